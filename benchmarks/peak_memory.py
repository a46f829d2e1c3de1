"""Peak resident memory per phase of training, per mode, against the README's bytes per param.

``python -m benchmarks.peak_memory`` spawns ``--world-size`` gloo ranks per mode, each a fresh
process with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``, see
/work/shared/MACHINE_NOTES.md: with glibc's sliding threshold, freed tensor memory stays in the
heap and RSS stops following live tensors). Each rank resets its peak (``5`` into
``/proc/self/clear_refs``) at the start of every phase and reads ``VmHWM`` at its end:

* ``model``: the MLP is built (in the params' dtype);
* ``wrap``: DDP, or ``ShardingStage1`` around AdamW, is built;
* ``backward``: the first forward and backward;
* ``step``: the first ``step()`` and ``zero_grad()``;
* ``steady``: ``--steps`` more full iterations.

Each phase's peak is reported in bytes per param above the process's resident bytes before the
model (torch imported, the process group up) and above the model's own bytes, and as an excess
over the formula the README promises for that mode (``formula_bytes_per_param`` minus the
model). Some of a process's peak does not grow with the model: code pages, gloo's and autograd's
threads, allocator arenas (~43 MiB here, 1.3 bytes per param of the 33.6M-param MLP). Each mode
therefore runs twice: in a fresh process (``raw excess``), and after a warm-up in which a tiny
MLP goes through the same phases first (the per-phase columns and ``excess``); ``fixed MiB`` is
the difference of the two peaks. ``one bucket`` is what overlap mode holds by design while it
overlaps (:func:`in_flight_bytes_per_param`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fusion.bucket_sizing import default_bucket_sizes
from sharded_opt import ShardingConfig, ShardingStage1, Strategy, spawn

MMAP_THRESHOLD_BYTES = 128 * 1024
"""Fixed glibc mmap threshold: every allocation above it is its own mapping, returned to the OS
when freed, so RSS follows live tensors (glibc's default threshold slides up to 32 MiB)."""

MODES = ("ddp", "sync", "overlap", "sync-bf16", "overlap-bf16")
"""DDP (fp32), ``ShardingStage1`` sync and overlap (fp32), and both with bf16 params and grads
and fp32 masters."""

PHASES = ("model", "wrap", "backward", "step", "steady")

TINY_WIDTH = 64
"""Width of the warm-up model: 33K params for 8 layers, nothing next to the measured one."""

BATCH_ROWS = 16
"""Rows per micro-batch: activations stay far below a byte per param, so the peak is the
wrapper's."""


@dataclass(frozen=True, slots=True)
class MemoryRun:
    """One mode's measurement: the MLP's shape, the iterations, the ranks."""

    mode: str
    width: int = 2048
    """Square ``Linear`` layers of ``width`` (with bias); 2048 and 8 layers: 33.6M params."""
    layers: int = 8
    steady_steps: int = 3
    world_size: int = 2


def formula_bytes_per_param(mode: str, world_size: int) -> float:
    """What the README promises per trainable param with AdamW: DDP holds fp32 params, grads and
    both moments (16); sharded fp32 holds full params and grads and a 1/N shard of reduced
    grads and moments (8 + 12/N); bf16 params with fp32 masters hold full bf16 params and grads
    and a 1/N shard of fp32 reduced grads, master and moments (4 + 16/N)."""
    if mode == "ddp":
        return 16.0
    if mode.endswith("bf16"):
        return 4 + 16 / world_size
    return 8 + 12 / world_size


def in_flight_bytes_per_param(run: MemoryRun) -> float:
    """What overlap mode holds beyond the formula by design: one bucket's reduction in flight
    during backward, its receive buffer the bucket's size (Note [Bounded receive buffers] in
    ``sharded_opt/comm/comm_context.py``), next to the grad autograd is producing. Zero otherwise."""
    if not run.mode.startswith("overlap"):
        return 0.0
    numel = num_params(run)
    return default_bucket_sizes(numel * model_bytes_per_param(run.mode)).bucket_bytes / numel


def model_bytes_per_param(mode: str) -> int:
    return 2 if mode.endswith("bf16") else 4


def rank_peaks(runs: list[MemoryRun], warm_up: bool) -> list[dict[str, int]]:
    """Run on every rank: per run, in turn, the peak resident bytes of each phase above the
    bytes before its model.

    With ``warm_up``, a model of ``TINY_WIDTH`` first goes through the same phases in every
    run's mode and is dropped: what a process pays once whatever the model (code pages, gloo's
    and autograd's threads, allocator arenas) is then paid before a baseline is read.
    """
    torch.set_num_threads(1)
    if warm_up:
        for run in runs:
            _train(dataclasses.replace(run, width=TINY_WIDTH))
    peaks = []
    for run in runs:
        gc.collect()
        peaks.append(_train(run))
    return peaks


def _train(run: MemoryRun) -> dict[str, int]:
    dtype = torch.bfloat16 if run.mode.endswith("bf16") else torch.float32
    baseline = resident_bytes("VmRSS")
    peaks: dict[str, int] = {}
    reset_peak()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(run.width, run.width, dtype=dtype) for _ in range(run.layers)])
    peaks["model"] = resident_bytes("VmHWM") - baseline
    reset_peak()
    trained, optimizer = _wrap(run.mode, model)
    peaks["wrap"] = resident_bytes("VmHWM") - baseline
    inputs = torch.randn(BATCH_ROWS, run.width, dtype=dtype, generator=torch.Generator().manual_seed(1))
    reset_peak()
    trained(inputs).float().square().mean().backward()
    peaks["backward"] = resident_bytes("VmHWM") - baseline
    reset_peak()
    optimizer.step()
    optimizer.zero_grad()
    peaks["step"] = resident_bytes("VmHWM") - baseline
    reset_peak()
    for _ in range(run.steady_steps):
        trained(inputs).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if isinstance(optimizer, ShardingStage1):
        optimizer.sync_params()
    peaks["steady"] = resident_bytes("VmHWM") - baseline
    if isinstance(optimizer, ShardingStage1):
        optimizer.close()
    dist.barrier()
    return peaks


