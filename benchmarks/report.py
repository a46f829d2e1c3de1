"""Turn the ranks' raw measurements into statistics, target checks, tables, JSON and charts."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.modes import COMM_ONLY, LABELS, MODES, MUST_AGREE

PARAM_ATOL = 1e-4
"""Max abs param difference allowed between modes that must agree. On CPU they agree bitwise;
on GPUs, reduction order inside NCCL may differ by a few ulps, which AdamW can amplify slightly."""

LOSS_ATOL = 1e-4
"""Same, for the per-step losses of the modes that must agree."""

MIB = 2**20


@dataclass(frozen=True, slots=True)
class Target:
    """One acceptance target of the benchmark issue and what was measured against it."""

    name: str
    measured: float
    limit: float

    @property
    def met(self) -> bool:
        return self.measured <= self.limit

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "measured": self.measured, "limit": self.limit, "met": self.met}


def spread(samples: list[float]) -> dict[str, float]:
    """Median and the p10/p90 and quartile spread of per-step times."""
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    quartiles = statistics.quantiles(samples, n=4, method="inclusive")
    return {
        "median_s": statistics.median(samples),
        "p10_s": deciles[0],
        "p90_s": deciles[-1],
        "iqr_s": quartiles[2] - quartiles[0],
        "samples": len(samples),
    }


def summarize_run(ranks: list[dict], memory: dict[str, list[dict]], tokens_per_rank: int) -> dict:
    """Combine the ranks' results of one run into per-mode statistics.

    A block's time is the slowest rank's, since a synchronous step ends when the last rank does.
    """
    world_size = ranks[0]["world_size"]
    names = list(ranks[0]["times"])
    modes = {}
    for name in names:
        block_times = [max(values) for values in zip(*(r["times"][name] for r in ranks), strict=True)]
        stats = spread(block_times)
        stats["tokens_per_s"] = world_size * tokens_per_rank / stats["median_s"]
        stats["tokens_per_s_per_rank"] = tokens_per_rank / stats["median_s"]
        stats["comm_bytes"] = ranks[0]["comm_bytes"][name]
        if name != COMM_ONLY:
            stats["state_bytes_per_rank"] = max(r["state_bytes"][name] for r in ranks)
            stats["first_loss"] = ranks[0]["losses"][name][0]
            stats["final_loss"] = ranks[0]["losses"][name][-1]
        if name in memory:
            stats["peak_bytes_per_rank"] = max(m["peak_bytes"] for m in memory[name])
        modes[name] = stats
    _add_ratios(modes)
    summary = {
        "world_size": world_size,
        "buckets_padded_numel": ranks[0]["buckets"],
        "num_params": ranks[0]["num_params"],
        "modes": modes,
        "agreement": _agreement(ranks),
    }
    summary["hidden_fraction"] = _hidden_fraction(modes)
    return summary


def _add_ratios(modes: dict[str, dict]) -> None:
    if "sync" not in modes:
        return
    for stats in modes.values():
        stats["ratio_vs_sync"] = stats["median_s"] / modes["sync"]["median_s"]


def _hidden_fraction(modes: dict[str, dict]) -> float | None:
    """(T_sync - T_overlap) / T_comm: the share of communication that overlap hid."""
    if not {"sync", "overlap", COMM_ONLY} <= modes.keys():
        return None
    t_comm = modes[COMM_ONLY]["median_s"]
    return (modes["sync"]["median_s"] - modes["overlap"]["median_s"]) / t_comm


def _agreement(ranks: list[dict]) -> dict[str, object]:
    """Largest param and per-step loss differences against DDP over all ranks."""
    param_diff = {
        name: max(r["agreement"][name] for r in ranks) for name in ranks[0]["agreement"] if name in MODES
    }
    loss_diff = {}
    for name in ranks[0]["losses"]:
        if name != "ddp" and "ddp" in ranks[0]["losses"]:
            loss_diff[name] = max(
                max(abs(a - b) for a, b in zip(r["losses"][name], r["losses"]["ddp"], strict=True))
                for r in ranks
            )
    checked = [name for name in MUST_AGREE if name in param_diff]
    agree = all(param_diff[n] <= PARAM_ATOL and loss_diff[n] <= LOSS_ATOL for n in checked)
    return {"param_max_abs_diff": param_diff, "loss_max_abs_diff": loss_diff, "agree": agree}


def targets(run: dict, single_rank: dict | None, emulated_link: bool) -> list[Target]:
    """The issue's targets that this run can check (each needs its modes to have run)."""
    modes = run["modes"]
    found: list[Target] = []

    def ratio(a: str, b: str, limit: float) -> None:
        if a in modes and b in modes and run["world_size"] > 1:
            found.append(Target(f"{a} / {b} step time", modes[a]["median_s"] / modes[b]["median_s"], limit))

    ratio("overlap", "sync", 0.75 if emulated_link else 0.90)
    ratio("overlap", "ddp", 1.00)
    ratio("overlap", "zero", 0.90)
    if "ddp" in modes and "sync" in modes and run["world_size"] > 1:
        unsharded = modes["ddp"]["state_bytes_per_rank"]
        found.append(
            Target(
                "sharded state bytes / (unsharded / N)",
                modes["sync"]["state_bytes_per_rank"] / (unsharded / run["world_size"]),
                1.01,
            )
        )
    if single_rank is not None and {"sync", "ddp"} <= single_rank["modes"].keys():
        one = single_rank["modes"]
        found.append(
            Target(
                "1 rank: sync / plain AdamW step time", one["sync"]["median_s"] / one["ddp"]["median_s"], 1.02
            )
        )
    return found


