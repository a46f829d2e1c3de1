"""Why a spawned run failed: name the rank that caused it, not the first failure torch noticed.

When one rank dies or raises, its peers fail soon after in their next collective ("connection
reset by peer"), and torch's process context reports whichever failure it sees first. These
helpers collect every rank's exit code and error file after a short grace and raise the root
cause: a rank that died without a traceback (killed, ``os._exit``), else the rank that raised
first.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import multiprocessing.process
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import torch.multiprocessing as mp


def exit_codes_after_first_failure(
    processes: Sequence[multiprocessing.process.BaseProcess], grace_s: float
) -> list[int | None]:
    """Wait until every rank ended cleanly or one failed, give the rest ``grace_s`` to end on
    their own, and return each rank's exit code (None: still running).

    Taken before anyone is stopped, these codes tell a rank that died (a negative code: killed by
    that signal) from the ranks the launcher ends afterwards with SIGTERM.
    """
    running = {process.sentinel: process for process in processes}
    deadline = None
    while running:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(list(running), timeout=timeout)
        if not ready:
            break
        for sentinel in ready:
            process = running.pop(sentinel)
            process.join()
            if process.exitcode != 0 and deadline is None:
                deadline = time.monotonic() + grace_s
    return [process.exitcode for process in processes]


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """What the ranks left behind: their error files, pids and exit codes after the grace."""

    result_dir: Path
    pids: list[int]
    exit_codes: list[int | None]
    grace_s: float

    def failures(self) -> list[tuple[float, int, str]]:
        """(time, rank, traceback) of every rank that raised, earliest first."""
        failures = []
        for path in self.result_dir.glob("rank*.error"):
            stamp, _, trace = path.read_text().partition("\n")
            failures.append((float(stamp), int(path.stem.removeprefix("rank")), trace))
        return sorted(failures)

    def still_running(self) -> list[int]:
        return [rank for rank, code in enumerate(self.exit_codes) if code is None]


def raise_root_cause(
    error: mp.ProcessRaisedException | mp.ProcessExitedException, outcome: RankOutcome
) -> None:
    """Raise the root cause of a failed run if it is not the one torch reported.

    When one rank dies or raises, its peers fail soon after in their next collective ("connection
    reset by peer"); torch reports whichever failure it notices first, which hides the cause. A
    rank that died without a traceback (killed, ``os._exit``) is the cause; otherwise the rank
    that raised first is.
    """
    failures = outcome.failures()
    raised = {rank for _, rank, _ in failures}
    died = [rank for rank, code in enumerate(outcome.exit_codes) if code and rank not in raised]
    if died:
        code = outcome.exit_codes[died[0]]
        raise mp.ProcessExitedException(
            _death_message(died, failures, outcome),
            error_index=died[0],
            error_pid=outcome.pids[died[0]],
            exit_code=code,
            signal_name=_signal_name(code) if code < 0 else None,
        ) from error
    if not failures:
        return
    _, rank, trace = failures[0]
    ended = outcome.still_running()
    if rank == error.error_index and not ended:
        return
    others = sorted(raised - {rank})
    cause = f" (it failed first; the errors of ranks {others} followed from it)" if others else ""
    tail = f"\n{_ended_note(ended, outcome.grace_s)}" if ended else ""
    raise mp.ProcessRaisedException(
        f"\n\n-- Process {rank} terminated with the following error{cause}:\n{trace}{tail}",
        rank,
        outcome.pids[rank],
    ) from error


def _death_message(died: list[int], failures: list[tuple[float, int, str]], outcome: RankOutcome) -> str:
    """'rank 1 was killed by SIGKILL (exit code -9) ...', one line per other rank, and the
    traceback of the first rank that raised (it shows where the survivors were when it broke)."""
    deaths = "; ".join(_how_it_died(rank, outcome.exit_codes[rank]) for rank in died)
    lines = [f"{deaths}, without raising an exception; the other ranks then failed with:"]
    for _, rank, trace in failures:
        last_line = trace.strip().splitlines()[-1] if trace.strip() else "(no traceback)"
        lines.append(f"  rank {rank}: {last_line}")
    ended = outcome.still_running()
    if ended:
        lines.append(f"  {_ended_note(ended, outcome.grace_s)}")
    if len(lines) == 1:
        return f"{deaths}, without raising an exception"
    if failures:
        _, rank, trace = failures[0]
        lines.append(
            f"\n-- Process {rank} (the first to raise) terminated with the following error:\n{trace}"
        )
    return "\n".join(lines)


def _how_it_died(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} was killed by {_signal_name(code)} (exit code {code})"
    return f"rank {rank} exited with code {code}"


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _ended_note(ranks: list[int], grace_s: float) -> str:
    return f"ranks {ranks} were still running {grace_s:g} s after the first failure and were ended"
