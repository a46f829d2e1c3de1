"""What each rank runs: interleaved timing of all modes in one process group, and a per-mode
memory pass. Functions here are module-level so ``sharded_opt.spawn`` can pickle them."""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from tqdm import tqdm

from benchmarks.data import DataConfig, RankBatches, stdlib_corpus
from benchmarks.modes import (
    COMM_ONLY,
    COMPRESSIBLE,
    COMPUTE_ONLY,
    MODES,
    PSEUDO_MODES,
    AdamWConfig,
    CommOnlyRunner,
    Compression,
    ModeSpec,
    MuonConfig,
    Runner,
    build_compute_runner,
    build_runner,
    comm_bytes_per_step,
    split_mode,
)
from benchmarks.netns import LinkConfig, link_group, link_tx_bytes
from benchmarks.step_split import StepClock, block_split, step_clock
from benchmarks.trace_analysis import profiler_options


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One comparison run; the defaults took 4 min 14 s on 2 otherwise idle CPU cores (2026-12-04)."""

    model: str = "default"
    micro_batch: int = 8
    seq_len: int = 128
    warmup: int = 3
    rounds: int = 12
    steps_per_round: int = 3
    steady_rounds: int = 4
    """Rounds of the steady-state method: one long block per mode and round."""
    steady_steps: int = 10
    """Steps per steady-state block; one ``settle`` at its end, so the all-gather left in flight
    by the last step is charged once per ``steady_steps`` steps, as in a long training run."""
    bucket_mb: float | None = None
    """None: each library's default bucket sizes (DDP 25 MiB, ShardingStage1 sized from the
    model)."""
    seed: int = 0
    threads: int = 1
    modes: tuple[str, ...] = MODES
    comm_only: bool = True
    trace_path: str | None = None
    profile_dir: str | None = None
    """Write one Chrome trace per mode here (rank 0), see ``--profile``."""
    profile_steps: int = 1
    """Steps in each ``--profile`` trace; more than one shows the steady state, where each
    step's all-gathers overlap the next forward."""
    link: LinkConfig | None = None
    adamw: AdamWConfig = AdamWConfig()
    degree: int | None = None
    """Ranks per shard group of the ``hybrid`` mode (``--degree``)."""
    gloo_point_to_point: bool = False
    """The wrapper's reductions and all-gathers over gloo point-to-point messages (``--gloo-p2p``)."""
    optimizer: str = "adamw"
    """AdamW over every param, or ``"muon"``: Muon over the hidden matrices and AdamW over the
    rest, with each block's time split into communication, Newton-Schulz and the rest on CPU
    ranks (``benchmarks.step_split``)."""
    muon: MuonConfig = MuonConfig()
    compile_backend: str | None = None
    """``torch.compile`` backend for every mode's forward (``--compile``); None: eager."""
    cpu_ranks: bool = False
    """Run the ranks on CPU even where an accelerator is visible (fewer devices than ranks)."""
    compression: Compression = Compression()
    """The wire of the compressed modes among ``modes`` (``--grad-compression``,
    ``--param-compression``); every other mode is exact."""

    @property
    def total_steps(self) -> int:
        return self.warmup + self.rounds * self.steps_per_round + self.steady_rounds * self.steady_steps


def splits_steps(config: RunConfig) -> bool:
    """Whether :func:`compare_rank` splits each block's time (Muon, CPU ranks; see ``step_split``)."""
    return config.optimizer == "muon" and (config.cpu_ranks or not torch.accelerator.is_available())


def compare_rank(config: RunConfig) -> dict:
    """Train every mode on the same batches, interleaved block by block (short blocks, then long
    steady-state blocks), and return this rank's block times, losses, state/comm bytes, param
    agreement and (rank 0) one overlap step's events; with Muon on CPU, each block's split too."""
    torch.set_num_threads(config.threads)
    with contextlib.ExitStack() as stack:
        clock = stack.enter_context(step_clock()) if splits_steps(config) else None
        return _compare(config, clock)


