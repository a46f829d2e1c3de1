"""spawn and init_parallel_env: environment, results, failures and bad arguments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sharded_opt import init_parallel_env, spawn


def _report_environment(tag: str) -> dict:
    return {
        "tag": tag,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
        "tensor": torch.full((2,), float(dist.get_rank())),
    }


def test_spawn_sets_environment_and_returns_results_in_rank_order() -> None:
    results = spawn(_report_environment, args=("hello",), nprocs=3)
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
