"""Hybrid sharding (shard within groups of ``degree`` ranks, replicate across them) on 4 CPU ranks.

Every 4-rank check of this module runs in one spawn (the module fixture), because starting ranks
costs seconds: random training programs (tests/harness/differential.py) as 2 x 2 against plain torch,
sync against overlap, the same layout given as a DeviceMesh, clipping, loss scaling, memory per
rank, the error cases, and DCP checkpoints moved between 2 x 2, 1 x 4 and 4 x 1; one more
1-rank spawn loads the 2 x 2 checkpoint in one process.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from sharded_opt import (
    ShardedGradScaler,
    ShardingConfig,
    ShardingStage1,
    Strategy,
    load_checkpoint,
    save_checkpoint,
)
from tests.harness.differential import (
    FP32_TOLERANCE,
    Program,
    StepSpec,
    _assert_params_close,
    check_result,
    draw_programs,
    run_programs,
)
from tests.harness.dist_helper import run_ranks
from tests.harness.training import (
    ATOL,
    GLOBAL_BATCH,
    RTOL,
    STEPS_AFTER,
    STEPS_BEFORE,
    RunConfig,
    _sharded_steps,
    batch,
    local_slice,
    make_model,
    make_optimizer,
    train_many,
    train_reference,
)

WORLD_SIZE = 4
DEGREE = 2
NUM_RANDOM_PROGRAMS = 4

UNUSED_AND_ACCUMULATED = Program(
    optimizer="adamw",
    steps=(
        StepSpec(expert_ranks="some", micro_batches=2),
        StepSpec(frozen=("body",), expert_ranks="none"),
        StepSpec(expert_ranks="some", swap_state=True),
        StepSpec(),
    ),
    bucket_size_mb=0.0005,
)


def _programs() -> list[Program]:
    drawn = [dataclasses.replace(p, degree=DEGREE) for p in draw_programs(NUM_RANDOM_PROGRAMS)]
    fixed = dataclasses.replace(UNUSED_AND_ACCUMULATED, degree=DEGREE)
    as_mesh = dataclasses.replace(fixed, device_mesh=True)
    bf16 = dataclasses.replace(fixed, bf16_master=True, optimizer="adam")
    return [*drawn, fixed, as_mesh, bf16]


CLIP_CONFIGS = {
    "l2_sync": RunConfig(optimizer="adamw", clip_norm=0.05, degree=DEGREE, steps=5),
    "l2_overlap": RunConfig(optimizer="adamw", clip_norm=0.05, overlap=True, degree=DEGREE, steps=5),
    "inf_overlap": RunConfig(
        optimizer="sgd", clip_norm=0.02, clip_norm_type=math.inf, overlap=True, degree=DEGREE, steps=5
    ),
}

# Checkpoint layouts as Strategy().sharding.degree on 4 ranks: 2 x 2, 1 x 4 (full), 4 x 1 (replicas).
LAYOUTS = {"2x2": 2, "1x4": None, "4x1": 1}
CHECKPOINT_MOVES = [("2x2", "2x2"), ("2x2", "1x4"), ("2x2", "4x1"), ("1x4", "2x2"), ("4x1", "2x2")]


def _hybrid_job(programs: list[Program], folder: str) -> dict:
    return {
        "programs": run_programs(programs),
        "clip": train_many(list(CLIP_CONFIGS.values())),
        "scaler": _scaled_training(inf_step=1),
        "memory": _bytes_per_param(),
        "errors": _errors(),
        "checkpoints": _checkpoint_moves(folder),
    }


@pytest.fixture(scope="module")
def hybrid_results(tmp_path_factory) -> tuple[list[Program], list[dict], Path]:
    programs = _programs()
    folder = tmp_path_factory.mktemp("hybrid")
    return programs, run_ranks(_hybrid_job, WORLD_SIZE, programs, str(folder)), folder


def test_programs_match_plain_torch(hybrid_results) -> None:
    """2 x 2 against plain torch averaging per-slice grads per shard group, then across groups."""
    programs, per_rank, _ = hybrid_results
    for rank, results in enumerate(per_rank):
        for index, result in enumerate(results["programs"]):
            program = programs[index // 2]
            where = f"rank {rank}, program {index // 2} (overlap={index % 2 == 1}): {program}"
            check_result(program, result, where)


def test_sync_equals_overlap_bitwise_and_ranks_agree(hybrid_results) -> None:
    programs, per_rank, _ = hybrid_results
    for index in range(len(programs)):
        sync = per_rank[0]["programs"][2 * index]["sharded"]
        for rank in range(WORLD_SIZE):
            for mode in (0, 1):
                got = per_rank[rank]["programs"][2 * index + mode]["sharded"]
                for a, b in zip(got, sync, strict=True):
                    assert torch.equal(a, b), f"program {index}, rank {rank}, overlap={mode == 1}"


@pytest.mark.parametrize("name", list(CLIP_CONFIGS))
def test_clip_norm_counts_each_element_once(hybrid_results, name: str) -> None:
    """The norm of the world-averaged grads, as torch's clip on the unsharded grads gives it:
    summed over the shard group only (a sum over the world would count each shard twice)."""
    _, per_rank, _ = hybrid_results
    index = list(CLIP_CONFIGS).index(name)
    reference = train_reference(CLIP_CONFIGS[name])
    for results in per_rank:
        result = results["clip"][index]
        torch.testing.assert_close(result["norms"], reference["norms"], rtol=1e-5, atol=0)
        assert min(result["norms"]) > CLIP_CONFIGS[name].clip_norm  # clipping was active
        for got, expected in zip(result["params"], reference["params"], strict=True):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def _scaled_training(inf_step: int) -> dict:
    """fp16 params, an overflow on the last rank (second replica) only at ``inf_step``."""
    model = make_model(dtype=torch.float16)
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        strategy=Strategy(sharding=ShardingConfig(master_dtype=torch.float32, degree=DEGREE)),
        overlap=True,
        model=model,
    )
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    changed = []
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(GLOBAL_BATCH // WORLD_SIZE, 12, generator=generator).half()
        if step == inf_step and dist.get_rank() == WORLD_SIZE - 1:
            inputs[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        scaler.scale(model(inputs).float().square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.sync_params()
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
    return {"changed": changed, "scale": scaler.get_scale()}


def test_grad_scaler_skips_the_same_steps_on_every_rank(hybrid_results) -> None:
    _, per_rank, _ = hybrid_results
    for results in per_rank:
        assert results["scaler"] == {"changed": [True, False, True, True], "scale": 128.0}


def _bytes_per_param() -> dict[str, float]:
    # 1024-multiples: no padding, so the bytes per param are exactly the formula's.
    model = torch.nn.Sequential(torch.nn.Linear(1024, 256), torch.nn.Linear(256, 1024))
    numel = sum(p.numel() for p in model.parameters())
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters()), strategy=Strategy(sharding=ShardingConfig(degree=DEGREE))
    )
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    return {key: value / numel for key, value in optimizer.memory_bytes().items()}


def test_state_per_rank_is_divided_by_degree(hybrid_results) -> None:
    _, per_rank, _ = hybrid_results
    for results in per_rank:
        memory = results["memory"]
        assert memory["optimizer_state"] == pytest.approx(8 / DEGREE, rel=1e-3)  # + scalar steps
        assert memory["reduced_grads"] == pytest.approx(4 / DEGREE)


def _error_of(build) -> str:
    try:
        build()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _errors() -> dict[str, str]:
    def wrap(**kwargs):
        model = make_model()
        return ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)

    mesh = init_device_mesh("cpu", (2, 2))
    flat_mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    return {
        "not_dividing": _error_of(lambda: wrap(strategy=Strategy(sharding=ShardingConfig(degree=3)))),
        "mesh_and_degree": _error_of(
            lambda: wrap(device_mesh=mesh, strategy=Strategy(sharding=ShardingConfig(degree=2)))
        ),
        "flat_mesh": _error_of(lambda: wrap(device_mesh=flat_mesh)),
        "not_a_mesh": _error_of(lambda: wrap(device_mesh=[[0, 1], [2, 3]])),
    }


def test_errors_name_the_problem_and_the_fix(hybrid_results) -> None:
    _, per_rank, _ = hybrid_results
    errors = per_rank[0]["errors"]
    assert errors["not_dividing"].startswith("ValueError: ShardingStage1 expects Strategy().sharding.degree")
    assert "world size 4 but got degree=3; use one of [1, 2, 4]" in errors["not_dividing"]
    assert errors["mesh_and_degree"].startswith("ValueError: ShardingStage1 expects either device_mesh")
    assert errors["flat_mesh"].startswith("ValueError: ShardingStage1 expects a 2-D device_mesh")
    assert errors["not_a_mesh"].startswith("TypeError: ShardingStage1 expects device_mesh to be")
    assert all(result["errors"] == errors for result in per_rank)


def test_degree_must_be_a_positive_int() -> None:
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"Strategy.sharding.degree expects None .* or an int >= 1"):
            ShardingConfig(degree=bad)


def test_degree_without_sharding_is_refused() -> None:
    model = torch.nn.Linear(2, 2)
    strategy = Strategy(sharding=ShardingConfig(enable=False, degree=2))
    with pytest.raises(ValueError, match=r"degree=2 with enable=False.*enable=True.*degree=None"):
        ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)


def _wrap_for_checkpoint(model, layout: str, overlap: bool) -> ShardingStage1:
    strategy = Strategy(sharding=ShardingConfig(degree=LAYOUTS[layout]))
    return ShardingStage1(
        make_optimizer("adamw_groups", model), overlap=overlap, model=model, strategy=strategy
    )


def _save_and_continue(path: str, layout: str) -> list[torch.Tensor]:
    model = make_model()
    optimizer = _wrap_for_checkpoint(model, layout, overlap=True)
    _sharded_steps(model, optimizer, range(STEPS_BEFORE))
    save_checkpoint(path, model, optimizer)
    _sharded_steps(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]


def _load_and_continue(path: str, layout: str) -> list[torch.Tensor]:
    model = make_model(seed=99)  # everything must come from the checkpoint
    optimizer = _wrap_for_checkpoint(model, layout, overlap=False)
    load_checkpoint(path, model, optimizer)
    _sharded_steps(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]


def _checkpoint_moves(folder: str) -> dict:
    uninterrupted = {
        layout: _save_and_continue(f"{folder}/{layout}", layout)
        for layout in dict.fromkeys(s for s, _ in CHECKPOINT_MOVES)
    }
    resumed = {
        f"{saved}->{loaded}": _load_and_continue(f"{folder}/{saved}", loaded)
        for saved, loaded in CHECKPOINT_MOVES
    }
    return {"uninterrupted": uninterrupted, "resumed": resumed}


@pytest.mark.parametrize(
    ("saved", "loaded"), CHECKPOINT_MOVES, ids=[f"{s}_to_{t}" for s, t in CHECKPOINT_MOVES]
)
def test_checkpoint_moves_between_layouts(hybrid_results, saved: str, loaded: str) -> None:
    """Resuming on the same layout is bitwise; on another, within parity tolerance."""
    _, per_rank, _ = hybrid_results
    for results in per_rank:
        want = results["checkpoints"]["uninterrupted"][saved]
        got = results["checkpoints"]["resumed"][f"{saved}->{loaded}"]
        for a, b in zip(got, want, strict=True):
            if saved == loaded:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_checkpoint_writes_each_shard_once(hybrid_results) -> None:
    """Only the first replica (ranks 0 and 1 of 2 x 2) writes sharded optimizer state, and the
    saved pieces of each state tensor tile it exactly once. (Replicated entries such as each
    param's ``step`` are written once by whichever rank DCP's planner picks.)"""
    _, _, folder = hybrid_results
    metadata = dcp.FileSystemReader(folder / "2x2").read_metadata()
    writers = {
        info.relative_path.split("_")[2]
        for index, info in metadata.storage_data.items()
        if index.fqn.startswith(("state.", "master.")) and len(metadata.state_dict_metadata[index.fqn].size)
    }
    assert writers == {"0", "1"}
    for name, entry in metadata.state_dict_metadata.items():
        if name.startswith("state.") and len(entry.size) > 0:
            assert sum(math.prod(chunk.sizes) for chunk in entry.chunks) == math.prod(entry.size), name


def test_checkpoint_of_2x2_loads_in_one_process(hybrid_results) -> None:
    _, per_rank, folder = hybrid_results
    resumed = run_ranks(_load_and_continue, 1, str(folder / "2x2"), "1x4")[0]
    want = per_rank[0]["checkpoints"]["uninterrupted"]["2x2"]
    for a, b in zip(resumed, want, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_six_ranks_as_3x2_match_plain_torch_and_sync_equals_overlap() -> None:
    """Three replicas: gloo's all-reduce over three ranks sums in its ring's order, not the
    reference's, so states agree to rounding (params to the fp32 tolerance), not bitwise; sync
    and overlap still do bitwise."""
    program = dataclasses.replace(UNUSED_AND_ACCUMULATED, degree=2, steps=UNUSED_AND_ACCUMULATED.steps[:3])
    per_rank = run_ranks(_six_rank_job, 6, program)
    subgroup = [result["subgroup"] for result in per_rank]
    assert subgroup[4:] == [None, None]
    reference = train_reference(SUBGROUP_CONFIG)["params"]
    for params in subgroup[:4]:
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for rank, (sync, overlap) in enumerate(result["programs"] for result in per_rank):
        for result in (sync, overlap):
            _assert_params_close(result["sharded"], result["plain"], FP32_TOLERANCE, f"rank {rank}")
            for plain, sharded in zip(result["plain_state"], result["sharded_state"], strict=True):
                for index, entry in plain["state"].items():
                    for key, value in entry.items():
                        torch.testing.assert_close(sharded["state"][index][key], value)
        first = per_rank[0]["programs"][0]["sharded"]
        for a, b, c in zip(sync["sharded"], overlap["sharded"], first, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c), f"rank {rank}"


SUBGROUP_CONFIG = RunConfig(optimizer="sgd", steps=3, degree=DEGREE, overlap=True)
SUBGROUP_RANKS = [0, 1, 2, 3]


def _six_rank_job(program: Program) -> dict:
    return {"programs": run_programs([program]), "subgroup": _train_on_subgroup()}


def _train_on_subgroup() -> list[torch.Tensor] | None:
    """2 x 2 hybrid over ranks 0-3 of a 6-rank world: its groups are created by their members
    only (ranks 4 and 5 take no part)."""
    subgroup = dist.new_group(SUBGROUP_RANKS)
    if dist.get_rank() not in SUBGROUP_RANKS:
        return None
    model = make_model()
    strategy = Strategy(sharding=ShardingConfig(degree=DEGREE, bucket_size_mb=SUBGROUP_CONFIG.bucket_size_mb))
    optimizer = ShardingStage1(
        make_optimizer(SUBGROUP_CONFIG.optimizer, model),
        overlap=True,
        strategy=strategy,
        process_group=subgroup,
        model=model,
    )
    rank, world_size = dist.get_rank(subgroup), len(SUBGROUP_RANKS)
    for step in range(SUBGROUP_CONFIG.steps):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        prediction = model(local_slice(inputs, rank, world_size))
        torch.nn.functional.mse_loss(prediction, local_slice(targets, rank, world_size)).backward()
        optimizer.step()
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]
