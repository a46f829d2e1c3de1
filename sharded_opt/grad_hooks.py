"""Which params got a grad, and (in overlap mode) launching each bucket's reduction when ready.

Note [Which params got a grad]
    ``torch.optim`` steps exactly the params whose ``.grad`` is not None: after the default
    ``zero_grad()`` (``set_to_none=True``) a param that no backward reached is skipped, its state
    untouched. Here grads are views of flat buffers and never None, so a post-accumulate-grad
    hook on every param that requires grad records that it received one (``received``), in both
    modes. A grad assigned by other code (``param.grad = g``) counts as received when it is
    adopted into the buffer; a grad set to None (``model.zero_grad()``) counts as none. The
    record is cleared by ``zero_grad(set_to_none=True)`` only, so grads that are never zeroed
    keep counting, as they do in torch. A bucket that stages its grads has no hooks: its grads
    stay autograd's, and ``param.grad is not None`` read at ``step()`` is the record (Note
    [Staged grads] in ``fusion.layout``).

    ``requires_grad`` can change after wrapping (freezing, gradual unfreezing). It is read again
    at the first hook of every backward (not only of every iteration: a layer unfrozen between
    two micro-batches' backwards was missed in overlap mode and not stepped) and before every
    reduction (:meth:`GradReadyTracker.scan`): a newly unfrozen param gets its hook then (and, if
    its bucket was all frozen so far, the bucket gets its grad buffer and local shard); a grad it
    accumulated before its hook existed is adopted (its bucket then waits for the end of
    backward). A frozen param is simply no longer expected. A backward may also run no hook at
    all (every other bucket stages its grads or is frozen): a grad it left on a param whose
    bucket has no grad buffer is seen when the presence flags are shared (Note [Frozen after
    backward]).

Note [Frozen after backward]
    torch steps every param whose ``.grad`` is not None, whatever its ``requires_grad``: a layer
    frozen between backward and ``step()`` (a callback that freezes on a schedule, a GAN loop
    that freezes D right after its backward) is still stepped with the grad it holds, and so is
    one frozen later whose grads were never set to None, even where only some ranks hold one
    (an expert layer that ran on some ranks only). A bucket whose params all stopped requiring
    grad therefore still takes part in the reduction where some rank holds a received grad in
    it, or its shard would step with the grads of whichever iteration last reduced it. Whether
    one does is a fact of each rank's own, so it is not decided here: such buckets are passed
    over during backward, and ``step()`` reduces them after all the others, once the presence
    flags every rank agreed on say that some rank holds a grad there (Note [Collectives from
    agreed state] in ``grad_sync``). Before any reduction a frozen param's slot is settled: it
    keeps a grad the param received and still holds, and is zeroed otherwise (it may hold a
    grad that ``model.zero_grad()`` set to None since; averaged with another rank's present
    grad, it put 13 % errors into the step).

    A bucket frozen when wrapped has no grad buffer, so no hook sees a grad its params get: a
    layer unfrozen for a backward that ran no hook of the wrapper (every other bucket staged
    its grads) and frozen again before ``step()`` holds its grad in autograd's own tensor
    (fuzz seed 60493: not stepped). When the flags are shared, such a held grad counts as
    received (:meth:`GradReadyTracker.note_unseen_grad`); where the agreed flags show one on
    some rank, every rank gives the bucket its grad buffer and shard, copying the held grads
    in, before reducing it (:meth:`GradReadyTracker.take_frozen`). ``zero_grad()`` sets such
    grads to None as torch does, so a discarded one is not stepped later.

Note [Grads written after backward]
    ``param.grad`` holds this rank's local grad, and in overlap mode a bucket's reduction reads
    it while backward is still running. A write to grads after backward reached them (torch's
    ``clip_grad_norm_`` clipping each rank by its *local* norm, the stock ``GradScaler.unscale_``
    checking each rank's local grads, ``p.grad.mul_()``) would race with the reduction in overlap
    mode, be lost after ``opt.clip_grad_norm_`` or ``ShardedGradScaler.unscale_`` reduced the
    grads, or clip ranks differently in sync mode. So every hook records its bucket's grad
    buffer version (views share their base's version counter) after accumulating, and the
    wrapper refuses to reduce or step grads whose buffer version has moved since, naming the
    sharded replacements. The wrapper's own writes (adopting a grad, zeroing) record the version
    again; assigning ``param.grad = g`` replaces the tensor rather than writing the buffer and
    is adopted as usual. A bucket that stages its grads (Note [Staged grads] in
    ``fusion.layout``) keeps autograd's own tensors and has no hooks, so nothing tells when
    backward last wrote them: a write to them is not refused (torch's local
    ``clip_grad_norm_`` over a model whose grads all stage, bf16 scalars say, clips each rank by
    its local norm). Known gap; the fuzzer expects the refusal only where a viewed grad is
    written.

Note [Grads written at the end of backward]
    A data-parallel wrapper around the model writes the grads at the end of backward: DDP's
    reducer averages each bucket as its grads arrive and copies the averages into ``param.grad``
    in a callback queued on the backward's end; FSDP does the same with its shards. Hugging Face
    Trainer, Accelerate and Lightning add such a wrapper after the optimizer was built, where
    the constructor's check of ``model=`` cannot see it. The grads would be averaged twice and,
    in overlap mode, read by the reductions while DDP writes them. So the first hook of every
    backward queues an end-of-backward callback (in both modes; it also launches what overlap
    mode left pending), and that one queues a last check, which runs after every callback
    queued during backward: DDP's included. A grad buffer whose version moved since its last
    hook was written by such a callback, and the error names the wrapper at once, in the first
    backward, rather than at ``step()`` among the edits a user makes to grads. (A grad that
    ``DistributedDataParallel(gradient_as_bucket_view=True)`` replaces instead of writing is
    caught at the attached model's first forward, which runs inside the wrapper's, and at
    ``step()``.)

Note [Launching reductions during backward]
    In overlap mode the hook also counts the grads that landed in each bucket. When a bucket's
    count reaches its number of params that require grad, it is ready. Collectives must be
    issued in the same order on every rank (a mismatch deadlocks NCCL and mixes data under
    gloo), and ranks can see buckets complete in different orders, so buckets are launched
    strictly in bucket order: a ready bucket waits until every earlier bucket has been launched.
    A bucket without a param that requires grad takes no part and is passed over.

    A param that gets no grad in an iteration (an unused branch, possibly only on some ranks)
    would keep its bucket from ever being ready. So the first hook of a backward queues an
    end-of-backward callback that launches every bucket still pending, in order, treating the
    missing grads as zeros. A leaf used twice in forward (tied weights) has its contributions
    summed by autograd before its single accumulation, so its hook fires once per backward.

    The hook body is kept tiny (a flag, a counter and an identity check) because it runs once
    per param per backward; all real work happens once per bucket. See Note [Hook cost].

Note [Hook cost]
    A model of 10,000 scalar params runs 10,000 hooks per backward, so every call the hook
    makes shows (see ``benchmarks/small_params.py``). The hook is a slotted object holding what
    it needs precomputed (its param's index, bucket and grad view) and a plain
    ``weakref.ref`` to the tracker; the body reads the tracker's state directly instead of
    calling a bound method through ``weakref.WeakMethod`` (a Python-level call that builds a
    bound method and an argument tuple each time, which cost more than the rest of the body).
    The overlap-only counting is one more call, and its launch check runs only when the
    hook completes a bucket. Per backward, the scan of ``requires_grad`` (Note [Which params
    got a grad]) is one C-level pass compared against the last one, and the full re-scan runs
    only when a flag changed.

Note [A second backward]
    Plain torch and DDP let grads of several backwards add up before ``step()``: the DCGAN
    tutorial runs ``errD_real.backward()`` then ``errD_fake.backward()``, and a G loss that
    reaches D's params is followed by ``netD.zero_grad()`` and D's own backward. In overlap mode
    the first backward already issued the reductions, so a hook that sees a param counted
    twice, or a bucket already launched, starts the iteration again: the wrapper waits for the
    reductions issued so far and forgets them (and their presence flags), and counting starts
    from zero. When sharded, a reduction writes a separate shard of averaged grads and the grad
    buffers keep this rank's local grads, which the second backward accumulated into (or, for
    grads set to None in between, replaced) exactly as torch does; the end of that backward
    reduces them again. The result is bitwise what sync mode computes, at the cost of one more
    reduction per extra backward; ``no_sync()`` avoids it. Every rank must run the same number
    of backwards, as with DDP. On one rank nothing is reduced, so the same holds. Without
    sharding (``enable=False``, or ``degree=1``) the all-reduce averages the grad buffers in
    place, so there a second backward raises, naming ``no_sync()``.
"""

