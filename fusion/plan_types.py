"""The plan's value types: what the planner knows of a param, where it lies, a bucket, the layout.

``fusion.layout`` computes these (its module docstring holds the Notes they follow) and
re-exports them; the flat buffers, the wrapper and the planner read them. Frozen dataclasses, so
a plan can be shared and compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusion.block_layout import BlockGrid


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the planner needs to know about one param (no tensor is kept)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    group_index: int
    requires_grad: bool = True
    """Frozen and trainable params never share a bucket, so a bucket of frozen params costs no
    grad memory and no communication until one of them is unfrozen."""
    strides: tuple[int, ...] | None = None
    """Strides the param keeps in its bucket (channels_last, ...), see Note [Memory format];
    None: contiguous."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, param: torch.Tensor, group_index: int) -> ParamSpec:
        return cls(
            tuple(param.shape),
            param.dtype,
            param.device,
            group_index,
            requires_grad=param.requires_grad,
            strides=kept_strides(param),
        )


def kept_strides(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The tensor's strides if they are not the contiguous ones and its view in a bucket can keep
    them (dense and non-overlapping: its elements fill ``numel`` consecutive slots in some
    dimension order), else None. See Note [Memory format]."""
    strides = tuple(tensor.stride())
    if strides == _contiguous_strides(tuple(tensor.shape)) or tensor.numel() == 0:
        return None
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(strides, tensor.shape, strict=True) if n != 1):
        if stride != expected:
            return None
        expected *= size
    return strides


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where param ``param_index`` (its position in the planner's input) lives in its bucket."""

    param_index: int
    bucket_index: int
    offset: int
    numel: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    """The param's strides inside its ``numel`` slots, see Note [Memory format]; None:
    contiguous."""


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """A contiguous run of one param that falls inside one rank's shard of a bucket.

    ``param_start`` counts elements from the start of the flattened param (in its memory order,
    see Note [Memory format]), ``shard_start`` from
    the start of the rank's shard.
    """

    param_index: int
    param_start: int
    shard_start: int
    numel: int


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """One flat buffer: its params (slots, in layout order) and its padded, shardable size."""

    index: int
    dtype: torch.dtype
    device: torch.device
    group_index: int
    slots: tuple[ParamSlot, ...]
    used_numel: int
    padded_numel: int
    world_size: int
    requires_grad: bool = True
    whole_params: bool = False
    """Each param lies inside one rank's shard, see Note [Whole params per owner]."""
    staged_grads: bool = False
    """Grads stay autograd's tensors and are copied into the grad buffer before the reduction,
    see Note [Staged grads]."""
    block_grid: BlockGrid | None = None
    """The optimizer quantizes state on this grid; every shard boundary is an allowed cut, see
    Note [Cuts on quantization blocks] in ``block_layout``."""

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Half-open element range ``[start, end)`` of ``rank``'s shard inside this bucket."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def shard_pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """The pieces of params held by ``rank``'s shard; padding is not part of any piece.

        A zero-element param is one empty piece on the rank whose shard holds its offset (the
        last rank when none does): torch keeps state for it once it has a grad (a ``step``
        count, empty tensors), so exactly one rank must step it and own that state."""
        shard_start, shard_end = self.shard_range(rank)
        pieces = []
        for slot in self.slots:
            if slot.numel == 0:
                if self.empty_slot_rank(slot) == rank:
                    pieces.append(ShardPiece(slot.param_index, 0, slot.offset - shard_start, 0))
                continue
            start = max(slot.offset, shard_start)
            end = min(slot.offset + slot.numel, shard_end)
            if start < end:
                pieces.append(
                    ShardPiece(slot.param_index, start - slot.offset, start - shard_start, end - start)
                )
        return tuple(pieces)

    def empty_slot_rank(self, slot: ParamSlot) -> int:
        """The rank that holds zero-element ``slot``, see :meth:`shard_pieces`."""
        return min(slot.offset // self.shard_numel, self.world_size - 1)


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    """The whole layout: buckets in order and, for each input param, its slot (or None if it was
    left out of the plan)."""

    buckets: tuple[BucketPlan, ...]
    slots: tuple[ParamSlot | None, ...]
    world_size: int
    align_bytes: int

    def slot(self, param_index: int) -> ParamSlot:
        slot = self.slots[param_index]
        if slot is None:
            raise KeyError(f"param {param_index} is not laid out (it was left out of the plan)")
        return slot

    @property
    def padding_numel(self) -> int:
        """Elements of all buckets that hold no param (alignment gaps and shard padding)."""
        return sum(bucket.padded_numel - sum(slot.numel for slot in bucket.slots) for bucket in self.buckets)

    def owner(self, param_index: int) -> int:
        """The rank whose shard holds the whole param, see Note [Whole params per owner]."""
        slot = self.slot(param_index)
        bucket = self.buckets[slot.bucket_index]
        if not bucket.whole_params:
            raise ValueError(
                f"LayoutPlan.owner: param {param_index} is laid out element-wise, it has no owner"
            )
        if slot.numel == 0:  # it occupies nothing; it may start where the next shard does
            return bucket.empty_slot_rank(slot)
        return slot.offset // bucket.shard_numel
