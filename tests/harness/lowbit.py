"""The model, data and loops of the low-bit optimizer tests (torchao's quantized Adam(W) under
ShardingStage1 against the same class in one process): ``tests/parity/test_lowbit_optimizers.py``,
``tests/parity/test_lowbit_combinations.py`` and ``tests/checkpoint/test_lowbit_checkpoint.py``.

One model for all of them: torchao compiles its step per tensor shape and dtype (tens of seconds
the first time on a loaded 2-core CPU; inductor's on-disk cache keeps them), so every run that
steps the same pieces in fp32 (masters included) reuses what the first one compiled.

The model holds every kind of param the cut rules tell apart: a weight of 32768 elements
(quantized, cut on its blocks on 2 and 3 ranks), weights of 4352 and 4096 (quantized, too small
to cut: whole in one shard), a gain of 4097 (4096 or more but not whole blocks: plain state,
whole in one shard) and small biases (plain state, cut anywhere).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardedGradScaler, ShardingConfig, ShardingStage1, Strategy
from tests.harness.dist_helper import run_ranks

STEPS = 10
RESUME_AT = 6
BATCH, FEATURES = 12, 32
INF_STEP = 3
"""With a grad scaler, the step whose last sample holds an inf (in the last rank's slice)."""
INIT_SCALE = 2.0**8


class LowBitModel(nn.Module):
    def __init__(self, tail_numel: int = 0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 1024)  # weight 32768: quantized, cut on blocks on 2 and 3 ranks
        self.fc2 = nn.Linear(1024, 17)  # weight 17408: quantized, may be cut
        self.fc3 = nn.Linear(17, 256, bias=False)  # 4352: quantized, too small to cut: whole
        self.fc4 = nn.Linear(256, 16)  # 4096: quantized (the threshold itself), whole
        self.head = nn.Linear(16, 2)
        self.gain = nn.Parameter(torch.ones(4097))  # 4096 or more, not whole blocks: plain, whole
        # bitsandbytes quantizes a param whatever its last block: one with a partial last block
        # that is long enough to be cut (none for torchao, so its compiled shapes stay the same).
        self.tail = nn.Parameter(torch.linspace(0.5, 1.5, tail_numel)) if tail_numel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        out = self.head(torch.tanh(self.fc4(torch.relu(self.fc3(hidden))))) * self.gain.mean()
        return out if self.tail is None else out * self.tail.square().mean()


@dataclass(frozen=True)
class Run:
    """One sharded training of the model and what its reference does alike.

    Attributes:
        cls: the torchao class, by name; ``bnb.<name>``: bitsandbytes' class.
        overlap: ``ShardingConfig(enable_overlap=...)``.
        param_dtype: the model's dtype (the loss is computed in fp32).
        master_dtype: ``ShardingConfig(master_dtype=...)``; the reference steps masters of it.
        clip_norm: clip the averaged grads to this global norm before every step.
        scaler: a ``ShardedGradScaler`` (the reference: ``torch.amp.GradScaler``) from
            ``INIT_SCALE``, with an inf in the last sample of step ``INF_STEP``.
        degree: ``ShardingConfig(degree=...)``, hybrid sharding; the reference averages the
            slices of each shard group, then the groups' means.
    """

    cls: str
    overlap: bool = False
    param_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype | None = None
    clip_norm: float | None = None
    scaler: bool = False
    degree: int | None = None

    @property
    def tail_numel(self) -> int:
        """bitsandbytes' runs add a 20000-element param (78 blocks and a partial one), cut on 2 and
        3 ranks."""
        return BNB_TAIL_NUMEL if self.cls.startswith(BNB_PREFIX) else 0


BNB_PREFIX = "bnb."
BNB_TAIL_NUMEL = 20000


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0, tail_numel: int = 0) -> LowBitModel:
    torch.manual_seed(seed)
    return LowBitModel(tail_numel).to(dtype)


def make_optimizer(cls: str, params, **kwargs) -> torch.optim.Optimizer:
    """torchao's class named ``cls`` (bitsandbytes' for ``bnb.<name>``) over ``params``, with the
    tests' settings (the package is imported here, so a test module can skip first when it is
    missing)."""
    if cls.startswith(BNB_PREFIX):
        import bitsandbytes.optim as module
    else:
        import torchao.optim as module
    return getattr(module, cls.removeprefix(BNB_PREFIX))(params, lr=1e-2, weight_decay=0.05, **kwargs)


def batch(step: int, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(BATCH, FEATURES, generator=generator).to(run.param_dtype)
    targets = torch.randn(BATCH, 2, generator=generator)
    if run.scaler and step == INF_STEP:
        inputs[-1, 0] = float("inf")
    return inputs, targets


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(inputs).float(), targets)


