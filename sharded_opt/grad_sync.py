"""``GradSync``: the grad side of the wrapper, from the per-param hooks to the averaged shards.

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
      (``GradSync._start_frozen_grad_sync``, Note [Frozen after backward] in ``grad_hooks``).
      This was a rank's own fact before ("this rank holds a grad in a frozen param") and hung
      2-4 ranks. Buckets that stage their grads (a fact of the layout, Note [Staged grads] in
      ``fusion.layout``) are reduced by ``step()`` in both modes, in bucket order after the ones
      backward launched; overlap mode then shares the last presence flags there too.
    - Presence flags (``GradSync._share_presence``): every bucket's, once per iteration: per
      bucket right before the reductions above where they share the group, the rest in one
      all-reduce after the last launch (Note [Presence per bucket] in ``grad_presence``). Their values
      differ per rank; which buckets' flags go in which all-reduce does not.
    - Reducing again (Note [A second backward]) and reusing the last step's grads (Note [A step
      without backward]): read from the hooks' and the buffers' state, the same on every rank
      when every rank runs the same number of backwards.
    - Which shards are stepped and all-gathered (``StepPipeline.step`` in ``step_pipeline``):
      the agreed presence flags; the all-gathers in the one gather order. Per-module waits for
      them issue nothing.
    - Whether the all-gathers run at all after the wrapped class's ``step``: that step may raise
      on some ranks only (each steps other params), so a one-byte-per-rank all-reduce agrees on
      it first (Note [A step that raises on some ranks] in ``step_pipeline``).
    - The replica all-reduce of hybrid sharding: one after each bucket's reduce-scatter, issued
      in bucket order (Note [Replica all-reduce order] in ``bucket_comm``).
    - ``clip_grad_norm_`` (one norm all-reduce), the scaler (one found-inf all-reduce per
      ``unscale_``), ``state_dict``/checkpoints (collectives fixed by the layout and the world
      size; the collective guard raises when a rank did not call them): issued per call, and
      every rank makes the call. Absent grads are zeroed from the agreed flags before a norm.
    - ``sync_params()`` waits for collectives already issued and issues none. ``close()`` does
      the same, then one barrier per group of the wrapper when it spans the whole world (its
      size, the same everywhere), called on every rank by contract; after an exception in a
      ``with`` block (a rank-local fact) it issues none (Note [Releasing a wrapper's groups]).

    ``tests/differential.py`` runs its programs with torch's collective check (Note in its
    ``check_collectives_across_ranks``), so a rank that breaks this fails loudly in the tests.

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
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator

import torch

from sharded_opt import collectives
from sharded_opt.grad_hooks import GradReadyTracker
from sharded_opt.grad_presence import GradPresence
from sharded_opt.optimizer_shards import OptimizerShards
from sharded_opt.validation import DROP_DDP


class GradSync:
    """The grad side of one iteration: which grads are ready and present, when each bucket's
    reduction starts and finishes, reuse of the last step's grads, frozen buckets.

    It owns the per-param grad hooks (:class:`GradReadyTracker`, which in overlap mode calls
    back :meth:`start_bucket_grad_sync` during backward) and the presence flags
    (:class:`GradPresence`); the collectives themselves run in ``shards.comm``. Every decision
    to issue one reads agreed state, see Note [Collectives from agreed state].

    Args:
        shards: the layout, buffers, per-bucket shards and inner optimizer.
        overlap: launch each bucket's reduction during backward, as its grads complete.
    """

    def __init__(self, shards: OptimizerShards, overlap: bool) -> None:
        comm = shards.comm
        self.overlap = overlap
        self._shards = shards
        self._comm = comm
        self._buffers = shards.buffers
        self._buckets = shards.plan.buckets
        # A second backward reduces again only where the reduction left the grad buffers alone.
        self._restartable = comm.sharded or shards.world_size == 1
        self.tracker = GradReadyTracker(
            shards.buffers,
            shards,
            self if overlap else None,
            comm if overlap and comm.stream is not None else None,
        )
        flags_group = shards.groups.presence
        self.presence = GradPresence(
            self._buckets,
            flags_group,
            shards.world_size,
            _flag_device(shards),
            per_bucket=shards.world_size > 1 and flags_group is shards.groups.world,
        )
        self._local_presence = bytearray(len(shards.buffers.params))
        self._grads_reduced = False
        self._grads_at_step: _GradsSnapshot | None = None
        staged = [bucket for bucket in self._buckets if bucket.staged_grads]
        self._staged_indices = [slot.param_index for bucket in staged for slot in bucket.slots]
        self._viewed_indices = [
            slot.param_index for bucket in self._buckets if not bucket.staged_grads for slot in bucket.slots
        ]

    # -- the iteration -----------------------------------------------------------------------

    def start_grad_sync(self) -> None:
        """Check the grads and issue every bucket's reduction not issued yet (in overlap mode
        backward issued most of them), each after its bucket's presence flags."""
        self._check_grads_not_written()
        if self._grads_reduced:
            return
        if self._grads_unchanged_since_step():
            # Note [A step without backward]: step again with the grads the last step used.
            self.all_buckets_launched()
            self._zero_absent_grads()
            self._grads_reduced = True
            return
        self._grads_at_step = None
        self._check_backward_finished()
        if self.overlap:
            if self.tracker.accumulate_only:
                raise RuntimeError(
                    "ShardingStage1: step() (or a grad reduction) inside `with opt.no_sync():`; the "
                    "grads of the block are never averaged over the ranks. Leave the block for the "
                    "last micro-batch's backward, then call step()"
                )
            self.tracker.flush()
            self.tracker.stage_grads()
            for bucket_index in self.tracker.staged_buckets():
                self.start_bucket_grad_sync(bucket_index)
            if self.tracker.stages_any:
                self.all_buckets_launched()
        else:
            self.tracker.adopt_all()
            self.tracker.stage_grads()
            for bucket in self._buckets:
                if self.tracker.takes_part(bucket.index):
                    self.start_bucket_grad_sync(bucket.index)
            self.all_buckets_launched()
        self._start_frozen_grad_sync()
        self._check_grads_not_dropped()

    def finish_grad_sync(self, bucket_indices: list[int]) -> None:
        """Wait for the reductions of ``bucket_indices`` (the step pipeline, bucket by bucket)."""
        if self._grads_reduced:
            return  # clip_grad_norm_ or the scaler finished (and maybe clipped) them already
        self._comm.finish_grad_sync(bucket_indices)

    def reduce_grads(self) -> None:
        """Reduce every bucket's grads now (clipping and the scaler need all of them)."""
        self.start_grad_sync()
        if not self._grads_reduced:
            self._comm.finish_grad_sync()
            self._zero_absent_grads()
            self._grads_reduced = True
            self.tracker.accept_grad_writes()

    def start_iteration(self) -> None:
        self._grads_reduced = False
        self.tracker.reset()
        self.presence.discard()  # flags shared but not used when the step was skipped

    def record_step(self) -> None:
        """The grads just stepped with; see Note [A step without backward]."""
        self._grads_at_step = self._grads_snapshot()

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the grad buffers in place once no reduction reads them; see
        ``ShardingStage1.zero_grad``."""
        self._comm.finish_grad_sync()
        if not set_to_none:
            # torch's zero_grad(set_to_none=False) leaves a None grad None (a layer whose grads
            # model.zero_grad() dropped): it stays without a grad, though its view is zeroed too.
            self.tracker.forget_none_grads()
        self._buffers.zero_grad(set_to_none)
        self._grads_at_step = None
        if set_to_none:
            self.tracker.clear_received()
        self.start_iteration()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Grads of the backwards inside accumulate and launch nothing (overlap mode)."""
        if not self.overlap:
            yield
            return
        previous = self.tracker.accumulate_only
        self.tracker.accumulate_only = True
        try:
            yield
        finally:
            self.tracker.accumulate_only = previous

    # -- launching, as the tracker's GradSyncLauncher ------------------------------------------

    def start_bucket_grad_sync(self, bucket_index: int) -> None:
        """Share the bucket's presence flags (where they go per bucket), then issue its grad
        reduction; see Note [Presence per bucket] in ``grad_presence``."""
        if self.presence.per_bucket:
            self._share_presence([bucket_index])
        self._comm.start_grad_sync(bucket_index)

    def all_buckets_launched(self) -> None:
        """Share the presence flags not shared yet: of the buckets that took no part in this
        reduction, or of every bucket where they are not shared per bucket."""
        unshared = self.presence.unshared()
        if unshared:
            self._share_presence(unshared)

    def restart_grad_sync(self) -> None:
        """Wait for this iteration's reductions and forget them (a second backward before
        ``step()``, see Note [A second backward] in ``grad_hooks``)."""
        if not self._restartable:
            raise RuntimeError(
                "ShardingStage1(overlap=True): a second backward ran before step(), after the "
                "grads of this iteration were already reduced in place; they would be lost. Run all "
                "but the last backward inside `with opt.no_sync():` (gradient accumulation)"
            )
        if self._grads_reduced:
            raise RuntimeError(
                "ShardingStage1(overlap=True): a backward ran after opt.clip_grad_norm_ (or "
                "clip_grad_value_, ShardedGradScaler.unscale_) and before step(); the grads would be "
                "reduced again without the clipping. Clip (or unscale) after the last backward, right "
                "before step()"
            )
        self._comm.finish_grad_sync()
        self.presence.discard()
        self._grads_reduced = False

    def _start_frozen_grad_sync(self) -> None:
        """Reduce the buckets whose params are all frozen now where some rank still holds a grad
        in them, after every other bucket; decided from the presence flags every rank agreed on,
        see Note [Frozen after backward] in ``grad_hooks``."""
        for bucket_index in self.tracker.frozen_buckets():
            if any(self.presence.agreed(bucket_index)):
                self.tracker.take_frozen(bucket_index)
                self._comm.start_grad_sync(bucket_index)

    def _share_presence(self, bucket_indices: list[int]) -> None:
        received = self.tracker.received
        params = self._buffers.params
        local = self._local_presence
        flags = []
        note_unseen_grad = self.tracker.note_unseen_grad
        for bucket_index in bucket_indices:
            for slot in self._buckets[bucket_index].slots:
                index = slot.param_index
                local[index] = (received[index] or note_unseen_grad(bucket_index, index)) and (
                    params[index].grad is not None
                )
                flags.append(local[index])
        self.presence.start(bucket_indices, flags)

    # -- reuse of the last step's grads ---------------------------------------------------------

    def _grads_snapshot(self) -> _GradsSnapshot:
        """What tells whether grads changed since: the grad buffers' versions, which params'
        grads are their buffer views, and the staged grads themselves with their versions (Note
        [Staged grads] in ``fusion.layout``); see Note [A step without backward]."""
        staged = self._staged_grads()
        return self._grad_versions(), self._grads_are_views(), staged, _versions(staged)

    def _grad_versions(self) -> list[int | None]:
        return [None if buffer is None else buffer._version for buffer in self._buffers.grad_buffers]

    def _grads_are_views(self) -> list[bool]:
        views = self._buffers.grad_views
        return [param.grad is views[index] for index, param in enumerate(self._buffers.params)]

    def _staged_grads(self) -> list[torch.Tensor | None]:
        return [self._buffers.params[index].grad for index in self._staged_indices]

    def _grads_unchanged_since_step(self) -> bool:
        if self._grads_at_step is None:
            return False
        versions, are_views, staged, staged_versions = self._grads_at_step
        staged_now = self._staged_grads()
        return (
            versions == self._grad_versions()
            and are_views == self._grads_are_views()
            and all(map(operator.is_, staged, staged_now))
            and staged_versions == _versions(staged_now)
        )

    @torch.no_grad()
    def _zero_absent_grads(self) -> None:
        """Zero the reduced grads of params that got no grad on any rank this iteration.

        ``step()`` leaves such params out, but clipping and the scaler read every reduced grad:
        torch's ``clip_grad_norm_`` and ``GradScaler`` skip a param whose ``.grad`` is None,
        whereas here its elements may still hold an earlier iteration's grads (a bucket frozen
        since takes no part in the reduction and keeps its last result; a param frozen after
        ``model.zero_grad()`` set its grad to None keeps its last grad in the grad buffer). They
        would count in the norm, or a past overflow would make the scaler skip every step.

        A bucket none of whose params got a grad was not reduced: its whole reduced grad is
        zeroed, padding included. The padding is zero after every reduction, but a clip by a
        nan norm (an overflow the scaler then skipped) leaves nan there too, and the next
        iteration's norm, summed over the flat shards, would be nan (ws-3 campaign of seed 9203,
        programs 67 and 68: every param nan two steps after a skipped overflow)."""
        grad_buffers = {id(g) for g in self._buffers.grad_buffers if g is not None}
        for shard in self._comm.live_shards():
            present = self.presence.params_with_grads(shard.bucket.index)
            if not present:
                for whole in {id(t): t for t in (shard.reduced_grad, shard.stepped_grad)}.values():
                    if id(whole) not in grad_buffers:  # this rank's local grads stay as they are
                        whole.zero_()
                continue
            for grad, owner in zip(shard.inner_grads, shard.inner_owners, strict=True):
                if owner not in present:
                    grad.zero_()

    # -- refusals of grads this iteration cannot use ---------------------------------------------

    def _check_grads_not_written(self) -> None:
        """See Note [Grads written after backward] in ``grad_hooks``."""
        written = self.tracker.grads_written_since_backward()
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

    def _check_backward_finished(self) -> None:
        if self.tracker.backward_unfinished:
            raise RuntimeError(
                "ShardingStage1.step: the last backward raised before it finished, so its grads are "
                "partial (some buckets were already being reduced). Call opt.zero_grad() to discard "
                "them, then run the iteration again"
            )

    def _check_grads_not_dropped(self) -> None:
        """In overlap mode which params have grads is shared when their bucket is launched, and
        the bucket's grads are read then: grads set to None after that (``model.zero_grad()``
        between backward and ``step()``) would be stepped anyway, and grads replaced after that
        (``p.grad = p.grad.clamp(...)``) would be silently ignored, so both are refused."""
        if not self.overlap:
            return
        views, params = self._buffers.grad_views, self._buffers.params
        dropped, replaced = [], []
        for index in self._viewed_indices:  # staged grads are read at step(), as they are then
            grad = params[index].grad
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


_GradsSnapshot = tuple[list[int | None], list[bool], list[torch.Tensor | None], list[int | None]]
"""Grad buffer versions, grads that are views, staged grads and their versions: see
:meth:`GradSync._grads_snapshot`."""


def _versions(grads: list[torch.Tensor | None]) -> list[int | None]:
    return [None if grad is None else grad._version for grad in grads]


def _flag_device(shards: OptimizerShards) -> torch.device:
    """CPU when the group runs CPU tensors on gloo (no device sync to read the flags), else the
    params' device."""
    if collectives.backend_for_device(shards.process_group, "cpu") == "gloo":
        return torch.device("cpu")
    return shards.plan.buckets[0].device
