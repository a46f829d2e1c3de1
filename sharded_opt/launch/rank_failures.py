"""Why a spawned run failed: name the rank that caused it, not the first failure torch noticed.

When one rank dies or raises, its peers fail soon after in their next collective ("connection
reset by peer"), and torch's process context reports whichever failure it sees first. These
helpers collect every rank's exit code and error file after a short grace and raise the root
cause: a rank that died without a traceback (killed, ``os._exit``), else the rank that raised
first; see Note [Attribute only what is known].

Note [Attribute only what is known]
    An error is called a consequence of another rank's only when its own words say so: it
    reports a lost connection to a peer (``Connection reset by peer``, ``Connection closed by
    peer``, a broken pipe). Every other error is a rank's own: ranks that raise the same error
    (the same exception and message, a ``ValueError`` each rank raised at construction) are
    reported once, naming all of them, and different errors of their own are listed after the
    first, never said to follow from it. Timing says nothing about cause: the rank that
    raised first is reported first, nothing more.
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
    rank that died without a traceback (killed, ``os._exit``) is the cause; otherwise the ranks'
    own errors are, see Note [Attribute only what is known].
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
    own = [failure for failure in failures if not _lost_a_peer(failure[2])] or failures
    _, rank, trace = own[0]
    same = [other for _, other, other_trace in own if _error_line(other_trace) == _error_line(trace)]
    ended = outcome.still_running()
    if len(raised) == 1 and rank == error.error_index and not ended:
        return  # torch's report is the whole story
    raise mp.ProcessRaisedException(
        _raised_message(rank, trace, same, own, failures, outcome), rank, outcome.pids[rank]
    ) from None  # the message holds torch's report and more: chaining would print it twice


def _raised_message(
    rank: int,
    trace: str,
    same: list[int],
    own: list[tuple[float, int, str]],
    failures: list[tuple[float, int, str]],
    outcome: RankOutcome,
) -> str:
    """The first own error's traceback, naming every rank that raised it, then the other ranks'
    own errors and the lost connections, each as one line."""
    which = f" (ranks {sorted(same)} raised the same error)" if len(same) > 1 else ""
    lines = [f"\n\n-- Process {rank} terminated with the following error{which}:\n{trace}"]
    others = [failure for failure in own if failure[1] not in same]
    if others:
        lines.append("Other ranks raised errors of their own:")
        lines += [f"  rank {other}: {_error_line(other_trace)}" for _, other, other_trace in others]
    followers = [failure for failure in failures if failure not in own]
    if followers:
        lines.append("Ranks that then lost their connection to a failed peer:")
        lines += [f"  rank {other}: {_error_line(other_trace)}" for _, other, other_trace in followers]
    ended = outcome.still_running()
    if ended:
        lines.append(_ended_note(ended, outcome.grace_s))
    return "\n".join(lines)


_LOST_PEER_WORDS = ("connection reset by peer", "connection closed by peer", "broken pipe")
"""How gloo, the TCP store and sockets say that the other end went away (lower case)."""


def _lost_a_peer(trace: str) -> bool:
    """Whether the error says that a peer went away, see Note [Attribute only what is known]."""
    text = trace.lower()
    return any(words in text for words in _LOST_PEER_WORDS)


def _error_line(trace: str) -> str:
    """The exception and its message: the traceback's last line."""
    lines = trace.strip().splitlines()
    return lines[-1] if lines else "(no traceback)"


def _death_message(died: list[int], failures: list[tuple[float, int, str]], outcome: RankOutcome) -> str:
    """'rank 1 was killed by SIGKILL (exit code -9) ...', one line per other rank, and the
    traceback of the first rank that raised (it shows where the survivors were when it broke)."""
    deaths = "; ".join(_how_it_died(rank, outcome.exit_codes[rank]) for rank in died)
    lines = [f"{deaths}, without raising an exception; the other ranks then failed with:"]
    for _, rank, trace in failures:
        lines.append(f"  rank {rank}: {_error_line(trace)}")
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
