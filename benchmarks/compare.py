"""``python -m benchmarks.compare``: DDP, ZeroRedundancyOptimizer and ShardingStage1 (sync and
overlap) on the same GPT, data, seed and AdamW, measured interleaved in one process group.

The default preset, ``auto``, runs where the comparison means something and says which it ran
(``benchmarks.setting``): on the machine's accelerators when there is one per rank; else on CPU
ranks joined by an emulated 200 Mbit/s link when the machine allows it (root, ``ip``, ``tc``:
the ``comm-bound`` preset); else on CPU ranks over loopback (the ``loopback`` preset), where
communication costs almost nothing and overlap has little to hide. It ends with a verdict: which
mode to use on this machine, from the measured compute and communication. ``--targets`` adds the
project's own acceptance checks. Each mode is timed two ways, interleaved: short
blocks that each end with ``sync_params()``, then long steady-state blocks. Two pseudo-modes,
communication alone and compute alone, give the hidden share of communication
(``report.hidden_comm``) and the distance to max(compute, comm). Writes ``results.json``,
``step_times.png``, ``timeline_overlap.png`` (and ``scaling.png`` for several world sizes) and a
Chrome trace of one overlap step per run into ``--out``; ``--profile`` adds one per mode.
Every mode's bytes sent per step and rank are in the table (``sent MiB``): counted from the
payloads for the wrapper's modes (``ShardingStage1.wire_bytes()`` over the timed steps), computed
for DDP (a ring all-reduce sends 2(N-1)/N of the grad bytes per rank).

``--grad-compression {bf16,int8}`` and ``--param-compression int8`` add the sync and overlap modes
again with ``ShardingConfig.grad_compression``/``param_compression`` set, as ``sync+TAG`` and
``overlap+TAG`` (TAG: what grads, g, and params, p, are sent as, e.g. ``int8g+int8p``), measured
interleaved with the exact modes in the same run; the summary gives their bytes and step times
over the exact modes' and DDP's. They are not meant to end on DDP's params: their distance is
printed, not checked; the compressed sync and overlap must agree with each other bitwise (Note
[Compressed wire] in ``sharded_opt/comm/compression.py``).

``--preset comm-bound`` emulates a 200 Mbit/s link between the 2 ranks (root needed), where
communication alone takes several times the compute: the case overlap exists for.

``--degree K`` adds the ``hybrid`` mode (shard within groups of K ranks, replicate across them).
With ``--emulate-link`` on ``--world-sizes 2K`` there are two emulated nodes of K ranks each
(fast loopback inside a node, the shaped link between them), and the bytes that cross the link
per step are measured for every mode from the link's own counters.

``--optimizer muon`` trains with torch's Muon over the hidden matrices and AdamW over the rest
(two ``ShardingStage1`` wrappers in the sharded modes; modes DDP, sync and overlap, hybrid with
``--degree``) and, on CPU ranks, splits each block's step time into communication, Newton-Schulz
and the rest per rank (``benchmarks/step_split.py``), with the optimizer state per rank and
class (benchmarks/results/2026-12-04-muon.md).

``--compile`` runs every mode's forward under ``torch.compile`` (inductor unless a backend is
named): DDP compiled whole (Dynamo cuts it at DDP's buckets), the sharded modes with the model
attached and ``sharded_opt.compile_backend`` around the named backend, which cuts the graph at the
wrappers' buckets (Note [Graph cuts at buckets]); their graph waits for each param's all-gather
before its first read (Note [torch.compile] in ``sharded_opt/model_hooks/compiled_waits.py``). Compare its
ratios with an eager run of the same command (benchmarks/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import plots, report
from benchmarks.models import MODEL_NAMES, PRESETS, model_seq_len
from benchmarks.modes import (
    COMPRESSIBLE,
    MODES,
    MUON_MODES,
    OPTIMIZERS,
    Compression,
    compressed_modes,
    split_mode,
)
from benchmarks.netns import LinkConfig, link_unavailable_reason, parse_link, shaped_link
from benchmarks.report import bucket_label
from benchmarks.session import RunConfig, compare_rank, memory_rank
from benchmarks.setting import DEFAULT_LINK_GBPS, Setting, choose_setting, step_times, verdict
from sharded_opt import spawn


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything the command line chose: the base run and the grid to repeat it over."""

    base: RunConfig
    world_sizes: tuple[int, ...]
    bucket_mbs: tuple[float | None, ...]
    out: Path
    memory: bool
    link: LinkConfig | None
    setting: Setting
    targets: bool = False
    """Print (and store) the project's acceptance targets: our checks, not a user's."""


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _bucket_list(text: str) -> tuple[float | None, ...]:
    """``auto`` (each library's default) or sizes in MiB, comma-separated."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        sizes = tuple(None if part == "auto" else float(part) for part in parts)
    except ValueError as error:
        message = f"expected 'auto' or sizes in MiB, e.g. auto,1,4; got {text!r}"
        raise argparse.ArgumentTypeError(message) from error
    if not sizes or any(size is not None and not size > 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected 'auto' or sizes > 0 in MiB but got {text!r}")
    return sizes


@dataclass(frozen=True, slots=True)
class Preset:
    """Settings a ``--preset`` changes; explicit flags still win."""

    link: str | None = None
    memory: bool = True
    rounds: int | None = None
    steady_rounds: int | None = None
    steady_steps: int | None = None


PRESETS_BY_NAME = {
    "loopback": Preset(),
    # 200 Mbit/s: on the default GPT, communication alone is a few times the compute. Fewer
    # rounds and no memory pass, since every step takes about a second.
    "comm-bound": Preset(
        link=f"{DEFAULT_LINK_GBPS:g}", memory=False, rounds=4, steady_rounds=2, steady_steps=6
    ),
}
"""``auto`` (the default) picks one of these from the machine, see :func:`_auto_preset`."""


@dataclass(frozen=True, slots=True)
class Machine:
    """What :func:`benchmarks.setting.choose_setting` needs to know about this machine."""

    accelerator_type: str | None
    device_count: int
    link_unavailable: Callable[[tuple[int, ...]], str | None]
    """Why an emulated link cannot join these world sizes here, or None."""


def this_machine() -> Machine:
    available = torch.accelerator.is_available()
    accelerator = torch.accelerator.current_accelerator() if available else None
    return Machine(
        None if accelerator is None else accelerator.type,
        torch.accelerator.device_count() if available else 0,
        link_unavailable_reason,
    )


def _auto_preset(world_sizes: tuple[int, ...], machine: Machine) -> tuple[str, Setting]:
    """The preset the ``auto`` default runs here, and the setting it stands for."""
    setting = choose_setting(
        accelerator_type=machine.accelerator_type,
        device_count=machine.device_count,
        world_size=max(world_sizes),
        link_unavailable=machine.link_unavailable(world_sizes),
    )
    return ("comm-bound" if setting.kind == "link" else "loopback"), setting


def _named_setting(preset: str, link: LinkConfig | None, cpu_ranks: bool) -> Setting:
    """The setting of a run whose preset or link the command line named."""
    if link is not None:
        return Setting("link", "asked for on the command line", link.gbps)
    if not cpu_ranks:
        return Setting("accelerator", "one device per rank")
    return Setting("loopback", f"the {preset} preset")


def _mode_list(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    return tuple(mode for mode in MODES if mode in modes)  # keep the A B C D order


def parse_args(argv: list[str] | None, machine: Machine | None = None) -> Plan:
    """The command line as a :class:`Plan`; ``machine`` (default: this one) decides ``auto``."""
    defaults = RunConfig()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__)
    parser.add_argument("--model", choices=MODEL_NAMES, default=defaults.model)
    parser.add_argument("--world-sizes", type=_int_list, default=(2,), help="e.g. 1,2,4 (default 2)")
    parser.add_argument("--preset", choices=("auto", *PRESETS_BY_NAME), default="auto",
                        help="auto (default): accelerators, else an emulated link, else loopback; "
                        "comm-bound: 200 Mbit/s link (root), fewer rounds, no memory; loopback")  # fmt: skip
    parser.add_argument("--targets", action="store_true",
                        help="also check the project's acceptance targets (MET/MISS)")  # fmt: skip
    parser.add_argument("--bucket-mb", type=_bucket_list, default=(defaults.bucket_mb,),
                        help="auto (each library's default) or MiB, e.g. auto,1,4")  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=defaults.micro_batch, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps per mode")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="timed blocks per mode")
    parser.add_argument("--steps-per-round", type=int, default=defaults.steps_per_round)
    parser.add_argument("--steady-rounds", type=int, default=None,
                        help=f"long blocks per mode (default {defaults.steady_rounds})")  # fmt: skip
    parser.add_argument("--steady-steps", type=int, default=None,
                        help=f"steps per long block (default {defaults.steady_steps})")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="save one Chrome trace per mode into --out")
    parser.add_argument("--profile-steps", type=int, default=defaults.profile_steps,
                        help="steps per --profile trace (3: the steady state)")  # fmt: skip
    parser.add_argument("--modes", type=_mode_list, default=None,
                        help=f"subset of {','.join(MODES)} (Muon: {','.join(MUON_MODES)})")  # fmt: skip
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer,
                        help="muon: Muon on hidden matrices, AdamW on the rest; split steps")  # fmt: skip
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                        help="measure peak memory per mode in separate processes (default: on)")  # fmt: skip
    parser.add_argument("--emulate-link", type=parse_link, default=None, metavar="GBPS[,LATENCY_MS]")
    parser.add_argument("--degree", type=int, default=None,
                        help="add the hybrid mode: ranks per shard group (and per node)")  # fmt: skip
    parser.add_argument("--gloo-p2p", action="store_true",
                        help="ShardingConfig(gloo_point_to_point=True) for the wrapper's modes")  # fmt: skip
    parser.add_argument("--grad-compression", choices=("bf16", "int8"), default=None,
                        help="add sync and overlap with compressed grads: sync+TAG, overlap+TAG")  # fmt: skip
    parser.add_argument("--param-compression", choices=("int8",), default=None,
                        help="add sync and overlap with params sent as int8 deltas (with or "
                        "without --grad-compression)")  # fmt: skip
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="torch.compile every mode's forward (default backend: inductor)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/compare"))
    args = parser.parse_args(argv)
    machine = this_machine() if machine is None else machine
    preset_name, setting = args.preset, None
    if preset_name == "auto":
        preset_name, setting = _auto_preset(args.world_sizes, machine)
        if args.emulate_link is not None:
            setting = None  # the named link decides, below
    preset = PRESETS_BY_NAME[preset_name]
    rounds = preset.rounds if preset.rounds is not None and args.rounds == defaults.rounds else args.rounds
    steady_rounds = _first_set(args.steady_rounds, preset.steady_rounds, defaults.steady_rounds)
    steady_steps = _first_set(args.steady_steps, preset.steady_steps, defaults.steady_steps)
    link = args.emulate_link if args.emulate_link or preset.link is None else parse_link(preset.link)
    memory = preset.memory if args.memory is None else args.memory
    if args.model in PRESETS and (args.seq_len or 0) > PRESETS[args.model].seq_len:
        parser.error(f"--seq-len is at most {PRESETS[args.model].seq_len} for the {args.model} preset")
    if rounds < 2 or steady_rounds < 2:
        parser.error("--rounds and --steady-rounds must be at least 2 to report a spread")
    if args.profile_steps < 1:
        parser.error("--profile-steps must be at least 1")
    if steady_steps < 1:
        parser.error("--steady-steps must be at least 1")
    if args.degree is not None and (args.degree < 1 or any(ws % args.degree for ws in args.world_sizes)):
        parser.error(f"--degree must be >= 1 and divide every world size {args.world_sizes}")
    allowed = MUON_MODES if args.optimizer == "muon" else MODES
    if args.modes is not None and any(mode not in allowed for mode in args.modes):
        parser.error(f"--optimizer {args.optimizer} runs the modes {','.join(allowed)} only")
    chosen = allowed if args.modes is None else args.modes
    modes = tuple(mode for mode in chosen if mode != "hybrid" or args.degree is not None)
    compression = Compression(args.grad_compression, args.param_compression)
    if not compression.exact and not set(COMPRESSIBLE) & set(modes):
        parser.error(
            f"--grad-compression/--param-compression compress the modes {','.join(COMPRESSIBLE)}: run one"
        )
    modes += compressed_modes(modes, compression)
    if link is not None and args.degree is not None:
        link = dataclasses.replace(link, ranks_per_node=args.degree)
    # Two ranks cannot share one device's collectives (NCCL refuses it): with fewer devices than
    # ranks, the ranks run on CPU.
    cpu_ranks = machine.accelerator_type is None or machine.device_count < max(args.world_sizes)
    if not compression.exact and not cpu_ranks:
        parser.error(
            "a compressed wire runs on CPU ranks (gloo) only: the library refuses accelerator tensors"
        )
    if setting is None:
        setting = _named_setting(preset_name, link, cpu_ranks)
    base = dataclasses.replace(
        defaults,
        model=args.model,
        micro_batch=args.micro_batch,
        seq_len=model_seq_len(args.model, args.seq_len),
        warmup=args.warmup,
        rounds=rounds,
        steps_per_round=args.steps_per_round,
        steady_rounds=steady_rounds,
        steady_steps=steady_steps,
        profile_dir=str(args.out) if args.profile else None,
        profile_steps=args.profile_steps,
        modes=modes,
        degree=args.degree,
        threads=args.threads,
        seed=args.seed,
        gloo_point_to_point=args.gloo_p2p,
        optimizer=args.optimizer,
        compile_backend=args.compile,
        cpu_ranks=cpu_ranks,
        compression=compression,
    )
    return Plan(base, args.world_sizes, args.bucket_mb, args.out, memory, link, setting, args.targets)


def _first_set(*values: int | None) -> int:
    return next(value for value in values if value is not None)


def _enter_link(plan: Plan, stack: contextlib.ExitStack) -> tuple[LinkConfig | None, Setting]:
    """The shaped link if one was asked for and can be built (torn down when ``stack`` closes,
    also when the run fails or is stopped); otherwise say why and go on over loopback."""
    if plan.link is None:
        return None, plan.setting
    reason = link_unavailable_reason(plan.world_sizes, plan.link.ranks_per_node)
    if reason is None:
        if plan.link.latency_ms:
            print("NOTE: latency is not applied: this kernel has no sch_netem; only the rate is shaped.")
        try:
            return stack.enter_context(shaped_link(plan.link)), plan.setting
        except RuntimeError as error:
            reason = f"could not build the emulated link: {error}"
    print(f"NOTE: {reason}; running over loopback instead.")
    return None, Setting("loopback", reason)


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """While the run lasts, SIGTERM ends its ranks and raises ``SystemExit``, so a stopped run
    still deletes its namespaces (and does not wait at exit for ranks that would run on).
    Signal handlers belong to the main thread; elsewhere (a test's thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        for child in multiprocessing.active_children():
            child.terminate()
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_once(config: RunConfig, world_size: int, memory: bool) -> dict:
    """One comparison run over ``world_size`` ranks, plus the per-mode memory pass."""
    ranks = spawn(compare_rank, (config,), nprocs=world_size)
    peaks: dict[str, list[dict]] = {}
    if memory:
        memory_config = dataclasses.replace(config, trace_path=None, profile_dir=None, link=None)
        for mode in config.modes:
            peaks[mode] = spawn(memory_rank, (memory_config, mode), nprocs=world_size)
    summary = report.summarize_run(ranks, peaks, config.micro_batch * config.seq_len)
    summary["bucket_mb"] = config.bucket_mb
    summary["optimizer"] = config.optimizer
    summary["compression"] = dataclasses.asdict(config.compression)
    summary["compressed_ratios"] = report.compressed_ratios(summary)
    summary["loss_curve_ddp"] = ranks[0]["losses"].get("ddp", [])
    summary["timeline"] = ranks[0].get("timeline", [])
    node_bytes = [r["link_tx_bytes_per_step"] for r in ranks if "link_tx_bytes_per_step" in r]
    if node_bytes:
        summary["link_bytes_per_step"] = {name: sum(n[name] for n in node_bytes) for name in node_bytes[0]}
    return summary


def _print_run(run: dict, config: RunConfig) -> None:
    print(f"\n== {run['world_size']} rank(s), {config.model} GPT ({run['num_params'] / 1e6:.2f}M params), "
          f"{config.micro_batch}x{config.seq_len} tokens/rank, {bucket_label(run['bucket_mb'])} MiB buckets "
          f"({len(run['buckets_padded_numel'])} buckets"
          f"{', gloo point-to-point' if config.gloo_point_to_point else ''})"
          f"{', Muon on the hidden matrices + AdamW' if config.optimizer == 'muon' else ''}"
          f"{_compiled_label(config)} ==")  # fmt: skip
    print(report.mode_table(run))
    print(report.SENT_NOTE)
    if not config.compression.exact:
        print(f"+{config.compression.tag}: the mode with {config.compression.words()} on the wire "
              "(g: ShardingConfig.grad_compression, p: param_compression)")  # fmt: skip
    if "link_bytes_per_step" in run:
        print("bytes across the emulated link per step (both directions, steady blocks, median):")
        width = max(10, *(len(name) for name in run["link_bytes_per_step"]))
        for name, sent in run["link_bytes_per_step"].items():
            print(f"  {name:{width}} {sent / 2**20:9.2f} MiB")
    print(f"block = {config.steps_per_round}-step blocks ending in sync_params(); steady = "
          f"{config.steady_steps}-step blocks; medians of the slowest rank")  # fmt: skip
    print("\n".join(report.analysis_lines(run)))
    if "split" in run:
        print("\nStep time split (benchmarks/step_split.py): medians of each rank's blocks, means over "
              "ranks; rest = step - comm - Newton-Schulz (NS); NS max: the busiest rank")  # fmt: skip
        print(report.split_table(run))
    elif config.optimizer == "muon":
        print("(no step time split: it is measured on CPU ranks only, see benchmarks/step_split.py)")
    if "state_bytes_by_rank" in run:
        print("optimizer state per rank, MiB:")
        print("\n".join(report.state_lines(run)))
    curve = run["loss_curve_ddp"]
    if curve:
        window = max(1, len(curve) // 6)
        means = [
            sum(curve[i : i + window]) / len(curve[i : i + window]) for i in range(0, len(curve), window)
        ]
        print(f"loss (rank 0, DDP), mean of each {window} steps:", " ".join(f"{v:.3f}" for v in means))
    print("\n".join(agreement_lines(run["agreement"])))


def agreement_lines(agreement: dict) -> list[str]:
    """The params' distance to DDP's: checked for the exact modes; for the compressed ones only
    reported, with the compressed sync against the compressed overlap checked instead."""
    diffs = agreement["param_max_abs_diff"]
    exact = {name: diff for name, diff in diffs.items() if not split_mode(name)[1]}
    compressed = {name: diff for name, diff in diffs.items() if split_mode(name)[1]}
    verdict = "agree" if agreement["agree"] else "DO NOT AGREE"
    lines = []
    if exact:
        listed = ", ".join(f"{k} {v:.2e}" for k, v in exact.items())
        lines.append(f"max |param - DDP param|: {listed}; modes {'/'.join(['ddp', *exact])} {verdict} "
                     f"(atol {report.PARAM_ATOL:g})")  # fmt: skip
    if compressed:
        listed = ", ".join(f"{k} {v:.2e}" for k, v in compressed.items())
        lines.append(f"compressed modes, max |param - DDP param|: {listed} (reported, not checked: a "
                     "compressed wire is not meant to end on DDP's params)")  # fmt: skip
    if "compressed_sync_vs_overlap" in agreement:
        pair = agreement["compressed_sync_vs_overlap"]
        same = "bitwise equal" if pair == 0 else "agree" if pair <= report.PARAM_ATOL else "DO NOT AGREE"
        lines.append(f"compressed sync against compressed overlap: max |param diff| {pair:.2e}, {same}")
    return lines


def _compiled_label(config: RunConfig) -> str:
    return f", forward compiled ({config.compile_backend})" if config.compile_backend else ""


def main(argv: list[str] | None = None) -> int:
    plan = parse_args(argv)
    plan.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_stop_on_sigterm())
        link, setting = _enter_link(plan, stack)
        print(setting.describe())
        for world_size in plan.world_sizes:
            for bucket_mb in plan.bucket_mbs:
                label = bucket_label(bucket_mb)
                trace = plan.out / f"trace_overlap_ws{world_size}_b{label}.json"
                profile_dir = plan.out / f"profile_b{label}" if plan.base.profile_dir else None
                if profile_dir is not None:
                    profile_dir.mkdir(parents=True, exist_ok=True)
                config = dataclasses.replace(
                    plan.base,
                    bucket_mb=bucket_mb,
                    trace_path=str(trace),
                    profile_dir=None if profile_dir is None else str(profile_dir),
                    link=link,
                )
                runs.append(run_once(config, world_size, plan.memory))
                _print_run(runs[-1], config)
    _finish(dataclasses.replace(plan, setting=setting), runs, link is not None, argv)
    return 0


def verdict_lines(run: dict, setting: Setting) -> list[str]:
    """The verdict on the steady-state medians (block medians when only those were measured)."""
    block = step_times(run, "median_s")
    steady = step_times(run, "steady_median_s")
    if block is None:
        return ["(no verdict: it needs the sync and overlap modes and both pseudo-modes)"]
    return verdict(steady, setting.kind, block) if steady else verdict(block, setting.kind)


def _finish(plan: Plan, runs: list[dict], emulated: bool, argv: list[str] | None) -> None:
    """Scaling/sweep tables, the verdict (and targets with ``--targets``), results.json, charts."""
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
    checks = report.targets(main_run, single, emulated) if plan.targets else []
    if checks:
        print(
            f"\nTargets ({main_run['world_size']} ranks, {bucket_label(main_run['bucket_mb'])} MiB buckets):"
        )
        for check in checks:
            mark = "MET " if check.met else "MISS"
            print(f"  {mark} {check.name}: {check.measured:.3f} (limit {check.limit:g})")
    lines = verdict_lines(main_run, plan.setting)
    compressed = report.compressed_lines(main_run)
    payload = {
        "command": " ".join(["python -m benchmarks.compare", *(sys.argv[1:] if argv is None else argv)]),
        "config": dataclasses.asdict(plan.base),
        "emulated_link": dataclasses.asdict(plan.link) if emulated and plan.link else None,
        "setting": dataclasses.asdict(plan.setting),
        "verdict": lines,
        "compressed": compressed,
        "environment": report.environment(),
        "runs": runs,
        "targets": [check.as_dict() for check in checks],
    }
    report.write_json(plan.out / "results.json", payload)
    plots.plot_step_times(runs, plan.out / "step_times.png")
    if main_run["timeline"]:
        plots.plot_timeline(main_run["timeline"], plan.out / "timeline_overlap.png")
    print(f"\nWrote {plan.out}/results.json, step_times.png, timeline_overlap.png and Chrome traces")
    print(f"\nVerdict ({plan.setting.where()}, {main_run['world_size']} ranks):")
    print("\n".join(f"  {line}" for line in lines))
    if compressed:
        print(f"\nCompressed wire ({plan.base.compression.words()}), against the exact modes and DDP "
              "(bytes from the payloads; DDP's computed):")  # fmt: skip
        print("\n".join(f"  {line}" for line in compressed))


if __name__ == "__main__":
    raise SystemExit(main())
