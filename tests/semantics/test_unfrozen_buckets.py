"""Params frozen when wrapped and unfrozen before a backward whose grads all arrive before any
hook of theirs runs: every one of them is stepped, as in torch.

Frozen params get buckets of their own without a grad buffer; the first hook of the backward
re-reads ``requires_grad``, hooks the unfrozen params and gives their bucket its buffer, which
points every param of the bucket at its view. A grad that arrived before must still count as
received for each of them, not only for the first one hooked (the others lost theirs: their
presence flag said "no grad", so torch stepped them and the wrapper did not).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from tests.harness.dist_helper import run_ranks

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


class _Gated(nn.Module):
    """A frozen-at-wrap ``Linear`` beside 64 scalar gates: the gates fill a bucket that stages
    its grads (Note [Staged grads] in ``fusion.layout``), so a backward runs no hook at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 2)
        self.gates = nn.ParameterList(nn.Parameter(torch.tensor(0.01 * i)) for i in range(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (1 + torch.stack(list(self.gates)).tanh().mean())


def _micro_loss(model: nn.Module, micro: int, rank: int, world_size: int) -> torch.Tensor:
    batch = torch.randn(12, 6, generator=torch.Generator().manual_seed(10 + micro))
    return model(batch[rank::world_size]).square().mean()


def _averaged_slice_grads(model: nn.Module, scenario, world_size: int) -> list[torch.Tensor | None]:
    """The scenario's grads of every rank's slice, summed in rank order then divided (what the
    reduction computes); None where no rank's run left a grad."""
    totals: list[torch.Tensor | None] = [None] * len(list(model.parameters()))
    for rank in range(world_size):
        model.zero_grad()
        scenario.backwards(model, rank, world_size, contextlib.nullcontext)
        for index, param in enumerate(model.parameters()):
            if param.grad is not None:
                base = totals[index] if totals[index] is not None else torch.zeros_like(param)
                totals[index] = base + param.grad
    return [None if total is None else total / world_size for total in totals]


class _UnfrozenBetweenBackwards:
    """The first layer frozen when wrapped and for the first micro-batch, unfrozen for the
    second: torch steps it with the second micro-batch's grads."""

    frozen_at_wrap = ("0",)

    @staticmethod
    def model() -> nn.Module:
        return _model()

    @staticmethod
    def backwards(model: nn.Module, rank: int, world_size: int, no_sync) -> None:
        model[0].requires_grad_(False)
        with no_sync():
            _micro_loss(model, 0, rank, world_size).backward()
        model[0].requires_grad_(True)
        _micro_loss(model, 1, rank, world_size).backward()

    @staticmethod
    def before_step(model: nn.Module) -> None:
        pass


class _RefrozenBeforeStepWithoutHooks:
    """The ``Linear`` frozen when wrapped, unfrozen for a backward in which no hook runs (the
    gates stage their grads), frozen again before ``step()``: torch steps it, its grad is
    there."""

    frozen_at_wrap = ("linear",)

    @staticmethod
    def model() -> nn.Module:
        return _Gated()

    @staticmethod
    def backwards(model: nn.Module, rank: int, world_size: int, no_sync) -> None:
        model.linear.requires_grad_(True)
        _micro_loss(model, 0, rank, world_size).backward()

    @staticmethod
    def before_step(model: nn.Module) -> None:
        model.linear.requires_grad_(False)


SCENARIOS = {
    "unfrozen_between_backwards": _UnfrozenBetweenBackwards,
    "refrozen_before_step_without_hooks": _RefrozenBeforeStepWithoutHooks,
}


def _scenario_against_torch(name: str, overlap: bool, attach: bool, no_sync: bool) -> list[bool]:
    """Per param: equal to plain torch after the scenario's step."""
    scenario = SCENARIOS[name]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, plain_model = scenario.model(), scenario.model()
    for layer in scenario.frozen_at_wrap:
        model.get_submodule(layer).requires_grad_(False)
    optimizer = ShardingStage1(
        torch.optim.SGD(list(model.parameters()), lr=0.1, momentum=0.9),
        overlap=overlap,
        model=model if attach else None,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.0005)),
    )
    scenario.backwards(model, rank, world_size, optimizer.no_sync if no_sync else contextlib.nullcontext)
    scenario.before_step(model)
    optimizer.step()
    optimizer.sync_params()

    plain = torch.optim.SGD(list(plain_model.parameters()), lr=0.1, momentum=0.9)
    averaged = _averaged_slice_grads(plain_model, scenario, world_size)
    scenario.before_step(plain_model)
    for param, grad in zip(plain_model.parameters(), averaged, strict=True):
        param.grad = grad
    plain.step()
    return [torch.equal(p, q) for p, q in zip(model.parameters(), plain_model.parameters(), strict=True)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    ("name", "attach", "no_sync"),
    [
        ("unfrozen_between_backwards", False, True),
        ("unfrozen_between_backwards", True, True),
        ("unfrozen_between_backwards", False, False),
        ("refrozen_before_step_without_hooks", False, False),
        ("refrozen_before_step_without_hooks", True, False),
    ],
)
def test_params_unfrozen_after_wrapping_step_as_torch(
    name: str, attach: bool, no_sync: bool, overlap: bool
) -> None:
    for rank, equal in enumerate(run_ranks(_scenario_against_torch, 2, name, overlap, attach, no_sync)):
        assert all(equal), f"rank {rank}: params equal to plain torch {equal}"


def _zero_grad_drops_unseen_grads(overlap: bool) -> list[bool]:
    """A grad that reached a frozen-at-wrap param in a backward no hook saw is dropped by
    ``zero_grad()`` as torch drops it: the next step steps only the gates, as torch does."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, plain_model = _Gated(), _Gated()
    model.linear.requires_grad_(False)
    config = ShardingConfig(bucket_size_mb=0.0005)
    optimizer = ShardingStage1(
        torch.optim.SGD(list(model.parameters()), lr=0.1), overlap=overlap, strategy=Strategy(sharding=config)
    )
    plain = torch.optim.SGD(list(plain_model.parameters()), lr=0.1)
    model.linear.requires_grad_(True)
    _micro_loss(model, 0, rank, world_size).backward()
    optimizer.zero_grad()
    plain.zero_grad()
    for each in (model, plain_model):
        each.linear.requires_grad_(False)
    _micro_loss(model, 1, rank, world_size).backward()
    optimizer.step()
    optimizer.sync_params()
    totals = [torch.zeros_like(p) for p in plain_model.parameters()]
    for slice_rank in range(world_size):
        plain_model.zero_grad()
        _micro_loss(plain_model, 1, slice_rank, world_size).backward()
        totals = [
            t if p.grad is None else t + p.grad for t, p in zip(totals, plain_model.parameters(), strict=True)
        ]
    for param, total in zip(plain_model.parameters(), totals, strict=True):
        param.grad = None if param.grad is None else total / world_size
    plain.step()
    return [torch.equal(p, q) for p, q in zip(model.parameters(), plain_model.parameters(), strict=True)]


@pytest.mark.parametrize("overlap", [False, True])
def test_zero_grad_drops_grads_of_params_without_a_grad_buffer(overlap: bool) -> None:
    for rank, equal in enumerate(run_ranks(_zero_grad_drops_unseen_grads, 2, overlap)):
        assert all(equal), f"rank {rank}: params equal to plain torch {equal}"