def train_sharded(run: Run, start: bytes | None = None) -> dict:
    """This rank's slice of every batch; ``start`` (a plain run's model and optimizer state
    dicts after ``RESUME_AT`` steps, saved by ``torch.save``) resumes from there. Returns the
    params, the state dict (saved), the state's bytes and the clipped norms."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(run.param_dtype, tail_numel=run.tail_numel)
    sharding = ShardingConfig(enable_overlap=run.overlap, master_dtype=run.master_dtype, degree=run.degree)
    opt = ShardingStage1(
        make_optimizer(run.cls, model.parameters()), strategy=Strategy(sharding=sharding), model=model
    )
    scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE) if run.scaler else None
    first = 0
    if start is not None:
        saved = torch.load(io.BytesIO(start), weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        first = RESUME_AT
    size = BATCH // world_size
    norms = []
    for step in range(first, STEPS):
        inputs, targets = batch(step, run)
        opt.zero_grad()
        part = slice(rank * size, (rank + 1) * size)
        loss = loss_of(model, inputs[part], targets[part])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            continue
        loss.backward()
        if run.clip_norm is not None:
            norms.append(opt.clip_grad_norm_(run.clip_norm))
        opt.step()
    opt.sync_params()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state_dict": buffer.getvalue(),
        "state_bytes": opt.memory_bytes()["optimizer_state"],
        "norms": norms,
        "scale": None if scaler is None else scaler.get_scale(),
    }


def train_all(runs: list[Run], resumed: Run, start: bytes) -> list[dict]:
    """On this rank, :func:`train_sharded` of each of ``runs``, then ``resumed`` from ``start``."""
    return [train_sharded(run) for run in runs] + [train_sharded(resumed, start)]


def spawn_runs(
    runs: dict[str, Run], snapshot_of: Run, resumed: Run, world_size: int
) -> dict[str, list[dict]]:
    """Per name, each rank's result of ``runs`` on ``world_size`` ranks (one spawn for all), and
    as ``"resumed_from_plain"`` the ranks' results of ``resumed`` started from the plain run of
    ``snapshot_of``'s snapshot."""
    start = train_plain(snapshot_of, slices=world_size)["snapshot"]
    per_rank = run_ranks(train_all, world_size, list(runs.values()), resumed, start)
    names = [*runs, "resumed_from_plain"]
    return {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


def sharded_runs_fixture(runs: dict[str, Run]) -> Callable:
    """A test module's ``sharded_runs`` fixture: ``(world_size, spawn_runs(...))`` on 2 and 3
    ranks, resuming the ``"adamw8bit_overlap"`` run from the ``"adamw8bit_sync"`` snapshot."""

    @pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"world{ws}")
    def sharded_runs(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[dict]]]:
        world_size = request.param
        return world_size, spawn_runs(runs, runs["adamw8bit_sync"], runs["adamw8bit_overlap"], world_size)

    return sharded_runs


def assert_params_equal(results: list[dict], expected: list[torch.Tensor]) -> None:
    """Every rank's params are bitwise ``expected``."""
    for rank, result in enumerate(results):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert torch.equal(got, want), f"rank {rank} param {index}: {(got - want).abs().max()}"


