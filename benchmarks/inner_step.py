"""Optimizer step time on one rank: plain ``torch.optim`` against ``ShardingStage1`` (sync mode,
world size 1, so the wrapper's own work is all that differs), interleaved, medians.

    python -m benchmarks.inner_step [--repeats 30] [--optimizer adamw]

Two workloads: the default GPT (few large params) and a model of 10,000 scalar params (the worst
case for per-param work). Grads come from one backward and stay in place; each timed call is one
``step()``. One thread, as each rank gets on a 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.models import build_model
from sharded_opt import ShardingStage1

SCALAR_PARAMS = 10_000


class ManyScalars(nn.Module):
    """``SCALAR_PARAMS`` separate 0-dim params summed with weights: a hook and a piece each."""

    def __init__(self) -> None:
        super().__init__()
        self.values = nn.ParameterList(nn.Parameter(torch.tensor(float(i % 7))) for i in range(SCALAR_PARAMS))

    def forward(self) -> torch.Tensor:
        return torch.stack(list(self.values)).square().sum()


def _loss(model: nn.Module, name: str) -> torch.Tensor:
    if name == "scalars":
        return model()
    tokens = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    return model(tokens, tokens)


def _build(name: str) -> nn.Module:
    return ManyScalars() if name == "scalars" else build_model("default", seed=0)


def _make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _prepared(workload: str, optimizer: str, wrap: bool) -> torch.optim.Optimizer:
    model = _build(workload)
    inner = _make_optimizer(optimizer, model.parameters())
    opt = ShardingStage1(inner) if wrap else inner
    opt.zero_grad()
    _loss(model, workload).backward()
    opt.step()  # state exists from here on
    return opt


def _time_step(opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    opt.step()
    return (time.perf_counter() - start) * 1e3


def measure(workload: str, optimizer: str, repeats: int) -> dict[str, float]:
    plain, wrapped = _prepared(workload, optimizer, False), _prepared(workload, optimizer, True)
    times: dict[str, list[float]] = {"plain": [], "wrapped": []}
    for _ in range(repeats):
        times["plain"].append(_time_step(plain))
        times["wrapped"].append(_time_step(wrapped))
    return {mode: statistics.median(values) for mode, values in times.items()}


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo world of this process alone, for the wrapper's own work at world size 1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--workloads", nargs="+", default=["default_gpt", "scalars"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with one_rank_group():
        print(f"| workload | plain {args.optimizer} step (ms) | ShardingStage1 step (ms) | ratio |")
        print("|---|---|---|---|")
        for workload in args.workloads:
            result = measure(workload, args.optimizer, args.repeats)
            ratio = result["wrapped"] / result["plain"]
            print(f"| {workload} | {result['plain']:.2f} | {result['wrapped']:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