def mode_table(run: dict) -> str:
    """Fixed-width table of one run, one line per mode."""
    header = (
        f"{'mode':32} {'median ms':>9} {'p10-p90 ms':>13} {'tok/s':>8} {'vs sync':>7} "
        f"{'state MiB':>9} {'peak MiB':>8} {'wire MiB':>8} {'loss':>13}"
    )
    rows = [_mode_row(name, stats) for name, stats in run["modes"].items()]
    return "\n".join([header, "-" * len(header), *rows])


def _mode_row(name: str, s: dict) -> str:
    spread_ms = f"{s['p10_s'] * 1e3:.0f}-{s['p90_s'] * 1e3:.0f}"
    state = f"{s['state_bytes_per_rank'] / MIB:.2f}" if "state_bytes_per_rank" in s else "-"
    peak = f"{s['peak_bytes_per_rank'] / MIB:.1f}" if "peak_bytes_per_rank" in s else "-"
    loss = f"{s['first_loss']:.2f}->{s['final_loss']:.3f}" if "final_loss" in s else "-"
    ratio = f"{s['ratio_vs_sync']:.3f}" if "ratio_vs_sync" in s else "-"
    return (
        f"{LABELS[name]:32} {s['median_s'] * 1e3:9.1f} {spread_ms:>13} {s['tokens_per_s']:8.0f} "
        f"{ratio:>7} {state:>9} {peak:>8} {s['comm_bytes']['wire_per_rank'] / MIB:8.2f} {loss:>13}"
    )


def scaling_table(runs: list[dict]) -> str:
    """Per-rank and total throughput per mode and world size, and speedup over one rank."""
    lines = [f"{'mode':32} {'ranks':>5} {'tok/s/rank':>10} {'tok/s total':>11} {'speedup':>7}"]
    for name in MODES:
        base = next((r["modes"][name]["tokens_per_s"] for r in runs if r["world_size"] == 1), None)
        for run in runs:
            if name not in run["modes"]:
                continue
            s = run["modes"][name]
            speedup = f"{s['tokens_per_s'] / base:7.2f}" if base else f"{'-':>7}"
            lines.append(
                f"{LABELS[name]:32} {run['world_size']:5d} {s['tokens_per_s_per_rank']:10.0f} "
                f"{s['tokens_per_s']:11.0f} {speedup}"
            )
    return "\n".join(lines)


def sweep_table(runs: list[dict]) -> str:
    """Bucket-size trade-off: number of buckets against sync/overlap step time."""
    header = f"{'bucket MiB':>10} {'buckets':>7} {'sync ms':>8} {'overlap ms':>10} {'ratio':>6} {'hidden':>7}"
    lines = [header]
    for run in runs:
        modes = run["modes"]
        sync = modes.get("sync", {}).get("median_s", float("nan"))
        overlap = modes.get("overlap", {}).get("median_s", float("nan"))
        hidden = run["hidden_fraction"]
        lines.append(
            f"{run['bucket_mb']:10g} {len(run['buckets_padded_numel']):7d} {sync * 1e3:8.1f} "
            f"{overlap * 1e3:10.1f} {overlap / sync:6.3f} {'-' if hidden is None else f'{hidden:7.2f}':>7}"
        )
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
