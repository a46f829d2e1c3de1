"""``ShardingStage1Trainer`` trains as ``transformers.Trainer`` does on one process.

``TrainingArguments`` as users write them: Trainer's own optimizer (its default AdamW, decay
and no-decay groups) and linear schedule, ``gradient_accumulation_steps=2``, ``max_grad_norm``
(which clips here: the logged ``grad_norm`` is compared), ``save_steps=4``, and a second trainer
that resumes from ``checkpoint-4``; then a trainer given ``optimizers=(AdamW, scheduler)``. On 2
ranks (overlap) with the adapter and on one process with plain ``Trainer`` over the same global
batch (per-device batch 2 on 2 ranks, 4 on one; ``train_sampling_strategy="sequential"``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness.dist_helper import run_ranks
from tests.harness.integrations_common import (
    assert_close_run,
    params_of,
    quiet_rank,
    shared_folder,
    tiny_gpt2,
    token_ids,
)

GLOBAL_BATCH = 4
ACCUMULATION = 2
MAX_STEPS = 8
SAVE_STEPS = 4
RANK_TIMEOUT_S = 300.0


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = token_ids()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _arguments(output_dir: str, world_size: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,  # Accelerate runs CPU processes as one data-parallel job only when told so
        per_device_train_batch_size=GLOBAL_BATCH // world_size,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=MAX_STEPS,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_steps=SAVE_STEPS,
        train_sampling_strategy="sequential",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )


def _trainer(sharded: bool, output_dir: str, optimizers=None):
    from transformers import Trainer

    from sharded_opt.integrations.transformers import ShardingStage1Trainer

    world_size = torch.distributed.get_world_size()
    cls = ShardingStage1Trainer if sharded else Trainer
    model = tiny_gpt2()
    extra = {} if optimizers is None else {"optimizers": optimizers(model)}
    if sharded:
        extra["overlap"] = True  # the adapters default to sync, as the wrapper does
    return cls(model=model, args=_arguments(output_dir, world_size), train_dataset=_Tokens(), **extra)


def _history(trainer) -> dict:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "losses": [entry["loss"] for entry in logs],
        "norms": [entry["grad_norm"] for entry in logs],
        "lrs": [entry["learning_rate"] for entry in logs],
        "params": params_of(trainer.model),
        "model_type": type(trainer.model_wrapped).__name__,
        "num_processes": trainer.accelerator.num_processes,
    }


def _own_optimizer(model):
    """What users pass as ``optimizers=``: a plain AdamW and a schedule built on it."""
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    return optimizer, get_linear_schedule_with_warmup(optimizer, 0, MAX_STEPS)


def _train(sharded: bool) -> dict:
    quiet_rank()
    with shared_folder() as folder:
        full = _trainer(sharded, os.path.join(folder, "full"))
        full.train()
        result = _history(full)
        resumed = _trainer(sharded, os.path.join(folder, "resumed"))
        resumed.train(resume_from_checkpoint=os.path.join(folder, "full", f"checkpoint-{SAVE_STEPS}"))
        result["resumed"] = _history(resumed)
        # optimizer.pt holds torch's own format: a plain AdamW over the model loads it.
        saved = torch.load(os.path.join(folder, "full", f"checkpoint-{SAVE_STEPS}", "optimizer.pt"))
        own = _trainer(sharded, os.path.join(folder, "own"), optimizers=_own_optimizer)
        own.train()
        result["own"] = _history(own)
    plain = torch.optim.AdamW(tiny_gpt2().parameters())
    plain.load_state_dict({"state": saved["state"], "param_groups": _one_group(saved["param_groups"])})
    return result


def _one_group(groups: list[dict]) -> list[dict]:
    """Trainer's two groups as the single group of a plain AdamW over model.parameters()."""
    return [{**groups[0], "params": sorted(i for group in groups for i in group["params"])}]


