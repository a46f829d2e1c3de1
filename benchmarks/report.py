"""Turn the ranks' raw measurements into statistics, target checks, tables, JSON and charts."""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.modes import COMM_ONLY, COMPUTE_ONLY, MUST_AGREE, PSEUDO_MODES, split_mode
from benchmarks.modes import label as mode_label

PARAM_ATOL = 1e-4
"""Max abs param difference allowed between modes that must agree. On CPU they agree bitwise;
on GPUs, reduction order inside NCCL may differ by a few ulps, which AdamW can amplify slightly."""

LOSS_ATOL = 1e-4
"""Same, for the per-step losses of the modes that must agree."""

MIB = 2**20

METHODS = {"block": "median_s", "steady": "steady_median_s"}
"""The two timing methods and the per-mode key of their median: short blocks that each end with
``sync_params()`` (charges overlap one un-hidden all-gather per block), and long steady-state
blocks (one per ``steady_steps`` steps, as in a long training run)."""


def bucket_label(bucket_mb: float | None) -> str:
    return "auto" if bucket_mb is None else f"{bucket_mb:g}"


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
        stats = spread(_slowest_rank(ranks, "times", name))
        if ranks[0].get("steady_times"):
            steady = spread(_slowest_rank(ranks, "steady_times", name))
            stats["steady_median_s"] = steady["median_s"]
            stats["steady_p10_s"], stats["steady_p90_s"] = steady["p10_s"], steady["p90_s"]
        stats["tokens_per_s"] = world_size * tokens_per_rank / stats["median_s"]
        stats["tokens_per_s_per_rank"] = tokens_per_rank / stats["median_s"]
        stats["comm_bytes"] = ranks[0]["comm_bytes"][name]
        stats.update(_sent(ranks, name))
        if name not in PSEUDO_MODES:
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
    summary["methods"] = {
        method: overlap_analysis(modes, key)
        for method, key in METHODS.items()
        if all(key in stats for stats in modes.values())
    }
    if "state_bytes_by_optimizer" in ranks[0]:
        summary["state_bytes_by_rank"] = {
            name: [r["state_bytes_by_optimizer"][name] for r in ranks]
            for name in ranks[0]["state_bytes_by_optimizer"]
        }
    if "splits" in ranks[0]:
        summary["split"] = {
            method: step_split(ranks, times_key, splits_key)
            for method, times_key, splits_key in SPLIT_METHODS
            if ranks[0].get(times_key)
        }
    return summary


SPLIT_METHODS = (("block", "times", "splits"), ("steady", "steady_times", "steady_splits"))
"""Per timing method, the ranks' keys of its block times and of its blocks' splits."""


def step_split(ranks: list[dict], times_key: str, splits_key: str) -> dict[str, dict]:
    """Per mode, where each rank's step time went (``benchmarks.step_split``): per rank, the
    medians of its own blocks' step time, communication and Newton-Schulz time, and the rest of
    the step (median step - both); then their means over ranks, and the Newton-Schulz time and
    work (``newton_schulz_cost`` per matrix) of the busiest rank over the ranks' mean.

    Each rank's own time: a step ends on every rank together, so a rank with less
    Newton-Schulz work waits longer in communication for the busiest one."""
    found = {}
    for name in ranks[0][times_key]:
        by_rank = []
        for r in ranks:
            split = r[splits_key][name]
            row = {"step_s": statistics.median(r[times_key][name])}
            row.update({key: statistics.median(values) for key, values in split.items()})
            row["rest_s"] = row["step_s"] - row["comm_s"] - row["newton_schulz_s"]
            by_rank.append(row)
        mean = {key: statistics.fmean(row[key] for row in by_rank) for key in by_rank[0]}
        found[name] = {
            "by_rank": by_rank,
            "mean": mean,
            "newton_schulz_max_s": max(row["newton_schulz_s"] for row in by_rank),
            "newton_schulz_max_over_mean": _max_over_mean([row["newton_schulz_s"] for row in by_rank]),
            "work_max_over_mean": _max_over_mean([row["newton_schulz_work"] for row in by_rank]),
        }
    return found


