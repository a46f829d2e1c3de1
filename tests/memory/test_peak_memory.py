"""Peak resident memory of the sharded modes against the README's bytes per param, measured from
outside as ``benchmarks.peak_memory`` does: 2 gloo ranks with glibc's mmap threshold fixed, peak
reset through ``/proc/self/clear_refs`` and read from ``VmHWM``, after a warm-up that pays the
per-process fixed cost (code pages, threads) before the baseline is read.

Memory does not depend on load (only on which collectives are in flight, which the bounds of
Note [Bounded receive buffers] and Note [Bounded staging] cap), so the margin is the measured
excess's distance to the bound, not a timing allowance.
"""

from __future__ import annotations

import pytest

from benchmarks.peak_memory import MemoryRun, excess, in_flight_bytes_per_param, measure

EXCESS_BOUND_BYTES_PER_PARAM = 1.5
"""Above the README's formula (plus one bucket in overlap mode), per param, after the warm-up.
The issue's bound is 1.0 at 33.6M params, where ``python -m benchmarks.peak_memory`` measured
+0.60 to +0.79 (+0.70 for overlap over its bucket). At this test's 18.9M params what the warm-up
leaves of the per-process cost (a few MiB) weighs more: +1.01 to +1.07, overlap +0.76 over its
bucket. 1.5 leaves ~0.45 of margin, and one more bucket-sized transient (0.5) in sync mode,
such as the receive buffers or gloo's all-gather copies this issue removed, reaches it."""

WIDTH = 1536
"""8 layers of 1536: 18.9M params, buckets of 9.4 MB (fp32), one in flight at a time as in the
33.6M-param benchmark (Note [Bounded receive buffers]); the four modes take 13-23 s."""


MODES = ("sync", "overlap", "sync-bf16", "overlap-bf16")


@pytest.fixture(scope="module")
def excesses() -> dict[str, tuple[float, float]]:
    """Per mode, the measured excess and its bound, all modes in one pair of ranks (starting
    ranks costs more than a mode)."""
    runs = [MemoryRun(mode, width=WIDTH, steady_steps=2) for mode in MODES]
    measured = measure(runs, warm_up=True)
    return {
        run.mode: (excess(run, peaks), EXCESS_BOUND_BYTES_PER_PARAM + in_flight_bytes_per_param(run))
        for run, peaks in zip(runs, measured, strict=True)
    }


@pytest.mark.parametrize("mode", MODES)
def test_peak_stays_within_the_bound_over_the_formula(
    excesses: dict[str, tuple[float, float]], mode: str
) -> None:
    measured, bound = excesses[mode]
    assert measured <= bound, (mode, measured, bound)
