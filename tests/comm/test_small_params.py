"""Models of many small params: the per-param work in backward stays one Python call per hook
(two in overlap mode), a bucket of small params only makes none (it stages its grads, Note
[Staged grads] in ``fusion.layout``), and small params take their own size in the flat buffers.

Call counts, not times: a test never asserts wall-clock time, and the number of Python-level
calls per backward is what the hook's cost scales with (see Note [Hook cost] in
``sharded_opt.step.grad_hooks``).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

from fusion.layout import DEFAULT_ALIGN_BYTES
from sharded_opt import ShardingStage1
from tests.harness.dist_helper import run_ranks

NUM_SCALARS = 500
WORLD_SIZE = 2
PER_BACKWARD_CALLS = 150
"""Python calls a backward may make beyond the per-hook ones: the first hook's scan, the bucket
launches and the grad presence share at the end of backward, once each."""


class Scalars(nn.Module):
    """``NUM_SCALARS`` 0-dim params next to one weight of a few aligned blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.values = nn.ParameterList(nn.Parameter(torch.tensor(float(i % 5))) for i in range(NUM_SCALARS))
        self.weight = nn.Parameter(torch.ones(200))

    def forward(self) -> torch.Tensor:
        return torch.stack(list(self.values)).square().sum() + self.weight.square().sum()


class OnlyScalars(nn.Module):
    """``NUM_SCALARS`` 0-dim params and nothing else: their bucket stages its grads."""

    def __init__(self) -> None:
        super().__init__()
        self.values = nn.ParameterList(nn.Parameter(torch.tensor(float(i % 5))) for i in range(NUM_SCALARS))

    def forward(self) -> torch.Tensor:
        return torch.stack(list(self.values)).square().sum()


def _python_calls_in_backward(overlap: bool, model_class: type[nn.Module] = Scalars) -> int:
    model = model_class()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters(), lr=1e-2), overlap=overlap, model=model)
    for _ in range(2):  # the second backward is the steady state that is counted
        opt.zero_grad()
        loss = model()
        calls = 0

        def count(frame, event, arg):
            nonlocal calls
            calls += event == "call"

        sys.setprofile(count)
        try:
            loss.backward()
        finally:
            sys.setprofile(None)
        opt.step()
    return calls


def _buffer_bytes() -> dict[str, int]:
    model = Scalars()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters(), lr=1e-2))
    memory = opt.memory_bytes()
    return {"params": memory["params"], "grads": memory["grads"]}


def _staged_grads_after_backward(overlap: bool) -> dict[str, object]:
    """Where an only-scalars model's grads live around one iteration."""
    model = OnlyScalars()
    opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap, model=model)
    params = list(model.parameters())
    (model() * (1 + torch.distributed.get_rank())).backward()
    grads = [p.grad for p in params]
    before_step = {
        "staged": [bucket.staged_grads for bucket in opt.shards.plan.buckets],
        "hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in params),
        "grads_are_own_tensors": all(g is not None and g._base is None for g in grads),
    }
    expected = [p.detach() - 0.1 * 2 * p.detach() * 1.5 for p in params]  # ranks' grads 2p and 4p
    opt.step()
    opt.zero_grad()
    return {
        **before_step,
        "stepped_on_the_average": all(map(torch.equal, [p.detach() for p in params], expected)),
        "none_after_zero_grad": all(p.grad is None for p in params),
    }


def _run_jobs() -> dict[str, object]:
    return {
        "calls-sync": _python_calls_in_backward(False),
        "calls-overlap": _python_calls_in_backward(True),
        "calls-staged-sync": _python_calls_in_backward(False, OnlyScalars),
        "calls-staged-overlap": _python_calls_in_backward(True, OnlyScalars),
        "staged-sync": _staged_grads_after_backward(False),
        "staged-overlap": _staged_grads_after_backward(True),
        "bytes": _buffer_bytes(),
    }


@pytest.fixture(scope="module")
def on_two_ranks() -> list[dict[str, object]]:
    """Every job of this file in one 2-rank run (starting ranks costs seconds)."""
    return run_ranks(_run_jobs, WORLD_SIZE)


@pytest.mark.parametrize(("mode", "calls_per_hook"), [("sync", 1), ("overlap", 2)])
def test_one_python_call_per_hook(on_two_ranks, mode, calls_per_hook):
    num_params = NUM_SCALARS + 1
    for rank_results in on_two_ranks:
        calls = rank_results[f"calls-{mode}"]
        assert calls >= num_params  # every param's hook ran
        assert calls <= calls_per_hook * num_params + PER_BACKWARD_CALLS, (
            f"{calls} Python calls in one backward with {num_params} grad hooks"
        )


def test_small_params_take_their_own_size(on_two_ranks):
    # fp32, one bucket: the weight (200 elements, registered last) at 0, then the 500 scalars
    # packed densely from 200; 700 used elements padded to a multiple of world_size * 64 (with
    # a 64-element slot per scalar it was 200 + 500 * 64 before padding).
    align = DEFAULT_ALIGN_BYTES // 4
    expected = math.ceil((200 + NUM_SCALARS) / (WORLD_SIZE * align)) * WORLD_SIZE * align * 4
    for rank_results in on_two_ranks:
        assert rank_results["bytes"] == {"params": expected, "grads": expected}


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_bucket_of_small_params_only_makes_no_call_per_param(on_two_ranks, mode):
    for rank_results in on_two_ranks:
        calls = rank_results[f"calls-staged-{mode}"]
        assert calls <= PER_BACKWARD_CALLS, f"{calls} Python calls in one backward of {NUM_SCALARS} scalars"


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_staged_grads_are_autograds_own_and_averaged_at_step(on_two_ranks, mode):
    for rank_results in on_two_ranks:
        staged = rank_results[f"staged-{mode}"]
        assert staged["staged"] == [True]
        assert staged["hooks"] == 0
        assert staged["grads_are_own_tensors"]
        assert staged["stepped_on_the_average"]
        assert staged["none_after_zero_grad"]
