"""``plan_training``: memory and predicted step time of every mode, and the one to pick."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusion.block_layout import BlockGrid
from fusion.bucket_sizing import trainable_bytes
from fusion.layout import BucketPlan, LayoutPlan, ParamSpec, plan_layout
from sharded_opt.guards.optimizer_needs import block_grid_of
from sharded_opt.guards.validation import check_error_feedback
from sharded_opt.plan.config import Cluster, ComputeTimes
from sharded_opt.plan.cost import GroupPlacement, collective_s, crosses_nodes, sent_s, wire_bytes
from sharded_opt.plan.memory import MemoryBytes, StateBytes, ddp_memory, sharded_memory
from sharded_opt.plan.model import (
    load_factory,
    meta_model,
    param_specs,
    resolve_optimizer,
    state_sizes,
)
from sharded_opt.plan.schedule import (
    NO_TRANSFER,
    BucketCosts,
    StepCosts,
    Timeline,
    Transfer,
    comm_only_s,
    simulate,
)
from sharded_opt.plan.wire import Payload, StepWire, bucket_wire
from sharded_opt.step.local_shard import BucketPrecision, resolve_precision
from sharded_opt.strategy import ShardingConfig

BUCKET_SWEEP_MB: tuple[float | None, ...] = (None, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0)
"""Bucket sizes tried for the overlapping modes: the wrapper's default (None, first) and a sweep."""

TIE_FRACTION = 0.03
"""Modes predicted within this share of the fastest count as equally fast; the one holding the
fewest bytes is recommended among them (the model is not more exact than that)."""

SIMULATED_STEPS = 8
"""Steps simulated from idle; the last one's length is the steady step time (overlap's
all-gathers reach into the next forward, so the first step differs)."""

DDP_BUCKET_CAP_MB = 25
"""DDP's default ``bucket_cap_mb``; its first bucket is ``dist._DEFAULT_FIRST_BUCKET_BYTES``."""

NODE_LINK, LINK = "node link", "link between nodes"


@dataclass(frozen=True, slots=True)
class ModePlan:
    """One mode's bytes and predicted time."""

    mode: str
    """``ddp``, ``sync``, ``overlap`` or ``hybrid`` (overlap with ``degree``)."""
    degree: int | None
    """Ranks per shard group; None for DDP."""
    bucket_size_mb: float | None
    """The wrapper's ``bucket_size_mb`` (None: its default sizes) or DDP's ``bucket_cap_mb``."""
    num_buckets: int
    memory_per_rank: tuple[MemoryBytes, ...]
    """Of each rank of a shard group (they differ in their pieces and in padding); one for DDP."""
    step_s: float
    """A long run's step time (steady state, no ``sync_params()``), or per step of blocks of
    ``steps_per_sync`` steps."""
    comm_s: float
    """Every collective of one step with nothing hidden: all reductions issued at once, then
    all all-gathers."""
    timeline: Timeline
    wire: StepWire = StepWire()
    """Bytes one rank sends in one step (``ShardingStage1.wire_bytes()``'s difference over a step;
    for DDP its all-reduces)."""
    grad_compression: str | None = None
    param_compression: str | None = None
    """``ShardingConfig``'s settings of these names the mode was planned with (None: exact)."""

    @property
    def memory(self) -> MemoryBytes:
        """Of the rank that holds the most."""
        return max(self.memory_per_rank, key=lambda m: m.total)

    @property
    def compressed(self) -> bool:
        return self.grad_compression is not None or self.param_compression is not None

    @property
    def label(self) -> str:
        label = f"hybrid {self.degree}" if self.mode == "hybrid" else self.mode
        if self.compressed:
            label += f" [{self.grad_compression or 'exact'}/{self.param_compression or 'exact'}]"
        return label


@dataclass(frozen=True, slots=True)
class TrainingPlan:
    """Every mode's plan, the pick and why."""

    modes: tuple[ModePlan, ...]
    """Each mode at its best bucket size; with compression each sharded mode exact, then
    compressed."""
    bucket_sweep: tuple[ModePlan, ...]
    """``overlap`` at every size of :data:`BUCKET_SWEEP_MB`."""
    recommended: ModePlan
    reason: str
    num_params: int
    world_size: int
    compressed_sweep: tuple[ModePlan, ...] = ()
    """Compressed ``overlap`` at every size of :data:`BUCKET_SWEEP_MB`; empty without compression."""