def _max_over_mean(values: list[float]) -> float | None:
    mean = statistics.fmean(values)
    return max(values) / mean if mean > 0 else None


def split_table(run: dict) -> str:
    """:func:`step_split` of every timing method as a table: one line per mode, ranks' means,
    and the busiest rank's Newton-Schulz time and the balance of the ranks' work."""
    header = (
        f"{'method':6} {'mode':32} {'step ms':>8} {'comm ms':>8} {'NS ms mean':>10} {'NS ms max':>9} "
        f"{'rest ms':>8} {'NS time max/mean':>16} {'NS work max/mean':>16} {'matrices/rank':>13}"
    )
    lines = [header, "-" * len(header)]
    optimizer = run.get("optimizer", "adamw")
    for method, modes in run.get("split", {}).items():
        for name, found in modes.items():
            mean = found["mean"]
            matrices = "/".join(f"{row['newton_schulz_calls']:g}" for row in found["by_rank"])
            lines.append(
                f"{method:6} {mode_label(name, optimizer):32} {mean['step_s'] * 1e3:8.1f} "
                f"{mean['comm_s'] * 1e3:8.1f} {mean['newton_schulz_s'] * 1e3:10.1f} "
                f"{found['newton_schulz_max_s'] * 1e3:9.1f} {mean['rest_s'] * 1e3:8.1f} "
                f"{_ratio_text(found['newton_schulz_max_over_mean']):>16} "
                f"{_ratio_text(found['work_max_over_mean']):>16} {matrices:>13}"
            )
    return "\n".join(lines)


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def state_lines(run: dict) -> list[str]:
    """Each mode's optimizer state on each rank, by wrapped class (Muon, AdamW), in MiB."""
    lines = []
    for name, per_rank in run.get("state_bytes_by_rank", {}).items():
        cells = []
        for rank, kinds in enumerate(per_rank):
            parts = " + ".join(f"{kind} {size / MIB:.2f}" for kind, size in kinds.items())
            cells.append(f"rank {rank}: {parts} = {sum(kinds.values()) / MIB:.2f}")
        lines.append(f"  {mode_label(name, run.get('optimizer', 'adamw')):32} {'; '.join(cells)}")
    return lines


SENT_NOTE = (
    "sent MiB: bytes each rank sent per step (mean over ranks), measured from\n"
    "  ShardingStage1.wire_bytes() over the timed steps for the wrapper's modes (comm only: the sync\n"
    "  wrapper's); * computed, not measured: DDP's ring all-reduce sends 2(N-1)/N of the grad bytes per\n"
    "  rank, ZeroRedundancyOptimizer that plus its param broadcasts, 3(N-1)/N of the param bytes"
)
"""What the table's ``sent MiB`` column holds, printed under it."""


def _sent(ranks: list[dict], name: str) -> dict[str, object]:
    """A mode's bytes sent per step and rank: counted from the payloads where the ranks measured
    them (``wire_bytes_per_step``: the wrapper's modes), else the ring estimate of
    ``benchmarks.modes.comm_bytes_per_step`` (DDP, ZeRO), marked as computed."""
    measured = [r.get("wire_bytes_per_step", {}).get(name) for r in ranks]
    if all(found is not None for found in measured):
        by_kind = {kind: statistics.fmean(found[kind] for found in measured) for kind in measured[0]}
        return {
            "sent_bytes_per_step": by_kind["total"],
            "sent_by_kind": by_kind,
            "sent_by_rank": [found["total"] for found in measured],
            "sent_measured": True,
        }
    return {"sent_bytes_per_step": ranks[0]["comm_bytes"][name]["wire_per_rank"], "sent_measured": False}


def _slowest_rank(ranks: list[dict], key: str, name: str) -> list[float]:
    return [max(values) for values in zip(*(r[key][name] for r in ranks), strict=True)]


