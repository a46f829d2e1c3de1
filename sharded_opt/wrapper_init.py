"""Construction steps of ``ShardingStage1`` (as FSDP2's ``_fsdp_init``): the resolved config,
the bucket layout and precisions, the communicator that runs each bucket's collectives, this
rank's shards and inner optimizer, the runtime objects over them (:func:`build_runtime`), and the
hooks on an attached model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from fusion.bucket_sizing import trainable_bytes
from fusion.buffers import FlatBuffers
from fusion.layout import LayoutPlan, ParamSpec, plan_layout
from sharded_opt.comm.collective_guard import EntryGuard
from sharded_opt.comm.comm_context import CommContext
from sharded_opt.comm.hybrid_groups import ShardGroups, lease_shard_groups
from sharded_opt.comm.initial_broadcast import broadcast_from_first_rank, broadcast_model_state, first_rank
from sharded_opt.guards.optimizer_needs import OptimizerNeeds
from sharded_opt.guards.param_guard import ParamGuard
from sharded_opt.guards.validation import (
    TORCH_OPTIMIZERS,
    check_compression,
    check_holds_trained_params,
    check_optimizer,
    check_same_layout,
    check_trained_modules,
    collect_params,
)
from sharded_opt.model_hooks.param_hooks import BufferBroadcaster, ParamReadyWaiter
from sharded_opt.state.state_dict import StateDictExchange
from sharded_opt.step.bucket import build_buckets
from sharded_opt.step.grad_clipping import GradClipping
from sharded_opt.step.grad_sync import GradSync
from sharded_opt.step.inner_optimizer import build_inner_optimizer, check_steps
from sharded_opt.step.local_shard import BucketPrecision, resolve_precision
from sharded_opt.step.optimizer_shards import OptimizerShards, ParamGroupsOwner
from sharded_opt.step.param_sync import ParamSync
from sharded_opt.step.quantized_state import SharedCodeBooks
from sharded_opt.step.step_pipeline import StepPipeline
from sharded_opt.strategy import ShardingConfig, Strategy
from sharded_opt.wrapper_lifetime import WrapperLifetime


@dataclass(frozen=True, slots=True)
class WrapperRuntime:
    """The objects a ``ShardingStage1`` delegates to, built by :func:`build_runtime` (each one's
    job in the module docstring of ``optimizer``)."""

    config: ShardingConfig
    shards: OptimizerShards
    grad_sync: GradSync
    param_sync: ParamSync
    param_guard: ParamGuard
    clipping: GradClipping
    pipeline: StepPipeline
    entry_guard: EntryGuard
    state_dicts: StateDictExchange
    attacher: ModelAttacher
    lifetime: WrapperLifetime


def build_runtime(
    wrapper: ParamGroupsOwner,
    optimizer: torch.optim.Optimizer,
    model: nn.Module | None,
    strategy: Strategy | None,
    overlap: bool | None,
    assume_elementwise: bool,
    process_group: ProcessGroup | None,
    device_mesh: DeviceMesh | None,
) -> WrapperRuntime:
    """Everything ``ShardingStage1.__init__`` needs before torch's ``Optimizer.__init__`` runs,
    from its arguments: the local checks, then the collective steps (the groups, the same layout
    on every rank, the broadcast of the params). ``wrapper`` owns the param groups; the cycle
    through it keeps a dropped wrapper (and its hooks) alive until the garbage collector runs."""
    config, needs, params, specs = check_locally(optimizer, model, strategy, overlap, assume_elementwise)
    # Groups of its own, a dropped wrapper's where one is free: Note [Reusing a dropped
    # wrapper's groups]; given back when the wrapper is collected, or by close().
    lease = lease_shard_groups(process_group, config.degree, device_mesh, config.enable)
    groups = lease.groups
    check_same_layout(specs, groups.world, groups.world_size)
    plan, precisions = plan_buckets(optimizer, needs, specs, config, groups)
    shards = build_shards(optimizer, wrapper, plan, params, precisions, config, groups)
    if needs.quantized_blocks is not None:
        shards.shared_state_parts = needs.quantized_blocks.shared_parts
        shards.keyed_state = needs.quantized_blocks.keyed
        shards.fresh_state = needs.quantized_blocks.fresh_state
        if needs.quantized_blocks.keyed is None:  # bitsandbytes shares its code books itself
            shards.code_books = SharedCodeBooks(needs.quantized_blocks.shared_parts)
    grad_sync = GradSync(shards, config.enable_overlap)
    param_sync = ParamSync(shards.buckets, shards.comm)
    param_guard = ParamGuard(shards.buffers, param_sync)
    # A failed check leaves the ranks' call counters on the groups apart: never reused.
    entry_guard = EntryGuard(groups.world, config.collective_entry_timeout_s, lease.withhold)
    return WrapperRuntime(
        config=config,
        shards=shards,
        grad_sync=grad_sync,
        param_sync=param_sync,
        param_guard=param_guard,
        clipping=GradClipping(grad_sync, shards, param_guard),
        pipeline=StepPipeline(shards, grad_sync, param_sync, needs.state_per_param),
        entry_guard=entry_guard,
        state_dicts=StateDictExchange(shards, param_sync, entry_guard),
        attacher=ModelAttacher(shards, param_guard, config),
        lifetime=WrapperLifetime(wrapper, lease, param_sync, grad_sync.tracker.handles),
    )


def check_locally(
    optimizer: torch.optim.Optimizer,
    model: nn.Module | None,
    strategy: Strategy | None,
    overlap: bool | None,
    assume_elementwise: bool,
) -> tuple[ShardingConfig, OptimizerNeeds, list[torch.Tensor], list[ParamSpec]]:
    """Every check that needs no other rank, run before the first collective so that a refused
    argument raises at once rather than after (or while waiting in) collectives. Returns the
    config, what the optimizer class needs, its params and their specs."""
    config = resolve_config(strategy, overlap)
    needs = check_optimizer(optimizer, assume_elementwise)
    check_not_stepped(optimizer)
    params, specs = collect_params(optimizer)
    if model is not None:
        check_trained_modules(model, params)
    return config, needs, params, specs


def resolve_config(strategy: Strategy | None, overlap: bool | None) -> ShardingConfig:
    """The wrapper's own copy of ``strategy.sharding``, with ``overlap`` applied."""
    if strategy is None:
        strategy = Strategy()
    elif not isinstance(strategy, Strategy):
        raise TypeError(
            f"ShardingStage1 expects strategy to be a sharded_opt.Strategy but got {type(strategy).__name__}"
        )
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"ShardingStage1 expects overlap to be a bool or None but got {overlap!r}")
    config = dataclasses.replace(strategy.sharding)
    if overlap is not None:
        config.enable_overlap = overlap
    if not config.enable and config.degree is not None:
        raise ValueError(
            f"ShardingStage1 got Strategy().sharding.degree={config.degree} with enable=False: without "
            "sharding every rank holds all state and there are no shard groups to size. Set "
            "enable=True for hybrid sharding, or degree=None for plain data parallel"
        )
    return config


