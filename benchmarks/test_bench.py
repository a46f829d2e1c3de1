"""pytest-benchmark suite: ``pytest benchmarks --benchmark-only`` (or ``--benchmark-disable`` as a
one-round smoke). Nothing here asserts on time; comparisons are read from the grouped tables.
``test_compare_muon_smoke`` runs ``python -m benchmarks.compare --optimizer muon`` end to end at
tiny sizes and checks what it counts (Newton-Schulz calls per rank, state bytes), not its times.

The two-rank step benchmark runs rank 0 inside pytest and rank 1 in a helper process that
mirrors every step (told which mode by a one-int broadcast), so pytest-benchmark times real
two-rank steps with their collectives.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from benchmarks import compare
from benchmarks.data import DataConfig, RankBatches, stdlib_corpus
from benchmarks.models import PRESETS, build_model, hidden_matrix_names
from benchmarks.modes import AdamWConfig, ModeSpec, Runner, build_runner
from fusion import ParamSpec, plan_layout
from sharded_opt import ShardingStage1

STEP_MODES = ("sync", "overlap")
STOP = -1
WORLD_SIZE = 2
JOIN_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class PairConfig:
    """The workload of the two-rank step benchmark: small, so the suite stays under a minute."""

    model: str = "tiny"
    micro_batch: int = 16
    bucket_mb: float = 0.02
    seed: int = 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join(port: int, rank: int) -> ProcessGroup:
    """Join the two-rank group and create the one-rank group rank 0 uses for world-size-1
    benchmarks (``new_group`` is collective, so the follower must create it too)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    return dist.new_group([0])


def _runners(config: PairConfig, rank: int) -> tuple[dict[str, Runner], tuple[torch.Tensor, torch.Tensor]]:
    spec = ModeSpec(
        config.model, config.seed, config.bucket_mb, AdamWConfig(), torch.device("cpu"), dist.group.WORLD
    )
    data = DataConfig(PRESETS[config.model].seq_len, config.micro_batch, config.seed, max_bytes=2**20)
    batch = RankBatches(stdlib_corpus(data.max_bytes), data, rank, WORLD_SIZE).batch(0)
    return {mode: build_runner(mode, spec) for mode in STEP_MODES}, batch


def _follower(port: int, config: PairConfig) -> None:
    """Rank 1: repeat whatever step rank 0 announces until told to stop."""
    torch.set_num_threads(1)
    _join(port, rank=1)
    runners, batch = _runners(config, rank=1)
    command = torch.zeros((), dtype=torch.int64)
    while True:
        dist.broadcast(command, src=0)
        if command.item() == STOP:
            break
        runner = runners[STEP_MODES[command.item()]]
        runner.step(*batch)
        runner.settle()
    dist.destroy_process_group()


class Pair:
    """Rank 0's side: ``step(mode)`` runs one synchronized step of ``mode`` on both ranks."""

    def __init__(self, config: PairConfig, port: int) -> None:
        self.solo = _join(port, rank=0)
        self.runners, self.batch = _runners(config, rank=0)

    def step(self, mode: str) -> None:
        dist.broadcast(torch.tensor(STEP_MODES.index(mode)), src=0)
        runner = self.runners[mode]
        runner.step(*self.batch)
        runner.settle()

    def stop(self) -> None:
        dist.broadcast(torch.tensor(STOP), src=0)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    port = _free_port()
    config = PairConfig()
    helper = multiprocessing.get_context("spawn").Process(target=_follower, args=(port, config), daemon=True)
    helper.start()
    try:
        pair = Pair(config, port)
        yield pair
        pair.stop()
    finally:
        helper.join(JOIN_TIMEOUT_S)
        if helper.is_alive():
            helper.kill()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", STEP_MODES)
@pytest.mark.benchmark(group="step: 2 ranks, sync vs overlap")
def test_step_time(benchmark, pair: Pair, mode: str) -> None:
    benchmark(pair.step, mode)


