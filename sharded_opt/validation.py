"""Boundary checks for ShardingStage1: each user mistake is caught once, before anything is
changed, with a message that names the problem and the fix."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from fusion.layout import ParamSpec

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
"""Optimizers whose update of each element depends only on that element's own grad and state
(plus scalars), so running them on an arbitrary flat slice of the params gives the same result
as running them on whole params."""


def check_optimizer(optimizer: object, assume_elementwise: bool) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "ShardingStage1 expects a torch.optim.Optimizer instance, e.g. "
            f"ShardingStage1(torch.optim.AdamW(model.parameters())), but got {type(optimizer).__name__}"
        )
    if getattr(optimizer, "_sharded_opt_wrapper", None) is not None:
        raise ValueError(
            "ShardingStage1 was given an optimizer that is already wrapped by a ShardingStage1; "
            "wrap each optimizer once and use the wrapper"
        )
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS and not assume_elementwise:
        supported = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"ShardingStage1 shards flat slices of params, which is only correct for element-wise "
            f"optimizers ({supported}) but got {type(optimizer).__name__}. If every element's update "
            "depends only on its own grad and state, pass assume_elementwise=True."
        )
    return optimizer


def collect_params(optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], list[ParamSpec | None]]:
    """Flatten the optimizer's params in registration order with a spec (None if frozen)."""
    params: list[Tensor] = []
    specs: list[ParamSpec | None] = []
    seen: dict[int, int] = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) in seen:
                raise ValueError(
                    f"ShardingStage1 expects each param once but param {len(params)} (group "
                    f"{group_index}) is the same tensor as param {seen[id(param)]}; remove the "
                    "duplicate from the optimizer's param groups"
                )
            seen[id(param)] = len(params)
            if param.is_sparse or param.layout != torch.strided:
                raise ValueError(
                    f"ShardingStage1 expects dense params but param {len(params)} (group "
                    f"{group_index}) has layout {param.layout}; sparse params cannot live in flat buffers"
                )
            params.append(param)
            specs.append(ParamSpec.of(param, group_index) if param.requires_grad else None)
    trainable = [spec for spec in specs if spec is not None]
    if not trainable:
        raise ValueError(
            f"ShardingStage1 expects an optimizer with trainable params but got {len(params)} "
            "params, none with requires_grad=True"
        )
    devices = sorted({str(spec.device) for spec in trainable})
    if len(devices) > 1:
        raise ValueError(
            f"ShardingStage1 expects all params on one device but got params on {devices}; move "
            "the model to one device (the rank's own) before building the optimizer"
        )
    return params, specs


def resolve_process_group(process_group: ProcessGroup | None) -> tuple[ProcessGroup, int, int]:
    """The group (default: the whole world), this rank's index in it and its size."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ShardingStage1 needs an initialized torch.distributed process group; call "
            "sharded_opt.init_parallel_env() first (under sharded_opt.spawn or torchrun), or "
            "torch.distributed.init_process_group(...)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("ShardingStage1 was given a process_group that this rank is not a member of")
    return group, rank, dist.get_world_size(group)


def check_same_layout(specs: list[ParamSpec | None], group: ProcessGroup, world_size: int) -> None:
    """Raise on every rank if any rank's params differ from rank 0's (collective)."""
    signature = [
        None if spec is None else (spec.shape, str(spec.dtype), spec.group_index, spec.strides)
        for spec in specs
    ]
    signatures: list[object] = [None] * world_size
    dist.all_gather_object(signatures, signature, group=group)
    reference = signatures[0]
    for rank, other in enumerate(signatures):
        if other != reference:
            raise ValueError(
                f"ShardingStage1 expects the same params on every rank but rank {rank} differs from "
                f"rank 0: {_first_difference(reference, other)}. Build the same model and optimizer "
                "(same param groups, shapes, dtypes and frozen params) on every rank"
            )


def _first_difference(reference: list, other: list) -> str:
    if len(reference) != len(other):
        return f"{len(other)} params instead of {len(reference)}"
    for index, (mine, theirs) in enumerate(zip(reference, other, strict=True)):
        if mine != theirs:
            return f"param {index} is {_describe(theirs)} instead of {_describe(mine)}"
    return "no difference found"


def _describe(signature: tuple | None) -> str:
    if signature is None:
        return "frozen"
    shape, dtype, group_index, strides = signature
    layout = "" if strides is None else f" with strides {list(strides)}"
    return f"shape {list(shape)} {dtype}{layout} in group {group_index}"
