"""torchao's low-bit Adam(W) (state quantized per block) under ShardingStage1 on 2 and 3 gloo
ranks, against the same class in one process (Note [Cuts on quantization blocks] in
``fusion/block_layout.py``).

The model holds every kind of param the cut rules tell apart: a weight of 8192 elements
(quantized, cut on its blocks), one of 4352 (quantized, too small to cut: whole in one shard),
one of 4100 (4096 or more but not whole blocks: plain state, whole in one shard) and small
biases (plain state, cut anywhere).

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
from tests.harness.dist_helper import run_ranks

torchao_optim = pytest.importorskip("torchao.optim")

STEPS = 10
BATCH, FEATURES = 12, 32


class LowBitModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 256)  # weight 8192: quantized, cut on blocks
        self.fc2 = nn.Linear(256, 17)  # weight 4352: quantized, whole
        self.fc3 = nn.Linear(17, 4100 // 17, bias=False)  # 4097 elements: plain, whole
        self.head = nn.Linear(4100 // 17, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))))


@dataclass(frozen=True)
class Run:
    cls: str
    overlap: bool


RUNS = {
    "adamw8bit_sync": Run("AdamW8bit", overlap=False),
    "adamw8bit_overlap": Run("AdamW8bit", overlap=True),
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


def train_sharded(run: Run) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    strategy = Strategy(sharding=ShardingConfig(enable_overlap=run.overlap))
    opt = ShardingStage1(make_optimizer(run.cls, model), strategy=strategy, model=model)
    size = BATCH // world_size
    for step in range(STEPS):
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


def train_all(runs: list[Run]) -> list[dict]:
    return [train_sharded(run) for run in runs]


def train_plain(cls: str, slices: int = 1) -> dict:
    """The plain class in one process; ``slices`` > 1 averages per-slice grads (sum in slice
    order, then divide), as the ranks' reduction does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        opt = make_optimizer(cls, model)
        params = list(model.parameters())
        size = BATCH // slices
        for step in range(STEPS):
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
        return {"params": [p.detach().clone() for p in params], "optimizer": opt}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"world{ws}")
def sharded_runs(request) -> tuple[int, dict[str, list[dict]]]:
    world_size = request.param
    per_rank = run_ranks(train_all, world_size, list(RUNS.values()))
    return world_size, {name: [r[i] for r in per_rank] for i, name in enumerate(RUNS)}


@pytest.mark.parametrize("name", list(RUNS))
def test_bitwise_equal_to_one_process_averaging_the_same_slices(sharded_runs, name: str) -> None:
    world_size, results = sharded_runs
    expected = train_plain(RUNS[name].cls, slices=world_size)["params"]
    for rank, result in enumerate(results[name]):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert torch.equal(got, want), f"rank {rank} param {index}: {(got - want).abs().max()}"
