"""The interval arithmetic behind the GPU check's "hidden comm %", on hand-made intervals with
known answers and on a real Chrome trace of two gloo ranks in overlap mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.trace_analysis import (
    TraceEvent,
    analyze,
    comm_kind,
    intersection,
    length,
    load_chrome_trace,
    phase_comm,
    profiler_options,
    union,
)
from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from tests.harness.dist_helper import run_ranks


def test_union_merges_overlapping_touching_and_nested_intervals() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (5, 6), (9, 9)]) == [(0, 4), (5, 7)]


def test_intersection_of_two_unions() -> None:
    first = union([(0, 4), (6, 10)])
    second = union([(2, 7), (9, 12)])
    assert intersection(first, second) == [(2, 4), (6, 7), (9, 10)]
    assert length(intersection(first, second)) == 4


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "all_gather"),
        ("gloo:all_to_all", "reduce_scatter"),
        ("gloo:all_gather", "all_gather"),
        ("gloo:reduce_scatter (point-to-point)", "reduce_scatter"),
        ("gloo:all_gather (point-to-point)", "all_gather"),
        ("gloo:send", None),
        ("gloo:all_reduce", None),
        ("c10d::_allgather_base_", None),
        ("aten::mm", None),
    ],
)
def test_comm_kind(name: str, kind: str | None) -> None:
    assert comm_kind(name) == kind


def _event(name: str, start: float, dur: float, lane: str, category: str = "kernel") -> TraceEvent:
    return TraceEvent(name, start, dur, lane, category)


def test_hidden_fraction_of_synthetic_streams() -> None:
    events = [
        # comm: [0, 10) and [20, 30) on the NCCL stream; the two overlapping ones merge to [20, 30)
        _event("ncclDevKernel_ReduceScatter_Sum", 0, 10, "stream 20"),
        _event("ncclDevKernel_AllGather", 20, 6, "stream 20"),
        _event("ncclDevKernel_AllGather", 24, 6, "stream 20"),
        # compute on stream 7 covers [5, 12) and [28, 40): 5 + 2 of the 20 comm microseconds
        _event("ampere_sgemm", 5, 7, "stream 7"),
        _event("elementwise_kernel", 28, 12, "stream 7"),
        # a kernel on the comm stream itself hides nothing; a memcpy is not compute
        _event("cast_kernel", 0, 30, "stream 20"),
        _event("Memcpy DtoH", 0, 30, "stream 9", category="gpu_memcpy"),
    ]
    report = analyze(events, compute="kernel")
    assert report.comm_us == 20
    assert report.hidden_us == 7
    assert report.hidden_fraction == pytest.approx(0.35)
    assert report.comm_events == {"reduce_scatter": 1, "all_gather": 2}
    assert report.compute_events == 3


def test_cpu_ops_count_only_on_other_threads() -> None:
    events = [
        _event("gloo:all_to_all", 10, 10, "1/200", "user_annotation"),
        _event("aten::copy_", 10, 10, "1/200", "cpu_op"),  # gloo's staging copy, same thread
        _event("aten::mm", 15, 20, "1/100", "cpu_op"),
        _event("c10d::alltoall_base_", 0, 40, "1/100", "cpu_op"),  # host issue call, not compute
    ]
    report = analyze(events, compute="cpu_op")
    assert (report.comm_us, report.hidden_us, report.hidden_fraction) == (10, 5, 0.5)


def test_phase_comm_splits_link_time_by_phase() -> None:
    """Per phase: how long each collective kind was in flight and how long the link was idle;
    nested phase ranges are ignored and gaps between phases are reported as "between"."""
    events = [
        _event("forward", 0, 100, "1/100", "user_annotation"),
        _event("backward", 100, 100, "1/100", "user_annotation"),
        _event("forward", 150, 10, "1/100", "user_annotation"),  # checkpoint recompute, nested
        _event("optimizer.step", 210, 40, "1/100", "user_annotation"),
        # all-gathers of the previous step land during forward: [0, 60) of its 100 us
        _event("gloo:all_gather", 0, 40, "1/200"),
        _event("gloo:all_gather", 30, 30, "1/201"),
        # reduce-scatters from [130, 230), across the end of backward and the gap into the step
        _event("gloo:all_to_all", 130, 50, "1/200"),
        _event("gloo:all_to_all", 170, 60, "1/201"),
    ]
    phases = [
        (p.name, p.start_us, p.dur_us, p.reduce_scatter_us, p.all_gather_us, p.idle_us)
        for p in phase_comm(events)
    ]
    assert phases == [
        ("forward", 0, 100, 0, 60, 40),
        ("backward", 100, 100, 70, 0, 30),
        ("between", 200, 10, 10, 0, 0),
        ("optimizer.step", 210, 40, 20, 0, 20),
    ]


def test_no_comm_gives_zero_fraction() -> None:
    assert analyze([_event("aten::mm", 0, 5, "1/1", "cpu_op")], compute="cpu_op").hidden_fraction == 0.0


def test_unknown_compute_source_is_refused() -> None:
    with pytest.raises(ValueError, match="analyze expects compute='kernel' or 'cpu_op' but got 'gpu'"):
        analyze([], compute="gpu")  # type: ignore[arg-type]


def test_load_chrome_trace_refuses_other_json(tmp_path: Path) -> None:
    path = tmp_path / "not_a_trace.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expects a Chrome trace with a traceEvents list"):
        load_chrome_trace(path)


def _record_overlap_trace(path: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters()),
        overlap=True,
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.02)),
    )
    inputs = torch.randn(32, 64)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], **profiler_options()
    ) as profiler:
        for _ in range(2):
            optimizer.zero_grad()
            model(inputs).sum().backward()
            optimizer.step()
        optimizer.sync_params()
    if dist.get_rank() == 0:
        profiler.export_chrome_trace(path)


def test_real_cpu_trace_of_overlap_mode(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    run_ranks(_record_overlap_trace, 2, str(path))
    events = load_chrome_trace(path)
    report = analyze(events, compute="cpu_op")
    # 4 buckets, 2 steps: one reduce-scatter (gloo's all-to-all) each, and one all-gather each
    # (buckets this small use gloo's own all-gather, Note [In-place all-gather on gloo]).
    assert report.comm_events == {"reduce_scatter": 8, "all_gather": 8}
    assert report.compute_events > 0
    assert report.comm_us > 0
    assert 0.0 <= report.hidden_fraction <= 1.0
