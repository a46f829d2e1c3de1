"""The per-bucket step pipeline (Note [Step pipeline] in ``sharded_opt/step/step_pipeline.py``): each
bucket's shard is stepped as soon as its own reduction is finished, every all-gather starts only
after its own bucket's step, and results are bitwise those of one step over all buckets, in sync
and overlap mode, with clipping and with bf16 params on fp32 masters.

All jobs run in one 2-rank spawn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.step import grad_sync, param_sync
from tests.harness.dist_helper import run_jobs, run_ranks

ONE_PARAM_PER_BUCKET_MB = 0.0001
"""Smaller than any param of :class:`_Net`: every param gets a bucket of its own."""

EVERY_RANK_HOLDS_PIECES_ALIGN_BYTES = 4
"""No padding beyond a multiple of the world size, so both ranks hold a piece of every bucket
(with the default alignment a 16-element bias would lie in rank 0's shard alone)."""


class _Net(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 16).to(dtype)
        self.middle = nn.Linear(16, 16).to(dtype)
        self.last = nn.Linear(16, 2).to(dtype)

    def forward(self, x: torch.Tensor, use_middle: bool) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        if use_middle:
            hidden = hidden + self.middle(hidden)
        return self.last(hidden)


def _batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).to(dtype)
    return data[rank::world_size]


def _wrap(model: nn.Module, overlap: bool, bf16: bool) -> ShardingStage1:
    config = ShardingConfig(
        bucket_size_mb=ONE_PARAM_PER_BUCKET_MB,
        align_bytes=EVERY_RANK_HOLDS_PIECES_ALIGN_BYTES,
        master_dtype=torch.float32 if bf16 else None,
    )
    return ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        overlap=overlap,
        strategy=Strategy(sharding=config),
        model=model,
    )


@contextlib.contextmanager
def _recorded_events(opt: ShardingStage1) -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Log the buckets' finish/start calls and the inner steps in order, inside the block (the
    module functions are patched in this worker process, then restored)."""
    events: list[tuple[str, tuple[int, ...]]] = []
    bucket_of = {id(p): s.bucket.index for s in opt.shards.live_shards() for p in s.inner_params}

    def logged(name, method, buckets_of):
        def call(*args, **kwargs):
            events.append((name, buckets_of(*args, **kwargs)))
            return method(*args, **kwargs)

        return call

    finish, gather = grad_sync.finish_grad_syncs, param_sync.start_param_syncs
    grad_sync.finish_grad_syncs = logged("finish", finish, lambda all, comm, some=None: _indices(some or ()))
    param_sync.start_param_syncs = logged("gather", gather, lambda buckets, comm: _indices(buckets))
    stepped_buckets = lambda params_per_group, kwargs: tuple(  # noqa: E731
        sorted({bucket_of[id(p)] for params in params_per_group for p in params})
    )
    opt._pipeline._inner_step = logged("step", opt._pipeline._inner_step, stepped_buckets)
    try:
        yield events
    finally:
        grad_sync.finish_grad_syncs, param_sync.start_param_syncs = finish, gather


def _indices(buckets) -> tuple[int, ...]:
    return tuple(bucket.index for bucket in buckets)


def _event_order(overlap: bool) -> tuple[int, list]:
    model = _Net(torch.float32)
    opt = _wrap(model, overlap, bf16=False)
    with _recorded_events(opt) as events:
        for step in range(2):
            opt.zero_grad()
            model(_batch(step, torch.float32), use_middle=True).square().mean().backward()
            events.clear()
            opt.step()
    opt.sync_params()
    return len(opt.plan.buckets), events


def _flag_groups() -> dict[str, object]:
    """Which groups carry a backward's presence flags and its bucket reductions, as recorded from
    ``torch.distributed``'s calls."""
    model = _Net(torch.float32)
    opt = _wrap(model, overlap=True, bf16=False)
    used: dict[str, list[str]] = {"all_reduce": [], "reduction": []}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_to_all_single")}

    def recorder(name: str):
        def call(*args, **kwargs):
            kind = "all_reduce" if name == "all_reduce" else "reduction"
            used[kind].append(kwargs["group"].group_name)
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, recorder(name))
    try:
        model(_batch(0, torch.float32), use_middle=True).square().mean().backward()
        flags_before_step = len(used["all_reduce"])
        opt.step()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {
        # The flags travel after the last launch, at the end of backward; the step's own
        # all-reduce agrees on the wrapped step's errors (Note [A step that raises on some ranks]).
        "flag_groups": used["all_reduce"][:flags_before_step],
        "agreement_groups": used["all_reduce"][flags_before_step:],
        "reduction_groups": used["reduction"],
        "flag_group_ranks": dist.get_process_group_ranks(opt.grad_sync.presence.group),
        "buckets": len(opt.plan.buckets),
    }