def plan_training(
    model: str | Callable[[], nn.Module],
    optimizer: str | type[torch.optim.Optimizer],
    *,
    cluster: Cluster,
    compute: ComputeTimes,
    optimizer_kwargs: dict[str, Any] | None = None,
    sharding: ShardingConfig | None = None,
    steps_per_sync: int | None = None,
) -> TrainingPlan:
    """Bytes per rank and predicted step time of DDP and the wrapper's modes; the mode to pick.

    Nothing of the model is allocated: it is built on the meta device and laid out by
    ``fusion.plan_layout`` as the wrapper lays it out.

    Args:
        model: a factory (called with no arguments), ``"module:callable"``, or the name of a
            built-in benchmark model (``"default"``, ``"tiny"``, ``"mlp"``, ...).
        optimizer: a ``torch.optim`` class or its name; the wrapper shards element-wise ones.
        cluster: world size, ranks per node and links.
        compute: one rank's forward, backward and optimizer step times.
        optimizer_kwargs: the optimizer's arguments (they decide its state: ``amsgrad``,
            ``momentum``, ...).
        sharding: the wrapper's settings (``reduce_dtype``, ``master_dtype``, ``align_bytes``,
            and ``bucket_size_mb`` for sync; the overlapping modes get the best size of
            :data:`BUCKET_SWEEP_MB`); None: ``ShardingConfig()``. ``degree`` and
            ``enable_overlap`` are what the modes vary, so they are ignored. With
            ``grad_compression`` or ``param_compression`` every sharded mode is planned twice,
            exact and compressed (Note [Compressed wire] in ``sharded_opt/comm/compression.py``),
            and the pick is made among both; DDP is exact.
        steps_per_sync: predict the step time of blocks of this many steps that each end in
            ``sync_params()`` (which waits for the last all-gathers, as ``benchmarks.compare``
            times its blocks); None: a long run's steady step.

    Returns:
        A :class:`TrainingPlan`; ``format_plan`` prints it.

    Raises:
        ValueError: an unknown optimizer or model, arguments the optimizer refuses, a model
            without trainable params.
    """
    sharding = ShardingConfig() if sharding is None else sharding
    if sharding.grad_error_feedback:
        check_error_feedback(sharding.grad_compression, hybrid=False)
    if steps_per_sync is not None and steps_per_sync < 1:
        raise ValueError(f"plan expects steps_per_sync >= 1 or None but got {steps_per_sync!r}")
    optimizer_class = resolve_optimizer(optimizer)
    factory = load_factory(model) if isinstance(model, str) else model
    meta = meta_model(factory)
    specs, meta_optimizer = param_specs(meta, optimizer_class, dict(optimizer_kwargs or {}))
    if trainable_bytes(specs) == 0:
        raise ValueError("plan expects a model with trainable params but got none")
    dtypes = {spec.dtype for spec in specs}
    dtypes |= {_precision(dtype, sharding).master_dtype for dtype in dtypes}
    state_bytes, at_construction = state_sizes(meta_optimizer, sorted(dtypes, key=str))
    inputs = _Inputs(
        specs, meta_optimizer, state_bytes, at_construction, cluster, compute, sharding, steps_per_sync
    )
    exact = replace(sharding, grad_compression=None, param_compression=None, grad_error_feedback=False)
    exact_modes, sweep = _sharded_modes(replace(inputs, sharding=exact))
    compressed, compressed_sweep = _sharded_modes(inputs) if sharding != exact else ([], ())
    pairs = itertools.zip_longest(exact_modes, compressed)  # each mode exact, then compressed
    modes = [_ddp_mode(inputs), *(m for pair in pairs for m in pair if m is not None)]
    recommended, reason = recommend(modes)
    num_params = sum(spec.numel for spec in specs if spec.requires_grad)
    return TrainingPlan(
        tuple(modes), sweep, recommended, reason, num_params, cluster.world_size, compressed_sweep
    )


