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
  ``load_state_dict`` around the state conversions; those three methods come from the base
  class ``StateDictMethods`` (``state_dict_methods``).
- ``WrapperLifetime`` (``wrapper_lifetime``): the groups' lease and every hook, given back by
  ``close()`` or when a dropped wrapper is collected.

The construction steps (config, layout, communicator, shards, the runtime objects over them, the
attached model's hooks) are in ``wrapper_init``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from sharded_opt.guards.wrapped_guard import ADD_GROUPS_FIRST, WrappedOptimizerGuard
from sharded_opt.state.state_view import ShardedStateView
from sharded_opt.state_dict_methods import StateDictMethods
from sharded_opt.step.step_pipeline import amp_scaling_arguments
from sharded_opt.strategy import Strategy
from sharded_opt.wrapper_init import AttachedModel, build_runtime


class ShardingStage1(StateDictMethods):
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
        strategy: a :class:`Strategy`; default ``Strategy()``. It is copied: later changes to
            the object do not affect this wrapper.
        process_group: ranks to shard over; default the whole world. The wrapper communicates
            on a group of its own over the same ranks (:attr:`process_group`).
        model: the module that holds the params (some may live outside it, such as a loss
            module's), attached at once, see :meth:`attach`.
        assume_elementwise: accept an optimizer class not known to be element-wise, on the
            caller's word that each element's update depends only on its own grad and state.
        device_mesh: hybrid sharding given as FSDP2's HSDP takes it: a 2-D ``DeviceMesh`` of
            dims (replicate, shard), each row a shard group (``docs/hybrid-sharding.md``). Not
            together with ``process_group`` or ``degree``.

    Raises:
        TypeError: ``optimizer`` is not a supported ``torch.optim.Optimizer``; bad argument types.
        ValueError: what cannot be sharded as given (no trainable params, duplicate or sparse
            params, ranks with different params, an optimizer already stepped or wrapped, a bad
            ``degree`` or ``device_mesh``, ...): every case and its fix in ``docs/errors.md``.
        RuntimeError: no initialized process group.

    Grads: ``param.grad`` stays a view of the flat grad buffer and holds this rank's local
    (not averaged) grad; the averaged grad of the local shard is what the optimizer steps, and
    what the clipping methods see. A bucket of many tiny params keeps autograd's own grads
    instead and copies them in at ``step()`` (Note [Staged grads] in ``fusion.layout``).

    ``plan`` (the bucket layout), ``shards`` (the buffers, per-bucket shards and inner optimizer)
    and ``grad_sync`` (the reductions) are the runtime pieces, for the library's checkpointing
    and scaler, tests and benchmarks, not for training code.
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
        built = build_runtime(
            self, optimizer, model, strategy, overlap, assume_elementwise, process_group, device_mesh
        )
        self.overlap, self.sharded = built.config.enable_overlap, built.config.enable
        self.collective_entry_timeout_s = built.config.collective_entry_timeout_s
        self.plan, self.shards, self.shard_groups = built.shards.plan, built.shards, built.shards.groups
        self.grad_sync, self.entry_guard, self._lifetime = built.grad_sync, built.entry_guard, built.lifetime
        self._param_sync, self._param_guard = built.param_sync, built.param_guard
        self._clipping, self._pipeline = built.clipping, built.pipeline
        self._state_dicts, self._attacher = built.state_dicts, built.attacher
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.state = ShardedStateView()  # type: ignore[assignment]  # Note [No per-param state]
        # The wrapper's groups *are* the wrapped optimizer's group dicts, so a scheduler built on
        # either object drives the step, and keys added to either show up in both.
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self._layout_frozen = True
        if model is not None:
            self._take_over(self._attacher.install(model))  # checked by check_locally, before any collective
        self._wrapped_guard = WrappedOptimizerGuard(self, optimizer)
        self._lifetime.keep_wrapped_guard(self._wrapped_guard)

    # -- training loop ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Average grads over the group, step the local shard, share the updated params.

        As in ``torch.optim``, a param without a grad (on every rank) is not stepped: its value
        and state are left exactly as they are. Keyword arguments are passed to the wrapped
        optimizer's ``step``. Returns the closure's result (the loss).
        """
        self._lifetime.check_open("step")
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
        """Clip the averaged grads by their global norm; returns the total norm (collective).

        Equals ``torch.nn.utils.clip_grad_norm_`` over the unsharded, averaged grads, on every
        rank; params without a grad count neither in the norm nor in the clipping. Call it
        between backward and ``step()``: it finishes the grad reduction now, and ``step()`` uses
        the clipped grads. ``param.grad`` (the local grads) is not changed, so zero grads between
        steps as usual (see ``docs/user-guide.md``).

        Raises:
            ValueError: ``norm_type`` is not positive.
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
        """
        return self._clipping.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the averaged grads, without clipping: what DDP users log with
        ``get_total_norm`` over ``param.grad``, which here holds only this rank's local grads.
        Computed and called as :meth:`clip_grad_norm_`'s norm; grads are not changed.

        Raises:
            ValueError: ``norm_type`` is not positive.
        """
        return self._clipping.grad_norm(norm_type)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the averaged grads to ``[-clip_value, clip_value]``, as
        ``torch.nn.utils.clip_grad_value_`` over the unsharded ones (each rank clamps its own
        shard). Called as :meth:`clip_grad_norm_`; ``param.grad`` is not changed."""
        self._clipping.clip_grad_value_(clip_value)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate grads of the backward passes inside the block without communicating, as
        DDP's: every micro-batch's backward but the last inside it (blocks nest). In sync mode
        communication only happens in ``step()`` anyway, so the block changes nothing."""
        return self.grad_sync.no_sync()

    def sync_params(self) -> None:
        """Wait until every param holds its updated value (a no-op unless overlap with a model
        attached left all-gathers running). Torch functions wait by themselves (Note [Reads
        right after step]); call it before reads of params they do not see: from another
        thread, under ``torch._C.DisableTorchFunction()``, or before replaying a CUDA graph.

        Raises:
            RuntimeError: a param was written (``param.copy_``...) while it was still being
                all-gathered (Note [Writes while params are gathered]).
        """
        self._param_sync.finish_param_sync()

    def wait_for_params(self, stream: torch.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait until every param holds its updated
        value, without blocking the host on NCCL (``docs/accelerators.md``); on CPU this is
        :meth:`sync_params`. Work that no forward pre-hook sees needs it first: every CUDA graph
        replay (on the stream that replays), reads of params on another stream.

        Raises:
            TypeError: ``stream`` is not a ``torch.Stream`` (or None).
            ValueError: ``stream`` is on another device than the params.
            RuntimeError: as :meth:`sync_params`.
        """
        self._param_sync.wait_for_params(stream)

    def attach(self, model: nn.Module) -> None:
        """Make ``model`` start equal on every rank and let its forward wait per module for its
        own params' all-gathers.

        As DDP's constructor does, every param and buffer of ``model`` is broadcast from the
        group's first rank (collective), and with ``broadcast_buffers`` (the default, as DDP's)
        buffers again before each forward with grad. In overlap mode ``step()`` then returns at
        once (Note [No stale params]; ``docs/user-guide.md``).

        Raises:
            ValueError: ``model`` holds none of the optimizer's trainable params, a module of
                it makes sparse grads for them (``nn.Embedding(sparse=True)``) or renormalizes
                them in forward (``nn.Embedding(max_norm=...)``), or a model is already attached.
        """
        self._take_over(self._attacher.attach(model))

    def close(self) -> None:
        """Wait for the all-gathers in flight, remove every hook and destroy the process groups
        this wrapper created (collective: call it on every rank; Note [Releasing a wrapper's
        groups] in ``communicator_pool``); over a strict subgroup they are kept for the next
        wrapper over the same ranks instead. Calling it again does nothing. ``with
        ShardingStage1(...) as opt:`` closes at the end of the block (this rank alone, keeping
        the groups, when an exception ends it).

        The model and the wrapped torch optimizer are then as if never wrapped (params stay views
        of the flat buffers): a new ``ShardingStage1`` can be built over the same params or torch
        optimizer, which may also step on its own again; this one's ``step()`` raises. A wrapper
        dropped without ``close()`` gives its groups to the next wrapper over the same ranks and
        loses its hooks when collected (Note [Hook lifetimes and copies]), so a loop that drops
        wrappers stays bounded; its torch optimizer keeps refusing ``step()``.
        """
        self._lifetime.close(release_groups=True)

    def __enter__(self) -> ShardingStage1:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # After an exception the other ranks may never reach close(): no collective then.
        self._lifetime.close(release_groups=exc_type is None)

    # -- introspection -----------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank."""
        return self.shards.optimizer_state_bytes()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training, by kind: ``params`` and ``grads`` (the flat
        buffers, padding included), ``reduced_grads`` (the averaged grads the optimizer steps,
        when not the grad buffer itself), ``master`` (master copies of the local shard),
        ``published`` (with ``param_compression``: the local shard's params as last sent, Note
        [Compressed wire] in ``compression``), ``optimizer_state``, ``staging`` (grads cast to
        ``reduce_dtype`` for the reduce-scatter, Note [Bounded staging] in ``comm_context``;
        none on CPU gloo, which widens on receipt), ``grad_residual`` (with
        ``grad_error_feedback``: the fp32 residual of the grads sent, Note [Error feedback] in
        ``compression``)."""
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

    # -- internals -------------------------------------------------------------------------

    def _take_over(self, attached: AttachedModel) -> None:
        """Keep the attached model's hooks for ``close()``; in overlap mode, leave the
        all-gathers to its per-module waits."""
        self._lifetime.keep_hooks(attached.handles)
        if attached.waiter is not None:
            self._param_sync.wait_per_module(attached.waiter)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or a ``with`` block ended): the hooks and, when it spans
        the world, the process groups are gone, so ``step()`` and the state-dict methods raise."""
        return self._lifetime.closed

    @property
    def process_group(self) -> ProcessGroup:
        """The wrapper's own communicator over the ranks it was built for (Note [One
        communicator per wrapper] in ``communicator_pool``)."""
        return self.shard_groups.world

    @property
    def rank(self) -> int:
        """This rank's index in :attr:`process_group`."""
        return self.shard_groups.world_rank

    @property
    def world_size(self) -> int:
        """The number of ranks of :attr:`process_group`."""
        return self.shard_groups.world_size

    def __reduce_ex__(self, protocol: int) -> Any:
        """Refuse pickling and ``copy.deepcopy``: a copy would share or lose the process group,
        the flat buffers the params view and the hooks, and fail later at ``step()``."""
        raise TypeError(
            "ShardingStage1 cannot be pickled or copied: it holds a process group, the flat buffers "
            "its params are views of, and hooks on them. Save opt.state_dict() (or use "
            "sharded_opt.save_checkpoint(path, model, opt)) and build a new ShardingStage1 to restore"
        )
