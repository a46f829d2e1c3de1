"""Differential test: random training programs give the same params and optimizer state through
ShardingStage1 (1, 2 and 3 gloo ranks, sync and overlap) as through the plain torch optimizer
with torch's default ``zero_grad()``.

Hypothesis draws one batch of programs per world size from a fixed seed (``derandomize``), and
all of them run in one spawn, because starting ranks costs seconds. See ``tests/differential.py``
for what a program does and how the reference is computed.

Tolerance. The reference averages the same per-slice grads in the same order as the reduction,
and every optimizer here is element-wise, so the runs are expected to be bitwise equal, and are,
except where a program clips: measured on the programs of this file, the largest difference is 0
for every optimizer, fp32 and bf16 with fp32 masters, on 1, 2 and 3 ranks, sync and overlap,
and at most 3e-8 in the programs that clip (the global norm is summed shard by shard, torch sums
it param by param, so the clip coefficient can differ in its last bit). The bound still allows a few
ulps (fp32: rtol 1e-6, atol 1e-7; bf16: one bf16 ulp) because the plain optimizer runs its
kernels on whole params where the wrapper runs them on pieces at other offsets, and another CPU
may contract a vectorized loop's tail differently. Anything semantic (a param stepped without a
grad, a lost step count, a stale master, a dropped scheduler) is orders of magnitude above both.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.differential import LAYERS, OPTIMIZERS, Program, StepSpec, run_programs
from tests.dist_helper import run_ranks

PROGRAMS_PER_WORLD_SIZE = 10
FP32_TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}
BF16_TOLERANCE = {"rtol": 2**-7, "atol": 1e-5}

shapes = st.one_of(st.just(()), st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple))
frozen_layers = st.lists(st.sampled_from(LAYERS), max_size=2, unique=True).map(tuple)

steps = st.builds(
    StepSpec,
    frozen=frozen_layers,
    expert_ranks=st.sampled_from(["all", "none", "some"]),
    micro_batches=st.integers(1, 2),
    zero_grad=st.sampled_from(["optimizer", "optimizer_keep", "model", "optimizer", "none"]),
    clip=st.sampled_from([None, None, 0.05, 5.0]),
    overflow=st.integers(0, 4).map(lambda n: n == 0),
    halve_lr=st.integers(0, 3).map(lambda n: n == 0),
    read_after=st.booleans(),
    clamp_after=st.booleans(),
    swap_state=st.booleans(),
)


@st.composite
def programs(draw) -> Program:
    bf16 = draw(st.integers(0, 3)) == 0
    program_steps = draw(st.lists(steps, min_size=3, max_size=6))
    if bf16:
        program_steps = [dataclasses.replace(step, clamp_after=False) for step in program_steps]
    # Clipped grads that are not zeroed before the next backward: torch accumulates into the
    # clipped averaged grads, the wrapper into its unclipped local ones (documented in
    # ``ShardingStage1.clip_grad_norm_``), so such programs are not drawn.
    # The same holds for grads the scaler unscaled, so with a scaler grads are always zeroed.
    scaler = draw(st.integers(0, 2)) == 0
    program_steps = [
        dataclasses.replace(step, clip=None) if step.zero_grad == "none" else step for step in program_steps
    ]
    if scaler:
        program_steps = [
            dataclasses.replace(step, zero_grad="optimizer") if step.zero_grad == "none" else step
            for step in program_steps
        ]
    else:
        program_steps = [dataclasses.replace(step, overflow=False) for step in program_steps]
    return Program(
        optimizer=draw(st.sampled_from(sorted(OPTIMIZERS))),
        steps=tuple(program_steps),
        frozen_at_wrap=draw(frozen_layers),
        scheduler=draw(st.sampled_from([None, "step", "lambda"])),
        scheduler_before_wrap=draw(st.booleans()),
        bucket_size_mb=draw(st.sampled_from([0.0002, 0.0005, 25.0])),
        bf16_master=bf16,
        attach_model=draw(st.booleans()),
        reuse_body=draw(st.booleans()),
        extra_shapes=tuple(draw(st.lists(shapes, max_size=4))),
        two_groups=draw(st.booleans()),
        scaler=scaler,
    )


def draw_programs(count: int) -> list[Program]:
    """``count`` distinct programs drawn by hypothesis from a fixed seed. Drawing runs in this
    process (no ranks), collecting one program per example, so a whole batch then runs in one
    spawn."""
    drawn: list[Program] = []

    @settings(
        max_examples=2 * count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(program=programs())
    def collect(program: Program) -> None:
        drawn.append(program)

    collect()
    # Every optimizer class in turn, so a small budget still covers them all.
    names = sorted(OPTIMIZERS)
    unique = list(dict.fromkeys(drawn))[:count]
    return [_for_optimizer(p, names[i % len(names)]) for i, p in enumerate(unique)]


def _for_optimizer(program: Program, name: str) -> Program:
    """``program`` with optimizer ``name``. A fused optimizer takes the scaler's ``found_inf``
    into its own step, so a step skipped for an overflow still creates zero state (``step`` 0)
    for params that had none, where the wrapper skips the step as for every other class: the
    params and every later step are the same, the state dict is not (entries of zeros), so
    fused programs are drawn without overflows."""
    if "fused" in name:
        program = dataclasses.replace(
            program, steps=tuple(dataclasses.replace(step, overflow=False) for step in program.steps)
        )
    return dataclasses.replace(program, optimizer=name)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_random_programs_match_plain_torch(world_size: int) -> None:
    everything = draw_programs(3 * PROGRAMS_PER_WORLD_SIZE)
    batch = everything[(world_size - 1) :: 3]
    per_rank = run_ranks(run_programs, world_size, batch)
    for rank, results in enumerate(per_rank):
        for index, result in enumerate(results):
            program = batch[index // 2]
            tolerance = BF16_TOLERANCE if program.bf16_master else FP32_TOLERANCE
            where = f"rank {rank}, program {index // 2} (overlap={index % 2 == 1}): {program}"
            _assert_params_close(result["sharded"], result["plain"], tolerance, where)
            _assert_params_close(result["sharded_reads"], result["plain_reads"], tolerance, f"read, {where}")
            _assert_states_close(result["sharded_state"], result["plain_state"], where)


def _assert_params_close(got: list, expected: list, tolerance: dict, where: str) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m, i=index: f"param {i}, {where}: {m}")


def _assert_states_close(got: dict, expected: dict, where: str) -> None:
    assert sorted(got["state"]) == sorted(expected["state"]), f"params with state differ, {where}"
    for index, entry in expected["state"].items():
        assert list(got["state"][index]) == list(entry), f"state keys of param {index}, {where}"
        for key, value in entry.items():
            mine = got["state"][index][key]
            if key == "step" or not torch.is_floating_point(value):
                assert torch.equal(torch.as_tensor(mine), torch.as_tensor(value)), (
                    f"{key} of param {index}: {mine} != {value}, {where}"
                )
            else:
                torch.testing.assert_close(
                    torch.as_tensor(mine), value, rtol=1e-5, atol=1e-6, check_dtype=False
                )
    for mine, theirs in zip(got["param_groups"], expected["param_groups"], strict=True):
        assert {k: v for k, v in mine.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"
        }, where
