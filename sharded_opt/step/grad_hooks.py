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
    backward] in ``bucket``).

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
from sharded_opt.guards.messages import DROP_DDP
from sharded_opt.model_hooks.weak_hooks import (
    CopiesAsInert,
    register_accumulate_hook,
    retire_hooks,
)
from sharded_opt.step.backward_end import BackwardEnd
from sharded_opt.step.bucket import Bucket

_requires_grad = operator.attrgetter("requires_grad")


class ShardMaterializer(Protocol):
    """Gives a bucket its grad buffer and local shard, and the inner optimizer the shard's
    pieces (idempotent); asked when a param of a bucket that has none starts to require grad."""

    def materialize(self, bucket: Bucket) -> None: ...


class GradSyncLauncher(Protocol):
    """What overlap mode's hooks drive: the start of each bucket's reduction."""

    def start_bucket_grad_sync(self, bucket: Bucket) -> None:
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
    bucket order as their grads complete. What it records per bucket (expected and counted
    grads, the grad buffer's version, frozen params) lives on the :class:`Bucket` its hooks hold;
    the tracker keeps the per-param record and the launch order.

    Args:
        buffers: the flat buffers whose params get hooks.
        buckets: the wrapper's buckets, in bucket order.
        shards: gives a bucket its grad buffer and local shard when a param of a bucket that has
            none starts to require grad.
        launcher: the grad-sync side that issues the reductions (overlap mode). None (sync
            mode): only record grads.
        note_streams: tell each bucket the stream of every hook that accumulated a grad into it
            (no_sync included): overlap mode on an accelerator. See Note [Streams and events].
    """

    def __init__(
        self,
        buffers: FlatBuffers,
        buckets: list[Bucket],
        shards: ShardMaterializer,
        launcher: GradSyncLauncher | None = None,
        *,
        note_streams: bool = False,
    ) -> None:
        self._buffers = buffers
        self._buckets = buckets
        self._shards = shards
        self._launcher = launcher
        self._note_streams = note_streams
        self.stages_any = any(bucket.staged for bucket in buckets)
        """Some bucket stages its grads (Note [Staged grads] in ``fusion.layout``): its reduction,
        and the sharing of the last presence flags, wait for ``step()``."""
        num_params = len(buffers.params)
        bucket_of: list[Bucket | None] = [None] * num_params
        for bucket in buckets:
            for index in bucket.param_indices():
                bucket_of[index] = bucket
        self._bucket_of = bucket_of
        self.received = bytearray(num_params)
        """Per param, 1 if a grad reached it since grads were last set to none."""
        self._hooked = bytearray(num_params)
        self.accumulate_only = False
        """True inside ``no_sync()``: grads accumulate in the buffers and nothing is launched."""
        self.handles: list[RemovableHandle] = []
        """The hooks this tracker installed; see Note [Hook lifetimes and copies]."""
        self._laid_out_params = [buffers.params[index] for index in buffers.laid_out_indices]
        self._requires_grad_at_scan: bytes | None = None
        self._iteration = 0
        self._backward_end = BackwardEnd(self._end_of_backward)
        retire_hooks(self._laid_out_params, _AccumulateGradHook)
        self.scan()
        self.reset()

    @property
    def overlapping(self) -> bool:
        return self._launcher is not None

    def reset(self) -> None:
        """Start a new iteration: no grad counted, no bucket launched, requires_grad re-read at
        the next hook."""
        for bucket in self._buckets:
            bucket.count = 0
            bucket.grad_version = None
        self._counted = bytearray(len(self._buffers.params))
        self._next_to_launch = 0
        """The position in bucket order of the next bucket to launch."""
        self._scanned = False
        self._counted_any = False
        self._flushed_at_end = False
        self._in_backward = False  # a backward that raised never ran its end
        self._iteration += 1

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
        params, views = self._buffers.params, self._buffers.grad_views
        bucket_of = self._bucket_of
        expected = dict.fromkeys(self._buckets, 0)
        for index in self._buffers.laid_out_indices:
            if params[index].requires_grad:
                expected[bucket_of[index]] += 1
        with_grads = {b for b in self._buckets if b.grad_buffer is not None or expected[b]}
        to_hook = []
        for index in self._buffers.laid_out_indices:
            param, bucket = params[index], bucket_of[index]
            if bucket.staged:
                if expected[bucket]:
                    self._shards.materialize(bucket)  # no hook: grads are read at step()
            elif not self._hooked[index] and bucket in with_grads:
                # Every param whose grad is (or is about to be) a buffer view gets its hook now,
                # frozen ones too: unfrozen later, its grad may accumulate into its view before
                # the first hook of that backward scans again, and would go unrecorded (a layer
                # unfrozen while every later layer is frozen or staged). Read before any hook is
                # added: giving a bucket its grad buffer points every param of it at its view,
                # so a grad that arrived before the hook would look like the view's own.
                arrived = param.grad is not None and param.grad is not views[index]
                to_hook.append((index, bucket, param, arrived))
        for index, bucket, param, arrived in to_hook:
            self._hook(index, bucket, param, arrived)
        for bucket in self._buckets:
            bucket.expected = expected[bucket]
            bucket.to_count = 0 if bucket.staged else bucket.expected
            bucket.frozen = []
        self._requires_grad_at_scan = requires_grad
        for index in self._buffers.laid_out_indices:
            bucket = bucket_of[index]
            if bucket.staged:
                continue  # staging copies every grad held, frozen or not
            if not params[index].requires_grad and bucket.grad_buffer is not None:
                bucket.frozen.append(index)

    def _hook(self, index: int, bucket: Bucket, param: Tensor, arrived_before_hook: bool) -> None:
        self._shards.materialize(bucket)
        hook = _AccumulateGradHook(self, index, bucket)
        self.handles.append(register_accumulate_hook(param, hook))
        self._hooked[index] = 1
        if arrived_before_hook:
            # Not counted: the grad may be from this backward or older; if this backward still
            # reaches the param, its hook counts it, and otherwise the end-of-backward flush
            # launches the bucket.
            self._buffers.adopt_grad(index)
            self.received[index] = 1

    def frozen_buckets(self) -> list[Bucket]:
        """Buckets whose params are all frozen now (as of the last scan), with a grad buffer or
        not: they take part only where some rank holds a grad in them, decided from the agreed
        presence flags; see Note [Frozen after backward] in ``bucket``."""
        return [bucket for bucket in self._buckets if not bucket.takes_part()]

    def note_unseen_grad(self, bucket: Bucket, param_index: int) -> bool:
        """Record as received, and return whether, the param holds a grad no hook could see:
        its bucket has no grad buffer (every param frozen when wrapped and at every scan since),
        yet a backward that ran no hook of this wrapper, or an assignment, gave it one. torch
        steps it. See Note [Frozen after backward] in ``bucket``."""
        if bucket.grad_buffer is not None or self._buffers.params[param_index].grad is None:
            return False
        self.received[param_index] = 1
        return True

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
                f"ShardingStage1: the grads of buckets {[b.index for b in written[:8]]} were written at "
                "the end of backward, after they were accumulated: a DistributedDataParallel (or FSDP) "
                "wrapper around the model does this (the accelerator of Hugging Face Trainer, Accelerate "
                "and Lightning adds one after the optimizer was built: use the adapters of "
                f"sharded_opt.integrations). It averages the grads a second time. {DROP_DDP}"
            )

    def _count(self, param_index: int, bucket: Bucket) -> None:
        """Overlap mode, outside ``no_sync()``: count the grad and launch what is ready, see
        Note [Launching reductions during backward]."""
        if self._counted[param_index] or bucket.index < self._next_to_launch:
            self._restart()
        self._counted[param_index] = 1
        self._counted_any = True
        bucket.count += 1
        # Only a bucket that just completed can extend the launched prefix.
        if bucket.count >= bucket.to_count:
            self._launch_ready()

    def _restart(self) -> None:
        """A second backward before ``step()``, see Note [A second backward]."""
        self._launcher.restart_grad_sync()
        self.reset()
        self._scanned = True  # this backward's first hook already scanned requires_grad
        self._in_backward = True  # and this backward's end is queued

    def _launch_ready(self) -> None:
        buckets = self._buckets
        while self._next_to_launch < len(buckets):
            bucket = buckets[self._next_to_launch]
            if bucket.count < bucket.to_count:
                return
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        """Launch one bucket in order; a bucket that stages its grads is passed over here and
        launched by ``step()`` after staging, and so are the last presence flags."""
        if bucket.takes_part() and not bucket.staged:
            bucket.settle_frozen(self.received)
            self._launcher.start_bucket_grad_sync(bucket)
        self._next_to_launch = bucket.index + 1
        if self._next_to_launch == len(self._buckets) and not self.stages_any:
            self._launcher.all_buckets_launched()

    def staged_buckets(self) -> list[Bucket]:
        """The buckets that stage their grads and take part (as of the last scan), in order."""
        return [bucket for bucket in self._buckets if bucket.staged and bucket.takes_part()]

    def stage_grads(self) -> None:
        """Copy the grads of every bucket that stages them into its grad buffer and record which
        params hold one: for them ``received`` is ``param.grad is not None``, read now (Note
        [Staged grads] in ``fusion.layout``)."""
        for bucket in self._buckets:
            if bucket.staged and bucket.grad_buffer is not None:
                bucket.stage_grads(self.received)

    def adopt_all(self) -> None:
        """Re-point every grad of a param that requires grad into its buffer (sync mode, before
        the reduction), see Note [Which params got a grad]."""
        self.scan()
        for bucket in self._buckets:
            if bucket.takes_part():
                self.adopt_uncounted(bucket)

    def flush(self) -> None:
        """Launch every bucket not launched yet, in order, with missing grads as zeros."""
        if self.accumulate_only or self._launcher is None:
            return
        if not self._scanned:
            self.scan()
        for bucket in self._buckets[self._next_to_launch :]:
            if bucket.takes_part():
                bucket.adopt_uncounted(self._counted, self.received)  # _launch settles the frozen
            self._launch(bucket)

    def accept_grad_writes(self) -> None:
        """The wrapper itself wrote the grad buffers (an in-place reduction, clipping or unscaling
        of grads that are the buffers): their current versions are the expected ones."""
        for bucket in self._buckets:
            bucket.accept_grad_writes()

    def grads_written_since_backward(self) -> list[Bucket]:
        """Buckets whose grad buffer was written after backward last accumulated into it, see
        Note [Grads written after backward]."""
        return [bucket for bucket in self._buckets if bucket.grads_written()]

    def adopt_uncounted(self, bucket: Bucket) -> None:
        """Make the bucket's grad buffer hold exactly this rank's grads before its reduction: a
        grad that backward did not count is adopted (an assigned one, or None as zeros), and the
        frozen params are settled (``Bucket.settle_frozen``)."""
        bucket.adopt_uncounted(self._counted, self.received)
        bucket.settle_frozen(self.received)

    def take_frozen(self, bucket: Bucket) -> None:
        """Before the reduction of a bucket whose params are all frozen, which the agreed flags
        say some rank holds a grad in: give it its grad buffer and shard if it has none (on
        every rank alike, the flags are agreed), its hooks and its grads, then settle it."""
        if bucket.grad_buffer is None:
            self._shards.materialize(bucket)  # copies in the grads params hold
            self._requires_grad_at_scan = None  # hook its params, list them as frozen
            self.scan()
            if bucket.staged:
                bucket.stage_grads(self.received)
        bucket.settle_frozen(self.received)


class _AccumulateGradHook(CopiesAsInert):
    """The post-accumulate-grad hook of one param: records the grad for its tracker and its
    bucket, see Note [Hook cost]. Refers to the tracker weakly and does nothing once it is gone
    or once it is retired (a newer tracker took the param, see
    :func:`~sharded_opt.model_hooks.weak_hooks.retire_hooks`); copies and pickles are
    :class:`~sharded_opt.model_hooks.weak_hooks.InertHook` (Note [Hook lifetimes and copies])."""

    __slots__ = ("_tracker", "_index", "_bucket", "_grad_view", "_grad_address", "retired")

    def __init__(self, tracker: GradReadyTracker, index: int, bucket: Bucket) -> None:
        buffers = tracker._buffers
        grad_view = buffers.grad_views[index]
        if grad_view is None:
            raise RuntimeError(f"GradReadyTracker: param {index} is hooked before its bucket has grads")
        self._tracker = weakref.ref(tracker)
        self._index = index
        self._bucket = bucket
        self._grad_view = grad_view
        self._grad_address = buffers.grad_addresses[index]
        self.retired = False

    def __call__(self, param: Tensor) -> None:
        tracker = self._tracker()
        if tracker is None or self.retired:
            return
        index, bucket = self._index, self._bucket
        grad = param.grad
        if grad is not self._grad_view or grad.data_ptr() != self._grad_address:  # assigned, or moved
            tracker._buffers.adopt_grad(index)
        tracker.received[index] = 1
        # A view shares its bucket buffer's version counter, see Note [Grads written after backward].
        bucket.grad_version = self._grad_view._version
        if tracker._note_streams:
            bucket.note_grad_stream()
        if not tracker._in_backward:
            tracker._begin_backward()
        if tracker._launcher is not None and not tracker.accumulate_only:
            tracker._count(index, bucket)