def _wrap(mode: str, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    if mode == "ddp":
        ddp = DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    master = torch.float32 if mode.endswith("bf16") else None
    strategy = Strategy(sharding=ShardingConfig(master_dtype=master))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    overlap = mode.startswith("overlap")
    return model, ShardingStage1(optimizer, overlap=overlap, strategy=strategy, model=model)


def reset_peak() -> None:
    """Make ``VmHWM`` the current resident size (Linux ``clear_refs``, value 5)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def resident_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last :func:`reset_peak`) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"resident_bytes: no {field} in /proc/self/status")


def measure(runs: list[MemoryRun], warm_up: bool) -> list[dict[str, int]]:
    """Spawn the ranks with the fixed mmap threshold and take ``runs`` in turn (all of one world
    size); per run, the largest peak over ranks per phase."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
    per_rank = spawn(rank_peaks, (runs, warm_up), nprocs=runs[0].world_size, backend="gloo")
    return [
        {phase: max(peaks[index][phase] for peaks in per_rank) for phase in PHASES}
        for index in range(len(runs))
    ]


def num_params(run: MemoryRun) -> int:
    return run.layers * (run.width * run.width + run.width)


def above_model(run: MemoryRun, peaks: dict[str, int]) -> dict[str, float]:
    """Per phase, peak bytes per param above the model's own bytes."""
    numel = num_params(run)
    return {phase: peaks[phase] / numel - model_bytes_per_param(run.mode) for phase in PHASES}


def excess(run: MemoryRun, peaks: dict[str, int]) -> float:
    """Bytes per param of the highest phase above the README's formula."""
    promised = formula_bytes_per_param(run.mode, run.world_size) - model_bytes_per_param(run.mode)
    return max(above_model(run, peaks).values()) - promised


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ",".join(MODES))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steady iterations")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    example = MemoryRun("sync", args.width, args.layers, args.steps, args.world_size)
    print(
        f"MLP {args.layers} x Linear({args.width}, {args.width}): {num_params(example) / 1e6:.1f}M params, ",
        end="",
    )
    print(f"{args.world_size} gloo ranks, AdamW. Peak bytes per param above the model, after a warm-up;")
    print("excess of the highest phase over the README formula, after a warm-up and raw (fresh process).")
    header = ["mode", "formula"] + list(PHASES) + ["excess", "raw excess", "fixed MiB", "one bucket"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for mode in args.modes.split(","):
        run = MemoryRun(mode, args.width, args.layers, args.steps, args.world_size)
        (warmed,), (raw,) = measure([run], warm_up=True), measure([run], warm_up=False)
        phases = above_model(run, warmed)
        formula = formula_bytes_per_param(mode, args.world_size) - model_bytes_per_param(mode)
        fixed_mib = (max(raw.values()) - max(warmed.values())) / 2**20
        cells = [mode, f"{formula:.2f}"] + [f"{phases[p]:.2f}" for p in PHASES]
        cells += [f"{excess(run, warmed):+.2f}", f"{excess(run, raw):+.2f}", f"{fixed_mib:.1f}"]
        cells.append(f"{in_flight_bytes_per_param(run):.2f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
