"""``ShardingStage1Accelerator`` trains as ``Accelerator`` does on one process.

A user's Accelerate loop, unchanged but for the class: ``prepare(model, optimizer, dataloader,
scheduler)``, ``accumulate(model)`` over 2 micro-batches, ``backward``, ``clip_grad_norm_`` (whose
return value is logged), a scheduler, ``save_state`` after the first epoch and a second run that
``load_state``s it and trains the second epoch. On 2 ranks (overlap) with the adapter and on one
process with plain ``Accelerator`` and AdamW over the same global batch (``split_batches=True``:
each batch of the loader is split over the ranks, so both runs step alike and the prepared
scheduler steps once per optimizer step in both).
"""

from __future__ import annotations

import os

import torch

from tests.harness.dist_helper import run_ranks
from tests.harness.integrations_common import (
    assert_close_run,
    decay_groups,
    params_of,
    quiet_rank,
    shared_folder,
    tiny_gpt2,
    token_ids,
)

GLOBAL_BATCH = 4
ACCUMULATION = 2
MAX_NORM = 0.5
RANK_TIMEOUT_S = 300.0


def _run(sharded: bool, epochs: range, save_to: str | None, load_from: str | None) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from sharded_opt.integrations.accelerate import ShardingStage1Accelerator, sharded_optimizer

    kwargs = {
        "cpu": True,  # Accelerate runs CPU processes as one data-parallel job only when told so
        "gradient_accumulation_steps": ACCUMULATION,
        "dataloader_config": DataLoaderConfiguration(split_batches=True),
    }
    accelerator = ShardingStage1Accelerator(overlap=True, **kwargs) if sharded else Accelerator(**kwargs)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(decay_groups(model), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 10)
    loader = torch.utils.data.DataLoader(token_ids(), batch_size=GLOBAL_BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if load_from is not None:
        accelerator.load_state(load_from)
    result: dict = {
        "losses": [],
        "norms": [],
        "lrs": [],
        "model_type": type(model).__name__,
        "num_processes": accelerator.num_processes,
    }
    for epoch in epochs:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    result["norms"].append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
                    result["lrs"].append(scheduler.get_last_lr()[0])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            result["losses"].append(accelerator.reduce(loss.detach(), "mean").item())
        if save_to is not None and epoch == 0:
            accelerator.save_state(save_to)
    result["params"] = params_of(accelerator.unwrap_model(model))
    inner = sharded_optimizer(optimizer)
    result["state_bytes"] = None if inner is None else inner.optimizer_state_bytes()
    return result


def _train(sharded: bool) -> dict:
    quiet_rank()
    with shared_folder() as folder:
        full = _run(sharded, range(2), save_to=os.path.join(folder, "epoch0"), load_from=None)
        resumed = _run(sharded, range(1), save_to=None, load_from=os.path.join(folder, "epoch0"))
        # save_state wrote torch's own optimizer format: a plain AdamW loads it.
        saved = torch.load(os.path.join(folder, "epoch0", "optimizer.bin"), weights_only=True)
    plain = torch.optim.AdamW(decay_groups(tiny_gpt2()), lr=1e-2)
    plain.load_state_dict(saved)
    full["resumed_params"] = resumed["params"]
    full["resumed_losses"] = resumed["losses"]
    return full


def test_accelerator_matches_one_process_run() -> None:
    plain = run_ranks(_train, 1, False, timeout_s=RANK_TIMEOUT_S)[0]
    sharded = run_ranks(_train, 2, True, timeout_s=RANK_TIMEOUT_S)
    for rank_result in sharded:
        assert rank_result["num_processes"] == 2
        assert rank_result["model_type"] == "GPT2LMHeadModel"  # never DistributedDataParallel
        assert rank_result["lrs"] == plain["lrs"]  # the prepared scheduler steps as on one process
        assert_close_run(rank_result, plain)
        # Resuming from save_state continues exactly (same ranks, same layout: bitwise).
        assert rank_result["resumed_losses"] == rank_result["losses"][len(rank_result["resumed_losses"]) :]
        for name, value in rank_result["params"].items():
            assert torch.equal(rank_result["resumed_params"][name], value), name
    # ZeRO-1: each of 2 ranks holds about half of AdamW's two moments (padding aside).
    total_state = sum(rank_result["state_bytes"] for rank_result in sharded)
    assert total_state >= 8 * sum(p.numel() for p in plain["params"].values())
    assert max(rank_result["state_bytes"] for rank_result in sharded) < 0.6 * total_state
