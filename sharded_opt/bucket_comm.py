"""Per-bucket collectives: reduce grads into this rank's shard, all-gather updated shards.

Vocabulary follows Megatron-Core: ``start_*`` issues asynchronous collectives on the comm
stream, ``finish_*`` makes compute wait for them. Sync mode calls start and finish back to back;
overlap mode calls start from backward hooks and finish as late as possible. Both issue the very
same collectives on the very same buffers, which is why their results are bitwise equal.

Note [Mixed precision]
    Params and their grads live in the params' own dtype (bf16, say) in the flat buffers:
    autograd needs a grad of the param's dtype. Grads are reduced in ``reduce_dtype`` (fp32 by
    default for 16-bit params): a bf16 bucket is cast to a temporary fp32 copy that the
    collective reads, and the averaged shard arrives in a persistent fp32 tensor. With a
    ``master_dtype`` wider than the params, the inner optimizer steps a persistent fp32 master
    copy of the local shard only (never of the whole model); after the step the master is cast
    back into the param buffer's shard, which is all-gathered in the params' dtype. See Note
    [Master copies] in ``local_shard`` for how params written by others stay the truth.

Note [Buckets that take part]
    A bucket takes part in an iteration's reduction when any of its params requires grad; which
    params do is program state, the same on every rank, so every rank issues the same
    collectives. A bucket of params that were all frozen when the wrapper was built has no grad
    buffer and no local shard until one of them is unfrozen (:meth:`BucketCommunicator.materialize`).
    A bucket is all-gathered after a step only if the step changed it: some param of it got a
    grad on some rank (agreed over the group, so again the same on every rank).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, Work
from torch.futures import Future

from fusion.buffers import FlatBuffers
from sharded_opt import collectives
from sharded_opt.local_shard import BucketPrecision, LocalShard, build_local_shard
from sharded_opt.streams import new_comm_stream, on_stream, wait_comm, wait_compute


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
    ) -> None:
        self.buffers = buffers
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.sharded = sharded and world_size > 1
        self.precisions = precisions
        self.stream = new_comm_stream(buffers.plan.buckets[0].device)
        num_buckets = len(buffers.plan.buckets)
        self._grad_works: list[Work | Future | None] = [None] * num_buckets
        self._reduce_inputs: list[Tensor | None] = [None] * num_buckets
        self._param_works: list[Work | None] = [None] * num_buckets
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
        elif self.world_size > 1 and precision.reduce_dtype != precision.param_dtype:
            reduced = torch.zeros_like(grad_buffer, dtype=precision.reduce_dtype)
        else:
            reduced = grad_buffer  # reduced in place (all-reduce), or nothing to reduce on one rank
        shard = build_local_shard(self.buffers, bucket, self.rank, self.sharded, reduced, precision)
        self.shards[bucket_index] = shard
        return shard

    def start_grad_sync(self, bucket_index: int) -> None:
        """Issue the bucket's grad reduction; its input must be final (see Note [Streams and events])."""
        if self.world_size == 1:
            return
        shard = self._shard(bucket_index)
        wait_compute(self.stream)
        grad_buffer = self.buffers.grad_buffers[bucket_index]
        reduced = shard.reduced_grad
        with on_stream(self.stream):
            if self.sharded:
                # The cast runs on the comm stream and its result is kept until finish_grad_sync,
                # so the caching allocator cannot reuse it while the collective reads it.
                reduce_input = (
                    grad_buffer if grad_buffer.dtype == reduced.dtype else grad_buffer.to(reduced.dtype)
                )
                work = collectives.reduce_scatter_avg(reduced, reduce_input, self.group, async_op=True)
                self._reduce_inputs[bucket_index] = reduce_input
            else:
                if reduced is not grad_buffer:
                    reduced.copy_(grad_buffer)
                work = collectives.all_reduce_avg(reduced, self.group, async_op=True)
        self._grad_works[bucket_index] = work

    def finish_grad_sync(self) -> None:
        """Make compute wait for every grad reduction issued so far; the optimizer's grads are
        then final."""
        works, self._grad_works = self._grad_works, [None] * len(self._grad_works)
        wait_comm(works)
        self._reduce_inputs = [None] * len(self._reduce_inputs)
        for shard in self.shards:
            if shard is not None:
                shard.copy_reduced_to_stepped_grad()

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
                self._param_works[bucket_index] = collectives.all_gather(
                    self.buffers.param_buffers[bucket_index],
                    self._shard(bucket_index).param_view,
                    self.group,
                    async_op=True,
                )

    def finish_param_sync(self, bucket_indices: Iterable[int] | None = None) -> None:
        """Make compute wait for the pending all-gathers of ``bucket_indices`` (default: all)."""
        indices = range(len(self._param_works)) if bucket_indices is None else bucket_indices
        for index in indices:
            work = self._param_works[index]
            if work is not None:
                self._param_works[index] = None
                work.wait()

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

    def local_grads(self) -> list[Tensor]:
        """The reduced grads the optimizer steps, one flat tensor per materialized bucket."""
        return [shard.stepped_grad for shard in self.live_shards()]

    def _shard(self, bucket_index: int) -> LocalShard:
        shard = self.shards[bucket_index]
        if shard is None:
            raise RuntimeError(f"BucketCommunicator: bucket {bucket_index} has no local shard")
        return shard
