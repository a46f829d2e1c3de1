"""torchao's low-bit Adam(W) (state quantized per block) under ShardingStage1 on 2 and 3 gloo
ranks, against the same class in one process (Note [Cuts on quantization blocks] in
``fusion/block_layout.py``).

The model holds every kind of param the cut rules tell apart: a weight of 32768 elements
(quantized, cut on its blocks on 2 and 3 ranks), weights of 4352 and 4096 (quantized, too small
to cut: whole in one shard), a gain of 4097 (4096 or more but not whole blocks: plain state,
whole in one shard) and small biases (plain state, cut anywhere).

Tolerances: against one process over the whole batch, the project's fp32 parity tolerance
(rtol=1e-6, atol=1e-7) is for AdamW's fp32 state; quantized state rounds each moment to its
code, and a last-bit difference in a grad can move a value across a code boundary, so the
comparison is bitwise against one process that averages the same slice grads as the reduction
does, and loose against the whole batch.

torchao compiles its step per tensor shape (tens of seconds on a loaded 2-core CPU the first
time; inductor's cache keeps them), so the runs share one spawn per world size and the model is
small.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.step.quantized_state import stored_bytes
from tests.harness.dist_helper import run_ranks

torchao_optim = pytest.importorskip("torchao.optim")
pytestmark = pytest.mark.timeout(1800)  # torchao compiles its step per shape, see above

STEPS = 10
RESUME_AT = 6
BATCH, FEATURES = 12, 32


class LowBitModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 1024)  # weight 32768: quantized, cut on blocks on 2 and 3 ranks
        self.fc2 = nn.Linear(1024, 17)  # weight 17408: quantized, may be cut
        self.fc3 = nn.Linear(17, 256, bias=False)  # 4352: quantized, too small to cut: whole
        self.fc4 = nn.Linear(256, 16)  # 4096: quantized (the threshold itself), whole
        self.head = nn.Linear(16, 2)
        self.gain = nn.Parameter(torch.ones(4097))  # 4096 or more, not whole blocks: plain, whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.head(torch.tanh(self.fc4(torch.relu(self.fc3(hidden))))) * self.gain.mean()


@dataclass(frozen=True)
class Run:
    cls: str
    overlap: bool


RUNS = {
    "adamw8bit_sync": Run("AdamW8bit", overlap=False),
    "adamw8bit_overlap": Run("AdamW8bit", overlap=True),
    "adamw4bit_overlap": Run("AdamW4bit", overlap=True),
    "adamwfp8_sync": Run("AdamWFp8", overlap=False),
}


def make_model() -> LowBitModel:
    torch.manual_seed(0)
    return LowBitModel()


def make_optimizer(cls: str, model: nn.Module) -> torch.optim.Optimizer:
    return getattr(torchao_optim, cls)(model.parameters(), lr=1e-2, weight_decay=0.05)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 2, generator=generator)


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(inputs), targets)


def train_sharded(run: Run, start: bytes | None = None) -> dict:
    """This rank's slice of every batch; ``start`` (a plain run's model and optimizer state
    dicts after ``RESUME_AT`` steps, saved by ``torch.save``) resumes from there."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    strategy = Strategy(sharding=ShardingConfig(enable_overlap=run.overlap))
    opt = ShardingStage1(make_optimizer(run.cls, model), strategy=strategy, model=model)
    first = 0
    if start is not None:
        saved = torch.load(io.BytesIO(start), weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        first = RESUME_AT
    size = BATCH // world_size
    for step in range(first, STEPS):
        inputs, targets = batch(step)
        opt.zero_grad()
        part = slice(rank * size, (rank + 1) * size)
        loss_of(model, inputs[part], targets[part]).backward()
        opt.step()
    opt.sync_params()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state_dict": buffer.getvalue(),
        "state_bytes": opt.memory_bytes()["optimizer_state"],
    }


def train_all(runs: list[Run], start: bytes) -> list[dict]:
    return [train_sharded(run) for run in runs] + [train_sharded(RUNS["adamw8bit_overlap"], start)]


