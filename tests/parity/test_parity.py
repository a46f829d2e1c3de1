"""The heart of the suite: ShardingStage1 on N gloo ranks over slices of each batch ends with
the same params as the plain optimizer in one process over the whole batch.

Tolerance (fp32): rtol=1e-6, atol=1e-7. The sharded run averages per-rank mean grads, the
reference takes one mean over the whole batch; the two sums round differently, so grads differ
in the last bits (about 1e-7 relative) and the difference is carried through 10 steps. It is
not bitwise; anything larger than rounding (a lost or double-counted grad, a stale param, a
missed hyperparameter) is orders of magnitude above it.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.dist_helper import run_ranks
from tests.harness.training import ATOL, RTOL, RunConfig, train_many, train_reference

CONFIGS = {
    "sgd_momentum_wd": RunConfig(optimizer="sgd"),
    "adam": RunConfig(optimizer="adam"),
    "adamw_two_groups": RunConfig(optimizer="adamw_groups"),
    "adamw_scheduler": RunConfig(optimizer="adamw", scheduler="step"),
    "adamw_onecycle": RunConfig(optimizer="adamw_groups", scheduler="onecycle"),
    "sgd_lambda": RunConfig(optimizer="sgd", scheduler="lambda"),
    "adamw_closure": RunConfig(optimizer="adamw", closure=True),
    "adamw_one_bucket": RunConfig(optimizer="adamw", bucket_size_mb=25.0),
    "adamw_data_parallel": RunConfig(optimizer="adamw_groups", enable=False),
}


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda ws: f"world{ws}")
def sharded_runs(request) -> tuple[int, dict[str, list[dict]]]:
    world_size = request.param
    per_rank = run_ranks(train_many, world_size, list(CONFIGS.values()))
    results = {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(CONFIGS)}
    return world_size, results


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_unsharded_reference(sharded_runs, name: str) -> None:
    _, results = sharded_runs
    reference = train_reference(CONFIGS[name])
    for rank, result in enumerate(results[name]):
        for index, (got, expected) in enumerate(zip(result["params"], reference["params"], strict=True)):
            torch.testing.assert_close(
                got, expected, rtol=RTOL, atol=ATOL, msg=lambda m, r=rank, i=index: f"rank {r} param {i}: {m}"
            )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_all_ranks_hold_identical_params(sharded_runs, name: str) -> None:
    _, results = sharded_runs
    first = results[name][0]["params"]
    for result in results[name][1:]:
        for got, expected in zip(result["params"], first, strict=True):
            assert torch.equal(got, expected)


def test_state_is_sharded(sharded_runs) -> None:
    world_size, results = sharded_runs
    reference_numel = train_reference(CONFIGS["adamw_two_groups"])["state_numel"]
    for result in results["adamw_two_groups"]:
        # AdamW keeps exp_avg and exp_avg_sq for each local element of a trainable param: no
        # state for padding or for the frozen param, as the plain optimizer keeps none for it.
        assert result["state_numel"] == 2 * result["trainable_local_numel"]
    assert sum(r["state_numel"] for r in results["adamw_two_groups"]) == reference_numel


def test_data_parallel_keeps_full_state(sharded_runs) -> None:
    _, results = sharded_runs
    for result in results["adamw_data_parallel"]:
        assert result["state_numel"] >= 2 * result["trainable_numel"]


def test_loss_goes_down(sharded_runs) -> None:
    _, results = sharded_runs
    losses = results["adamw_two_groups"][0]["losses"]
    assert losses[-1] < losses[0]
