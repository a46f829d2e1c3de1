"""Shared models, data and training loops for the parity tests.

Each run is described by a small picklable ``RunConfig`` so one spawned job can train many
configurations; the single-process reference trains the same model with the plain optimizer on
the concatenated batch.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy

GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3 and 4
IN_FEATURES = 12
RTOL, ATOL = 1e-6, 1e-7
"""The fp32 parity tolerance against one process over the whole batch (why: the docstring of
``tests/parity/test_parity.py``)."""
STEPS_BEFORE, STEPS_AFTER = 4, 4
"""Steps before a state dict or checkpoint is taken, and after it is loaded."""


class ParityMLP(nn.Module):
    """Mixed shapes: a (2,) bias smaller than world size 3, a scalar param, a frozen param."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 24)
        self.fc2 = nn.Linear(24, 16)
        self.head = nn.Linear(16, 2)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.frozen_offset = nn.Parameter(torch.randn(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.fc1(x))
        hidden = torch.tanh(self.fc2(hidden))
        return self.head(hidden) * self.scale + self.frozen_offset


@dataclass(frozen=True)
class RunConfig:
    optimizer: str = "adamw"
    steps: int = 10
    overlap: bool = False
    enable: bool = True
    bucket_size_mb: float = 0.001  # ~1 KiB: several buckets even for the tiny model
    scheduler: str | None = None
    closure: bool = False
    micro_batches: int = 1
    zero_grad_style: str = "optimizer"  # or "model": model.zero_grad() sets grads to None
    attach_model: bool = True
    clip_norm: float | None = None
    clip_norm_type: float = 2.0
    param_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    degree: int | None = None


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> ParityMLP:
    torch.manual_seed(seed)
    return ParityMLP().to(dtype)


def make_optimizer(name: str, model: ParityMLP) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    if name == "adamw_groups":
        first = list(model.fc1.parameters())
        first_ids = {id(p) for p in first}
        rest = [p for p in model.parameters() if id(p) not in first_ids]
        return torch.optim.AdamW(
            [{"params": first, "lr": 1e-2, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3}],
            weight_decay=0.0,
        )
    raise ValueError(f"unknown optimizer {name!r}")


def make_scheduler(name: str | None, optimizer: torch.optim.Optimizer):
    if name is None:
        return None
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    if name == "onecycle":  # also cycles Adam's beta1 through param_groups
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-2, total_steps=20)
    if name == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    raise ValueError(f"unknown scheduler {name!r}")


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + micro)
    inputs = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator)
    targets = torch.randn(GLOBAL_BATCH, 2, generator=generator)
    return inputs, targets


def local_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = tensor.shape[0] // world_size
    return tensor[rank * size : (rank + 1) * size]


def _sharded_steps(model, optimizer, steps: range) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in steps:
        optimizer.zero_grad()
        dtype = next(model.parameters()).dtype
        inputs, targets = (t.to(dtype) for t in batch(step))
        prediction = model(local_slice(inputs, rank, world_size))
        torch.nn.functional.mse_loss(prediction, local_slice(targets, rank, world_size)).backward()
        optimizer.step()


