"""The README's example is a real file; it must run and the README must show it verbatim."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_shows_the_quickstart_file() -> None:
    example = (ROOT / "examples" / "quickstart.py").read_text()
    body = example.split('"""', 2)[2].strip()
    assert body in (ROOT / "README.md").read_text()


def test_quickstart_runs_on_two_ranks() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    assert "final losses per rank:" in result.stdout
    assert "rank 0: loss" in result.stdout and "rank 1: loss" in result.stdout


def _torchrun(ckpt_dir: pathlib.Path, steps: int) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", "2", str(ROOT / "examples" / "train_torchrun.py"),
               "--ckpt-dir", str(ckpt_dir), "--steps", str(steps), "--save-every", "3"]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=240, check=True).stdout


def test_torchrun_example_resumes_where_it_stopped(tmp_path: pathlib.Path) -> None:
    """Stopped after step 6 and started again, it trains to step 10 exactly as a run that never
    stopped; it keeps the newest two checkpoints."""
    first = _torchrun(tmp_path / "ckpt", steps=6)
    assert "resumed" not in first
    resumed = _torchrun(tmp_path / "ckpt", steps=10)
    assert "resumed from step 6" in resumed
    straight = _torchrun(tmp_path / "straight", steps=10)
    assert resumed.splitlines()[-1] == straight.splitlines()[-1]  # loss and param checksum, bitwise
    assert straight.splitlines()[-1].startswith("step 10: loss ")
    kept = sorted(path.name for path in (tmp_path / "ckpt").iterdir())
    assert [name for name in kept if ".ckpt-" not in name] == ["step-10", "step-9"]
    assert len(kept) == 4  # each link and the one folder it points at
