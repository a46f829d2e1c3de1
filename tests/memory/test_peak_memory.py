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
"""Above the README's formula, per param, after the warm-up. The issue's bound is 1.0 at 33.6M
params, where ``python -m benchmarks.peak_memory`` measured +0.5 to +0.8 (sync) after the fixed
cost; at this test's 18.9M params what does not grow with the model and the warm-up leaves
(allocator arenas, the new wrapper's groups) is a larger share: +0.8 to +1.2 measured, so 1.5
leaves a margin that holds while a regression of one bucket-sized buffer (0.5) still fails."""

WIDTH = 1536
"""8 layers of 1536: 18.9M params, buckets of 9.4 MB (fp32): large enough that the per-process
fixed cost left after the warm-up is noise, small enough for ~6 s per mode."""


@pytest.mark.parametrize("mode", ["sync", "overlap", "sync-bf16", "overlap-bf16"])
def test_peak_stays_within_a_byte_per_param_of_the_formula(mode: str) -> None:
    run = MemoryRun(mode, width=WIDTH, steady_steps=2)
    measured = excess(run, measure(run, warm_up=True))
    assert measured <= EXCESS_BOUND_BYTES_PER_PARAM + in_flight_bytes_per_param(run), measured
