"""Grads edited in place after backward (torch's clip, the stock GradScaler, ``p.grad.mul_``)
must fail at ``step()`` with an error naming the sharded replacements, never clip by a local
norm or race with an in-flight reduction. See Note [Grads written after backward]."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardedGradScaler, ShardingConfig, ShardingStage1, Strategy
from tests.harness.dist_helper import run_ranks

STRATEGY = Strategy(sharding=ShardingConfig(bucket_size_mb=0.0005))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _edit_after_backward(habit: str, overlap: bool) -> str:
    rank = dist.get_rank()
    model = _model()
    opt = ShardingStage1(
        torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap, strategy=STRATEGY, model=model
    )
    inputs = torch.randn(6, 6, generator=torch.Generator().manual_seed(rank)) * (1 + 5 * rank)
    loss = model(inputs).square().mean()
    if habit == "scaler_then_torch_clip":
        scaler = ShardedGradScaler("cpu")
    elif habit == "stock_scaler":
        scaler = torch.amp.GradScaler("cpu")
    else:
        scaler = None
    (loss if scaler is None else scaler.scale(loss)).backward()
    try:
        if habit == "torch_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
        elif habit == "grad_mul":
            for param in model.parameters():
                param.grad.mul_(0.5)
            opt.step()
        elif habit == "scaler_then_torch_clip":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
        elif habit == "stock_scaler":
            scaler.step(opt)
        elif habit == "sharded_clip":
            opt.clip_grad_norm_(0.1)
            opt.step()
        return "stepped"
    except RuntimeError as error:
        opt.zero_grad()
        return str(error)


HABITS = ["torch_clip", "grad_mul", "scaler_then_torch_clip", "stock_scaler", "sharded_clip"]


def _run_all() -> dict:
    results: dict = {}
    for overlap in (False, True):
        for habit in HABITS:
            results[(habit, overlap)] = _edit_after_backward(habit, overlap)
        results[("assign_and_zero", overlap)] = _assign_and_zero(overlap)
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict:
    """Every habit of this file in one 2-rank job; maps (habit, overlap) to per-rank results."""
    per_rank = run_ranks(_run_all, 2)
    return {key: [results[key] for results in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("habit", HABITS[:-1])
def test_grads_edited_after_backward_are_refused_at_step(outcomes, habit: str, overlap: bool) -> None:
    for message in outcomes[(habit, overlap)]:
        if habit == "stock_scaler":  # its unscale does not move version counters; it is named
            assert "driven by a stock torch.amp.GradScaler" in message, message
        else:
            assert "modified in place after backward" in message, message
            assert "opt.clip_grad_norm_" in message
        assert "ShardedGradScaler" in message


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_sharded_clip_is_the_way(outcomes, overlap: bool) -> None:
    assert outcomes[("sharded_clip", overlap)] == ["stepped", "stepped"]


def _assign_and_zero(overlap: bool) -> list[torch.Tensor] | str:
    """Replacing a grad (``p.grad = g``) is adopted; dropping grads after backward
    (``model.zero_grad()``) means no grad in sync mode, as in torch, and is refused in overlap
    mode, where the grads were already being reduced."""
    model = _model()
    opt = ShardingStage1(
        torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap, strategy=STRATEGY, model=model
    )
    model(torch.randn(4, 6)).sum().backward()
    model.zero_grad()
    try:
        opt.step()
    except RuntimeError as error:
        return str(error)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    opt.step()
    opt.sync_params()
    return [p.detach().clone() for p in model.parameters()]


def test_assigning_or_dropping_grads_after_backward(outcomes) -> None:
    initial = [p.detach() for p in _model().parameters()]
    for params in outcomes[("assign_and_zero", False)]:
        torch.testing.assert_close(params[0], initial[0] - 0.1)
        for got, expected in zip(params[1:], initial[1:], strict=True):
            assert torch.equal(got, expected)
    for message in outcomes[("assign_and_zero", True)]:
        assert "were set to None after backward" in message
