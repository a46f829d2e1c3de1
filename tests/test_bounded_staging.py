"""Bounded memory and waits of the reduction and all-gather on CPU gloo ranks: casts of grads to
``reduce_dtype`` share two staging buffers (Note [Bounded staging] in ``bucket_comm``), and
``wait_for_params`` is ``sync_params`` on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, collectives
from tests.dist_helper import run_ranks


def _bf16_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def _train_recording_casts(overlap: bool) -> dict:
    model = _bf16_model()
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        overlap=overlap,
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=1e-3, master_dtype=torch.float32)),
    )
    casts: list[tuple[int, int]] = []
    original = collectives.reduce_scatter_avg

    def recording(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
        if input.dtype == torch.float32:  # a cast of bf16 grads, not a grad buffer
            casts.append((input.untyped_storage().data_ptr(), input.numel() * input.element_size()))
        return original(output, input, group, async_op)

    collectives.reduce_scatter_avg = recording
    try:
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            optimizer.zero_grad()
            model(
                torch.randn(4, 16, generator=generator).to(torch.bfloat16)
            ).float().square().mean().backward()
            optimizer.step()
        optimizer.sync_params()
    finally:
        collectives.reduce_scatter_avg = original
    return {
        "num_buckets": len(optimizer.plan.buckets),
        "largest_bucket_fp32_bytes": max(bucket.padded_numel for bucket in optimizer.plan.buckets) * 4,
        "casts": casts,
        "staging_bytes": optimizer.memory_bytes()["staging"],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _all_checks() -> dict:
    return {
        "staging": [_train_recording_casts(overlap) for overlap in (False, True)],
        "wait_for_params": _wait_for_params(),
    }


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    """One spawn for the whole module: starting ranks costs more than the checks."""
    return run_ranks(_all_checks, 2)


def test_casts_share_two_buffers_of_the_largest_bucket_and_results_are_unchanged(
    per_rank: list[dict],
) -> None:
    for sync, overlap in (rank["staging"] for rank in per_rank):
        for run in (sync, overlap):
            assert run["num_buckets"] >= 5
            assert len(run["casts"]) == 3 * run["num_buckets"]
            assert len({pointer for pointer, _ in run["casts"]}) == 2
            assert max(nbytes for _, nbytes in run["casts"]) == run["largest_bucket_fp32_bytes"]
            assert run["staging_bytes"] == 2 * run["largest_bucket_fp32_bytes"]
        for a, b in zip(sync["params"], overlap["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(per_rank[0]["staging"][1]["params"], per_rank[1]["staging"][1]["params"], strict=True):
        assert torch.equal(a, b)


def _wait_for_params() -> dict:
    model = _bf16_model().float()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, model=model)
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    pending_after_step = optimizer._comm.pending_param_buckets()
    optimizer.wait_for_params(torch.Stream(device="cpu"))
    pending_after_wait = optimizer._comm.pending_param_buckets()
    errors = []
    for stream in ("cuda", torch.Stream(device="meta")):
        with pytest.raises((TypeError, ValueError)) as raised:
            optimizer.wait_for_params(stream)
        errors.append(f"{raised.type.__name__}: {raised.value}")
    optimizer.step()
    with torch.no_grad():
        model[0].weight.zero_()  # written while its all-gather may still run
    with pytest.raises(RuntimeError) as raised:
        optimizer.wait_for_params()
    errors.append(str(raised.value))
    return {"pending": (pending_after_step, pending_after_wait), "errors": errors}


def test_wait_for_params_on_cpu_is_sync_params_and_checks_its_stream(per_rank: list[dict]) -> None:
    result = per_rank[0]["wait_for_params"]
    pending_after_step, pending_after_wait = result["pending"]
    assert pending_after_step and not pending_after_wait
    type_error, value_error, written = result["errors"]
    assert type_error == (
        "TypeError: ShardingStage1.wait_for_params expects stream to be a torch.Stream or None but got "
        "str; pass e.g. torch.cuda.current_stream()"
    )
    assert value_error == (
        "ValueError: ShardingStage1.wait_for_params expects a stream on the params' device cpu but got "
        "one on meta; pass a stream of cpu or stream=None"
    )
    assert "were written while step()'s all-gather" in written and "opt.sync_params()" in written
