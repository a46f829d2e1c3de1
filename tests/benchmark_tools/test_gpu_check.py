"""The GPU check's CPU-checkable parts: it imports and refuses to run without CUDA, and its
harness keeps every part's result when one fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cli_without_cuda_exits_with_a_clear_message(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--quick", "--out", str(tmp_path / "g.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == gpu_check.CUDA_MISSING_EXIT_CODE
    assert "benchmarks.gpu_check needs a CUDA device but torch.cuda.is_available() is False" in done.stderr
    assert not (tmp_path / "g.json").exists()


def test_run_parts_keeps_results_after_a_failure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def broken() -> dict:
        raise RuntimeError("stream raced")

    out = tmp_path / "summary.json"
    ok = gpu_check.run_parts({"first": lambda: {"ratio": 1.01}, "broken": broken, "last": dict}, out)
    summary = json.loads(out.read_text())
    assert not ok and summary["ok"] is False
    assert summary["parts"]["first"]["ok"] and summary["parts"]["first"]["ratio"] == 1.01
    assert summary["parts"]["broken"] == {
        **summary["parts"]["broken"],
        "ok": False,
        "error": "RuntimeError: stream raced",
    }
    assert "Traceback" in summary["parts"]["broken"]["traceback"]
    assert summary["parts"]["last"]["ok"]
    assert "[gpu_check] broken: FAILED RuntimeError: stream raced" in capsys.readouterr().out


def test_run_parts_all_passing(tmp_path: Path) -> None:
    assert gpu_check.run_parts({"only": dict}, tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text())["ok"] is True


def test_check_raises_even_under_python_O() -> None:
    with pytest.raises(AssertionError, match="peak off"):
        gpu_check.check(False, "peak off")