def _train(overlap: bool, per_bucket: bool, clip: bool, bf16: bool) -> list[torch.Tensor]:
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = _Net(dtype)
    opt = _wrap(model, overlap, bf16)
    opt._pipeline.step_per_bucket = per_bucket
    for step in range(4):
        opt.zero_grad()
        # The middle layer gets no grad in step 2 on rank 0 only, and in step 3 on no rank.
        use_middle = step < 2 or (step == 2 and dist.get_rank() == 1)
        model(_batch(step, dtype), use_middle=use_middle).float().square().mean().backward()
        if clip:
            opt.clip_grad_norm_(0.05)
        opt.step()
    opt.sync_params()
    return [p.detach().float().clone() for p in model.parameters()]


TRAIN_CASES = {
    f"{mode}-{'bucketwise' if per_bucket else 'once'}-{'clip' if clip else 'noclip'}-{dtype}": (
        mode == "overlap",
        per_bucket,
        clip,
        dtype == "bf16",
    )
    for mode in ("sync", "overlap")
    for per_bucket in (True, False)
    for clip in (False, True)
    for dtype in ("fp32", "bf16")
}


@pytest.fixture(scope="module")
def on_two_ranks() -> dict[str, list]:
    jobs: list[tuple[str, object, tuple]] = [
        ("events-sync", _event_order, (False,)),
        ("events-overlap", _event_order, (True,)),
        ("flag-groups", _flag_groups, ()),
    ]
    jobs += [(name, _train, args) for name, args in TRAIN_CASES.items()]
    per_rank = run_ranks(run_jobs, 2, jobs)
    return {name: [results[name] for results in per_rank] for name, _, _ in jobs}


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_each_bucket_is_stepped_once_its_own_reduction_is_finished(on_two_ranks, mode: str) -> None:
    """Bucket 0's grads land first (backward order): it is finished and stepped on its own
    before bucket 1 is waited for, and so on; each inner step holds one bucket's pieces."""
    for num_buckets, events in on_two_ranks[f"events-{mode}"]:
        assert num_buckets == 6
        steps = [(kind, buckets) for kind, buckets in events if kind != "gather"]
        expected = [(kind, (b,)) for b in range(num_buckets) for kind in ("finish", "step")]
        assert steps == expected


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_all_gathers_start_after_their_own_step_in_forward_order(on_two_ranks, mode: str) -> None:
    """Every bucket is all-gathered once, after its own step, first layers' bucket first."""
    for num_buckets, events in on_two_ranks[f"events-{mode}"]:
        gathered = [b for kind, buckets in events if kind == "gather" for b in buckets]
        assert gathered == list(reversed(range(num_buckets)))
        for bucket in range(num_buckets):
            stepped_at = events.index(("step", (bucket,)))
            gathered_at = next(i for i, (kind, b) in enumerate(events) if kind == "gather" and bucket in b)
            assert stepped_at < gathered_at


def test_presence_flags_travel_on_a_group_of_their_own_on_gloo(on_two_ranks) -> None:
    """On gloo a flag all-reduce on the reductions' group would hold one of its two worker
    threads until the previous bucket's bytes had passed, keeping a single reduction on the wire
    (Note [Presence per bucket]); the flags use a group of the same ranks of their own, and
    all of them travel in one all-reduce per step rather than one per bucket."""
    for recorded in on_two_ranks["flag-groups"]:
        assert recorded["buckets"] > 1
        assert len(recorded["reduction_groups"]) == recorded["buckets"]
        assert len(set(recorded["reduction_groups"])) == 1
        assert len(recorded["flag_groups"]) == 1
        assert recorded["flag_groups"][0] not in recorded["reduction_groups"]
        assert recorded["agreement_groups"] == recorded["flag_groups"]
        assert recorded["flag_group_ranks"] == [0, 1]


@pytest.mark.parametrize("clip", ["noclip", "clip"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pipeline_is_bitwise_one_step_over_all_buckets(on_two_ranks, clip: str, dtype: str) -> None:
    """Stepping bucket by bucket equals one inner step over every bucket, and overlap equals
    sync, bitwise: with grads missing on some or all ranks, with clipping (which reduces every
    bucket before the step) and with bf16 params on fp32 masters."""
    reference = on_two_ranks[f"sync-once-{clip}-{dtype}"][0]
    for mode in ("sync", "overlap"):
        for per_bucket in ("bucketwise", "once"):
            for rank_params in on_two_ranks[f"{mode}-{per_bucket}-{clip}-{dtype}"]:
                for got, expected in zip(rank_params, reference, strict=True):
                    assert torch.equal(got, expected), (mode, per_bucket)