def hidden_comm(t_sync: float, t_overlap: float, t_comm: float) -> dict[str, float | bool]:
    """The communication that overlap kept off the step time, from three medians.

    Derivation: sync runs the step's compute ``C`` and then its collectives, so
    ``T_sync = C + T_comm``. Overlap runs the same compute and the same collectives; what still
    adds to its step time is the exposed part ``E = T_overlap - C``, and the hidden part is
    ``H = T_comm - E``. With ``C = T_sync - T_comm`` that is ``H = T_sync - T_overlap``, so the
    hidden share is ``(T_sync - T_overlap) / T_comm``.

    That is a share between 0 and 1 only while the model holds: communication costs in a step
    what it costs alone, and compute costs the same in both modes. On one machine neither holds
    exactly (gloo's copies and sums run on the cores that compute fills), and when
    communication is a small part of the step (25 ms of 400 ms on loopback) the noise of two
    step medians is many times ``T_comm``: run to run, the raw ratio has read -848% and +1008%.
    So ``hidden_fraction`` is the raw share clamped to [0, 1], and the inputs and the raw share
    are kept beside it: ``clamped`` says whether the clamp changed anything (below 0: overlap
    was slower than sync; above 1: overlap saved more than communication alone takes, so the
    difference is not communication alone but noise or compute that differed).
    """
    saved_s = t_sync - t_overlap
    raw = saved_s / t_comm
    return {
        "hidden_fraction": min(max(raw, 0.0), 1.0),
        "hidden_fraction_raw": raw,
        "sync_minus_overlap_s": saved_s,
        "comm_s": t_comm,
        "clamped": not 0.0 <= raw <= 1.0,
    }


def hidden_comm_text(found: dict[str, float | bool]) -> str:
    """``hidden_comm`` in words: the clamped share, its two inputs, and why it was clamped."""
    share, raw = found["hidden_fraction"], found["hidden_fraction_raw"]
    saved_ms, comm_ms = found["sync_minus_overlap_s"] * 1e3, found["comm_s"] * 1e3
    inputs = f"sync - overlap {saved_ms:+.1f} ms, comm alone {comm_ms:.1f} ms"
    if raw < 0:
        return (
            f"hidden {share:.0%} of comm ({inputs}; clamped from {raw:.0%}: overlap was slower than "
            "sync, so it hid nothing measurable)"
        )
    if raw > 1:
        return (
            f"hidden {share:.0%} of comm ({inputs}; clamped from {raw:.0%}: overlap saved more than "
            "comm alone takes, the rest is noise or compute that differed between modes)"
        )
    return f"hidden {share:.0%} of comm ({inputs})"


def overlap_analysis(modes: dict[str, dict], key: str) -> dict[str, float | bool]:
    """For the medians under ``key``: overlap against sync and DDP, the share of communication
    it hid (:func:`hidden_comm`: (T_sync - T_overlap) / T_comm clamped to [0, 1], with its
    inputs), and its distance to the best any overlap can do, T_overlap / max(T_compute,
    T_comm). Entries whose modes did not run are left out."""
    t = {name: stats[key] for name, stats in modes.items()}
    found: dict[str, float | bool] = {}
    if "overlap" in t:
        for other in ("sync", "ddp", "zero"):
            if other in t:
                found[f"overlap_vs_{other}"] = t["overlap"] / t[other]
    if {"sync", "overlap", COMM_ONLY} <= t.keys():
        found.update(hidden_comm(t["sync"], t["overlap"], t[COMM_ONLY]))
    if {"overlap", COMM_ONLY, COMPUTE_ONLY} <= t.keys():
        found["bound_s"] = max(t[COMM_ONLY], t[COMPUTE_ONLY])
        found["overlap_vs_bound"] = t["overlap"] / found["bound_s"]
        found["comm_vs_compute"] = t[COMM_ONLY] / t[COMPUTE_ONLY]
    return found