def _specs(count: int) -> list[ParamSpec | None]:
    """A mix of weight, bias and frozen params of varied sizes, like a deep model's."""
    shapes = [(256, 256), (256,), (1024, 256), (1024,), (3, 3, 64, 64)]
    cpu = torch.device("cpu")
    return [
        None if index % 97 == 0 else ParamSpec(shapes[index % len(shapes)], torch.float32, cpu, 0)
        for index in range(count)
    ]


@pytest.mark.benchmark(group="layout planning")
def test_plan_layout_10k_params(benchmark) -> None:
    specs = _specs(10_000)
    plan = benchmark(plan_layout, specs, 8, bucket_size_bytes=25 * 2**20)
    assert sum(len(bucket.slots) for bucket in plan.buckets) == sum(spec is not None for spec in specs)


def _optimizer_with_grads(flat: bool, solo: ProcessGroup) -> torch.optim.Optimizer:
    model = build_model("mlp", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), **AdamWConfig().kwargs())
    if flat:
        optimizer = ShardingStage1(optimizer, process_group=solo)
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        grad = torch.randn(param.shape, generator=generator)
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.copy_(grad)  # ShardingStage1 keeps grads as views of its flat buffer
    return optimizer


@pytest.mark.parametrize("layout", ["flat shard (ShardingStage1)", "per param (torch.optim)"])
@pytest.mark.benchmark(group="AdamW step, world size 1, MLP 2.7M params")
def test_optimizer_step_world_size_1(benchmark, pair: Pair, layout: str) -> None:
    optimizer = _optimizer_with_grads(layout.startswith("flat"), pair.solo)
    benchmark(optimizer.step)


MUON_SMOKE = (
    "--optimizer", "muon", "--model", "tiny", "--micro-batch", "2", "--seq-len", "8", "--warmup", "1",
    "--rounds", "2", "--steps-per-round", "1", "--steady-rounds", "2", "--steady-steps", "1", "--no-memory",
    "--preset", "loopback",
)  # fmt: skip
"""``--optimizer muon`` at the smallest sizes the options allow: 11 s on the 2-core machine, 31 s
while other jobs loaded it."""


def test_compare_muon_smoke(tmp_path: Path) -> None:
    """``--optimizer muon`` end to end on 2 ranks: every mode's step split, Newton-Schulz on each
    matrix's owner only under the wrapper, and the optimizer state per rank and class."""
    compare.main([*MUON_SMOKE, "--out", str(tmp_path)])
    run = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    assert run["optimizer"] == "muon" and run["agreement"]["agree"]
    matrices = len(hidden_matrix_names(build_model("tiny", seed=0)))
    for method in ("block", "steady"):
        split = run["split"][method]
        assert set(split) == {"ddp", "sync", "overlap", "comm", "compute"}
        assert [row["newton_schulz_calls"] for row in split["ddp"]["by_rank"]] == [matrices] * 2
        for mode in ("sync", "overlap"):
            assert sum(row["newton_schulz_calls"] for row in split[mode]["by_rank"]) == matrices
            assert split[mode]["mean"]["comm_s"] > 0
        assert split["compute"]["mean"]["comm_s"] == 0
        for found in split.values():
            mean = found["mean"]
            assert mean["rest_s"] == pytest.approx(mean["step_s"] - mean["comm_s"] - mean["newton_schulz_s"])
    state = run["state_bytes_by_rank"]
    ddp_muon, ddp_adamw = state["ddp"][0]["Muon"], state["ddp"][0]["AdamW"]
    for mode in ("sync", "overlap"):
        assert sum(rank["Muon"] for rank in state[mode]) == ddp_muon  # each momentum on its owner only
        assert all(0 < rank["AdamW"] < ddp_adamw for rank in state[mode])


def test_compare_compiled_smoke(tmp_path: Path) -> None:
    """``--compile`` end to end on 2 ranks (Dynamo with the eager backend, to stay fast): every
    mode trains its compiled forward and ends with the params of compiled DDP."""
    smoke = [arg for arg in MUON_SMOKE if arg not in ("--optimizer", "muon")]
    compare.main([*smoke, "--compile", "eager", "--modes", "ddp,sync,overlap", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["config"]["compile_backend"] == "eager"
    assert payload["runs"][0]["agreement"]["agree"]
