"""Pure layout planning: where every parameter lives in the flat, padded, sharded buckets.

Nothing here allocates a tensor or talks to another rank; a plan is a frozen description that
``fusion.buffers`` executes and that the communication code in ``sharded_opt`` reads.

Note [Alignment and padding]
    A param of at least ``align_bytes // element_size`` elements (256 bytes by default, as in
    Paddle's fused buffers) starts at a multiple of that many elements, so that its view, and
    vectorized kernels over it, start on an aligned address. A smaller param (a scalar, a bias
    of a few elements) is packed densely right after the param before it: a kernel over fewer
    elements than one aligned block gains nothing from an aligned start, while padding it to a
    full block made a model of scalar params take 64 times its size (fp32, 256 bytes). It does
    start at a multiple of the largest power of two that divides its size in bytes, up to 16
    bytes (``MAX_VIEW_ALIGN_BYTES``): a fresh tensor starts at offset 0, so models read small
    params through views as wider dtypes (``torch.view_as_complex`` of a (3, 2) fp32 weight kept
    as real pairs, ``param.view(torch.float32)`` of a bf16 one), which need an offset divisible
    by the wider itemsize; packed at an odd offset the view raised. A scalar still takes its own
    size, and any view the param's size allows stays possible. Each
    bucket's numel is padded to a multiple of ``world_size * align_elems``: the bucket then splits
    into ``world_size`` equal shards (equal shards are what reduce_scatter/all_gather need) and
    every shard also starts aligned. The weaker rule ``lcm(world_size, align_elems)`` used
    elsewhere gives equal shards whose starts are not aligned (world_size 2, 64-element
    alignment: shards of 32 elements). The price is at most ``world_size * align_elems - 1``
    padding elements per bucket, negligible next to a bucket.

Note [Bucket order]
    Params are laid out in reverse registration order, which approximates the order in which
    backward produces their grads; bucket 0 is therefore the first one ready in backward. A param
    is never split across buckets, and a bucket holds one dtype, one device and one param group,
    so each bucket maps onto one flat tensor and one optimizer param group. Params frozen when the
    plan is made get buckets of their own, which need no grad buffer until a param is unfrozen.

Note [Memory format]
    A param that is not contiguous but dense (channels_last conv weights, a transposed weight)
    keeps its strides: its slot holds its elements in its own memory order, and its param and
    grad views are strided views of the slot (``torch.as_strided``). Kernels then see the memory
    format the user chose, and autograd's grads, which follow the param's strides, accumulate
    in place. Everything that treats a slot as flat data (collectives, the optimizer, shard
    pieces) works on memory order, which is the same on every rank (the strides are part of
    the check that all ranks hold the same params); a slot's state becomes a tensor of the
    param's shape with the param's strides (``fusion.buffers.view_slot``), and a tensor is cut
    into a slot in memory order (``fusion.buffers.flatten_to_slot``). A param that is not dense
    (a slice with gaps) cannot be viewed that way and is laid out contiguous.

Note [First bucket]
    Bucket 0 of each kind holds the last-registered params, whose grads backward produces first;
    its reduction cannot start before every one of its params has a grad. A small first bucket
    (DDP uses 1 MiB) therefore starts communication early in backward, while later buckets stay
    large enough to amortize a collective's fixed cost. ``first_bucket_bytes`` bounds that bucket
    alone; see ``fusion.bucket_sizing`` for how the wrapper picks both sizes.

Note [Whole params per owner]
    Element-wise optimizers may step any flat slice of a param, so a shard ignores param
    boundaries. An optimizer that needs each param whole (Muon orthogonalizes a whole matrix by
    Newton-Schulz; Adafactor keeps row and column factors of it) cannot step half a matrix. With
    ``whole_param_cost`` the planner therefore gives each param of a bucket one owner among the
    ``world_size`` ranks and lays every owner's params out inside the owner's own shard, so the
    rank's shard pieces are whole params, which it steps in their own shape. Nothing else
    changes: each bucket is still one flat buffer cut into ``world_size`` equal, aligned shards,
    and reduce-scatter and all-gather move exactly what they move for element-wise optimizers.
    Moonshot's distributed Muon instead gathers each matrix's grad shards before Newton-Schulz
    and scatters the update afterwards; owning whole params needs no collective beyond ZeRO-1's.

    Each bucket is filled as before (same order, same keys), with its bound multiplied by
    ``world_size``, so that each shard, not the whole bucket, is about the bound: a shard must
    hold a few whole params for the shards to come out nearly equal. The bucket's params are
    split into ``world_size`` bins by the greedy largest-first rule on numel (each param, largest
    first, into the bin with the fewest elements): the largest bin sets the shard size, and every
    smaller bin is padded up to it, so balancing numel is what keeps the padding small. The bins
    are then given to ranks by work (``whole_param_cost`` of each param's shape, e.g. Muon's
    Newton-Schulz flops ``m * n * min(m, n)``): the costliest bin to the rank with the least
    work so far over the buckets already planned, so the step time, which the slowest rank
    sets, stays balanced over the whole model and not only within each bucket. Frozen params
    are laid out the same way but add no work. The price is padding: at most the largest
    param of a bucket per shard, reported by ``LayoutPlan.padding_numel``.

Note [Staged grads]
    A bucket's grads are normally views of its flat grad buffer, so backward accumulates straight
    into the memory the reduction reads, and the wrapper learns of each grad from a hook on its
    param. With many tiny params (a model of 10,000 scalars, per-channel gates) that costs a
    Python call and an in-place add per param per backward, which plain torch does not pay (it
    keeps autograd's grad tensor): above 1.26 times plain torch's backward before the hook does
    anything. A bucket of at least ``STAGED_GRADS_MIN_PARAMS`` params that are all below one
    aligned block (the densely packed ones, see Note [Alignment and padding]) therefore *stages*
    its grads: ``param.grad`` stays autograd's own tensor, as in torch (None until a backward
    reaches the param, None again after ``zero_grad()``), and the whole bucket is copied into
    its grad buffer in one ``torch._foreach_copy_`` right before its reduction, which therefore
    runs at ``step()`` in both modes. A bucket with a larger param, or with fewer small params,
    keeps views and hooks: its reduction can then start during backward, and its few hooks cost
    nothing that shows. Whether a bucket stages is a fact of the layout, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusion.block_layout import BlockGrid, place_on_blocks
from fusion.plan_types import BucketPlan, LayoutPlan, ParamSlot, ParamSpec, ShardPiece, kept_strides

__all__ = [
    "DEFAULT_ALIGN_BYTES",
    "BucketPlan",
    "LayoutPlan",
    "ParamSlot",
    "ParamSpec",
    "ShardPiece",
    "align_numel",
    "kept_strides",
    "plan_layout",
    "round_up",
    "slot_offset",
]

MAX_VIEW_ALIGN_BYTES = 16
"""The widest dtype (complex128) in bytes: a param may be viewed as any dtype up to this wide,
see Note [Alignment and padding]."""

DEFAULT_ALIGN_BYTES = 256
"""Param and shard start alignment; 256 bytes covers 128-byte cache lines and GPU vector loads.
Params smaller than this are packed densely, see Note [Alignment and padding]."""

STAGED_GRADS_MIN_PARAMS = 64
"""A bucket of at least this many params, each smaller than one aligned block, stages its grads
instead of viewing them, see Note [Staged grads]."""


def align_numel(dtype: torch.dtype, align_bytes: int) -> int:
    """Alignment in elements of ``dtype``; at least one element."""
    return max(1, align_bytes // dtype.itemsize)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def slot_offset(cursor: int, numel: int, align: int, itemsize: int) -> int:
    """Where a param of ``numel`` elements of ``itemsize`` bytes starts when the bucket's used
    part ends at ``cursor``: aligned to ``align`` elements if it has at least that many, else
    packed at ``cursor`` rounded up to the wider views its size allows, see Note [Alignment and
    padding]."""
    block = align if numel >= align else 1
    return round_up(cursor, max(block, view_align_numel(numel, itemsize)))


def view_align_numel(numel: int, itemsize: int) -> int:
    """The start alignment, in elements, that keeps every view of a param of ``numel`` elements
    as a dtype of up to ``MAX_VIEW_ALIGN_BYTES`` bytes possible: the largest power of two that
    divides its size in bytes, at most that many bytes."""
    size_bytes = numel * itemsize
    largest = size_bytes & -size_bytes if size_bytes else 1  # the largest power of two dividing it
    return max(1, min(largest, MAX_VIEW_ALIGN_BYTES) // itemsize)


def plan_layout(
    params: list[ParamSpec | None],
    world_size: int,
    *,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
    bucket_size_bytes: int,
    first_bucket_bytes: int | None = None,
    whole_param_cost: Callable[[tuple[int, ...]], int] | None = None,
    block_grid: BlockGrid | None = None,
) -> LayoutPlan:
    """Plan the flat buckets for ``params`` given in registration order.

    Args:
        params: one entry per optimizer param in registration order; ``None`` marks a param that
            is left out and keeps its index free. Params that do not require grad get buckets
            of their own (see :class:`ParamSpec`).
        world_size: number of shards each bucket is split into.
        align_bytes: start alignment of each shard and of each param of at least this many
            bytes (smaller ones are packed densely), see Note [Alignment and padding].
        bucket_size_bytes: a bucket is closed once adding the next param would exceed this size;
            a param larger than this gets a bucket of its own.
        first_bucket_bytes: the same bound for the first bucket of each (dtype, device, param
            group, requires_grad) kind, the one backward fills first; None means
            ``bucket_size_bytes``. A small first bucket lets communication start early in
            backward, see Note [First bucket].
        whole_param_cost: None lays params out for element-wise optimizers (shards ignore param
            boundaries). Otherwise every param lies whole inside one rank's shard, owners
            balanced by this work per param shape, and both bucket bounds apply per shard; see
            Note [Whole params per owner].
        block_grid: the optimizer's quantization blocks: shard boundaries fall only on cuts that
            keep its decisions and blocks, see Note [Cuts on quantization blocks] in
            ``block_layout``. Not with ``whole_param_cost``.

    Returns:
        A frozen :class:`LayoutPlan`; see Note [Bucket order].

    Raises:
        ValueError: for a non-positive world size, alignment or bucket size.
    """
    first_bucket_bytes = bucket_size_bytes if first_bucket_bytes is None else first_bucket_bytes
    if world_size < 1:
        raise ValueError(f"plan_layout expects world_size >= 1 but got {world_size}")
    if align_bytes < 1:
        raise ValueError(f"plan_layout expects align_bytes >= 1 but got {align_bytes}")
    if bucket_size_bytes < 1:
        raise ValueError(f"plan_layout expects bucket_size_bytes >= 1 but got {bucket_size_bytes}")
    if first_bucket_bytes < 1:
        raise ValueError(f"plan_layout expects first_bucket_bytes >= 1 or None but got {first_bucket_bytes}")
    if whole_param_cost is not None and block_grid is not None:
        raise ValueError("plan_layout expects whole_param_cost or block_grid, not both")
    if whole_param_cost is not None:
        bucket_size_bytes *= world_size
        first_bucket_bytes *= world_size

    open_buckets: dict[tuple[torch.dtype, torch.device, int, bool], _OpenBucket] = {}
    closed: list[_OpenBucket] = []
    for index in reversed(range(len(params))):
        spec = params[index]
        if spec is None:
            continue
        key = (spec.dtype, spec.device, spec.group_index, spec.requires_grad)
        bucket = open_buckets.setdefault(
            key, _OpenBucket(align_numel(spec.dtype, align_bytes), first_bucket_bytes)
        )
        if bucket.members and bucket.bytes_after(spec) > bucket.limit_bytes:
            closed.append(bucket)
            bucket = open_buckets[key] = _OpenBucket(bucket.align, bucket_size_bytes)
        bucket.add(index, spec)
    closed.extend(bucket for bucket in open_buckets.values() if bucket.members)
    # Order buckets by the layout position of their first param, see Note [Bucket order].
    closed.sort(key=lambda bucket: -bucket.members[0][0])

    buckets = []
    slots: list[ParamSlot | None] = [None] * len(params)
    work_per_rank = [0] * world_size
    plain_held = [0] * world_size  # elements of params kept plain by a quantizing class, per rank
    for bucket_index, open_bucket in enumerate(closed):
        if block_grid is not None:
            bucket = _build_block_bucket(
                bucket_index, open_bucket.members, world_size, align_bytes, block_grid, plain_held
            )
        elif whole_param_cost is None:
            bucket = _build_bucket(bucket_index, open_bucket.members, world_size, align_bytes)
        else:
            bucket = _build_owned_bucket(
                bucket_index, open_bucket.members, world_size, align_bytes, whole_param_cost, work_per_rank
            )
        buckets.append(bucket)
        for slot in bucket.slots:
            slots[slot.param_index] = slot
    return LayoutPlan(tuple(buckets), tuple(slots), world_size, align_bytes)


def _build_bucket(
    bucket_index: int, members: list[tuple[int, ParamSpec]], world_size: int, align_bytes: int
) -> BucketPlan:
    first = members[0][1]
    align = align_numel(first.dtype, align_bytes)
    placed, cursor = _pack(members, align)
    slots = [
        ParamSlot(param_index, bucket_index, offset, spec.numel, spec.shape, spec.strides)
        for param_index, spec, offset in placed
    ]
    padded = round_up(max(cursor, 1), world_size * align)
    return BucketPlan(
        bucket_index,
        first.dtype,
        first.device,
        first.group_index,
        tuple(slots),
        cursor,
        padded,
        world_size,
        first.requires_grad,
        staged_grads=_stages_grads(members, align),
    )


def _build_block_bucket(
    bucket_index: int,
    members: list[tuple[int, ParamSpec]],
    world_size: int,
    align_bytes: int,
    grid: BlockGrid,
    plain_held: list[int],
) -> BucketPlan:
    """A bucket whose shard boundaries fall on allowed cuts of ``grid``, see Note [Cuts on
    quantization blocks] in ``block_layout``; ``plain_held`` as ``place_on_blocks`` takes it."""
    first = members[0][1]
    align = align_numel(first.dtype, align_bytes)
    offsets, shard_numel = place_on_blocks(
        [spec.numel for _, spec in members],
        world_size,
        align,
        grid,
        lambda cursor, numel: slot_offset(cursor, numel, align, first.dtype.itemsize),
        plain_held,
    )
    slots = tuple(
        ParamSlot(param_index, bucket_index, offset, spec.numel, spec.shape, spec.strides)
        for (param_index, spec), offset in zip(members, offsets, strict=True)
    )
    used = max((slot.offset + slot.numel for slot in slots), default=0)
    return BucketPlan(
        bucket_index,
        first.dtype,
        first.device,
        first.group_index,
        slots,
        used,
        shard_numel * world_size,
        world_size,
        first.requires_grad,
        staged_grads=_stages_grads(members, align),
        block_grid=grid,
    )


def _stages_grads(members: list[tuple[int, ParamSpec]], align: int) -> bool:
    """Whether a bucket of ``members`` stages its grads, see Note [Staged grads]."""
    return len(members) >= STAGED_GRADS_MIN_PARAMS and all(spec.numel < align for _, spec in members)


def _build_owned_bucket(
    bucket_index: int,
    members: list[tuple[int, ParamSpec]],
    world_size: int,
    align_bytes: int,
    cost: Callable[[tuple[int, ...]], int],
    work_per_rank: list[int],
) -> BucketPlan:
    """A bucket whose params each lie whole in one rank's shard; adds the bucket's work to
    ``work_per_rank``. See Note [Whole params per owner]."""
    first = members[0][1]
    align = align_numel(first.dtype, align_bytes)
    bins: list[list[tuple[int, ParamSpec]]] = [[] for _ in range(world_size)]
    bin_numel = [0] * world_size
    for member in sorted(members, key=lambda m: -m[1].numel):  # stable: ties keep layout order
        fewest = min(range(world_size), key=lambda b: (bin_numel[b], b))
        bins[fewest].append(member)
        bin_numel[fewest] += member[1].numel
    bin_work = [
        sum(cost(spec.shape) for _, spec in members) if first.requires_grad else 0 for members in bins
    ]
    ranks_by_work = sorted(range(world_size), key=lambda r: (work_per_rank[r], r))
    bins_by_work = sorted(range(world_size), key=lambda b: (-bin_work[b], b))
    owned = [0] * world_size
    for rank, bin_index in zip(ranks_by_work, bins_by_work, strict=True):
        owned[rank] = bin_index
        work_per_rank[rank] += bin_work[bin_index]
    layouts = [_pack(sorted(bins[owned[rank]], key=lambda m: -m[0]), align) for rank in range(world_size)]
    shard_numel = round_up(max(1, *(end for _, end in layouts)), align)
    slots = [
        ParamSlot(index, bucket_index, rank * shard_numel + offset, spec.numel, spec.shape, spec.strides)
        for rank, (placed, _) in enumerate(layouts)
        for index, spec, offset in placed
    ]
    return BucketPlan(
        bucket_index,
        first.dtype,
        first.device,
        first.group_index,
        tuple(slots),
        max(slot.offset + slot.numel for slot in slots),
        shard_numel * world_size,
        world_size,
        first.requires_grad,
        whole_params=True,
        staged_grads=_stages_grads(members, align),
    )


def _pack(members: list[tuple[int, ParamSpec]], align: int) -> tuple[list[tuple[int, ParamSpec, int]], int]:
    """Offsets of ``members`` laid out from 0 by the rules of Note [Alignment and padding], and
    the end of the last one."""
    placed, cursor = [], 0
    for index, spec in members:
        offset = slot_offset(cursor, spec.numel, align, spec.dtype.itemsize)
        placed.append((index, spec, offset))
        cursor = offset + spec.numel
    return placed, cursor


class _OpenBucket:
    """A bucket being filled: its members, the cursor after the last one in elements, and the
    size in bytes past which it is closed."""

    def __init__(self, align: int, limit_bytes: int) -> None:
        self.align = align
        self.limit_bytes = limit_bytes
        self.members: list[tuple[int, ParamSpec]] = []
        self.cursor = 0

    def bytes_after(self, spec: ParamSpec) -> int:
        offset = slot_offset(self.cursor, spec.numel, self.align, spec.dtype.itemsize)
        return (offset + spec.numel) * spec.dtype.itemsize

    def add(self, index: int, spec: ParamSpec) -> None:
        self.members.append((index, spec))
        self.cursor = slot_offset(self.cursor, spec.numel, self.align, spec.dtype.itemsize) + spec.numel