def analysis_lines(run: dict) -> list[str]:
    """One line per timing method: the ratios of :func:`overlap_analysis`."""
    lines = []
    for method, found in run.get("methods", {}).items():
        parts = [f"overlap/sync {found['overlap_vs_sync']:.3f}"] if "overlap_vs_sync" in found else []
        if "overlap_vs_ddp" in found:
            parts.append(f"overlap/DDP {found['overlap_vs_ddp']:.3f}")
        if "hidden_fraction" in found:
            parts.append(hidden_comm_text(found))
        if "overlap_vs_bound" in found:
            parts.append(
                f"overlap / max(compute, comm) {found['overlap_vs_bound']:.3f} "
                f"(bound {found['bound_s'] * 1e3:.1f} ms, comm/compute {found['comm_vs_compute']:.2f})"
            )
        lines.append(f"{method:>6}: " + "; ".join(parts))
    return lines


def _add_ratios(modes: dict[str, dict]) -> None:
    if "sync" not in modes:
        return
    for stats in modes.values():
        stats["ratio_vs_sync"] = stats["median_s"] / modes["sync"]["median_s"]


def _hidden_fraction(modes: dict[str, dict]) -> float | None:
    """The block medians' hidden share of communication, in [0, 1]; see :func:`hidden_comm`."""
    if not {"sync", "overlap", COMM_ONLY} <= modes.keys():
        return None
    t = {name: modes[name]["median_s"] for name in ("sync", "overlap", COMM_ONLY)}
    return hidden_comm(t["sync"], t["overlap"], t[COMM_ONLY])["hidden_fraction"]


