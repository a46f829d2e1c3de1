"""Optimizers that need whole params (torch's Muon and Adafactor, a class that declares it)
under ShardingStage1 on 1-3 gloo ranks, against the same optimizer in one process.

Muon is wrapped as its users run it: its matrices (``fc1``, ``fc2``, the head) in one wrapper,
every other param (biases, the scalar, the frozen one) in a second wrapper holding AdamW, both
attached to the same model.

Tolerances, measured (fp32, 10 steps of ``tests.harness.training``'s MLP and batches):
- Against one process over the whole batch: rtol=1e-6, atol=1e-7, as ``test_parity``. The ranks
  average per-slice mean grads, the reference takes one mean of the whole batch, so grads differ
  in the last bits; the largest difference measured was 3e-8 (2 and 3 ranks, every run; Muon
  casts each grad to bf16 for Newton-Schulz, where a last-bit difference could flip a
  rounding: it did not here).
- Against one process that computes each rank's slice grads and averages them as the
  reduction does (sum in rank order, then divide): bitwise, every world size and mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from sharded_opt import (
    OptimizerNeeds,
    ShardingConfig,
    ShardingStage1,
    Strategy,
    load_checkpoint,
    save_checkpoint,
)
from tests.harness.dist_helper import run_ranks
from tests.harness.training import batch, local_slice, make_model

RTOL, ATOL = 1e-6, 1e-7
STEPS = 10


@dataclass(frozen=True)
class Run:
    kind: str  # "muon_adamw", "adafactor" or "normalized_sgd"
    overlap: bool
    bucket_size_mb: float | None = None  # None: sized from the model
    degree: int | None = None


RUNS = {
    "muon_adamw_sync": Run("muon_adamw", overlap=False),
    "muon_adamw_overlap": Run("muon_adamw", overlap=True),
    "muon_adamw_small_buckets": Run("muon_adamw", overlap=True, bucket_size_mb=0.0005),
    "adafactor_sync": Run("adafactor", overlap=False),
    "adafactor_overlap": Run("adafactor", overlap=True),
    "adafactor_small_buckets": Run("adafactor", overlap=False, bucket_size_mb=0.0005),
    "declared_whole_param_class": Run("normalized_sgd", overlap=True),
}


class NormalizedSGD(torch.optim.Optimizer):
    """SGD on each param's grad divided by the whole param's grad norm: not element-wise, and
    declared so through the protocol a third-party class uses."""

    sharded_opt_needs = OptimizerNeeds(whole_params=True, param_cost=math.prod, state_per_param=True)

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad / param.grad.norm().clamp(min=1e-12), alpha=-group["lr"])


def make_optimizers(kind: str, model) -> list[torch.optim.Optimizer]:
    if kind == "muon_adamw":
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        return [
            torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01),
            torch.optim.AdamW(others, lr=1e-2, weight_decay=0.01),
        ]
    if kind == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01)]
    if kind == "normalized_sgd":
        return [NormalizedSGD(model.parameters(), lr=0.05)]
    raise ValueError(kind)


def _loss(model, inputs, targets) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(inputs), targets)


def train_sharded(run: Run, steps: int = STEPS, start: dict | None = None) -> dict:
    """This rank's slice of every batch through one wrapper per optimizer; ``start`` (model and
    plain optimizer state dicts after ``start["step"]`` steps) resumes from a plain run."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    optimizers = make_optimizers(run.kind, model)
    strategy = Strategy(
        sharding=ShardingConfig(
            enable_overlap=run.overlap, bucket_size_mb=run.bucket_size_mb, degree=run.degree
        )
    )
    wrappers = [ShardingStage1(o, strategy=strategy, model=model) for o in optimizers]
    first = 0
    if start is not None:
        model.load_state_dict(start["model"])
        for wrapper, state in zip(wrappers, start["optimizers"], strict=True):
            wrapper.load_state_dict(state)
        first = start["step"]
    for step in range(first, first + steps):
        inputs, targets = batch(step)
        for wrapper in wrappers:
            wrapper.zero_grad()
        _loss(model, local_slice(inputs, rank, world_size), local_slice(targets, rank, world_size)).backward()
        for wrapper in wrappers:
            wrapper.step()
    for wrapper in wrappers:
        wrapper.sync_params()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state_dicts": [w.state_dict() for w in wrappers],
        "state_bytes": [w.memory_bytes()["optimizer_state"] for w in wrappers],
    }


def train_all(runs: list[Run]) -> list[dict]:
    return [train_sharded(run) for run in runs]


