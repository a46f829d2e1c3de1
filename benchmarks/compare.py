"""``python -m benchmarks.compare``: DDP, ZeroRedundancyOptimizer and ShardingStage1 (sync and
overlap) on the same GPT, data, seed and AdamW, measured interleaved in one process group.

See ``--help``; the defaults finish in a few minutes on 2 CPU cores. Writes ``results.json``,
``step_times.png``, ``timeline_overlap.png`` (and ``scaling.png`` for several world sizes) and a
Chrome trace of one overlap step per run into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import plots, report
from benchmarks.models import MODEL_NAMES, PRESETS, model_seq_len
from benchmarks.modes import MODES
from benchmarks.netns import LinkConfig, link_unavailable_reason, parse_link, shaped_link
from benchmarks.session import RunConfig, compare_rank, memory_rank
from sharded_opt import spawn


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything the command line chose: the base run and the grid to repeat it over."""

    base: RunConfig
    world_sizes: tuple[int, ...]
    bucket_mbs: tuple[float, ...]
    out: Path
    memory: bool
    link: LinkConfig | None


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _float_list(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(",") if part.strip())


def _mode_list(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    return tuple(mode for mode in MODES if mode in modes)  # keep the A B C D order


def parse_args(argv: list[str] | None) -> Plan:
    defaults = RunConfig()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__)
    parser.add_argument("--model", choices=MODEL_NAMES, default=defaults.model)
    parser.add_argument("--world-sizes", type=_int_list, default=(2,), help="e.g. 1,2,4 (default 2)")
    parser.add_argument("--bucket-mb", type=_float_list, default=(defaults.bucket_mb,), help="e.g. 1,4,16")
    parser.add_argument("--micro-batch", type=int, default=defaults.micro_batch, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps per mode")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="timed blocks per mode")
    parser.add_argument("--steps-per-round", type=int, default=defaults.steps_per_round)
    parser.add_argument("--modes", type=_mode_list, default=MODES, help="subset of " + ",".join(MODES))
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="measure peak memory per mode in separate processes")  # fmt: skip
    parser.add_argument("--emulate-link", type=parse_link, default=None, metavar="GBPS[,LATENCY_MS]")
    parser.add_argument("--out", type=Path, default=Path("out/compare"))
    args = parser.parse_args(argv)
    if args.model in PRESETS and (args.seq_len or 0) > PRESETS[args.model].seq_len:
        parser.error(f"--seq-len is at most {PRESETS[args.model].seq_len} for the {args.model} preset")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 to report a spread")
    base = dataclasses.replace(
        defaults,
        model=args.model,
        micro_batch=args.micro_batch,
        seq_len=model_seq_len(args.model, args.seq_len),
        warmup=args.warmup,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        modes=args.modes,
        threads=args.threads,
        seed=args.seed,
    )
    return Plan(base, args.world_sizes, args.bucket_mb, args.out, args.memory, args.emulate_link)


def _enter_link(plan: Plan, stack: contextlib.ExitStack) -> LinkConfig | None:
    """The shaped link if one was asked for and can be built (torn down when ``stack`` closes);
    otherwise say why and return None, so the run goes on without it."""
    if plan.link is None:
        return None
    reason = link_unavailable_reason(plan.world_sizes)
    if reason is not None:
        print(f"NOTE: {reason}; running without link emulation.")
        return None
    if plan.link.latency_ms:
        print("NOTE: latency is not applied: this kernel has no sch_netem; only the rate is shaped.")
    try:
        return stack.enter_context(shaped_link(plan.link))
    except RuntimeError as error:
        print(f"NOTE: could not build the emulated link ({error}); running without it.")
        return None


def run_once(config: RunConfig, world_size: int, memory: bool) -> dict:
    """One comparison run over ``world_size`` ranks, plus the per-mode memory pass."""
    ranks = spawn(compare_rank, (config,), nprocs=world_size)
    peaks: dict[str, list[dict]] = {}
    if memory:
        memory_config = dataclasses.replace(config, trace_path=None, link=None)
        for mode in config.modes:
            peaks[mode] = spawn(memory_rank, (memory_config, mode), nprocs=world_size)
    summary = report.summarize_run(ranks, peaks, config.micro_batch * config.seq_len)
    summary["bucket_mb"] = config.bucket_mb
    summary["loss_curve_ddp"] = ranks[0]["losses"].get("ddp", [])
    summary["timeline"] = ranks[0].get("timeline", [])
    return summary


