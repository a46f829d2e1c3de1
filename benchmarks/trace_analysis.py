"""How much of the grad reduce-scatters and param all-gathers ran while compute ran: pure
interval arithmetic over profiler events (from a Chrome trace or built by hand).

Definitions (what "hidden comm %" means):

* A *comm* event is a reduce-scatter or all-gather as the backend executes it: NCCL kernels
  (``ncclDevKernel_ReduceScatter...``, ``ncclKernel_AllGather...``) or gloo's own spans on its
  worker threads (``gloo:all_to_all``, ``gloo:all_gather``; ``gloo:broadcast``: on CPU gloo the
  wrapper all-gathers by one broadcast per rank, Note [In-place all-gather on gloo], and a
  model's buffers, broadcast as DDP does, count there too) or the wrapper's own spans of its
  point-to-point collectives on gloo (``gloo:reduce_scatter (point-to-point)``, ``gloo:all_gather
  (point-to-point)``, recorded with :func:`profiler_options`). The host-side ``c10d::...`` issue
  calls, and gloo's ``gloo:send``/``gloo:recv`` posting spans, are neither comm nor compute.
* A *compute* event is a GPU kernel that is not a collective (``compute="kernel"``) or, for CPU
  traces, an ``aten::`` operator (``compute="cpu_op"``).
* Events are placed on *lanes* (a GPU stream or a host thread). Compute on the same lane as a
  comm event cannot run beside it (on a host thread it is nested inside it, e.g. gloo's
  staging copies), so only compute on other lanes counts.

``hidden = | U_lanes L ( comm on L  intersect  compute not on L ) |`` and
``hidden_fraction = hidden / | U comm |``, where ``U`` is the union of intervals and ``| |`` its
length: the share of wall-clock time during which some reduce-scatter or all-gather was in
flight that some other lane spent computing. 1.0 means the communication was entirely hidden
behind compute; 0.0 means compute always waited for it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

Interval = tuple[float, float]
"""(start_us, end_us) with start <= end."""

CommKind = Literal["reduce_scatter", "all_gather"]
ComputeSource = Literal["kernel", "cpu_op"]

_COMM_PREFIXES = ("gloo:", "nccl")


def profiler_options() -> dict[str, Any]:
    """Keyword arguments for ``torch.profiler.profile`` that record every host thread.

    On gloo with CPU tensors the wrapper's collectives run over point-to-point messages that a
    helper thread per collective waits for (Note [Reduce-scatter on gloo] in
    ``sharded_opt/comm/collectives.py``); their ``gloo:...`` spans live on those threads, which the
    profiler records only with ``profile_all_threads`` (torch releases without it: no option,
    and the trace then shows no such spans).
    """
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return {}
    return {"experimental_config": config}


_REDUCE_SCATTER_MARKERS = ("reducescatter", "alltoall")
_ALL_GATHER_MARKERS = ("allgather", "broadcast")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One complete (``ph == "X"``) profiler event."""

    name: str
    start_us: float
    dur_us: float
    lane: str
    """A GPU stream (``"stream 7"``) or a host thread (``"pid/tid"``)."""
    category: str = ""
    """The trace's ``cat``: ``"kernel"``, ``"cpu_op"``, ``"user_annotation"``, ..."""

    @property
    def interval(self) -> Interval:
        return (self.start_us, self.start_us + self.dur_us)


@dataclass(frozen=True, slots=True)
class OverlapReport:
    """The result of :func:`analyze`; times in microseconds."""

    comm_us: float
    """Length of the union of all reduce-scatter and all-gather intervals."""
    hidden_us: float
    """Part of ``comm_us`` during which compute ran on another lane."""
    comm_events: dict[str, int]
    """Number of comm events by kind."""
    compute_events: int

    @property
    def hidden_fraction(self) -> float:
        """``hidden_us / comm_us``; 0.0 when there was no comm at all."""
        return self.hidden_us / self.comm_us if self.comm_us > 0 else 0.0


def comm_kind(name: str) -> CommKind | None:
    """The collective an event executes, or None for anything else (see module docstring)."""
    lowered = name.lower()
    if not lowered.startswith(_COMM_PREFIXES):
        return None
    flat = lowered.replace("_", "")
    if any(marker in flat for marker in _REDUCE_SCATTER_MARKERS):
        return "reduce_scatter"
    if any(marker in flat for marker in _ALL_GATHER_MARKERS):
        return "all_gather"
    return None


def is_compute(event: TraceEvent, source: ComputeSource) -> bool:
    """True for the events that count as compute, see the module docstring."""
    if event.name.lower().startswith(_COMM_PREFIXES):
        return False
    if source == "kernel":
        return event.category == "kernel"
    return event.category == "cpu_op" and event.name.startswith("aten::")


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the same points; empty ones are dropped."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersection(first: Sequence[Interval], second: Sequence[Interval]) -> list[Interval]:
    """Intersection of two sets of intervals (each given as a :func:`union`)."""
    result: list[Interval] = []
    a = b = 0
    while a < len(first) and b < len(second):
        start = max(first[a][0], second[b][0])
        end = min(first[a][1], second[b][1])
        if end > start:
            result.append((start, end))
        if first[a][1] < second[b][1]:
            a += 1
        else:
            b += 1
    return result


