"""``--calibrate``: measure one rank's compute and the link between two ranks on this machine.

Both are measured on two spawned gloo ranks, as the modes run. Compute: forward, backward and
the optimizer step of the real model on one batch on every rank at once (ranks of one machine
share its cores and memory bandwidth), medians of a few repeats after a warm-up, the slowest
rank's. The wrapper's step is timed on the layout it really steps: the params as flat CPU chunks
(Note [Per-param pieces]).

Link: spawned gloo ranks issue each collective the modes use through ``sharded_opt.comm.collectives``
(so the reduce-scatter is the wrapper's all-to-all plus sum), several in flight at once as the
modes issue them, at a few sizes; a least-squares line through (bytes sent, seconds) gives beta,
its intercept per round alpha (``cost.rounds``, ``cost.wire_bytes``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from sharded_opt.comm import collectives
from sharded_opt.launch.launcher import spawn
from sharded_opt.plan.config import AlphaBeta, Collective, CollectiveCosts, ComputeTimes, LinkModel
from sharded_opt.plan.cost import rounds, wire_bytes
from sharded_opt.plan.model import load_batch, load_factory, resolve_optimizer
from sharded_opt.step.local_shard import CPU_CHUNK_BYTES

PROBE_SIZES_BYTES = (128 * 2**10, 512 * 2**10, 2 * 2**20)
"""Collective sizes timed: around the default buckets of small models (64 KiB to a few MiB)."""

IN_FLIGHT = 4
"""Collectives issued before waiting for ``LinkModel.in_flight``: the modes keep several buckets
in flight, and gloo runs concurrent collectives faster per byte than one alone
(Note [Reduce-scatter on gloo] in ``sharded_opt/comm/collectives.py``)."""

REPEATS = 3
WARMUP = 2
KINDS: tuple[Collective, ...] = ("all_reduce", "reduce_scatter", "all_gather")


def measure_compute(
    model: nn.Module,
    batch: Sequence[Tensor],
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict,
    repeats: int = 5,
) -> ComputeTimes:
    """Medians of forward, backward and step of ``model`` on ``batch``; the forward's output is
    the loss (summed when it is not a scalar)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_class(params, **optimizer_kwargs)
    forward, backward, step = [], [], []
    for index in range(WARMUP + repeats):
        optimizer.zero_grad()
        start = time.perf_counter()
        output = model(*batch)
        loss = output if output.dim() == 0 else output.sum()
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        optimizer.step()
        if index >= WARMUP:
            forward.append(middle - start)
            backward.append(end - middle)
            step.append(time.perf_counter() - end)
    return ComputeTimes(
        forward_s=statistics.median(forward),
        backward_s=statistics.median(backward),
        step_s=statistics.median(step),
        sharded_step_s=_chunked_step_s(params, optimizer_class, optimizer_kwargs, repeats),
    )


def _chunked_step_s(
    params: list[Tensor], optimizer_class: type[torch.optim.Optimizer], kwargs: dict, repeats: int
) -> float:
    """The step over every param cut into the wrapper's CPU chunks."""
    chunks = []
    for param in params:
        flat = param.detach().reshape(-1)
        chunk_numel = max(1, CPU_CHUNK_BYTES // flat.element_size())
        for start in range(0, flat.numel(), chunk_numel):
            chunk = flat[start : start + chunk_numel].clone().requires_grad_(True)
            chunk.grad = torch.randn_like(chunk)
            chunks.append(chunk)
    optimizer = optimizer_class(chunks, **kwargs)
    times = []
    for index in range(WARMUP + repeats):
        start = time.perf_counter()
        optimizer.step()
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_link(group: ProcessGroup | None = None) -> LinkModel:
    """Fit each collective's alpha and beta on ``group`` (every rank calls it; each returns the
    same model, fitted to the slowest rank's times)."""
    group = dist.group.WORLD if group is None else group
    return LinkModel(alone=_fit(group, 1), in_flight=_fit(group, IN_FLIGHT))


def _fit(group: ProcessGroup, in_flight: int) -> CollectiveCosts:
    size = dist.get_world_size(group)
    fitted = {}
    for kind in KINDS:
        times = [_time_collective(kind, nbytes, group, in_flight) for nbytes in PROBE_SIZES_BYTES]
        seconds = torch.tensor(times)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
        sent = [wire_bytes(kind, nbytes, size) for nbytes in PROBE_SIZES_BYTES]
        slope, intercept = statistics.linear_regression(sent, seconds.tolist())
        fitted[kind] = AlphaBeta(
            alpha_s=max(0.0, intercept) / rounds(kind, size), beta_s_per_byte=max(0.0, slope)
        )
    return CollectiveCosts(**fitted)


def _time_collective(kind: Collective, nbytes: int, group: ProcessGroup, in_flight: int) -> float:
    """Median seconds per collective with ``in_flight`` of them issued at once."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = nbytes // 4 // size * size
    inputs = [torch.ones(numel) for _ in range(in_flight)]
    outputs = [torch.empty(numel // size if kind == "reduce_scatter" else numel) for _ in range(in_flight)]
    issue: Callable[[Tensor, Tensor], object] = {
        "all_reduce": lambda out, inp: collectives.all_reduce_avg(inp, group, async_op=True),
        "reduce_scatter": lambda out, inp: collectives.reduce_scatter_avg(out, inp, group, async_op=True),
        "all_gather": lambda out, inp: collectives.all_gather(
            out, out.view(size, -1)[rank], group, async_op=True
        ),
    }[kind]
    times = []
    for index in range(WARMUP + REPEATS):
        dist.barrier(group)
        start = time.perf_counter()
        works = [issue(out, inp) for out, inp in zip(outputs, inputs, strict=True)]
        for work in works:
            work.wait()
        if index >= WARMUP:
            times.append((time.perf_counter() - start) / in_flight)
    return statistics.median(times)


@dataclass(frozen=True, slots=True)
class CalibrationInputs:
    """What the ranks need to build the model, its batch and the optimizer (paths, so they
    travel to spawned ranks)."""

    model: str
    """``module:callable`` or a built-in model's name."""
    batch: str | None
    """``module:callable`` returning the forward's arguments; None for a built-in model."""
    micro_batch: int
    optimizer: str
    optimizer_kwargs: dict
    threads: int
    """torch threads per rank."""


def calibrate_rank(inputs: CalibrationInputs, link_group: ProcessGroup | None = None) -> Calibration:
    """Every rank's part of :func:`calibrate`: compute on every rank at once, then the link on
    ``link_group`` (default: the world); returns the slowest rank's compute."""
    torch.set_num_threads(inputs.threads)
    model = load_factory(inputs.model)()
    batch = load_batch(inputs.batch, inputs.model, inputs.micro_batch)
    optimizer = resolve_optimizer(inputs.optimizer)
    dist.barrier()
    compute = measure_compute(model, batch, optimizer, inputs.optimizer_kwargs)
    times = torch.tensor([compute.forward_s, compute.backward_s, compute.step_s, compute.wrapper_step_s])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    forward, backward, step, sharded_step = times.tolist()
    slowest = ComputeTimes(forward_s=forward, backward_s=backward, step_s=step, sharded_step_s=sharded_step)
    return Calibration(slowest, measure_link(link_group))


@dataclass(frozen=True, slots=True)
class Calibration:
    compute: ComputeTimes
    link: LinkModel


def calibrate(inputs: CalibrationInputs) -> Calibration:
    """Compute and the link, measured on two spawned gloo ranks of this machine."""
    return spawn(calibrate_rank, (inputs,), nprocs=2)[0]