def _print_run(run: dict, config: RunConfig) -> None:
    print(f"\n== {run['world_size']} rank(s), {config.model} GPT ({run['num_params'] / 1e6:.2f}M params), "
          f"{config.micro_batch}x{config.seq_len} tokens/rank, {run['bucket_mb']:g} MiB buckets "
          f"({len(run['buckets_padded_numel'])} buckets) ==")  # fmt: skip
    print(report.mode_table(run))
    curve = run["loss_curve_ddp"]
    if curve:
        window = max(1, len(curve) // 6)
        means = [
            sum(curve[i : i + window]) / len(curve[i : i + window]) for i in range(0, len(curve), window)
        ]
        print(f"loss (rank 0, DDP), mean of each {window} steps:", " ".join(f"{v:.3f}" for v in means))
    comm = run["modes"].get("comm")
    if comm and run["hidden_fraction"] is not None:
        print(f"T_comm (comm-only) {comm['median_s'] * 1e3:.1f} ms; hidden fraction "
              f"(T_sync - T_overlap) / T_comm = {run['hidden_fraction']:.2f}")  # fmt: skip
    agreement = run["agreement"]
    if agreement["param_max_abs_diff"]:
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in agreement["param_max_abs_diff"].items())
        verdict = "agree" if agreement["agree"] else "DO NOT AGREE"
        print(f"max |param - DDP param|: {diffs}; modes ddp/sync/overlap {verdict} "
              f"(atol {report.PARAM_ATOL:g})")  # fmt: skip


def _environment() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "accelerator": str(torch.accelerator.current_accelerator())
        if torch.accelerator.is_available()
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    plan = parse_args(argv)
    plan.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        link = _enter_link(plan, stack)
        for world_size in plan.world_sizes:
            for bucket_mb in plan.bucket_mbs:
                trace = plan.out / f"trace_overlap_ws{world_size}_b{bucket_mb:g}.json"
                config = dataclasses.replace(plan.base, bucket_mb=bucket_mb, trace_path=str(trace), link=link)
                runs.append(run_once(config, world_size, plan.memory))
                _print_run(runs[-1], config)
    _finish(plan, runs, link is not None, argv)
    return 0


def _finish(plan: Plan, runs: list[dict], emulated: bool, argv: list[str] | None) -> None:
    """Scaling/sweep tables, target checks, results.json and charts."""
    if len(plan.world_sizes) > 1:
        print("\nScaling (first bucket size):")
        print(report.scaling_table([r for r in runs if r["bucket_mb"] == plan.bucket_mbs[0]]))
        plots.plot_scaling(
            [r for r in runs if r["bucket_mb"] == plan.bucket_mbs[0]], plan.out / "scaling.png"
        )
    if len(plan.bucket_mbs) > 1:
        for world_size in plan.world_sizes:
            print(f"\nBucket sweep, {world_size} rank(s):")
            print(report.sweep_table([r for r in runs if r["world_size"] == world_size]))
    single = next((r for r in runs if r["world_size"] == 1), None)
    main_run = next((r for r in runs if r["world_size"] > 1), runs[0])
    checks = report.targets(main_run, single, emulated)
    print(f"\nTargets ({main_run['world_size']} ranks, {main_run['bucket_mb']:g} MiB buckets):")
    for check in checks:
        print(
            f"  {'MET ' if check.met else 'MISS'} {check.name}: {check.measured:.3f} (limit {check.limit:g})"
        )
    payload = {
        "command": " ".join(["python -m benchmarks.compare", *(sys.argv[1:] if argv is None else argv)]),
        "config": dataclasses.asdict(plan.base),
        "emulated_link": dataclasses.asdict(plan.link) if emulated and plan.link else None,
        "environment": _environment(),
        "runs": runs,
        "targets": [check.as_dict() for check in checks],
    }
    report.write_json(plan.out / "results.json", payload)
    plots.plot_step_times(runs, plan.out / "step_times.png")
    if main_run["timeline"]:
        plots.plot_timeline(main_run["timeline"], plan.out / "timeline_overlap.png")
    print(f"\nWrote {plan.out}/results.json, step_times.png, timeline_overlap.png and Chrome traces")


if __name__ == "__main__":
    raise SystemExit(main())
