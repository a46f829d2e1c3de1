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
