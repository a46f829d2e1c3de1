"""Run a test function on N gloo ranks and bring each rank's return value back to pytest.

Built on the project's own ``spawn`` (free loopback port, child exceptions re-raised with their
rank and traceback); the collective timeout bounds how long a broken test can block. Ranks start
from the forkserver, which ``conftest.py`` preloads with torch and the project, so a job's ranks
start in a fraction of a second instead of importing torch anew (Note [Start methods]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sharded_opt import spawn

TEST_COLLECTIVE_TIMEOUT_S = 60.0
START_METHOD = "forkserver"
PRELOADED_MODULES = [
    "torch",
    "torch.distributed",
    "sharded_opt",
    "tests.harness.dist_helper",
    "pytest",
    "hypothesis",
]
"""What the forkserver imports once, before its first fork (set by ``conftest.py``)."""


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = TEST_COLLECTIVE_TIMEOUT_S
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks; returns the per-rank results in rank order.

    ``timeout_s`` bounds each collective; tests whose failure mode is a hang pass a short one.
    """
    return spawn(
        _single_threaded, (fn, args), nprocs=world_size, timeout_s=timeout_s, start_method=START_METHOD
    )


def run_jobs(jobs: list[tuple[str, Callable[..., Any], tuple[Any, ...]]]) -> dict[str, Any]:
    """On this rank, ``{name: fn(*args)}`` for every ``(name, fn, args)`` of ``jobs``: one spawn
    runs every multi-rank job of a test module (``run_ranks(run_jobs, n, jobs)``)."""
    return {name: fn(*args) for name, fn, args in jobs}


def _single_threaded(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    # Two cores are shared by all ranks and gloo's threads; one intra-op thread per rank keeps
    # the machine from oversubscribing and the per-rank numerics deterministic.
    torch.set_num_threads(1)
    return fn(*args)
