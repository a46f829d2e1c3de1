"""Soak: thousands of small, irregular training steps, checking that nothing accumulates.

Every step draws, per rank, a random schedule: 1 to 3 micro-batches (all but the last backward
inside ``no_sync()``), a random subset of branch layers per micro-batch (so params go unused on
some ranks and micro-batches), and a random ``zero_grad`` style (``opt.zero_grad()`` or
``model.zero_grad(set_to_none=True)``). The same schedule trains once in sync mode and once in
overlap mode with the model attached. Every few steps a probe records the process's RSS, the
number of hooks on the model's params and modules, the number of live tensors and the collectives
still pending after ``sync_params()``.

The checks (:func:`soak_problems`): after warm-up, RSS stays within a small bound and the hook and
tensor counts stay exactly constant; no collective is pending after ``sync_params()``; and the
final params of both modes are bitwise equal on every rank.

The CI version (a few hundred steps) runs in ``tests/reliability/test_faults.py``; the long one is a script::

    .venv/bin/python -m tests.harness.soak --steps 5000 [--world-size 2] [--seed 0]

It prints the probes and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, spawn
from tests.harness.training import IN_FEATURES, batch, local_slice

BRANCHES = 4
WIDTH = 16
RSS_BOUND_BYTES = 2 * 2**20
"""Allowed RSS spread after warm-up: the allocator's noise, far below what a per-step leak of a
grad bucket or a pending collective's buffers adds over thousands of steps."""


class SoakModel(nn.Module):
    """A trunk and head every micro-batch uses, and branches each one may skip."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN_FEATURES, WIDTH)
        self.branches = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BRANCHES))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, inputs: torch.Tensor, used: tuple[int, ...]) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(inputs))
        for index in used:
            hidden = hidden + torch.relu(self.branches[index](hidden))
        return self.head(hidden)


@dataclass(frozen=True)
class StepPlan:
    """One rank's schedule for one step: the branches each micro-batch uses, how grads are zeroed."""

    used: tuple[tuple[int, ...], ...]
    zero_grad: str  # "optimizer" or "model"


def plan_step(seed: int, step: int, rank: int) -> StepPlan:
    """The same plan for the same (seed, step, rank), so sync and overlap runs see one schedule."""
    rng = random.Random(f"soak:{seed}:{step}:{rank}")
    micro_batches = rng.randint(1, 3)
    used = tuple(
        tuple(index for index in range(BRANCHES) if rng.random() < 0.5) for _ in range(micro_batches)
    )
    return StepPlan(used, rng.choice(("optimizer", "model")))


def run_soak(steps: int, overlap: bool, seed: int, warmup: int, probe_every: int) -> dict:
    """Train ``steps`` planned steps on this rank; return final params and the probes."""
    torch.manual_seed(0)
    model = SoakModel()
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        overlap=overlap,
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.001)),
    )
    rank = dist.get_rank()
    probes = []
    for step in range(steps):
        _train_step(model, optimizer, step, plan_step(seed, step, rank))
        done = step + 1
        if done >= warmup and (done - warmup) % probe_every == 0:
            probes.append(_probe(model, optimizer, done))
    optimizer.sync_params()
    return {"params": [p.detach().clone() for p in model.parameters()], "probes": probes}


def _train_step(model: SoakModel, optimizer: ShardingStage1, step: int, plan: StepPlan) -> None:
    if plan.zero_grad == "model":
        model.zero_grad(set_to_none=True)
    else:
        optimizer.zero_grad()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    last = len(plan.used) - 1
    for micro, used in enumerate(plan.used):
        inputs, targets = batch(step, micro)
        prediction = model(local_slice(inputs, rank, world_size), used)
        loss = nn.functional.mse_loss(prediction, local_slice(targets, rank, world_size)) / len(plan.used)
        if micro < last:
            with optimizer.no_sync():
                loss.backward()
        else:
            loss.backward()
    optimizer.step()


def _probe(model: SoakModel, optimizer: ShardingStage1, step: int) -> dict:
    optimizer.sync_params()
    buckets = optimizer.shards.buckets
    pending = [b.index for b in buckets if b.param_sync_pending]
    launched = [b.index for b in buckets if b.grad_sync_pending]
    live_tensors = live_tensor_count()  # first: its object list must be in every RSS sample alike
    return {
        "step": step,
        "rss_bytes": rss_bytes(),
        "pending_param_buckets": pending,
        "launched_grad_buckets": launched,
        "hooks": hook_count(model),
        "live_tensors": live_tensors,
    }