def train_plain(run: Run, slices: int = 1, norms: list | None = None, start: dict | None = None) -> dict:
    """The plain class in one process, as the sharded ``run`` trains. ``slices`` > 1 averages
    per-slice grads in fp32 as the ranks' reduction does (sum in slice order, then divide; with
    ``run.degree``, the mean of each group of ``degree`` slices, then the mean of the means).
    With ``run.master_dtype`` it steps master copies and casts them back into the params. With
    ``run.clip_norm``, ``norms`` (the sharded run's global norms) clip the grads, so that the
    norm's summation order, the only thing that differs, stays out of the comparison; None
    clips by torch's own norm. Saves the model and optimizer after ``RESUME_AT`` steps
    (``"snapshot"``, what ``train_sharded`` resumes from); ``start`` (such a snapshot, loaded)
    resumes from there instead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(run.param_dtype, tail_numel=run.tail_numel)
        params = list(model.parameters())
        masters = params
        if run.master_dtype is not None:
            masters = [p.detach().to(run.master_dtype).requires_grad_(True) for p in params]
        opt = make_optimizer(run.cls, masters)
        if start is not None:
            model.load_state_dict(start["model"])
            opt.load_state_dict(start["optimizer"])
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if run.scaler else None
        snapshot, torch_norms = None, []
        for step in range(RESUME_AT if start is not None else 0, STEPS):
            if step == RESUME_AT and start is None:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
                snapshot = buffer.getvalue()
            grads = _slice_grads(model, batch(step, run), slices, scaler)
            averages = [_average([g[i] for g in grads], run.degree or slices) for i in range(len(params))]
            for master, average in zip(masters, averages, strict=True):
                master.grad = average.to(master.dtype)
            if run.clip_norm is not None:
                torch_norms.append(torch.nn.utils.get_total_norm([m.grad for m in masters]))
                norm = torch_norms[-1] if norms is None else norms[step]
                torch.nn.utils.clip_grads_with_norm_(masters, run.clip_norm, norm)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            with torch.no_grad():
                for param, master in zip(params, masters, strict=True):
                    if master is not param:
                        param.copy_(master)
        return {
            "params": [p.detach().clone() for p in params],
            "optimizer": opt,
            "snapshot": snapshot,
            "norms": torch_norms,
            "scale": None if scaler is None else scaler.get_scale(),
        }
    finally:
        torch.set_num_threads(threads)


def _slice_grads(
    model: nn.Module,
    data: tuple[torch.Tensor, torch.Tensor],
    slices: int,
    scaler: torch.amp.GradScaler | None,
) -> list[list[torch.Tensor]]:
    """Each slice's grads of every param, in the params' dtype (of the scaled loss with a scaler)."""
    inputs, targets = data
    size = BATCH // slices
    grads = []
    for index in range(slices):
        model.zero_grad()
        part = slice(index * size, (index + 1) * size)
        loss = loss_of(model, inputs[part], targets[part])
        (loss if scaler is None else scaler.scale(loss)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def _average(grads: list[torch.Tensor], degree: int) -> torch.Tensor:
    """The mean in fp32 of each group of ``degree`` consecutive slices' grads (summed in slice
    order, then divided), then of the groups' means: the reduce-scatter over a shard group, then
    the all-reduce over the replicas (none without hybrid sharding)."""
    means = []
    for first in range(0, len(grads), degree):
        total = grads[first].float()
        for grad in grads[first + 1 : first + degree]:
            total = total + grad.float()
        means.append(total / degree)
    if len(means) == 1:
        return means[0]
    total = means[0]
    for mean in means[1:]:
        total = total + mean
    return total / len(means)


CODE_BOOK_NAMES = ("qmap", "qmap1", "qmap2")
"""torchao's code book (an inner tensor of each quantized value), bitsandbytes' (state keys)."""


def code_book_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """The bytes of the distinct code books (by content) in ``optimizer``'s state, and the
    bytes its code-book tensors really hold (torchao: one per quantized value; bitsandbytes:
    one tensor for all params)."""
    distinct: dict[bytes, int] = {}
    held: dict[int, int] = {}
    for state in optimizer.state.values():
        books = [state.get(name) for name in CODE_BOOK_NAMES]
        books += [getattr(value, "qmap", None) for value in state.values()]
        for book in books:
            if isinstance(book, torch.Tensor) and book.dim():
                nbytes = book.numel() * book.element_size()
                distinct[book.numpy().tobytes()] = nbytes
                held[book.untyped_storage().data_ptr()] = nbytes
    return sum(distinct.values()), sum(held.values())


def assert_state_is_shared_out(results: list[dict], plain: torch.optim.Optimizer, slack: int) -> None:
    """The ranks' state bytes (``memory_bytes()``) against the plain class's: every code and
    scale and every plain moment's element on exactly one rank (no state for padding, none
    twice), one set of code books per rank (Note [Shared code books]), and each rank within
    ``slack`` bytes of its 1/N share."""
    from sharded_opt.step.quantized_state import states_nbytes

    books, plain_books = code_book_bytes(plain)
    per_element = states_nbytes(plain.state.values()) - plain_books
    world_size = len(results)
    assert sum(r["state_bytes"] for r in results) == per_element + world_size * books
    for rank, result in enumerate(results):
        share = per_element / world_size + books
        assert result["state_bytes"] <= share + slack, (rank, result["state_bytes"], share, slack)


def assert_same_state(got: dict, want: dict) -> None:
    """Two optimizer state dicts are equal bitwise: param groups, keys, and every plain tensor
    or quantized value's inner tensors (codes, scales, code book) and attributes; nested dicts
    (bitsandbytes' ``__bnb_optimizer_quant_state__``) and Python scalars (its ``step``) alike."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        _assert_same_entry(got["state"][index], state, (index,))


def _assert_same_entry(got: dict, want: dict, where: tuple) -> None:
    assert got.keys() == want.keys(), where
    for key, value in want.items():
        mine = got[key]
        assert type(mine) is type(value), (*where, key)
        if isinstance(value, dict):
            _assert_same_entry(mine, value, (*where, key))
            continue
        if not isinstance(value, torch.Tensor):
            assert mine == value, (*where, key)
            continue
        assert mine.shape == value.shape and mine.dtype == value.dtype, (*where, key)
        if type(value) is torch.Tensor:
            assert torch.equal(mine, value), (*where, key)
            continue
        names, attributes = value.__tensor_flatten__()
        assert mine.__tensor_flatten__()[1] == attributes, (*where, key)
        for name in names:
            assert torch.equal(getattr(mine, name), getattr(value, name)), (*where, key, name)
