"""Faults injected into real ranks: a rank killed or hung mid-step, a crash while a checkpoint is
written, resuming after a crash, and a short soak (the long one: ``python -m tests.harness.soak``).

Each fault is injected inside a spawned rank, the way it happens in production: the rank sends
itself SIGKILL from inside its training loop (or from inside a patched checkpoint writer), so
nothing in the rank gets a chance to clean up.

Run: ``.venv/bin/python -m pytest tests/reliability/test_faults.py`` (about a minute on two cores).
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, load_checkpoint, save_checkpoint, spawn
from sharded_opt import checkpoint as checkpoint_module
from sharded_opt.launch import launcher, rank_failures
from tests.harness import soak
from tests.harness.dist_helper import START_METHOD, run_ranks
from tests.harness.training import batch, local_slice, make_model, make_optimizer

STEPS = 12
COLLECTIVE_TIMEOUT_S = 20.0
HANG_BOUND_S = 60.0
"""Generous: start-up of the ranks plus the collective timeout, on a loaded 2-core machine. A
hang would only end at pytest's own timeout."""

PHASES = ("before_backward", "before_step", "after_step")
"""Where in a step the victim dies: with overlap, reduce-scatters are in flight before step and
all-gathers after it; in sync mode the peers are inside step's collectives or on their way."""

# -- training with a fault --------------------------------------------------------------------------


def _wrap(model: torch.nn.Module, overlap: bool) -> ShardingStage1:
    return ShardingStage1(
        make_optimizer("adamw_groups", model),
        overlap=overlap,
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.001)),
    )


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _train(model, optimizer: ShardingStage1, steps: range, fault: tuple[int, str] | None = None) -> None:
    """Train on this rank's slice of each step's batch; die at ``fault`` = (step, phase)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in steps:
        optimizer.zero_grad()
        inputs, targets = batch(step)
        prediction = model(local_slice(inputs, rank, world_size))
        loss = torch.nn.functional.mse_loss(prediction, local_slice(targets, rank, world_size))
        if fault == (step, "before_backward"):
            _die()
        loss.backward()
        if fault == (step, "before_step"):
            _die()
        optimizer.step()
        if fault == (step, "after_step"):
            _die()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _record_pid(folder: str) -> None:
    Path(folder, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))


# -- 1. a rank dies or hangs mid-step ---------------------------------------------------------------


def _train_with_victim(victim: int, fault: tuple[int, str], overlap: bool, pid_folder: str) -> None:
    torch.set_num_threads(1)
    _record_pid(pid_folder)
    model = make_model()
    optimizer = _wrap(model, overlap)
    _train(model, optimizer, range(STEPS), fault if dist.get_rank() == victim else None)


def _assert_all_ended(pid_folder: Path, world_size: int) -> None:
    """No rank's process is left running (torch reaped them all, so their pids are free)."""
    pids = [int(path.read_text()) for path in pid_folder.glob("rank*.pid")]
    assert len(pids) == world_size
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_killed_rank_is_named_and_the_others_fail_fast(
    tmp_path: Path, world_size: int, overlap: bool
) -> None:
    """A peer of a dead rank fails in its next collective; spawn names the dead rank and signal."""
    rng = random.Random(f"kill:{world_size}:{overlap}")
    # Never the last step: the peers must have a collective left to fail in.
    victim, fault = rng.randrange(world_size), (rng.randrange(1, STEPS - 1), rng.choice(PHASES))
    started = time.monotonic()
    with pytest.raises(mp.ProcessExitedException) as caught:
        spawn(
            _train_with_victim,
            (victim, fault, overlap, str(tmp_path)),
            nprocs=world_size,
            timeout_s=COLLECTIVE_TIMEOUT_S,
            start_method=START_METHOD,
        )
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert message.startswith(f"rank {victim} was killed by SIGKILL (exit code -9)"), (fault, message)
    assert (caught.value.error_index, caught.value.signal_name) == (victim, "SIGKILL")
    for peer in set(range(world_size)) - {victim}:
        # Each peer failed on its own, in a collective, rather than being ended by the launcher.
        assert f"\n  rank {peer}: RuntimeError: " in message, (fault, message)
    assert elapsed < HANG_BOUND_S, (fault, elapsed)
    _assert_all_ended(tmp_path, world_size)


