"""``python -m benchmarks.convergence``: does ``ShardingStage1`` with a compressed wire
(``Strategy().sharding.grad_compression`` / ``param_compression``) still train as well as exact?

Step-by-step parity tests cannot answer that: a compressed setting is not meant to match exact
bitwise, only to reach about the same loss. So every setting trains the same byte-level GPT,
from the same seed, on the same batches, on 2 gloo CPU ranks (each on its half of every global
batch), and the curves differ only by the setting. The text is real English prose that every
Python ships with, so nothing is downloaded: the help topics of Python's own documentation
(``pydoc_data.topics``), its last tenth held out. The held-out loss is measured on a fixed set
of held-out batches every ``--eval-every`` steps and at the end.

One setting, ``exact-ulp``, is the control: the exact wire, but every initial param moved by one
ulp. Trajectories part after any tiny difference, so how far it ends from exact is the spread a
setting shows without costing anything; a setting's distance from exact means something only
beyond that spread.

Every setting is also checked: every loss finite, and both ranks holding bitwise the same params
at the end (an int8 param delta that two ranks applied differently would break training
silently). Writes a JSON file (``--out``) with each setting's curves, its final held-out loss
relative to exact's, and its step time, a PNG of the curves beside it, and prints a table. Exits
with 1 when a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import math
import pydoc_data.topics
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks import plots
from benchmarks.data import DataConfig, RankBatches
from benchmarks.models import GPTConfig, build_gpt
from benchmarks.modes import AdamWConfig, Compression
from benchmarks.report import environment, write_json
from sharded_opt import ShardingConfig, ShardingStage1, Strategy, spawn


@dataclass(frozen=True, slots=True)
class Setting:
    """What one setting changes against exact training; nothing else differs between settings."""

    compression: Compression = Compression()
    """The wire: ``ShardingConfig.grad_compression`` and ``param_compression``."""
    ulp_nudge: bool = False
    """Move every initial param element one ulp (``torch.nextafter``) towards +inf or -inf, the
    direction drawn from the run's seed (:func:`nudge_one_ulp`): the smallest change a run can
    have, so the control for how far trajectories spread apart after any difference."""
    error_feedback: bool = False
    """``ShardingConfig.grad_error_feedback``: carry the grads' rounding error into the next
    step (Note [Error feedback] in ``sharded_opt/comm/compression.py``)."""


SETTINGS: dict[str, Setting] = {
    "exact": Setting(),
    "exact-ulp": Setting(ulp_nudge=True),
    "bf16": Setting(Compression(grad="bf16")),
    "bf16-ef": Setting(Compression(grad="bf16"), error_feedback=True),
    "int8-grads": Setting(Compression(grad="int8")),
    "int8-grads-ef": Setting(Compression(grad="int8"), error_feedback=True),
    "int8": Setting(Compression(grad="int8", param="int8")),
}
"""Exact first: the others are compared with it. ``exact-ulp`` is the control: the exact wire
from one-ulp-nudged initial params, its distance from exact the run-to-run spread."""

ULP_NUDGE_SEED_OFFSET = 1_000_000
"""Added to the run's seed to seed the nudge's directions: far from the seeds the run already
uses (``seed`` for the weights and batches, ``seed + 1`` for the held-out batches), so the
directions are a stream of their own."""

MODEL = GPTConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4)
"""0.44M params: big enough to learn English words and the docs' markup, small enough that the
thousand steps of one setting fit in a few minutes on 2 CPU cores."""

HELDOUT_FRACTION = 0.1

MIN_LR_RATIO = 0.1
"""The cosine schedule ends at this fraction of the peak learning rate: a decayed learning rate
settles the final loss, so settings are compared on a loss that no longer jumps per step."""


@dataclass(frozen=True, slots=True)
class ConvergenceConfig:
    """One training run of a setting; every setting of an experiment shares it."""

    model: GPTConfig = MODEL
    steps: int = 1000
    micro_batch: int = 16
    """Sequences per rank and step: the global batch is ``micro_batch * world_size``."""
    adamw: AdamWConfig = AdamWConfig(lr=3e-3)
    warmup_steps: int = 50
    eval_every: int = 100
    eval_batches: int = 8
    """Global held-out batches of ``micro_batch * world_size`` sequences, the same at every
    evaluation; each rank evaluates its half of each."""
    seed: int = 0
    overlap: bool = False
    world_size: int = 2


DEFAULTS = ConvergenceConfig()


def pydoc_corpus() -> Tensor:
    """The documentation's help topics, joined in sorted-key order, as UTF-8 bytes (uint8)."""
    topics = pydoc_data.topics.topics
    text = "".join(topics[key] for key in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def split_corpus(corpus: Tensor) -> tuple[Tensor, Tensor]:
    """(train, held out): the held-out part is the last tenth, a contiguous stretch of topics the
    model never trains on."""
    cut = len(corpus) - int(len(corpus) * HELDOUT_FRACTION)
    return corpus[:cut], corpus[cut:]


def lr_factor(step: int, config: ConvergenceConfig) -> float:
    """Linear warm-up, then cosine decay to ``MIN_LR_RATIO`` at the last step."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def strategy_for(setting: str, overlap: bool) -> Strategy:
    """The default strategy but for the setting's wire: settings differ in nothing else."""
    compression = SETTINGS[setting].compression
    return Strategy(
        sharding=ShardingConfig(
            enable_overlap=overlap,
            grad_compression=compression.grad,
            param_compression=compression.param,
            grad_error_feedback=SETTINGS[setting].error_feedback,
        )
    )


def train_rank(config: ConvergenceConfig, setting: str) -> dict:
    """What each rank runs: train ``setting`` and return this rank's training losses (of its half
    of each batch), held-out losses (of its half of the held-out set), step times and a digest
    of its final params."""
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_text, heldout_text = split_corpus(pydoc_corpus())
    data = DataConfig(config.model.seq_len, config.micro_batch, config.seed)
    batches = RankBatches(train_text, data, rank, world_size)
    heldout = RankBatches(heldout_text, dataclasses.replace(data, seed=config.seed + 1), rank, world_size)
    heldout_set = [heldout.batch(index) for index in range(config.eval_batches)]
    model = build_gpt(config.model, config.seed)
    if SETTINGS[setting].ulp_nudge:
        nudge_one_ulp(model, config.seed + ULP_NUDGE_SEED_OFFSET)
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), **config.adamw.kwargs()),
        strategy=strategy_for(setting, config.overlap),
        model=model,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, config=config))
    train_losses: list[float] = []
    step_s: list[float] = []
    heldout_losses = [mean_loss(model, heldout_set)]
    for step in range(config.steps):
        inputs, targets = batches.batch(step)
        start = time.perf_counter()
        train_losses.append(train_step(model, optimizer, inputs, targets))
        step_s.append(time.perf_counter() - start)
        scheduler.step()
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            heldout_losses.append(mean_loss(model, heldout_set))
    optimizer.sync_params()
    return {
        "train_loss": train_losses,
        "heldout_loss": heldout_losses,
        "step_s": step_s,
        "param_digest": param_digest(model),
    }


