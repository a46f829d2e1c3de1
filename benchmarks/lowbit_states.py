"""State bytes per param and step time of torchao's (or bitsandbytes') low-bit AdamW against
torch's AdamW, plain in one process and under ShardingStage1 on 2 ranks.

    python -m benchmarks.lowbit_states [--width 1024] [--steps 10] [--classes AdamW bnb.AdamW8bit]

The model is an MLP of two ``width x width`` layers. Each rank reports its optimizer state
(``memory_bytes()["optimizer_state"]``: codes, scales and code books for the quantized
moments) per param of the model, and the median time of ``step()`` after three warm-up steps
(torchao compiles its step per tensor shape at the first one). One thread per rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingStage1, spawn
from sharded_opt.step.quantized_state import stored_bytes

CLASSES = ("AdamW", "AdamW8bit", "AdamW4bit", "AdamWFp8")
BITSANDBYTES_CLASSES = ("bnb.AdamW8bit", "bnb.Adam8bit")
"""bitsandbytes' classes, by ``bnb.`` and name (torchao has classes of the same names)."""
WARMUP = 3


def make(cls: str, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    if cls == "AdamW":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if cls.startswith("bnb."):
        import bitsandbytes.optim as module
    else:
        import torchao.optim as module
    return model, getattr(module, cls.removeprefix("bnb."))(model.parameters(), lr=1e-3)


def measure(cls: str, width: int, steps: int, sharded: bool) -> tuple[float, float]:
    """State bytes per param and median step seconds on this process."""
    torch.set_num_threads(1)
    model, opt = make(cls, width)
    if sharded:
        opt = ShardingStage1(opt, overlap=False, model=model)
    inputs = torch.randn(16, width)
    times = []
    for step in range(WARMUP + steps):
        opt.zero_grad()
        model(inputs).square().mean().backward()
        start = time.perf_counter()
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in model.parameters())
    if sharded:
        state = opt.memory_bytes()["optimizer_state"]
    else:
        # bitsandbytes' step is an int, not a tensor
        state = sum(
            stored_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
        )
    return state / numel, statistics.median(times)


def sharded_rank(width: int, steps: int, classes: list[str]) -> dict[str, tuple[float, float]]:
    result = {cls: measure(cls, width, steps, sharded=True) for cls in classes}
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--classes", nargs="+", default=list(CLASSES), choices=[*CLASSES, *BITSANDBYTES_CLASSES]
    )
    args = parser.parse_args()
    plain = {cls: measure(cls, args.width, args.steps, sharded=False) for cls in args.classes}
    ranks = spawn(sharded_rank, (args.width, args.steps, args.classes), nprocs=2)
    print(f"MLP 2 x {args.width}^2, {args.steps} timed steps after {WARMUP}, one thread per process")
    print("| class | plain B/param | plain step ms | rank 0 B/param | rank 1 B/param | sharded ms (max) |")
    print("|---|---|---|---|---|---|")
    for cls in args.classes:
        per_rank = [r[cls] for r in ranks]
        print(
            f"| {cls} | {plain[cls][0]:.3f} | {plain[cls][1] * 1e3:.1f} | {per_rank[0][0]:.3f} | "
            f"{per_rank[1][0]:.3f} | {max(t for _, t in per_rank) * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