def _sharded_modes(inputs: _Inputs) -> tuple[list[ModePlan], tuple[ModePlan, ...]]:
    """sync, overlap and each hybrid degree with ``inputs.sharding``; overlap's bucket sweep."""
    world_size = inputs.cluster.world_size
    sweep = tuple(_sharded_mode(inputs, "overlap", world_size, size) for size in BUCKET_SWEEP_MB)
    best_size = _bucket_size(sweep)
    modes = [
        _sharded_mode(inputs, "sync", world_size, inputs.sharding.bucket_size_mb),
        _sharded_mode(inputs, "overlap", world_size, best_size),
    ]
    # The wrapper refuses error feedback with hybrid sharding (Note [Error feedback]).
    hybrid = not inputs.sharding.grad_error_feedback
    for degree in range(2, world_size):
        if hybrid and world_size % degree == 0:
            modes.append(_sharded_mode(inputs, "hybrid", degree, best_size))
    return modes, sweep


def _bucket_size(sweep: Sequence[ModePlan]) -> float | None:
    """The fastest bucket size, or the wrapper's default sizes (``sweep[0]``) if they are within
    :data:`TIE_FRACTION` of it: a size the model cannot tell apart is not worth setting."""
    fastest = min(sweep, key=lambda m: m.step_s)
    default = sweep[0]
    return (
        default.bucket_size_mb
        if default.step_s <= fastest.step_s * (1 + TIE_FRACTION)
        else fastest.bucket_size_mb
    )


def recommend(modes: Sequence[ModePlan]) -> tuple[ModePlan, str]:
    """The fastest mode, or among those within :data:`TIE_FRACTION` of it the one that holds
    the fewest bytes; and why."""
    fastest = min(modes, key=lambda m: m.step_s)
    near = [m for m in modes if m.step_s <= fastest.step_s * (1 + TIE_FRACTION)]
    pick = min(near, key=lambda m: (m.memory.total, m.step_s))
    if pick is fastest:
        return pick, f"fastest predicted ({pick.step_s * 1e3:.1f} ms per step)"
    return pick, (
        f"within {TIE_FRACTION:.0%} of the fastest ({fastest.label}, {fastest.step_s * 1e3:.1f} ms) "
        f"and holds {(fastest.memory.total - pick.memory.total) / 2**20:.1f} MiB less per rank"
    )


@dataclass(frozen=True, slots=True)
class _Inputs:
    specs: list[ParamSpec]
    optimizer: torch.optim.Optimizer
    state_bytes: StateBytes
    at_construction: bool
    cluster: Cluster
    compute: ComputeTimes
    sharding: ShardingConfig
    steps_per_sync: int | None

    def simulate(self, costs: StepCosts, mode: str) -> tuple[float, Timeline]:
        """The mode's step time and timeline, see ``plan_training``'s ``steps_per_sync``."""
        timeline = simulate(costs, mode, self.steps_per_sync or SIMULATED_STEPS)
        if self.steps_per_sync is None:
            return timeline.steady_step_s(), timeline
        return timeline.block_step_s(), timeline


def _precision(dtype: torch.dtype, sharding: ShardingConfig, shard_size: int = 1) -> BucketPrecision:
    """As the wrapper resolves it: params travel as deltas with ``param_compression`` over a
    sharded group (``wrapper_init.shares_param_deltas``)."""
    deltas = sharding.param_compression is not None and shard_size > 1
    return resolve_precision(dtype, sharding.reduce_dtype, sharding.master_dtype, delta_params=deltas)


def layout_for(
    specs: list[ParamSpec], shard_size: int, sharding: ShardingConfig, block_grid: BlockGrid | None = None
) -> LayoutPlan:
    """The plan the wrapper makes for ``specs`` over ``shard_size`` shards (``ShardingStage1``'s
    own call), with ``block_grid`` for an optimizer that quantizes its state per block."""
    sizes = sharding.bucket_sizes(trainable_bytes(specs))
    return plan_layout(
        specs,
        shard_size,
        align_bytes=sharding.align_bytes,
        bucket_size_bytes=sizes.bucket_bytes,
        first_bucket_bytes=sizes.first_bucket_bytes,
        block_grid=block_grid,
    )


