"""Params frozen when wrapped and unfrozen before a backward whose grads all arrive before any
hook of theirs runs: every one of them is stepped, as in torch.

Frozen params get buckets of their own without a grad buffer; the first hook of the backward
re-reads ``requires_grad``, hooks the unfrozen params and gives their bucket its buffer, which
points every param of the bucket at its view. A grad that arrived before must still count as
received for each of them, not only for the first one hooked (the others lost theirs: their
presence flag said "no grad", so torch stepped them and the wrapper did not).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingStage1
from tests.dist_helper import run_ranks

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),  # element-wise layout
    "muon": lambda params: torch.optim.Muon(params, lr=2e-2),  # whole params per owner
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in ((6, 8), (8, 8), (8, 2))))


def _slice_loss(model: nn.Module, rank: int, world_size: int) -> torch.Tensor:
    batch = torch.randn(12, 6, generator=torch.Generator().manual_seed(1))
    return model(batch[rank::world_size]).square().mean()


def _unfreeze_and_step(name: str, overlap: bool) -> list[tuple[bool, bool]]:
    """Per param: (equal to plain torch, has optimizer state)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, plain_model = _model(), _model()
    for layer in (model[1], model[2]):  # later layers: their grads arrive first in backward
        layer.weight.requires_grad_(False)
    optimizer = ShardingStage1(OPTIMIZERS[name](list(model.parameters())), overlap=overlap)
    for param in model.parameters():
        param.requires_grad_(True)
    _slice_loss(model, rank, world_size).backward()
    optimizer.step()
    optimizer.sync_params()

    plain = OPTIMIZERS[name](list(plain_model.parameters()))
    grads = [torch.zeros_like(p) for p in plain_model.parameters()]
    for slice_rank in range(world_size):  # the reduction's order: rank by rank, then the mean
        plain_model.zero_grad()
        _slice_loss(plain_model, slice_rank, world_size).backward()
        grads = [total + p.grad for total, p in zip(grads, plain_model.parameters(), strict=True)]
    for param, total in zip(plain_model.parameters(), grads, strict=True):
        param.grad = total / world_size
    plain.step()
    state = optimizer.state_dict()["state"]
    return [
        (torch.equal(p, q), index in state)
        for index, (p, q) in enumerate(zip(model.parameters(), plain_model.parameters(), strict=True))
    ]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_param_unfrozen_before_its_hook_is_stepped(name: str, overlap: bool) -> None:
    for rank, per_param in enumerate(run_ranks(_unfreeze_and_step, 2, name, overlap)):
        assert per_param == [(True, True)] * 3, f"rank {rank}: (equal, has state) per param {per_param}"