def test_trainer_matches_one_process_run() -> None:
    plain = run_ranks(_train, 1, False, timeout_s=RANK_TIMEOUT_S)[0]
    sharded = run_ranks(_train, 2, True, timeout_s=RANK_TIMEOUT_S)
    for rank_result in sharded:
        assert rank_result["num_processes"] == 2
        assert rank_result["model_type"] == "GPT2LMHeadModel"  # never DistributedDataParallel
        assert rank_result["lrs"] == plain["lrs"]
        assert len(rank_result["losses"]) == MAX_STEPS
        assert_close_run(rank_result, plain)
        assert_close_run(rank_result["own"], plain["own"])
        # Resuming from checkpoint-4 continues exactly (same ranks, same layout: bitwise).
        resumed = rank_result["resumed"]  # its log history starts with checkpoint-4's
        assert resumed["losses"] == rank_result["losses"]
        assert resumed["norms"] == rank_result["norms"]
        for name, value in rank_result["params"].items():
            assert torch.equal(resumed["params"][name], value), name


LOWBIT_WIDTH = 64
"""A GPT-2 width at which torchao quantizes: the MLP's weights (16384 elements) are cut on their
blocks, attention's ``c_attn`` (12288) is cut or kept whole, its ``c_proj`` (4096) kept whole."""


def _train_lowbit(sharded: bool) -> dict:
    """``TrainingArguments(optim="adamw_torch_8bit")``: transformers builds torchao's AdamW8bit
    (decay and no-decay groups); the adapter wraps it like any optimizer. Without clipping: the
    global norm is summed in another order than DDP's clip, and its last bit would move codes."""
    from transformers import Trainer, TrainingArguments

    from sharded_opt.integrations.transformers import ShardingStage1Trainer

    quiet_rank()
    with shared_folder() as folder:
        arguments = TrainingArguments(
            output_dir=folder,
            use_cpu=True,
            per_device_train_batch_size=GLOBAL_BATCH // torch.distributed.get_world_size(),
            gradient_accumulation_steps=ACCUMULATION,
            max_steps=4,
            learning_rate=1e-3,
            optim="adamw_torch_8bit",
            max_grad_norm=0.0,
            logging_steps=1,
            save_strategy="no",
            train_sampling_strategy="sequential",
            report_to=[],
            seed=0,
            disable_tqdm=True,
        )
        cls = ShardingStage1Trainer if sharded else Trainer
        trainer = cls(model=tiny_gpt2(LOWBIT_WIDTH), args=arguments, train_dataset=_Tokens())
        trainer.train()
    optimizer = trainer.optimizer.optimizer  # inside Accelerate's wrapper
    state = optimizer.state_dict()["state"]  # collective with the adapter: every rank calls it
    return {
        **_history(trainer),
        "optimizer": type(optimizer.shards.inner if sharded else optimizer).__name__,
        "wrapped": type(optimizer).__name__,
        "quantized": sorted({type(v).__name__ for s in state.values() for v in s.values()} - {"Tensor"}),
    }


@pytest.mark.timeout(900)  # torchao compiles its step per shape: tens of seconds each, once per process
def test_trainer_optim_name_for_torchao_8bit_equals_ddp() -> None:
    """On 2 ranks against plain Trainer with DDP on the same 2 ranks: the same optimizer class
    from the same ``optim`` name, quantized state, losses and params bitwise equal."""
    pytest.importorskip("torchao.optim")
    ddp = run_ranks(_train_lowbit, 2, False, timeout_s=RANK_TIMEOUT_S)
    sharded = run_ranks(_train_lowbit, 2, True, timeout_s=RANK_TIMEOUT_S)
    for plain, result in zip(ddp, sharded, strict=True):
        assert plain["model_type"] == "DistributedDataParallel" and result["model_type"] == "GPT2LMHeadModel"
        assert (plain["wrapped"], result["wrapped"]) == ("AdamW8bit", "ShardingStage1")
        assert plain["optimizer"] == result["optimizer"] == "AdamW8bit"
        assert plain["quantized"] == result["quantized"] == ["OptimState8bit"]
        assert result["losses"] == plain["losses"]
        for name, value in plain["params"].items():
            assert torch.equal(result["params"][name], value), name
