"""``ShardingStage1``: ZeRO stage 1 around an existing ``torch.optim`` optimizer."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from fusion.buffers import FlatBuffers
from fusion.layout import LayoutPlan, plan_layout
from sharded_opt import state_dict as state_dict_conversion
from sharded_opt.bucket_comm import BucketCommunicator, resolve_precision
from sharded_opt.collective_guard import check_all_ranks_enter
from sharded_opt.grad_hooks import GradReadyTracker
from sharded_opt.inner_optimizer import (
    bucket_state,
    build_inner_optimizer,
    chunk_local_tensor,
    load_bucket_states,
)
from sharded_opt.param_hooks import ParamReadyWaiter
from sharded_opt.strategy import Strategy
from sharded_opt.validation import (
    check_optimizer,
    check_same_layout,
    collect_params,
    resolve_process_group,
)


class ShardingStage1(torch.optim.Optimizer):
    """Shard an optimizer's state over the ranks of a process group (ZeRO stage 1).

    The user's params are moved into flat, aligned buckets (their ``.data`` and ``.grad``
    become views; values are unchanged). Each rank keeps optimizer state only for its 1/N slice
    of every bucket: ``step()`` averages the grads over the group with one reduce-scatter per
    bucket, runs the wrapped optimizer's algorithm on the local slice only, and all-gathers the
    updated slices back into every rank's params. Communication volume equals DDP's all-reduce;
    optimizer state memory drops from S to S/N per rank.

    Args:
        optimizer: an already built optimizer of an element-wise algorithm (SGD, Adam, AdamW,
            ...). Its param groups and hyperparameters are taken over; use the wrapper from then
            on (the original refuses to step).
        overlap: overrides ``strategy.sharding.enable_overlap``. With overlap, each bucket's
            reduce-scatter starts during backward as soon as its grads are complete, and (with a
            model attached) the all-gather of later layers runs during the next forward.
        strategy: a :class:`Strategy`; default ``Strategy()``. It is copied, so later changes
            to the object do not affect this wrapper.
        process_group: ranks to shard over; default the whole world.
        model: the module that owns the params. In overlap mode its modules then wait for
            their own params only, see :meth:`attach`.
        assume_elementwise: accept an optimizer class not known to be element-wise, on the
            caller's word that each element's update depends only on its own grad and state.

    Raises:
        TypeError: ``optimizer`` is not a supported ``torch.optim.Optimizer``; bad argument types.
        ValueError: no trainable params, duplicate or sparse params, params on several devices,
            ranks with different params, an optimizer that already stepped or is already wrapped.
        RuntimeError: no initialized process group.

    Grads: ``param.grad`` stays a view of the flat grad buffer and holds this rank's local
    (not averaged) grad; the averaged grad of the local shard is what the optimizer steps.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        overlap: bool | None = None,
        strategy: Strategy | None = None,
        process_group: ProcessGroup | None = None,
        model: nn.Module | None = None,
        assume_elementwise: bool = False,
    ) -> None:
        config = _resolve_config(strategy, overlap)
        check_optimizer(optimizer, assume_elementwise)
        _check_not_stepped(optimizer)
        params, specs = collect_params(optimizer)
        group, rank, world_size = resolve_process_group(process_group)
        check_same_layout(specs, group, world_size)

        self.overlap = config.enable_overlap
        self.collective_entry_timeout_s = config.collective_entry_timeout_s
        self.sharded = config.enable
        self.process_group = group
        self.rank = rank
        self.world_size = world_size
        self.plan: LayoutPlan = plan_layout(
            specs,
            world_size if config.enable else 1,
            align_bytes=config.align_bytes,
            bucket_size_bytes=config.bucket_size_bytes,
        )
        self._buffers = FlatBuffers(self.plan, params)
        self._broadcast_from_first_rank()
        precisions = [
            resolve_precision(bucket.dtype, config.reduce_dtype, config.master_dtype)
            for bucket in self.plan.buckets
        ]
        self._comm = BucketCommunicator(self._buffers, group, rank, world_size, config.enable, precisions)
        self._inner_chunks = [chunk_local_tensor(local) for local in self._comm.local_params]
        self._inner = build_inner_optimizer(optimizer, self.plan, self._inner_chunks)
        # Forward order is registration order (buckets are laid out in reverse), see
        # Note [No stale params].
        self._gather_order = list(reversed(range(len(self.plan.buckets))))
        self._grad_tracker = (
            GradReadyTracker(self._buffers, self._comm.start_grad_sync) if self.overlap else None
        )
        self._param_waiter: ParamReadyWaiter | None = None
        self._grads_reduced = False
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self._layout_frozen = True
        if model is not None:
            self.attach(model)
        optimizer._sharded_opt_wrapper = self
        optimizer.register_step_pre_hook(_refuse_wrapped_step)

    # -- training loop ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Average grads over the group, step the local shard, share the updated params.

        Returns the closure's result (the loss), like ``torch.optim`` optimizers.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params_in_buffers()
        self._comm.finish_param_sync()
        self._comm.refresh_stale_masters()
        self._reduce_grads()
        self._sync_hyperparameters()
        self._inner.step()
        self._comm.start_param_sync(self._gather_order)
        if self._param_waiter is None:
            self._comm.finish_param_sync()
        self._start_iteration()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffers. Grads are never set to None: they stay views of the
        buffers the collectives read, so ``set_to_none`` is accepted and ignored."""
        self._comm.finish_grad_sync()
        self._buffers.zero_grad()
        self._start_iteration()

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged grads by their global norm; returns the total norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` over the unsharded, averaged grads: each rank
        computes the norm of its shard and one all-reduce of a scalar combines them, so every
        rank gets the same norm and clips alike (a local norm would differ per rank). Call it
        between backward and ``step()``; it finishes the grad reduction now, and ``step()``
        then uses the clipped grads. ``param.grad`` (the local, unreduced grads) is not changed.

        Raises:
            ValueError: ``norm_type`` is not positive.
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"clip_grad_norm_ expects norm_type > 0 (or inf) but got {norm_type}")
        self._check_params_in_buffers()
        self._reduce_grads()
        grads = self._comm.local_grads()
        if norm_type == math.inf:
            local = torch.stack([g.abs().max().float() for g in grads]).max()
            op = dist.ReduceOp.MAX
        else:
            local = torch.stack(
                [torch.linalg.vector_norm(g, norm_type).float() ** norm_type for g in grads]
            ).sum()
            op = dist.ReduceOp.SUM
        if self._comm.sharded:
            dist.all_reduce(local, op=op, group=self.process_group)
        total = local if norm_type == math.inf else local ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} is {total.item()}; set "
                "error_if_nonfinite=False to clip anyway (grads then become nan)"
            )
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
        return total

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads of the backward passes inside the block without communicating.

        As with DDP: run every micro-batch's backward but the last inside ``no_sync()``; the
        last backward (outside) then reduces the summed grads. In sync mode communication only
        happens in ``step()`` anyway, so the block changes nothing there.
        """
        if self._grad_tracker is None:
            yield
            return
        self._grad_tracker.accumulate_only = True
        try:
            yield
        finally:
            self._grad_tracker.accumulate_only = False

    def sync_params(self) -> None:
        """Wait until every param holds its updated value (a no-op unless overlap with a model
        attached left all-gathers running); call before reading params outside forward."""
        self._comm.finish_param_sync()

    def attach(self, model: nn.Module) -> None:
        """Let ``model``'s forward wait per module for its own params' all-gathers.

        Without an attached model, ``step()`` waits for all all-gathers before it returns. With
        one (in overlap mode), ``step()`` returns at once and each module's forward pre-hook
        waits only for the buckets that hold its own params, so later layers' all-gathers
        overlap earlier layers' forward. See Note [No stale params] for the contract.

        Raises:
            ValueError: ``model`` does not own all the optimizer's trainable params, or a model
                is already attached.
        """
        if self._param_waiter is not None:
            raise ValueError("ShardingStage1.attach: a model is already attached to this optimizer")
        waiter = ParamReadyWaiter(model, self._buffers, self._comm.finish_param_sync)
        if self.overlap:
            self._param_waiter = waiter
        else:
            waiter.remove_hooks()

    # -- introspection -----------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank."""
        return sum(
            value.numel() * value.element_size()
            for state in self._inner.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training, by kind (persistent tensors only; a bucket-sized
        cast during a low-precision grad reduction is transient).

        Keys: ``params`` and ``grads`` (the flat buffers, padding included), ``reduced_grads``
        (the averaged grads the optimizer steps, when not the grad buffer itself), ``master``
        (master copies of the local shard), ``optimizer_state``.
        """

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "params": nbytes(self._buffers.param_buffers),
            "grads": nbytes(self._buffers.grad_buffers),
            "reduced_grads": nbytes(self._comm.reduced_grad_tensors()),
            "master": nbytes(m for m in self._comm.master_copies() if m is not None),
            "optimizer_state": self.optimizer_state_bytes(),
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout_frozen", False):
            raise RuntimeError(
                "ShardingStage1 lays params out once, when it is built; add every param group to "
                "the torch optimizer first, then wrap it"
            )
        super().add_param_group(param_group)

    def state_dict(self, *, to_rank: int | None = None) -> dict[str, Any] | None:  # type: ignore[override]
        """The wrapped optimizer's state in the standard ``torch.optim`` format (collective).

        Per original param (same indices as the user's optimizer) with state tensors of the
        param's own shape, plus the param groups: it loads into a plain optimizer of the same
        class over an unsharded model, or into a ``ShardingStage1`` on any number of ranks.
        Beyond the local shard, at most one param's full state exists at a time.

        Args:
            to_rank: materialize the full state on this rank of the group only; the other ranks
                return None. Default: every rank gets it.
        """
        if to_rank is not None and not 0 <= to_rank < self.world_size:
            raise ValueError(
                f"ShardingStage1.state_dict expects to_rank in [0, {self.world_size}) but got {to_rank}"
            )
        self.sync_params()
        self._check_all_ranks_enter(
            "state_dict", "Call opt.state_dict(to_rank=0) on every rank (the others get None)"
        )
        return state_dict_conversion.gather_state_dict(self, to_rank)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a standard ``torch.optim`` state dict (from a plain optimizer or from
        :meth:`state_dict`, saved on any number of ranks).

        Everything is validated before anything changes: on error the optimizer is exactly as
        it was.

        Raises:
            ValueError: wrong structure, number of groups or params, state keys of another
                optimizer class or configuration, or state shapes that do not match the params.
        """
        self.sync_params()
        self._check_all_ranks_enter("load_state_dict", "Call opt.load_state_dict(sd) on every rank")
        state_dict_conversion.load_state_dict(self, state_dict)

    # -- internals -------------------------------------------------------------------------

    def _broadcast_from_first_rank(self) -> None:
        if self.world_size == 1:
            return
        source = dist.get_global_rank(self.process_group, 0)
        for buffer in self._buffers.param_buffers:
            dist.broadcast(buffer, src=source, group=self.process_group)

    def _check_params_in_buffers(self) -> None:
        moved = self._buffers.detached_params()
        converted = [(index, self._buffers.conversion_of(index)) for index in sorted(moved)]
        converted = [(index, change) for index, change in converted if change is not None]
        if converted:
            index, change = converted[0]
            raise RuntimeError(
                f"ShardingStage1: param {index} (optimizer order) {change} ({len(converted)} "
                "param(s) converted, e.g. by model.half() or model.to(...) after wrapping), so it "
                "no longer lives in the flat buffers and updates would be lost. Cast or move the "
                "model before building the optimizer and wrapping it"
            )
        if moved:
            raise RuntimeError(
                f"ShardingStage1: params {moved[:8]} (optimizer order) no longer live in the flat "
                "buffers (was `param.data = ...` assigned?), so updates would be lost. Modify params "
                "in place instead (`with torch.no_grad(): param.copy_(new)`)"
            )

    def _check_all_ranks_enter(self, method: str, fix: str) -> None:
        check_all_ranks_enter(
            f"ShardingStage1.{method}", fix, self.process_group, self.collective_entry_timeout_s
        )

    def _check_backward_finished(self) -> None:
        if self._grad_tracker is not None and self._grad_tracker.backward_unfinished:
            raise RuntimeError(
                "ShardingStage1.step: the last backward raised before it finished, so its grads are "
                "partial (some buckets were already being reduced). Call opt.zero_grad() to discard "
                "them, then run the iteration again"
            )

    def _start_iteration(self) -> None:
        self._grads_reduced = False
        if self._grad_tracker is not None:
            self._grad_tracker.reset()

    def _reduce_grads(self) -> None:
        if self._grads_reduced:
            return
        self._check_backward_finished()
        if self._grad_tracker is not None:
            self._grad_tracker.flush()
        else:
            for index in self._buffers.laid_out_indices:
                self._buffers.adopt_grad(index)
            for bucket in self.plan.buckets:
                self._comm.start_grad_sync(bucket.index)
        self._comm.finish_grad_sync()
        self._grads_reduced = True

    def _bucket_states(self) -> list[dict[str, Any]]:
        """Per bucket, the inner optimizer's state of this rank's local flat tensor."""
        return [bucket_state(self._inner, chunks) for chunks in self._inner_chunks]

    def _load_bucket_states(self, states: list[dict[str, Any]]) -> None:
        load_bucket_states(self._inner, self._inner_chunks, states)

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self._inner.param_groups, strict=True):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value

    def __reduce_ex__(self, protocol: int) -> Any:
        """Refuse pickling and ``copy.deepcopy``: a copy would share or lose the process group,
        the flat buffers the params view and the hooks, and fail later at ``step()``."""
        raise TypeError(
            "ShardingStage1 cannot be pickled or copied: it holds a process group, the flat buffers "
            "its params are views of, and hooks on them. Save opt.state_dict() (or use "
            "sharded_opt.save_checkpoint(path, model, opt)) and build a new ShardingStage1 to restore"
        )


def _resolve_config(strategy: Strategy | None, overlap: bool | None):
    if strategy is None:
        strategy = Strategy()
    elif not isinstance(strategy, Strategy):
        raise TypeError(
            f"ShardingStage1 expects strategy to be a sharded_opt.Strategy but got {type(strategy).__name__}"
        )
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"ShardingStage1 expects overlap to be a bool or None but got {overlap!r}")
    config = dataclasses.replace(strategy.sharding)
    if overlap is not None:
        config.enable_overlap = overlap
    return config


def _check_not_stepped(optimizer: torch.optim.Optimizer) -> None:
    stepped = [state for state in optimizer.state.values() if float(state.get("step", 1)) > 0]
    if stepped:
        raise ValueError(
            f"ShardingStage1 expects an optimizer that has not stepped yet but it holds state for "
            f"{len(stepped)} params, which would be lost; wrap the optimizer before training"
        )


def _refuse_wrapped_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    raise RuntimeError(
        f"this {type(optimizer).__name__} is wrapped by ShardingStage1; call the wrapper's step()"
    )