def train_plain(kind: str, slices: int = 1, steps: int = STEPS, start_step: int = 0) -> dict:
    """The plain optimizers in one process; ``slices`` > 1 averages per-slice grads (sum in
    slice order, then divide), as the ranks' reduction does. One intra-op thread, as the ranks
    (``tests.harness.dist_helper``): a matmul's blocking, and so its rounding, follows the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_plain(kind, slices, steps, start_step)
    finally:
        torch.set_num_threads(threads)


def _train_plain(kind: str, slices: int, steps: int, start_step: int) -> dict:
    model = make_model()
    optimizers = make_optimizers(kind, model)
    params = list(model.parameters())
    snapshot = None
    for step in range(steps):
        if step == start_step and start_step:
            snapshot = _snapshot(model, optimizers, step)
        inputs, targets = batch(step)
        grads: list[list[torch.Tensor | None]] = []
        for index in range(slices):
            model.zero_grad()
            _loss(model, local_slice(inputs, index, slices), local_slice(targets, index, slices)).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in params])
        for position, param in enumerate(params):
            parts = [g[position] for g in grads if g[position] is not None]
            if parts:
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                param.grad = total / len(parts)
        for optimizer in optimizers:
            optimizer.step()
    return {
        "params": [p.detach().clone() for p in params],
        "state_dicts": [o.state_dict() for o in optimizers],
        "state_bytes": [_state_bytes(o) for o in optimizers],
        "snapshot": snapshot,
    }


def _snapshot(model, optimizers, step: int) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizers": [_clone(o.state_dict()) for o in optimizers],
        "step": step,
    }


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of state tensors of at least one dim, and of every state tensor but ``step``."""
    tensors = [
        (key, v)
        for state in optimizer.state.values()
        for key, v in state.items()
        if isinstance(v, torch.Tensor)
    ]
    return (
        sum(v.numel() * v.element_size() for _, v in tensors if v.dim() > 0),
        sum(v.numel() * v.element_size() for key, v in tensors if key != "step"),
    )


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda ws: f"world{ws}")
def sharded_runs(request) -> tuple[int, dict[str, list[dict]]]:
    world_size = request.param
    per_rank = run_ranks(train_all, world_size, list(RUNS.values()))
    return world_size, {name: [r[i] for r in per_rank] for i, name in enumerate(RUNS)}


def _assert_params(results: list[dict], expected: list[torch.Tensor], exact: bool) -> None:
    for rank, result in enumerate(results):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            if exact:
                assert torch.equal(got, want), f"rank {rank} param {index}: {(got - want).abs().max()}"
            else:
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"rank {rank} param {index}")


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_one_process_over_the_whole_batch(sharded_runs, name: str) -> None:
    _, results = sharded_runs
    _assert_params(results[name], train_plain(RUNS[name].kind)["params"], exact=False)


@pytest.mark.parametrize("name", list(RUNS))
def test_bitwise_equal_to_one_process_averaging_the_same_slices(sharded_runs, name: str) -> None:
    world_size, results = sharded_runs
    _assert_params(results[name], train_plain(RUNS[name].kind, slices=world_size)["params"], exact=True)


@pytest.mark.parametrize("name", ["muon_adamw_overlap", "adafactor_sync"])
def test_state_dict_is_torchs_own(sharded_runs, name: str) -> None:
    world_size, results = sharded_runs
    plain = train_plain(RUNS[name].kind, slices=world_size)["state_dicts"]
    for result in results[name]:
        for got, want in zip(result["state_dicts"], plain, strict=True):
            assert got["param_groups"] == want["param_groups"]
            assert got["state"].keys() == want["state"].keys()
            for index, state in want["state"].items():
                assert got["state"][index].keys() == state.keys()
                for key, value in state.items():
                    assert torch.equal(got["state"][index][key], value), (index, key)


@pytest.mark.parametrize("name", ["muon_adamw_overlap", "adafactor_sync"])
def test_state_per_rank_is_a_share_of_the_plain_optimizers(sharded_runs, name: str) -> None:
    """The ranks' Muon/Adafactor state adds up to the plain optimizer's, and no rank holds more
    than its 1/N share plus one param's state (whole params cannot be cut finer).
    ``memory_bytes`` leaves 0-dim tensors out (``step``, the 0-dim ``scale``'s Adafactor
    variance), hence a range for the sum."""
    world_size, results = sharded_runs
    plain_bytes, plain_with_scalars = train_plain(RUNS[name].kind)["state_bytes"][0]
    mine = [result["state_bytes"][0] for result in results[name]]
    assert plain_bytes <= sum(mine) <= plain_with_scalars
    largest = max(
        p.numel() * p.element_size()
        for g in make_optimizers(RUNS[name].kind, make_model())[0].param_groups
        for p in g["params"]
    )
    assert max(mine) <= plain_bytes / world_size + largest, (mine, plain_bytes)
    if world_size > 1:
        assert max(mine) < plain_bytes