def check_not_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose state a wrapper would drop."""
    # An empty entry is what reading ``optimizer.state[p]`` leaves (schedule-free's train()).
    stepped = [state for state in optimizer.state.values() if state and float(state.get("step", 1)) > 0]
    if stepped:
        raise ValueError(
            f"ShardingStage1 expects an optimizer that has not stepped yet but it holds state for "
            f"{len(stepped)} params, which would be lost; wrap the optimizer before training. To "
            "resume from a checkpoint, load its optimizer state into the wrapper instead: "
            "opt = ShardingStage1(optimizer, ...); opt.load_state_dict(checkpoint_state) (on every rank)"
        )


def plan_buckets(
    optimizer: torch.optim.Optimizer,
    needs: OptimizerNeeds,
    specs: list[ParamSpec],
    config: ShardingConfig,
    groups: ShardGroups,
) -> tuple[LayoutPlan, list[BucketPrecision]]:
    """The bucket layout (whole params per owner where the class ``needs`` them) and each
    bucket's precisions; settings torch refuses only at the first step are refused now (Note
    [Refused at the first step] in ``inner_optimizer``)."""
    check_compression(
        config.grad_compression,
        config.param_compression,
        sharded=config.enable,
        specs=specs,
        grad_error_feedback=config.grad_error_feedback,
        hybrid=groups.replicate is not None,
    )
    sharded = config.enable and groups.shard_size > 1
    bucket_sizes = config.bucket_sizes(trainable_bytes(specs))
    plan = plan_layout(
        specs,
        groups.shard_size if sharded else 1,
        align_bytes=config.align_bytes,
        bucket_size_bytes=bucket_sizes.bucket_bytes,
        first_bucket_bytes=bucket_sizes.first_bucket_bytes,
        whole_param_cost=needs.param_cost if needs.whole_params else None,
        block_grid=None if needs.quantized_blocks is None else needs.quantized_blocks.grid(optimizer),
    )
    deltas = shares_param_deltas(config, groups)
    precisions = [
        resolve_precision(bucket.dtype, config.reduce_dtype, config.master_dtype, delta_params=deltas)
        for bucket in plan.buckets
    ]
    if type(optimizer) in TORCH_OPTIMIZERS:
        check_steps(
            optimizer,
            {
                (b.group_index, p.master_dtype, b.device)
                for b, p in zip(plan.buckets, precisions, strict=True)
            },
            probe_shape=(2, 2) if needs.whole_params else (2,),
        )
    return plan, precisions


def shares_param_deltas(config: ShardingConfig, groups: ShardGroups) -> bool:
    """Updated params travel as compressed deltas: ``param_compression`` on a sharded group of
    several ranks (Note [Compressed wire] in ``sharded_opt/comm/compression.py``)."""
    return config.param_compression is not None and config.enable and groups.shard_size > 1


def build_shards(
    optimizer: torch.optim.Optimizer,
    owner: ParamGroupsOwner,
    plan: LayoutPlan,
    params: list[torch.Tensor],
    precisions: list[BucketPrecision],
    config: ShardingConfig,
    groups: ShardGroups,
) -> OptimizerShards:
    """The flat buffers over ``params`` (holding the group's first rank's values on every rank,
    collective), the buckets, and the wrapped class rebuilt over this rank's shards."""
    buffers = FlatBuffers(plan, params)
    broadcast_from_first_rank(buffers, groups.world, groups.world_size)
    comm = CommContext.for_groups(
        groups,
        sharding=config.enable,
        point_to_point=config.gloo_point_to_point,
        device=plan.buckets[0].device,
        grad_compression=config.grad_compression,
        param_compression=config.param_compression,
        grad_error_feedback=config.grad_error_feedback,
    )
    buckets = build_buckets(buffers, precisions, comm)
    if optimizer.state:
        # The class creates state at construction (Adagrad): it exists for every param, frozen
        # or not, so every bucket needs its pieces now, as the plain optimizer has them.
        for bucket in buckets:
            bucket.materialize()
    inner = build_inner_optimizer(optimizer, [b.shard for b in buckets if b.shard is not None])
    return OptimizerShards(plan, buffers, comm, buckets, inner, owner, groups)