def _compare(config: RunConfig, clock: StepClock | None) -> dict:
    group = link_group(config.link) if config.link else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    spec = _mode_spec(config, group)
    batches = _batches(config, rank, world_size, spec.device)
    runners = {name: build_runner(name, spec) for name in config.modes}
    if config.comm_only and "sync" in runners and world_size > 1:
        runners[COMM_ONLY] = CommOnlyRunner(runners["sync"])
        runners[COMPUTE_ONLY] = build_compute_runner(spec)
    if clock is not None and "ddp" in runners:
        clock.watch_ddp(runners["ddp"].model, runners["ddp"].forward, runners["ddp"].optimizer)
    losses: dict[str, list[float]] = {name: [] for name in runners}
    _warm_up(runners, batches[: config.warmup], losses)
    if clock is not None and config.warmup and not clock.totals["newton_schulz_calls"]:
        raise RuntimeError(
            "Muon stepped but torch.optim._muon._zeropower_via_newtonschulz was never called: this "
            "torch's Muon orthogonalizes elsewhere; update benchmarks/step_split.py"
        )
    short_end = config.warmup + config.rounds * config.steps_per_round
    show = rank == 0
    splits: dict[str, dict[str, list[float]]] = {name: {} for name in runners}
    short = batches[config.warmup : short_end]
    sent: dict[str, dict[str, int]] = {}
    times = _timed_rounds(
        runners, short, config.steps_per_round, losses, group, show, clock=clock, splits=splits, sent=sent
    )
    link_bytes: dict[str, list[float]] = {name: [] for name in runners}
    steady_splits: dict[str, dict[str, list[float]]] = {name: {} for name in runners}
    steady = _timed_rounds(
        runners, batches[short_end:], config.steady_steps, losses, group, show, config.link, link_bytes,
        clock=clock, splits=steady_splits, sent=sent,
    )  # fmt: skip
    timed_steps = len(short) // config.steps_per_round * config.steps_per_round
    timed_steps += len(batches[short_end:]) // config.steady_steps * config.steady_steps
    result = {
        "rank": rank,
        "world_size": world_size,
        "times": times,
        "steady_times": steady,
        "losses": {name: values for name, values in losses.items() if name not in PSEUDO_MODES},
        "state_bytes": {name: r.state_bytes() for name, r in runners.items() if name not in PSEUDO_MODES},
        "comm_bytes": {name: comm_bytes_per_step(r, world_size) for name, r in runners.items()},
        "num_params": sum(p.numel() for p in next(iter(runners.values())).model.parameters()),
        "agreement": _param_agreement(runners),
        "compressed_pair_diff": _compressed_pair_diff(runners),
        # What the wrapper's modes sent per timed step, counted from their payloads.
        "wire_bytes_per_step": {
            name: {kind: total / timed_steps for kind, total in kinds.items()} for name, kinds in sent.items()
        },
        "buckets": _bucket_sizes(runners),
        "rss_bytes": psutil.Process().memory_info().rss,
    }
    if config.link is not None and rank % config.link.ranks_per_node == 0:
        # This node's share of the bytes that crossed the emulated link, per step (steady blocks).
        result["link_tx_bytes_per_step"] = {n: statistics.median(v) for n, v in link_bytes.items() if v}
    if clock is not None:
        result["splits"], result["steady_splits"] = splits, steady_splits
    if config.optimizer != "adamw":
        result["state_bytes_by_optimizer"] = {
            name: r.state_bytes_by_optimizer() for name, r in runners.items() if name not in PSEUDO_MODES
        }
    if config.trace_path is not None and "overlap" in runners:
        result["timeline"] = _trace_overlap_step(runners["overlap"], batches[-1:], config.trace_path, rank)
    if config.profile_dir is not None:
        for name, runner in runners.items():
            path = f"{config.profile_dir}/trace_{name}_ws{world_size}.json"
            _trace_overlap_step(runner, batches[-config.profile_steps :], path, rank)
    return result


def memory_rank(config: RunConfig, mode: str) -> dict[str, int]:
    """Peak memory of one mode alone in a fresh process: RSS on CPU, max allocated on a device.

    Modes share a process in :func:`compare_rank`, where peaks cannot be told apart, hence a
    separate process per mode here.
    """
    torch.set_num_threads(config.threads)
    group = link_group(config.link) if config.link else dist.group.WORLD
    baseline = psutil.Process().memory_info().rss
    spec = _mode_spec(config, group)
    runner = build_runner(mode, spec)
    batches = _batches(config, dist.get_rank(group), dist.get_world_size(group), spec.device)
    for inputs, targets in batches[: config.warmup + 2]:
        runner.step(inputs, targets)
    runner.settle()
    if spec.device.type != "cpu":
        return {"peak_bytes": torch.accelerator.max_memory_allocated(), "baseline_bytes": 0}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_bytes": peak, "baseline_bytes": baseline}


def _mode_spec(config: RunConfig, group: ProcessGroup) -> ModeSpec:
    if torch.accelerator.is_available() and not config.cpu_ranks:
        accelerator = torch.accelerator.current_accelerator()
        device = torch.device(accelerator.type, torch.accelerator.current_device_index())
    else:
        device = torch.device("cpu")
    return ModeSpec(
        config.model,
        config.seed,
        config.bucket_mb,
        config.adamw,
        device,
        group,
        config.degree,
        config.gloo_point_to_point,
        config.optimizer,
        config.muon,
        config.compile_backend,
        config.compression,
    )


def _batches(config: RunConfig, rank: int, world_size: int, device: torch.device) -> list:
    """Every batch of the run, built before any timing so data loading is never measured."""
    data = DataConfig(config.seq_len, config.micro_batch, config.seed)
    source = RankBatches(stdlib_corpus(data.max_bytes), data, rank, world_size)
    return [source.batch(step, device) for step in range(config.total_steps + 1)]


def _warm_up(runners: dict[str, Runner], batches: list, losses: dict[str, list[float]]) -> None:
    for inputs, targets in batches:
        for name, runner in runners.items():
            losses[name].append(runner.step(inputs, targets).item())
            runner.settle()


