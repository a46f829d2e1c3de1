"""Overlap mode: bitwise equal to sync mode, equal to the unsharded reference, and really
overlapping (collectives issued during backward and during the next forward)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.step.bucket import Bucket
from tests.harness.dist_helper import run_ranks
from tests.harness.training import (
    ATOL,
    RTOL,
    RunConfig,
    batch,
    local_slice,
    make_model,
    train_branchy,
    train_many,
    train_reference,
)

CONFIGS = {
    "adamw": RunConfig(optimizer="adamw"),
    "adamw_two_groups": RunConfig(optimizer="adamw_groups"),
    "sgd_momentum": RunConfig(optimizer="sgd"),
    "no_sync_three_micro_batches": RunConfig(optimizer="adamw", micro_batches=3),
    "model_zero_grad_misuse": RunConfig(optimizer="adamw", zero_grad_style="model"),
    "closure_scheduler": RunConfig(optimizer="adam", closure=True, scheduler="step"),
    "data_parallel": RunConfig(optimizer="adamw", enable=False),
}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"world{ws}")
def sync_and_overlap(request) -> dict[str, dict[str, list[dict]]]:
    configs = list(CONFIGS.values())
    runs = {
        "sync": configs,
        "overlap": [dataclasses.replace(c, overlap=True) for c in configs],
        "overlap_no_model": [dataclasses.replace(c, overlap=True, attach_model=False) for c in configs],
    }
    ordered = [config for mode in runs.values() for config in mode]
    per_rank = run_ranks(train_many, request.param, ordered)
    results: dict[str, dict[str, list[dict]]] = {}
    for mode_index, mode in enumerate(runs):
        results[mode] = {
            name: [rank_results[mode_index * len(configs) + i] for rank_results in per_rank]
            for i, name in enumerate(CONFIGS)
        }
    return results


@pytest.mark.parametrize("mode", ["overlap", "overlap_no_model"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_overlap_bitwise_equals_sync(sync_and_overlap, mode: str, name: str) -> None:
    for rank, (sync, overlap) in enumerate(
        zip(sync_and_overlap["sync"][name], sync_and_overlap[mode][name], strict=True)
    ):
        for index, (a, b) in enumerate(zip(sync["params"], overlap["params"], strict=True)):
            assert torch.equal(a, b), f"rank {rank} param {index} differs between sync and {mode}"
        assert sync["losses"] == overlap["losses"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_overlap_matches_unsharded_reference(sync_and_overlap, name: str) -> None:
    reference = train_reference(CONFIGS[name])
    for got, expected in zip(
        sync_and_overlap["overlap"][name][0]["params"], reference["params"], strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_branch_and_tied_weight_bitwise(world_size: int) -> None:
    sync, overlap = zip(*run_ranks(_sync_and_overlap_branchy, world_size), strict=True)
    for rank in range(world_size):
        for a, b in zip(sync[rank], overlap[rank], strict=True):
            assert torch.equal(a, b)
    # The branch trained at all (some rank used it every step) and ranks agree.
    for a, b in zip(overlap[0], overlap[-1], strict=True):
        assert torch.equal(a, b)


def _sync_and_overlap_branchy() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return train_branchy(overlap=False), train_branchy(overlap=True)


def test_reduce_scatter_starts_during_backward_and_allgather_during_forward() -> None:
    observations = run_ranks(_observe_overlap, 2)
    for seen in observations:
        # When the first layer's grads (the last bucket in backward order) landed, earlier
        # buckets' reduce-scatters had already been issued and were still in flight.
        assert seen["launched_before_last_grad"], seen
        assert 0 in seen["launched_before_last_grad"]
        # When the first layer's forward started, the later layers' all-gathers were pending.
        assert seen["pending_at_first_forward"], seen
        assert not set(seen["first_layer_buckets"]) & set(seen["pending_at_first_forward"]), seen


def _observe_overlap() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        overlap=True,
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.001)),
    )
    buckets = optimizer.shards.buckets
    first_layer = [i for i, p in enumerate(model.parameters()) if any(p is q for q in model.fc1.parameters())]
    seen: dict = {"first_layer_buckets": [optimizer.plan.slot(i).bucket_index for i in first_layer]}

    # fc1 is the first layer in forward, so its grads arrive last in backward.
    def on_last_grad(param: torch.Tensor) -> None:
        seen.setdefault("launched_before_last_grad", [b.index for b in buckets if b.grad_sync_pending])

    model.fc1.weight.register_post_accumulate_grad_hook(on_last_grad)

    def before_first_layer(module, args):
        pending = [b.index for b in buckets if b.param_sync_pending]
        seen.setdefault("pending_at_first_forward", pending)

    inputs, targets = batch(0)
    for _ in range(2):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(
            model(local_slice(inputs, rank, world_size)), local_slice(targets, rank, world_size)
        )
        loss.backward()
        optimizer.step()
        if "pending_at_first_forward" not in seen:
            # Registered after the wrapper's own pre-hook, so it runs after fc1 has waited for
            # its own bucket: what is still pending then is the later layers' all-gathers.
            model.fc1.register_forward_pre_hook(before_first_layer)
    optimizer.sync_params()
    return seen


def test_grad_buckets_issued_in_the_same_order_on_every_rank() -> None:
    results = run_ranks(_record_launch_order, 3)
    arrivals = [arrival for arrival, _ in results]
    launches = [launch for _, launch in results]
    # The test is only meaningful if grads really arrived in different orders on the ranks.
    assert len({tuple(arrival) for arrival in arrivals}) > 1, arrivals
    for launch in launches:
        assert launch == [0, 1, 2, 3] * 3, launches


class _TwoPaths(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = torch.nn.Linear(6, 6)
        self.right = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, left_first: bool) -> torch.Tensor:
        # The path computed last is differentiated first, so ranks that swap the order see
        # their buckets become ready in opposite orders.
        if left_first:
            a = self.left(x)
            b = self.right(x * 2)
        else:
            b = self.right(x * 2)
            a = self.left(x)
        return (a * b).sum()


def _record_launch_order() -> tuple[list[int], list[int]]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _TwoPaths()
    optimizer = ShardingStage1(
        torch.optim.SGD(model.parameters(), lr=0.1),
        overlap=True,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=1e-4)),
    )
    assert len(optimizer.plan.buckets) == 4
    arrival: list[int] = []
    for index, param in enumerate(model.parameters()):
        bucket_index = optimizer.plan.slot(index).bucket_index
        param.register_post_accumulate_grad_hook(lambda p, b=bucket_index: arrival.append(b))
    launch: list[int] = []
    start = optimizer.grad_sync.start_bucket_grad_sync

    def recording_start(bucket: Bucket) -> None:
        launch.append(bucket.index)
        start(bucket)

    optimizer.grad_sync.start_bucket_grad_sync = recording_start
    for step in range(3):
        optimizer.zero_grad()
        model(torch.ones(2, 6), left_first=(rank + step) % 2 == 0).backward()
        optimizer.step()
    return arrival, launch
