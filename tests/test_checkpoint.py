"""Sharded DCP checkpoints: written by N ranks, loaded by M, training continues as if never
stopped (bitwise when M == N, to parity tolerance otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, load_checkpoint, save_checkpoint
from tests.dist_helper import run_ranks
from tests.test_parity import ATOL, RTOL
from tests.test_state_dict import STEPS_AFTER, STEPS_BEFORE, _sharded_steps
from tests.training import make_model, make_optimizer

OPTIMIZER = "adamw_groups"


def _wrap(model, overlap: bool, mixed: bool) -> ShardingStage1:
    strategy = Strategy(sharding=ShardingConfig(master_dtype=torch.float32 if mixed else None))
    return ShardingStage1(make_optimizer(OPTIMIZER, model), overlap=overlap, model=model, strategy=strategy)


def _dtype(mixed: bool) -> torch.dtype:
    return torch.bfloat16 if mixed else torch.float32


def _train_save_continue(path: str, overlap: bool, mixed: bool) -> list[torch.Tensor]:
    model = make_model(dtype=_dtype(mixed))
    optimizer = _wrap(model, overlap, mixed)
    _sharded_steps(model, optimizer, range(STEPS_BEFORE))
    optimizer.param_groups[0]["lr"] *= 0.5  # as a scheduler would; must be restored on load
    save_checkpoint(path, model, optimizer)
    _sharded_steps(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]


def _load_continue(path: str, overlap: bool, mixed: bool) -> list[torch.Tensor]:
    model = make_model(seed=99, dtype=_dtype(mixed))  # everything must come from the checkpoint
    optimizer = _wrap(model, overlap, mixed)
    load_checkpoint(path, model, optimizer)
    _sharded_steps(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("saved_on", "loaded_on", "overlap", "mixed"),
    [
        (2, 2, True, False),
        (2, 1, False, False),
        (2, 3, True, False),
        (3, 2, False, False),
        (2, 2, True, True),
    ],
    ids=["2to2", "2to1", "2to3", "3to2", "2to2_bf16_fp32_master"],
)
def test_checkpoint_reshards(
    tmp_path: Path, saved_on: int, loaded_on: int, overlap: bool, mixed: bool
) -> None:
    """With bf16 params the fp32 master shards are part of the checkpoint, so resuming on the
    same number of ranks is still bitwise."""
    path = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(_train_save_continue, saved_on, path, overlap, mixed)[0]
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    assert not (tmp_path / "ckpt.partial").exists()
    for resumed in run_ranks(_load_continue, loaded_on, path, not overlap, mixed):
        for got, want in zip(resumed, uninterrupted, strict=True):
            if saved_on == loaded_on:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _load_missing(path: str) -> str:
    model = make_model()
    optimizer = ShardingStage1(make_optimizer(OPTIMIZER, model))
    try:
        load_checkpoint(path, model, optimizer)
    except FileNotFoundError as error:
        return str(error)
    return "loaded"


def test_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    partial = tmp_path / "ckpt.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    messages = run_ranks(_load_missing, 1, str(tmp_path / "ckpt.partial"))
    assert "no complete checkpoint" in messages[0]
