"""``plan_training``: memory and predicted step time of every mode, and the one to pick."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fusion.bucket_sizing import trainable_bytes
from fusion.layout import BucketPlan, LayoutPlan, ParamSpec, plan_layout
from sharded_opt.plan.config import Cluster, Collective, ComputeTimes
from sharded_opt.plan.cost import GroupPlacement, collective_s, crosses_nodes
from sharded_opt.plan.memory import MemoryBytes, StateBytes, ddp_memory, sharded_memory
from sharded_opt.plan.model import (
    load_factory,
    meta_model,
    param_specs,
    resolve_optimizer,
    state_bytes_per_element,
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

    @property
    def memory(self) -> MemoryBytes:
        """Of the rank that holds the most."""
        return max(self.memory_per_rank, key=lambda m: m.total)

    @property
    def label(self) -> str:
        return f"hybrid {self.degree}" if self.mode == "hybrid" else self.mode


@dataclass(frozen=True, slots=True)
class TrainingPlan:
    """Every mode's plan, the pick and why."""

    modes: tuple[ModePlan, ...]
    """Each mode at its best bucket size."""
    bucket_sweep: tuple[ModePlan, ...]
    """``overlap`` at every size of :data:`BUCKET_SWEEP_MB`."""
    recommended: ModePlan
    reason: str
    num_params: int
    world_size: int


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
            ``enable_overlap`` are what the modes vary, so they are ignored.
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
    state_bytes, at_construction = state_bytes_per_element(meta_optimizer, sorted(dtypes, key=str))
    inputs = _Inputs(
        specs, meta_optimizer, state_bytes, at_construction, cluster, compute, sharding, steps_per_sync
    )
    sweep = tuple(_sharded_mode(inputs, "overlap", cluster.world_size, size) for size in BUCKET_SWEEP_MB)
    best_size = _bucket_size(sweep)
    modes = [
        _ddp_mode(inputs),
        _sharded_mode(inputs, "sync", cluster.world_size, sharding.bucket_size_mb),
        _sharded_mode(inputs, "overlap", cluster.world_size, best_size),
    ]
    for degree in range(2, cluster.world_size):
        if cluster.world_size % degree == 0:
            modes.append(_sharded_mode(inputs, "hybrid", degree, best_size))
    recommended, reason = recommend(modes)
    num_params = sum(spec.numel for spec in specs if spec.requires_grad)
    return TrainingPlan(tuple(modes), sweep, recommended, reason, num_params, cluster.world_size)


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


def _precision(dtype: torch.dtype, sharding: ShardingConfig) -> BucketPrecision:
    return resolve_precision(dtype, sharding.reduce_dtype, sharding.master_dtype)


def layout_for(specs: list[ParamSpec], shard_size: int, sharding: ShardingConfig) -> LayoutPlan:
    """The plan the wrapper makes for ``specs`` over ``shard_size`` shards (``ShardingStage1``'s
    own call)."""
    sizes = sharding.bucket_sizes(trainable_bytes(specs))
    return plan_layout(
        specs,
        shard_size,
        align_bytes=sharding.align_bytes,
        bucket_size_bytes=sizes.bucket_bytes,
        first_bucket_bytes=sizes.first_bucket_bytes,
    )


