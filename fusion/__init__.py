"""Flat, aligned, shardable buffer layout for params and grads (no communication here)."""

from fusion.buffers import FlatBuffers
from fusion.layout import (
    DEFAULT_ALIGN_BYTES,
    BucketPlan,
    LayoutPlan,
    ParamSlot,
    ParamSpec,
    ShardPiece,
    align_numel,
    plan_layout,
)

__all__ = [
    "DEFAULT_ALIGN_BYTES",
    "BucketPlan",
    "FlatBuffers",
    "LayoutPlan",
    "ParamSlot",
    "ParamSpec",
    "ShardPiece",
    "align_numel",
    "plan_layout",
]