def _to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def train_sharded(config: RunConfig) -> dict:
    """Train on this rank's slice of every batch through ShardingStage1; return final params."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(dtype=config.param_dtype)
    strategy = Strategy(
        sharding=ShardingConfig(
            enable=config.enable,
            enable_overlap=config.overlap,
            bucket_size_mb=config.bucket_size_mb,
            master_dtype=config.master_dtype,
            reduce_dtype=config.reduce_dtype,
            degree=config.degree,
        )
    )
    optimizer = ShardingStage1(
        make_optimizer(config.optimizer, model),
        strategy=strategy,
        model=model if config.attach_model else None,
    )
    scheduler = make_scheduler(config.scheduler, optimizer)
    losses, norms = [], []
    for step in range(config.steps):
        losses.append(_sharded_step(model, optimizer, config, step, rank, world_size, norms))
        if scheduler is not None:
            scheduler.step()
    optimizer.sync_params()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "losses": losses,
        "norms": norms,
        "state_numel": _state_numel(optimizer.shards.inner),
        "trainable_local_numel": sum(
            piece.numel
            for shard in optimizer.shards.live_shards()
            for piece in shard.pieces
            if optimizer.shards.buffers.params[piece.param_index].requires_grad
        ),
        "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def _sharded_step(
    model, optimizer, config: RunConfig, step: int, rank: int, world_size: int, norms: list[float]
) -> float:
    def closure() -> torch.Tensor:
        _zero_grad(model, optimizer, config)
        total = torch.zeros(())
        for micro in range(config.micro_batches):
            inputs, targets = _cast(batch(step, micro), config.param_dtype)
            loss = _loss(model, local_slice(inputs, rank, world_size), local_slice(targets, rank, world_size))
            loss = loss / config.micro_batches
            if micro < config.micro_batches - 1:
                with optimizer.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.detach()
        if config.clip_norm is not None:
            norms.append(float(optimizer.clip_grad_norm_(config.clip_norm, config.clip_norm_type)))
        return total

    if config.closure:
        return float(optimizer.step(closure))
    loss = closure()
    optimizer.step()
    return float(loss)


def _zero_grad(model, optimizer, config: RunConfig) -> None:
    if config.zero_grad_style == "model":
        model.zero_grad(set_to_none=True)
    else:
        optimizer.zero_grad()


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(inputs), targets)


def train_reference(config: RunConfig, grad_slices: int = 1) -> dict:
    """The same training with the plain optimizer on the whole batch in one process.

    With a ``master_dtype``, the optimizer steps fp32 master copies of the (bf16) params and
    the params are cast back after each step, the textbook mixed-precision loop. With
    ``grad_slices`` > 1, each batch's grads are computed per slice (as the ranks do) and
    averaged in the reduction dtype: bf16 grads of a slice and of the whole batch round
    differently, and Adam turns a rounding difference in a near-zero grad into a full
    ``lr``-sized step, so a low-precision reference must see the same slices.
    """
    model = make_model(dtype=config.param_dtype)
    params = list(model.parameters())
    masters = params
    if config.master_dtype is not None:
        masters = [p.detach().to(config.master_dtype).requires_grad_(p.requires_grad) for p in params]
    optimizer = make_optimizer(config.optimizer, _MasterView(model, masters))
    scheduler = make_scheduler(config.scheduler, optimizer)
    norms = []
    for step in range(config.steps):
        accumulated: list[torch.Tensor | None] = [None] * len(params)
        for micro in range(config.micro_batches):
            inputs, targets = _cast(batch(step, micro), config.param_dtype)
            slice_grads = []
            for index in range(grad_slices):
                model.zero_grad()
                loss = _loss(
                    model, local_slice(inputs, index, grad_slices), local_slice(targets, index, grad_slices)
                )
                (loss / config.micro_batches).backward()
                slice_grads.append([None if p.grad is None else p.grad.clone() for p in params])
            averages = _average_slices(params, slice_grads, config.reduce_dtype)
            accumulated = [_add(total, average) for total, average in zip(accumulated, averages, strict=True)]
        model.zero_grad()
        for master, grad in zip(masters, accumulated, strict=True):
            master.grad = None if grad is None else grad.to(master.dtype)
        if config.clip_norm is not None:
            norms.append(
                float(torch.nn.utils.clip_grad_norm_(masters, config.clip_norm, config.clip_norm_type))
            )
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters, strict=True):
                if master is not param:
                    param.copy_(master)
        if scheduler is not None:
            scheduler.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state_numel": _state_numel(optimizer),
        "norms": norms,
    }


def _add(total: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor | None:
    if total is None or value is None:
        return value if total is None else total
    return total + value


def _average_slices(params: list, slice_grads: list, reduce_dtype) -> list[torch.Tensor | None]:
    """Per param, the slices' grads averaged in the reduction dtype, as the ranks' averaging
    collective does it (sum, then divide)."""
    averages: list[torch.Tensor | None] = []
    for position, param in enumerate(params):
        grads = [grads[position] for grads in slice_grads if grads[position] is not None]
        if not grads:
            averages.append(None)
            continue
        dtype = reduce_dtype or (torch.float32 if param.dtype.itemsize < 4 else param.dtype)
        total = grads[0].to(dtype)
        for grad in grads[1:]:
            total = total + grad.to(dtype)
        averages.append(total / len(grads))
    return averages


class _MasterView:
    """Looks like the model to ``make_optimizer`` but hands out the master params."""

    def __init__(self, model: ParityMLP, masters: list[torch.Tensor]) -> None:
        by_id = {id(p): m for p, m in zip(model.parameters(), masters, strict=True)}
        self._masters = masters
        self.fc1 = _Params([by_id[id(p)] for p in model.fc1.parameters()])

    def parameters(self):
        return iter(self._masters)


class _Params:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params

    def parameters(self):
        return iter(self._params)


def _cast(pair: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return pair[0].to(dtype), pair[1].to(dtype)


def train_many(configs: list[RunConfig]) -> list[dict]:
    return [train_sharded(config) for config in configs]


def _state_numel(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel()
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    )


def with_overlap(configs: list[RunConfig], overlap: bool) -> list[RunConfig]:
    return [dataclasses.replace(config, overlap=overlap) for config in configs]


class BranchyModel(nn.Module):
    """A branch that some ranks skip on some steps, and a tied input/output embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, use_branch: bool) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(self.embed(tokens)))
        if use_branch:
            hidden = hidden + torch.relu(self.branch(hidden))
        return self.head(hidden)


def train_branchy(overlap: bool, steps: int = 10) -> list[torch.Tensor]:
    """Overlap must cope with params that get no grad on some ranks and with a tied weight."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = BranchyModel()
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        overlap=overlap,
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.0005)),
    )
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator)
        tokens = local_slice(tokens, rank, world_size)
        optimizer.zero_grad()
        logits = model(tokens, use_branch=(step + rank) % 3 != 0)
        torch.nn.functional.cross_entropy(logits, (tokens + 1) % 10).backward()
        optimizer.step()
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]