def _sharded_mode(inputs: _Inputs, mode: str, degree: int, bucket_size_mb: float | None) -> ModePlan:
    cluster = inputs.cluster
    sharding = replace(inputs.sharding, bucket_size_mb=bucket_size_mb)
    plan = layout_for(inputs.specs, degree, sharding)
    precisions = [_precision(bucket.dtype, sharding) for bucket in plan.buckets]
    memory = tuple(
        sharded_memory(plan, precisions, inputs.state_bytes, rank, materialize_all=inputs.at_construction)
        for rank in range(degree)
    )
    shard = GroupPlacement.consecutive(degree, cluster)
    replicas = GroupPlacement.strided(cluster.world_size // degree, degree, cluster)
    trainable = [b for b in plan.buckets if b.requires_grad]
    total_numel = sum(b.used_numel for b in trainable)
    busiest = max(range(degree), key=lambda r: sum(_stepped(b, r) for b in trainable))
    buckets = []
    for bucket, precision in zip(plan.buckets, precisions, strict=True):
        if not bucket.requires_grad:
            continue
        reduce_bytes = bucket.padded_numel * precision.reduce_dtype.itemsize
        buckets.append(
            BucketCosts(
                compute_share=bucket.used_numel / total_numel,
                step_share=_stepped(bucket, busiest) / total_numel,
                reduce=_transfer("reduce_scatter", reduce_bytes, shard, cluster),
                replica=_transfer("all_reduce", reduce_bytes // degree, replicas, cluster)
                if replicas.size > 1
                else NO_TRANSFER,
                gather=_transfer("all_gather", _nbytes(bucket), shard, cluster),
                at_step=bucket.staged_grads,
            )
        )
    world = GroupPlacement.consecutive(cluster.world_size, cluster)
    flags_s = collective_s("all_reduce", len(inputs.specs), world, cluster, alone=True)
    costs = StepCosts(tuple(buckets), inputs.compute, inputs.compute.wrapper_step_s, flags_s)
    step_s, timeline = inputs.simulate(costs, "sync" if mode == "sync" else "overlap")
    comm_s = comm_only_s(tuple(buckets))
    return ModePlan(mode, degree, bucket_size_mb, len(plan.buckets), memory, step_s, comm_s, timeline)


def _nbytes(bucket: BucketPlan) -> int:
    return bucket.padded_numel * bucket.dtype.itemsize


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
    buckets = []
    for indices in assignment:
        members = [grads_in_backward_order[i] for i in indices]
        nbytes = sum(p.numel() * p.element_size() for p in members)
        numel = sum(p.numel() for p in members)
        buckets.append(
            BucketCosts(
                compute_share=numel / total_numel,
                step_share=numel / total_numel,
                reduce=_transfer("all_reduce", nbytes, world, cluster),
            )
        )
    costs = StepCosts(tuple(buckets), inputs.compute, inputs.compute.step_s)
    step_s, timeline = inputs.simulate(costs, "ddp")
    memory = (ddp_memory(inputs.specs, inputs.state_bytes),)
    comm_s = comm_only_s(tuple(buckets))
    return ModePlan("ddp", None, DDP_BUCKET_CAP_MB, len(buckets), memory, step_s, comm_s, timeline)


def _transfer(kind: Collective, nbytes: int, group: GroupPlacement, cluster: Cluster) -> Transfer:
    return Transfer(
        LINK if crosses_nodes(group, cluster) else NODE_LINK,
        collective_s(kind, nbytes, group, cluster, alone=True),
        collective_s(kind, nbytes, group, cluster, alone=False),
    )


def format_plan(plan: TrainingPlan) -> str:
    """The plan as the CLI prints it: a table of bytes per rank and step times, then the pick."""
    mib = 2**20
    header = (
        f"{'mode':10} {'buckets':>7} {'bucket MiB':>10} {'params':>8} {'grads':>8} {'red.grad':>8} "
        f"{'master':>8} {'opt st.':>8} {'comm buf':>8} {'total':>8} {'(pad)':>7} "
        f"{'step ms':>8} {'comm ms':>8}"
    )
    lines = [
        f"{plan.num_params / 1e6:.2f}M trainable params, {plan.world_size} rank(s); bytes per rank in MiB",
        header,
    ]
    for m in plan.modes:
        memory = m.memory
        size = "auto" if m.bucket_size_mb is None else f"{m.bucket_size_mb:g}"
        cells = (
            memory.params,
            memory.grads,
            memory.reduced_grads,
            memory.master,
            memory.optimizer_state,
            memory.staging + memory.ddp_buckets,
            memory.total,
        )
        lines.append(
            f"{m.label:10} {m.num_buckets:>7} {size:>10} "
            + " ".join(f"{c / mib:8.2f}" for c in cells)
            + f" {memory.padding / mib:7.3f} {m.step_s * 1e3:8.1f} {m.comm_s * 1e3:8.1f}"
        )
    sweep = ", ".join(
        f"{'auto' if m.bucket_size_mb is None else f'{m.bucket_size_mb:g}'}: {m.step_s * 1e3:.1f}"
        for m in plan.bucket_sweep
    )
    pick = plan.recommended
    size = "the default sizes" if pick.bucket_size_mb is None else f"bucket_size_mb={pick.bucket_size_mb:g}"
    lines += [
        f"overlap step ms by bucket MiB: {sweep}",
        f"recommended: {pick.label}" + ("" if pick.mode == "ddp" else f" with {size}") + f": {plan.reason}",
    ]
    return "\n".join(lines)