def _agreement(ranks: list[dict]) -> dict[str, object]:
    """Largest param and per-step loss differences against DDP over all ranks. ``agree`` covers
    the modes of :data:`MUST_AGREE` and, when both ran, the compressed sync against the
    compressed overlap (``compressed_sync_vs_overlap``, bitwise equal by Note [Compressed wire]);
    the compressed modes' distance to DDP is reported, not checked."""
    param_diff = {
        name: max(r["agreement"][name] for r in ranks)
        for name in ranks[0]["agreement"]
        if name not in PSEUDO_MODES
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
    found = {"param_max_abs_diff": param_diff, "loss_max_abs_diff": loss_diff, "agree": agree}
    pair = [r.get("compressed_pair_diff") for r in ranks]
    if all(diff is not None for diff in pair):
        found["compressed_sync_vs_overlap"] = max(pair)
        found["agree"] = agree and max(pair) <= PARAM_ATOL
    return found


INT8_TAG = "int8g+int8p"
"""The tag of int8 grads and int8 params, the wire the link's step time target is for."""

BYTES_TARGETS = {INT8_TAG: 0.30, "bf16g": 0.80}
"""The compressed wire's targets, bytes per step against the exact mode's, by compression tag;
on an emulated link, overlap with :data:`INT8_TAG` has a step time target of 0.40x DDP's, and
on loopback every compressed mode one of 1.10x its exact mode's."""


def targets(run: dict, single_rank: dict | None, emulated_link: bool) -> list[Target]:
    """The issue's targets that this run can check (each needs its modes to have run), on the
    steady-state medians when they were measured, else on the block medians."""
    modes = run["modes"]
    found: list[Target] = []
    method = "steady" if "steady" in run.get("methods", {}) else "block"
    key = METHODS[method]

    def ratio(a: str, b: str, limit: float) -> None:
        if a in modes and b in modes and run["world_size"] > 1:
            found.append(Target(f"{a} / {b} step time ({method})", modes[a][key] / modes[b][key], limit))

    if emulated_link:
        ratio("overlap", "ddp", 0.90)
        bound = run.get("methods", {}).get(method, {}).get("overlap_vs_bound")
        if bound is not None:
            found.append(Target(f"overlap / max(compute, comm) ({method})", bound, 1.15))
    else:
        ratio("overlap", "ddp", 1.00)
        ratio("overlap", "sync", 0.93)
    ratio("overlap", "zero", 0.90)
    for name in modes:
        base, tag = split_mode(name)
        if not tag or base not in modes or run["world_size"] == 1:
            continue
        if tag in BYTES_TARGETS:
            sent = modes[name]["sent_bytes_per_step"] / modes[base]["sent_bytes_per_step"]
            found.append(Target(f"{name} / {base} bytes sent per step", sent, BYTES_TARGETS[tag]))
        if emulated_link and base == "overlap" and tag == INT8_TAG:
            ratio(name, "ddp", 0.40)
        elif not emulated_link:
            ratio(name, base, 1.10)
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
    """Fixed-width table of one run, one line per mode; ``sent MiB`` is :data:`SENT_NOTE`."""
    header = (
        f"{'mode':{LABEL_WIDTH}} {'median ms':>9} {'p10-p90 ms':>13} {'steady ms':>9} {'tok/s':>8} "
        f"{'vs sync':>7} {'state MiB':>9} {'peak MiB':>8} {'sent MiB':>9} {'loss':>13}"
    )
    rows = [
        _mode_row(mode_label(name, run.get("optimizer", "adamw")), stats)
        for name, stats in run["modes"].items()
    ]
    return "\n".join([header, "-" * len(header), *rows])


def _mode_row(name_label: str, s: dict) -> str:
    spread_ms = f"{s['p10_s'] * 1e3:.0f}-{s['p90_s'] * 1e3:.0f}"
    state = f"{s['state_bytes_per_rank'] / MIB:.2f}" if "state_bytes_per_rank" in s else "-"
    peak = f"{s['peak_bytes_per_rank'] / MIB:.1f}" if "peak_bytes_per_rank" in s else "-"
    loss = f"{s['first_loss']:.2f}->{s['final_loss']:.3f}" if "final_loss" in s else "-"
    ratio = f"{s['ratio_vs_sync']:.3f}" if "ratio_vs_sync" in s else "-"
    steady = f"{s['steady_median_s'] * 1e3:.1f}" if "steady_median_s" in s else "-"
    sent = s.get("sent_bytes_per_step", s["comm_bytes"]["wire_per_rank"]) / MIB
    sent_text = f"{sent:.2f}" if s.get("sent_measured") else f"{sent:.2f}*"
    return (
        f"{name_label:{LABEL_WIDTH}} {s['median_s'] * 1e3:9.1f} {spread_ms:>13} {steady:>9} "
        f"{s['tokens_per_s']:8.0f} {ratio:>7} {state:>9} {peak:>8} {sent_text:>9} {loss:>13}"
    )


LABEL_WIDTH = 36
"""The mode column of :func:`mode_table`: room for a compressed mode's label."""


def mode_names(runs: list[dict]) -> list[str]:
    """The measured modes of ``runs`` (not the pseudo-modes), in the order they ran."""
    names = dict.fromkeys(name for run in runs for name in run["modes"])
    return [name for name in names if name not in PSEUDO_MODES]


def compressed_ratios(run: dict) -> dict[str, dict[str, float]]:
    """Per compressed mode (``overlap+TAG``): its bytes per step over its exact mode's and over
    DDP's, and per timing method its step time over its exact mode's and over DDP's (keys
    ``bytes_vs_exact``, ``bytes_vs_ddp``, ``steady_vs_exact``, ``block_vs_ddp``, ...)."""
    modes = run["modes"]
    found: dict[str, dict[str, float]] = {}
    for name, stats in modes.items():
        base, tag = split_mode(name)
        if not tag or base not in modes:
            continue
        ratios = {"bytes_vs_exact": stats["sent_bytes_per_step"] / modes[base]["sent_bytes_per_step"]}
        if "ddp" in modes and modes["ddp"]["sent_bytes_per_step"]:
            ratios["bytes_vs_ddp"] = stats["sent_bytes_per_step"] / modes["ddp"]["sent_bytes_per_step"]
        for method, key in METHODS.items():
            if key in stats:
                ratios[f"{method}_vs_exact"] = stats[key] / modes[base][key]
                if "ddp" in modes:
                    ratios[f"{method}_vs_ddp"] = stats[key] / modes["ddp"][key]
        found[name] = ratios
    return found


def compressed_lines(run: dict) -> list[str]:
    """:func:`compressed_ratios` in words: bytes, then each timing method's step time ratios."""
    ratios = compressed_ratios(run)
    if not ratios:
        return []
    modes = run["modes"]
    lines = []
    for name, found in ratios.items():
        base = split_mode(name)[0]
        sent = modes[name]["sent_bytes_per_step"] / MIB
        text = f"{name}: sent {sent:.2f} MiB/step/rank = {found['bytes_vs_exact']:.3f}x {base}"
        if "bytes_vs_ddp" in found:
            text += f", {found['bytes_vs_ddp']:.3f}x DDP's (computed)"
        for method in METHODS:
            if f"{method}_vs_exact" in found:
                text += f"; {method} step {found[f'{method}_vs_exact']:.3f}x {base}"
                if f"{method}_vs_ddp" in found:
                    text += f", {found[f'{method}_vs_ddp']:.3f}x DDP"
        lines.append(text)
    return lines


def scaling_table(runs: list[dict]) -> str:
    """Per-rank and total throughput per mode and world size, and speedup over one rank."""
    lines = [f"{'mode':{LABEL_WIDTH}} {'ranks':>5} {'tok/s/rank':>10} {'tok/s total':>11} {'speedup':>7}"]
    for name in mode_names(runs):
        base = next((r["modes"][name]["tokens_per_s"] for r in runs if r["world_size"] == 1), None)
        for run in runs:
            if name not in run["modes"]:
                continue
            s = run["modes"][name]
            speedup = f"{s['tokens_per_s'] / base:7.2f}" if base else f"{'-':>7}"
            lines.append(
                f"{mode_label(name, run.get('optimizer', 'adamw')):{LABEL_WIDTH}} {run['world_size']:5d} "
                f"{s['tokens_per_s_per_rank']:10.0f} {s['tokens_per_s']:11.0f} {speedup}"
            )
    return "\n".join(lines)


def sweep_table(runs: list[dict]) -> str:
    """Bucket-size trade-off: number of buckets against sync/overlap step time."""
    header = (
        f"{'bucket MiB':>10} {'buckets':>7} {'sync ms':>8} {'overlap ms':>10} {'ratio':>6} {'hidden':>7} "
        f"{'steady sync':>11} {'steady overlap':>14} {'ratio':>6} {'hidden':>7}"
    )
    lines = [header]
    for run in runs:
        cells = []
        for key in METHODS.values():
            sync = run["modes"].get("sync", {}).get(key, float("nan"))
            overlap = run["modes"].get("overlap", {}).get(key, float("nan"))
            comm = run["modes"].get(COMM_ONLY, {}).get(key)
            hidden = f"{'-':>7}"
            if comm:
                found = hidden_comm(sync, overlap, comm)
                mark = "*" if found["clamped"] else ""
                hidden = f"{found['hidden_fraction']:.0%}{mark}".rjust(7)
            cells.append((sync * 1e3, overlap * 1e3, overlap / sync, hidden))
        (s1, o1, r1, h1), (s2, o2, r2, h2) = cells
        label = bucket_label(run["bucket_mb"])
        lines.append(
            f"{label:>10} {len(run['buckets_padded_numel']):7d} {s1:8.1f} {o1:10.1f} "
            f"{r1:6.3f} {h1} {s2:11.1f} {o2:14.1f} {r2:6.3f} {h2}"
        )
    lines.append("hidden: share of comm alone hidden by overlap; * clamped to [0, 1], see report.hidden_comm")
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def environment() -> dict[str, object]:
    """Where a result was measured, stored beside it."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "accelerator": str(torch.accelerator.current_accelerator())
        if torch.accelerator.is_available()
        else None,
    }