@dataclass(frozen=True, slots=True)
class AttachedModel:
    """What attaching a model put in place, for the wrapper to take over (``ShardingStage1``
    keeps the handles for ``close()`` and gives the waiter to ``ParamSync``)."""

    handles: list[RemovableHandle]
    """Every hook installed on the model."""
    waiter: ParamReadyWaiter | None
    """The per-module waits for the all-gathers (overlap mode); None in sync mode, where
    ``step()`` waits for every all-gather itself."""


class ModelAttacher:
    """Puts the hooks of an attached model in place (``ShardingStage1.attach``): the per-module
    waits for the all-gathers (overlap mode, Note [No stale params] in ``param_hooks``), the
    check of each forward with grad (``ParamGuard.watch``) and DDP's buffer broadcast; and
    makes the model start equal on every rank. It sets nothing on the wrapper's other objects:
    it returns what it installed (:class:`AttachedModel`).

    Args:
        shards: the flat buffers the model's params are views of.
        param_guard: checks each forward and names the model's params in its errors.
        config: ``enable_overlap`` (forwards wait per module; otherwise ``step()`` waits for
            every all-gather) and ``broadcast_buffers`` (before each forward with grad, as DDP).
    """

    def __init__(self, shards: OptimizerShards, param_guard: ParamGuard, config: ShardingConfig) -> None:
        self._shards = shards
        self._param_guard = param_guard
        self._overlap = config.enable_overlap
        self._broadcast_buffers = config.broadcast_buffers
        self._buffer_broadcaster: BufferBroadcaster | None = None
        """Held here: its hook refers to it weakly."""
        self._attached = False
        """A model was installed (in sync mode too, where no per-module waiter is kept)."""

    def attach(self, model: nn.Module) -> AttachedModel:
        """``ShardingStage1.attach``: refuse a second model or one the wrapper cannot serve, then
        :meth:`install` it."""
        if self._attached:
            raise ValueError("ShardingStage1.attach: a model is already attached to this optimizer")
        check_trained_modules(model, self._shards.buffers.params)
        return self.install(model)

    def install(self, model: nn.Module) -> AttachedModel:
        """Install the hooks on ``model`` and broadcast its params and buffers from the first rank
        (collective); the model was checked (``check_trained_modules``)."""
        buffers = self._shards.buffers
        group, world_size = self._shards.groups.world, self._shards.groups.world_size
        check_holds_trained_params(model, buffers)
        self._attached = True
        broadcast_model_state(model, buffers, group, world_size)
        # The hooks go on after the broadcast, the one step here that can fail (a collective), so
        # that they reach the wrapper (and ``close()``) or are not installed at all. The waiter's
        # go on before the guard's: both are prepended, so the guard's check runs first.
        waiter = ParamReadyWaiter(model, buffers, self._shards.buckets) if self._overlap else None
        handles = [self._param_guard.watch(model)]
        if self._broadcast_buffers and world_size > 1 and next(model.buffers(), None) is not None:
            self._buffer_broadcaster = BufferBroadcaster(model, group, first_rank(group))
            handles += self._buffer_broadcaster.handles
        if waiter is not None:
            handles += waiter.handles
        return AttachedModel(handles, waiter)
