"""State bytes per param and step time of torchao's (or bitsandbytes') low-bit AdamW against
torch's AdamW, plain in one process and under ShardingStage1 on N ranks.

    python -m benchmarks.lowbit_states [--model mlp|gpt|odd] [--ranks 2] [--width 1024]
        [--steps 10] [--classes AdamW bnb.AdamW8bit]

Models: ``mlp``, two ``width x width`` layers; ``gpt``, the built-in default GPT (3.3M params,
biases and norms that every class keeps plain beside quantized weights); ``odd``, an MLP of
300 -> 1000 -> LayerNorm -> 5000 -> 77, whose 1000 x 5000 weight holds no whole number of
256-blocks (torchao keeps its state plain). Each rank reports its optimizer state
(``memory_bytes()["optimizer_state"]``: codes and scales of the quantized moments, code books
once) per param of the model and against its 1/N share of the plain class's, and the median
time of ``step()`` after three warm-up steps (torchao compiles its step per tensor shape at the
first one). One thread per rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.models import PRESETS, build_gpt
from sharded_opt import ShardingStage1, spawn
from sharded_opt.step.quantized_state import states_nbytes

CLASSES = ("AdamW", "AdamW8bit", "AdamW4bit", "AdamWFp8")
BITSANDBYTES_CLASSES = ("bnb.AdamW8bit", "bnb.Adam8bit")
"""bitsandbytes' classes, by ``bnb.`` and name (torchao has classes of the same names)."""
WARMUP = 3


MODELS = ("mlp", "gpt", "odd")


def build(model_name: str, width: int) -> nn.Module:
    torch.manual_seed(0)
    if model_name == "gpt":
        return build_gpt(PRESETS["default"], seed=0)
    if model_name == "odd":
        return nn.Sequential(
            nn.Linear(300, 1000), nn.LayerNorm(1000), nn.Linear(1000, 5000), nn.GELU(), nn.Linear(5000, 77)
        )
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def make(cls: str, model_name: str, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build(model_name, width)
    if cls == "AdamW":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if cls.startswith("bnb."):
        import bitsandbytes.optim as module
    else:
        import torchao.optim as module
    return model, getattr(module, cls.removeprefix("bnb."))(model.parameters(), lr=1e-3)


Measured = tuple[int, int, float]
"""State bytes, params of the model, median step seconds."""


def measure(cls: str, model_name: str, width: int, steps: int, sharded: bool) -> Measured:
    """State bytes, params and median step seconds on this process."""
    torch.set_num_threads(1)
    model, opt = make(cls, model_name, width)
    if sharded:
        opt = ShardingStage1(opt, overlap=False, model=model)
    times = []
    for step in range(WARMUP + steps):
        opt.zero_grad()
        for param in model.parameters():  # the grads' values do not change the state's bytes
            param.grad = torch.randn_like(param) * 1e-3
        start = time.perf_counter()
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in model.parameters())
    # A tensor several values share (bitsandbytes' code books; ours per rank) counts once.
    state = opt.memory_bytes()["optimizer_state"] if sharded else states_nbytes(opt.state.values())
    return state, numel, statistics.median(times)


def sharded_rank(
    model_name: str, width: int, steps: int, classes: list[str]
) -> dict[str, tuple[int, int, float]]:
    result = {cls: measure(cls, model_name, width, steps, sharded=True) for cls in classes}
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--classes", nargs="+", default=list(CLASSES), choices=[*CLASSES, *BITSANDBYTES_CLASSES]
    )
    args = parser.parse_args()
    plain = {cls: measure(cls, args.model, args.width, args.steps, sharded=False) for cls in args.classes}
    ranks = spawn(sharded_rank, (args.model, args.width, args.steps, args.classes), nprocs=args.ranks)
    print(f"model {args.model}, {args.ranks} ranks, {args.steps} timed steps after {WARMUP}, one thread each")
    print(
        "| class | plain B/param | plain step ms | B/param per rank | most over its 1/N share "
        "| sharded step ms (max) |"
    )
    print("|---|---|---|---|---|---|")
    for cls in args.classes:
        state, numel, seconds = plain[cls]
        share = state / args.ranks
        per_rank = [r[cls] for r in ranks]
        held = " / ".join(f"{s / n:.4f}" for s, n, _ in per_rank)
        over = max(s for s, _, _ in per_rank) - share
        print(
            f"| {cls} | {state / numel:.4f} | {seconds * 1e3:.1f} | {held} | {over:+.0f} B "
            f"({over / share:+.2%}) | {max(t for _, _, t in per_rank) * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
