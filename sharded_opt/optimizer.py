"""``ShardingStage1``: ZeRO stage 1 around an existing ``torch.optim`` optimizer.

The class is the ``torch.optim.Optimizer`` surface a torch user reads; each method delegates to
runtime objects with one job each (module map in ``docs/design.md``):

- ``OptimizerShards`` (``optimizer_shards``): the layout, the flat buffers, this rank's shards
  and the inner optimizer; what the state conversions read.
- ``GradSync`` (``grad_sync``): which grads are ready and present, when each bucket's reduction
  starts and finishes, reuse of the last step's grads, frozen buckets.
- ``StepPipeline`` (``step_pipeline``): each bucket's shard stepped as its reduction lands.
- ``ParamSync`` (``param_sync``): the all-gathers and the waits for them.
- ``ParamGuard`` (``param_guard``): params replaced after wrapping, DDP added after wrapping.
- ``WrappedOptimizerGuard`` (``wrapped_guard``): the wrapped optimizer's refusals and hooks.

The construction steps (config, layout, communicator) are in ``wrapper_init``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from fusion.buffers import FlatBuffers
from sharded_opt import state_dict as state_dict_conversion
from sharded_opt.bucket_comm import BucketCommunicator
from sharded_opt.collective_guard import check_all_ranks_enter
from sharded_opt.grad_sync import GradSync
from sharded_opt.hybrid_groups import resolve_shard_groups
from sharded_opt.inner_optimizer import build_inner_optimizer, indexed_groups
from sharded_opt.optimizer_shards import OptimizerShards
from sharded_opt.param_guard import ParamGuard
from sharded_opt.param_hooks import BufferBroadcaster, ParamReadyWaiter, register_eager_pre_hook
from sharded_opt.param_sync import ParamSync, broadcast_from_first_rank, broadcast_model_state, first_rank
from sharded_opt.state_view import ShardedStateView
from sharded_opt.step_pipeline import StepPipeline
from sharded_opt.strategy import Strategy
from sharded_opt.validation import (
    check_optimizer,
    check_same_layout,
    check_trained_modules,
    collect_params,
    release_communicators,
)
from sharded_opt.weak_hooks import remove_handles
from sharded_opt.wrapped_guard import ADD_GROUPS_FIRST, WrappedOptimizerGuard
from sharded_opt.wrapper_init import build_communicator, check_not_stepped, plan_buckets, resolve_config


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
            on a group of its own over the same ranks (``self.process_group``), so several
            wrappers on one group never mix their collectives; see Note [One communicator per
            wrapper] in ``sharded_opt/validation.py``.
        model: the module that holds the params (some may live outside it, such as a loss
            module's). In overlap mode its modules then wait for their own params only, see
            :meth:`attach`.
        assume_elementwise: accept an optimizer class not known to be element-wise, on the
            caller's word that each element's update depends only on its own grad and state.
        device_mesh: hybrid sharding given as FSDP2's HSDP takes it: a 2-D ``DeviceMesh`` whose
            dims are (replicate, shard). Each mesh row is a shard group, each column holds
            replicas of one shard; the same as ``ShardingConfig(degree=k)`` for a mesh of rows of
            ``k`` consecutive ranks. Memory per rank is then S/k, and only an all-reduce of each
            rank's 1/k shard crosses between rows; see Note [Hybrid sharding] in
            ``sharded_opt/hybrid_groups.py``. Not together with ``process_group`` or ``degree``.

    Raises:
        TypeError: ``optimizer`` is not a supported ``torch.optim.Optimizer``; bad argument types
            (``device_mesh`` that is not a ``DeviceMesh``).
        ValueError: no trainable params, duplicate or sparse params, a ``model`` module that
            makes sparse grads (``nn.Embedding(sparse=True)``) or renormalizes its weight in
            forward (``nn.Embedding(max_norm=...)``), params on several devices,
            ranks with different params, an optimizer that already stepped or is already wrapped,
            settings torch refuses only at the first step (``capturable=True`` on CPU, see Note
            [Refused at the first step] in ``inner_optimizer``);
            a ``degree`` that does not divide the world size, a ``device_mesh`` that is not 2-D or
            comes with ``process_group`` or ``degree``.
        RuntimeError: no initialized process group.

    Grads: ``param.grad`` stays a view of the flat grad buffer and holds this rank's local
    (not averaged) grad; the averaged grad of the local shard is what the optimizer steps.
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
        config = resolve_config(strategy, overlap)
        needs = check_optimizer(optimizer, assume_elementwise)
        check_not_stepped(optimizer)
        params, specs = collect_params(optimizer)
        if model is not None:
            check_trained_modules(model, params)
        groups = resolve_shard_groups(process_group, config.degree, device_mesh, config.enable)
        group, rank, world_size = groups.world, dist.get_rank(groups.world), dist.get_world_size(groups.world)
        check_same_layout(specs, group, world_size)

        self.overlap = config.enable_overlap
        self.collective_entry_timeout_s = config.collective_entry_timeout_s
        self.sharded = config.enable
        self.process_group = group
        self.rank = rank
        self.world_size = world_size
        self.shard_groups = groups
        self.plan, precisions = plan_buckets(optimizer, needs, specs, config, groups)
        buffers = FlatBuffers(self.plan, params)
        broadcast_from_first_rank(buffers, group, world_size)
        comm = build_communicator(buffers, groups, config, precisions)
        if optimizer.state:
            # The class creates state at construction (Adagrad): it exists for every param, frozen
            # or not, so every bucket needs its pieces now, as the plain optimizer has them.
            for bucket in self.plan.buckets:
                comm.materialize(bucket.index)
        inner = build_inner_optimizer(optimizer, comm.live_shards())
        # ``self`` owns the param groups; the cycle through it keeps a dropped wrapper (and its
        # hooks) alive until the garbage collector runs, as it always did.
        self._shards = OptimizerShards(self.plan, buffers, comm, inner, self, groups, group, rank, world_size)
        self._grad_sync = GradSync(self._shards, self.overlap)
        self._param_sync = ParamSync(comm)
        self._param_guard = ParamGuard(buffers, self._param_sync)
        # See Note [Step pipeline]: torch's own classes keep all state per param, so stepping
        # them bucket by bucket is exact; another class may keep state per step() call.
        step_per_bucket = world_size > 1 and needs.state_per_param
        self._pipeline = StepPipeline(self._shards, self._grad_sync, self._param_sync, step_per_bucket)
        self._consolidated: _Consolidated | None = None
        self._num_params_per_group = [len(g["params"]) for g in optimizer.param_groups]
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.state = ShardedStateView()  # type: ignore[assignment]  # Note [No per-param state]
        # The wrapper's groups *are* the wrapped optimizer's group dicts, so a scheduler built on
        # either object drives the step, and keys added to either show up in both.
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self._layout_frozen = True
        self._broadcast_buffers = config.broadcast_buffers
        self._track_hooks()
        if model is not None:
            self._attach(model)  # its grads were checked to be dense above, before any collective
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
        self._check_open()
        self._consolidated = None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._param_guard.take_back_replaced()
        self._check_param_groups_unchanged()
        found_inf, grad_scale = self._amp_scaling_arguments()
        self.sync_params()
        if found_inf is None:
            self._grad_sync.start_grad_sync()
        else:
            self._grad_sync.reduce_grads()  # the scaler reduced them already, to check the averaged grads
        if found_inf is not None and float(found_inf) > 0:
            self._grad_sync.start_iteration()  # the scaler saw an inf on some rank: every rank skips
            return loss
        if grad_scale is not None:
            inverse = grad_scale.double().reciprocal().float()
            torch._foreach_mul_(self._shards.comm.local_grads(), inverse)
        self._pipeline.step(kwargs)
        self._param_sync.hand_over()
        self._grad_sync.start_iteration()
        self._grad_sync.record_step()
        # A scheduler built on the wrapped optimizer checks that its step ran before its own.
        self._wrapped_guard.optimizer._opt_called = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffers.

        Grads stay views of the buffers the collectives read, so they are zeroed in place rather
        than set to None; with ``set_to_none=True`` (the default) every param also counts as
        having no grad, exactly as after torch's ``zero_grad()``: a param that no backward
        reaches before the next ``step()`` is not stepped.
        """
        self._param_guard.refuse_converted_before_zero_grad()
        self._grad_sync.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged grads by their global norm; returns the total norm.

        Equals ``torch.nn.utils.clip_grad_norm_`` over the unsharded, averaged grads: each rank
        computes the norm of its shard and one all-reduce of a scalar combines them, so every
        rank gets the same norm and clips alike (a local norm would differ per rank). Call it
        between backward and ``step()``; it finishes the grad reduction now, and ``step()``
        then uses the clipped grads. As in torch, params that got no grad (frozen ones, say)
        count neither in the norm nor in the clipping.

        ``param.grad`` (the local, unreduced grads) is not changed. So zero grads between steps
        as usual: a backward that accumulates into last step's grads sums them unclipped here,
        where torch sums the clipped ones.

        Raises:
            ValueError: ``norm_type`` is not positive.
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
        """
        _check_norm_type("clip_grad_norm_", norm_type)
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} is {total.item()}; set "
                "error_if_nonfinite=False to clip anyway (grads then become nan)"
            )
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._grad_sync.scale_grads(coefficient)
        return total

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the averaged grads over every shard, without clipping (collective).

        For logging what DDP users log with ``clip_grad_norm_(params, inf)`` or a separate
        ``get_total_norm`` over ``param.grad``: here ``param.grad`` holds only this rank's local
        grads, whose norm differs per rank. Like :meth:`clip_grad_norm_` it finishes the grad
        reduction now (so call it between backward and ``step()``), takes each rank's shard norm
        and combines them with one all-reduce of a scalar: the result equals
        ``torch.nn.utils.get_total_norm`` over the unsharded averaged grads and is the same on
        every rank. Params without a grad do not count. Grads are not changed, so calling it
        before :meth:`clip_grad_norm_` or ``step()`` changes nothing they compute.

        Raises:
            ValueError: ``norm_type`` is not positive.
        """
        norm_type = _check_norm_type("grad_norm", norm_type)
        self._param_guard.take_back_replaced()
        return self._grad_sync.grad_norm(norm_type)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the averaged grads to ``[-clip_value, clip_value]``.

        Equals ``torch.nn.utils.clip_grad_value_`` over the unsharded, averaged grads: clamping
        is element-wise, so each rank clamps its own shard and nothing more is communicated
        (the stock function would clamp each rank's local grads before they are averaged). Call
        it between backward and ``step()``; it finishes the grad reduction now. ``param.grad``
        (the local, unreduced grads) is not changed.
        """
        clip_value = float(clip_value)
        self._param_guard.take_back_replaced()
        self._grad_sync.clamp_grads(clip_value)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate grads of the backward passes inside the block without communicating.

        As with DDP: run every micro-batch's backward but the last inside ``no_sync()``; the
        last backward (outside) then reduces the summed grads. In sync mode communication only
        happens in ``step()`` anyway, so the block changes nothing there. Blocks nest: leaving
        an inner block restores the state of the outer one, as DDP's does.
        """
        return self._grad_sync.no_sync()

    def sync_params(self) -> None:
        """Wait until every param holds its updated value (a no-op unless overlap with a model
        attached left all-gathers running). Reads and writes of params through torch functions
        wait by themselves (Note [Reads right after step]); call it before reading params in a
        way torch functions do not see: from another thread, under
        ``torch._C.DisableTorchFunction()``, or before replaying a CUDA graph.

        Raises:
            RuntimeError: a param was written (``param.copy_``...) while it was still being
                all-gathered, see Note [Writes while params are gathered].
        """
        self._param_sync.finish_param_sync()

    def wait_for_params(self, stream: torch.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait until every param holds its updated
        value; on CPU this is :meth:`sync_params`.

        Forward pre-hooks make the stream running each module's forward wait for its own
        params' all-gathers. Work that no hook sees needs this call first: a CUDA graph replay
        (its captured kernels read the params without running hooks; call it before every
        replay, on the stream that replays), or reads of params on another stream. Each stream
        waits on an event recorded after each bucket's latest all-gather; on NCCL the host
        is not blocked. See Note [Streams and events] in ``sharded_opt/streams.py``.

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

        As DDP's constructor does, every param of ``model`` (frozen ones included) and every
        buffer is broadcast from the group's first rank (collective). With
        ``Strategy().sharding.broadcast_buffers`` (the default, like DDP's), buffers are
        broadcast again before each forward with grad enabled.

        Without an attached model, ``step()`` waits for all all-gathers before it returns. With
        one (in overlap mode), ``step()`` returns at once and each module's forward pre-hook
        waits only for the buckets that hold its own params, so later layers' all-gathers
        overlap earlier layers' forward; ``model.state_dict()`` and ``model.load_state_dict()``
        wait too. See Note [No stale params] for the contract.

        Raises:
            ValueError: ``model`` holds none of the optimizer's trainable params, a module of
                it makes sparse grads for them (``nn.Embedding(sparse=True)``) or renormalizes
                them in forward (``nn.Embedding(max_norm=...)``), or a model is already attached.
        """
        if self._param_sync.waiter is not None:
            raise ValueError("ShardingStage1.attach: a model is already attached to this optimizer")
        check_trained_modules(model, self._shards.buffers.params)
        self._attach(model)

    def _attach(self, model: nn.Module) -> None:
        buffers = self._shards.buffers
        waiter = ParamReadyWaiter(model, buffers, self._shards.comm.finish_param_sync)
        names = {id(param): name for name, param in model.named_parameters()}
        self._param_guard.param_names = {
            index: names[id(param)] for index, param in enumerate(buffers.params) if id(param) in names
        }
        self._hook_handles.append(register_eager_pre_hook(model, self._param_guard.check_before_forward))
        broadcast_model_state(model, buffers, self.process_group, self.world_size)
        if self._broadcast_buffers and self.world_size > 1 and next(model.buffers(), None) is not None:
            source = first_rank(self.process_group)
            self._buffer_broadcaster = BufferBroadcaster(model, self.process_group, source)
            self._hook_handles += self._buffer_broadcaster.handles
        if self.overlap:
            self._param_sync.waiter = waiter
            self._hook_handles += waiter.handles
        else:
            waiter.remove_hooks()

    def close(self) -> None:
        """Wait for the all-gathers in flight and remove every hook this wrapper installed.

        The model and the wrapped torch optimizer are then as if never wrapped (the params stay
        views of the flat buffers, with their current values): a new ``ShardingStage1`` can be
        built over the same params, or over the same torch optimizer, which may also step on
        its own again. ``step()`` of a closed wrapper raises. A wrapper that is dropped without
        ``close()`` loses its hooks when it is garbage collected (see Note [Hook lifetimes and
        copies]), but its torch optimizer keeps refusing ``step()``; ``with ShardingStage1(...)
        as opt:`` closes at the end of the block. Calling it again does nothing.

        Collective when the wrapper spans every rank: it then destroys the process groups it
        created (Note [Releasing a wrapper's groups] in ``validation``), so call it on every
        rank. A ``with`` block left by an exception closes this rank alone and keeps them.
        """
        self._close(release_groups=True)

    def _close(self, release_groups: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()
        self._wrapped_guard.release()
        if release_groups:
            groups = self.shard_groups
            others = [groups.shard, groups.replicate, self._grad_sync.presence.group]
            release_communicators(groups.world, others)

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
        return self._shards.optimizer_state_bytes()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training, by kind.

        Keys: ``params`` and ``grads`` (the flat buffers, padding included), ``reduced_grads``
        (the averaged grads the optimizer steps, when not the grad buffer itself), ``master``
        (master copies of the local shard), ``optimizer_state``, ``staging`` (casts of grads to
        ``reduce_dtype`` for the reduce-scatter: at most two buffers of the largest such bucket,
        allocated at the first reduction, see Note [Bounded staging] in ``bucket_comm``).
        """
        return self._shards.memory_bytes()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout_frozen", False):
            raise RuntimeError(f"ShardingStage1 lays params out once, when it is built; {ADD_GROUPS_FIRST}")
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

        Hooks registered with ``register_state_dict_pre_hook``/``..._post_hook`` run around it,
        as in torch; post-hooks only on the ranks that get the state dict.

        After :meth:`consolidate_state_dict` (torch ``ZeroRedundancyOptimizer``'s protocol),
        ``state_dict()`` without ``to_rank`` is not collective until the next ``step()`` or
        ``load_state_dict()``: on the rank the state was consolidated to it returns that state
        (with the current param groups), on every other rank it raises.

        Raises:
            ValueError: ``to_rank`` is not a rank of the group.
            RuntimeError: only some ranks called it (see Note [Collectives entered by some
                ranks]), or it was called on another rank than the one :meth:`consolidate_state_dict`
                gathered to.
        """
        if to_rank is not None and not 0 <= to_rank < self.world_size:
            raise ValueError(
                f"ShardingStage1.state_dict expects to_rank in [0, {self.world_size}) but got {to_rank}"
            )
        consolidated = self._consolidated if to_rank is None else None
        if consolidated is None:
            self.sync_params()
            self._check_all_ranks_enter(
                "state_dict", "Call opt.state_dict(to_rank=0) on every rank (the others get None)"
            )
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        if consolidated is None:
            state = state_dict_conversion.gather_state_dict(self._shards, to_rank)
        else:
            state = self._consolidated_state_dict(consolidated)
        if state is not None:
            for post_hook in self._optimizer_state_dict_post_hooks.values():
                state = _replaced_by(post_hook(self, state), state)
        return state

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state on rank ``to`` of the group, for a later ``state_dict()`` there
        (collective; torch ``ZeroRedundancyOptimizer``'s protocol).

        Frameworks that save on one rank (Lightning's ``Strategy.optimizer_state``, code written
        for torch's ZeRO) call this on every rank, then ``state_dict()`` on rank ``to`` alone.
        Until the next ``step()`` or ``load_state_dict()``, ``state_dict()`` on rank ``to`` then
        returns the gathered state without communicating, and raises on the other ranks. The
        gathered state stays on rank ``to`` until then (as with :meth:`state_dict` ``(to_rank=to)``,
        which is what this calls); the other ranks hold nothing extra.

        Raises:
            ValueError: ``to`` is not a rank of the group.
            RuntimeError: only some ranks called it (see Note [Collectives entered by some ranks]).
        """
        if not 0 <= to < self.world_size:
            raise ValueError(
                f"ShardingStage1.consolidate_state_dict expects to in [0, {self.world_size}) but got {to}"
            )
        self._consolidated = None
        self.sync_params()
        self._check_all_ranks_enter(
            "consolidate_state_dict", f"Call opt.consolidate_state_dict(to={to}) on every rank"
        )
        gathered = state_dict_conversion.gather_state_dict(self._shards, to)
        self._consolidated = _Consolidated(to, None if gathered is None else gathered["state"])

    def _consolidated_state_dict(self, consolidated: _Consolidated) -> dict[str, Any]:
        if consolidated.state is None:
            raise RuntimeError(
                f"ShardingStage1.state_dict: consolidate_state_dict(to={consolidated.rank}) gathered the "
                f"state on rank {consolidated.rank}, so until the next step() only that rank's "
                f"state_dict() returns it (this is rank {self.rank}). Call opt.state_dict() on rank "
                f"{consolidated.rank} alone, or opt.state_dict() / opt.state_dict(to_rank=...) on every rank"
            )
        # The param groups are read now: a scheduler may have changed them since consolidating.
        return {"state": consolidated.state, "param_groups": indexed_groups(self.param_groups)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a standard ``torch.optim`` state dict (from a plain optimizer or from
        :meth:`state_dict`, saved on any number of ranks).

        Everything is validated before anything changes: on error the optimizer is exactly as
        it was. Hooks registered with ``register_load_state_dict_pre_hook``/``..._post_hook``
        run around it, as in torch.

        Raises:
            ValueError: wrong structure, number of groups or params, state keys of another
                optimizer class or configuration, or state shapes that do not match the params.
        """
        self._consolidated = None
        self.sync_params()
        self._check_all_ranks_enter("load_state_dict", "Call opt.load_state_dict(sd) on every rank")
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = _replaced_by(pre_hook(self, state_dict), state_dict)
        state_dict_conversion.load_state_dict(self._shards, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- internals -------------------------------------------------------------------------

    def _track_hooks(self) -> None:
        """Arrange for every hook to be removed by ``close()`` or when this wrapper is
        collected, see Note [Hook lifetimes and copies]."""
        self._closed = False
        self._hook_handles: list[RemovableHandle] = []
        # The tracker's list, not a copy: it grows when params are unfrozen later.
        self._release = weakref.finalize(
            self, _release_hooks, self._shards.comm, self._hook_handles, self._grad_sync.tracker.handles
        )
        # At interpreter exit the process group may be gone; there is nothing to wait for then.
        self._release.atexit = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "ShardingStage1.step: this optimizer was closed (close() or the end of its `with` "
                "block) and its hooks are gone; build a new ShardingStage1 to keep training"
            )

    def _amp_scaling_arguments(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``found_inf`` and ``grad_scale`` set by a ``GradScaler`` driving this step, see Note
        [Loss scaling with sharded grads] in ``grad_scaler``."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return None, None
        if not getattr(self, "_scaled_by_sharded_scaler", False):
            raise RuntimeError(
                "ShardingStage1.step: driven by a stock torch.amp.GradScaler, which checks this rank's "
                "local, unreduced grads for infs, so ranks would skip different steps and their "
                "scales drift apart. Use sharded_opt.ShardedGradScaler (same API) instead; call "
                "opt.zero_grad() to discard these grads"
            )
        return found_inf, getattr(self, "grad_scale", None)

    def _check_param_groups_unchanged(self) -> None:
        counts = [len(g["params"]) for g in self.param_groups]
        if counts != self._num_params_per_group:
            raise RuntimeError(
                f"ShardingStage1.step: the param groups now hold {counts} params but the wrapper laid "
                f"out {self._num_params_per_group}; params cannot be added after wrapping. Add every "
                "param group to the torch optimizer first, then wrap it"
            )

    def _check_all_ranks_enter(self, method: str, fix: str) -> None:
        check_all_ranks_enter(
            f"ShardingStage1.{method}", fix, self.process_group, self.collective_entry_timeout_s
        )

    def __reduce_ex__(self, protocol: int) -> Any:
        """Refuse pickling and ``copy.deepcopy``: a copy would share or lose the process group,
        the flat buffers the params view and the hooks, and fail later at ``step()``."""
        raise TypeError(
            "ShardingStage1 cannot be pickled or copied: it holds a process group, the flat buffers "
            "its params are views of, and hooks on them. Save opt.state_dict() (or use "
            "sharded_opt.save_checkpoint(path, model, opt)) and build a new ShardingStage1 to restore"
        )


@dataclasses.dataclass(frozen=True)
class _Consolidated:
    """What :meth:`ShardingStage1.consolidate_state_dict` gathered: the rank it went to, and there
    the ``"state"`` part of the state dict (None on the other ranks)."""

    rank: int
    state: dict[int, dict[str, Any]] | None


def _check_norm_type(api: str, norm_type: float) -> float:
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"ShardingStage1.{api} expects norm_type > 0 (or inf) but got {norm_type}")
    return norm_type


def _replaced_by(hook_result: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """torch's hook protocol: a state-dict hook returns a new dict, or None to keep the old one."""
    return state_dict if hook_result is None else hook_result


def _release_hooks(comm: BucketCommunicator, *handle_lists: list[RemovableHandle]) -> None:
    """Finish the all-gathers still writing the params (a new wrapper may copy them next), then
    remove every hook."""
    comm.finish_param_sync()
    for handles in handle_lists:
        remove_handles(handles)
