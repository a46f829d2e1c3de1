"""spawn and init_parallel_env: environment, results, failures and bad arguments."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, init_parallel_env, spawn
from sharded_opt.comm import collectives
from sharded_opt.launch import launcher, rank_failures
from tests.harness.dist_helper import START_METHOD


def _report_environment(tag: str) -> dict:
    return {
        "tag": tag,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        # gloo on a CPU-only machine, the CPU half of "cpu:gloo,cuda:nccl" on a GPU machine
        "backend": collectives.backend_for_device(dist.group.WORLD, "cpu"),
        "env": {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
        "tensor": torch.full((2,), float(dist.get_rank())),
    }


@pytest.mark.parametrize("start_method", launcher.START_METHODS)
def test_spawn_sets_environment_and_returns_results_in_rank_order(start_method: str) -> None:
    results = spawn(_report_environment, args=("hello",), nprocs=3, start_method=start_method)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["world_size"] for r in results} == {3}
    assert {r["backend"] for r in results} == {"gloo"}
    assert {r["env"]["MASTER_ADDR"] for r in results} == {"127.0.0.1"}
    assert len({r["env"]["MASTER_PORT"] for r in results}) == 1
    # Below the ephemeral range, so no rank's outgoing connection can self-connect to it.
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert int(results[0]["env"]["MASTER_PORT"]) < floor
    assert [r["env"]["RANK"] for r in results] == ["0", "1", "2"]
    assert all(r["tag"] == "hello" for r in results)
    assert torch.equal(results[2]["tensor"], torch.full((2,), 2.0))


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from the test")
    dist.barrier()  # rank 0 would wait forever for rank 1 without the launcher ending it


def test_child_exception_surfaces_with_rank_and_traceback() -> None:
    with pytest.raises(mp.ProcessRaisedException, match=r"(?s)Process 1 terminated.*ValueError: boom from"):
        spawn(_fail_on_rank_one, nprocs=2, timeout_s=120)


def test_unpicklable_function() -> None:
    with pytest.raises(TypeError, match="picklable function defined at module level"):
        spawn(lambda: None, nprocs=2)


def test_bad_start_method() -> None:
    with pytest.raises(
        ValueError, match=r"start_method to be one of \('spawn', 'forkserver'\) but got 'fork'"
    ):
        spawn(_report_environment, args=("x",), nprocs=2, start_method="fork")


@pytest.mark.parametrize("nprocs", [0, -2, 1.5, True])
def test_bad_nprocs(nprocs) -> None:
    with pytest.raises(ValueError, match="nprocs >= 1"):
        spawn(_report_environment, args=("x",), nprocs=nprocs)


def test_default_nprocs_without_accelerators() -> None:
    with pytest.raises(ValueError, match="without accelerators"):
        spawn(_report_environment, args=("x",))


def test_devices_not_visible() -> None:
    with pytest.raises(ValueError, match=r"devices \[0, 1\] but only 0 accelerator device\(s\) are visible"):
        spawn(_report_environment, args=("x",), devices="0,1")


def test_bad_device_strings() -> None:
    with pytest.raises(ValueError, match='devices like "0,1"'):
        spawn(_report_environment, devices="gpu0")
    with pytest.raises(ValueError, match="distinct devices"):
        spawn(_report_environment, devices=[0, 0])


def test_device_count_differs_from_nprocs(monkeypatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    with pytest.raises(ValueError, match=r"nprocs=3 but 2 devices \[2, 3\]"):
        spawn(_report_environment, devices="2,3", nprocs=3)


def test_init_parallel_env_names_missing_variables(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*torchrun"):
        init_parallel_env()


# -- backend and device per rank (pure; the GPU cases run here with fake device counts) -------------


@pytest.mark.parametrize(
    ("accelerator", "device_count", "local_rank", "backend", "expected"),
    [
        (None, 0, 0, None, ("gloo", None)),
        (None, 0, None, None, ("gloo", None)),
        ("cuda", 1, 0, None, ("cpu:gloo,cuda:nccl", 0)),
        ("cuda", 1, 1, None, ("cpu:gloo,cuda:nccl", None)),  # spawn(fn, nprocs=2) on one GPU
        ("cuda", 8, 3, None, ("cpu:gloo,cuda:nccl", 3)),
        ("cuda", 2, None, None, ("cpu:gloo,cuda:nccl", None)),  # spawn(devices=...) chose it
        ("cuda", 2, 1, "nccl", ("nccl", 1)),  # an explicit backend is kept
        ("cuda", 2, 1, "gloo", ("gloo", 1)),
        (None, 0, 1, "gloo", ("gloo", None)),
    ],
)
def test_plan_parallel_env(accelerator, device_count, local_rank, backend, expected) -> None:
    plan = launcher.plan_parallel_env(accelerator, device_count, local_rank, backend)
    assert (plan.backend, plan.device_index) == expected


class _FakeAccelerator:
    """Stands in for torch.accelerator on a machine with ``count`` CUDA devices."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.current: list[int] = []
        self.backends: list[str] = []
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
        monkeypatch.setattr(torch.accelerator, "set_device_index", self.current.append)
        monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: self.backends.append(backend))
        monkeypatch.setattr(dist, "rendezvous", lambda url, **kw: iter([(None, 0, 1)]))
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.setenv(name, "0")  # restored after the test; the code under test sets them