from __future__ import annotations

import operator
import weakref
from typing import Protocol

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from fusion.buffers import FlatBuffers
from sharded_opt.backward_end import BackwardEnd
from sharded_opt.validation import DROP_DDP
from sharded_opt.weak_hooks import CopiesAsInert, remove_handles

_requires_grad = operator.attrgetter("requires_grad")


class ShardMaterializer(Protocol):
    """Gives a bucket its grad buffer and local shard (idempotent); asked when a param of a
    bucket that has none starts to require grad."""

    def materialize(self, bucket_index: int) -> None: ...


class GradStreamRecorder(Protocol):
    """Remembers the current stream as one that accumulated grads of a bucket, so the bucket's
    reduction can wait for every stream that wrote its grads (accelerators only, see Note
    [Streams and events])."""

    def note_grad_stream(self, bucket_index: int) -> None: ...


class GradSyncLauncher(Protocol):
    """What overlap mode's hooks drive: the start of each bucket's reduction."""

    def start_bucket_grad_sync(self, bucket_index: int) -> None:
        """Issue one bucket's reduction; called once per taking-part bucket per iteration, in
        bucket order."""

    def all_buckets_launched(self) -> None:
        """Called once per iteration right after the last bucket was launched."""

    def restart_grad_sync(self) -> None:
        """Wait for this iteration's reductions and forget them, so that a second backward
        before ``step()`` reduces the grads again (Note [A second backward]); raises where a
        reduction overwrote the grad buffers."""