def train_plain(cls: str, slices: int = 1, start: dict | None = None) -> dict:
    """The plain class in one process; ``slices`` > 1 averages per-slice grads (sum in slice
    order, then divide), as the ranks' reduction does. Saves the model and optimizer after
    ``RESUME_AT`` steps (``"snapshot"``); ``start`` (such a snapshot) resumes from there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        opt = make_optimizer(cls, model)
        if start is not None:
            model.load_state_dict(start["model"])
            opt.load_state_dict(start["optimizer"])
        params = list(model.parameters())
        size = BATCH // slices
        snapshot = None
        for step in range(RESUME_AT if start is not None else 0, STEPS):
            if step == RESUME_AT and start is None:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
                snapshot = buffer.getvalue()
            inputs, targets = batch(step)
            grads = []
            for index in range(slices):
                model.zero_grad()
                part = slice(index * size, (index + 1) * size)
                loss_of(model, inputs[part], targets[part]).backward()
                grads.append([p.grad.clone() for p in params])
            for position, param in enumerate(params):
                total = grads[0][position]
                for other in grads[1:]:
                    total = total + other[position]
                param.grad = total / slices
            opt.step()
        return {"params": [p.detach().clone() for p in params], "optimizer": opt, "snapshot": snapshot}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"world{ws}")
def sharded_runs(request) -> tuple[int, dict[str, list[dict]]]:
    world_size = request.param
    start = train_plain("AdamW8bit", slices=world_size)["snapshot"]
    per_rank = run_ranks(train_all, world_size, list(RUNS.values()), start)
    names = [*RUNS, "resumed_from_plain"]
    return world_size, {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


@pytest.mark.parametrize("name", list(RUNS))
def test_bitwise_equal_to_one_process_averaging_the_same_slices(sharded_runs, name: str) -> None:
    world_size, results = sharded_runs
    expected = train_plain(RUNS[name].cls, slices=world_size)["params"]
    for rank, result in enumerate(results[name]):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert torch.equal(got, want), f"rank {rank} param {index}: {(got - want).abs().max()}"


def test_resumed_from_a_plain_state_dict_is_bitwise_the_plain_run(sharded_runs) -> None:
    world_size, results = sharded_runs
    expected = train_plain("AdamW8bit", slices=world_size)["params"]
    for rank, result in enumerate(results["resumed_from_plain"]):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert torch.equal(got, want), f"rank {rank} param {index}: {(got - want).abs().max()}"


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        assert got["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            mine = got["state"][index][key]
            assert type(mine) is type(value) and mine.shape == value.shape, (index, key)
            if type(value) is torch.Tensor:
                assert torch.equal(mine, value), (index, key)
                continue
            names, attributes = value.__tensor_flatten__()
            assert mine.__tensor_flatten__()[1] == attributes, (index, key)
            for name in names:
                assert torch.equal(getattr(mine, name), getattr(value, name)), (index, key, name)


@pytest.mark.parametrize("name", list(RUNS))
def test_state_dict_is_the_plain_classs_own_and_loads_into_it(sharded_runs, name: str) -> None:
    """The wrapper saves torchao's format (codes, scales and code book of each quantized
    moment, plain tensors for the others), equal to the plain run's; the plain class loads it
    and steps on as the plain run does."""
    world_size, results = sharded_runs
    plain = train_plain(RUNS[name].cls, slices=world_size)
    want = plain["optimizer"].state_dict()
    for result in results[name]:
        _assert_same_state(torch.load(io.BytesIO(result["state_dict"]), weights_only=False), want)
    saved = torch.load(io.BytesIO(results[name][0]["state_dict"]), weights_only=False)
    model = make_model()
    with torch.no_grad():
        for param, value in zip(model.parameters(), plain["params"], strict=True):
            param.copy_(value)
    reloaded = make_optimizer(RUNS[name].cls, model)
    reloaded.load_state_dict(saved)
    _assert_same_state(reloaded.state_dict(), want)


@pytest.mark.parametrize("name", list(RUNS))
def test_state_per_rank_is_a_share_of_the_plain_classs(sharded_runs, name: str) -> None:
    """Each rank's real state bytes (codes, scales, code books, plain moments) are at most its
    1/N share of the plain class's plus, per cut param, the code books of its piece and the
    state of the elements padding displaces (at most 2 * 4096 per shard boundary)."""
    world_size, results = sharded_runs
    plain = train_plain(RUNS[name].cls)["optimizer"]
    plain_bytes = sum(stored_bytes(v) for state in plain.state.values() for v in state.values() if v.dim())
    code_books = 2 * 256 * 4  # exp_avg's and exp_avg_sq's, one per quantized piece (8-bit)
    for result in results[name]:
        assert result["state_bytes"] <= plain_bytes / world_size + 2 * code_books + 2 * 4096 * 8
    assert sum(r["state_bytes"] for r in results[name]) >= plain_bytes


def test_params_are_cut_on_blocks() -> None:
    """The model's largest weight is cut (so the runs above step pieces of a quantized param)."""
    from fusion.block_layout import BlockGrid
    from fusion.layout import ParamSpec, plan_layout

    model = make_model()
    specs = [ParamSpec.of(p, 0) for p in model.parameters()]
    index = [p is model.fc1.weight for p in model.parameters()].index(True)
    for world_size in (2, 3):
        plan = plan_layout(specs, world_size, bucket_size_bytes=64 * 1024, block_grid=BlockGrid(256, 4096))
        bucket = plan.buckets[plan.slot(index).bucket_index]
        pieces = [p for r in range(world_size) for p in bucket.shard_pieces(r) if p.param_index == index]
        assert len(pieces) == world_size and all(p.param_start % 256 == 0 for p in pieces)
