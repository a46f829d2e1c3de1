"""``ShardingStage1Strategy`` trains as Lightning does on one process.

A LightningModule over a tiny GPT-2 whose ``configure_optimizers`` returns a plain AdamW (decay
and no-decay groups) and a per-step scheduler, trained with ``accumulate_grad_batches=2``,
``gradient_clip_val`` (norm), epoch-end checkpoints, and a second fit from the first epoch's
checkpoint (``fit(ckpt_path=...)``). The global grad norm is read in
``on_before_optimizer_step`` (``opt.grad_norm()``; torch's ``get_total_norm`` on one process).
On 2 ranks with ``ShardingStage1Strategy(overlap=True)`` and on one process with Lightning's
default strategy over the same global batch: Lightning's default training sampler shuffles, so
``use_distributed_sampler=False`` and each rank's loader holds its half of every global batch,
in order.
"""

from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist

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
EPOCHS = 2
RANK_TIMEOUT_S = 300.0


def _module():
    import lightning.pytorch as pl

    class TinyGPT2(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()
            self.losses: list[float] = []
            self.norms: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            if hasattr(optimizer, "grad_norm"):
                self.norms.append(optimizer.grad_norm().item())
            else:
                grads = [p.grad for p in self.parameters() if p.grad is not None]
                self.norms.append(torch.nn.utils.get_total_norm(grads).item())

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(decay_groups(self.model), lr=1e-2)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 10)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return TinyGPT2()


def _loader() -> torch.utils.data.DataLoader:
    """This rank's half of every global batch, in order."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    per_rank = GLOBAL_BATCH // world_size
    ids = token_ids()
    halves = ids.view(-1, GLOBAL_BATCH, ids.shape[-1])[:, rank * per_rank : (rank + 1) * per_rank]
    return torch.utils.data.DataLoader(halves.reshape(-1, ids.shape[-1]), batch_size=per_rank)


def _fit(sharded: bool, folder: str, ckpt_path: str | None):
    import lightning.pytorch as pl

    from sharded_opt.integrations.lightning import ShardingStage1Strategy

    module = _module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=ShardingStage1Strategy(overlap=True) if sharded else "auto",
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATION,
        gradient_clip_val=MAX_NORM,
        use_distributed_sampler=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return trainer, module


def _losses_of_all_ranks(module) -> list[float]:
    """The global batch's loss per micro-batch: the mean of the ranks' (equal-size) halves."""
    losses = torch.tensor(module.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist()


def _train(sharded: bool) -> dict:
    quiet_rank()
    with shared_folder() as folder:
        trainer, module = _fit(sharded, os.path.join(folder, "full"), None)
        first_epoch = sorted(glob.glob(os.path.join(folder, "full", "epoch=0-*.ckpt")))[0]
        _, resumed = _fit(sharded, os.path.join(folder, "resumed"), first_epoch)
        # The checkpoint holds torch's own optimizer format: a plain AdamW loads it.
        saved = torch.load(first_epoch, weights_only=False)["optimizer_states"][0]
    torch.optim.AdamW(decay_groups(tiny_gpt2())).load_state_dict(saved)
    return {
        "losses": _losses_of_all_ranks(module),
        "norms": module.norms,
        "params": params_of(module),
        "model_type": type(trainer.strategy.model).__name__,
        "strategy": type(trainer.strategy).__name__,
        "resumed_losses": _losses_of_all_ranks(resumed),
        "resumed_params": params_of(resumed),
    }


def test_strategy_matches_one_process_run() -> None:
    plain = run_ranks(_train, 1, False, timeout_s=RANK_TIMEOUT_S)[0]
    sharded = run_ranks(_train, 2, True, timeout_s=RANK_TIMEOUT_S)
    for rank_result in sharded:
        assert rank_result["strategy"] == "ShardingStage1Strategy"
        assert rank_result["model_type"] == "TinyGPT2"  # never DistributedDataParallel
        assert_close_run(rank_result, plain)
        # fit(ckpt_path=first epoch) trains the second epoch exactly as the uninterrupted run.
        assert len(rank_result["resumed_losses"]) == len(rank_result["losses"]) // EPOCHS
        assert rank_result["resumed_losses"] == rank_result["losses"][len(rank_result["resumed_losses"]) :]
        for name, value in rank_result["params"].items():
            assert torch.equal(rank_result["resumed_params"][name], value), name