def _timed_rounds(
    runners: dict[str, Runner],
    batches: list,
    k: int,
    losses: dict[str, list[float]],
    group: ProcessGroup,
    show: bool,
    link: LinkConfig | None = None,
    link_bytes: dict[str, list[float]] | None = None,
    clock: StepClock | None = None,
    splits: dict[str, dict[str, list[float]]] | None = None,
    sent: dict[str, dict[str, int]] | None = None,
) -> dict[str, list[float]]:
    """Per-step seconds of each block: A B C D A B C D ..., each block ``k`` steps long (one
    round per ``k`` batches) and ending with ``settle`` so its in-flight work is charged to it.
    With ``link`` and ``link_bytes``, also the bytes per step this rank's node sent over the
    emulated link during each block; with ``clock`` and ``splits``, what the clock added up per
    step of each block (``splits[mode][key]``, one value per block); with ``sent``, the bytes
    each wrapper mode's blocks sent (``Runner.wire_bytes``) are added to ``sent[mode][kind]``,
    read outside the timed span."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    bar = tqdm(range(len(batches) // k), desc=f"rounds of {k} steps", disable=not show, leave=False)
    for round_index in bar:
        block = batches[round_index * k : (round_index + 1) * k]
        for name, runner in runners.items():
            dist.barrier(group)
            wire_before = runner.wire_bytes() if sent is not None else None
            tx_before = link_tx_bytes(link) if link is not None else 0
            before = clock.read() if clock is not None else {}
            start = time.perf_counter()
            block_losses = [runner.step(inputs, targets) for inputs, targets in block]
            runner.settle()
            times[name].append((time.perf_counter() - start) / k)
            if sent is not None and wire_before is not None:
                totals = sent.setdefault(name, dict.fromkeys(wire_before, 0))
                for kind, value in runner.wire_bytes().items():
                    totals[kind] += value - wire_before[kind]
            if clock is not None and splits is not None:
                for key, value in block_split(before, clock.read(), k).items():
                    splits[name].setdefault(key, []).append(value)
            if link is not None and link_bytes is not None:
                link_bytes[name].append((link_tx_bytes(link) - tx_before) / k)
            losses[name].extend(loss.item() for loss in block_losses)
        if show:
            bar.set_postfix_str(_loss_postfix(losses))
    return times


def _loss_postfix(losses: dict[str, list[float]]) -> str:
    """The progress bar's postfix: each mode's training loss after its latest step, labelled."""
    last = ", ".join(
        f"{name} {values[-1]:.3f}" for name, values in losses.items() if name not in PSEUDO_MODES and values
    )
    return f"last loss: {last}"


def _param_agreement(runners: dict[str, Runner]) -> dict[str, float]:
    """Max abs param difference of every mode against DDP's (the reference), the compressed
    modes' included (their distance, which is not meant to be 0)."""
    if "ddp" not in runners:
        return {}
    reference = runners["ddp"].flat_params()
    return {
        name: (runner.flat_params() - reference).abs().max().item()
        for name, runner in runners.items()
        if name not in PSEUDO_MODES and name != "ddp"
    }


def _compressed_pair_diff(runners: dict[str, Runner]) -> float | None:
    """Max abs param difference between the compressed sync and overlap modes, which must be 0
    (Note [Compressed wire] in ``sharded_opt/comm/compression.py``); None unless both ran."""
    pair = [name for name in runners if split_mode(name)[1] and split_mode(name)[0] in COMPRESSIBLE]
    if len(pair) != 2:
        return None
    first, second = (runners[name].flat_params() for name in pair)
    return (first - second).abs().max().item()


def _bucket_sizes(runners: dict[str, Runner]) -> list[int]:
    for name in ("overlap", "sync"):
        if name in runners:
            return [
                bucket.padded_numel for wrapper in runners[name].wrappers for bucket in wrapper.plan.buckets
            ]
    return []


def _trace_overlap_step(runner: Runner, batches: list, trace_path: str, rank: int) -> list[dict]:
    """Profile one step of ``runner`` per batch (every rank must step; rank 0 writes the Chrome
    trace) and return their forward/backward/step ranges and collective launches for the
    timeline plot."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, **profiler_options()) as profiler:
        for batch in batches:
            runner.step(*batch)
        runner.settle()
    if rank != 0:
        return []
    profiler.export_chrome_trace(trace_path)
    return _timeline_events(profiler)


PHASES = ("forward", "backward", "optimizer.step")
"""The ``record_function`` ranges each step is labelled with (see ``Runner.step``)."""


def _timeline_events(profiler: torch.profiler.profile) -> list[dict]:
    """Compute phases, collective launches (``c10d::``) and gloo's own work (``gloo:``)."""
    events = [e for e in profiler.events() if e.name in PHASES or e.name.startswith(("c10d::", "gloo:"))]
    if not events:
        return []
    origin = min(e.time_range.start for e in events)
    return [
        {"name": e.name, "start_us": e.time_range.start - origin, "end_us": e.time_range.end - origin}
        for e in events
    ]
