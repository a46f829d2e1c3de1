"""Where a step's time goes under ``--optimizer muon``: communication, Newton-Schulz and the
rest, measured on each rank's training thread inside the timed blocks of every mode.

* **Newton-Schulz**: the time in torch's ``_zeropower_via_newtonschulz`` (``torch.optim._muon``),
  which ``Muon.step`` calls once per matrix (torch 2.13). A wrapper around it adds up the
  seconds, the calls and the work (``newton_schulz_cost`` of each matrix's shape, what the
  layout balances owners by). Under ``ShardingStage1`` it runs on each matrix's owner only, so
  it differs between ranks; under DDP every rank orthogonalizes every matrix.
* **Communication**, ``ShardingStage1`` modes: the time in the wrappers' calls that issue or
  wait for a collective (``Bucket``: each bucket's reduce-scatter and all-gather;
  ``GradPresence``: the grad-presence flags' all-reduce), all made on the training thread: the
  waits are what communication added to the step that nothing hid, the rest the cost of
  issuing. The classes are instrumented before any runner is built, since a wrapper keeps a
  bound method of its communicator for its forward waits.
* **Communication**, DDP: from the moment the last param's grad was accumulated to the start
  of ``optimizer.step()``: DDP's copy and launch of its last bucket, its wait for every bucket's
  all-reduce, its copy of the averaged grads back. Its earlier buckets' copies and launches,
  during backward, are not in it (they fall in the rest).
* **The rest**: step time minus both: forward, backward, AdamW, Muon's momentum and update, the
  wrapper's own work, and the slowdown of compute by gloo's threads on the same cores.

CPU ranks (gloo) only: on an accelerator the host waits neither for collectives nor for the
Newton-Schulz kernels, so host times would not say where the device's time goes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.optim._muon as muon_module
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from sharded_opt.guards.optimizer_needs import newton_schulz_cost
from sharded_opt.step import grad_presence
from sharded_opt.step.bucket import Bucket

SPLIT_KEYS = ("comm_s", "newton_schulz_s", "newton_schulz_calls", "newton_schulz_work")
"""What a :class:`StepClock` adds up, per rank, over the run."""

NEWTON_SCHULZ = "_zeropower_via_newtonschulz"
"""The function of ``torch.optim._muon`` that orthogonalizes one matrix."""

COMM_METHODS: tuple[tuple[type, str], ...] = (
    *((Bucket, name) for name in ("start_grad_sync", "finish_grad_sync")),
    *((Bucket, name) for name in ("start_param_sync", "finish_param_sync")),
    (grad_presence.GradPresence, "start"),
    (grad_presence._FlagsAllReduce, "values"),  # the flags' wait; private, as the class
)
"""Every call through which a wrapper issues or waits for a collective during training."""


class StepClock:
    """Totals of :data:`SPLIT_KEYS` on this rank's training thread; a timed block reads them
    before and after itself. Built by :func:`step_clock`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(SPLIT_KEYS, 0.0)
        self._in_comm = False

    def read(self) -> dict[str, float]:
        return dict(self.totals)

    def timed_comm(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` charging its time to communication (outermost call only)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._in_comm:
                return method(*args, **kwargs)
            self._in_comm = True
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.totals["comm_s"] += time.perf_counter() - start
                self._in_comm = False

        return timed

    def timed_newton_schulz(self, function: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def timed(grad: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            start = time.perf_counter()
            result = function(grad, *args, **kwargs)
            self.totals["newton_schulz_s"] += time.perf_counter() - start
            self.totals["newton_schulz_calls"] += 1
            self.totals["newton_schulz_work"] += newton_schulz_cost(tuple(grad.shape))
            return result

        return timed

    def watch_ddp(
        self, model: torch.nn.Module, forward: torch.nn.Module, first: torch.optim.Optimizer
    ) -> None:
        """Charge DDP's exposed all-reduce to communication: the time from the last grad
        accumulated into ``model``'s params to the start of ``first.step()`` (see the module
        docstring). Nothing is watched when ``forward`` is not DDP (one rank)."""
        if not isinstance(forward, DistributedDataParallel):
            return
        last_grad = [0.0]

        def grad_ready(_param: Tensor) -> None:
            last_grad[0] = time.perf_counter()

        def step_starts(*_args: Any) -> None:
            self.totals["comm_s"] += time.perf_counter() - last_grad[0]

        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(grad_ready)
        first.register_step_pre_hook(step_starts)


@contextlib.contextmanager
def step_clock() -> Iterator[StepClock]:
    """Instrument Newton-Schulz and the wrappers' communicator in this process while inside;
    build the runners inside too (see the module docstring)."""
    if not hasattr(muon_module, NEWTON_SCHULZ):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.optim._muon.{NEWTON_SCHULZ}: the Newton-Schulz "
            "time cannot be measured; update benchmarks/step_split.py to this torch's Muon"
        )
    clock = StepClock()
    with contextlib.ExitStack() as stack:
        original = getattr(muon_module, NEWTON_SCHULZ)
        stack.enter_context(
            mock.patch.object(muon_module, NEWTON_SCHULZ, clock.timed_newton_schulz(original))
        )
        for owner, name in COMM_METHODS:
            stack.enter_context(mock.patch.object(owner, name, clock.timed_comm(getattr(owner, name))))
        yield clock


def block_split(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Per step of a block of ``steps`` steps, what the clock added up during it."""
    return {key: (after[key] - before[key]) / steps for key in SPLIT_KEYS}
