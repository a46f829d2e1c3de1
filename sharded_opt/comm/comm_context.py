"""What every bucket of one wrapper shares to run its collectives (as FSDP2's ``FSDPCommContext``).

The buckets (:class:`~sharded_opt.step.bucket.Bucket`) each own their collectives in flight; what is
not one bucket's lives here: the group they are reduced over and this rank's place in it, the
replicate group of hybrid sharding and the order its all-reduces are issued in, the comm stream,
and the two pools that bound the memory of collectives in flight.

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

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, Work
from torch.futures import Future

from sharded_opt.comm import collectives, compression
from sharded_opt.comm.hybrid_groups import ShardGroups
from sharded_opt.comm.streams import new_comm_stream, wait_comm

STAGING_BUFFERS = 2
"""Casts of grads to ``reduce_dtype`` that may exist at once: one read by a running collective
while the next bucket is cast into the other. See Note [Bounded staging]."""

RECEIVE_BUDGET_BYTES = 16 * 2**20
"""Bytes of reduce-scatter receive buffers that may be live at once on the host (at least one
bucket's, whatever its size). See Note [Bounded receive buffers]."""


class CommContext:
    """The collectives' shared state for every bucket of one wrapper.

    In sharded mode each bucket's grads are reduce-scattered over ``group`` and, with replicas,
    averaged over ``replicate_group``; otherwise they are all-reduced over ``group`` (or, on
    one rank, left as they are) and every rank steps whole buckets. Build it from the wrapper's
    groups with :meth:`for_groups`.

    Args:
        group: the group the buckets are reduced over; ``rank`` and ``world_size`` are this
            rank's place in it.
        sharded: reduce-scatter and all-gather (only with more than one rank).
        replicate_group: ranks holding the same shard (hybrid sharding), see Note [Hybrid
            sharding] in ``hybrid_groups``; None without replicas.
        point_to_point: ``ShardingConfig.gloo_point_to_point``, see Note [Reduce-scatter on
            gloo] in ``collectives``.
        device: the buckets' device (the comm stream's).
        grad_compression, param_compression, grad_error_feedback: ``ShardingConfig``'s fields
            of these names (used only when sharded), see Notes [Compressed wire] and [Error
            feedback] in ``compression``.
    """

    def __init__(
        self,
        group: ProcessGroup,
        rank: int,
        world_size: int,
        *,
        sharded: bool,
        replicate_group: ProcessGroup | None,
        point_to_point: bool,
        device: torch.device,
        grad_compression: str | None = None,
        param_compression: str | None = None,
        grad_error_feedback: bool = False,
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.sharded = sharded and world_size > 1
        self.grad_compression = grad_compression if self.sharded else None
        self.param_compression = param_compression if self.sharded else None
        self.grad_error_feedback = grad_error_feedback and self.grad_compression is not None
        self.wire = WireBytes()
        self.replicate_group = replicate_group if self.sharded else None
        self.point_to_point = point_to_point
        self.stream = new_comm_stream(device)
        self.widens_on_receipt = self.stream is None and collectives.widens_on_receipt(group, device)
        """Grads of a narrower dtype than the reduction go out as they are and are widened where
        they are summed, see Note [Widening on receipt] in ``collectives``."""
        self.staging = StagingPool(device)
        self.receives = (
            ReceiveBudget(RECEIVE_BUDGET_BYTES) if self.widens_on_receipt and self.sharded else None
        )
        """See Note [Bounded receive buffers]; None where no receive buffer is allocated."""
        self.replica_chain = ReplicaChain()

    @classmethod
    def for_groups(
        cls,
        groups: ShardGroups,
        *,
        sharding: bool,
        point_to_point: bool,
        device: torch.device,
        grad_compression: str | None = None,
        param_compression: str | None = None,
        grad_error_feedback: bool = False,
    ) -> CommContext:
        """Sharded over the shard group where sharding is on (``ShardingConfig.enable``) and it
        has several ranks; otherwise all-reducing (or, on one rank, leaving) the grads of the
        whole group."""
        if sharding and groups.shard_size > 1:
            return cls(
                groups.shard,
                groups.shard_rank,
                groups.shard_size,
                sharded=True,
                replicate_group=groups.replicate,
                point_to_point=point_to_point,
                device=device,
                grad_compression=grad_compression,
                param_compression=param_compression,
                grad_error_feedback=grad_error_feedback,
            )
        return cls(
            groups.world,
            groups.world_rank,
            groups.world_size,
            sharded=False,
            replicate_group=None,
            point_to_point=point_to_point,
            device=device,
        )

    def grad_syncs_finished(self) -> None:
        """Compute waited for every bucket's grad reduction, and comm-stream work starts behind
        compute: the chain, the staging readers and the receive budget start afresh."""
        self.replica_chain.reset()
        self.staging.forget_readers()
        if self.receives is not None:
            self.receives.forget()


class WireBytes:
    """Bytes this rank has put on the wire for the buckets' collectives since the wrapper was
    built, counted from the payloads as they are issued: what a grad reduction or a param
    all-gather sends to its peers ((N-1)/N of the bucket in its wire dtype for the exact
    collectives, a row of codes to each peer for compressed ones, Note [Compressed wire] in
    ``compression``), and the replica all-reduces of hybrid sharding (a ring's 2(R-1)/R)."""

    def __init__(self) -> None:
        self.grads = 0
        self.params = 0
        self.replicas = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "grads": self.grads,
            "params": self.params,
            "replicas": self.replicas,
            "total": self.grads + self.params + self.replicas,
        }


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
        self,
        reduce_scatter: Work | Future | None,
        shard: Tensor,
        group: ProcessGroup,
        codec: compression.Codec | None = None,
    ) -> Work | _IssuedWork | None:
        """Average ``shard`` over ``group`` once ``reduce_scatter`` (which writes it) is done,
        sent as ``codec`` codes if given (Note [Compressed wire] in ``compression``); returns a
        handle whose ``wait()`` makes ``shard`` final."""
        if shard.device.type != "cpu":
            wait_comm([reduce_scatter])
            return collectives.all_reduce_avg(shard, group, async_op=True)
        before = [_as_future(reduce_scatter)]
        if self._last_issued is not None:
            before.append(self._last_issued)

        done = torch.futures.collect_all(before)

        def issue() -> Work | Future | None:
            for future in done.value():
                future.value()  # raises what a failed reduce-scatter (or earlier issue) raised
            if codec is not None:
                return compression.average_compressed(shard, codec, group)
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


class ReceiveBudget:
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


class StagingPool:
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
                f"StagingPool: a bucket of {nbytes} bytes to stage but the pool was sized "
                f"for {buffer.numel()}; every staged bucket must be reserved first"
            )
        return slot, buffer[:nbytes].view(dtype)

    def read_by(self, slot: int, work: Work | Future | None) -> None:
        """The collective ``work`` reads the buffer of ``slot`` until it completes."""
        self._readers[slot] = work

    def forget_readers(self) -> None:
        """Every reader completed and the stream that writes next is ordered after them."""
        self._readers = [None] * len(self._readers)
