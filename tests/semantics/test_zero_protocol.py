"""What frameworks that save on one rank call: torch ``ZeroRedundancyOptimizer``'s
``consolidate_state_dict(to=...)`` on every rank, then ``state_dict()`` on that rank alone; and
``grad_norm()``, the global norm for logging without clipping. One 2-rank job."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sharded_opt import ShardingStage1
from tests.harness.dist_helper import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _backward(model: torch.nn.Module, rows: slice) -> None:
    data = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    model(data[rows]).square().mean().backward()


def _protocol_job() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plain = _model()
    _backward(plain, slice(None))
    plain_norm = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])

    model = _model()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters(), lr=0.1), overlap=True, model=model)
    per_rank = 8 // world_size
    _backward(model, slice(rank * per_rank, (rank + 1) * per_rank))
    norm = opt.grad_norm()
    clipped_norm = opt.clip_grad_norm_(0.1)
    opt.step()
    collective = opt.state_dict()
    opt.consolidate_state_dict(to=1)
    errors = []
    if rank == 1:
        consolidated = opt.state_dict()
        same = all(
            torch.equal(consolidated["state"][i][key], value)
            for i, entry in collective["state"].items()
            for key, value in entry.items()
        )
        same = same and consolidated["param_groups"] == collective["param_groups"]
    else:
        same = None
        with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=1\) gathered the state"):
            opt.state_dict()
        errors.append("raised")
    opt.zero_grad()
    _backward(model, slice(rank * per_rank, (rank + 1) * per_rank))
    opt.step()
    after_step = opt.state_dict(to_rank=0)  # collective again once the optimizer stepped
    return {
        "norm": norm.item(),
        "clipped_norm": clipped_norm.item(),
        "plain_norm": plain_norm.item(),
        "same": same,
        "errors": errors,
        "after_step_steps": None if after_step is None else after_step["state"][0]["step"].item(),
    }


def test_consolidate_then_state_dict_on_one_rank_and_grad_norm() -> None:
    rank0, rank1 = run_ranks(_protocol_job, 2)
    assert rank1["same"] is True
    assert rank0["errors"] == ["raised"]
    assert rank0["after_step_steps"] == 2.0 and rank1["after_step_steps"] is None
    for result in (rank0, rank1):
        assert result["norm"] == result["clipped_norm"]  # reading the norm changes nothing
        assert result["norm"] == pytest.approx(result["plain_norm"], rel=1e-6)


def test_consolidate_state_dict_refuses_a_rank_outside_the_group(single_rank_group) -> None:
    model = _model()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters()), model=model)
    with pytest.raises(ValueError, match=r"consolidate_state_dict expects to in \[0, 1\) but got 1"):
        opt.consolidate_state_dict(to=1)
    opt.consolidate_state_dict(to=0)
    assert opt.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]
