"""``benchmarks.hook_cost`` runs and prints a row per mode (its timings are never asserted)."""

from __future__ import annotations

import subprocess
import sys


def test_hook_cost_prints_a_row_per_mode() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.hook_cost", "--params", "100", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["mode", "plain", "sync", "overlap"], run.stdout
