"""The harness of the user-loop tests (``tests/loops/``, also used by
``tests/semantics/test_param_kinds.py`` and ``tests/semantics/test_optimizer_surface.py``).

Each loop is written once against a :class:`Loop`, which is either sharded (this rank's slice of
every batch, the wrapper) or plain (every slice in turn, its grads averaged in rank order as the
wrapper's reduction sums them, see ``tests/harness/differential.py``). Both runs happen in every rank, and
all loops of a module run in one spawn (:func:`loop_outcome_fixtures`). The comparison
(:func:`assert_matches_plain`) is bitwise where nothing but the averaging differs; the global norm
of ``clip_grad_norm_`` sums per shard, so clipped loops use the fp32 bound of
``tests/parity/test_differential.py``.

:class:`BufferLoop` treats module buffers as DDP does, :class:`ModelFreeLoop` wraps without
``model=``, and :func:`_late_all_gather` makes all-gathers land only when waited for, so any read
of params that does not wait sees last step's weights.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.comm import collectives
from tests.harness.differential import _add, _average, _zeros_like
from tests.harness.dist_helper import run_ranks

FP32_TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}
"""The fp32 bound of ``tests/parity/test_differential.py`` (its tolerance paragraph)."""
SLICE = 4
"""Samples per rank and batch."""


class Loop:
    """One run of a loop: ``sharded`` (this rank's slice, the wrapper) or plain (every slice)."""

    def __init__(self, sharded: bool, overlap: bool, bucket_size_mb: float | None = 0.002) -> None:
        self.sharded = sharded
        self.overlap = overlap
        self.bucket_size_mb = bucket_size_mb
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._sums: dict[int, list[torch.Tensor | None]] = {}

    def slices(self) -> list[int]:
        return [self.rank] if self.sharded else list(range(self.world_size))

    def wrap(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        if not self.sharded:
            return optimizer
        strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=self.bucket_size_mb))
        return ShardingStage1(optimizer, overlap=self.overlap, strategy=strategy, model=model)

    def backward(
        self,
        opt: torch.optim.Optimizer,
        params: list[nn.Parameter],
        loss_of: Callable[[int], torch.Tensor],
        no_sync: bool = False,
        retain_graph: bool = False,
    ) -> None:
        """Backward of ``loss_of(slice)``: the own slice when sharded; every slice when plain,
        each slice's grads summed over micro-batches and averaged over slices in rank order."""
        if self.sharded:
            with opt.no_sync() if no_sync else contextlib.nullcontext():
                loss_of(self.rank).backward(retain_graph=retain_graph)
            return
        for index in range(self.world_size):
            for p in params:
                p.grad = None
            loss_of(index).backward(retain_graph=retain_graph)
            sums = self._sums.setdefault(index, [None] * len(params))
            self._sums[index] = [_add(s, p.grad) for s, p in zip(sums, params, strict=True)]
        for i, p in enumerate(params):
            p.grad = _average([self._sums[r][i] for r in range(self.world_size)], p.dtype, self.world_size)

    def zero_grad(self, opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        opt.zero_grad(set_to_none=set_to_none)
        if not self.sharded:
            if set_to_none:
                self._sums = {}
            else:
                self._sums = {r: [_zeros_like(s) for s in sums] for r, sums in self._sums.items()}

    def clip(self, opt: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        if self.sharded:
            return opt.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def sync(self, opt: torch.optim.Optimizer) -> None:
        if self.sharded:
            opt.sync_params()


def _snapshot(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _both(loop_fn: Callable[[Loop], object], **kwargs) -> dict[str, object]:
    """``loop_fn`` plain, sharded sync and sharded overlap on this rank."""
    return {
        "plain": loop_fn(Loop(False, False, **kwargs)),
        "sync": loop_fn(Loop(True, False, **kwargs)),
        "overlap": loop_fn(Loop(True, True, **kwargs)),
    }


# -- all-gathers that land late, loops that keep buffers as DDP does --------------------------


class _LandsOnWait:
    """An all-gather whose result reaches the params only when waited for: the latest a real
    all-gather may land, so a write racing with it loses deterministically."""

    def __init__(self, work, staging: torch.Tensor, output: torch.Tensor) -> None:
        self._work, self._staging, self._output = work, staging, output

    def wait(self) -> bool:
        self._work.wait()
        self._output.copy_(self._staging)
        return True


def _late_all_gather(output, input, group, async_op, point_to_point=False):
    """``collectives.all_gather`` whose result lands only when waited for (:class:`_LandsOnWait`);
    patched in with ``mock.patch.object(collectives, "all_gather", _late_all_gather)``."""
    staging = torch.empty_like(output)
    work = collectives._all_gather(staging, input.clone(), group=group, async_op=True)
    return _LandsOnWait(work, staging, output)


def _late_gathers(loop_fn: Callable[[Loop], object], **kwargs) -> dict[str, object]:
    with mock.patch.object(collectives, "all_gather", _late_all_gather):
        return _both(loop_fn, **kwargs)


class BufferLoop(Loop):
    """:class:`Loop` whose plain run treats module buffers as DDP does (each slice's forward
    starts from the buffers rank 0 ended the previous forward with), and whose backward takes
    ``inputs=`` as ``Tensor.backward`` does."""

    def backward(  # type: ignore[override]
        self,
        opt: torch.optim.Optimizer,
        params: list[nn.Parameter],
        loss_of: Callable[[int], torch.Tensor],
        no_sync: bool = False,
        retain_graph: bool = False,
        inputs: list[torch.Tensor] | None = None,
        module: nn.Module | None = None,
    ) -> None:
        self._params = params
        if self.sharded:
            with opt.no_sync() if no_sync else contextlib.nullcontext():
                loss_of(self.rank).backward(retain_graph=retain_graph, inputs=inputs)
            return
        buffers = [] if module is None else list(module.buffers())
        start = [b.clone() for b in buffers]
        after_first: list[torch.Tensor] = []
        for index in range(self.world_size):
            with torch.no_grad():
                for b, s in zip(buffers, start, strict=True):
                    b.copy_(s)
            for p in params:
                p.grad = None
            loss_of(index).backward(retain_graph=retain_graph, inputs=inputs)
            if index == 0:
                after_first = [b.clone() for b in buffers]
            sums = self._sums.setdefault(index, [None] * len(params))
            self._sums[index] = [_add(s, p.grad) for s, p in zip(sums, params, strict=True)]
        with torch.no_grad():
            for b, first in zip(buffers, after_first, strict=True):
                b.copy_(first)
        for i, p in enumerate(params):
            p.grad = _average([self._sums[r][i] for r in range(self.world_size)], p.dtype, self.world_size)

    def zero_grad(self, opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Zero ``opt``'s grads; in the plain run also only its params' per-slice sums (another
        optimizer over other params of the model keeps accumulating)."""
        opt.zero_grad(set_to_none=set_to_none)
        if self.sharded or not self._sums:
            return
        own = {id(p) for group in opt.param_groups for p in group["params"]}
        for sums in self._sums.values():
            for i, p in enumerate(self._params):
                if id(p) in own:
                    sums[i] = None if set_to_none or sums[i] is None else torch.zeros_like(sums[i])


class ModelFreeLoop(BufferLoop):
    """A :class:`BufferLoop` whose wrapper is built without ``model=`` (waits in ``step()``)."""

    def wrap(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        return super().wrap(optimizer, None)


# -- a small model, its data and loss -----------------------------------------------------------


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 12)
        self.norm = nn.BatchNorm1d(12)
        self.last = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.norm(self.first(x))))


def _xy(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * step + index)
    return torch.randn(SLICE, 6, generator=generator), torch.randn(SLICE, 2, generator=generator)


def _mse(model: nn.Module, step: int) -> Callable[[int], torch.Tensor]:
    """The loss of slice ``index`` of batch ``step``."""
    return lambda index: F.mse_loss(model(_xy(step, index)[0]), _xy(step, index)[1])


def _average_grads(params: list[nn.Parameter]) -> None:
    """Grads all-reduced and averaged by hand, as for an optimizer left unwrapped."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


# -- running the jobs of a module, comparing with plain torch --------------------------------


def run_loop_jobs(jobs: dict[str, Callable[[], object]], names: tuple[str, ...] | None) -> dict[str, object]:
    """Run ``jobs`` (only ``names`` if given) on this rank; a job that raises is reported by
    its test as the error and its traceback, the others still run."""
    results: dict[str, object] = {}
    for name, job in jobs.items():
        if names is not None and name not in names:
            continue
        try:
            results[name] = job()
        except Exception as error:  # noqa: BLE001 - reported per loop by its test
            results[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    return results


def loop_outcome_fixtures(
    run_all: Callable[..., dict[str, object]], three_rank_jobs: tuple[str, ...]
) -> tuple[Callable[[], list[dict[str, object]]], Callable[[], list[dict[str, object]]]]:
    """A user-loop module's two module-scoped fixtures, ``outcomes`` and ``outcomes_on_three``:
    every job of ``run_all`` (a module-level function, so ranks can import it) on 2 ranks in one
    spawn, and ``three_rank_jobs`` on 3 ranks in another."""

    @pytest.fixture(scope="module")
    def outcomes() -> list[dict[str, object]]:
        return run_ranks(run_all, 2)

    @pytest.fixture(scope="module")
    def outcomes_on_three() -> list[dict[str, object]]:
        return run_ranks(run_all, 3, three_rank_jobs)

    return outcomes, outcomes_on_three


def assert_matches_plain(outcomes: list[dict[str, object]], name: str) -> None:
    for rank, results in enumerate(outcomes):
        result = results[name]
        assert not isinstance(result, str), f"rank {rank}: {result}"
        for mode in [m for m in result if m != "plain"]:
            where = f"rank {rank}, {mode}"
            torch.testing.assert_close(
                result[mode], result["plain"], **FP32_TOLERANCE, msg=lambda m, where=where: f"{where}: {m}"
            )
