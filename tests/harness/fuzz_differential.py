"""Differential fuzzing outside the suite: many drawn programs (``tests/harness/differential.py``)
per world size, sharded against plain torch, with a report of every program that differs.

    python -m tests.harness.fuzz_differential --programs 300 --world-sizes 2,3,4 --seed 7

Each world size runs all its programs in one spawn (starting ranks costs seconds), each program
sync and overlap. On world sizes with a proper divisor, about a third of the programs shard
hybrid (``degree`` or a 2-D device mesh). Every rank checks its own results and keeps going after
a mismatch or an error, so one bad program does not hide the others; a hang ends the world size
at the collective timeout, and the report names the program that was running. The time limit
bounds the whole campaign: ranks stop between programs once it has passed.

A failure prints the program's ``repr``, which replays it:

    python -m tests.harness.fuzz_differential --world-sizes 3 --replay "Program(optimizer='adam', ...)"

The campaign a change that adds program features or touches the grad path, the layout or the
step needs before it is done (issue 37): ``CAMPAIGN_PROGRAMS`` programs at each of 2, 3 and 4
ranks, hybrid included, on a fresh seed (printed; from the clock unless ``--seed`` is given),
each world size with its own time limit, one world size after another:

    python -m tests.harness.fuzz_differential --campaign [--seed S] [--concurrent]

About one program in seven of a campaign sends a compressed wire (``Program.compressed``: int8
grads and int8 param deltas): those are checked for ranks and modes that agree bitwise, not
against plain torch (``check_compressed_modes``).

It prints a summary (commit, seed, per world size the programs run, the failing runs and the
seconds) and writes it to ``out/campaign-<seed>.json``; the exit status is 1 if any run failed
or a world size ran out of time before its last program. ``--concurrent`` runs the world sizes
at once, each in a process of its own (only worth it with more cores than ranks).

Cost on the 2-core machine the project develops on (one campaign at a time, other jobs beside
it): 300 programs in about 20 minutes at 2 ranks, 27 at 3 and 42 at 4; 150 programs in 7 minutes
at 2 ranks and 100 in 5 at 3 while the test suite ran beside them. ``--concurrent`` only helps
with more cores than ranks. The time limits (``CAMPAIGN_TIME_LIMIT_S``) leave room for load.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from tests.harness import differential
from tests.harness.differential import (
    Program,
    StepSpec,
    check_compressed_modes,
    check_result,
    draw_programs,
    programs,
    run_program,
)
from tests.harness.dist_helper import run_ranks

FUZZ_COLLECTIVE_TIMEOUT_S = 60.0
"""How long a rank waits in a collective before the world size is given up as hung."""

CAMPAIGN_PROGRAMS = 300
CAMPAIGN_WORLD_SIZES = (2, 3, 4)
CAMPAIGN_TIME_LIMIT_S = {2: 2 * 3600.0, 3: 4 * 3600.0, 4: 6 * 3600.0}
"""Per world size: about twice what 300 programs took on the loaded 2-core machine (see the
module docstring), so that they all run there; a world size that runs out of time before its
last program fails the campaign."""
CAMPAIGN_OUT = Path("out")


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
        if not draw(differential.one_in(2)):  # comes out at about a third, see one_in
            return program
        return dataclasses.replace(
            program, degree=draw(st.sampled_from(degrees)), device_mesh=draw(st.booleans())
        )

    return drawn()


def campaign_programs(world_size: int) -> st.SearchStrategy:
    """Programs of :func:`hybrid_programs`, about one in six of them with a compressed wire
    (``Program.compressed``), hybrid or not."""

    @st.composite
    def drawn(draw) -> Program:
        program = draw(hybrid_programs(world_size))
        return dataclasses.replace(program, compressed=draw(differential.one_in(4)))

    return drawn()


def check_programs(batch: list[Program], deadline: float) -> tuple[int, list[tuple[int, bool, str]]]:
    """On each rank: run every program sync and overlap until ``deadline`` (seconds since the
    epoch); returns how many programs ran and (program index, overlap, message) for each run
    that failed on this rank."""
    differential.check_collectives_across_ranks()
    # Each program's close() collects garbage (its wrappers live in cycles); with what was
    # imported out of the collector's sight, that takes milliseconds instead of about a second.
    gc.freeze()
    failures = []
    ran = 0
    for index, program in enumerate(batch):
        stop = [time.time() > deadline]
        dist.broadcast_object_list(stop, src=0)
        if stop[0]:
            break
        ran += 1
        results = {}
        for overlap in (False, True):
            try:
                results[overlap] = run_program(dataclasses.replace(program, overlap=overlap))
                check_result(program, results[overlap], f"rank {dist.get_rank()}")
            except Exception:  # noqa: BLE001 - reported with the program, the campaign goes on
                failures.append((index, overlap, traceback.format_exc(limit=-6)))
        if len(results) == 2:
            try:
                check_compressed_modes(program, results[False], results[True], f"rank {dist.get_rank()}")
            except AssertionError:
                failures.append((index, True, traceback.format_exc(limit=-6)))
        dist.barrier()
    return ran, failures


def fuzz(world_size: int, count: int, seed: int, time_limit_s: float) -> tuple[list[Failure], int]:
    """Draw ``count`` programs for ``world_size`` and check them until the time limit; returns
    the failures and how many programs ran."""
    batch = draw_programs(count, seed=seed + world_size, strategy=campaign_programs(world_size))
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


def summarize(world_size: int, count: int, ran: int, found: list[Failure], seconds: float) -> dict:
    """One world size's line of a campaign summary (JSON-ready)."""
    return {
        "world_size": world_size,
        "programs": count,
        "programs_ran": ran,
        "failing_runs": len(found),
        "seconds": round(seconds, 1),
        "failures": [
            {"index": f.index, "overlap": f.overlap, "program": repr(f.program), "message": f.message}
            for f in found
        ],
    }


