"""``Bucket``: one bucket at run time, from its params' grads to its updated params.

The unit the whole design is about (as Megatron-Core's ``_ParamAndGradBucketGroup`` and
FSDP2's ``FSDPParamGroup``): its plan, its views into the flat buffers, this rank's shard of it
and its precision, its collectives in flight with their events, what the grad hooks recorded
for it in this iteration, and the presence flags its params agreed on. What every bucket shares
(the groups, the comm stream, the bounded pools) is the :class:`~sharded_opt.comm.comm_context.CommContext`.

Vocabulary follows Megatron-Core: ``start_*`` issues asynchronous collectives on the comm
stream, ``finish_*`` makes compute wait for them. Sync mode calls start and finish back to back;
overlap mode calls start from backward hooks and finish as late as possible. Both issue the very
same collectives on the very same buffers, which is why their results are bitwise equal.

Note [Mixed precision]
    Params and their grads live in the params' own dtype (bf16, say) in the flat buffers:
    autograd needs a grad of the param's dtype. Grads are reduced in ``reduce_dtype`` (fp32 by
    default for 16-bit params): on CPU gloo the bf16 grads are sent as they are and widened
    while their slices are summed (Note [Widening on receipt] in ``collectives``); elsewhere a
    bf16 bucket is cast into an fp32 staging buffer that the collective reads (Note [Bounded
    staging] in ``comm_context``). The averaged shard arrives in a persistent fp32 tensor. With
    a ``master_dtype`` wider than the params, the inner optimizer steps a persistent fp32 master
    copy of the local shard only (never of the whole model); after the step the master is cast
    back into the param buffer's shard, which is all-gathered in the params' dtype. See Note
    [Master copies] in ``local_shard`` for how params written by others stay the truth.

Note [Buckets that take part]
    A bucket takes part in an iteration's reduction when any of its params requires grad; which
    params do is program state, the same on every rank, so every rank issues the same
    collectives. A bucket of params that were all frozen when the wrapper was built has no grad
    buffer and no local shard until one of them is unfrozen (:meth:`Bucket.materialize`). A
    bucket is all-gathered after a step only if the step changed it: some param of it got a grad
    on some rank (agreed over the group, so again the same on every rank).

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
    received (``GradReadyTracker.note_unseen_grad`` in ``grad_hooks``); where the agreed flags show one on
    some rank, every rank gives the bucket its grad buffer and shard, copying the held grads
    in, before reducing it (``GradReadyTracker.take_frozen``). ``zero_grad()`` sets such
    grads to None as torch does, so a discarded one is not stepped later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.distributed import Work
from torch.futures import Future

from fusion.buffers import FlatBuffers
from fusion.layout import BucketPlan
from sharded_opt.comm.bucket_wire import BucketWire
from sharded_opt.comm.comm_context import CommContext
from sharded_opt.comm.streams import (
    note_current_stream,
    on_stream,
    record_completion,
    wait_comm,
    wait_compute,
    wait_event_once,
)
from sharded_opt.step.local_shard import BucketPrecision, LocalShard, build_local_shard

if TYPE_CHECKING:
    from sharded_opt.step.grad_presence import SharedFlags


class Bucket:
    """One bucket of the layout at run time; see the module docstring.

    Args:
        plan: the bucket's place in the layout.
        buffers: the flat buffers holding its params and grads.
        precision: its dtypes.
        comm: what it shares with the other buckets of the wrapper.

    The attributes the grad hooks record (``expected``, ``to_count``, ``count``,
    ``grad_version``, ``frozen``) are written by :class:`~sharded_opt.step.grad_hooks.GradReadyTracker`
    and its hooks, which keep them cheap to reach (Note [Hook cost] in ``grad_hooks``).
    """

    __slots__ = (
        "plan",
        "index",
        "precision",
        "staged",
        "shard",
        "expected",
        "to_count",
        "count",
        "grad_version",
        "frozen",
        "flags",
        "_buffers",
        "_comm",
        "_grad_work",
        "_grad_streams",
        "_param_work",
        "_param_event",
        "_param_waited",
        "_wire",
    )

    def __init__(
        self, plan: BucketPlan, buffers: FlatBuffers, precision: BucketPrecision, comm: CommContext
    ) -> None:
        self.plan = plan
        self.index = plan.index
        """The bucket's position in bucket order (the layout's index)."""
        self.precision = precision
        self.staged = plan.staged_grads
        """It stages its grads (Note [Staged grads] in ``fusion.layout``): no hooks, read at ``step()``."""
        self._buffers = buffers
        self._comm = comm
        self.shard: LocalShard | None = None
        """What this rank steps of the bucket; None until the bucket has a grad buffer."""
        self._grad_work: Work | Future | None = None
        self._grad_streams: list[torch.Stream] = []
        """The streams its grads were accumulated on since its last reduction."""
        self._param_work: Work | None = None
        self._param_event: torch.Event | None = None
        """An event after its latest all-gather (accelerators only)."""
        self._param_waited: list[torch.Stream] = []
        """The streams that already waited on ``_param_event``."""
        self.expected = 0
        """Its params that require grad, as of the tracker's last scan."""
        self.to_count = 0
        """The grads overlap mode counts before launching it (0 when it stages its grads)."""
        self.count = 0
        """The grads counted in this iteration."""
        self.grad_version: int | None = None
        """Its grad buffer's version after backward (or the wrapper) last wrote it in this
        iteration, see Note [Grads written after backward] in ``grad_hooks``."""
        self.frozen: list[int] = []
        """Its params that do not require grad now, when it has a grad buffer and views."""
        self.flags: SharedFlags | None = None
        """Its params' agreed presence flags in this iteration, once shared (``GradPresence``)."""
        self._wire = BucketWire(comm, plan.shard_numel, plan.dtype)
        """How its grads and params travel (exact, cast or compressed)."""

    # -- buffers -------------------------------------------------------------------------------

    @property
    def grad_buffer(self) -> Tensor | None:
        return self._buffers.grad_buffers[self.index]

    @property
    def param_buffer(self) -> Tensor:
        return self._buffers.param_buffers[self.index]

    def param_indices(self) -> list[int]:
        """Its params' indices (optimizer order), in layout order."""
        return [slot.param_index for slot in self.plan.slots]

    def takes_part(self) -> bool:
        """Whether it has a param that requires grad (as of the last scan): the same on every
        rank, see Note [Collectives from agreed state] in ``grad_sync``."""
        return self.expected > 0

    def materialize(self) -> LocalShard | None:
        """Give the bucket its grad buffer and local shard; return the shard if it is new."""
        if self.shard is not None:
            return None
        buffers, comm, precision, plan = self._buffers, self._comm, self.precision, self.plan
        buffers.allocate_grads(self.index)
        grad_buffer = buffers.grad_buffers[self.index]
        self._wire.allocate_residual(plan.device)
        if comm.sharded:
            reduced = torch.zeros(plan.shard_numel, dtype=precision.reduce_dtype, device=plan.device)
            if grad_buffer.dtype != reduced.dtype and not comm.widens_on_receipt:
                comm.staging.reserve(plan.padded_numel * reduced.element_size())
        elif comm.world_size > 1 and precision.reduce_dtype != precision.param_dtype:
            reduced = torch.zeros_like(grad_buffer, dtype=precision.reduce_dtype)
        else:
            reduced = grad_buffer  # reduced in place (all-reduce), or nothing to reduce on one rank
        self.shard = build_local_shard(buffers, plan, comm.rank, comm.sharded, reduced, precision)
        return self.shard

    def reduced_grad_tensors(self) -> list[Tensor]:
        """The persistent grad tensors of its shard beyond its grad buffer: the averaged shard
        grads and, with a stepped tensor of another dtype, its grads."""
        if self.shard is None:
            return []
        tensors = {id(t): t for t in (self.shard.reduced_grad, self.shard.stepped_grad)}
        return [t for t in tensors.values() if t is not self.grad_buffer]

    # -- the hooks' record -----------------------------------------------------------------------

    def grads_written(self) -> bool:
        """Whether its grad buffer was written since backward (or the wrapper) last wrote it in
        this iteration, see Note [Grads written after backward] in ``grad_hooks``."""
        return self.grad_version is not None and self.grad_buffer._version != self.grad_version

    def accept_grad_writes(self) -> None:
        """The wrapper itself wrote the grad buffer: its current version is the expected one."""
        if self.grad_version is not None:
            self.grad_version = self.grad_buffer._version

    def stage_grads(self, received: bytearray) -> None:
        """Copy the grads autograd holds into the grad buffer (a bucket that stages them) and
        record in ``received`` which params hold one (Note [Staged grads] in ``fusion.layout``)."""
        present = self._buffers.stage_grads(self.index)
        for slot, has_grad in zip(self.plan.slots, present, strict=True):
            received[slot.param_index] = has_grad

    def adopt_uncounted(self, counted: bytearray, received: bytearray) -> None:
        """Point every grad of a param that requires grad and that backward did not count into
        the buffer (an assigned one, or None as zeros), see Note [Which params got a grad] in
        ``grad_hooks``; the frozen params are left to :meth:`settle_frozen`."""
        if self.staged:
            return  # stage_grads reads them
        params, buffers = self._buffers.params, self._buffers
        for slot in self.plan.slots:
            index = slot.param_index
            if counted[index] or not params[index].requires_grad:
                continue
            had_grad = params[index].grad is not None
            if buffers.adopt_grad(index):  # None (no grad) or an assigned tensor (a grad)
                received[index] = had_grad
                self.grad_version = buffers.grad_buffers[self.index]._version

    def settle_frozen(self, received: bytearray) -> None:
        """Before the reduction: a frozen param keeps a grad it received and still holds (Note
        [Frozen after backward]); any other frozen param's slot is zeroed, its
        ``.grad`` left as it is. Its slot may still hold a grad that ``model.zero_grad()`` set to
        None since, which would otherwise be averaged with another rank's present grad."""
        if not self.frozen:
            return
        params, buffers = self._buffers.params, self._buffers
        for index in self.frozen:
            if received[index] and params[index].grad is not None:
                buffers.adopt_grad(index)
            else:
                buffers.zero_grad_view(index)
        self.grad_version = buffers.grad_buffers[self.index]._version

    # -- presence --------------------------------------------------------------------------------

    def agreed_presence(self) -> list[int]:
        """Per slot (layout order), 1 if its param got a grad on some rank; waits for the flags'
        all-reduce.

        Raises:
            RuntimeError: its flags were not shared this iteration.
        """
        if self.flags is None:
            raise RuntimeError(
                f"ShardingStage1: the grad presence flags of bucket {self.index} were never shared"
            )
        return self.flags.values()

    def params_with_grads(self) -> set[int]:
        """The param indices of its slots whose param got a grad on some rank (waits, as
        :meth:`agreed_presence` does)."""
        slots = self.plan.slots
        return {slot.param_index for slot, flag in zip(slots, self.agreed_presence(), strict=True) if flag}

    # -- grad sync -------------------------------------------------------------------------------

    def note_grad_stream(self) -> None:
        """Remember the current stream as one that accumulated its grads (called by the grad
        hooks in overlap mode, on accelerators only), see Note [Streams and events]."""
        note_current_stream(self._grad_streams, self._comm.stream.device)

    def start_grad_sync(self) -> None:
        """Issue the grad reduction; its input must be final (see Note [Streams and events])."""
        comm = self._comm
        if comm.world_size == 1:
            return
        shard = self._live_shard()
        producers, self._grad_streams = self._grad_streams, []
        wait_compute(comm.stream, producers)
        with on_stream(comm.stream):
            self._grad_work = self._wire.reduce(shard.reduced_grad, self.grad_buffer)

    @property
    def grad_sync_pending(self) -> bool:
        """Its grad reduction is issued and not yet finished."""
        return self._grad_work is not None

    def finish_grad_sync(self) -> None:
        """Make compute wait for the grad reduction; the optimizer's grads of the bucket are then
        final. Finish once per reduction: a second call copies the reduced grads into the stepped
        ones again, undoing a clip."""
        work, self._grad_work = self._grad_work, None
        wait_comm([work])
        if self.shard is not None:
            self.shard.copy_reduced_to_stepped_grad()

    # -- param sync ------------------------------------------------------------------------------

    def start_param_sync(self) -> None:
        """All-gather the updated shard into the param buffer, or share its compressed delta;
        on the comm stream, which waited for the step (see :func:`start_param_syncs`)."""
        self._param_event = None
        self._param_waited = []
        shard = self._live_shard()
        if self._wire.publishes_deltas:
            assert shard.master is not None and shard.published is not None
            replica = shard.param_view.data
            self._param_work = self._wire.publish_deltas(
                self.param_buffer, shard.master, replica, shard.published
            )
        else:
            self._param_work = self._wire.gather(self.param_buffer, shard.param_view)

    @property
    def grad_residual(self) -> Tensor | None:
        """Its error feedback residual, see Note [Error feedback] in ``compression``."""
        return self._wire.residual

    @property
    def publishes_deltas(self) -> bool:
        """Its updated params are shared as compressed deltas (Note [Compressed wire])."""
        return self._wire.publishes_deltas

    @property
    def param_sync_pending(self) -> bool:
        """Its updated params are still being all-gathered."""
        return self._param_work is not None

    def finish_param_sync(self) -> None:
        """Make the current stream (on CPU: the host) wait for its latest all-gather.

        The first call after an all-gather turns its handle into an event on the comm stream,
        kept until the next all-gather; every stream that calls this later waits on that event
        once (forwards on several streams, a second consumer, before a CUDA-graph replay). See
        Note [Streams and events].
        """
        work = self._param_work
        if work is not None:
            self._param_work = None
            self._param_event = record_completion(work, self._comm.stream)
        wait_event_once(self._param_event, self._param_waited)

    def _live_shard(self) -> LocalShard:
        if self.shard is None:
            raise RuntimeError(f"Bucket: bucket {self.index} has no local shard")
        return self.shard


