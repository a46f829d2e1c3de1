"""Layout properties for optimizers that need whole params (Note [Whole params per owner] in
``fusion/layout.py``): every param inside one rank's shard, shards of equal aligned size, bins
balanced by numel within a bucket and work balanced over the model.

Expected values are worked out here from the stated rules, not from the planner.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusion.layout import LayoutPlan, ParamSpec, align_numel, plan_layout, round_up
from sharded_opt.guards.optimizer_needs import newton_schulz_cost, numel_cost
from tests.harness.layout_reference import (
    align_bytes_st,
    bucket_sizes,
    param_lists,
    reference_buckets,
    spec,
    start_after,
    world_sizes,
)

costs = st.sampled_from([numel_cost, newton_schulz_cost])
PROPERTY_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def whole_plan(params, world_size, align_bytes, bsize, cost=numel_cost, first=None) -> LayoutPlan:
    return plan_layout(
        params,
        world_size,
        align_bytes=align_bytes,
        bucket_size_bytes=bsize,
        first_bucket_bytes=first,
        whole_param_cost=cost,
    )


def owned(plan: LayoutPlan, bucket_index: int) -> list[list[int]]:
    """Per rank, the params whose slots lie in its shard of the bucket, in layout order."""
    bucket = plan.buckets[bucket_index]
    ranks: list[list[int]] = [[] for _ in range(bucket.world_size)]
    for slot in bucket.slots:
        ranks[plan.owner(slot.param_index)].append(slot.param_index)
    return ranks


def work_per_rank(plan: LayoutPlan, params, cost) -> list[int]:
    work = [0] * plan.world_size
    for bucket in plan.buckets:
        if bucket.requires_grad:
            for rank, indices in enumerate(owned(plan, bucket.index)):
                work[rank] += sum(cost(params[i].shape) for i in indices)
    return work


@PROPERTY_SETTINGS
@given(
    params=param_lists(), world_size=world_sizes, align_bytes=align_bytes_st, bsize=bucket_sizes, cost=costs
)
def test_every_param_lies_whole_in_one_equal_aligned_shard(params, world_size, align_bytes, bsize, cost):
    plan = whole_plan(params, world_size, align_bytes, bsize, cost)
    laid_out = sorted(slot.param_index for bucket in plan.buckets for slot in bucket.slots)
    assert laid_out == [i for i, p in enumerate(params) if p is not None]
    for bucket in plan.buckets:
        align = align_numel(bucket.dtype, align_bytes)
        assert bucket.whole_params
        assert bucket.shard_numel % align == 0 and bucket.padded_numel == world_size * bucket.shard_numel
        ends = [0] * world_size
        for slot in bucket.slots:
            rank = plan.owner(slot.param_index)
            start = slot.offset - rank * bucket.shard_numel
            assert start >= 0 and start + slot.numel <= bucket.shard_numel, "a param crosses a shard boundary"
            # Exactly one piece, on the owner (a zero-size param's is empty: it still has state).
            holders = [
                r
                for r in range(world_size)
                for p in bucket.shard_pieces(r)
                if (p.param_index, p.param_start, p.numel) == (slot.param_index, 0, slot.numel)
            ]
            assert holders == [rank]
            if slot.numel == 0:
                continue  # it occupies nothing
            # Laid out from the shard's start by the element-wise rules, owners' params in layout order.
            assert start == start_after(ends[rank], slot.numel, align, bucket.dtype.itemsize)
            ends[rank] = start + slot.numel
        # No more padding than the largest shard needs.
        assert bucket.shard_numel == round_up(max(1, *ends), align)


@PROPERTY_SETTINGS
@given(params=param_lists(), world_size=world_sizes, align_bytes=align_bytes_st, bsize=bucket_sizes)
def test_buckets_are_the_element_wise_ones_with_a_bound_per_shard(params, world_size, align_bytes, bsize):
    plan = whole_plan(params, world_size, align_bytes, bsize, first=bsize // 2 + 1)
    members = [tuple(sorted((s.param_index for s in b.slots), reverse=True)) for b in plan.buckets]
    expected = reference_buckets(params, align_bytes, bsize * world_size, (bsize // 2 + 1) * world_size)
    assert members == [tuple(sorted(m, reverse=True)) for m in expected]


@PROPERTY_SETTINGS
@given(
    params=param_lists(), world_size=world_sizes, align_bytes=align_bytes_st, bsize=bucket_sizes, cost=costs
)
def test_bins_balanced_by_numel_and_ranks_by_work(params, world_size, align_bytes, bsize, cost):
    """Greedy largest-first bins: none exceeds the mean by more than the bucket's largest param.
    Costliest bin to the least-loaded rank: the spread of work over ranks never exceeds the
    costliest bin of any bucket."""
    plan = whole_plan(params, world_size, align_bytes, bsize, cost)
    costliest_bin = 0
    for bucket in plan.buckets:
        numels = [sum(params[i].numel for i in indices) for indices in owned(plan, bucket.index)]
        largest = max(slot.numel for slot in bucket.slots)
        assert max(numels) <= sum(numels) / world_size + largest
        if bucket.requires_grad:
            bins = [sum(cost(params[i].shape) for i in ix) for ix in owned(plan, bucket.index)]
            costliest_bin = max(costliest_bin, *bins)
    work = work_per_rank(plan, params, cost)
    assert max(work) - min(work) <= costliest_bin


@PROPERTY_SETTINGS
@given(params=param_lists(), align_bytes=align_bytes_st, bsize=bucket_sizes)
def test_one_rank_lays_out_as_for_element_wise_optimizers(params, align_bytes, bsize):
    elementwise = plan_layout(params, 1, align_bytes=align_bytes, bucket_size_bytes=bsize)
    whole = whole_plan(params, 1, align_bytes, bsize)
    assert whole.slots == elementwise.slots
    assert [b.padded_numel for b in whole.buckets] == [b.padded_numel for b in elementwise.buckets]


def test_worked_example_two_ranks():
    """fp32, 64-element alignment. Largest first: 300 -> bin 0, 200 -> bin 1, 100 -> bin 1 (200 <
    300). Both bins cost 300, so bin 0 goes to rank 0. Rank 1 lays out its params in layout order
    (param 2, then 1): 100 at 0, 200 at round_up(100, 64) = 128, ending at 328; the shard is
    round_up(328, 64) = 384 elements."""
    plan = whole_plan([spec(300), spec(200), spec(100)], 2, 256, 1 << 20)
    (bucket,) = plan.buckets
    assert bucket.shard_numel == 384 and bucket.padded_numel == 768
    assert [(s.param_index, s.offset) for s in bucket.slots] == [(0, 0), (2, 384), (1, 384 + 128)]
    assert plan.padding_numel == 768 - 600


def test_work_decides_owners_across_buckets():
    """One param per bucket (a 1-byte bound); layout order is C, B, A. C (8x8) goes to rank 0, B
    (64x64) to rank 1, then A (64x64) to rank 0, which has done 8**3 = 512 multiply-adds against
    rank 1's 64**3. By numel alone the same holds; by Newton-Schulz cost it is by a wide margin."""
    params = [spec(64, 64), spec(64, 64), spec(8, 8)]
    plan = whole_plan(params, 2, 256, 1, cost=newton_schulz_cost)
    assert [plan.owner(i) for i in range(3)] == [0, 1, 0]
    assert work_per_rank(plan, params, newton_schulz_cost) == [64**3 + 8**3, 64**3]


def test_element_wise_plans_have_no_owners():
    plan = plan_layout([spec(3)], 2, bucket_size_bytes=1 << 20)
    with pytest.raises(ValueError, match="laid out element-wise, it has no owner"):
        plan.owner(0)


@pytest.mark.parametrize(
    ("shape", "expected"), [((4, 6), 4 * 6 * 4), ((6, 4), 6 * 4 * 4), ((5,), 5), ((2, 3, 4), 2 * 12 * 2)]
)
def test_newton_schulz_cost(shape, expected):
    assert newton_schulz_cost(shape) == expected
    assert numel_cost(shape) == math.prod(shape)


def test_frozen_params_add_no_work():
    trainable = spec(64, 64)
    params = [trainable, ParamSpec((64, 64), trainable.dtype, trainable.device, 0, requires_grad=False)]
    plan = whole_plan(params, 2, 256, 1)
    assert work_per_rank(plan, params, numel_cost) == [64 * 64, 0]
