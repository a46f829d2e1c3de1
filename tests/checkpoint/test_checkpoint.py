"""Sharded DCP checkpoints: written by N ranks, loaded by M, training continues as if never
stopped (bitwise when M == N, to parity tolerance otherwise)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, load_checkpoint, save_checkpoint
from tests.harness.dist_helper import run_ranks
from tests.harness.training import (
    ATOL,
    RTOL,
    STEPS_AFTER,
    STEPS_BEFORE,
    _sharded_steps,
    make_model,
    make_optimizer,
)

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


RESHARD_CASES = {
    "2to2": (2, 2, True, False),
    "2to1": (2, 1, False, False),
    "2to3": (2, 3, True, False),
    "3to2": (3, 2, False, False),
    "2to2_bf16_fp32_master": (2, 2, True, True),
}
"""Per case: ranks that save, ranks that load, overlap when saving (loading uses the other
mode), bf16 params on fp32 masters."""


def _each(fn, jobs: list[tuple[str, bool, bool]]) -> list[list[torch.Tensor]]:
    return [fn(*job) for job in jobs]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list, list]]:
    """Every case's uninterrupted run and resumed runs, with one spawn per world size and phase
    (each spawn costs seconds; the cases of one world size run one after another in it)."""
    root = tmp_path_factory.mktemp("reshard")
    paths = {name: root / name / "ckpt" for name in RESHARD_CASES}
    uninterrupted, resumed = {}, {}
    for world_size in sorted({saved_on for saved_on, *_ in RESHARD_CASES.values()}):
        names = [name for name, (saved_on, *_) in RESHARD_CASES.items() if saved_on == world_size]
        jobs = [(str(paths[name]), *RESHARD_CASES[name][2:]) for name in names]
        per_rank = run_ranks(_each, world_size, _train_save_continue, jobs)
        uninterrupted.update(zip(names, per_rank[0], strict=True))
    for world_size in sorted({loaded_on for _, loaded_on, *_ in RESHARD_CASES.values()}):
        names = [name for name, (_, loaded_on, *_) in RESHARD_CASES.items() if loaded_on == world_size]
        jobs = [(str(paths[name]), not RESHARD_CASES[name][2], RESHARD_CASES[name][3]) for name in names]
        per_rank = run_ranks(_each, world_size, _load_continue, jobs)
        for index, name in enumerate(names):
            resumed[name] = [rank_results[index] for rank_results in per_rank]
    return {name: (paths[name], uninterrupted[name], resumed[name]) for name in RESHARD_CASES}


@pytest.mark.parametrize("name", RESHARD_CASES)
def test_checkpoint_reshards(resharded, name: str) -> None:
    """With bf16 params the fp32 master shards are part of the checkpoint, so resuming on the
    same number of ranks is still bitwise."""
    path, uninterrupted, resumed = resharded[name]
    saved_on, loaded_on, _, _ = RESHARD_CASES[name]
    assert (path / ".metadata").is_file()
    assert not path.with_name("ckpt.partial").exists()
    for rank_params in resumed:
        for got, want in zip(rank_params, uninterrupted, strict=True):
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


# -- no deprecated ShardedTensor; checkpoints written with it still load ----------------------------

OLD_CHECKPOINT = Path(__file__).parents[1] / "fixtures" / "checkpoint_sharded_tensor_2ranks"
"""Written on 2 ranks by save_checkpoint as of commit 13a17a4, when state pieces were
ShardedTensors: ``make_model()``, AdamW with two groups (``make_optimizer("adamw_groups")``),
``ShardingConfig(bucket_size_mb=0.001)`` (params cut between the ranks), ``_sharded_steps`` over
steps 0-2, then group 0's lr halved. ``checkpoint_sharded_tensor_2ranks.expected_optimizer.pt``
holds that optimizer's ``state_dict()`` at the save."""


def _save_and_load_without_future_warnings(path: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch deprecates ShardedTensor with one
        model = make_model()
        optimizer = _wrap(model, overlap=True, mixed=False)
        _sharded_steps(model, optimizer, range(2))
        save_checkpoint(path, model, optimizer)
        model = make_model(seed=99)
        load_checkpoint(path, model, _wrap(model, overlap=False, mixed=False))
    return "no warning"


def test_save_and_load_emit_no_future_warning(tmp_path: Path) -> None:
    assert run_ranks(_save_and_load_without_future_warnings, 2, str(tmp_path / "ckpt")) == ["no warning"] * 2


def _load_old_checkpoint(path: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = make_model(seed=99)
        strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=0.001))
        optimizer = ShardingStage1(make_optimizer(OPTIMIZER, model), model=model, strategy=strategy)
        load_checkpoint(path, model, optimizer)
        state = optimizer.state_dict()
    return {"optimizer": state, "model": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_checkpoint_written_with_sharded_tensors_still_loads(world_size: int) -> None:
    expected = torch.load(
        OLD_CHECKPOINT.with_name(OLD_CHECKPOINT.name + ".expected_optimizer.pt"), weights_only=True
    )
    unloaded = make_model(seed=99).state_dict()  # what the ranks load into
    for loaded in run_ranks(_load_old_checkpoint, world_size, str(OLD_CHECKPOINT)):
        assert loaded["optimizer"]["param_groups"] == expected["param_groups"]
        assert loaded["optimizer"]["state"].keys() == expected["state"].keys()
        for index, want in expected["state"].items():
            for key, value in want.items():
                assert torch.equal(loaded["optimizer"]["state"][index][key], value), (index, key)
        assert loaded["model"].keys() == unloaded.keys()
        assert not torch.equal(loaded["model"]["fc1.weight"], unloaded["fc1.weight"])
