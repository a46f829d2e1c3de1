"""Documented behaviour after failures that are not the wrapper's: a backward that raised
midway, non-finite grads, and damaged or foreign checkpoint files."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, load_checkpoint, save_checkpoint
from tests.harness.dist_helper import run_ranks
from tests.harness.training import GLOBAL_BATCH, make_model


def _wrapped(overlap: bool = True):
    model = make_model()
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        overlap=overlap,
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.001)),
    )
    return model, optimizer


class _FailingBackward(torch.autograd.Function):
    """Identity in forward; raises in backward, after later layers' buckets were launched."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("injected backward failure")


def _step_after_failed_backward() -> dict:
    model, optimizer = _wrapped()
    inputs = torch.randn(GLOBAL_BATCH // 2, 12)
    hidden = _FailingBackward.apply(torch.relu(model.fc1(inputs)))
    loss = model.head(torch.tanh(model.fc2(hidden))).sum()
    with contextlib.suppress(ValueError):
        loss.backward()
    launched = [b.index for b in optimizer.shards.buckets if b.grad_sync_pending]
    try:
        optimizer.step()
        refused = "stepped"
    except RuntimeError as error:
        refused = str(error)
    optimizer.zero_grad()  # discards the partial grads and finishes the pending reductions
    model(inputs).sum().backward()
    optimizer.step()  # the next iteration works normally
    optimizer.sync_params()
    pending = [b.index for b in optimizer.shards.buckets if b.grad_sync_pending]
    return {"launched": launched, "refused": refused, "pending": pending}


def test_step_after_a_backward_that_raised_midway_is_refused_then_recovers() -> None:
    for result in run_ranks(_step_after_failed_backward, 2):
        assert result["launched"], "the test needs reductions in flight when backward raised"
        assert "last backward raised before it finished" in result["refused"], result["refused"]
        assert "opt.zero_grad()" in result["refused"]
        assert result["pending"] == []


def _train_with_inf_on_one_rank(overlap: bool) -> list[torch.Tensor]:
    model, optimizer = _wrapped(overlap)
    for step in range(3):
        inputs = torch.randn(GLOBAL_BATCH // 2, 12, generator=torch.Generator().manual_seed(step))
        if step == 1 and dist.get_rank() == 1:
            inputs[0, 0] = float("inf")
        optimizer.zero_grad()
        model(inputs).sum().backward()
        optimizer.step()
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]


def test_non_finite_grads_reach_every_rank_alike() -> None:
    """Documented behaviour: no silent skip. A non-finite grad on one rank is averaged into the
    shard that holds it, stepped there and all-gathered, so every rank ends with the same
    (non-finite) params, in sync and overlap mode alike. Use clip_grad_norm_ or
    ShardedGradScaler to detect or skip such steps."""
    for overlap in (False, True):
        first, second = run_ranks(_train_with_inf_on_one_rank, 2, overlap)
        assert any(not torch.isfinite(p).all() for p in first)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
            assert torch.equal(a.isnan(), b.isnan())


def _load_damaged(folder: str) -> dict[str, str]:
    model, optimizer = _wrapped(overlap=False)
    outcomes = {}
    for name in ("truncated", "foreign"):
        try:
            load_checkpoint(Path(folder, name), model, optimizer)
            outcomes[name] = "loaded"
        except ValueError as error:
            outcomes[name] = str(error)
    return outcomes


def _save_good_and_foreign(folder: str) -> None:
    model, optimizer = _wrapped(overlap=False)
    optimizer.zero_grad()
    model(torch.randn(GLOBAL_BATCH // 2, 12)).sum().backward()
    optimizer.step()
    save_checkpoint(Path(folder, "truncated"), model, optimizer)
    other = torch.nn.Linear(3, 3)
    save_checkpoint(
        Path(folder, "foreign"), other, ShardingStage1(torch.optim.SGD(other.parameters(), lr=0.1))
    )


def test_truncated_or_foreign_checkpoint_is_refused(tmp_path: Path) -> None:
    run_ranks(_save_good_and_foreign, 2, str(tmp_path))
    shard = sorted((tmp_path / "truncated").resolve().glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    for outcome in run_ranks(_load_damaged, 2, str(tmp_path)):
        assert "could not be read (damaged files" in outcome["truncated"], outcome
        assert "holds 2 optimizer params but this optimizer has 8" in outcome["foreign"], outcome
