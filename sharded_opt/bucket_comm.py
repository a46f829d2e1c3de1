"""Per-bucket collectives: reduce grads into this rank's shard, all-gather updated shards.

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
    staging]). The averaged shard arrives in a persistent fp32 tensor. With a ``master_dtype``
    wider than the params, the inner optimizer steps a persistent fp32 master copy of the
    local shard only (never of the whole model); after the step the master is cast back into
    the param buffer's shard, which is all-gathered in the params' dtype. See Note [Master
    copies] in ``local_shard`` for how params written by others stay the truth.

Note [Buckets that take part]
    A bucket takes part in an iteration's reduction when any of its params requires grad; which
    params do is program state, the same on every rank, so every rank issues the same
    collectives. A bucket of params that were all frozen when the wrapper was built has no grad
    buffer and no local shard until one of them is unfrozen (:meth:`BucketCommunicator.materialize`).
    A bucket is all-gathered after a step only if the step changed it: some param of it got a
    grad on some rank (agreed over the group, so again the same on every rank).

Note [Bounded staging]
    A bucket whose grads are cast to ``reduce_dtype`` before the reduce-scatter (bf16 grads
    reduced in fp32) needs a bucket-sized input in that dtype that lives until the collective has
    read it. Allocating one per bucket and keeping each until ``finish_grad_sync`` holds a cast of
    every bucket at once at the end of backward: a full fp32 copy of the grads (4 bytes per
    param) that ``memory_bytes()`` did not show. Instead the casts go into a pool of at most
    ``STAGING_BUFFERS`` persistent buffers of the largest such bucket, used in turn. Before a
    buffer is overwritten, the writer waits for the collective that last read it: on CPU the host
    waits on that reduction's handle; on an accelerator the comm stream, where the cast runs,
    waits for it (``Work.wait()`` with the comm stream current: on NCCL the host is not
    blocked). So at most two casts exist, whatever the number of buckets, and the third bucket's
    cast starts only once the first bucket's collective is done. On CPU that wait holds up the
    backward hook that launches the third bucket when the first reduction is slower than the
    backward between them: memory is bounded at the price of that much overlap. The values cast
    are the same as before, so results are bitwise unchanged. The pool is reported by
    ``memory_bytes()["staging"]``.

Note [Bounded receive buffers]
    On CPU gloo every reduce-scatter receives into a buffer of its bucket's size (every rank's
    slice for this rank, summed once all are in: Note [Reduce-scatter on gloo] in
    ``collectives``), allocated per call and freed once summed. Sync mode issues every bucket's
    reduction at once and overlap mode issues them as fast as backward produces grads, so
    without a bound as many of them were live as gloo had collectives running or queued: 3
    buckets on the 33.6M-param MLP (+1.5-1.8 bytes per param over the step's rest,
    ``benchmarks/results/2026-12-05-peak-memory.md``). So before a reduction is issued, the host
    waits for the oldest ones in flight until its buffer fits in ``RECEIVE_BUDGET_BYTES`` with
    theirs; a bucket larger than the budget alone is always let through. The budget is a
    constant, not a share of the model: it keeps this transient at a fixed 16 MiB (one bucket
    of the default sizes of a large model, or up to 16 small ones) whatever the model's size,
    while small buckets still overlap each other on the wire. The same collectives run on the
    same buffers in the same order, only later, so results are bitwise unchanged. The price is
    as for Note [Bounded staging]: in overlap mode a backward hook may wait for the reduction
    before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, Work
from torch.futures import Future

from fusion.buffers import FlatBuffers
from sharded_opt import collectives
from sharded_opt.local_shard import BucketPrecision, LocalShard, build_local_shard
from sharded_opt.streams import (
    new_comm_stream,
    note_current_stream,
    on_stream,
    record_completion,
    wait_comm,
    wait_compute,
    wait_event_once,
)

STAGING_BUFFERS = 2
"""Casts of grads to ``reduce_dtype`` that may exist at once: one read by a running collective
while the next bucket is cast into the other. See Note [Bounded staging]."""

RECEIVE_BUDGET_BYTES = 16 * 2**20
"""Bytes of reduce-scatter receive buffers that may be live at once on the host (at least one
bucket's, whatever its size). See Note [Bounded receive buffers]."""


class BucketCommunicator:
    """Owns the comm stream, each bucket's :class:`LocalShard` and the pending collectives.

    In sharded mode (``sharded=True`` and more than one rank) a bucket's grads are
    reduce-scattered (averaged, as DDP does) into the local shard's persistent reduced grad and
    the updated shard is all-gathered back into the bucket in place. Otherwise grads are
    all-reduced (or, on one rank, left as they are) and the whole bucket is stepped. See Note
    [Mixed precision] and Note [Buckets that take part].
    """

    def __init__(
        self,
        buffers: FlatBuffers,
        group: ProcessGroup,
        rank: int,
        world_size: int,
        sharded: bool,
        precisions: list[BucketPrecision],
        replicate_group: ProcessGroup | None = None,
        point_to_point: bool = False,
    ) -> None:
        self.buffers = buffers
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.sharded = sharded and world_size > 1
        self.precisions = precisions
        self.point_to_point = point_to_point
        """``ShardingConfig.gloo_point_to_point``, see Note [Reduce-scatter on gloo] in
        ``collectives``."""
        self.replicate_group = replicate_group if self.sharded else None
        """Ranks holding the same shard (hybrid sharding), see Note [Hybrid sharding] in
        ``hybrid_groups``; None without replicas."""
        self._replica_chain = ReplicaChain()
        self.stream = new_comm_stream(buffers.plan.buckets[0].device)
        num_buckets = len(buffers.plan.buckets)
        self._grad_works: list[Work | Future | None] = [None] * num_buckets
        self._grad_streams: list[list[torch.Stream]] = [[] for _ in range(num_buckets)]
        """Per bucket, the streams its grads were accumulated on since its last reduction."""
        self._staging = _StagingPool(buffers.plan.buckets[0].device)
        self._widens_on_receipt = self.stream is None and collectives.widens_on_receipt(
            group, buffers.plan.buckets[0].device
        )
        """Grads of a narrower dtype than the reduction go out as they are and are widened where
        they are summed, see Note [Widening on receipt] in ``collectives``."""
        self._receives = (
            _ReceiveBudget(RECEIVE_BUDGET_BYTES) if self._widens_on_receipt and self.sharded else None
        )
        """See Note [Bounded receive buffers]; None where no receive buffer is allocated."""
        self._param_works: list[Work | None] = [None] * num_buckets
        self._param_events: list[torch.Event | None] = [None] * num_buckets
        """Per bucket, an event after its latest all-gather (accelerators only)."""
        self._param_waited: list[list[torch.Stream]] = [[] for _ in range(num_buckets)]
        """Per bucket, the streams that already waited on its ``_param_events`` entry."""
        self.shards: list[LocalShard | None] = [None] * num_buckets
        """Per bucket, what this rank steps; None until the bucket has a grad buffer."""
        for bucket in buffers.plan.buckets:
            if buffers.grad_buffers[bucket.index] is not None:
                self.materialize(bucket.index)

    def materialize(self, bucket_index: int) -> LocalShard | None:
        """Give the bucket its grad buffer and local shard; return the shard if it is new."""
        if self.shards[bucket_index] is not None:
            return None
        self.buffers.allocate_grads(bucket_index)
        bucket = self.buffers.plan.buckets[bucket_index]
        precision = self.precisions[bucket_index]
        grad_buffer = self.buffers.grad_buffers[bucket_index]
        if self.sharded:
            reduced = torch.zeros(bucket.shard_numel, dtype=precision.reduce_dtype, device=bucket.device)
            if grad_buffer.dtype != reduced.dtype and not self._widens_on_receipt:
                self._staging.reserve(bucket.padded_numel * reduced.element_size())
        elif self.world_size > 1 and precision.reduce_dtype != precision.param_dtype:
            reduced = torch.zeros_like(grad_buffer, dtype=precision.reduce_dtype)
        else:
            reduced = grad_buffer  # reduced in place (all-reduce), or nothing to reduce on one rank
        shard = build_local_shard(self.buffers, bucket, self.rank, self.sharded, reduced, precision)
        self.shards[bucket_index] = shard
        return shard

    def note_grad_stream(self, bucket_index: int) -> None:
        """Remember the current stream as one that accumulated grads of the bucket (called by
        the grad hooks in overlap mode, on accelerators only), see Note [Streams and events]."""
        note_current_stream(self._grad_streams[bucket_index], self.stream.device)

    def start_grad_sync(self, bucket_index: int) -> None:
        """Issue the bucket's grad reduction; its input must be final (see Note [Streams and events])."""
        if self.world_size == 1:
            return
        shard = self._shard(bucket_index)
        producers, self._grad_streams[bucket_index] = self._grad_streams[bucket_index], []
        wait_compute(self.stream, producers)
        grad_buffer = self.buffers.grad_buffers[bucket_index]
        reduced = shard.reduced_grad
        with on_stream(self.stream):
            if self.sharded:
                if self._receives is not None:
                    self._receives.admit(grad_buffer.nbytes)
                if grad_buffer.dtype == reduced.dtype or self._widens_on_receipt:
                    work = collectives.reduce_scatter_avg(
                        reduced, grad_buffer, self.group, async_op=True, point_to_point=self.point_to_point
                    )
                else:
                    work = self._reduce_scatter_cast(reduced, grad_buffer)
                if self.replicate_group is not None:
                    work = self._replica_chain.all_reduce_after(work, reduced, self.replicate_group)
                if self._receives is not None:
                    self._receives.track(work, grad_buffer.nbytes)
            else:
                if reduced is not grad_buffer:
                    reduced.copy_(grad_buffer)
                # ``.data`` has a version counter of its own: gloo's in-place average bumps the
                # counter when it completes, which would read as a user's write to the grads (Note
                # [Grads written after backward] in ``grad_hooks``); this write is the wrapper's.
                work = collectives.all_reduce_avg(reduced.data, self.group, async_op=True)
        self._grad_works[bucket_index] = work

    def finish_grad_sync(self, bucket_indices: Iterable[int] | None = None) -> None:
        """Make compute wait for the grad reductions of ``bucket_indices`` (default: every
        bucket); the optimizer's grads of those buckets are then final.

        ``step()`` finishes one bucket at a time to step each shard as soon as its reduction
        lands (Note [Step pipeline] in ``step_pipeline``). Finish a bucket once per reduction: a
        second call copies the reduced grads into the stepped ones again, undoing a clip.
        """
        indices = range(len(self._grad_works)) if bucket_indices is None else bucket_indices
        for index in indices:
            work, self._grad_works[index] = self._grad_works[index], None
            wait_comm([work])
            shard = self.shards[index]
            if shard is not None:
                shard.copy_reduced_to_stepped_grad()
        if all(work is None for work in self._grad_works):
            # Compute waited for every reduction, and comm-stream work starts behind compute.
            self._replica_chain.reset()
            self._staging.forget_readers()
            if self._receives is not None:
                self._receives.forget()

    def launched_grad_buckets(self) -> list[int]:
        """Buckets whose grad reduction is issued and not yet finished."""
        return [index for index, work in enumerate(self._grad_works) if work is not None]

    def start_param_sync(self, bucket_order: Iterable[int]) -> None:
        """Cast master shards back into the param buffer and all-gather the updated shards of
        ``bucket_order`` (the buckets the step changed), behind the last optimizer op."""
        buckets = list(bucket_order)
        for bucket_index in buckets:
            self._shard(bucket_index).write_back()
        if not self.sharded:
            return
        wait_compute(self.stream)
        with on_stream(self.stream):
            for bucket_index in buckets:
                self._param_events[bucket_index] = None
                self._param_waited[bucket_index] = []
                self._param_works[bucket_index] = collectives.all_gather(
                    self.buffers.param_buffers[bucket_index],
                    self._shard(bucket_index).param_view,
                    self.group,
                    async_op=True,
                    point_to_point=self.point_to_point,
                )

    def finish_param_sync(self, bucket_indices: Iterable[int] | None = None) -> None:
        """Make the current stream (on CPU: the host) wait for the latest all-gathers of
        ``bucket_indices`` (default: all).

        The first call after an all-gather turns its handle into an event on the comm stream,
        kept until the bucket's next all-gather; every stream that calls this later waits on
        that event once (forwards on several streams, a second consumer, before a CUDA-graph
        replay). See Note [Streams and events].
        """
        indices = range(len(self._param_works)) if bucket_indices is None else bucket_indices
        for index in indices:
            work = self._param_works[index]
            if work is not None:
                self._param_works[index] = None
                self._param_events[index] = record_completion(work, self.stream)
            wait_event_once(self._param_events[index], self._param_waited[index])

    def pending_param_buckets(self) -> list[int]:
        """Buckets whose updated params are still being all-gathered."""
        return [index for index, work in enumerate(self._param_works) if work is not None]

    def live_shards(self) -> list[LocalShard]:
        return [shard for shard in self.shards if shard is not None]

    def reduced_grad_tensors(self) -> list[Tensor]:
        """The persistent grad tensors this class allocated beyond the flat grad buffers: the
        averaged shard grads and, with a stepped tensor of another dtype, its grads."""
        buffers = {id(g) for g in self.buffers.grad_buffers if g is not None}
        tensors = {
            id(t): t
            for shard in self.live_shards()
            for t in (shard.reduced_grad, shard.stepped_grad)
            if id(t) not in buffers
        }
        return list(tensors.values())

    def staging_bytes(self) -> int:
        """Bytes of the staging pool, see Note [Bounded staging]."""
        return self._staging.nbytes

    def _reduce_scatter_cast(self, reduced: Tensor, grad_buffer: Tensor) -> Work | Future | None:
        """Cast the grads into a staging buffer and reduce-scatter that; on the comm stream."""
        slot, staging = self._staging.acquire(grad_buffer.numel(), reduced.dtype)
        staging.copy_(grad_buffer)
        work = collectives.reduce_scatter_avg(
            reduced, staging, self.group, async_op=True, point_to_point=self.point_to_point
        )
        self._staging.read_by(slot, work)
        return work

    def local_grads(self) -> list[Tensor]:
        """The reduced grads the optimizer steps, one flat tensor per materialized bucket."""
        return [shard.stepped_grad for shard in self.live_shards()]

    def _shard(self, bucket_index: int) -> LocalShard:
        shard = self.shards[bucket_index]
        if shard is None:
            raise RuntimeError(f"BucketCommunicator: bucket {bucket_index} has no local shard")
        return shard


class ReplicaChain:
    """Averages each bucket's reduce-scattered shard across the replicate group once its
    reduce-scatter has landed, issuing those all-reduces in the order the buckets were launched.

    Note [Replica all-reduce order]
        Collectives of one group pair up across ranks in issue order, so the replicate
        all-reduces must be issued in the same order on every rank: the buckets' launch order,
        which is the bucket order on every rank. Their reduce-scatters, though, may complete in
        any order (gloo runs several collectives of a group at once). On CPU, bucket i's
        all-reduce is therefore issued by a helper thread once both its reduce-scatter
        completed and bucket i-1's all-reduce was issued: it runs in the background and keeps
        the order (a thread rather than a callback on gloo's thread, Note [No Python on gloo's
        threads] in ``collectives``). On an accelerator the comm stream waits for the
        reduce-scatter (``Work.wait()``, the host is not blocked on NCCL) and the all-reduce is
        issued behind it at once, so host order is launch order. Sync and overlap mode issue the
        same collectives in the same order on the same buffers: results stay bitwise equal.
    """

    def __init__(self) -> None:
        self._last_issued: Future | None = None

    def all_reduce_after(
        self, reduce_scatter: Work | Future | None, shard: Tensor, group: ProcessGroup
    ) -> Work | _IssuedWork | None:
        """Average ``shard`` over ``group`` once ``reduce_scatter`` (which writes it) is done;
        returns a handle whose ``wait()`` makes ``shard`` final."""
        if shard.device.type != "cpu":
            wait_comm([reduce_scatter])
            return collectives.all_reduce_avg(shard, group, async_op=True)
        before = [_as_future(reduce_scatter)]
        if self._last_issued is not None:
            before.append(self._last_issued)

        done = torch.futures.collect_all(before)

        def issue() -> Work | None:
            for future in done.value():
                future.value()  # raises what a failed reduce-scatter (or earlier issue) raised
            return collectives.all_reduce_avg(shard, group, async_op=True)

        issued = collectives.run_after(done, issue, "sharded_opt: issue the replica all-reduce")
        self._last_issued = issued
        return _IssuedWork(issued)

    def reset(self) -> None:
        """Every all-reduce was waited for; the next one starts a new chain."""
        self._last_issued = None


class _IssuedWork:
    """The handle of an all-reduce issued later by a helper thread: ``wait()`` waits for the
    issue, then for the all-reduce, and raises what either raised."""

    def __init__(self, issued: Future) -> None:
        self._issued = issued

    def wait(self) -> bool:
        work = self._issued.wait()
        if work is not None:
            work.wait()
        return True


def _as_future(handle: Work | Future | None) -> Future:
    if handle is None:
        done: Future = Future()
        done.set_result(None)
        return done
    return handle.get_future() if isinstance(handle, Work) else handle


class _ReceiveBudget:
    """The host's reduce-scatters in flight with the bytes of their receive buffers, bounded;
    see Note [Bounded receive buffers]."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget_bytes = budget_bytes
        self._in_flight: deque[tuple[Work | Future | _IssuedWork | None, int]] = deque()
        self._live_bytes = 0

    def admit(self, nbytes: int) -> None:
        """Wait for the oldest reductions in flight until ``nbytes`` more fit (or none is left)."""
        while self._in_flight and self._live_bytes + nbytes > self._budget_bytes:
            work, done_bytes = self._in_flight.popleft()
            wait_comm([work])
            self._live_bytes -= done_bytes

    def track(self, work: Work | Future | _IssuedWork | None, nbytes: int) -> None:
        self._in_flight.append((work, nbytes))
        self._live_bytes += nbytes

    def forget(self) -> None:
        """Every reduction was waited for."""
        self._in_flight.clear()
        self._live_bytes = 0


class _StagingPool:
    """Reduction inputs for buckets whose grads are cast, reused in turn; see Note [Bounded
    staging]. Buffers are raw bytes viewed in the dtype asked for, so buckets of different
    dtypes share them."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._bucket_bytes = 0
        self._num_users = 0
        self._buffers: list[Tensor | None] = []
        self._readers: list[Work | Future | None] = []
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer in self._buffers if buffer is not None)

    def reserve(self, bucket_bytes: int) -> None:
        """A bucket of ``bucket_bytes`` (in the reduce dtype) will be staged here."""
        self._num_users += 1
        self._bucket_bytes = max(self._bucket_bytes, bucket_bytes)

    def acquire(self, numel: int, dtype: torch.dtype) -> tuple[int, Tensor]:
        """A buffer of ``numel`` elements of ``dtype`` that no collective reads any more, and its
        slot; the current stream (the comm stream, or the host on CPU) waited for its last reader."""
        if len(self._buffers) < min(STAGING_BUFFERS, self._num_users):
            self._buffers.append(None)
            self._readers.append(None)
        slot = self._next % len(self._buffers)
        self._next = slot + 1
        reader, self._readers[slot] = self._readers[slot], None
        wait_comm([reader])
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < self._bucket_bytes:
            self._buffers[slot] = None  # free the smaller one before allocating
            buffer = torch.empty(self._bucket_bytes, dtype=torch.uint8, device=self._device)
            self._buffers[slot] = buffer
        nbytes = numel * dtype.itemsize
        if nbytes > buffer.numel():
            raise RuntimeError(
                f"BucketCommunicator: a bucket of {nbytes} bytes to stage but the pool was sized "
                f"for {buffer.numel()}; every staged bucket must be reserved first"
            )
        return slot, buffer[:nbytes].view(dtype)

    def read_by(self, slot: int, work: Work | Future | None) -> None:
        """The collective ``work`` reads the buffer of ``slot`` until it completes."""
        self._readers[slot] = work

    def forget_readers(self) -> None:
        """Every reader completed and the stream that writes next is ordered after them."""
        self._readers = [None] * len(self._readers)