def test_init_parallel_env_leaves_a_rank_without_a_device_on_cpu(monkeypatch) -> None:
    fake = _FakeAccelerator(monkeypatch, count=1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    init_parallel_env()
    assert fake.current == []  # the old code set device 1: "invalid device ordinal"
    assert fake.backends == ["cpu:gloo,cuda:nccl"]


def test_init_parallel_env_sets_an_existing_device(monkeypatch) -> None:
    fake = _FakeAccelerator(monkeypatch, count=2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    init_parallel_env()
    assert fake.current == [1]
    assert fake.backends == ["cpu:gloo,cuda:nccl"]


def test_spawn_devices_choose_the_device_and_init_keeps_it(monkeypatch) -> None:
    fake = _FakeAccelerator(monkeypatch, count=4)
    launcher._join_group(rank=1, world_size=2, port=1, device_ids=[2, 3], backend=None, timeout_s=5)
    assert fake.current == [3]
    assert fake.backends == ["cpu:gloo,cuda:nccl"]


def _reduce_scatter_path() -> tuple[bool, torch.Tensor]:
    calls = []
    by_all_to_all = collectives._reduce_scatter_by_all_to_all

    def spy(*args, **kwargs):
        calls.append(args)
        return by_all_to_all(*args, **kwargs)

    collectives._reduce_scatter_by_all_to_all = spy
    output = torch.empty(2)
    collectives.reduce_scatter_avg(output, torch.arange(4.0) * (dist.get_rank() + 1), dist.group.WORLD, False)
    return bool(calls), output


def test_cpu_tensors_take_the_gloo_path_in_a_group_with_a_backend_per_device() -> None:
    results = spawn(_reduce_scatter_path, nprocs=2, backend="cpu:gloo")
    assert [took_gloo_path for took_gloo_path, _ in results] == [True, True]
    assert torch.equal(results[0][1], torch.tensor([0.0, 1.5]))
    assert torch.equal(results[1][1], torch.tensor([3.0, 4.5]))


# -- spawn reports a rank's own failure, also one in spawn's code after fn returned -----------------


def _return_a_lock_on_rank_one() -> object:
    return threading.Lock() if dist.get_rank() == 1 else 0


def test_unpicklable_return_value_is_reported_as_the_cause() -> None:
    with pytest.raises(
        mp.ProcessRaisedException, match=r"cannot pickle the lock returned by fn on rank 1 \(cannot pickle"
    ):
        spawn(_return_a_lock_on_rank_one, nprocs=2)


def _both_ranks_catch_a_timeout() -> str:
    with contextlib.suppress(RuntimeError):
        dist.recv(torch.zeros(1), src=1 - dist.get_rank())  # both wait, nobody sends
    return "caught"


def test_broken_group_after_fn_returned_is_reported_as_the_cause() -> None:
    # A short collective timeout bounds the test; the ranks' rendezvous does not depend on it.
    with pytest.raises(
        mp.ProcessRaisedException,
        match=r"fn returned on rank \d, but the closing barrier with the other ranks failed .*"
        r"a collective in fn failed or timed out and left the process group unusable",
    ):
        spawn(_both_ranks_catch_a_timeout, nprocs=2, timeout_s=2, start_method=START_METHOD)


# -- timeouts: the rendezvous waits longer than a short collective timeout --------------------------


def _store_and_collective_timeouts() -> tuple[float, float]:
    store = dist.distributed_c10d._get_default_store()
    return store.timeout.total_seconds(), collectives.collective_timeout(dist.group.WORLD).total_seconds()


def test_a_short_collective_timeout_leaves_the_rendezvous_generous() -> None:
    """A run that bounds its collectives at 1 s must not fail while its ranks start (under load,
    "Timed out after 3 seconds waiting for clients. 1/2 clients joined")."""
    results = spawn(_store_and_collective_timeouts, nprocs=2, timeout_s=1, start_method=START_METHOD)
    assert results == [(launcher.RENDEZVOUS_TIMEOUT_S, 1.0)] * 2


def _rank_zero_evaluates_alone(seconds: float) -> float:
    total = torch.ones(1)
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        time.sleep(seconds)  # a final evaluation or a save on rank 0 only
    return float(total)


def test_rank_zero_working_alone_longer_than_the_collective_timeout_is_waited_for() -> None:
    """Rank 1 returns at once and waits for rank 0 without a timeout, instead of failing the
    closing barrier after 1 s and getting blamed when rank 0 is ended."""
    results = spawn(_rank_zero_evaluates_alone, (4.0,), nprocs=2, timeout_s=1, start_method=START_METHOD)
    assert results == [2.0, 2.0]


# -- the failure report names what is known ---------------------------------------------------------


def _every_rank_refuses_the_strategy() -> None:
    model = torch.nn.Linear(2, 2)
    strategy = Strategy(sharding=ShardingConfig(degree=3))  # does not divide the world size 2
    ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)


def test_the_same_error_on_every_rank_is_reported_once_naming_every_rank() -> None:
    with pytest.raises(mp.ProcessRaisedException) as caught:
        spawn(_every_rank_refuses_the_strategy, nprocs=2, start_method=START_METHOD)
    message = str(caught.value)
    assert "terminated with the following error (ranks [0, 1] raised the same error):" in message, message
    assert message.count("degree to divide the world size 2") == 1, message
    assert "followed from" not in message and "Other ranks" not in message, message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # printed once


def _write_failure(folder: Path, rank: int, stamp: float, last_line: str) -> str:
    trace = f"Traceback (most recent call last):\n  ...\n{last_line}\n"
    (folder / f"rank{rank}.error").write_text(f"{stamp!r}\n{trace}")
    return trace


def test_a_lost_connection_is_a_consequence_even_when_it_came_first(tmp_path: Path) -> None:
    _write_failure(tmp_path, 0, 1.0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    trace = _write_failure(tmp_path, 1, 2.0, "ValueError: bad batch on rank 1")
    outcome = rank_failures.RankOutcome(tmp_path, pids=[100, 101], exit_codes=[1, 1], grace_s=5.0)
    reported = mp.ProcessRaisedException("-- Process 0 terminated ...", 0, 100)
    with pytest.raises(mp.ProcessRaisedException) as caught:
        rank_failures.raise_root_cause(reported, outcome)
    assert caught.value.error_index == 1
    assert str(caught.value) == (
        f"\n\n-- Process 1 terminated with the following error:\n{trace}\n"
        "Ranks that then lost their connection to a failed peer:\n"
        "  rank 0: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    )


def test_different_errors_of_their_own_are_listed_not_attributed(tmp_path: Path) -> None:
    trace = _write_failure(tmp_path, 2, 1.0, "KeyError: 'labels'")
    _write_failure(tmp_path, 0, 2.0, "ValueError: bad batch on rank 0")
    outcome = rank_failures.RankOutcome(tmp_path, pids=[100, 101, 102], exit_codes=[1, None, 1], grace_s=5.0)
    reported = mp.ProcessRaisedException("-- Process 0 terminated ...", 0, 100)
    with pytest.raises(mp.ProcessRaisedException) as caught:
        rank_failures.raise_root_cause(reported, outcome)
    assert str(caught.value) == (
        f"\n\n-- Process 2 terminated with the following error:\n{trace}\n"
        "Other ranks raised errors of their own:\n"
        "  rank 0: ValueError: bad batch on rank 0\n"
        "ranks [1] were still running 5 s after the first failure and were ended"
    )


# -- nothing aborts at exit -------------------------------------------------------------------------


class _SlowExit:
    """Held by a module global: collected while the interpreter finalizes, it keeps the rank
    there for a while, as flushing logs or closing files would."""

    def __del__(self) -> None:
        time.sleep(4.0)


def _refused_step(point_to_point: bool) -> None:
    """Every rank raises from a refused step while overlap mode's reductions are in flight.

    Rank 1 runs its last backward late, so rank 0's reductions land while rank 0 finalizes.
    """
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    wrapped = torch.optim.AdamW(model.parameters())
    strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=0.001, gloo_point_to_point=point_to_point))
    opt = ShardingStage1(wrapped, overlap=True, model=model, strategy=strategy)
    for _ in range(2):
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        globals()["_slow_exit"] = _SlowExit()
    else:
        time.sleep(1.5)
    model(torch.randn(2, 64)).sum().backward()
    wrapped.step()  # refused: "this AdamW is wrapped by ShardingStage1"


_SPAWN_A_REFUSED_STEP = """
import sys
from sharded_opt.launch import launcher
from tests.reliability.test_launcher import _refused_step

measure = launcher.exit_codes_after_first_failure
def exit_codes(processes, grace_s):
    codes = measure(processes, grace_s)
    print("exit codes", codes, flush=True)
    return codes
launcher.exit_codes_after_first_failure = exit_codes
launcher.FAILURE_GRACE_S = 120.0  # every rank ends on its own, however loaded the machine
launcher.spawn(_refused_step, (sys.argv[1] == "p2p",), nprocs=2)
"""


@pytest.mark.parametrize("path", ["collectives", "p2p"])
def test_a_refused_step_exits_with_its_error_and_nothing_aborts(path: str) -> None:
    """Reductions in flight when a rank raises used to end it in SIGABRT at exit ("terminate
    called without an active exception"): Note [No Python on gloo's threads]."""
    run = subprocess.run(
        [sys.executable, "-c", _SPAWN_A_REFUSED_STEP, path],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=600,
    )
    assert "terminate called" not in run.stderr and "Fatal Python error" not in run.stderr, run.stderr
    assert "exit codes [1, 1]" in run.stdout, (run.stdout, run.stderr)
    assert run.returncode == 1, run.stderr
    assert "ranks [0, 1] raised the same error" in run.stderr, run.stderr
    assert "this AdamW is wrapped by ShardingStage1" in run.stderr, run.stderr