class GradReadyTracker:
    """Records which params got a grad and, given a ``launcher``, launches bucket reductions in
    bucket order as their grads complete.

    Args:
        buffers: the flat buffers whose params get hooks.
        shards: gives a bucket its grad buffer and local shard when a param of a bucket that has
            none starts to require grad.
        launcher: the grad-sync side that issues the reductions (overlap mode). None (sync
            mode): only record grads.
        grad_streams: told the bucket index from every hook that accumulated a grad (no_sync
            included); None on CPU and in sync mode. See Note [Streams and events].
    """

    def __init__(
        self,
        buffers: FlatBuffers,
        shards: ShardMaterializer,
        launcher: GradSyncLauncher | None = None,
        grad_streams: GradStreamRecorder | None = None,
    ) -> None:
        self._buffers = buffers
        self._shards = shards
        self._launcher = launcher
        self._grad_streams = grad_streams
        self._buckets = buffers.plan.buckets
        self._staged = [bucket.staged_grads for bucket in self._buckets]
        self.stages_any = any(self._staged)
        """Some bucket stages its grads (Note [Staged grads] in ``fusion.layout``): its reduction,
        and the sharing of the last presence flags, wait for ``step()``."""
        num_params = len(buffers.params)
        self._bucket_of = [-1] * num_params
        for bucket in self._buckets:
            for slot in bucket.slots:
                self._bucket_of[slot.param_index] = bucket.index
        self.received = bytearray(num_params)
        """Per param, 1 if a grad reached it since grads were last set to none."""
        self._hooked = bytearray(num_params)
        self._expected = [0] * len(self._buckets)
        self._to_count = [0] * len(self._buckets)
        self.accumulate_only = False
        """True inside ``no_sync()``: grads accumulate in the buffers and nothing is launched."""
        self.handles: list[RemovableHandle] = []
        """The hooks this tracker installed; see Note [Hook lifetimes and copies]."""
        self._laid_out_params = [buffers.params[index] for index in buffers.laid_out_indices]
        self._requires_grad_at_scan: bytes | None = None
        self._iteration = 0
        self._backward_end = BackwardEnd(self._end_of_backward)
        _retire_older_hooks(self._laid_out_params)
        self.scan()
        self.reset()

    @property
    def overlapping(self) -> bool:
        return self._launcher is not None

    def reset(self) -> None:
        """Start a new iteration: no grad counted, no bucket launched, requires_grad re-read at
        the next hook."""
        self._counts = [0] * len(self._buckets)
        self._counted = bytearray(len(self._buffers.params))
        self._next_to_launch = 0
        self._scanned = False
        self._counted_any = False
        self._flushed_at_end = False
        self._in_backward = False  # a backward that raised never ran its end
        self._iteration += 1
        self._grad_versions: list[int | None] = [None] * len(self._buckets)

    def clear_received(self) -> None:
        """Grads were set to none: no param has one now."""
        self.received = bytearray(len(self._buffers.params))

    def forget_none_grads(self) -> None:
        """Params whose grad is None now have none, whatever they received before."""
        for index, param in enumerate(self._buffers.params):
            if param.grad is None:
                self.received[index] = 0

    @property
    def backward_unfinished(self) -> bool:
        """A backward counted grads but never reached its end (it raised midway)."""
        return self._counted_any and not self._flushed_at_end

    def scan(self) -> None:
        """Re-read ``requires_grad``, see Note [Which params got a grad]."""
        self._scanned = True
        requires_grad = bytes(map(_requires_grad, self._laid_out_params))
        if requires_grad == self._requires_grad_at_scan:
            return
        params = self._buffers.params
        expected = [0] * len(self._buckets)
        with_grads = {b for b, buffer in enumerate(self._buffers.grad_buffers) if buffer is not None}
        for index in self._buffers.laid_out_indices:
            bucket_index = self._bucket_of[index]
            if params[index].requires_grad:
                expected[bucket_index] += 1
                with_grads.add(bucket_index)
        to_hook = []
        for index in self._buffers.laid_out_indices:
            param = params[index]
            bucket_index = self._bucket_of[index]
            if self._staged[bucket_index]:
                if expected[bucket_index]:
                    self._shards.materialize(bucket_index)  # no hook: grads are read at step()
            elif not self._hooked[index] and bucket_index in with_grads:
                # Every param whose grad is (or is about to be) a buffer view gets its hook now,
                # frozen ones too: unfrozen later, its grad may accumulate into its view before
                # the first hook of that backward scans again, and would go unrecorded (a layer
                # unfrozen while every later layer is frozen or staged). Read before any hook is
                # added: giving a bucket its grad buffer points every param of it at its view,
                # so a grad that arrived before the hook would look like the view's own.
                arrived = param.grad is not None and param.grad is not self._buffers.grad_views[index]
                to_hook.append((index, bucket_index, param, arrived))
        for index, bucket_index, param, arrived in to_hook:
            self._hook(index, bucket_index, param, arrived)
        self._expected = expected
        self._to_count = [0 if staged else n for staged, n in zip(self._staged, expected, strict=True)]
        self._requires_grad_at_scan = requires_grad
        frozen_in: list[list[int]] = [[] for _ in self._buckets]
        for index in self._buffers.laid_out_indices:
            bucket_index = self._bucket_of[index]
            if self._staged[bucket_index]:
                continue  # staging copies every grad held, frozen or not
            if not params[index].requires_grad and self._buffers.grad_buffers[bucket_index] is not None:
                frozen_in[bucket_index].append(index)
        self._frozen_in = frozen_in
        """Per bucket with a grad buffer and views, its params that do not require grad now."""

    def _hook(self, index: int, bucket_index: int, param: Tensor, arrived_before_hook: bool) -> None:
        self._shards.materialize(bucket_index)
        hook = _AccumulateGradHook(self, index, bucket_index)
        self.handles.append(_register_accumulate_hook(param, hook))
        self._hooked[index] = 1
        if arrived_before_hook:
            # Not counted: the grad may be from this backward or older; if this backward still
            # reaches the param, its hook counts it, and otherwise the end-of-backward flush
            # launches the bucket.
            self._buffers.adopt_grad(index)
            self.received[index] = 1

    def takes_part(self, bucket_index: int) -> bool:
        """Whether the bucket has a param that requires grad (as of the last scan): the same on
        every rank, see Note [Collectives from agreed state] in ``grad_sync``."""
        return self._expected[bucket_index] > 0

    def frozen_buckets(self) -> list[int]:
        """Buckets whose params are all frozen now (as of the last scan), with a grad buffer or
        not: they take part only where some rank holds a grad in them, decided from the agreed
        presence flags; see Note [Frozen after backward]."""
        return [b for b, expected in enumerate(self._expected) if expected == 0]

    def note_unseen_grad(self, bucket_index: int, param_index: int) -> bool:
        """Record as received, and return whether, the param holds a grad no hook could see:
        its bucket has no grad buffer (every param frozen when wrapped and at every scan since),
        yet a backward that ran no hook of this wrapper, or an assignment, gave it one. torch
        steps it. See Note [Frozen after backward]."""
        buffers = self._buffers
        if buffers.grad_buffers[bucket_index] is not None or buffers.params[param_index].grad is None:
            return False
        self.received[param_index] = 1
        return True

    def remove_hooks(self) -> None:
        remove_handles(self.handles)
        self._hooked = bytearray(len(self._buffers.params))
        self._requires_grad_at_scan = None

    def _begin_backward(self) -> None:
        """The first hook of a backward: read ``requires_grad`` again (Note [Which params got a
        grad]) and queue the work of its end."""
        self.scan()
        self._in_backward = True
        self._backward_end.queue()

    def _end_of_backward(self) -> None:
        """The end of the outermost backward, see Note [End of backward under reentrant
        checkpointing] in ``backward_end``."""
        self._in_backward = False
        if self._counted_any:  # overlap mode counted grads in this iteration
            self._flushed_at_end = True
            self.flush()
        # Queued now, it runs after every callback queued during backward; see Note [Grads
        # written at the end of backward].
        torch.autograd.Variable._execution_engine.queue_callback(self._refuse_data_parallel_writes)

    def _refuse_data_parallel_writes(self) -> None:
        written = self.grads_written_since_backward()
        if written:
            raise RuntimeError(
                f"ShardingStage1: the grads of buckets {written[:8]} were written at the end of "
                "backward, after they were accumulated: a DistributedDataParallel (or FSDP) wrapper "
                "around the model does this (the accelerator of Hugging Face Trainer, Accelerate and "
                "Lightning adds one after the optimizer was built: use the adapters of "
                f"sharded_opt.integrations). It averages the grads a second time. {DROP_DDP}"
            )

    def _count(self, param_index: int, bucket_index: int) -> None:
        """Overlap mode, outside ``no_sync()``: count the grad and launch what is ready, see
        Note [Launching reductions during backward]."""
        if self._counted[param_index] or bucket_index < self._next_to_launch:
            self._restart()
        self._counted[param_index] = 1
        self._counted_any = True
        counts = self._counts
        counts[bucket_index] += 1
        # Only a bucket that just completed can extend the launched prefix.
        if counts[bucket_index] >= self._to_count[bucket_index]:
            self._launch_ready()

    def _restart(self) -> None:
        """A second backward before ``step()``, see Note [A second backward]."""
        self._launcher.restart_grad_sync()
        self.reset()
        self._scanned = True  # this backward's first hook already scanned requires_grad
        self._in_backward = True  # and this backward's end is queued

    def _launch_ready(self) -> None:
        while (
            self._next_to_launch < len(self._buckets)
            and self._counts[self._next_to_launch] >= self._to_count[self._next_to_launch]
        ):
            self._launch(self._next_to_launch)

    def _launch(self, bucket_index: int) -> None:
        """Launch one bucket in order; a bucket that stages its grads is passed over here and
        launched by ``step()`` after staging, and so are the last presence flags."""
        if self.takes_part(bucket_index) and not self._staged[bucket_index]:
            self.settle_frozen(bucket_index)
            self._launcher.start_bucket_grad_sync(bucket_index)
        self._next_to_launch = bucket_index + 1
        if self._next_to_launch == len(self._buckets) and not self.stages_any:
            self._launcher.all_buckets_launched()

    def staged_buckets(self) -> list[int]:
        """The buckets that stage their grads and take part (as of the last scan), in order."""
        return [b for b, staged in enumerate(self._staged) if staged and self.takes_part(b)]

    def stage_grads(self) -> None:
        """Copy the grads of every bucket that stages them into its grad buffer and record which
        params hold one: for them ``received`` is ``param.grad is not None``, read now (Note
        [Staged grads] in ``fusion.layout``)."""
        received = self.received
        for bucket in self._buckets:
            if not bucket.staged_grads or self._buffers.grad_buffers[bucket.index] is None:
                continue
            present = self._buffers.stage_grads(bucket.index)
            for slot, has_grad in zip(bucket.slots, present, strict=True):
                received[slot.param_index] = has_grad

    def adopt_all(self) -> None:
        """Re-point every grad of a param that requires grad into its buffer (sync mode, before
        the reduction), see Note [Which params got a grad]."""
        self.scan()
        for bucket in self._buckets:
            if self.takes_part(bucket.index):
                self.adopt_uncounted(bucket.index)

    def flush(self) -> None:
        """Launch every bucket not launched yet, in order, with missing grads as zeros."""
        if self.accumulate_only or self._launcher is None:
            return
        if not self._scanned:
            self.scan()
        for bucket_index in range(self._next_to_launch, len(self._buckets)):
            if self.takes_part(bucket_index):
                self._adopt_uncounted_trainable(bucket_index)  # _launch settles the frozen ones
            self._launch(bucket_index)

    def accept_grad_writes(self) -> None:
        """The wrapper itself wrote the grad buffers (an in-place reduction, clipping or unscaling
        of grads that are the buffers): their current versions are the expected ones."""
        for bucket_index, version in enumerate(self._grad_versions):
            if version is not None:
                self._grad_versions[bucket_index] = self._buffers.grad_buffers[bucket_index]._version

    def grads_written_since_backward(self) -> list[int]:
        """Buckets whose grad buffer was written after backward last accumulated into it, see
        Note [Grads written after backward]."""
        written = []
        for bucket_index, version in enumerate(self._grad_versions):
            if version is not None and self._buffers.grad_buffers[bucket_index]._version != version:
                written.append(bucket_index)
        return written

    def adopt_uncounted(self, bucket_index: int) -> None:
        """Make the bucket's grad buffer hold exactly this rank's grads before its reduction: a
        grad that backward did not count is adopted (an assigned one, or None as zeros), and the
        frozen params are settled (:meth:`settle_frozen`)."""
        self._adopt_uncounted_trainable(bucket_index)
        self.settle_frozen(bucket_index)

    def _adopt_uncounted_trainable(self, bucket_index: int) -> None:
        if self._staged[bucket_index]:
            return  # see stage_grads
        params, buffers = self._buffers.params, self._buffers
        for slot in self._buckets[bucket_index].slots:
            index = slot.param_index
            if self._counted[index] or not params[index].requires_grad:
                continue
            had_grad = params[index].grad is not None
            if buffers.adopt_grad(index):  # None (no grad) or an assigned tensor (a grad)
                self.received[index] = had_grad
                self._grad_versions[bucket_index] = buffers.grad_buffers[bucket_index]._version

    def take_frozen(self, bucket_index: int) -> None:
        """Before the reduction of a bucket whose params are all frozen, which the agreed flags
        say some rank holds a grad in: give it its grad buffer and shard if it has none (on
        every rank alike, the flags are agreed), its hooks and its grads, then settle it."""
        if self._buffers.grad_buffers[bucket_index] is None:
            self._shards.materialize(bucket_index)  # copies in the grads params hold
            self._requires_grad_at_scan = None  # hook its params, list them as frozen
            self.scan()
            if self._staged[bucket_index]:
                present = self._buffers.stage_grads(bucket_index)
                for slot, has_grad in zip(self._buckets[bucket_index].slots, present, strict=True):
                    self.received[slot.param_index] = has_grad
        self.settle_frozen(bucket_index)

    def settle_frozen(self, bucket_index: int) -> None:
        """Before the bucket's reduction: a frozen param keeps a grad it received and still holds
        (Note [Frozen after backward]); any other frozen param's slot is zeroed, its ``.grad``
        left as it is. Its slot may still hold a grad that ``model.zero_grad()`` set to None
        since, which would otherwise be averaged with another rank's present grad."""
        frozen = self._frozen_in[bucket_index]
        if not frozen:
            return
        params, buffers = self._buffers.params, self._buffers
        for index in frozen:
            if self.received[index] and params[index].grad is not None:
                buffers.adopt_grad(index)
            else:
                buffers.zero_grad_view(index)
        self._grad_versions[bucket_index] = buffers.grad_buffers[bucket_index]._version