def rss_bytes() -> int:
    """This process's resident set size, from /proc/self/statm (pages)."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def hook_count(model: nn.Module) -> int:
    """Hooks registered on the model's params and modules; a leak adds some every step."""
    on_params = sum(
        len(param._post_accumulate_grad_hooks or {}) + len(param._backward_hooks or {})
        for param in model.parameters()
    )
    on_modules = sum(
        len(module._forward_pre_hooks)
        + len(module._forward_hooks)
        + len(module._backward_hooks)
        + len(module._backward_pre_hooks)
        for module in model.modules()
    )
    return on_params + on_modules


def live_tensor_count() -> int:
    """Tensors reachable by the garbage collector after a collection (leaked grads, kept buffers)."""
    gc.collect()
    # type(), not isinstance(): some module objects warn when their __class__ is looked up.
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def soak_both_modes(steps: int, seed: int, warmup: int, probe_every: int) -> dict:
    """Rank entry point: the same schedule in sync mode, then in overlap mode."""
    torch.set_num_threads(1)
    return {
        "sync": run_soak(steps, False, seed, warmup, probe_every),
        "overlap": run_soak(steps, True, seed, warmup, probe_every),
    }


def soak_problems(per_rank: list[dict], rss_bound_bytes: int = RSS_BOUND_BYTES) -> list[str]:
    """Every failed check of a soak, one readable line each; empty if the soak passed."""
    problems = []
    for rank, results in enumerate(per_rank):
        for mode, result in results.items():
            problems += _probe_problems(f"rank {rank} {mode}", result["probes"], rss_bound_bytes)
        pairs = zip(results["sync"]["params"], results["overlap"]["params"], strict=True)
        differing = [index for index, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
        if differing:
            problems.append(f"rank {rank}: params {differing} differ between sync and overlap mode")
    return problems


def _probe_problems(label: str, probes: list[dict], rss_bound_bytes: int) -> list[str]:
    if len(probes) < 2:
        return [f"{label}: {len(probes)} probe(s); run more steps than the warm-up"]
    problems = []
    rss = [probe["rss_bytes"] for probe in probes]
    if max(rss) - min(rss) > rss_bound_bytes:
        problems.append(f"{label}: RSS spread {max(rss) - min(rss)} B > {rss_bound_bytes} B: {rss}")
    for key in ("hooks", "live_tensors"):
        counts = [probe[key] for probe in probes]
        if len(set(counts)) != 1:
            problems.append(f"{label}: {key} changed over the soak: {counts}")
    for probe in probes:
        if probe["pending_param_buckets"] or probe["launched_grad_buckets"]:
            problems.append(f"{label}: collectives pending after sync_params() at step {probe['step']}")
    return problems


def _print_probes(per_rank: list[dict]) -> None:
    for rank, results in enumerate(per_rank):
        for mode, result in results.items():
            probes = result["probes"]
            rss = [probe["rss_bytes"] / 2**20 for probe in probes]
            print(
                f"rank {rank} {mode:7s}: {len(probes)} probes from step {probes[0]['step']} to "
                f"{probes[-1]['step']}; RSS {rss[0]:.2f} -> {rss[-1]:.2f} MiB (min {min(rss):.2f}, "
                f"max {max(rss):.2f}); hooks {sorted({p['hooks'] for p in probes})}; live tensors "
                f"{sorted({p['live_tensors'] for p in probes})}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--probes", type=int, default=20, help="probes after warm-up")
    args = parser.parse_args(argv)
    probe_every = max(1, (args.steps - args.warmup) // args.probes)
    started = time.perf_counter()
    per_rank = spawn(
        soak_both_modes, (args.steps, args.seed, args.warmup, probe_every), nprocs=args.world_size
    )
    print(f"{args.steps} steps x 2 modes on {args.world_size} ranks in {time.perf_counter() - started:.1f} s")
    _print_probes(per_rank)
    problems = soak_problems(per_rank)
    print("\n".join(problems) if problems else "all soak checks passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
