"""Differential fuzzing outside the suite: many drawn programs (``tests/differential.py``) per
world size, sharded against plain torch, with a report of every program that differs.

    python -m tests.fuzz_differential --programs 300 --world-sizes 2,3,4 --seed 7 --time-limit-s 900

Each world size runs all its programs in one spawn (starting ranks costs seconds), each program
sync and overlap. On world sizes with a proper divisor, about a third of the programs shard
hybrid (``degree`` or a 2-D device mesh). Every rank checks its own results and keeps going after
a mismatch or an error, so one bad program does not hide the others; a hang ends the world size
at the collective timeout, and the report names the program that was running. The time limit
bounds the whole campaign: ranks stop between programs once it has passed.

A failure prints the program's ``repr``, which replays it:

    python -m tests.fuzz_differential --world-sizes 3 --replay "Program(optimizer='adam', ...)"
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from tests import differential
from tests.differential import Program, StepSpec, check_result, draw_programs, programs, run_program
from tests.dist_helper import run_ranks

FUZZ_COLLECTIVE_TIMEOUT_S = 60.0
"""How long a rank waits in a collective before the world size is given up as hung."""


@dataclasses.dataclass(frozen=True)
class Failure:
    world_size: int
    index: int
    overlap: bool | None
    """None: the failure was not tied to one run (the spawn itself failed)."""
    program: Program | None
    message: str

    def report(self) -> str:
        head = f"world size {self.world_size}, program {self.index}, overlap={self.overlap}"
        return f"{head}\n  {self.program!r}\n  {self.message.strip()}"


def hybrid_programs(world_size: int) -> st.SearchStrategy:
    """Programs of :func:`programs`, a third of them hybrid where ``world_size`` allows it."""
    degrees = [d for d in range(2, world_size) if world_size % d == 0]
    if not degrees:
        return programs()

    @st.composite
    def drawn(draw) -> Program:
        program = draw(programs())
        if draw(st.integers(0, 2)) != 0:
            return program
        return dataclasses.replace(
            program, degree=draw(st.sampled_from(degrees)), device_mesh=draw(st.booleans())
        )

    return drawn()


def check_programs(batch: list[Program], deadline: float) -> tuple[int, list[tuple[int, bool, str]]]:
    """On each rank: run every program sync and overlap until ``deadline`` (seconds since the
    epoch); returns how many programs ran and (program index, overlap, message) for each run
    that failed on this rank."""
    differential.check_collectives_across_ranks()
    failures = []
    ran = 0
    for index, program in enumerate(batch):
        stop = [time.time() > deadline]
        dist.broadcast_object_list(stop, src=0)
        if stop[0]:
            break
        ran += 1
        for overlap in (False, True):
            try:
                result = run_program(dataclasses.replace(program, overlap=overlap))
                check_result(program, result, f"rank {dist.get_rank()}")
            except Exception:  # noqa: BLE001 - reported with the program, the campaign goes on
                failures.append((index, overlap, traceback.format_exc(limit=-6)))
        dist.barrier()
    return ran, failures


def fuzz(world_size: int, count: int, seed: int, time_limit_s: float) -> tuple[list[Failure], int]:
    """Draw ``count`` programs for ``world_size`` and check them until the time limit; returns
    the failures and how many programs ran."""
    batch = draw_programs(count, seed=seed + world_size, strategy=hybrid_programs(world_size))
    return run_batch(world_size, batch, time_limit_s)


def run_batch(world_size: int, batch: list[Program], time_limit_s: float) -> tuple[list[Failure], int]:
    """Check ``batch`` in one spawn; returns the failures and how many programs ran (0 when the
    spawn itself failed)."""
    deadline = time.time() + time_limit_s
    try:
        per_rank = run_ranks(check_programs, world_size, batch, deadline, timeout_s=FUZZ_COLLECTIVE_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - a rank died or hung: report it, go on
        return [Failure(world_size, -1, None, None, f"spawn failed: {error}")], 0
    seen: dict[tuple[int, bool], Failure] = {}
    for _, results in per_rank:
        for index, overlap, message in results:
            seen.setdefault((index, overlap), Failure(world_size, index, overlap, batch[index], message))
    return sorted(seen.values(), key=lambda f: (f.index, f.overlap)), per_rank[0][0]


def simpler(program: Program) -> list[Program]:
    """Every program one edit simpler than ``program``: a step dropped, one field of a step or
    of the program back at its default, or the optimizer plain SGD."""
    candidates = [
        dataclasses.replace(program, steps=program.steps[:i] + program.steps[i + 1 :])
        for i in range(len(program.steps))
        if len(program.steps) > 1
    ]
    for i, spec in enumerate(program.steps):
        for field in dataclasses.fields(StepSpec):
            if getattr(spec, field.name) != field.default:
                edited = dataclasses.replace(spec, **{field.name: field.default})
                candidates.append(
                    dataclasses.replace(program, steps=(*program.steps[:i], edited, *program.steps[i + 1 :]))
                )
    for field in dataclasses.fields(Program):
        if (
            field.name not in ("optimizer", "steps", "overlap")
            and getattr(program, field.name) != field.default
        ):
            candidates.append(dataclasses.replace(program, **{field.name: field.default}))
    if program.optimizer != "sgd":
        candidates.append(dataclasses.replace(program, optimizer="sgd"))
    return [c for c in candidates if c.degree is not None or not c.device_mesh]


def shrink(world_size: int, program: Program, time_limit_s: float) -> Program:
    """The smallest program still failing that greedy one-edit steps from ``program`` reach;
    each round checks every candidate in one spawn."""
    end = time.time() + time_limit_s
    while time.time() < end:
        candidates = simpler(program)
        found, _ = run_batch(world_size, candidates, end - time.time())
        failing = {f.index for f in found if f.program is not None}
        if not failing:
            return program
        program = candidates[min(failing)]
        print(f"shrunk to {program!r}", flush=True)
    return program


def replay(text: str) -> Program:
    """The program a failure report printed."""
    namespace = {"Program": Program, "StepSpec": StepSpec, "differential": differential, "torch": torch}
    return eval(text, namespace)  # noqa: S307 - a program the user pasted from a report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=100, help="programs per world size")
    parser.add_argument("--world-sizes", default="2,3,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=600.0, help="for the whole campaign")
    parser.add_argument("--replay", help="run only this program (a failure report's repr)")
    parser.add_argument("--shrink", action="store_true", help="with --replay: shrink it while it fails")
    args = parser.parse_args(argv)
    end = time.time() + args.time_limit_s
    failures: list[Failure] = []
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        started = time.time()
        if args.replay and args.shrink:
            print(repr(shrink(world_size, replay(args.replay), end - time.time())))
            continue
        if args.replay:
            found, ran = run_batch(world_size, [replay(args.replay)], end - time.time())
        else:
            found, ran = fuzz(world_size, args.programs, args.seed, end - time.time())
        failures += found
        print(
            f"world size {world_size}: {ran} programs ran, {len(found)} failing runs, "
            f"{time.time() - started:.0f} s",
            flush=True,
        )
    for failure in failures:
        print(failure.report(), end="\n\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
