"""The accelerator path's wrapper-level behaviour on CPU gloo ranks: bf16 grads reduced in fp32
go out uncast on CPU gloo (Note [Widening on receipt] in ``collectives``; the staging pool of
Note [Bounded staging] is tested on fake streams in ``test_streams``),
``wait_for_params`` is ``sync_params`` on CPU, and in overlap mode the wrapper's grad hooks make
the reduction wait for every stream that accumulated grads (with the fakes of
``tests.harness.fake_accelerator``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.comm import collectives, comm_context
from tests.harness.dist_helper import run_ranks
from tests.harness.fake_accelerator import FakeAccelerator, FakeEvent, FakeStream


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

    def recording(output: torch.Tensor, input: torch.Tensor, group, async_op: bool, point_to_point: bool):
        casts.append((input.dtype, output.dtype))
        return original(output, input, group, async_op, point_to_point)

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
        "casts": casts,
        "staging_bytes": optimizer.memory_bytes()["staging"],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _streams_the_reduction_waited_for() -> set[str]:
    """Overlap mode on fake streams: a Linear whose weight's grad is accumulated on a side stream
    and its bias's (same bucket) on the compute stream."""
    fake = FakeAccelerator()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "Event", lambda device: FakeEvent(fake, device))
        patch.setattr(torch.accelerator, "current_stream", fake.current_stream)
        patch.setattr(comm_context, "new_comm_stream", lambda device: fake.comm)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
        assert len(optimizer.plan.buckets) == 1
        side = FakeStream(fake, "side")
        model.weight.register_hook(lambda grad: setattr(fake, "current", side))
        model.bias.register_hook(lambda grad: setattr(fake, "current", fake.compute))
        model(torch.ones(2, 4)).sum().backward()
        waited = {
            line.split(" waits ")[1].split("#")[0] for line in fake.log if line.startswith("comm waits")
        }
        fake.current = fake.compute
        optimizer.step()
    return waited


def _all_checks() -> dict:
    return {
        "staging": [_train_recording_casts(overlap) for overlap in (False, True)],
        "wait_for_params": _wait_for_params(),
        "streams": _streams_the_reduction_waited_for(),
    }


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    """One spawn for the whole module: starting ranks costs more than the checks."""
    return run_ranks(_all_checks, 2)


def test_bf16_grads_go_out_uncast_on_cpu_gloo_and_modes_agree_bitwise(per_rank: list[dict]) -> None:
    for sync, overlap in (rank["staging"] for rank in per_rank):
        for run in (sync, overlap):
            assert run["num_buckets"] >= 5
            assert run["casts"] == [(torch.bfloat16, torch.float32)] * (3 * run["num_buckets"])
            assert run["staging_bytes"] == 0
        for a, b in zip(sync["params"], overlap["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(per_rank[0]["staging"][1]["params"], per_rank[1]["staging"][1]["params"], strict=True):
        assert torch.equal(a, b)


def _wait_for_params() -> dict:
    model = _bf16_model().float()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, model=model)
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    pending_after_step = [b.index for b in optimizer.shards.buckets if b.param_sync_pending]
    optimizer.wait_for_params(torch.Stream(device="cpu"))
    pending_after_wait = [b.index for b in optimizer.shards.buckets if b.param_sync_pending]
    errors = []
    for stream in ("cuda", torch.Stream(device="meta")):
        with pytest.raises((TypeError, ValueError)) as raised:
            optimizer.wait_for_params(stream)
        errors.append(f"{raised.type.__name__}: {raised.value}")
    optimizer.step()
    with torch.no_grad(), torch._C.DisableTorchFunction():  # past the read guard
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


def test_overlap_reduction_waits_for_each_stream_that_accumulated_the_buckets_grads(
    per_rank: list[dict],
) -> None:
    for rank in per_rank:
        assert rank["streams"] == {"compute", "side"}