def length(intervals: Iterable[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def analyze(events: Iterable[TraceEvent], compute: ComputeSource) -> OverlapReport:
    """Hidden reduce-scatter and all-gather time, as defined in the module docstring.

    Raises:
        ValueError: ``compute`` is not ``"kernel"`` or ``"cpu_op"``.
    """
    if compute not in ("kernel", "cpu_op"):
        raise ValueError(f"analyze expects compute='kernel' or 'cpu_op' but got {compute!r}")
    comm_by_lane: dict[str, list[Interval]] = {}
    compute_by_lane: dict[str, list[Interval]] = {}
    counts: dict[str, int] = {"reduce_scatter": 0, "all_gather": 0}
    for event in events:
        kind = comm_kind(event.name)
        if kind is not None:
            counts[kind] += 1
            comm_by_lane.setdefault(event.lane, []).append(event.interval)
        elif is_compute(event, compute):
            compute_by_lane.setdefault(event.lane, []).append(event.interval)
    hidden: list[Interval] = []
    for lane, comm in comm_by_lane.items():
        others = union(i for other, spans in compute_by_lane.items() if other != lane for i in spans)
        hidden.extend(intersection(union(comm), others))
    comm_all = union(i for spans in comm_by_lane.values() for i in spans)
    return OverlapReport(
        comm_us=length(comm_all),
        hidden_us=length(union(hidden)),
        comm_events=counts,
        compute_events=sum(len(spans) for spans in compute_by_lane.values()),
    )


PHASE_NAMES = ("forward", "backward", "optimizer.step")
"""The ``record_function`` ranges the benchmark labels each training step with."""


@dataclass(frozen=True, slots=True)
class PhaseComm:
    """What the link did during one phase of a step (or between phases); times in microseconds."""

    name: str
    """A phase of :data:`PHASE_NAMES`, or ``"between"`` for time outside every phase."""
    start_us: float
    dur_us: float
    reduce_scatter_us: float
    """Time some reduce-scatter was in flight (union over lanes)."""
    all_gather_us: float
    idle_us: float
    """Time no reduce-scatter or all-gather was in flight."""


def phase_comm(events: Sequence[TraceEvent]) -> list[PhaseComm]:
    """Per phase of the profiled steps, in time order, how long each collective kind was in
    flight and how long none was: where a comm-bound step leaves the link idle. The phases are the
    outermost :data:`PHASE_NAMES` ranges; the gaps between them (waits at the end of a block,
    Python between calls) are reported as ``"between"``."""
    phases = sorted((e for e in events if e.name in PHASE_NAMES), key=lambda e: e.start_us)
    windows: list[tuple[str, Interval]] = []
    for event in phases:
        if windows and event.start_us < windows[-1][1][1]:
            continue  # nested in the previous phase
        if windows and event.start_us > windows[-1][1][1]:
            windows.append(("between", (windows[-1][1][1], event.start_us)))
        windows.append((event.name, event.interval))
    spans: dict[str, list[Interval]] = {"reduce_scatter": [], "all_gather": []}
    for event in events:
        kind = comm_kind(event.name)
        if kind is not None:
            spans[kind].append(event.interval)
    rs, ag = union(spans["reduce_scatter"]), union(spans["all_gather"])
    either = union(rs + ag)
    result = []
    for name, window in windows:
        busy = length(intersection(either, [window]))
        result.append(
            PhaseComm(
                name,
                window[0],
                window[1] - window[0],
                length(intersection(rs, [window])),
                length(intersection(ag, [window])),
                (window[1] - window[0]) - busy,
            )
        )
    return result


def load_chrome_trace(path: str | Path) -> list[TraceEvent]:
    """The complete events of a trace written by ``torch.profiler``'s ``export_chrome_trace``.

    Raises:
        ValueError: the file is not a Chrome trace (no ``traceEvents`` list).
    """
    data = json.loads(Path(path).read_text())
    raw = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(raw, list):
        raise ValueError(
            f"load_chrome_trace expects a Chrome trace with a traceEvents list but {path} has none"
        )
    return [_to_event(entry) for entry in raw if entry.get("ph") == "X" and "dur" in entry]


def _to_event(entry: dict) -> TraceEvent:
    args = entry.get("args") or {}
    stream = args.get("stream")
    lane = f"stream {stream}" if stream is not None else f"{entry.get('pid')}/{entry.get('tid')}"
    return TraceEvent(
        name=str(entry.get("name", "")),
        start_us=float(entry["ts"]),
        dur_us=float(entry["dur"]),
        lane=lane,
        category=str(entry.get("cat", "")),
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.trace_analysis TRACE.json``: the hidden share of comm and, per
    phase, the time each collective was in flight and the link idle (CPU traces from
    ``python -m benchmarks.compare --profile``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_analysis", description=main.__doc__)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--compute", choices=["cpu_op", "kernel"], default="cpu_op")
    args = parser.parse_args(argv)
    events = load_chrome_trace(args.trace)
    report = analyze(events, args.compute)
    print(f"comm in flight {report.comm_us / 1e3:.1f} ms, hidden {report.hidden_fraction:.0%}")
    print(f"{'phase':16} {'start ms':>9} {'ms':>8} {'RS ms':>8} {'AG ms':>8} {'link idle ms':>13}")
    origin = min((e.start_us for e in events), default=0.0)
    for phase in phase_comm(events):
        start, dur = (phase.start_us - origin) / 1e3, phase.dur_us / 1e3
        rs, ag, idle = phase.reduce_scatter_us / 1e3, phase.all_gather_us / 1e3, phase.idle_us / 1e3
        print(f"{phase.name:16} {start:9.1f} {dur:8.1f} {rs:8.1f} {ag:8.1f} {idle:13.1f}")


if __name__ == "__main__":
    main()
