"""Tests for the pure layout planner in ``fusion.layout``.

Expected values are worked out here and in ``tests/harness/layout_reference.py`` from the layout rules
(reverse registration order, aligned offsets for params of at least ``align_elems`` elements and
dense packing of smaller ones, each param starting where every view its byte size allows, up to
16-byte dtypes, is possible, greedy bucket closing, padding to ``world_size * align_elems``), not
from the planner.
"""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusion.layout import (
    DEFAULT_ALIGN_BYTES,
    STAGED_GRADS_MIN_PARAMS,
    LayoutPlan,
    ParamSlot,
    ParamSpec,
    ShardPiece,
    align_numel,
    plan_layout,
    round_up,
)
from tests.harness.layout_reference import (
    CPU,
    ITEMSIZE,
    align_bytes_st,
    bucket_sizes,
    ceil_to,
    elems_per_align,
    param_lists,
    reference_buckets,
    spec,
    start_after,
    view_alignment,
    world_sizes,
)

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_plan(
    plan: LayoutPlan, params: list[ParamSpec | None], world_size: int, align_bytes: int, bsize: int
):
    assert plan.world_size == world_size
    assert plan.align_bytes == align_bytes
    assert len(plan.slots) == len(params)

    # Frozen params have no slot; every other param has exactly one, in the bucket it names.
    seen: set[int] = set()
    for b, bucket in enumerate(plan.buckets):
        assert bucket.index == b
        assert bucket.world_size == world_size
        assert bucket.slots, "an empty bucket should not exist"
        for slot in bucket.slots:
            assert slot.param_index not in seen
            seen.add(slot.param_index)
            assert slot.bucket_index == b
            assert plan.slots[slot.param_index] == slot
    for index, p in enumerate(params):
        if p is None:
            assert plan.slots[index] is None
            with pytest.raises(KeyError):
                plan.slot(index)
        else:
            assert index in seen
            slot = plan.slot(index)
            assert slot.shape == p.shape
            assert slot.numel == math.prod(p.shape)

    # Buckets come in layout order: the first param of each bucket sits later in reverse
    # registration order than the first param of the bucket before.
    firsts = [bucket.slots[0].param_index for bucket in plan.buckets]
    assert firsts == sorted(firsts, reverse=True)

    assert [tuple(s.param_index for s in bucket.slots) for bucket in plan.buckets] == reference_buckets(
        params, align_bytes, bsize
    )

    for bucket in plan.buckets:
        check_bucket(bucket, params, world_size, align_bytes, bsize)

    # Greedy closing: when a key has several buckets, the first param of each later bucket would
    # not have fit into the previous bucket of that key.
    by_key: dict[tuple, list] = {}
    for bucket in plan.buckets:
        by_key.setdefault((bucket.dtype, bucket.device, bucket.group_index), []).append(bucket)
    for key_buckets in by_key.values():
        for prev, nxt in pairwise(key_buckets):
            align = elems_per_align(prev.dtype, align_bytes)
            first = nxt.slots[0]
            end_if_added = (
                start_after(prev.used_numel, first.numel, align, ITEMSIZE[prev.dtype]) + first.numel
            )
            assert end_if_added * ITEMSIZE[prev.dtype] > bsize
            # And buckets of one key never interleave in layout order.
            assert prev.slots[-1].param_index > first.param_index