@torch.no_grad()
def nudge_one_ulp(model: nn.Module, seed: int) -> None:
    """Move every element of every param to the next float towards +inf or -inf, each element's
    direction a fair coin from a generator seeded with ``seed``: every rank draws the same
    directions, so the ranks' params stay bitwise equal."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        up = torch.randint(0, 2, param.shape, generator=generator, dtype=torch.bool)
        param.copy_(torch.nextafter(param, torch.full_like(param, math.inf).where(up, -math.inf)))


def train_step(model: nn.Module, optimizer: ShardingStage1, inputs: Tensor, targets: Tensor) -> float:
    optimizer.zero_grad()
    loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def mean_loss(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean loss over equally sized batches: the held-out loss of this rank's share."""
    return statistics.fmean(model(inputs, targets).item() for inputs, targets in batches)


def param_digest(model: nn.Module) -> str:
    """SHA-256 of every param's bytes in order: equal on two ranks only if bitwise equal."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def heldout_steps(config: ConvergenceConfig) -> list[int]:
    """The steps after which :func:`train_rank` measured the held-out loss (0: before training)."""
    steps = list(range(0, config.steps + 1, config.eval_every))
    return steps if steps[-1] == config.steps else [*steps, config.steps]


def run_setting(config: ConvergenceConfig, setting: str) -> dict:
    """Train ``setting`` on ``config.world_size`` gloo CPU ranks and summarize it: the global
    training loss of every step (the mean of the ranks' halves), the held-out curve, whether
    every loss was finite and the ranks' params bitwise equal, and the slowest rank's step
    times."""
    if setting not in SETTINGS:
        raise ValueError(f"run_setting expects one of {', '.join(SETTINGS)} but got {setting!r}")
    start = time.perf_counter()
    ranks = spawn(train_rank, (config, setting), nprocs=config.world_size, backend="gloo")
    wall_s = time.perf_counter() - start
    train = _mean_over_ranks([rank["train_loss"] for rank in ranks])
    heldout = _mean_over_ranks([rank["heldout_loss"] for rank in ranks])
    slowest = [max(times) for times in zip(*(rank["step_s"] for rank in ranks), strict=True)]
    losses = [loss for rank in ranks for loss in (*rank["train_loss"], *rank["heldout_loss"])]
    return {
        "train_loss": train,
        "heldout_steps": heldout_steps(config),
        "heldout_loss": heldout,
        "final_heldout_loss": heldout[-1],
        "all_finite": all(math.isfinite(loss) for loss in losses),
        "params_identical": len({rank["param_digest"] for rank in ranks}) == 1,
        "median_step_s": statistics.median(slowest),
        "train_s": sum(slowest),
        "wall_s": wall_s,
    }


def _mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    return [statistics.fmean(values) for values in zip(*per_rank, strict=True)]


def add_relative_to_exact(results: dict[str, dict]) -> None:
    """Each setting's final held-out loss relative to exact's, ``(loss - exact) / exact``, as
    ``heldout_vs_exact`` (None when exact did not run)."""
    exact = results.get("exact")
    for summary in results.values():
        summary["heldout_vs_exact"] = (
            None
            if exact is None
            else (summary["final_heldout_loss"] - exact["final_heldout_loss"]) / exact["final_heldout_loss"]
        )


def table(results: dict[str, dict]) -> str:
    """A markdown table: one row per setting."""
    lines = [
        "| setting | final train loss (last 50 steps) | final held-out loss | vs exact | finite "
        "| params identical | median step ms | train s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        relative = "-" if s["heldout_vs_exact"] is None else f"{s['heldout_vs_exact']:+.2%}"
        lines.append(
            f"| {name} | {statistics.fmean(s['train_loss'][-50:]):.4f} | {s['final_heldout_loss']:.4f} "
            f"| {relative} | {_yes(s['all_finite'])} | {_yes(s['params_identical'])} "
            f"| {s['median_step_s'] * 1e3:.1f} | {s['train_s']:.0f} |"
        )
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _settings(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in SETTINGS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected settings among {', '.join(SETTINGS)} but got {text!r}")
    return names


def parse_args(argv: list[str] | None) -> tuple[ConvergenceConfig, tuple[str, ...], Path]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__)
    parser.add_argument("--settings", type=_settings, default=tuple(SETTINGS), help="comma-separated")
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps)
    parser.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every)
    parser.add_argument("--overlap", action="store_true", help="ShardingStage1 in overlap mode")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("out") / f"{datetime.date.today().isoformat()}-convergence.json",
        help="the JSON file; the plot goes beside it with the suffix .png",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be at least 1")
    config = ConvergenceConfig(
        steps=args.steps, eval_every=args.eval_every, overlap=args.overlap, seed=args.seed
    )
    return config, args.settings, args.out


def main(argv: list[str] | None = None) -> int:
    config, settings, out = parse_args(argv)
    results: dict[str, dict] = {}
    for setting in settings:
        print(f"{setting}: {config.steps} steps on {config.world_size} ranks ...", flush=True)
        results[setting] = run_setting(config, setting)
        print(f"{setting}: final held-out loss {results[setting]['final_heldout_loss']:.4f}", flush=True)
    add_relative_to_exact(results)
    corpus = pydoc_corpus()
    train_text, heldout_text = split_corpus(corpus)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(
        out,
        {
            "command": " ".join(
                ["python -m benchmarks.convergence", *(sys.argv[1:] if argv is None else argv)]
            ),
            "config": dataclasses.asdict(config),
            "text": {
                "source": "pydoc_data.topics",
                "train_bytes": len(train_text),
                "heldout_bytes": len(heldout_text),
            },
            "environment": environment(),
            "settings": results,
        },
    )
    plots.plot_convergence(results, out.with_suffix(".png"))
    print(table(results))
    print(f"\nWrote {out} and {out.with_suffix('.png')}")
    return 0 if all(s["all_finite"] and s["params_identical"] for s in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
