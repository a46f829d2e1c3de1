"""Tests for the model-derived default bucket sizes (``fusion.bucket_sizing``) and how
``ShardingConfig`` resolves them. Pure: no process group."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusion.bucket_sizing import (
    FIRST_BUCKET_BYTES,
    MAX_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    TARGET_NUM_BUCKETS,
    BucketSizes,
    default_bucket_sizes,
    trainable_bytes,
)
from fusion.layout import ParamSpec, plan_layout
from sharded_opt import ShardingConfig

CPU = torch.device("cpu")
MIB = 2**20
SETTINGS = settings(max_examples=200, deadline=None)

totals = st.one_of(st.integers(0, 4 * MIB), st.integers(4 * MIB, 2**40))


def ideal_num_buckets(total: int, sizes: BucketSizes) -> int:
    """Buckets of a model whose params could be cut anywhere: the first, then full others."""
    if total <= sizes.first_bucket_bytes:
        return 1
    return 1 + math.ceil((total - sizes.first_bucket_bytes) / sizes.bucket_bytes)


@SETTINGS
@given(total=totals)
def test_bounds_respected(total):
    sizes = default_bucket_sizes(total)
    assert MIN_BUCKET_BYTES <= sizes.bucket_bytes <= MAX_BUCKET_BYTES
    assert MIN_BUCKET_BYTES <= sizes.first_bucket_bytes <= FIRST_BUCKET_BYTES


@SETTINGS
@given(total=totals)
def test_bucket_count_bounds(total):
    """At most the target unless the cap binds; exactly the target once the model is large
    enough for buckets above the floor and small enough for buckets below the cap."""
    sizes = default_bucket_sizes(total)
    count = ideal_num_buckets(total, sizes)
    if sizes.bucket_bytes < MAX_BUCKET_BYTES:
        assert count <= TARGET_NUM_BUCKETS
    else:
        assert count >= TARGET_NUM_BUCKETS
    if sizes.bucket_bytes not in (MIN_BUCKET_BYTES, MAX_BUCKET_BYTES):
        assert count == TARGET_NUM_BUCKETS


@SETTINGS
@given(total=totals)
def test_monotone_in_model_size(total):
    """A larger model never gets smaller buckets."""
    small, large = default_bucket_sizes(total), default_bucket_sizes(total + MIB)
    assert small.bucket_bytes <= large.bucket_bytes
    assert small.first_bucket_bytes <= large.first_bucket_bytes


@pytest.mark.parametrize(
    ("total", "expected"),
    [
        (0, BucketSizes(MIN_BUCKET_BYTES, MIN_BUCKET_BYTES)),
        # 3.26M fp32 params (the default benchmark GPT): 1 MiB, then (T - 1 MiB) / 7 each.
        (13_040_000, BucketSizes(MIB, math.ceil((13_040_000 - MIB) / 7))),
        # 4 MiB: eight equal 512 KiB buckets.
        (4 * MIB, BucketSizes(MIB // 2, MIB // 2)),
        # 1B fp32 params: capped.
        (4 * 10**9, BucketSizes(MIB, 25 * MIB)),
    ],
)
def test_worked_examples(total, expected):
    assert default_bucket_sizes(total) == expected


def test_rejects_negative_total():
    with pytest.raises(ValueError, match="default_bucket_sizes expects total_bytes >= 0 but got -1"):
        default_bucket_sizes(-1)


@SETTINGS
@given(
    numels=st.lists(st.integers(1, MIN_BUCKET_BYTES // 16), min_size=1, max_size=400),
    world_size=st.integers(1, 5),
)
def test_planned_model_gets_several_buckets(numels, world_size):
    """Through the planner, with params small next to a bucket (at most a quarter of the
    floor): never fewer buckets than the ideal count, at most twice the target, each bucket
    within its bound, the first within ``FIRST_BUCKET_BYTES``."""
    specs: list[ParamSpec | None] = [ParamSpec((n,), torch.float32, CPU, 0) for n in numels]
    sizes = default_bucket_sizes(trainable_bytes(specs))
    plan = plan_layout(
        specs,
        world_size,
        bucket_size_bytes=sizes.bucket_bytes,
        first_bucket_bytes=sizes.first_bucket_bytes,
    )
    count = len(plan.buckets)
    assert min(ideal_num_buckets(trainable_bytes(specs), sizes), len(numels)) <= count
    assert count <= 2 * TARGET_NUM_BUCKETS
    assert plan.buckets[0].used_numel * 4 <= sizes.first_bucket_bytes
    assert all(bucket.used_numel * 4 <= sizes.bucket_bytes for bucket in plan.buckets)


def test_large_model_respects_the_cap():
    """A 1.2B-param model of 48 MiB and 1 MiB params: every bucket at most 25 MiB."""
    shapes = [(4096, 3072), (1024, 256)] * 100
    specs: list[ParamSpec | None] = [ParamSpec(shape, torch.float32, CPU, 0) for shape in shapes]
    sizes = default_bucket_sizes(trainable_bytes(specs))
    plan = plan_layout(
        specs, 8, bucket_size_bytes=sizes.bucket_bytes, first_bucket_bytes=sizes.first_bucket_bytes
    )
    assert sizes.bucket_bytes == MAX_BUCKET_BYTES
    assert plan.buckets[0].used_numel * 4 <= FIRST_BUCKET_BYTES
    assert all(len(b.slots) == 1 or b.used_numel * 4 <= MAX_BUCKET_BYTES for b in plan.buckets)


def test_trainable_bytes_skips_frozen_and_left_out():
    specs = [
        ParamSpec((3, 4), torch.float32, CPU, 0),
        None,
        ParamSpec((10,), torch.bfloat16, CPU, 0),
        ParamSpec((100,), torch.float32, CPU, 0, requires_grad=False),
    ]
    assert trainable_bytes(specs) == 12 * 4 + 10 * 2


def test_config_default_is_sized_from_the_model():
    assert ShardingConfig().bucket_size_mb is None
    assert ShardingConfig().bucket_sizes(13_040_000) == default_bucket_sizes(13_040_000)


def test_config_explicit_size_overrides_every_bucket():
    assert ShardingConfig(bucket_size_mb=4).bucket_sizes(13_040_000) == BucketSizes(4 * MIB, 4 * MIB)
    assert ShardingConfig(bucket_size_mb=1e-9).bucket_sizes(10) == BucketSizes(1, 1)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "4"])
def test_config_rejects_bad_bucket_size(value):
    with pytest.raises(ValueError, match=r"bucket_size_mb expects a number > 0 \(finite\), or None"):
        ShardingConfig(bucket_size_mb=value)


def test_wrapper_default_plans_model_derived_buckets(single_rank_group):
    """``ShardingStage1`` with the default config lays a 1.5 MiB model out in the buckets the
    sizing function derives (not one 25 MiB bucket); an explicit size still wins."""
    from sharded_opt import ShardingStage1, Strategy

    def plan(strategy: Strategy | None):
        model = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(24)))
        optimizer = ShardingStage1(torch.optim.AdamW(model.parameters()), strategy=strategy)
        specs: list[ParamSpec | None] = [ParamSpec.of(p, 0) for p in model.parameters()]
        return optimizer.plan, specs

    default_plan, specs = plan(None)
    sizes = default_bucket_sizes(trainable_bytes(specs))
    expected = plan_layout(
        specs, 1, bucket_size_bytes=sizes.bucket_bytes, first_bucket_bytes=sizes.first_bucket_bytes
    )
    assert default_plan == expected
    assert len(default_plan.buckets) == TARGET_NUM_BUCKETS
    explicit_plan, _ = plan(Strategy(sharding=ShardingConfig(bucket_size_mb=25.0)))
    assert len(explicit_plan.buckets) == 1
