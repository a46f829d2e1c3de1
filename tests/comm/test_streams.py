"""Stream logic checked without an accelerator: stream set-up, and the buckets'
accelerator path run with fake streams, events and collectives (the real thing runs in
``python -m benchmarks.gpu_check``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusion.buffers import FlatBuffers
from fusion.layout import ParamSpec, plan_layout
from sharded_opt.comm import collectives, comm_context, streams
from sharded_opt.comm.comm_context import CommContext
from sharded_opt.step.bucket import Bucket, build_buckets, finish_grad_syncs, start_param_syncs
from sharded_opt.step.grad_hooks import GradReadyTracker
from sharded_opt.step.local_shard import resolve_precision
from tests.harness.fake_accelerator import FakeAccelerator, FakeEvent, FakeStream


class _RecordedStream:
    def __init__(self, device: torch.device, *, priority: int = 0) -> None:
        self.device = device
        self.priority = priority


def test_comm_stream_has_high_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "Stream", _RecordedStream)
    stream = streams.new_comm_stream(torch.device("cuda", 0))
    assert stream.priority == -1
    assert stream.device == torch.device("cuda", 0)


def test_no_comm_stream_on_cpu() -> None:
    assert streams.new_comm_stream(torch.device("cpu")) is None


# -- the accelerator path with fake streams and events ------------------------------------------
#
# Streams and events are replaced by the fakes of ``tests.harness.fake_accelerator``: they log every
# record and wait in order; collectives log which stream was current when they were issued and
# return handles whose wait() logs which stream waited.


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> FakeAccelerator:
    fake = FakeAccelerator()
    monkeypatch.setattr(torch, "Event", lambda device: FakeEvent(fake, device))
    monkeypatch.setattr(torch.accelerator, "current_stream", fake.current_stream)
    monkeypatch.setattr(comm_context, "new_comm_stream", lambda device: fake.comm)
    monkeypatch.setattr(collectives, "reduce_scatter_avg", fake.collective("reduce_scatter"))
    monkeypatch.setattr(collectives, "all_gather", fake.collective("all_gather"))
    return fake


def _buckets(
    numels: tuple[int, ...], dtype: torch.dtype = torch.float32, bucket_size_bytes: int = 1 << 20
) -> tuple[list[torch.nn.Parameter], FlatBuffers, list[Bucket], CommContext]:
    """Rank 0 of 2, sharded, on a group that is never used (the collectives are fakes)."""
    params = [torch.nn.Parameter(torch.ones(numel, dtype=dtype)) for numel in numels]
    specs = [ParamSpec.of(param, 0) for param in params]
    plan = plan_layout(specs, 2, align_bytes=256, bucket_size_bytes=bucket_size_bytes)
    buffers = FlatBuffers(plan, params)
    precisions = [resolve_precision(bucket.dtype, None, None) for bucket in plan.buckets]
    comm = CommContext(
        None, 0, 2, sharded=True, replicate_group=None, point_to_point=False, device=plan.buckets[0].device
    )
    return params, buffers, build_buckets(buffers, precisions, comm), comm


def _waits_before(log: list[str], entry: str, waiter: str) -> list[str]:
    """What ``waiter`` waited for before ``entry`` was logged, as the recording streams' names."""
    before = log[: log.index(entry)]
    return sorted(
        line.split(" waits ")[1].split("#")[0] for line in before if line.startswith(f"{waiter} waits")
    )