def commit_of_checkout() -> str | None:
    """``git rev-parse HEAD``, with ``+changes`` when the checkout differs from it (None outside
    a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def campaign(
    seed: int, count: int, world_sizes: list[int], time_limits_s: dict[int, float], concurrent: bool
) -> dict:
    """Fuzz ``count`` programs at each world size (each with its own time limit), one after
    another or each in a process of its own at once; returns the summary, also written to
    ``out/campaign-<seed>.json``."""
    summary = {"commit": commit_of_checkout(), "seed": seed, "concurrent": concurrent, "world_sizes": []}
    print(f"campaign: seed {seed}, commit {summary['commit']}, {count} programs at {world_sizes}", flush=True)
    CAMPAIGN_OUT.mkdir(exist_ok=True)
    if concurrent:
        summary["world_sizes"] = _concurrent_world_sizes(seed, count, world_sizes, time_limits_s)
    else:
        for world_size in world_sizes:
            started = time.time()
            found, ran = fuzz(world_size, count, seed, time_limits_s[world_size])
            line = summarize(world_size, count, ran, found, time.time() - started)
            summary["world_sizes"].append(line)
            _print_line(line)
            for failure in found:
                print(failure.report(), end="\n\n", flush=True)
    path = CAMPAIGN_OUT / f"campaign-{seed}.json"
    path.write_text(json.dumps(summary, indent=1))
    print(json.dumps({**summary, "world_sizes": [_brief(w) for w in summary["world_sizes"]]}, indent=1))
    print(f"summary written to {path}", flush=True)
    return summary


def campaign_passed(summary: dict) -> bool:
    """No failing run, and every world size ran all its programs."""
    return all(w["failing_runs"] == 0 and w["programs_ran"] == w["programs"] for w in summary["world_sizes"])


def _concurrent_world_sizes(
    seed: int, count: int, world_sizes: list[int], time_limits_s: dict[int, float]
) -> list[dict]:
    """Each world size in a child ``python -m tests.harness.fuzz_differential`` at once; its output goes
    to ``out/campaign-<seed>-ws<N>.log`` (printed at the end), its line of the summary to a
    JSON file beside it."""
    children = []
    for world_size in world_sizes:
        stem = CAMPAIGN_OUT / f"campaign-{seed}-ws{world_size}"
        command = [
            sys.executable, "-m", "tests.harness.fuzz_differential", "--world-sizes", str(world_size),
            "--programs", str(count), "--seed", str(seed), "--time-limit-s", str(time_limits_s[world_size]),
            "--summary-json", str(stem.with_suffix(".json")),
        ]  # fmt: skip
        log = stem.with_suffix(".log").open("w")
        children.append(
            (world_size, stem, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        )
    lines = []
    for world_size, stem, log, child in children:
        child.wait()
        log.close()
        print(stem.with_suffix(".log").read_text(), flush=True)
        try:
            lines.append(json.loads(stem.with_suffix(".json").read_text())[0])
        except (OSError, ValueError, IndexError):
            lines.append(
                summarize(world_size, count, 0, [Failure(world_size, -1, None, None, "child died")], 0.0)
            )
    return lines


def _print_line(line: dict) -> None:
    print(
        f"world size {line['world_size']}: {line['programs_ran']} programs ran, "
        f"{line['failing_runs']} failing runs, {line['seconds']:.0f} s",
        flush=True,
    )


def _brief(line: dict) -> dict:
    return {k: v for k, v in line.items() if k != "failures"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=None, help="programs per world size")
    parser.add_argument("--world-sizes", default=None, help="comma-separated (default 2,3,4)")
    parser.add_argument(
        "--seed", type=int, default=None, help="default: 0, or from the clock with --campaign"
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="for the whole run; with --campaign, for each world size",
    )
    parser.add_argument("--replay", help="run only this program (a failure report's repr)")
    parser.add_argument("--shrink", action="store_true", help="with --replay: shrink it while it fails")
    parser.add_argument(
        "--campaign", action="store_true", help="the campaign of issue 37 (see the module docstring)"
    )
    parser.add_argument("--concurrent", action="store_true", help="with --campaign: world sizes at once")
    parser.add_argument("--summary-json", type=Path, help="write the per world size summary here")
    args = parser.parse_args(argv)
    world_sizes = [int(w) for w in (args.world_sizes or "2,3,4").split(",")]
    if args.campaign:
        seed = args.seed if args.seed is not None else time.time_ns() // 1000 % 10**9
        limits = dict(CAMPAIGN_TIME_LIMIT_S)
        if args.time_limit_s is not None:
            limits = dict.fromkeys(world_sizes, args.time_limit_s)
        count = CAMPAIGN_PROGRAMS if args.programs is None else args.programs
        return 0 if campaign_passed(campaign(seed, count, world_sizes, limits, args.concurrent)) else 1
    seed = 0 if args.seed is None else args.seed
    count = 100 if args.programs is None else args.programs
    end = time.time() + (600.0 if args.time_limit_s is None else args.time_limit_s)
    failures: list[Failure] = []
    lines = []
    for world_size in world_sizes:
        started = time.time()
        if args.replay and args.shrink:
            print(repr(shrink(world_size, replay(args.replay), end - time.time())))
            continue
        if args.replay:
            found, ran = run_batch(world_size, [replay(args.replay)], end - time.time())
        else:
            found, ran = fuzz(world_size, count, seed, end - time.time())
        failures += found
        lines.append(summarize(world_size, 1 if args.replay else count, ran, found, time.time() - started))
        _print_line(lines[-1])
    if args.summary_json is not None:
        args.summary_json.write_text(json.dumps(lines, indent=1))
    for failure in failures:
        print(failure.report(), end="\n\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
