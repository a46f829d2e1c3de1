"""``ShardingStage1``: ZeRO stage 1 around an existing ``torch.optim`` optimizer.

Note [Step pipeline]
    Buckets' reductions land in bucket order (bucket 0 holds the last layers, whose grads
    backward produces first; gloo completes a group's collectives in issue order). ``step()``
    therefore takes the buckets in that order: it waits for bucket 0's reduction alone, steps
    bucket 0's shard, then waits for bucket 1, and so on, so the optimizer works while later
    reductions are still on the wire, instead of waiting for all of them first (Megatron's
    ``overlap_param_gather_with_optimizer_step`` idea). The presence flags travel just before
    each bucket's reduction, or on gloo on a group of their own right after the last one (Note
    [Presence per bucket] in ``grad_presence``), so nothing else has to land first.

    A bucket's step is one call of the wrapped optimizer's ``step`` over that bucket's pieces
    only (its param groups temporarily hold just them; pieces of params without a grad are left
    out as before). torch's element-wise optimizers keep every piece of state per param
    (``step`` included), so N calls over disjoint pieces compute bitwise what one call over all
    of them does. A class that is not one of torch's own (``assume_elementwise=True``) may keep
    state per call, so it is stepped once, over every bucket, after every reduction; so is any
    optimizer on one rank, where there is nothing to wait for.

    ``clip_grad_norm_`` and ``ShardedGradScaler`` need every shard's grads before any step (a
    global norm, a global inf flag): they finish every reduction themselves, and the pipeline
    then only steps.

    All-gathers: each bucket's all-gather starts behind the last optimizer op of its own step
    (``start_param_sync`` makes the comm stream wait for it). They are issued after the whole
    step, in forward order (reverse bucket index), not one after each bucket's step: the
    latter queues them in backward order, and gloo runs a group's collectives in issue order,
    so the next forward's first module (last bucket) would wait for every all-gather; see
    ``benchmarks/results/2026-12-03-pipeline-cpu-2core.md`` for both measured.

Note [Collectives from agreed state]
    Collectives must be issued alike on every rank: the same ones, in the same order, or the
    ranks wait for each other until the timeout (and gloo may pair up different ones). So every
    branch that decides whether, which or how many collectives a rank issues reads only state
    that is the same on every rank: the layout (the same params, world size and options), what
    every rank's training loop does alike (as DDP also requires: the same calls of ``step()``,
    ``zero_grad()``, ``clip_grad_norm_``, the scaler and the checkpoint APIs, the same number of
    backwards, the same ``requires_grad`` flags), or a value the ranks agreed on through a
    collective. Never a rank's own grads: which params got a grad differs between ranks (a
    branch or expert that runs on some ranks only). Decision by decision:

    - Which buckets are reduced (``GradReadyTracker.takes_part``): those with a param that
      requires grad, in bucket order; during backward as they complete, the rest at the end of
      backward (overlap) or all at ``step()`` (sync). Buckets whose params are all frozen now:
      after the others, where the agreed presence flags show a grad on some rank
      (``_start_frozen_grad_sync``, Note [Frozen after backward] in ``grad_hooks``). This was a
      rank's own fact before ("this rank holds a grad in a frozen param") and hung 2-4 ranks.
    - Presence flags (``_share_presence``): every bucket's, once per iteration: per bucket right
      before the reductions above where they share the group, the rest in one all-reduce
      after the last launch (Note [Presence per bucket] in ``grad_presence``). Their values
      differ per rank; which buckets' flags go in which all-reduce does not.
    - Reducing again (Note [A second backward]) and reusing the last step's grads (Note [A step
      without backward]): read from the hooks' and the buffers' state, the same on every rank
      when every rank runs the same number of backwards.
    - Which shards are stepped and all-gathered (``_step_pipeline``): the agreed presence flags;
      the all-gathers in the one gather order. Per-module waits for them issue nothing.
    - The replica all-reduce of hybrid sharding: one after each bucket's reduce-scatter, issued
      in bucket order (Note [Replica all-reduce order] in ``bucket_comm``).
    - ``clip_grad_norm_`` (one norm all-reduce), the scaler (one found-inf all-reduce per
      ``unscale_``), ``state_dict``/checkpoints (collectives fixed by the layout and the world
      size; the collective guard raises when a rank did not call them): issued per call, and
      every rank makes the call. Absent grads are zeroed from the agreed flags before a norm.
    - ``close()`` and ``sync_params()`` wait for collectives already issued and issue none.

    ``tests/differential.py`` runs its programs with torch's collective check (Note in its
    ``check_collectives_across_ranks``), so a rank that breaks this fails loudly in the tests.

Note [Params replaced after wrapping]
    Code outside the wrapper replaces ``param.data`` rather than writing into it: WGAN and
    old scripts write ``p.data = p.data.clamp(-c, c)``, weight loading code assigns
    ``p.data = tensor``, and cuDNN's ``flatten_parameters`` on a GPU moves an RNN's weights into
    a new blob of its own (after ``model.cuda()``, or when it finds them scattered). In plain
    torch the param simply holds the new values from then on. Here the optimizer steps the flat
    buffer, so ``step()`` (and ``clip_grad_norm_``) first takes such a param back: the new
    values are copied into its slot and ``.data`` is pointed at the slot again, as
    ``adopt_grad`` does for an assigned grad. Its grads keep flowing meanwhile: a param's grad
    hook stops reporting only when a newer wrapper takes the param, never because ``.data``
    moved. What cannot be taken back raises: a new dtype or device (``model.half()``,
    ``model.to(...)``), a new shape, or memory of another param (``a.data = b.data`` ties two
    params, which separate slots cannot). Every rank must replace alike, as every write to
    params must be.

    A new shape (Hugging Face's ``resize_token_embeddings`` after wrapping) would not even reach
    ``step()``: the next backward fails inside autograd adding the new-shape grad to the param's
    old-shape grad view. So the attached model's first forward pre-hook refuses it in forwards
    with grad enabled (one C-level pass over the params' data pointers per forward; forwards
    without grad, such as ``generate()``, work as in torch). The fix it names, a new optimizer
    and wrapper, must work while the old wrapper lives on: the new layout drops the leftover
    grad of the old shape (in torch it would be None after ``zero_grad()``), and the old
    wrapper's check passes over params a newer layout took (``FlatBuffers.owns``).

Note [A step without backward]
    torch's ``step()`` reads ``param.grad``, and after a step those are the grads it stepped
    with, averaged (by DDP), clipped, unscaled: a second ``step()`` with no backward in between
    (an SAM-like loop, a retried step, a skipped iteration without ``zero_grad()``) steps again
    with exactly them. Here ``param.grad`` holds the local grads and the averaged shard the
    optimizer stepped sits in the shard's own tensors; reducing the local grads again would
    drop a clip or an unscaling done on the shard (and on some world sizes round the mean anew).
    So ``step()`` records the grad buffers' versions and which params' grads are the buffers'
    views, and the next reduction (``step()``, ``clip_grad_norm_``, ``clip_grad_value_``, the
    scaler's) reuses the shard's grads when nothing changed since: no backward accumulated
    (it bumps the buffer's version), no ``zero_grad`` ran, no grad was assigned or set to None.
    Only the presence flags are shared again, so params without a grad stay unstepped.

Note [Step hooks]
    Hooks registered with ``register_step_pre_hook``/``register_step_post_hook`` on the wrapped
    torch optimizer (an EMA update, a logger, a library's bookkeeping), before or after
    wrapping, fire around every ``step()`` of the wrapper, as they fired around the torch
    optimizer's own step: the wrapper registers two hooks of its own, first in its hook lists,
    that run the wrapped optimizer's current hooks with the wrapped optimizer as their first
    argument (a pre-hook may replace the arguments, as in torch). The wrapper's own hooks and
    torch's global ones fire as for any optimizer. The inner optimizer's per-bucket steps are
    an implementation detail: they run its class's step without torch's hook wrapper, so a
    global hook (``register_optimizer_step_post_hook``) fires once per ``step()``, never once
    per bucket with the inner optimizer. When ``ShardedGradScaler`` skips the update, the
    wrapper's step (and its own hooks) still runs, as a fused optimizer's does; the wrapped
    optimizer's hooks fire then only if its class takes ``found_inf`` itself (fused Adam):
    for any other class ``GradScaler.step`` would not have called its ``step`` at all, and an
    EMA hook would average in a step that never happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from fusion.bucket_sizing import trainable_bytes
from fusion.buffers import FlatBuffers
from fusion.layout import LayoutPlan, plan_layout
from sharded_opt import collectives
from sharded_opt import state_dict as state_dict_conversion
from sharded_opt.bucket_comm import BucketCommunicator
from sharded_opt.collective_guard import check_all_ranks_enter
from sharded_opt.grad_hooks import GradReadyTracker
from sharded_opt.grad_presence import GradPresence, presence_group
from sharded_opt.hybrid_groups import resolve_shard_groups
from sharded_opt.inner_optimizer import (
    add_shard,
    build_inner_optimizer,
    check_steps,
    copy_group_updates,
    hyperparameters,
    indexed_groups,
    step_without_hooks,
)
from sharded_opt.local_shard import resolve_precision
from sharded_opt.param_hooks import BufferBroadcaster, ParamReadyWaiter, register_eager_pre_hook
from sharded_opt.state_view import ShardedStateView
from sharded_opt.strategy import Strategy
from sharded_opt.streams import on_stream
from sharded_opt.validation import (
    DROP_DDP,
    TORCH_OPTIMIZERS,
    check_optimizer,
    check_same_layout,
    check_trained_modules,
    collect_params,
)
from sharded_opt.weak_hooks import remove_handles


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
        config = _resolve_config(strategy, overlap)
        needs = check_optimizer(optimizer, assume_elementwise)
        _check_not_stepped(optimizer)
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
        sharded = config.enable and groups.shard_size > 1
        bucket_sizes = config.bucket_sizes(trainable_bytes(specs))
        self.plan: LayoutPlan = plan_layout(
            specs,
            groups.shard_size if sharded else 1,
            align_bytes=config.align_bytes,
            bucket_size_bytes=bucket_sizes.bucket_bytes,
            first_bucket_bytes=bucket_sizes.first_bucket_bytes,
            whole_param_cost=needs.param_cost if needs.whole_params else None,
        )
        precisions = [
            resolve_precision(bucket.dtype, config.reduce_dtype, config.master_dtype)
            for bucket in self.plan.buckets
        ]
        if type(optimizer) in TORCH_OPTIMIZERS:  # Note [Refused at the first step]
            check_steps(
                optimizer,
                {
                    (b.group_index, p.master_dtype, b.device)
                    for b, p in zip(self.plan.buckets, precisions, strict=True)
                },
                probe_shape=(2, 2) if needs.whole_params else (2,),
            )
        self._buffers = FlatBuffers(self.plan, params)
        self._broadcast_from_first_rank()
        if sharded:
            self._comm = BucketCommunicator(
                self._buffers,
                groups.shard,
                groups.shard_rank,
                groups.shard_size,
                True,
                precisions,
                replicate_group=groups.replicate,
                point_to_point=config.gloo_point_to_point,
            )
        else:
            self._comm = BucketCommunicator(self._buffers, group, rank, world_size, False, precisions)
        if optimizer.state:
            # The class creates state at construction (Adagrad): it exists for every param, frozen
            # or not, so every bucket needs its pieces now, as the plain optimizer has them.
            for bucket in self.plan.buckets:
                self._comm.materialize(bucket.index)
        self._inner = build_inner_optimizer(optimizer, self._comm.live_shards())
        # Forward order is registration order (buckets are laid out in reverse), see
        # Note [No stale params].
        self._gather_order = list(reversed(range(len(self.plan.buckets))))
        self._grad_tracker = GradReadyTracker(
            self._buffers,
            self._materialize,
            self._start_bucket_sync if self.overlap else None,
            self._start_unlaunched_presence if self.overlap else None,
            self._comm.note_grad_stream if self.overlap and self._comm.stream is not None else None,
            self._restart_grad_sync if self.overlap and (self._comm.sharded or world_size == 1) else None,
        )
        flags_group = presence_group(groups, self._flag_device)
        self._presence = GradPresence(
            self.plan.buckets,
            flags_group,
            world_size,
            self._flag_device,
            per_bucket=world_size > 1 and flags_group is groups.world,
        )
        self._local_presence = bytearray(len(params))
        # See Note [Step pipeline]: torch's own classes keep all state per param, so stepping
        # them bucket by bucket is exact; another class may keep state per step() call.
        self._step_per_bucket = world_size > 1 and needs.state_per_param
        self._param_waiter: ParamReadyWaiter | None = None
        self._param_names: dict[int, str] = {}
        self._grads_reduced = False
        self._grads_at_step: tuple[list[int | None], list[bool]] | None = None
        self._consolidated: _Consolidated | None = None
        self._num_params_per_group = [len(g["params"]) for g in optimizer.param_groups]
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.state = ShardedStateView()  # type: ignore[assignment]  # Note [No per-param state]
        # The wrapper's groups *are* the wrapped optimizer's group dicts, so a scheduler built on
        # either object drives the step, and keys added to either show up in both.
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self._wrapped = optimizer
        self._layout_frozen = True
        self._broadcast_buffers = config.broadcast_buffers
        self._track_hooks()
        if model is not None:
            self._attach(model)  # its grads were checked to be dense above, before any collective
        self._mark_wrapped(optimizer)

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
        self._check_params_in_buffers()
        self._check_param_groups_unchanged()
        found_inf, grad_scale = self._amp_scaling_arguments()
        self.sync_params()
        if found_inf is None:
            self._launch_grad_sync()
        else:
            self._reduce_grads()  # the scaler reduced them already, to check the averaged grads
        if found_inf is not None and float(found_inf) > 0:
            self._start_iteration()  # the scaler saw an inf on some rank: every rank skips
            return loss
        if grad_scale is not None:
            inverse = grad_scale.double().reciprocal().float()
            torch._foreach_mul_(self._comm.local_grads(), inverse)
        self._step_pipeline(kwargs)
        if self._param_waiter is None or self._param_waiter.forward_compiled:
            self._comm.finish_param_sync()
        else:
            self._param_waiter.gathers_started(self._comm.pending_param_buckets())
        self._start_iteration()
        self._grads_at_step = self._grads_snapshot()
        # A scheduler built on the wrapped optimizer checks that its step ran before its own.
        self._wrapped._opt_called = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffers.

        Grads stay views of the buffers the collectives read, so they are zeroed in place rather
        than set to None; with ``set_to_none=True`` (the default) every param also counts as
        having no grad, exactly as after torch's ``zero_grad()``: a param that no backward
        reaches before the next ``step()`` is not stepped.
        """
        self._refuse_converted_before_zero_grad()
        self._comm.finish_grad_sync()
        if not set_to_none:
            # torch's zero_grad(set_to_none=False) leaves a None grad None (a layer whose grads
            # model.zero_grad() dropped): it stays without a grad, though its view is zeroed too.
            self._grad_tracker.forget_none_grads()
        self._buffers.zero_grad()
        self._grads_at_step = None
        if set_to_none:
            self._grad_tracker.clear_received()
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
        for grad in self._comm.local_grads():
            grad.mul_(coefficient.to(grad.dtype))
        self._grad_tracker.accept_grad_writes()
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
            # Replicas hold equal shards after the replicate all-reduce: each element counts once.
            dist.all_reduce(local, op=op, group=self._comm.group)
        return local if norm_type == math.inf else local ** (1.0 / norm_type)

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
        self._check_params_in_buffers()
        self._reduce_grads()
        for grad in self._comm.local_grads():
            grad.clamp_(-clip_value, clip_value)
        self._grad_tracker.accept_grad_writes()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads of the backward passes inside the block without communicating.

        As with DDP: run every micro-batch's backward but the last inside ``no_sync()``; the
        last backward (outside) then reduces the summed grads. In sync mode communication only
        happens in ``step()`` anyway, so the block changes nothing there. Blocks nest: leaving
        an inner block restores the state of the outer one, as DDP's does.
        """
        if not self.overlap:
            yield
            return
        previous = self._grad_tracker.accumulate_only
        self._grad_tracker.accumulate_only = True
        try:
            yield
        finally:
            self._grad_tracker.accumulate_only = previous

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
        if self._param_waiter is None:
            self._comm.finish_param_sync()
        else:
            self._param_waiter.finish()

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
        device = self.plan.buckets[0].device
        if stream is not None and not isinstance(stream, torch.Stream):
            raise TypeError(
                f"ShardingStage1.wait_for_params expects stream to be a torch.Stream or None but got "
                f"{type(stream).__name__}; pass e.g. torch.cuda.current_stream()"
            )
        if stream is not None and stream.device != device:
            raise ValueError(
                f"ShardingStage1.wait_for_params expects a stream on the params' device {device} but "
                f"got one on {stream.device}; pass a stream of {device} or stream=None"
            )
        with on_stream(None if self._comm.stream is None else stream):
            self.sync_params()

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
        if self._param_waiter is not None:
            raise ValueError("ShardingStage1.attach: a model is already attached to this optimizer")
        check_trained_modules(model, self._buffers.params)
        self._attach(model)

    def _attach(self, model: nn.Module) -> None:
        waiter = ParamReadyWaiter(model, self._buffers, self._comm.finish_param_sync)
        names = {id(param): name for name, param in model.named_parameters()}
        self._param_names = {
            index: names[id(param)] for index, param in enumerate(self._buffers.params) if id(param) in names
        }
        self._hook_handles.append(register_eager_pre_hook(model, self._check_before_forward))
        self._broadcast_model_state(model)
        if self._broadcast_buffers and self.world_size > 1 and next(model.buffers(), None) is not None:
            self._buffer_broadcaster = BufferBroadcaster(model, self.process_group, self._first_rank())
            self._hook_handles += self._buffer_broadcaster.handles
        if self.overlap:
            self._param_waiter = waiter
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
        """
        self._closed = True
        self._release()
        remove_handles(self._refusals)
        original = self._wrapped_optimizer()
        if original is not None:
            original._sharded_opt_wrapper = None
            original.__dict__.pop("add_param_group", None)

    def __enter__(self) -> ShardingStage1:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- introspection -----------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank."""
        return sum(
            value.numel() * value.element_size()
            for state in self._inner.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        )

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training, by kind.

        Keys: ``params`` and ``grads`` (the flat buffers, padding included), ``reduced_grads``
        (the averaged grads the optimizer steps, when not the grad buffer itself), ``master``
        (master copies of the local shard), ``optimizer_state``, ``staging`` (casts of grads to
        ``reduce_dtype`` for the reduce-scatter: at most two buffers of the largest such bucket,
        allocated at the first reduction, see Note [Bounded staging] in ``bucket_comm``).
        """

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "params": nbytes(self._buffers.param_buffers),
            "grads": nbytes(g for g in self._buffers.grad_buffers if g is not None),
            "reduced_grads": nbytes(self._comm.reduced_grad_tensors()),
            "master": nbytes(s.master for s in self._comm.live_shards() if s.master is not None),
            "optimizer_state": self.optimizer_state_bytes(),
            "staging": self._comm.staging_bytes(),
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout_frozen", False):
            raise RuntimeError(f"ShardingStage1 lays params out once, when it is built; {_ADD_GROUPS_FIRST}")
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
            state = state_dict_conversion.gather_state_dict(self, to_rank)
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
        gathered = state_dict_conversion.gather_state_dict(self, to)
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
        state_dict_conversion.load_state_dict(self, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- internals -------------------------------------------------------------------------

    def _broadcast_from_first_rank(self) -> None:
        if self.world_size == 1:
            return
        for buffer in self._buffers.param_buffers:
            dist.broadcast(buffer, src=self._first_rank(), group=self.process_group)

    def _first_rank(self) -> int:
        return dist.get_global_rank(self.process_group, 0)

    def _broadcast_model_state(self, model: nn.Module) -> None:
        """Broadcast what the flat buffers did not cover: frozen params, params the optimizer
        does not hold, and buffers."""
        if self.world_size == 1:
            return
        laid_out = {id(self._buffers.params[index]) for index in self._buffers.laid_out_indices}
        tensors = [p for p in model.parameters() if id(p) not in laid_out] + list(model.buffers())
        if tensors:
            collectives.broadcast_coalesced(tensors, self.process_group, self._first_rank())

    def _track_hooks(self) -> None:
        """Arrange for every hook to be removed by ``close()`` or when this wrapper is
        collected, see Note [Hook lifetimes and copies]."""
        self._closed = False
        self._hook_handles: list[RemovableHandle] = []
        self._wrapped_optimizer: weakref.ref[torch.optim.Optimizer] = lambda: None
        # The tracker's list, not a copy: it grows when params are unfrozen later.
        self._release = weakref.finalize(
            self, _release_hooks, self._comm, self._hook_handles, self._grad_tracker.handles
        )
        # At interpreter exit the process group may be gone; there is nothing to wait for then.
        self._release.atexit = False

    def _mark_wrapped(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` refuse to be wrapped again while this wrapper lives, and to step,
        save or load its state until ``close()`` (stepping it is a mistake even after the
        wrapper was dropped: ranks would diverge; its own state is empty, so a checkpoint of it
        would silently hold no moments, and state loaded into it would never be used)."""
        optimizer._sharded_opt_wrapper = weakref.ref(self)
        self._refusals = [
            optimizer.register_step_pre_hook(_refuse_wrapped_step),
            optimizer.register_state_dict_pre_hook(_refuse_wrapped_state_dict),
            optimizer.register_load_state_dict_pre_hook(_refuse_wrapped_load_state_dict),
        ]
        # Note [Step hooks]: first in the wrapper's lists, before any hook a user adds to it.
        self._hook_handles.append(self.register_step_pre_hook(_run_wrapped_pre_hooks))
        self._hook_handles.append(self.register_step_post_hook(_run_wrapped_post_hooks))
        optimizer.add_param_group = functools.partial(_refuse_wrapped_add_param_group, type(optimizer))
        self._wrapped_optimizer = weakref.ref(optimizer)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "ShardingStage1.step: this optimizer was closed (close() or the end of its `with` "
                "block) and its hooks are gone; build a new ShardingStage1 to keep training"
            )

    def _check_params_in_buffers(self) -> None:
        """Take back params whose ``.data`` was replaced, or raise where that cannot be right;
        see Note [Params replaced after wrapping]."""
        moved = self._buffers.detached_params()
        if not moved:
            return
        self._refuse_unadoptable(moved)
        self.sync_params()  # an all-gather still running must not land over the adopted values
        for index in moved:
            self._buffers.adopt_param(index)

    def _check_before_forward(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of the attached model, for forwards with grad enabled (forwards
        without grad, ``generate()`` and evaluation, work as in torch).

        A ``DistributedDataParallel`` added around the model after wrapping (as Hugging Face
        Trainer, Accelerate and Lightning do) is refused at its first forward, see Note [Grads
        written at the end of backward] in ``grad_hooks``. A param that ``param.data = t`` gave
        another shape (``model.resize_token_embeddings(n)`` after wrapping) is refused instead of
        by torch's shape error when the next backward adds its grad to the old-shape grad view,
        see Note [Params replaced after wrapping]."""
        if not torch.is_grad_enabled():
            return
        if nn.parallel.DistributedDataParallel._active_ddp_module is not None:
            self._refuse_data_parallel(nn.parallel.DistributedDataParallel._active_ddp_module)
        with torch._C.DisableTorchFunction():  # plain pointer reads, never the read guard's waits
            if not self._buffers.any_param_detached():
                return
            moved = [index for index in self._buffers.detached_params() if self._buffers.owns(index)]
        self._refuse_reshaped(moved)

    def _refuse_data_parallel(self, wrapper: nn.Module) -> None:
        ours = {id(param) for param in self._buffers.params}
        if any(id(param) in ours for param in wrapper.parameters()):
            raise RuntimeError(
                "ShardingStage1: the model runs inside a DistributedDataParallel wrapper added "
                "after the optimizer was wrapped (the accelerator of Hugging Face Trainer, Accelerate "
                "and Lightning adds one: use the adapters of sharded_opt.integrations). It would "
                f"average the grads a second time. {DROP_DDP}"
            )

    def _refuse_converted_before_zero_grad(self) -> None:
        """``zero_grad()`` points every grad at its buffer view again; a param that
        ``model.half()`` or ``model.to(...)`` moved out of the buffers (or gave a new shape) is
        refused with the fix, instead of torch's "assign a gradient with dtype 'float' to a
        tensor with grad_dtype 'Half'"; see Note [Params replaced after wrapping]."""
        with torch._C.DisableTorchFunction():  # plain pointer reads, never the read guard's waits
            if not self._buffers.any_param_detached():
                return
            moved = [index for index in self._buffers.detached_params() if self._buffers.owns(index)]
        self._refuse_converted(moved)
        self._refuse_reshaped(moved)

    def _refuse_unadoptable(self, moved: list[int]) -> None:
        self._refuse_converted(moved)
        self._refuse_reshaped(moved)
        params = self._buffers.params
        flat = {buffer.untyped_storage().data_ptr() for buffer in self._buffers.param_buffers}
        aliased = [index for index in sorted(moved) if params[index].untyped_storage().data_ptr() in flat]
        if aliased:
            raise RuntimeError(
                f"ShardingStage1: params {aliased[:8]} (optimizer order) were pointed at another "
                "param's memory (`param.data = other.data`); the wrapper keeps every param in a slot "
                "of its own, so the two would no longer be tied. Tie params before building the "
                "optimizer (`module.weight = other.weight`) and wrap it then"
            )

    def _refuse_converted(self, moved: list[int]) -> None:
        converted = [(index, self._buffers.conversion_of(index)) for index in sorted(moved)]
        converted = [(index, change) for index, change in converted if change is not None]
        if converted:
            index, change = converted[0]
            raise RuntimeError(
                f"ShardingStage1: param {self._describe_param(index)} {change} ({len(converted)} "
                "param(s) converted, e.g. by model.half() or model.to(...) after wrapping), so it "
                "no longer lives in the flat buffers and updates would be lost. Cast or move the "
                "model before building the optimizer and wrapping it"
            )

    def _refuse_reshaped(self, moved: list[int]) -> None:
        params, views = self._buffers.params, self._buffers.param_views
        reshaped = [index for index in sorted(moved) if params[index].shape != views[index].shape]
        if reshaped:
            index = reshaped[0]
            raise RuntimeError(
                f"ShardingStage1: `param.data = ...` gave param {self._describe_param(index)} the shape "
                f"{tuple(params[index].shape)} but it was laid out as {tuple(views[index].shape)} (Hugging "
                "Face's model.resize_token_embeddings(n) does this); the optimizer's state and the flat "
                "buffers cannot change shape. Resize the model before building the optimizer and "
                "wrapping it, or build a new optimizer and ShardingStage1 after resizing (close() this one)"
            )

    def _describe_param(self, index: int) -> str:
        name = self._param_names.get(index)
        return f"{index} (optimizer order{'' if name is None else f', {name!r}'})"

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

    def _check_backward_finished(self) -> None:
        if self._grad_tracker.backward_unfinished:
            raise RuntimeError(
                "ShardingStage1.step: the last backward raised before it finished, so its grads are "
                "partial (some buckets were already being reduced). Call opt.zero_grad() to discard "
                "them, then run the iteration again"
            )

    def _start_iteration(self) -> None:
        self._grads_reduced = False
        self._grad_tracker.reset()
        self._presence.discard()  # flags shared but not used when the step was skipped

    def _materialize(self, bucket_index: int) -> None:
        shard = self._comm.materialize(bucket_index)
        if shard is not None:
            add_shard(self._inner, shard)

    def _check_grads_not_written(self) -> None:
        """See Note [Grads written after backward] in ``grad_hooks``."""
        written = self._grad_tracker.grads_written_since_backward()
        if written:
            raise RuntimeError(
                f"ShardingStage1: grads of buckets {written[:8]} were modified in place after backward "
                "(torch.nn.utils.clip_grad_norm_, clip_grad_value_, GradScaler.unscale_, p.grad.mul_(), "
                "...). param.grad holds this rank's local, unreduced grad (in overlap mode it is being "
                "reduced while you write it), so the edit would be lost or differ per rank. Clip with "
                "opt.clip_grad_norm_(max_norm) or opt.clip_grad_value_(clip_value), scale losses with "
                "sharded_opt.ShardedGradScaler, "
                "and scale the loss instead of the grads. Call opt.zero_grad() to discard these grads. "
                f"A DistributedDataParallel around the model writes grads this way too: {DROP_DDP}"
            )

    def _launch_grad_sync(self) -> None:
        """Check the grads and issue every bucket's reduction not issued yet (in overlap mode
        backward issued most of them), each after its bucket's presence flags."""
        self._check_grads_not_written()
        if self._grads_reduced:
            return
        if self._grads_unchanged_since_step():
            # Note [A step without backward]: step again with the grads the last step used.
            self._start_unlaunched_presence()
            self._zero_absent_grads()
            self._grads_reduced = True
            return
        self._grads_at_step = None
        self._check_backward_finished()
        if self.overlap:
            if self._grad_tracker.accumulate_only:
                raise RuntimeError(
                    "ShardingStage1: step() (or a grad reduction) inside `with opt.no_sync():`; the "
                    "grads of the block are never averaged over the ranks. Leave the block for the "
                    "last micro-batch's backward, then call step()"
                )
            self._grad_tracker.flush()
        else:
            self._grad_tracker.adopt_all()
            for bucket in self.plan.buckets:
                if self._grad_tracker.takes_part(bucket.index):
                    self._start_bucket_sync(bucket.index)
            self._start_unlaunched_presence()
        self._start_frozen_grad_sync()
        self._check_grads_not_dropped()

    def _grads_snapshot(self) -> tuple[list[int | None], list[bool]]:
        """What tells whether grads changed since: the grad buffers' versions and which params'
        grads are their buffer views; see Note [A step without backward]."""
        return self._grad_versions(), self._grads_are_views()

    def _grad_versions(self) -> list[int | None]:
        return [None if buffer is None else buffer._version for buffer in self._buffers.grad_buffers]

    def _grads_are_views(self) -> list[bool]:
        views = self._buffers.grad_views
        return [param.grad is views[index] for index, param in enumerate(self._buffers.params)]

    def _grads_unchanged_since_step(self) -> bool:
        if self._grads_at_step is None:
            return False
        versions, are_views = self._grads_at_step
        return versions == self._grad_versions() and are_views == self._grads_are_views()

    def _reduce_grads(self) -> None:
        """Reduce every bucket's grads now (clipping and the scaler need all of them)."""
        self._launch_grad_sync()
        if not self._grads_reduced:
            self._comm.finish_grad_sync()
            self._zero_absent_grads()
            self._grads_reduced = True
            self._grad_tracker.accept_grad_writes()

    @torch.no_grad()
    def _zero_absent_grads(self) -> None:
        """Zero the reduced grads of params that got no grad on any rank this iteration.

        ``step()`` leaves such params out, but clipping and the scaler read every reduced grad:
        torch's ``clip_grad_norm_`` and ``GradScaler`` skip a param whose ``.grad`` is None,
        whereas here its elements may still hold an earlier iteration's grads (a bucket frozen
        since takes no part in the reduction and keeps its last result; a param frozen after
        ``model.zero_grad()`` set its grad to None keeps its last grad in the grad buffer). They
        would count in the norm, or a past overflow would make the scaler skip every step."""
        for shard in self._comm.live_shards():
            present = self._presence.params_with_grads(shard.bucket.index)
            for grad, owner in zip(shard.inner_grads, shard.inner_owners, strict=True):
                if owner not in present:
                    grad.zero_()

    def _check_grads_not_dropped(self) -> None:
        """In overlap mode which params have grads is shared when their bucket is launched, and
        the bucket's grads are read then: grads set to None after that (``model.zero_grad()``
        between backward and ``step()``) would be stepped anyway, and grads replaced after that
        (``p.grad = p.grad.clamp(...)``) would be silently ignored, so both are refused."""
        if not self.overlap:
            return
        views = self._buffers.grad_views
        dropped, replaced = [], []
        for index, param in enumerate(self._buffers.params):
            grad = param.grad
            if self._local_presence[index] and grad is not views[index]:
                (dropped if grad is None else replaced).append(index)
        if dropped:
            raise RuntimeError(
                f"ShardingStage1(overlap=True): grads of params {dropped[:8]} (optimizer order) were set "
                "to None after backward, when they were already being reduced. Zero grads before "
                "backward (opt.zero_grad() or model.zero_grad()), not between backward and step(); to "
                "leave params out of one step (DINO's cancel_gradients_last_layer), freeze them before "
                "the forward with requires_grad_(False) and unfreeze them after step(), or use "
                "overlap=False, where a grad set to None after backward means no grad as in torch"
            )
        if replaced:
            raise RuntimeError(
                f"ShardingStage1(overlap=True): grads of params {replaced[:8]} (optimizer order) were "
                "replaced (`param.grad = g`) after backward, when the grads backward produced were "
                "already being reduced, so the new ones would be ignored. To clip, call "
                "opt.clip_grad_norm_(max_norm) or opt.clip_grad_value_(clip_value) instead; grads "
                "computed without a backward (assigned after opt.zero_grad()) are taken as they are; "
                "with overlap=False an assigned grad is averaged over the ranks like any other. A "
                "DistributedDataParallel(gradient_as_bucket_view=True) around the model replaces "
                f"grads this way: {DROP_DDP}"
            )

    def _restart_grad_sync(self) -> None:
        """Wait for this iteration's reductions and forget them (a second backward before
        ``step()``, see Note [A second backward] in ``grad_hooks``)."""
        if self._grads_reduced:
            raise RuntimeError(
                "ShardingStage1(overlap=True): a backward ran after opt.clip_grad_norm_ (or "
                "clip_grad_value_, ShardedGradScaler.unscale_) and before step(); the grads would be "
                "reduced again without the clipping. Clip (or unscale) after the last backward, right "
                "before step()"
            )
        self._comm.finish_grad_sync()
        self._presence.discard()
        self._grads_reduced = False

    def _start_bucket_sync(self, bucket_index: int) -> None:
        """Share the bucket's presence flags (where they go per bucket), then issue its grad
        reduction; see Note [Presence per bucket] in ``grad_presence``."""
        if self._presence.per_bucket:
            self._share_presence([bucket_index])
        self._comm.start_grad_sync(bucket_index)

    def _start_frozen_grad_sync(self) -> None:
        """Reduce the buckets whose params are all frozen now where some rank still holds a grad
        in them, after every other bucket; decided from the presence flags every rank agreed on,
        see Note [Frozen after backward] in ``grad_hooks``."""
        for bucket_index in self._grad_tracker.frozen_buckets():
            if any(self._presence.agreed(bucket_index)):
                self._grad_tracker.settle_frozen(bucket_index)
                self._comm.start_grad_sync(bucket_index)

    def _start_unlaunched_presence(self) -> None:
        """Share the presence flags not shared yet: of the buckets that took no part in this
        reduction, or of every bucket where they are not shared per bucket."""
        unshared = self._presence.unshared()
        if unshared:
            self._share_presence(unshared)

    def _share_presence(self, bucket_indices: list[int]) -> None:
        received = self._grad_tracker.received
        params = self._buffers.params
        local = self._local_presence
        flags = []
        for bucket_index in bucket_indices:
            for slot in self.plan.buckets[bucket_index].slots:
                index = slot.param_index
                local[index] = received[index] and params[index].grad is not None
                flags.append(local[index])
        self._presence.start(bucket_indices, flags)

    @functools.cached_property
    def _flag_device(self) -> torch.device:
        """CPU when the group runs CPU tensors on gloo (no device sync to read the flags), else
        the params' device."""
        if collectives.backend_for_device(self.process_group, "cpu") == "gloo":
            return torch.device("cpu")
        return self.plan.buckets[0].device

    def _step_pipeline(self, kwargs: dict[str, Any]) -> None:
        """Step every bucket's shard and start the all-gathers of those that changed; see Note
        [Step pipeline]."""
        self._sync_hyperparameters()
        order = [shard.bucket.index for shard in self._comm.live_shards()]  # the landing order
        if not self._step_per_bucket:
            self._finish_grads(order)
            stepped = self._step_buckets(order, kwargs)
        else:
            stepped = []
            for bucket_index in order:
                self._finish_grads([bucket_index])
                stepped += self._step_buckets([bucket_index], kwargs)
        self._comm.start_param_sync(b for b in self._gather_order if b in stepped)
        self._mark_params_updated(stepped)

    def _mark_params_updated(self, bucket_indices: list[int]) -> None:
        """Bump the version counter of every param the step changed, as torch's in-place
        optimizer update does: a graph built before ``step()`` that saved a param for its
        backward (``loss1.backward(retain_graph=True); opt.step(); loss2.backward()``) then
        raises torch's "modified by an inplace operation" error instead of silently
        differentiating through the new weights. The update itself went through the flat
        buffers, whose views count versions apart from the params (Note [Writes while params
        are gathered] in ``param_hooks``), so the params' own counters need the bump; it comes
        before ``gathers_started`` records them."""
        params = self._buffers.params
        updated = [
            params[index]
            for bucket_index in bucket_indices
            for index in self._presence.params_with_grads(bucket_index)
        ]
        if updated:
            torch.autograd.graph.increment_version(updated)

    def _finish_grads(self, bucket_indices: list[int]) -> None:
        if self._grads_reduced:
            return  # clip_grad_norm_ or the scaler finished (and maybe clipped) them already
        self._comm.finish_grad_sync(bucket_indices)

    def _step_buckets(self, bucket_indices: list[int], kwargs: dict[str, Any]) -> list[int]:
        """One inner step over the pieces of ``bucket_indices`` whose params got a grad on some
        rank; returns the buckets it changed. Pieces of other params (and other buckets) are
        left out of the step, so, as in torch, they and their state stay untouched."""
        groups: list[list[torch.Tensor]] = [[] for _ in self._inner.param_groups]
        stepped = []
        for bucket_index in bucket_indices:
            shard = self._comm.shards[bucket_index]
            present = self._presence.agreed(bucket_index)
            if shard is None or not any(present):
                continue
            stepped.append(bucket_index)
            shard.refresh_master()
            group = groups[shard.bucket.group_index]
            if all(present):
                group += shard.inner_params
            else:
                owners = self._presence.params_with_grads(bucket_index)
                pieces = zip(shard.inner_params, shard.inner_owners, strict=True)
                group += [piece for piece, owner in pieces if owner in owners]
        if any(groups) or not self._step_per_bucket:
            self._inner_step(groups, kwargs)
        return stepped

    def _inner_step(self, params_per_group: list[list[torch.Tensor]], kwargs: dict[str, Any]) -> None:
        """The wrapped class's ``step`` over ``params_per_group`` only, the groups' full lists
        restored afterwards."""
        inner_groups = self._inner.param_groups
        full = [group["params"] for group in inner_groups]
        try:
            for group, params in zip(inner_groups, params_per_group, strict=True):
                group["params"] = params
            step_without_hooks(self._inner, kwargs)
            copy_group_updates(self._inner.param_groups, self.param_groups)
        finally:
            for group, params in zip(inner_groups, full, strict=True):
                group["params"] = params

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self._inner.param_groups, strict=True):
            inner.update(hyperparameters(outer))

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
    if not config.enable and config.degree is not None:
        raise ValueError(
            f"ShardingStage1 got Strategy().sharding.degree={config.degree} with enable=False: without "
            "sharding every rank holds all state and there are no shard groups to size. Set "
            "enable=True for hybrid sharding, or degree=None for plain data parallel"
        )
    return config


def _check_norm_type(api: str, norm_type: float) -> float:
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"ShardingStage1.{api} expects norm_type > 0 (or inf) but got {norm_type}")
    return norm_type


def _check_not_stepped(optimizer: torch.optim.Optimizer) -> None:
    # An empty entry is what reading ``optimizer.state[p]`` leaves (schedule-free's train()).
    stepped = [state for state in optimizer.state.values() if state and float(state.get("step", 1)) > 0]
    if stepped:
        raise ValueError(
            f"ShardingStage1 expects an optimizer that has not stepped yet but it holds state for "
            f"{len(stepped)} params, which would be lost; wrap the optimizer before training. To "
            "resume from a checkpoint, load its optimizer state into the wrapper instead: "
            "opt = ShardingStage1(optimizer, ...); opt.load_state_dict(checkpoint_state) (on every rank)"
        )


def _replaced_by(hook_result: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """torch's hook protocol: a state-dict hook returns a new dict, or None to keep the old one."""
    return state_dict if hook_result is None else hook_result


def _release_hooks(comm: BucketCommunicator, *handle_lists: list[RemovableHandle]) -> None:
    """Finish the all-gathers still writing the params (a new wrapper may copy them next), then
    remove every hook."""
    comm.finish_param_sync()
    for handles in handle_lists:
        remove_handles(handles)


def _refuse_wrapped_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    raise RuntimeError(
        f"this {type(optimizer).__name__} is wrapped by ShardingStage1; call the wrapper's step()"
    )


def _user_hooks(hooks: dict[int, Callable[..., Any]]) -> list[Callable[..., Any]]:
    return [hook for hook in hooks.values() if hook is not _refuse_wrapped_step]


def _run_wrapped_pre_hooks(wrapper: ShardingStage1, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The wrapped optimizer's step pre-hooks, see Note [Step hooks]."""
    original = wrapper._wrapped
    hooks = _user_hooks(original._optimizer_step_pre_hooks)
    if not hooks or _scaler_skips_wrapped_step(wrapper):
        return None
    original_args = (original, *args[1:])
    for hook in hooks:
        result = hook(original, original_args, kwargs)
        if result is None:
            continue
        if not (isinstance(result, tuple) and len(result) == 2):
            raise RuntimeError(
                f"the step pre-hook {hook} of the wrapped {type(original).__name__} must return None "
                f"or a tuple (new_args, new_kwargs) but returned {result!r}"
            )
        original_args, kwargs = result
    return (wrapper, *original_args[1:]), kwargs


def _run_wrapped_post_hooks(wrapper: ShardingStage1, args: tuple, kwargs: dict) -> None:
    """The wrapped optimizer's step post-hooks, see Note [Step hooks]."""
    original = wrapper._wrapped
    if _scaler_skips_wrapped_step(wrapper):
        return
    for hook in _user_hooks(original._optimizer_step_post_hooks):
        hook(original, (original, *args[1:]), kwargs)


def _scaler_skips_wrapped_step(wrapper: ShardingStage1) -> bool:
    """Whether plain torch would not call the wrapped optimizer's ``step`` at all: a
    ``ShardedGradScaler`` found an inf (the agreed flag it set on the wrapper, as ``GradScaler``
    does) and the wrapped class does not take ``found_inf`` itself, so ``GradScaler.step`` would
    skip it, hooks included. See Note [Step hooks]."""
    found_inf = getattr(wrapper, "found_inf", None)
    if found_inf is None or not getattr(wrapper, "_scaled_by_sharded_scaler", False):
        return False
    return not getattr(wrapper._wrapped, "_step_supports_amp_scaling", False) and float(found_inf) > 0


def _refuse_wrapped_state_dict(optimizer: torch.optim.Optimizer) -> None:
    raise RuntimeError(
        f"this {type(optimizer).__name__} is wrapped by ShardingStage1 and holds none of the "
        "optimizer state (it lives in the wrapper's shards); call the wrapper's state_dict() on "
        "every rank (state_dict(to_rank=0) to keep it on rank 0 only)"
    )


def _refuse_wrapped_load_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    raise RuntimeError(
        f"this {type(optimizer).__name__} is wrapped by ShardingStage1, which would never use state "
        "loaded into it; call the wrapper's load_state_dict(state_dict) on every rank"
    )


_ADD_GROUPS_FIRST = (
    "add every param group to the torch optimizer first, then wrap it. For gradual unfreezing, "
    "give the frozen params their group (and lr) before wrapping and unfreeze them later with "
    "requires_grad_(True): frozen params cost no grad memory and no communication until then"
)


def _refuse_wrapped_add_param_group(optimizer_class: type, param_group: dict[str, Any]) -> None:
    raise RuntimeError(
        f"this {optimizer_class.__name__} is wrapped by ShardingStage1, which laid its params out "
        f"when it was built; {_ADD_GROUPS_FIRST}"
    )