def test_reduction_waits_for_every_stream_that_accumulated_grads_of_the_bucket(
    accelerator: FakeAccelerator,
) -> None:
    params, buffers, buckets, _ = _buckets((8, 8))
    assert len(buckets) == 1
    launcher = SimpleNamespace(
        start_bucket_grad_sync=Bucket.start_grad_sync, all_buckets_launched=lambda: None
    )
    shards = SimpleNamespace(materialize=Bucket.materialize)
    tracker = GradReadyTracker(buffers, buckets, shards, launcher, note_streams=True)  # noqa: F841 (hooks live with it)
    side = FakeStream(accelerator, "side")

    def accumulate_on(stream: FakeStream):
        def switch(grad: torch.Tensor) -> None:
            accelerator.current = stream  # the stream autograd accumulates this leaf's grad on

        return switch

    params[0].register_hook(accumulate_on(side))
    params[1].register_hook(accumulate_on(accelerator.compute))
    (params[0] * 2 + params[1] * 3).sum().backward()
    assert _waits_before(accelerator.log, "reduce_scatter1 on comm", "comm") == ["compute", "side"]

    accelerator.current = accelerator.compute
    accelerator.log.clear()
    buckets[0].start_grad_sync()  # the next reduction: the streams seen were consumed by the first
    assert _waits_before(accelerator.log, "reduce_scatter2 on comm", "comm") == ["compute"]


def test_grad_hooks_note_the_stream_in_no_sync_too(
    accelerator: FakeAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    params, buffers, buckets, _ = _buckets((8, 8))
    noted: list[int] = []
    monkeypatch.setattr(Bucket, "note_grad_stream", lambda bucket: noted.append(bucket.index))
    tracker = GradReadyTracker(
        buffers,
        buckets,
        SimpleNamespace(materialize=lambda bucket: None),
        SimpleNamespace(start_bucket_grad_sync=lambda bucket: None, all_buckets_launched=lambda: None),
        note_streams=True,
    )
    tracker.accumulate_only = True
    (params[0] + params[1]).sum().backward()
    assert noted == [0, 0]


def test_every_stream_that_reads_params_waits_for_the_latest_all_gather(
    accelerator: FakeAccelerator,
) -> None:
    _, _, buckets, comm = _buckets((8,))
    (bucket,) = buckets
    side = FakeStream(accelerator, "side")
    start_param_syncs([bucket], comm)
    assert accelerator.log[-1] == "all_gather1 on comm"
    accelerator.log.clear()
    bucket.finish_param_sync()
    bucket.finish_param_sync()  # the compute stream already waited: nothing more
    with side:
        bucket.finish_param_sync()
    assert accelerator.log == [
        "comm waits all_gather1",
        "record comm#1",
        "compute waits comm#1",
        "side waits comm#1",
    ]
    start_param_syncs([bucket], comm)
    accelerator.log.clear()
    with side:
        bucket.finish_param_sync()
    bucket.finish_param_sync()
    assert accelerator.log == [
        "comm waits all_gather2",
        "record comm#2",
        "side waits comm#2",
        "compute waits comm#2",
    ]


def test_casts_reuse_two_staging_buffers_each_behind_its_last_reader(
    accelerator: FakeAccelerator,
) -> None:
    # bf16 grads reduced in fp32; 128 bf16 elements are 256 bytes, one bucket per param.
    _, _, buckets, comm = _buckets((256, 768, 256, 512), dtype=torch.bfloat16, bucket_size_bytes=256)
    assert len(buckets) == 4
    largest_bytes = max(bucket.plan.padded_numel for bucket in buckets) * 4
    for step in range(2):
        accelerator.log.clear()
        for bucket in buckets:
            bucket.start_grad_sync()
        collective_lines = [line for line in accelerator.log if "reduce_scatter" in line]
        first = 4 * step
        assert collective_lines == [
            f"reduce_scatter{first + 1} on comm",
            f"reduce_scatter{first + 2} on comm",
            f"comm waits reduce_scatter{first + 1}",  # before the third cast overwrites buffer 0
            f"reduce_scatter{first + 3} on comm",
            f"comm waits reduce_scatter{first + 2}",
            f"reduce_scatter{first + 4} on comm",
        ]
        finish_grad_syncs(buckets, comm)
    storages = {tensor.untyped_storage().data_ptr() for tensor in accelerator.inputs}
    assert len(storages) == 2
    assert all(tensor.dtype == torch.float32 for tensor in accelerator.inputs)
    assert comm.staging.nbytes == 2 * largest_bytes
