"""The grad hooks' cost per param in backward: plain ``torch.optim`` against ``ShardingStage1`` in
sync and overlap mode, at world size 1 (nothing is reduced, so the hooks are all that differs).

    python -m benchmarks.hook_cost [--params 3000] [--repeats 80]

Every param has 64 fp32 elements (256 bytes): large enough that its bucket keeps hooks (Note
[Staged grads] in ``fusion.layout``), small enough that the hook is a visible share of its
backward. Each backward is timed in the calling thread's CPU time (autograd runs there on CPU, so
other processes disturb it less) and the minimum over the repeats is kept, the usual estimate for
a micro-benchmark on a shared machine. One thread, as each rank gets on a 2-core machine. See
Note [Hook cost] in ``sharded_opt.step.grad_hooks``.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.inner_step import one_rank_group
from sharded_opt import ShardingStage1

WARMUP = 5
MODES = ("plain", "sync", "overlap")


def backward_seconds(mode: str, num_params: int, repeats: int) -> float:
    """The fastest of ``repeats`` backwards over ``num_params`` hooked params in ``mode``."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(num_params)]
    weights = torch.randn(num_params, 64)
    optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.0)
    if mode != "plain":
        optimizer = ShardingStage1(optimizer, overlap=mode == "overlap")
    times = []
    for _ in range(WARMUP + repeats):
        optimizer.zero_grad()
        loss = (torch.stack(params) * weights).sum()
        start = time.process_time()
        loss.backward()
        times.append(time.process_time() - start)
        optimizer.step()
    if isinstance(optimizer, ShardingStage1):
        optimizer.close()
    return min(times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=80)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with one_rank_group():
        seconds = {mode: backward_seconds(mode, args.params, args.repeats) for mode in MODES}
    print("| mode | backward (ms) | per param over plain (us) |")
    print("|---|---|---|")
    for mode in MODES:
        extra = (seconds[mode] - seconds["plain"]) / args.params * 1e6
        print(f"| {mode} | {seconds[mode] * 1e3:.2f} | {extra:.2f} |")


if __name__ == "__main__":
    main()
