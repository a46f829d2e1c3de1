"""Construction steps of ``ShardingStage1`` (as FSDP2's ``_fsdp_init``): the resolved config,
the bucket layout and precisions, and the communicator that runs each bucket's collectives."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from fusion.bucket_sizing import trainable_bytes
from fusion.buffers import FlatBuffers
from fusion.layout import LayoutPlan, ParamSpec, plan_layout
from sharded_opt.bucket_comm import BucketCommunicator
from sharded_opt.hybrid_groups import ShardGroups
from sharded_opt.inner_optimizer import check_steps
from sharded_opt.local_shard import BucketPrecision, resolve_precision
from sharded_opt.optimizer_needs import OptimizerNeeds
from sharded_opt.strategy import ShardingConfig, Strategy
from sharded_opt.validation import TORCH_OPTIMIZERS


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
    sharded = config.enable and groups.shard_size > 1
    bucket_sizes = config.bucket_sizes(trainable_bytes(specs))
    plan = plan_layout(
        specs,
        groups.shard_size if sharded else 1,
        align_bytes=config.align_bytes,
        bucket_size_bytes=bucket_sizes.bucket_bytes,
        first_bucket_bytes=bucket_sizes.first_bucket_bytes,
        whole_param_cost=needs.param_cost if needs.whole_params else None,
    )
    precisions = [
        resolve_precision(bucket.dtype, config.reduce_dtype, config.master_dtype) for bucket in plan.buckets
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


def build_communicator(
    buffers: FlatBuffers, groups: ShardGroups, config: ShardingConfig, precisions: list[BucketPrecision]
) -> BucketCommunicator:
    """Sharded over the shard group where sharding is on and it has several ranks; otherwise
    all-reducing (or, on one rank, leaving) the grads of the whole group."""
    if config.enable and groups.shard_size > 1:
        return BucketCommunicator(
            buffers,
            groups.shard,
            groups.shard_rank,
            groups.shard_size,
            True,
            precisions,
            replicate_group=groups.replicate,
            point_to_point=config.gloo_point_to_point,
        )
    world = groups.world
    return BucketCommunicator(
        buffers, world, dist.get_rank(world), dist.get_world_size(world), False, precisions
    )
