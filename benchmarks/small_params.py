"""Backward time and buffer memory for a model of many small params: plain ``torch.optim``
against ``ShardingStage1`` in sync and overlap mode, interleaved, medians.

    python -m benchmarks.small_params [--world-sizes 1 2] [--repeats 30]

The model is ``benchmarks.inner_step.ManyScalars`` (10,000 scalar params), the worst case for
per-param work in backward (one post-accumulate-grad hook each) and for per-param padding in
the flat buffers. Each rank builds four plain and two wrapped copies and, in every repeat, runs
``zero_grad``, forward, backward and ``step`` on each in turn (see ``MODES``); ``backward()`` is
timed (wall clock and the calling thread's CPU time: on CPU the autograd engine runs in the
calling thread, so CPU time is less disturbed by other processes on a shared machine), and so is
the whole iteration's CPU time, where work moved out of backward (the staging of grads, Note
[Staged grads] in ``fusion.layout``) shows. Memory is the bytes of params and grads: the flat
buffers for the wrapper plus grads autograd owns outside them, the tensors themselves for plain
torch. One thread per rank, as each of two ranks gets on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from benchmarks.inner_step import ManyScalars
from sharded_opt import ShardingStage1, spawn

MODES = ("plain", "plain_kept_grads", "plain_hooked", "floor", "sync", "overlap")
"""``plain_kept_grads`` is plain torch zeroing grads with ``set_to_none=False``: backward then
adds into existing grads in place, as it does into the wrapper's flat grad buffers, instead of
taking autograd's grad tensors as they are; it separates that cost from the hooks'.
``plain_hooked`` is plain torch with a post-accumulate-grad hook per param that does nothing:
the price of calling into Python once per param. ``floor`` has both (kept grads and a no-op hook
per param): what any design pays that keeps grads in flat buffers and learns of each grad from
a per-param hook, before its hook does any work."""


def _noop_hook(param: torch.Tensor) -> None:
    """A post-accumulate-grad hook that does nothing (``plain_hooked``, ``floor``)."""


def _build(mode: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = ManyScalars()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode in ("plain_hooked", "floor"):
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(_noop_hook)
    if mode not in ("sync", "overlap"):
        return model, inner
    return model, ShardingStage1(inner, overlap=mode == "overlap", model=model)


def _param_and_grad_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    if isinstance(opt, ShardingStage1):
        memory = opt.memory_bytes()
        own_grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad._base is None]
        return memory["params"] + memory["grads"] + sum(g.numel() * g.element_size() for g in own_grads)
    return sum(2 * p.numel() * p.element_size() for p in model.parameters())


def _time_iteration(
    model: nn.Module, opt: torch.optim.Optimizer, set_to_none: bool
) -> tuple[float, float, float]:
    """Backward's wall and CPU time and the whole iteration's CPU time, in ms."""
    start_cpu = time.thread_time()
    opt.zero_grad(set_to_none=set_to_none)
    loss = model()
    wall, cpu = time.perf_counter(), time.thread_time()
    loss.backward()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    opt.step()
    return wall * 1e3, cpu * 1e3, (time.thread_time() - start_cpu) * 1e3


def measure(repeats: int) -> dict[str, dict[str, float]]:
    """One rank's results per mode: medians ``wall_ms`` and ``cpu_ms`` of backward, the fastest
    ``cpu_min_ms`` (other processes only ever add time), the median ``iteration_cpu_ms`` of
    zero_grad, forward, backward and step, and ``bytes``."""
    torch.set_num_threads(1)
    built = {mode: _build(mode) for mode in MODES}
    times: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
    for repeat in range(repeats + 1):
        for mode in MODES:
            timed = _time_iteration(*built[mode], set_to_none=mode not in ("plain_kept_grads", "floor"))
            if repeat > 0:  # the first backward creates grads and state: warm-up
                times[mode].append(timed)
    return {
        mode: {
            "wall_ms": statistics.median(t[0] for t in times[mode]),
            "cpu_ms": statistics.median(t[1] for t in times[mode]),
            "cpu_min_ms": min(t[1] for t in times[mode]),
            "iteration_cpu_ms": statistics.median(t[2] for t in times[mode]),
            "bytes": _param_and_grad_bytes(*built[mode]),
        }
        for mode in MODES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(
        "| world size | mode | backward wall (ms) | backward CPU (ms) | CPU / plain "
        "| fastest CPU (ms) | fastest / plain | iteration CPU (ms) | / plain "
        "| params+grads (bytes) | / plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world_size in args.world_sizes:
        rank0 = spawn(measure, args=(args.repeats,), nprocs=world_size)[0]
        plain = rank0["plain"]
        for mode in MODES:
            row = rank0[mode]
            cpu_ratio, bytes_ratio = row["cpu_ms"] / plain["cpu_ms"], row["bytes"] / plain["bytes"]
            min_ratio = row["cpu_min_ms"] / plain["cpu_min_ms"]
            iteration_ratio = row["iteration_cpu_ms"] / plain["iteration_cpu_ms"]
            print(
                f"| {world_size} | {mode} | {row['wall_ms']:.1f} | {row['cpu_ms']:.1f} | {cpu_ratio:.3f} "
                f"| {row['cpu_min_ms']:.1f} | {min_ratio:.3f} | {row['iteration_cpu_ms']:.1f} "
                f"| {iteration_ratio:.3f} | {row['bytes']} | {bytes_ratio:.2f} |"
            )


if __name__ == "__main__":
    main()
