"""``ShardingStage1``: ZeRO stage 1 around an existing ``torch.optim`` optimizer.

The class is the ``torch.optim.Optimizer`` surface a torch user reads; each method delegates to
runtime objects with one job each (module map in ``docs/design.md``):

- ``OptimizerShards`` (``optimizer_shards``): the layout, the flat buffers, this rank's shards
  and the inner optimizer; what the state conversions read.
- ``GradSync`` (``grad_sync``): which grads are ready and present, when each bucket's reduction
  starts and finishes, reuse of the last step's grads, frozen buckets.
- ``StepPipeline`` (``step_pipeline``): ``step()`` from the grads to the all-gathers, each
  bucket's shard stepped as its reduction lands.
- ``ParamSync`` (``param_sync``): the all-gathers and the waits for them.
- ``ParamGuard`` (``param_guard``): params replaced after wrapping, DDP added after wrapping.
- ``WrappedOptimizerGuard`` (``wrapped_guard``): the wrapped optimizer's refusals and hooks.
- ``GradClipping`` (``grad_clipping``): the norm and the clipping of the averaged grads.
- ``StateDictExchange`` (``state_dict``): ``state_dict``, ``consolidate_state_dict`` and
  ``load_state_dict`` around the state conversions.

The construction steps (config, layout, communicator, shards, the attached model's hooks) are in
``wrapper_init``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from sharded_opt.comm.collective_guard import EntryGuard
from sharded_opt.comm.communicator_pool import groups_can_be_destroyed, release_communicators
from sharded_opt.comm.hybrid_groups import lease_shard_groups
from sharded_opt.guards.messages import closed_error
from sharded_opt.guards.param_guard import ParamGuard
from sharded_opt.guards.validation import check_same_layout
from sharded_opt.guards.wrapped_guard import ADD_GROUPS_FIRST, WrappedOptimizerGuard
from sharded_opt.model_hooks.weak_hooks import remove_handles
from sharded_opt.state.state_dict import StateDictExchange
from sharded_opt.state.state_view import ShardedStateView
from sharded_opt.step.grad_clipping import GradClipping
from sharded_opt.step.grad_sync import GradSync
from sharded_opt.step.param_sync import ParamSync
from sharded_opt.step.step_pipeline import StepPipeline, amp_scaling_arguments
from sharded_opt.strategy import Strategy
from sharded_opt.wrapper_init import AttachedModel, ModelAttacher, build_shards, check_locally, plan_buckets


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
        process_group: ranks to shard over; default the whole world. The wrapper communicates
            on a group of its own over the same ranks (``self.process_group``; Note [One
            communicator per wrapper] in ``sharded_opt/comm/communicator_pool.py``).
        model: the module that holds the params (some may live outside it, such as a loss
            module's). In overlap mode its modules then wait for their own params only, see
            :meth:`attach`.
        assume_elementwise: accept an optimizer class not known to be element-wise, on the
            caller's word that each element's update depends only on its own grad and state.
        device_mesh: hybrid sharding given as FSDP2's HSDP takes it: a 2-D ``DeviceMesh`` whose
            dims are (replicate, shard), each row a shard group (``docs/hybrid-sharding.md``,
            Note [Hybrid sharding] in ``sharded_opt/comm/hybrid_groups.py``). Not together with
            ``process_group`` or ``degree``.

    Raises:
        TypeError: ``optimizer`` is not a supported ``torch.optim.Optimizer``; bad argument types.
        ValueError: what cannot be sharded as given (no trainable params, duplicate or sparse
            params, ranks with different params, an optimizer already stepped or wrapped, a bad
            ``degree`` or ``device_mesh``, ...): every case and its fix in ``docs/errors.md``.
        RuntimeError: no initialized process group.

    Grads: ``param.grad`` stays a view of the flat grad buffer and holds this rank's local
    (not averaged) grad; the averaged grad of the local shard is what the optimizer steps. A
    bucket of many tiny params keeps autograd's own grads instead and copies them in at
    ``step()`` (Note [Staged grads] in ``fusion.layout``).

    The runtime pieces are attributes for the library's own checkpointing and scaler (and for
    tests and benchmarks), not for training code: ``plan`` (the bucket layout), ``shards``
    (:class:`~sharded_opt.step.optimizer_shards.OptimizerShards`: buffers, per-bucket shards, the
    wrapped optimizer) and ``grad_sync`` (:class:`~sharded_opt.step.grad_sync.GradSync`: which grads
    are ready and present, the reductions).
    """

    _step_supports_amp_scaling = True
    """torch's protocol: ``GradScaler.step`` passes ``found_inf``/``grad_scale`` to ``step()``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        overlap: bool | None = None,
        strategy: Strategy | None = None,
        process_group: ProcessGroup | None = None,
        model: nn.Module | None = None,
        assume_elementwise: bool = False,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        config, needs, params, specs = check_locally(optimizer, model, strategy, overlap, assume_elementwise)
        # Groups of its own, a dropped wrapper's where one is free: Note [Reusing a dropped
        # wrapper's groups]; given back when this wrapper is collected, or by close().
        self._lease = lease_shard_groups(process_group, config.degree, device_mesh, config.enable)
        groups = self._lease.groups
        check_same_layout(specs, groups.world, groups.world_size)
        self.overlap = config.enable_overlap
        self.collective_entry_timeout_s = config.collective_entry_timeout_s
        self.sharded = config.enable
        self.shard_groups = groups
        self.plan, precisions = plan_buckets(optimizer, needs, specs, config, groups)
        # ``self`` owns the param groups; the cycle through it keeps a dropped wrapper (and its
        # hooks) alive until the garbage collector runs, as it always did.
        self.shards = build_shards(optimizer, self, self.plan, params, precisions, config, groups)
        self.grad_sync = GradSync(self.shards, self.overlap)
        self._param_sync = ParamSync(self.shards.buckets, self.shards.comm)
        self._param_guard = ParamGuard(self.shards.buffers, self._param_sync)
        self._clipping = GradClipping(self.grad_sync, self.shards, self._param_guard)
        self._pipeline = StepPipeline(self.shards, self.grad_sync, self._param_sync, needs.state_per_param)
        # A failed check leaves the ranks' call counters on the groups apart: never reused.
        self.entry_guard = EntryGuard(groups.world, self.collective_entry_timeout_s, self._lease.withhold)
        self._state_dicts = StateDictExchange(self.shards, self._param_sync, self.entry_guard)
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.state = ShardedStateView()  # type: ignore[assignment]  # Note [No per-param state]
        # The wrapper's groups *are* the wrapped optimizer's group dicts, so a scheduler built on
        # either object drives the step, and keys added to either show up in both.
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self._layout_frozen = True
        self._track_hooks()
        self._attacher = ModelAttacher(self.shards, self._param_guard, config)
        if model is not None:
            self._take_over(self._attacher.install(model))  # checked by check_locally, before any collective
        self._wrapped_guard = WrappedOptimizerGuard(self, optimizer)
        self._hook_handles += self._wrapped_guard.wrapper_handles

    # -- training loop ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Average grads over the group, step the local shard, share the updated params.

        As in ``torch.optim``, a param without a grad (on every rank) is not stepped: its value
        and state are left exactly as they are. Keyword arguments are passed to the wrapped
        optimizer's ``step``. Returns the closure's result (the loss).
        """
        self._check_open("step")
        self._state_dicts.discard_consolidated()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._param_guard.take_back_replaced()
        self._wrapped_guard.check_param_groups_unchanged(self.param_groups)
        if self._pipeline.run(kwargs, *amp_scaling_arguments(self)):
            self._wrapped_guard.stepped()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffers in place (grads stay views of the buffers the collectives
        read). With ``set_to_none=True`` (the default) every param also counts as having no
        grad, as after torch's ``zero_grad()``: a param that no backward reaches before the next
        ``step()`` is not stepped."""
        self._param_guard.refuse_converted_before_zero_grad()
        self.grad_sync.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged grads by their global norm; returns the total norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` over the unsharded, averaged grads, the same
        on every rank (one all-reduce of a scalar). Call it between backward and ``step()``: it
        finishes the grad reduction now, and ``step()`` uses the clipped grads. As in torch,
        params without a grad count neither in the norm nor in the clipping. ``param.grad`` (the
        local grads) is not changed, so zero grads between steps as usual (see
        ``docs/user-guide.md``).

        Raises:
            ValueError: ``norm_type`` is not positive.
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
        """
        return self._clipping.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the averaged grads over every shard, without clipping (collective).

        What DDP users log with ``get_total_norm`` over ``param.grad``, which here holds only
        this rank's local grads. Like :meth:`clip_grad_norm_` it finishes the grad reduction now
        (call it between backward and ``step()``) and equals ``torch.nn.utils.get_total_norm``
        over the unsharded averaged grads on every rank; params without a grad do not count.
        Grads are not changed.

        Raises:
            ValueError: ``norm_type`` is not positive.
        """
        return self._clipping.grad_norm(norm_type)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the averaged grads to ``[-clip_value, clip_value]``.

        Equals ``torch.nn.utils.clip_grad_value_`` over the unsharded, averaged grads (each rank
        clamps its own shard). Call it between backward and ``step()``; it finishes the grad
        reduction now. ``param.grad`` (the local, unreduced grads) is not changed.
        """
        self._clipping.clip_grad_value_(clip_value)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate grads of the backward passes inside the block without communicating.

        As with DDP: run every micro-batch's backward but the last inside ``no_sync()``; the
        last backward (outside) then reduces the summed grads. Blocks nest as DDP's do. In sync
        mode communication only happens in ``step()`` anyway, so the block changes nothing.
        """
        return self.grad_sync.no_sync()

    def sync_params(self) -> None:
        """Wait until every param holds its updated value (a no-op unless overlap with a model
        attached left all-gathers running). Torch functions wait by themselves (Note [Reads
        right after step]); call it before reads of params they do not see: from another
        thread, under ``torch._C.DisableTorchFunction()``, or before replaying a CUDA graph.

        Raises:
            RuntimeError: a param was written (``param.copy_``...) while it was still being
                all-gathered, see Note [Writes while params are gathered].
        """
        self._param_sync.finish_param_sync()

    def wait_for_params(self, stream: torch.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait until every param holds its updated
        value; on CPU this is :meth:`sync_params`. Work that no forward pre-hook sees needs it
        first: every CUDA graph replay (on the stream that replays), reads of params on another
        stream. On NCCL the host is not blocked (Note [Streams and events] in
        ``sharded_opt/comm/streams.py``; ``docs/accelerators.md``).

        Raises:
            TypeError: ``stream`` is not a ``torch.Stream`` (or None).
            ValueError: ``stream`` is on another device than the params.
            RuntimeError: a param was written while it was still being all-gathered, see
                Note [Writes while params are gathered].
        """
        self._param_sync.wait_for_params(stream)

    def attach(self, model: nn.Module) -> None:
        """Make ``model`` start equal on every rank and let its forward wait per module for its
        own params' all-gathers.

        As DDP's constructor does, every param and buffer of ``model`` is broadcast from the
        group's first rank (collective); with ``Strategy().sharding.broadcast_buffers`` (the
        default, like DDP's) buffers are broadcast again before each forward with grad. In
        overlap mode ``step()`` then returns at once and each module's forward waits only for
        its own params' all-gathers (Note [No stale params]; ``docs/user-guide.md``).

        Raises:
            ValueError: ``model`` holds none of the optimizer's trainable params, a module of
                it makes sparse grads for them (``nn.Embedding(sparse=True)``) or renormalizes
                them in forward (``nn.Embedding(max_norm=...)``), or a model is already attached.
        """
        self._take_over(self._attacher.attach(model))

    def close(self) -> None:
        """Wait for the all-gathers in flight, remove every hook and destroy the process groups
        this wrapper created (collective: call it on every rank; Note [Releasing a wrapper's
        groups] in ``communicator_pool``); over a strict subgroup they are kept for the next wrapper
        over the same ranks instead. Calling it again does nothing. A wrapper dropped without
        ``close()`` gives its groups to the next wrapper over the same ranks when it is
        collected, so a loop that drops wrappers stays bounded without it.

        The model and the wrapped torch optimizer are then as if never wrapped (params stay views
        of the flat buffers): a new ``ShardingStage1`` can be built over the same params or torch
        optimizer, which may also step on its own again; this one's ``step()`` raises. A dropped
        wrapper loses its hooks when collected (Note [Hook lifetimes and copies]), but its torch
        optimizer keeps refusing ``step()``. ``with ShardingStage1(...) as opt:`` closes at the end
        of the block (this rank alone, keeping the groups, when an exception ends it).
        """
        self._close(release_groups=True)

    def _close(self, release_groups: bool) -> None:
        if self._closed:
            return
        self._closed = True
        destroy = release_groups and groups_can_be_destroyed(self.process_group)
        if destroy or not release_groups:
            # Destroyed below, or an exception may have left this rank's collectives on them
            # unmatched: never reused (Note [Reusing a dropped wrapper's groups]).
            self._lease.withhold()
        self._release()
        self._wrapped_guard.release()
        if destroy:
            release_communicators(self.shard_groups.owned())
            self._lease.remove()
        elif release_groups:
            self._lease.give_back()

    def __enter__(self) -> ShardingStage1:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # After an exception the other ranks may never reach close(): no collective then.
        self._close(release_groups=exc_type is None)

    # -- introspection -----------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank."""
        return self.shards.optimizer_state_bytes()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training, by kind.

        Keys: ``params`` and ``grads`` (the flat buffers, padding included), ``reduced_grads``
        (the averaged grads the optimizer steps, when not the grad buffer itself), ``master``
        (master copies of the local shard), ``published`` (with ``param_compression``: the local
        shard's params as last sent, Note [Compressed wire] in ``compression``),
        ``optimizer_state``, ``staging`` (casts of grads to ``reduce_dtype`` for the
        reduce-scatter, Note [Bounded staging] in ``comm_context``; none on CPU gloo, which
        widens on receipt).
        """
        return self.shards.memory_bytes()

    def wire_bytes(self) -> dict[str, int]:
        """Bytes this rank has sent to its peers for the buckets' collectives since the wrapper
        was built, counted from each payload as it is issued: ``grads`` (reductions), ``params``
        (all-gathers), ``replicas`` (hybrid sharding's all-reduces) and ``total``. The difference
        over a step is that step's traffic; compare ``grad_compression``/``param_compression``
        settings with it (Note [Compressed wire] in ``sharded_opt/comm/compression.py``)."""
        return self.shards.comm.wire.as_dict()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout_frozen", False):
            raise RuntimeError(f"ShardingStage1 lays params out once, when it is built; {ADD_GROUPS_FIRST}")
        super().add_param_group(param_group)

    def state_dict(self, *, to_rank: int | None = None) -> dict[str, Any] | None:  # type: ignore[override]
        """The wrapped optimizer's state in the standard ``torch.optim`` format (collective).

        Per original param (same indices as the user's optimizer) with state tensors of the
        param's own shape: it loads into a plain optimizer of the same class, or into a
        ``ShardingStage1`` on any number of ranks (``docs/checkpoints.md``). State-dict hooks
        run as in torch; post-hooks only on the ranks that get the state dict. After
        :meth:`consolidate_state_dict`, ``state_dict()`` without ``to_rank`` is not collective
        until the next ``step()`` or ``load_state_dict()``.

        Args:
            to_rank: materialize the full state on this rank of the group only; the other ranks
                return None. Default: every rank gets it.

        Raises:
            ValueError: ``to_rank`` is not a rank of the group.
            RuntimeError: only some ranks called it (Note [Collectives entered by some ranks]),
                or on another rank than the one :meth:`consolidate_state_dict` gathered to.
        """
        self._check_open("state_dict")
        return self._state_dicts.state_dict(self, to_rank)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state on rank ``to`` of the group, for a later ``state_dict()`` there
        (collective; torch ``ZeroRedundancyOptimizer``'s protocol).

        Frameworks that save on one rank (Lightning, code written for torch's ZeRO) call this on
        every rank, then ``state_dict()`` on rank ``to`` alone, which until the next ``step()``
        or ``load_state_dict()`` returns the gathered state without communicating (with the
        current param groups) and raises on the other ranks (``docs/trainers.md``). Only rank
        ``to`` holds the gathered state meanwhile.

        Raises:
            ValueError: ``to`` is not a rank of the group.
            RuntimeError: only some ranks called it (see Note [Collectives entered by some ranks]).
        """
        self._check_open("consolidate_state_dict")
        self._state_dicts.consolidate(to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a standard ``torch.optim`` state dict (from a plain optimizer or from
        :meth:`state_dict`, saved on any number of ranks).

        Everything is validated before anything changes: on error the optimizer is exactly as
        it was. Load-state-dict hooks run around it, as in torch.

        Raises:
            ValueError: wrong structure, number of groups or params, state keys of another
                optimizer class or configuration, or state shapes that do not match the params.
        """
        self._check_open("load_state_dict")
        self._state_dicts.load_state_dict(self, state_dict)

    # -- internals -------------------------------------------------------------------------

    def _track_hooks(self) -> None:
        """Arrange for every hook to be removed by ``close()`` or when this wrapper is
        collected, see Note [Hook lifetimes and copies]."""
        self._closed = False
        self._hook_handles: list[RemovableHandle] = []
        # The tracker's list, not a copy: it grows when params are unfrozen later.
        self._release = weakref.finalize(
            self, _release_hooks, self._param_sync, self._hook_handles, self.grad_sync.tracker.handles
        )
        # At interpreter exit the process group may be gone; there is nothing to wait for then.
        self._release.atexit = False

    def _take_over(self, attached: AttachedModel) -> None:
        """Keep the attached model's hooks for ``close()``; in overlap mode, leave the
        all-gathers to its per-module waits."""
        self._hook_handles += attached.handles
        if attached.waiter is not None:
            self._param_sync.wait_per_module(attached.waiter)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or a ``with`` block ended): the hooks and, when it spans
        the world, the process groups are gone, so ``step()`` and the state-dict methods raise."""
        return self._closed

    @property
    def process_group(self) -> ProcessGroup:
        """The wrapper's own communicator over the ranks it was built for (Note [One
        communicator per wrapper] in ``validation``)."""
        return self.shard_groups.world

    @property
    def rank(self) -> int:
        """This rank's index in :attr:`process_group`."""
        return self.shard_groups.world_rank

    @property
    def world_size(self) -> int:
        """The number of ranks of :attr:`process_group`."""
        return self.shard_groups.world_size

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(closed_error(f"ShardingStage1.{method}"))

    def __reduce_ex__(self, protocol: int) -> Any:
        """Refuse pickling and ``copy.deepcopy``: a copy would share or lose the process group,
        the flat buffers the params view and the hooks, and fail later at ``step()``."""
        raise TypeError(
            "ShardingStage1 cannot be pickled or copied: it holds a process group, the flat buffers "
            "its params are views of, and hooks on them. Save opt.state_dict() (or use "
            "sharded_opt.save_checkpoint(path, model, opt)) and build a new ShardingStage1 to restore"
        )


def _release_hooks(param_sync: ParamSync, *handle_lists: list[RemovableHandle]) -> None:
    """Finish the all-gathers still writing the params (a new wrapper may copy them next), then
    remove every hook."""
    param_sync.finish_gathers()
    for handles in handle_lists:
        remove_handles(handles)
