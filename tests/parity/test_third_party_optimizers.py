"""Third-party element-wise optimizers under ``assume_elementwise=True``, against the same
optimizer on one process over the full batch: their per-group scalars (schedule-free's ``k``,
``weight_sum``, ``lr_max``) advance as with plain torch and show up in ``param_groups`` and
``state_dict()``; a closure passed to ``step`` computes the loss and the grads once."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from lion_pytorch import Lion
from schedulefree import AdamWScheduleFree, SGDScheduleFree

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from tests.harness.dist_helper import run_ranks

STEPS = 5
BATCH = 8
OPTIMIZERS = {
    # schedule-free's warmup reads the group's step counter ``k``, which its step() advances
    "adamw_schedulefree": lambda params: AdamWScheduleFree(params, lr=0.02, warmup_steps=3),
    "sgd_schedulefree": lambda params: SGDScheduleFree(params, lr=0.05, warmup_steps=2, weight_decay=0.01),
    "lion": lambda params: Lion(params, lr=1e-3, weight_decay=0.1),
    # kept outside the defaults, as attributes (decoupled_wd, _init_lr)
    "lion_decoupled": lambda params: Lion(params, lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)


def _train(name: str, overlap: bool | None) -> dict[str, Any]:
    """Sharded over the group when ``overlap`` is not None, else plain torch on the full batch."""
    model = _model()
    optimizer = OPTIMIZERS[name](model.parameters())
    if hasattr(optimizer, "train"):
        optimizer.train()  # schedule-free's mode switch, on the wrapped optimizer's groups
    opt: torch.optim.Optimizer = optimizer
    rank, world_size = 0, 1
    if overlap is not None:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=0.0005))
        opt = ShardingStage1(
            optimizer, overlap=overlap, model=model, assume_elementwise=True, strategy=strategy
        )
    for step in range(STEPS):
        inputs, targets = _batch(step)
        rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)

        def closure(inputs=inputs[rows], targets=targets[rows]) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            return loss

        assert opt.step(closure) is not None  # the closure's loss
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = opt.state_dict()
    return {"params": [p.detach().clone() for p in model.parameters()], "groups": groups, "state": state}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_third_party_optimizer_matches_plain_torch(name: str, overlap: bool) -> None:
    expected = _train(name, None)
    for result in run_ranks(_train, 2, name, overlap):
        assert result["groups"] == expected["groups"]
        assert result["state"]["param_groups"] == expected["state"]["param_groups"]
        for got, want in zip(result["params"], expected["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert result["state"]["state"].keys() == expected["state"]["state"].keys()
        for index, want in expected["state"]["state"].items():
            got = result["state"]["state"][index]
            assert got.keys() == want.keys()
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