def check_bucket(bucket, params, world_size: int, align_bytes: int, bsize: int):
    members = [params[s.param_index] for s in bucket.slots]
    # Homogeneous: one dtype, one device, one group.
    for p in members:
        assert p.dtype == bucket.dtype
        assert p.device == bucket.device
        assert p.group_index == bucket.group_index

    itemsize = ITEMSIZE[bucket.dtype]
    align = elems_per_align(bucket.dtype, align_bytes)

    # Reverse registration order, no overlap, tight packing: a param of at least one aligned
    # block starts at the first aligned offset after the one before it, a smaller one at the
    # first offset after it where its wider views are possible.
    end = 0
    prev_index = None
    for slot in bucket.slots:
        if prev_index is not None:
            assert slot.param_index < prev_index
        prev_index = slot.param_index
        alignment = max(align if slot.numel >= align else 1, view_alignment(slot.numel, itemsize))
        assert slot.offset % alignment == 0
        assert slot.offset >= end
        assert slot.offset - end < alignment
        end = slot.offset + slot.numel
    assert bucket.used_numel == end

    # Size rule: only a lone param may exceed the bucket size.
    if len(bucket.slots) > 1:
        assert bucket.used_numel * itemsize <= bsize

    # Padding: a multiple of world_size * align, at least one element, and minimal.
    quantum = world_size * align
    assert bucket.padded_numel % quantum == 0
    assert bucket.padded_numel >= max(bucket.used_numel, 1)
    assert bucket.padded_numel - max(bucket.used_numel, 1) < quantum
    assert bucket.padded_numel == ceil_to(max(bucket.used_numel, 1), quantum)

    # Equal shards that tile the padded bucket, each starting aligned.
    shard = bucket.shard_numel
    assert shard * world_size == bucket.padded_numel
    assert shard % align == 0
    for rank in range(world_size):
        assert bucket.shard_range(rank) == (rank * shard, (rank + 1) * shard)

    # Element coverage: every param element in exactly one piece of exactly one rank, at the
    # bucket position its slot says; padding in no piece. A zero-element param is one empty
    # piece, on the rank whose shard holds its offset (the last one past the end).
    bucket_hits = np.zeros(bucket.padded_numel, dtype=np.int64)
    param_hits = {s.param_index: np.zeros(s.numel, dtype=np.int64) for s in bucket.slots}
    slot_of = {s.param_index: s for s in bucket.slots}
    empty_holders: dict[int, list[int]] = {s.param_index: [] for s in bucket.slots if s.numel == 0}
    for rank in range(world_size):
        shard_lo = rank * shard
        for piece in bucket.shard_pieces(rank):
            assert isinstance(piece, ShardPiece)
            if slot_of[piece.param_index].numel == 0:
                assert piece.numel == 0 and piece.param_start == 0
                empty_holders[piece.param_index].append(rank)
            assert piece.numel > 0 or piece.param_index in empty_holders
            assert piece.shard_start >= 0
            assert piece.shard_start + piece.numel <= shard
            slot = slot_of[piece.param_index]
            assert piece.param_start >= 0
            assert piece.param_start + piece.numel <= slot.numel
            assert slot.offset + piece.param_start == shard_lo + piece.shard_start
            lo = shard_lo + piece.shard_start
            bucket_hits[lo : lo + piece.numel] += 1
            param_hits[piece.param_index][piece.param_start : piece.param_start + piece.numel] += 1
    for hits in param_hits.values():
        assert np.all(hits == 1)
    for index, holders in empty_holders.items():
        assert holders == [min(slot_of[index].offset // shard, world_size - 1)]
    expected = np.zeros(bucket.padded_numel, dtype=np.int64)
    for slot in bucket.slots:
        expected[slot.offset : slot.offset + slot.numel] = 1
    assert np.array_equal(bucket_hits, expected)


# --------------------------------------------------------------------------------------------
# Property tests


@PROPERTY_SETTINGS
@given(params=param_lists(), world_size=world_sizes, align_bytes=align_bytes_st, bsize=bucket_sizes)
def test_plan_properties(params, world_size, align_bytes, bsize):
    plan = plan_layout(params, world_size, align_bytes=align_bytes, bucket_size_bytes=bsize)
    check_plan(plan, params, world_size, align_bytes, bsize)


@PROPERTY_SETTINGS
@given(
    numels=st.lists(st.integers(1, 7), min_size=1, max_size=10),
    world_size=world_sizes,
    align_bytes=st.sampled_from([1, 2, 4, 8]),
)
def test_tiny_params_many_ranks(numels, world_size, align_bytes):
    """Params smaller than the world size: many ranks hold nothing or share one param."""
    params = [spec(n) for n in numels]
    plan = plan_layout(params, world_size, align_bytes=align_bytes, bucket_size_bytes=1 << 20)
    assert len(plan.buckets) == 1
    check_plan(plan, params, world_size, align_bytes, 1 << 20)


@PROPERTY_SETTINGS
@given(params=param_lists(), world_size=world_sizes, align_bytes=align_bytes_st, bsize=bucket_sizes)
def test_plan_is_deterministic(params, world_size, align_bytes, bsize):
    """Every rank plans independently, so the same input must give the same plan."""
    first = plan_layout(params, world_size, align_bytes=align_bytes, bucket_size_bytes=bsize)
    second = plan_layout(list(params), world_size, align_bytes=align_bytes, bucket_size_bytes=bsize)
    assert first == second


@PROPERTY_SETTINGS
@given(params=param_lists(), world_size=world_sizes, align_bytes=align_bytes_st)
def test_huge_bucket_gives_one_bucket_per_key(params, world_size, align_bytes):
    plan = plan_layout(params, world_size, align_bytes=align_bytes, bucket_size_bytes=1 << 40)
    keys = {(p.dtype, p.device, p.group_index) for p in params if p is not None}
    assert len(plan.buckets) == len(keys)
    assert {(b.dtype, b.device, b.group_index) for b in plan.buckets} == keys


@PROPERTY_SETTINGS
@given(params=param_lists(), world_size=world_sizes, align_bytes=align_bytes_st)
def test_one_byte_bucket_gives_one_bucket_per_param(params, world_size, align_bytes):
    plan = plan_layout(params, world_size, align_bytes=align_bytes, bucket_size_bytes=1)
    laid_out = [i for i, p in enumerate(params) if p is not None and math.prod(p.shape) > 0]
    # A zero-size param adds no bytes, so it may join the bucket before it; everything else is alone.
    for bucket in plan.buckets:
        assert sum(1 for s in bucket.slots if s.numel > 0) <= 1
    assert sorted(s.param_index for b in plan.buckets for s in b.slots if s.numel > 0) == laid_out


@PROPERTY_SETTINGS
@given(
    params=param_lists(),
    world_size=world_sizes,
    align_bytes=align_bytes_st,
    bsize=bucket_sizes,
    first=bucket_sizes,
)
def test_first_bucket_bound(params, world_size, align_bytes, bsize, first):
    """The first bucket of each kind closes at ``first_bucket_bytes``, the others at
    ``bucket_size_bytes``; everything else about the plan is unchanged."""
    plan = plan_layout(
        params, world_size, align_bytes=align_bytes, bucket_size_bytes=bsize, first_bucket_bytes=first
    )
    membership = [tuple(s.param_index for s in bucket.slots) for bucket in plan.buckets]
    assert membership == reference_buckets(params, align_bytes, bsize, first)
    seen_keys: set[tuple] = set()
    for bucket in plan.buckets:
        key = (bucket.dtype, bucket.device, bucket.group_index)
        limit = bsize if key in seen_keys else first
        seen_keys.add(key)
        check_bucket(bucket, params, world_size, align_bytes, limit)


def test_first_bucket_bytes_none_is_bucket_size():
    params = [spec(100) for _ in range(6)]
    plain = plan_layout(params, 2, align_bytes=4, bucket_size_bytes=800)
    assert plan_layout(params, 2, align_bytes=4, bucket_size_bytes=800, first_bucket_bytes=None) == plain


def test_small_first_bucket_worked_example():
    # Six 100-element fp32 params (400 bytes each), align 4 bytes. First bucket bound 400 bytes:
    # param 5 alone; then 800-byte buckets: params 4, 3 and 2, 1; then param 0 alone.
    params = [spec(100) for _ in range(6)]
    plan = plan_layout(params, 2, align_bytes=4, bucket_size_bytes=800, first_bucket_bytes=400)
    assert [tuple(s.param_index for s in b.slots) for b in plan.buckets] == [(5,), (4, 3), (2, 1), (0,)]


def test_first_bucket_is_per_kind():
    # Two param groups: each group's first bucket gets the small bound.
    params = [spec(100, group=g) for g in (0, 0, 0, 1, 1, 1)]
    plan = plan_layout(params, 1, align_bytes=4, bucket_size_bytes=1200, first_bucket_bytes=400)
    assert [tuple(s.param_index for s in b.slots) for b in plan.buckets] == [(5,), (4, 3), (2,), (1, 0)]


@pytest.mark.parametrize("first_bucket_bytes", [0, -1])
def test_rejects_bad_first_bucket_size(first_bucket_bytes):
    with pytest.raises(
        ValueError, match=rf"plan_layout expects first_bucket_bytes >= 1 or None but got {first_bucket_bytes}"
    ):
        plan_layout([spec(1)], 1, bucket_size_bytes=1024, first_bucket_bytes=first_bucket_bytes)


# --------------------------------------------------------------------------------------------
# Worked examples


def test_two_float32_params_world_size_3():
    # align 256 bytes / 4 bytes = 64 elements. Reverse order: param 1 (3 elems) at 0, param 0
    # (70 elems, at least one aligned block) at the next multiple of 64 -> 64. Used 134; quantum
    # 3 * 64 = 192 -> padded 192.
    plan = plan_layout([spec(70), spec(3)], 3, align_bytes=256, bucket_size_bytes=1 << 20)
    (bucket,) = plan.buckets
    assert bucket.dtype == torch.float32 and bucket.group_index == 0 and bucket.device == CPU
    assert bucket.slots == (ParamSlot(1, 0, 0, 3, (3,)), ParamSlot(0, 0, 64, 70, (70,)))
    assert plan.slots == (bucket.slots[1], bucket.slots[0])
    assert bucket.used_numel == 134
    assert bucket.padded_numel == 192
    assert bucket.shard_numel == 64
    assert bucket.shard_range(0) == (0, 64)
    assert bucket.shard_range(2) == (128, 192)
    assert bucket.shard_pieces(0) == (ShardPiece(1, 0, 0, 3),)
    assert bucket.shard_pieces(1) == (ShardPiece(0, 0, 0, 64),)
    assert bucket.shard_pieces(2) == (ShardPiece(0, 64, 0, 6),)


def test_small_params_pack_densely_big_ones_stay_aligned():
    # fp32, 64-element alignment. Reverse order: 3 (5 elems) at 0, 2 (3 elems) right after it at
    # 5, 1 (64 elems) at the next block, 64, and 0 (10 elems) right after it at 128; used 138,
    # world size 2 pads to 256.
    plan = plan_layout([spec(10), spec(64), spec(3), spec(5)], 2, align_bytes=256, bucket_size_bytes=1 << 20)
    (bucket,) = plan.buckets
    assert [(s.param_index, s.offset) for s in bucket.slots] == [(3, 0), (2, 5), (1, 64), (0, 128)]
    assert bucket.used_numel == 138
    assert bucket.padded_numel == 256
    assert bucket.shard_pieces(0) == (
        ShardPiece(3, 0, 0, 5),
        ShardPiece(2, 0, 5, 3),
        ShardPiece(1, 0, 64, 64),
    )
    assert bucket.shard_pieces(1) == (ShardPiece(0, 0, 0, 10),)


@pytest.mark.parametrize("whole_params", [False, True])
def test_buckets_of_many_small_params_only_stage_their_grads(whole_params):
    # Note [Staged grads]: at least STAGED_GRADS_MIN_PARAMS params, each below one aligned block
    # (64 fp32 elements here).
    cost = (lambda shape: math.prod(shape)) if whole_params else None

    def staged(specs, bucket_bytes=1 << 20):
        plan = plan_layout(specs, 2, align_bytes=256, bucket_size_bytes=bucket_bytes, whole_param_cost=cost)
        return [bucket.staged_grads for bucket in plan.buckets]

    many = [spec(3) for _ in range(STAGED_GRADS_MIN_PARAMS)]
    assert staged(many) == [True]
    assert staged(many[1:]) == [False]  # too few for hooks to cost anything that shows
    assert staged([*many, spec(64)]) == [False]  # one aligned param: views and hooks
    assert staged([*many, spec(63)]) == [True]
    # Each bucket decides alone: 3 * 64 scalars in 256-byte buckets, 64 each (the bound is per
    # shard with whole params: 128 and 64); 130 in 65 and 65, or all in one.
    scalars = [spec(1) for _ in range(3 * 64)]
    assert staged(scalars, bucket_bytes=256) == [True] * (3 if cost is None else 2)
    assert staged(scalars[:130], bucket_bytes=260) == ([True, True] if cost is None else [True])
    frozen = [ParamSpec(s.shape, s.dtype, s.device, s.group_index, requires_grad=False) for s in many]
    assert staged(frozen) == [True]


def test_small_params_start_where_their_wider_views_are_possible():
    # fp32, 64-element alignment. Reverse order: the scalar 3 at 0; 2, (3, 2) = 24 bytes, may be
    # viewed as complex64 (8 bytes), so it starts at 2, not 1; 1, 5 elements = 20 bytes, allows
    # no wider view and follows at 8; 0, (4, 2) = 32 bytes, may be viewed as complex128 (16
    # bytes) and starts at 16, not 13.
    plan = plan_layout(
        [spec(4, 2), spec(5), spec(3, 2), spec()], 1, align_bytes=256, bucket_size_bytes=1 << 20
    )
    (bucket,) = plan.buckets
    assert [(s.param_index, s.offset) for s in bucket.slots] == [(3, 0), (2, 2), (1, 8), (0, 16)]
    # bf16: a scalar at 0, then 4 elements (8 bytes, viewable as fp64) at 4.
    plan = plan_layout(
        [spec(4, dtype=torch.bfloat16), spec(dtype=torch.bfloat16)],
        1,
        align_bytes=256,
        bucket_size_bytes=1 << 20,
    )
    assert [(s.param_index, s.offset) for s in plan.buckets[0].slots] == [(1, 0), (0, 4)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ten_thousand_scalars_cost_their_own_size(world_size):
    # 10,000 fp32 scalars: packed densely they take 10,000 elements plus the bucket padding to a
    # multiple of world_size * 64 (with a 256-byte slot each they took 64 times that).
    plan = plan_layout([spec() for _ in range(10_000)], world_size, bucket_size_bytes=1 << 30)
    (bucket,) = plan.buckets
    assert [s.offset for s in bucket.slots] == list(range(10_000))
    assert bucket.padded_numel == ceil_to(10_000, world_size * 64)
    assert bucket.padded_numel <= 1.1 * 10_000
    assert bucket.shard_numel * world_size == bucket.padded_numel and bucket.shard_numel % 64 == 0


def test_param_split_across_shards():
    # align 1 element, world size 4: 10 + 6 = 16 elements, shards of 4.
    # Layout: param 1 (6 elems) at [0, 6), param 0 (10 elems) at [6, 16).
    plan = plan_layout([spec(2, 5), spec(6)], 4, align_bytes=4, bucket_size_bytes=1 << 20)
    (bucket,) = plan.buckets
    assert [(s.param_index, s.offset) for s in bucket.slots] == [(1, 0), (0, 6)]
    assert bucket.padded_numel == 16
    assert bucket.shard_pieces(0) == (ShardPiece(1, 0, 0, 4),)
    assert bucket.shard_pieces(1) == (ShardPiece(1, 4, 0, 2), ShardPiece(0, 0, 2, 2))
    assert bucket.shard_pieces(2) == (ShardPiece(0, 2, 0, 4),)
    assert bucket.shard_pieces(3) == (ShardPiece(0, 6, 0, 4),)


def test_padding_rounds_to_world_size_times_alignment():
    # bfloat16 with 256-byte alignment: 128 elements. World size 2: quantum 256.
    plan = plan_layout([spec(300, dtype=torch.bfloat16)], 2, bucket_size_bytes=1 << 20)
    (bucket,) = plan.buckets
    assert bucket.used_numel == 300
    assert bucket.padded_numel == 512
    assert bucket.shard_numel == 256
    assert bucket.shard_pieces(0) == (ShardPiece(0, 0, 0, 256),)
    assert bucket.shard_pieces(1) == (ShardPiece(0, 256, 0, 44),)


def test_default_alignment_is_256_bytes():
    assert DEFAULT_ALIGN_BYTES == 256
    plan = plan_layout(
        [spec(32, dtype=torch.float64), spec(1, dtype=torch.float64)], 1, bucket_size_bytes=1 << 20
    )
    # float64: 256 / 8 = 32 elements; the scalar first, the 32-element param at the next block.
    assert [s.offset for s in plan.buckets[0].slots] == [0, 32]
    assert plan.buckets[0].padded_numel == 64


def test_scalar_on_eight_ranks():
    # align_bytes 1 < itemsize: the alignment is one element, so the scalar pads to 8.
    plan = plan_layout([spec()], 8, align_bytes=1, bucket_size_bytes=1 << 20)
    (bucket,) = plan.buckets
    assert bucket.slots == (ParamSlot(0, 0, 0, 1, ()),)
    assert bucket.padded_numel == 8
    assert bucket.shard_pieces(0) == (ShardPiece(0, 0, 0, 1),)
    for rank in range(1, 8):
        assert bucket.shard_pieces(rank) == ()


def test_zero_size_param_still_gets_a_shardable_bucket():
    plan = plan_layout([spec(0, 3)], 2, align_bytes=4, bucket_size_bytes=1 << 20)
    (bucket,) = plan.buckets
    assert bucket.used_numel == 0
    assert bucket.padded_numel == 2
    # One empty piece, on the rank holding offset 0, which steps it and keeps its torch state.
    assert bucket.shard_pieces(0) == (ShardPiece(0, 0, 0, 0),) and bucket.shard_pieces(1) == ()


def test_bucket_closes_when_next_param_would_overflow():
    # align 1 element; 100 float32 = 400 bytes. Reverse order: 2, 1 fill 800 bytes exactly,
    # adding 0 would make 1200 > 800, so 0 opens a second bucket.
    params = [spec(100), spec(100), spec(100)]
    plan = plan_layout(params, 2, align_bytes=4, bucket_size_bytes=800)
    assert [[s.param_index for s in b.slots] for b in plan.buckets] == [[2, 1], [0]]
    assert [b.used_numel for b in plan.buckets] == [200, 100]
    assert [b.padded_numel for b in plan.buckets] == [200, 100]
    # One byte less and every param is alone.
    plan = plan_layout(params, 2, align_bytes=4, bucket_size_bytes=799)
    assert [[s.param_index for s in b.slots] for b in plan.buckets] == [[2], [1], [0]]


def test_bucket_size_counts_alignment_gaps():
    # 64-element alignment: param 1 (1 elem) at 0, param 0 (64 elems) would sit at 64 and end at
    # 128 -> 512 bytes.
    params = [spec(64), spec(1)]
    plan = plan_layout(params, 1, align_bytes=256, bucket_size_bytes=512)
    assert [[s.param_index for s in b.slots] for b in plan.buckets] == [[1, 0]]
    plan = plan_layout(params, 1, align_bytes=256, bucket_size_bytes=511)
    assert [[s.param_index for s in b.slots] for b in plan.buckets] == [[1], [0]]


def test_bucket_size_counts_small_params_densely():
    # Two scalars with 64-element alignment take 2 elements (8 bytes), not 65.
    plan = plan_layout([spec(1), spec(1)], 1, align_bytes=256, bucket_size_bytes=8)
    assert [[s.param_index for s in b.slots] for b in plan.buckets] == [[1, 0]]


def test_oversized_param_gets_its_own_bucket():
    params = [spec(2), spec(1000), spec(2)]
    plan = plan_layout(params, 1, align_bytes=4, bucket_size_bytes=16)
    assert [[s.param_index for s in b.slots] for b in plan.buckets] == [[2], [1], [0]]
    assert plan.buckets[1].used_numel == 1000


def test_buckets_split_by_dtype_device_and_group():
    params = [
        spec(4),  # 0: f32 g0
        spec(4, dtype=torch.bfloat16),  # 1: bf16 g0
        spec(4, group=1),  # 2: f32 g1
        spec(4),  # 3: f32 g0
        spec(4, device=torch.device("meta")),  # 4: f32 g0 on another device
    ]
    plan = plan_layout(params, 2, align_bytes=4, bucket_size_bytes=1 << 20)
    # Reverse order opens buckets for 4, 3, 2, 1; param 0 joins 3's bucket.
    assert [[s.param_index for s in b.slots] for b in plan.buckets] == [[4], [3, 0], [2], [1]]
    assert [(b.dtype, b.device, b.group_index) for b in plan.buckets] == [
        (torch.float32, torch.device("meta"), 0),
        (torch.float32, CPU, 0),
        (torch.float32, CPU, 1),
        (torch.bfloat16, CPU, 0),
    ]
    assert plan.slot(0).bucket_index == 1 and plan.slot(0).offset == 4


def test_interleaved_keys_order_buckets_by_first_param():
    # Key A = f32, key B = f64; align 1; bucket of 8 bytes holds two f32 or one f64 element.
    params = [spec(1), spec(1, dtype=torch.float64), spec(1), spec(1), spec(1, dtype=torch.float64)]
    plan = plan_layout(params, 1, align_bytes=1, bucket_size_bytes=8)
    # Reverse order 4(B) 3(A) 2(A) 1(B) 0(A): buckets B[4], A[3,2], B[1], A[0].
    assert [[s.param_index for s in b.slots] for b in plan.buckets] == [[4], [3, 2], [1], [0]]


def test_frozen_params_keep_their_index_free():
    params = [None, spec(5), None, spec(7), None]
    plan = plan_layout(params, 2, align_bytes=4, bucket_size_bytes=1 << 20)
    assert plan.slots[0] is None and plan.slots[2] is None and plan.slots[4] is None
    assert [(s.param_index, s.offset) for s in plan.buckets[0].slots] == [(3, 0), (1, 7)]
    with pytest.raises(KeyError, match="param 2 is not laid out"):
        plan.slot(2)


def test_frozen_and_trainable_params_never_share_a_bucket():
    params = [spec(3), ParamSpec((4,), torch.float32, CPU, 0, requires_grad=False), spec(5)]
    plan = plan_layout(params, 2, align_bytes=4, bucket_size_bytes=1 << 20)
    assert [([s.param_index for s in b.slots], b.requires_grad) for b in plan.buckets] == [
        ([2, 0], True),
        ([1], False),
    ]


def test_no_params_or_all_left_out():
    for params in ([], [None, None]):
        plan = plan_layout(params, 4, bucket_size_bytes=1024)
        assert plan.buckets == ()
        assert plan.slots == tuple(params)


@pytest.mark.parametrize("world_size", [0, -1])
def test_rejects_bad_world_size(world_size):
    with pytest.raises(ValueError, match=rf"plan_layout expects world_size >= 1 but got {world_size}"):
        plan_layout([spec(1)], world_size, bucket_size_bytes=1024)


@pytest.mark.parametrize("align_bytes", [0, -256])
def test_rejects_bad_align_bytes(align_bytes):
    with pytest.raises(ValueError, match=rf"plan_layout expects align_bytes >= 1 but got {align_bytes}"):
        plan_layout([spec(1)], 1, align_bytes=align_bytes, bucket_size_bytes=1024)


@pytest.mark.parametrize("bucket_size_bytes", [0, -1])
def test_rejects_bad_bucket_size(bucket_size_bytes):
    with pytest.raises(
        ValueError, match=rf"plan_layout expects bucket_size_bytes >= 1 but got {bucket_size_bytes}"
    ):
        plan_layout([spec(1)], 1, bucket_size_bytes=bucket_size_bytes)


def test_bucket_size_is_keyword_only():
    with pytest.raises(TypeError):
        plan_layout([spec(1)], 1, 256, 1024)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("dtype", "align_bytes", "expected"),
    [
        (torch.float32, 256, 64),
        (torch.bfloat16, 256, 128),
        (torch.float16, 2, 1),
        (torch.float64, 256, 32),
        (torch.float64, 4, 1),
        (torch.float32, 1, 1),
    ],
)
def test_align_numel(dtype, align_bytes, expected):
    assert align_numel(dtype, align_bytes) == expected


@pytest.mark.parametrize(
    ("value", "multiple", "expected"),
    [(0, 64, 0), (1, 64, 64), (64, 64, 64), (65, 64, 128), (7, 1, 7), (10, 3, 12)],
)
def test_round_up(value, multiple, expected):
    assert round_up(value, multiple) == expected


def test_param_spec_of_tensor():
    t = torch.zeros(3, 4, dtype=torch.float16)
    p = ParamSpec.of(t, 2)
    assert p == ParamSpec((3, 4), torch.float16, CPU, 2, requires_grad=False)
    assert ParamSpec.of(t.requires_grad_(), 2).requires_grad
    assert p.numel == 12
    assert ParamSpec.of(torch.tensor(1.0), 0).numel == 1
