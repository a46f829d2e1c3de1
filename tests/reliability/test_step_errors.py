"""A wrapped optimizer's ``step`` that raises on some ranks only: every rank raises at once
instead of waiting in the all-gathers until the collective timeout (Note [A step that raises on
some ranks] in ``step_pipeline``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from tests.harness.dist_helper import run_ranks

# A rank left waiting in a collective would fail after this, with gloo's timeout message, not
# with the errors the test expects.
SHORT_TIMEOUT_S = 20.0


class _RaisesOnRankOne(torch.optim.SGD):
    """A third-party element-wise class whose step fails on one rank's data."""

    def step(self, closure=None):  # type: ignore[override]
        if dist.get_rank() == 1:
            raise ValueError("bad shard on rank 1")
        return super().step(closure)


def _step_errors(optimizer_name: str, overlap: bool) -> tuple[str, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    params = list(model.parameters())
    extra = {}
    if optimizer_name == "adafactor":
        # torch's Adafactor divides by a zero-element param's size: only its owner raises.
        params.append(nn.Parameter(torch.zeros(0)))
        inner = torch.optim.Adafactor(params, lr=1e-2)
    else:
        inner = _RaisesOnRankOne(params, lr=0.1)
        extra["assume_elementwise"] = True
    strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=0.0002))
    optimizer = ShardingStage1(inner, overlap=overlap, model=model, strategy=strategy, **extra)
    loss = model(torch.randn(4, 6)).sum() + params[-1].sum()
    loss.backward()
    with pytest.raises(Exception) as error:
        optimizer.step()
    return type(error.value).__name__, str(error.value)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("optimizer_name", ["adafactor", "raises_on_rank_one"])
def test_a_step_raising_on_one_rank_raises_on_every_rank(optimizer_name: str, overlap: bool) -> None:
    errors = run_ranks(_step_errors, 2, optimizer_name, overlap, timeout_s=SHORT_TIMEOUT_S)
    own = {"adafactor": "ZeroDivisionError", "raises_on_rank_one": "ValueError"}[optimizer_name]
    raised = [rank for rank, (kind, _) in enumerate(errors) if kind == own]
    assert len(raised) == 1, errors
    other = 1 - raised[0]
    kind, message = errors[other]
    assert kind == "RuntimeError", errors
    assert f"the wrapped optimizer's step raised on rank(s) [{raised[0]}]" in message