@pytest.mark.parametrize("reported_rank", [0, 1])
def test_the_dead_rank_is_reported_whichever_failure_torch_saw_first(
    tmp_path: Path, reported_rank: int
) -> None:
    """torch reports the peer's 'connection reset' or the death, whichever it sees first; spawn
    always reports the death, with the peers' errors after it."""
    trace = "Traceback (most recent call last):\n  ...\nRuntimeError: Connection reset by peer\n"
    (tmp_path / "rank0.error").write_text(f"{time.time()!r}\n{trace}")
    outcome = rank_failures.RankOutcome(tmp_path, pids=[100, 101, 102], exit_codes=[1, -9, None], grace_s=5.0)
    if reported_rank == 0:
        reported = mp.ProcessRaisedException(
            f"-- Process 0 terminated with the following error:\n{trace}", 0, 100
        )
    else:
        reported = mp.ProcessExitedException(
            "process 1 terminated with signal SIGKILL", 1, 101, -9, "SIGKILL"
        )
    with pytest.raises(mp.ProcessExitedException) as caught:
        rank_failures.raise_root_cause(reported, outcome)
    assert str(caught.value) == (
        "rank 1 was killed by SIGKILL (exit code -9), without raising an exception; the other ranks then "
        "failed with:\n  rank 0: RuntimeError: Connection reset by peer\n  ranks [2] were still running 5 s "
        f"after the first failure and were ended\n\n-- Process 0 (the first to raise) terminated with the "
        f"following error:\n{trace}"
    )
    assert (caught.value.error_index, caught.value.error_pid, caught.value.exit_code) == (1, 101, -9)
    assert caught.value.__cause__ is reported


def test_a_rank_that_exits_without_raising_is_named(tmp_path: Path) -> None:
    outcome = rank_failures.RankOutcome(tmp_path, pids=[100, 101], exit_codes=[0, 3], grace_s=5.0)
    reported = mp.ProcessExitedException("process 1 terminated with exit code 3", 1, 101, 3)
    with pytest.raises(
        mp.ProcessExitedException, match=r"^rank 1 exited with code 3, without raising an exception$"
    ):
        rank_failures.raise_root_cause(reported, outcome)


def _train_with_hung_rank(victim: int, hang_step: int, pid_folder: str) -> None:
    torch.set_num_threads(1)
    _record_pid(pid_folder)
    model = make_model()
    optimizer = _wrap(model, overlap=True)
    if dist.get_rank() == victim:
        _train(model, optimizer, range(hang_step))
        time.sleep(3600)  # alive and silent: no connection resets, only the timeout can tell
    _train(model, optimizer, range(STEPS))


def test_hung_rank_ends_in_the_collective_timeout(tmp_path: Path, monkeypatch) -> None:
    """The collective timeout is the backstop when no connection breaks."""
    monkeypatch.setattr(launcher, "FAILURE_GRACE_S", 1.0)
    timeout_s = 8.0  # only the collectives; the ranks' rendezvous waits longer (launcher)
    started = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as caught:
        spawn(
            _train_with_hung_rank,
            (1, 3, str(tmp_path)),
            nprocs=2,
            timeout_s=timeout_s,
            start_method=START_METHOD,
        )
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert "Process 0 terminated with the following error" in message, message
    # gloo's words vary with the op: "Timed out waiting 8000ms for recv ...", or "Application
    # timeout caused pair closure" for the works queued behind the one that timed out.
    assert re.search("Timed out waiting 8000ms|Application timeout", message), message
    assert "ranks [1] were still running 1 s after the first failure and were ended" in message, message
    assert elapsed < HANG_BOUND_S, elapsed
    _assert_all_ended(tmp_path, 2)


# -- 2. a crash while a checkpoint is written -------------------------------------------------------


def _install_save_fault(where: str) -> None:
    """Make this rank die at ``where`` inside its next ``save_checkpoint``."""
    if where == "writing_shards":  # after this rank wrote its shard files, before DCP's metadata

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            _die()

        write_data = dcp.FileSystemWriter.write_data
        dcp.FileSystemWriter.write_data = write_then_die
    elif where == "before_publish":  # everything written, '.partial' not yet renamed into place
        checkpoint_module._publish = lambda staging, final: _die()
    elif where == "before_link_swap":  # the new folder complete and renamed, the link not yet swapped
        checkpoint_module._point_link = lambda final, version: _die()
    else:
        raise ValueError(where)


def _save_then_crash_in_next_save(folder: str, victim: int, where: str) -> None:
    torch.set_num_threads(1)
    rank, path = dist.get_rank(), Path(folder, "ckpt")
    model = make_model()
    optimizer = _wrap(model, overlap=True)
    _train(model, optimizer, range(4))
    save_checkpoint(path, model, optimizer)
    torch.save(_params(model), Path(folder, f"published{rank}.pt"))
    _train(model, optimizer, range(4, 8))
    optimizer.sync_params()
    torch.save(_params(model), Path(folder, f"unpublished{rank}.pt"))
    if rank == victim:
        _install_save_fault(where)
    save_checkpoint(path, model, optimizer)


def _load_after_crash(folder: str) -> dict:
    """Load the published checkpoint and try the staging folder, on fresh models."""
    outcome = {"published": _load_params(Path(folder, "ckpt"))}
    try:
        outcome["partial"] = _load_params(Path(folder, "ckpt.partial"))
    except FileNotFoundError as error:
        outcome["partial"] = str(error)
    return outcome


def _load_params(path: Path) -> list[torch.Tensor]:
    model = make_model(seed=99)  # a different init: every value must come from the checkpoint
    optimizer = _wrap(model, overlap=False)
    load_checkpoint(path, model, optimizer)
    return _params(model)