def _register_accumulate_hook(param: Tensor, hook: _AccumulateGradHook) -> RemovableHandle:
    """``param``'s post-accumulate-grad hook, frozen params included (see :meth:`GradReadyTracker.scan`):
    torch refuses to register one on a tensor that does not require grad, but keeps it on the
    tensor, where the param's grad accumulator finds it once the param is unfrozen; so the flag
    is set for the registration only (no torch function mode sees it)."""
    if param.requires_grad:
        return param.register_post_accumulate_grad_hook(hook)
    with torch._C.DisableTorchFunction():
        param.requires_grad_(True)
        try:
            return param.register_post_accumulate_grad_hook(hook)
        finally:
            param.requires_grad_(False)


class _AccumulateGradHook(CopiesAsInert):
    """The post-accumulate-grad hook of one param: records the grad for its tracker, see Note
    [Hook cost]. Refers to the tracker weakly and does nothing once it is gone or once it is
    retired (a newer tracker took the param, see :func:`_retire_older_hooks`); copies and
    pickles are :class:`~sharded_opt.weak_hooks.InertHook` (Note [Hook lifetimes and copies])."""

    __slots__ = ("_tracker", "_index", "_bucket_index", "_grad_view", "_grad_address", "retired")

    def __init__(self, tracker: GradReadyTracker, index: int, bucket_index: int) -> None:
        buffers = tracker._buffers
        grad_view = buffers.grad_views[index]
        if grad_view is None:
            raise RuntimeError(f"GradReadyTracker: param {index} is hooked before its bucket has grads")
        self._tracker = weakref.ref(tracker)
        self._index = index
        self._bucket_index = bucket_index
        self._grad_view = grad_view
        self._grad_address = buffers.grad_addresses[index]
        self.retired = False

    def __call__(self, param: Tensor) -> None:
        tracker = self._tracker()
        if tracker is None or self.retired:
            return
        index, bucket_index = self._index, self._bucket_index
        grad = param.grad
        if grad is not self._grad_view or grad.data_ptr() != self._grad_address:  # assigned, or moved
            tracker._buffers.adopt_grad(index)
        tracker.received[index] = 1
        # A view shares its bucket buffer's version counter, see Note [Grads written after backward].
        tracker._grad_versions[bucket_index] = self._grad_view._version
        if tracker._grad_streams is not None:
            tracker._grad_streams.note_grad_stream(bucket_index)
        if not tracker._in_backward:
            tracker._begin_backward()
        if tracker._launcher is not None and not tracker.accumulate_only:
            tracker._count(index, bucket_index)


def _retire_older_hooks(params: list[Tensor]) -> None:
    """Silence the hooks an older tracker (a previous wrapper still alive, not yet closed or
    collected) left on ``params``: the params' grads now belong to the new tracker's buffers.
    Ownership is decided here, once, and not by where ``param.data`` lives, so a param whose
    data the user replaced (Note [Params replaced after wrapping] in ``sharded_opt/param_guard.py``)
    keeps reporting its grads."""
    for param in params:
        hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
        for hook in hooks.values():
            if isinstance(hook, _AccumulateGradHook):
                hook.retired = True
