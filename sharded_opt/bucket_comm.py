"""Per-bucket collectives: reduce grads into this rank's shard, all-gather updated shards.

Vocabulary follows Megatron-Core: ``start_*`` issues asynchronous collectives on the comm
stream, ``finish_*`` makes compute wait for them. Sync mode calls start and finish back to back;
overlap mode calls start from backward hooks and finish as late as possible. Both issue the very
same collectives on the very same buffers, which is why their results are bitwise equal.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, Work

from fusion.buffers import FlatBuffers
from sharded_opt import collectives
from sharded_opt.streams import new_comm_stream, on_stream, wait_comm, wait_compute


class BucketCommunicator:
    """Owns the comm stream, the per-bucket local tensors the inner optimizer steps, and the
    pending collective handles.

    In sharded mode (``sharded=True`` and more than one rank) a bucket's grads are
    reduce-scattered (averaged, as DDP does) into a persistent shard-sized tensor and the updated
    shard is all-gathered back into the bucket in place. Otherwise grads are all-reduced in place
    (or, on one rank, left as they are) and the whole bucket is stepped.
    """

    def __init__(
        self, buffers: FlatBuffers, group: ProcessGroup, rank: int, world_size: int, sharded: bool
    ) -> None:
        self.buffers = buffers
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.sharded = sharded and world_size > 1
        device = buffers.plan.buckets[0].device
        self.stream = new_comm_stream(device)
        num_buckets = len(buffers.plan.buckets)
        self._grad_works: list[Work | None] = [None] * num_buckets
        self._param_works: list[Work | None] = [None] * num_buckets
        self.local_params: list[Tensor] = []
        for bucket in buffers.plan.buckets:
            if self.sharded:
                local_param = buffers.param_shard(bucket.index, rank).detach()
                local_grad = torch.zeros_like(local_param)
            else:
                local_param = buffers.param_buffers[bucket.index].detach()
                local_grad = buffers.grad_buffers[bucket.index]
            local_param.requires_grad_(True)
            local_param.grad = local_grad
            self.local_params.append(local_param)

    def start_grad_sync(self, bucket_index: int) -> None:
        """Issue the bucket's grad reduction; its input must be final (see Note [Streams and events])."""
        if self.world_size == 1:
            return
        wait_compute(self.stream)
        grad_buffer = self.buffers.grad_buffers[bucket_index]
        with on_stream(self.stream):
            if self.sharded:
                output = self.local_params[bucket_index].grad
                work = collectives.reduce_scatter_avg(output, grad_buffer, self.group, async_op=True)
            else:
                work = collectives.all_reduce_avg(grad_buffer, self.group, async_op=True)
        self._grad_works[bucket_index] = work

    def finish_grad_sync(self) -> None:
        """Make compute wait for every grad reduction issued so far."""
        works, self._grad_works = self._grad_works, [None] * len(self._grad_works)
        wait_comm(works)

    def launched_grad_buckets(self) -> list[int]:
        """Buckets whose grad reduction is issued and not yet finished."""
        return [index for index, work in enumerate(self._grad_works) if work is not None]

    def start_param_sync(self, bucket_order: Iterable[int]) -> None:
        """All-gather the updated shards into the param buffers, behind the last optimizer op."""
        if not self.sharded:
            return
        wait_compute(self.stream)
        with on_stream(self.stream):
            for bucket_index in bucket_order:
                self._param_works[bucket_index] = collectives.all_gather(
                    self.buffers.param_buffers[bucket_index],
                    self.buffers.param_shard(bucket_index, self.rank),
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