def _assert_equal_params(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}: param {index} differs"


@pytest.mark.parametrize(
    ("victim", "where"),
    [
        (1, "writing_shards"),
        (0, "before_publish"),
        (0, "before_link_swap"),
    ],
)
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path: Path, victim: int, where: str) -> None:
    """The published checkpoint still loads to exactly its values; the new one is never half-read."""
    with pytest.raises(mp.ProcessExitedException, match=f"^rank {victim} was killed by SIGKILL"):
        spawn(
            _save_then_crash_in_next_save,
            (str(tmp_path), victim, where),
            nprocs=2,
            timeout_s=60,
            start_method=START_METHOD,
        )
    assert (tmp_path / "ckpt" / ".metadata").is_file(), sorted(p.name for p in tmp_path.iterdir())
    for rank, outcome in enumerate(run_ranks(_load_after_crash, 2, str(tmp_path))):
        published = torch.load(tmp_path / f"published{rank}.pt", weights_only=True)
        _assert_equal_params(outcome["published"], published, f"rank {rank}: ckpt after the crash")
        if where == "writing_shards":  # shards on disk but no DCP metadata: refused, not half-read
            assert any((tmp_path / "ckpt.partial").glob("*.distcp"))
            assert "holds no complete checkpoint" in outcome["partial"], outcome["partial"]
        elif where == "before_publish":  # complete, never published: it loads to its own values only
            unpublished = torch.load(tmp_path / f"unpublished{rank}.pt", weights_only=True)
            _assert_equal_params(outcome["partial"], unpublished, f"rank {rank}: ckpt.partial")


# -- 3. resume after a crash ------------------------------------------------------------------------

CHECKPOINT_EVERY = 3


def _train_checkpointing(folder: str, victim: int, fault: tuple[int, str], overlap: bool) -> None:
    """Save ``stepNNN`` after every CHECKPOINT_EVERY steps; the victim dies at ``fault``."""
    torch.set_num_threads(1)
    model = make_model()
    optimizer = _wrap(model, overlap)
    own_fault = fault if dist.get_rank() == victim else None
    for step in range(STEPS):
        _train(model, optimizer, range(step, step + 1), own_fault)
        if (step + 1) % CHECKPOINT_EVERY == 0:
            save_checkpoint(Path(folder, f"step{step + 1:03d}"), model, optimizer)


def _last_complete_checkpoint(folder: str) -> int:
    """Steps done at the newest checkpoint that has DCP metadata (what a job would resume from)."""
    done = [
        int(path.name.removeprefix("step"))
        for path in Path(folder).glob("step[0-9][0-9][0-9]")  # the published links only
        if (path / ".metadata").is_file()
    ]
    return max(done, default=0)


def _resume_and_run_uninterrupted(folder: str, overlap: bool) -> dict:
    done = _last_complete_checkpoint(folder)
    model = make_model(seed=99)
    optimizer = _wrap(model, overlap)
    load_checkpoint(Path(folder, f"step{done:03d}"), model, optimizer)
    _train(model, optimizer, range(done, STEPS))
    optimizer.sync_params()
    resumed = _params(model)
    model = make_model()
    optimizer = _wrap(model, overlap)
    _train(model, optimizer, range(STEPS))
    optimizer.sync_params()
    return {"resumed_from": done, "resumed": resumed, "uninterrupted": _params(model)}


def test_resume_after_crash_is_bitwise_uninterrupted(tmp_path: Path) -> None:
    """In overlap mode with the model attached, where all-gathers may still be in flight when
    the rank dies (tests/checkpoint/test_checkpoint.py resumes both modes after a clean stop)."""
    overlap = True
    rng = random.Random("resume")
    victim, fault = rng.randrange(2), (rng.randrange(CHECKPOINT_EVERY + 1, STEPS - 1), rng.choice(PHASES))
    with pytest.raises(mp.ProcessExitedException, match=f"^rank {victim} was killed by SIGKILL"):
        spawn(
            _train_checkpointing,
            (str(tmp_path), victim, fault, overlap),
            nprocs=2,
            timeout_s=60,
            start_method=START_METHOD,
        )
    for rank, result in enumerate(run_ranks(_resume_and_run_uninterrupted, 2, str(tmp_path), overlap)):
        # Steps 0..s-1 of the fatal step s completed, so the last save is the one at or before s.
        expected = fault[0] // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        assert result["resumed_from"] == expected, (fault, result["resumed_from"])
        _assert_equal_params(result["resumed"], result["uninterrupted"], f"rank {rank} after resume")


# -- 4. soak ----------------------------------------------------------------------------------------


def test_short_soak_leaks_nothing_and_overlap_equals_sync() -> None:
    """250 irregular steps per mode, probed every 30 after a warm-up of 100 (in sync mode RSS
    settles by a one-off ~1 MiB between steps 50 and 70); tests/harness/soak.py has the details."""
    per_rank = run_ranks(soak.soak_both_modes, 2, 250, 0, 100, 30)
    assert soak.soak_problems(per_rank) == []