def _sharded_mode(inputs: _Inputs, mode: str, degree: int, bucket_size_mb: float | None) -> ModePlan:
    cluster = inputs.cluster
    sharding = replace(inputs.sharding, bucket_size_mb=bucket_size_mb)
    plan = layout_for(inputs.specs, degree, sharding, block_grid_of(inputs.optimizer))
    precisions = [_precision(bucket.dtype, sharding, degree) for bucket in plan.buckets]
    memory = tuple(
        sharded_memory(
            plan,
            precisions,
            inputs.state_bytes,
            rank,
            materialize_all=inputs.at_construction,
            fed_back=sharding.grad_compression if sharding.grad_error_feedback else None,
        )
        for rank in range(degree)
    )
    shard = GroupPlacement.consecutive(degree, cluster)
    replicas = GroupPlacement.strided(cluster.world_size // degree, degree, cluster)
    trainable = [b for b in plan.buckets if b.requires_grad]
    total_numel = sum(b.used_numel for b in trainable)
    busiest = max(range(degree), key=lambda r: sum(_stepped(b, r) for b in trainable))
    buckets, wires = [], []
    for bucket, precision in zip(plan.buckets, precisions, strict=True):
        if not bucket.requires_grad:
            continue
        wire = bucket_wire(
            bucket, precision, degree, replicas.size, sharding.grad_compression, sharding.param_compression
        )
        wires.append(wire)
        buckets.append(
            BucketCosts(
                compute_share=bucket.used_numel / total_numel,
                step_share=_stepped(bucket, busiest) / total_numel,
                reduce=_transfer(wire.grads, shard, cluster),
                replica=_transfer(wire.replicas, replicas, cluster) if replicas.size > 1 else NO_TRANSFER,
                gather=_transfer(wire.params, shard, cluster),
                at_step=bucket.staged_grads,
            )
        )
    world = GroupPlacement.consecutive(cluster.world_size, cluster)
    flags_s = collective_s("all_reduce", len(inputs.specs), world, cluster, alone=True)
    costs = StepCosts(tuple(buckets), inputs.compute, inputs.compute.wrapper_step_s, flags_s)
    step_s, timeline = inputs.simulate(costs, "sync" if mode == "sync" else "overlap")
    comm_s = comm_only_s(tuple(buckets))
    return ModePlan(
        mode,
        degree,
        bucket_size_mb,
        len(plan.buckets),
        memory,
        step_s,
        comm_s,
        timeline,
        StepWire.of(wires),
        sharding.grad_compression,
        sharding.param_compression,
    )


def _stepped(bucket: BucketPlan, rank: int) -> int:
    """Elements ``rank`` steps of ``bucket``."""
    return sum(piece.numel for piece in bucket.shard_pieces(rank))


def _ddp_mode(inputs: _Inputs) -> ModePlan:
    cluster = inputs.cluster
    params = [p for group in inputs.optimizer.param_groups for p in group["params"] if p.requires_grad]
    grads_in_backward_order = list(reversed(params))
    first_bytes = dist._DEFAULT_FIRST_BUCKET_BYTES
    assignment, _ = dist._compute_bucket_assignment_by_size(
        grads_in_backward_order, [first_bytes, DDP_BUCKET_CAP_MB * 2**20], [False] * len(params)
    )
    total_numel = sum(p.numel() for p in params)
    world = GroupPlacement.consecutive(cluster.world_size, cluster)
    buckets, sent = [], 0
    for indices in assignment:
        members = [grads_in_backward_order[i] for i in indices]
        nbytes = sum(p.numel() * p.element_size() for p in members)
        numel = sum(p.numel() for p in members)
        payload = Payload("all_reduce", wire_bytes("all_reduce", nbytes, world.size))
        sent += payload.sent
        buckets.append(
            BucketCosts(
                compute_share=numel / total_numel,
                step_share=numel / total_numel,
                reduce=_transfer(payload, world, cluster),
            )
        )
    costs = StepCosts(tuple(buckets), inputs.compute, inputs.compute.step_s)
    step_s, timeline = inputs.simulate(costs, "ddp")
    memory = (ddp_memory(inputs.specs, inputs.state_bytes),)
    comm_s = comm_only_s(tuple(buckets))
    wire = StepWire(grads=sent)
    return ModePlan("ddp", None, DDP_BUCKET_CAP_MB, len(buckets), memory, step_s, comm_s, timeline, wire)


def _transfer(payload: Payload, group: GroupPlacement, cluster: Cluster) -> Transfer:
    return Transfer(
        LINK if crosses_nodes(group, cluster) else NODE_LINK,
        sent_s(payload.kind, payload.sent, group, cluster, alone=True),
        sent_s(payload.kind, payload.sent, group, cluster, alone=False),
    )


def format_plan(plan: TrainingPlan) -> str:
    """The plan as the CLI prints it: a table of bytes per rank, bytes sent per step and step
    times, compressed modes against exact ones where planned, then the pick."""
    mib = 2**20
    publishes = any(m.memory.published for m in plan.modes)
    feeds_back = any(m.memory.grad_residual for m in plan.modes)
    width = max(10, *(len(m.label) for m in plan.modes))
    header = (
        f"{'mode':{width}} {'buckets':>7} {'bucket MiB':>10} {'params':>8} {'grads':>8} {'red.grad':>8} "
        f"{'master':>8} "
        + (f"{'publ.':>8} " if publishes else "")
        + f"{'opt st.':>8} "
        + (f"{'resid.':>8} " if feeds_back else "")
        + f"{'comm buf':>8} {'total':>8} {'(pad)':>7} {'sent MiB':>8} {'step ms':>8} {'comm ms':>8}"
    )
    lines = [
        f"{plan.num_params / 1e6:.2f}M trainable params, {plan.world_size} rank(s); bytes per rank in MiB, "
        "sent: per step",
        header,
    ]
    for m in plan.modes:
        memory = m.memory
        cells = (
            memory.params,
            memory.grads,
            memory.reduced_grads,
            memory.master,
            *((memory.published,) if publishes else ()),
            memory.optimizer_state,
            *((memory.grad_residual,) if feeds_back else ()),
            memory.staging + memory.ddp_buckets,
            memory.total,
        )
        times = f"{m.step_s * 1e3:8.1f} {m.comm_s * 1e3:8.1f}"
        lines.append(
            f"{m.label:{width}} {m.num_buckets:>7} {_size(m.bucket_size_mb):>10} "
            + " ".join(f"{c / mib:8.2f}" for c in cells)
            + f" {memory.padding / mib:7.3f} {m.wire.total / mib:8.2f} {times}"
        )
    for sweep in (plan.bucket_sweep, plan.compressed_sweep):
        if sweep:
            times = ", ".join(f"{_size(m.bucket_size_mb)}: {m.step_s * 1e3:.1f}" for m in sweep)
            lines.append(f"{sweep[0].label} step ms by bucket MiB: {times}")
    lines += _compression_gains(plan.modes)
    pick = plan.recommended
    size = "the default sizes" if pick.bucket_size_mb is None else f"bucket_size_mb={pick.bucket_size_mb:g}"
    lines.append(
        f"recommended: {pick.label}" + ("" if pick.mode == "ddp" else f" with {size}") + f": {plan.reason}"
    )
    return "\n".join(lines)


def _size(bucket_size_mb: float | None) -> str:
    return "auto" if bucket_size_mb is None else f"{bucket_size_mb:g}"


def _compression_gains(modes: Sequence[ModePlan]) -> list[str]:
    """Each compressed mode against the same mode exact: bytes sent, step time, bytes held."""
    exact = {(m.mode, m.degree): m for m in modes if not m.compressed}
    compressed = [m for m in modes if m.compressed]
    if not compressed:
        return []
    mib = 2**20
    lines = ["compressed [grads/params] against exact, per rank (encoding and decoding not modelled):"]
    for m in compressed:
        base = exact[(m.mode, m.degree)]
        ratio = f"{m.wire.total / base.wire.total:.2f}x" if base.wire.total else "nothing, as exact"
        lines.append(
            f"  {m.label}: sends {ratio} "
            f"({base.wire.total / mib:.2f} -> {m.wire.total / mib:.2f} MiB per step), "
            f"step {base.step_s * 1e3:.1f} -> {m.step_s * 1e3:.1f} ms, "
            f"holds {(m.memory.total - base.memory.total) / mib:+.2f} MiB"
        )
    return lines