def build_buckets(buffers: FlatBuffers, precisions: list[BucketPrecision], comm: CommContext) -> list[Bucket]:
    """One :class:`Bucket` per bucket of the layout, in bucket order; those whose grad buffer
    exists get their local shard now."""
    buckets = [
        Bucket(plan, buffers, precision, comm)
        for plan, precision in zip(buffers.plan.buckets, precisions, strict=True)
    ]
    for bucket in buckets:
        if bucket.grad_buffer is not None:
            bucket.materialize()
    return buckets


def finish_grad_syncs(buckets: list[Bucket], comm: CommContext, some: list[Bucket] | None = None) -> None:
    """Make compute wait for the grad reductions of ``some`` of ``buckets`` (default: all) and
    copy their averaged grads into the stepped ones; once none of ``buckets`` has a reduction
    pending, the shared pools start afresh. ``step()`` finishes one bucket at a time to step
    each shard as soon as its reduction lands (Note [Step pipeline] in ``step_pipeline``)."""
    for bucket in buckets if some is None else some:
        bucket.finish_grad_sync()
    if not any(bucket.grad_sync_pending for bucket in buckets):
        comm.grad_syncs_finished()


def start_param_syncs(buckets: list[Bucket], comm: CommContext) -> None:
    """Cast master shards back into the param buffer and all-gather the updated shards of
    ``buckets`` (those the step changed, in the order given), behind the last optimizer op."""
    for bucket in buckets:
        if not bucket.publishes_deltas:  # its delta is taken from the master as it is sent
            bucket._live_shard().write_back()
    if not comm.sharded:
        return
    wait_compute(comm.stream)
    with on_stream(comm.stream):
        for bucket in buckets:
            bucket.start_param_sync()


@torch.no_grad()
def republish_exactly(buckets: list[Bucket]) -> None:
    """Rebuild every rank's params exactly from the owners' masters, with uncompressed
    all-gathers (collective): after a checkpoint's masters were loaded, when params are shared
    as compressed deltas (Note [Compressed wire] in ``compression``)."""
    for bucket in buckets:
        shard = bucket.shard
        if shard is None or not bucket.publishes_deltas:
            continue
        shard.write_back()
        assert shard.published is not None
        shard.published.copy_(shard.param_view)
        wait_comm([bucket._wire.gather(bucket.param_buffer, shard.param_view)])
