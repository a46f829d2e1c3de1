"""PNG charts (matplotlib, Agg backend: no display needed on a server or in CI)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)
from matplotlib.patches import Patch  # noqa: E402

from benchmarks.modes import PSEUDO_MODES  # noqa: E402
from benchmarks.modes import label as mode_label  # noqa: E402
from benchmarks.report import bucket_label, mode_names  # noqa: E402


def plot_step_times(runs: list[dict], path: Path) -> None:
    """Median step time per mode with p10-p90 whiskers, one group of bars per run."""
    figure, axes = plt.subplots(figsize=(9, 4.5))
    names = [*mode_names(runs), *(name for name in PSEUDO_MODES if any(name in run["modes"] for run in runs))]
    width = 0.8 / len(runs)
    for offset, run in enumerate(runs):
        xs, medians, lower, upper = [], [], [], []
        for position, name in enumerate(names):
            if name in run["modes"]:
                s = run["modes"][name]
                xs.append(position + offset * width)
                medians.append(s["median_s"] * 1e3)
                lower.append((s["median_s"] - s["p10_s"]) * 1e3)
                upper.append((s["p90_s"] - s["median_s"]) * 1e3)
        label = f"{run['world_size']} ranks, {bucket_label(run['bucket_mb'])} MiB buckets"
        axes.bar(xs, medians, width, yerr=[lower, upper], capsize=3, label=label)
    axes.set_xticks([p + width * (len(runs) - 1) / 2 for p in range(len(names))])
    optimizer = runs[0].get("optimizer", "adamw")
    axes.set_xticklabels([mode_label(n, optimizer) for n in names], rotation=15, ha="right", fontsize=8)
    axes.set_ylabel("step time, ms (median, p10-p90)")
    axes.legend(fontsize=8)
    _save(figure, path)


def plot_scaling(runs: list[dict], path: Path) -> None:
    """Total tokens/s against world size, one line per mode."""
    figure, axes = plt.subplots(figsize=(6, 4))
    for name in mode_names(runs):
        points = [(r["world_size"], r["modes"][name]["tokens_per_s"]) for r in runs if name in r["modes"]]
        if points:
            axes.plot(
                *zip(*points, strict=True),
                marker="o",
                label=mode_label(name, runs[0].get("optimizer", "adamw")),
            )
    _label(axes, "ranks", "tokens/s (all ranks)")
    _save(figure, path)


COMPUTE_PHASES = {"forward": "tab:blue", "backward": "tab:orange", "optimizer.step": "tab:green"}

COLLECTIVE_COLOURS = {"reduce_scatter": "tab:red", "all_gather": "tab:purple", "other": "tab:gray"}
"""Launch ticks and gloo work spans, by the collective they belong to."""

COLLECTIVE_LABELS = {
    "reduce_scatter": "grad reduce-scatter",
    "all_gather": "param all-gather",
    "other": "other (presence flags, buffer broadcast, barrier)",
}


def collective_kind(name: str) -> str:
    """``reduce_scatter``, ``all_gather`` or ``other`` for a ``c10d::`` launch or a ``gloo:``
    span. On gloo the wrapper's reduce-scatter of CPU tensors is an all-to-all plus a local sum
    (``c10d::alltoall_base_``, ``gloo:all_to_all``), or point-to-point spans it names itself
    (``gloo:reduce_scatter (point-to-point)``); Note [Reduce-scatter on gloo]. Its all-gather
    of CPU tensors is one broadcast per rank (``c10d::broadcast_``; Note [In-place all-gather
    on gloo]), so broadcasts count as all-gathers (a model's buffers, broadcast as DDP does,
    with them). The small all-reduces of the presence flags and the step's error agreement are
    ``other``."""
    flat = name.lower().replace("_", "").replace(" ", "")
    if "reducescatter" in flat or "alltoall" in flat:
        return "reduce_scatter"
    if "allgather" in flat or "broadcast" in flat:
        return "all_gather"
    return "other"


def plot_timeline(events: list[dict], path: Path) -> None:
    """One overlap step on rank 0: compute phases on one row, each collective's launch (host
    side) on the next, and gloo's own work on a third, on one time axis; launches and gloo
    work are coloured by :func:`collective_kind`, with a legend."""
    figure, axes = plt.subplots(figsize=(10, 3.2))
    rows = {"compute": 2, "launch": 1, "gloo": 0}
    for event in events:
        start, end = event["start_us"] / 1e3, event["end_us"] / 1e3
        name = event["name"]
        if name in COMPUTE_PHASES:
            axes.broken_barh([(start, end - start)], (rows["compute"] - 0.4, 0.8), color=COMPUTE_PHASES[name])
            axes.text(start, rows["compute"] + 0.45, name, fontsize=7)
        elif name.startswith("c10d::"):
            color = COLLECTIVE_COLOURS[collective_kind(name)]
            axes.plot(
                [start, start], [rows["launch"] - 0.3, rows["launch"] + 0.3], color=color, linewidth=1.5
            )
        elif name.startswith("gloo:"):
            color = COLLECTIVE_COLOURS[collective_kind(name)]
            axes.broken_barh([(start, end - start)], (rows["gloo"] - 0.3, 0.6), color=color, alpha=0.5)
    axes.set_yticks(list(rows.values()))
    axes.set_yticklabels(["compute", "launch (host)", "gloo work"])
    axes.set_ylim(-0.6, 2.9)
    handles = [
        Patch(color=COLLECTIVE_COLOURS[kind], label=label) for kind, label in COLLECTIVE_LABELS.items()
    ]
    axes.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3)
    axes.set_xlabel("ms since the step began (rank 0)")
    _save(figure, path)


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def plot_convergence(settings: dict[str, dict], path: Path) -> None:
    """Training loss (a running mean: one step's batch is noisy) and held-out loss against the
    step, one line per setting of ``benchmarks.convergence``."""
    figure, (train_axes, heldout_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    window = max(1, max(len(s["train_loss"]) for s in settings.values()) // 50)
    for name, s in settings.items():
        steps = range(1, len(s["train_loss"]) + 1)
        train_axes.plot(steps, running_mean(s["train_loss"], window), label=name, linewidth=1)
        heldout_axes.plot(s["heldout_steps"], s["heldout_loss"], marker="o", markersize=3, label=name)
    train_axes.set_title(f"training loss (mean of the last {window} steps)", fontsize=9)
    heldout_axes.set_title("held-out loss (last tenth of the text)", fontsize=9)
    for axes in (train_axes, heldout_axes):
        _label(axes, "step", "cross-entropy, nats per byte")
    _save(figure, path)


def _label(axes, xlabel: str, ylabel: str) -> None:
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.legend(fontsize=8)


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