def equal_matrices_state_bytes(kind: str) -> list[int]:
    """Optimizer state bytes of this rank after one step over 6 equal 32x32 matrices, and of
    the plain optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32, bias=False) for _ in range(6)))
    make = torch.optim.Muon if kind == "muon" else torch.optim.Adafactor
    plain = make(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    plain.step()
    wrapper = ShardingStage1(make(model.parameters()), model=model)
    model(torch.randn(4, 32)).sum().backward()
    wrapper.step()
    return [wrapper.memory_bytes()["optimizer_state"], _state_bytes(plain)[0]]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_state_per_rank_is_one_nth_for_equal_matrices(kind: str, world_size: int) -> None:
    results = run_ranks(equal_matrices_state_bytes, world_size, kind)
    plain = results[0][1]
    assert [mine for mine, _ in results] == [plain // world_size] * world_size


def test_all_ranks_hold_identical_params(sharded_runs) -> None:
    _, results = sharded_runs
    for name in RUNS:
        first = results[name][0]["params"]
        for result in results[name][1:]:
            assert all(torch.equal(a, b) for a, b in zip(result["params"], first, strict=True)), name


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["muon_adamw", "adafactor"])
def test_plain_state_dict_loads_into_the_wrapper_and_training_continues(world_size: int, kind: str) -> None:
    """A plain torch Muon/Adafactor state dict (after 4 steps) loads into wrappers on N ranks,
    which then train on to the plain run's result, bitwise."""
    plain = train_plain(kind, slices=world_size, steps=STEPS, start_step=4)
    run = Run(kind, overlap=True, bucket_size_mb=0.0005)
    results = run_ranks(train_sharded, world_size, run, STEPS - 4, plain["snapshot"])
    _assert_params(results, plain["params"], exact=True)


def test_hybrid_sharding_degree_two_on_four_ranks() -> None:
    """Shard groups of 2 ranks, replicated twice: whole params per owner inside each group."""
    runs = [Run("muon_adamw", overlap=True, degree=2), Run("adafactor", overlap=False, degree=2)]
    per_rank = run_ranks(train_all, 4, runs)
    for index, run in enumerate(runs):
        _assert_params([r[index] for r in per_rank], train_plain(run.kind, slices=4)["params"], exact=False)


def test_a_class_that_declares_nothing_is_refused_naming_both_kinds() -> None:
    class Sign(torch.optim.Optimizer):
        def __init__(self, params) -> None:
            super().__init__(params, {})

    with pytest.raises(TypeError) as raised:
        ShardingStage1(Sign([torch.nn.Parameter(torch.ones(2, 2))]))
    message = str(raised.value)
    for supported in ("AdamW", "Muon", "Adafactor", "assume_elementwise=True", "Sign.sharded_opt_needs ="):
        assert supported in message, supported


def test_a_declaration_that_is_not_optimizer_needs_is_refused() -> None:
    class Declared(NormalizedSGD):
        sharded_opt_needs = "whole_params"

    with pytest.raises(
        TypeError, match="Declared.sharded_opt_needs to be a sharded_opt.OptimizerNeeds but got str"
    ):
        ShardingStage1(Declared([torch.nn.Parameter(torch.ones(2, 2))]))


def save_after_training(run: Run, path: str) -> dict:
    """Train ``STEPS`` steps, save a DCP checkpoint, return the state dicts saved."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    strategy = Strategy(
        sharding=ShardingConfig(enable_overlap=run.overlap, bucket_size_mb=run.bucket_size_mb)
    )
    (wrapper,) = [ShardingStage1(o, strategy=strategy, model=model) for o in make_optimizers(run.kind, model)]
    for step in range(STEPS):
        inputs, targets = batch(step)
        wrapper.zero_grad()
        _loss(model, local_slice(inputs, rank, world_size), local_slice(targets, rank, world_size)).backward()
        wrapper.step()
    save_checkpoint(path, model, wrapper)
    return wrapper.state_dict()


def load_saved(run: Run, path: str) -> dict:
    model = make_model()
    strategy = Strategy(
        sharding=ShardingConfig(enable_overlap=run.overlap, bucket_size_mb=run.bucket_size_mb)
    )
    (wrapper,) = [ShardingStage1(o, strategy=strategy, model=model) for o in make_optimizers(run.kind, model)]
    load_checkpoint(path, model, wrapper)
    return wrapper.state_dict()


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(3, 2), (1, 3)])
@pytest.mark.parametrize("kind", ["adafactor", "normalized_sgd"])
def test_checkpoint_reshards(tmp_path, kind: str, saved_on: int, loaded_on: int) -> None:
    """A DCP checkpoint of whole-param state (Adafactor's row and column factors included) saved
    on N ranks loads on M, each param's state on its new owner."""
    run = Run(kind, overlap=True, bucket_size_mb=0.0005)
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_after_training, saved_on, run, path)[0]
    for loaded in run_ranks(load_saved, loaded_on, run, path):
        assert loaded["param_groups"] == saved["param_groups"]
        assert loaded["state"].keys() == saved["state"].keys()
        for index, state in saved["state"].items():
            for key, value in state.items():
                assert torch.equal(loaded["state"][index][key], value), (index, key)


def wrap_muon_over_a_complex_matrix() -> str:
    try:
        ShardingStage1(torch.optim.Muon([torch.nn.Parameter(torch.ones(2, 3, dtype=torch.complex64))]))
    except ValueError as error:
        return str(error)
    return "no error"


def test_what_muon_refuses_only_in_step_is_refused_when_wrapping() -> None:
    """Muon raises for complex params only in ``step()``, which only the owner runs: the other
    ranks would wait in the all-gather. Note [Refused at the first step] probes a 2x2 matrix."""
    (message,) = run_ranks(wrap_muon_over_a_complex_matrix, 1)
    assert "cannot step torch.complex64 params on cpu" in message
    assert "Muon does not support complex parameters" in message
