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
    back into the param buffer's shard, which is all-gathered in the params' dtype.

    The params stay the truth: if anything else writes them in place (``model.load_state_dict``
    after wrapping, a user's ``param.copy_``), the params' autograd version counters move and
    the master copy is refreshed from the params before the next step, instead of silently
    overwriting them with stale master values. (A param whose ``.data`` was pointed at the
    buffer keeps a version counter of its own, which only writes through the param bump; the
    wrapper's own writes go through the buffer and do not.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, Work
from torch.futures import Future

from fusion.buffers import FlatBuffers
from sharded_opt import collectives
from sharded_opt.streams import new_comm_stream, on_stream, wait_comm, wait_compute


@dataclass(frozen=True, slots=True)
class BucketPrecision:
    """Resolved dtypes of one bucket: params/grads, the reduction, the optimizer's master copy."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype


def resolve_precision(
    param_dtype: torch.dtype, reduce_dtype: torch.dtype | None, master_dtype: torch.dtype | None
) -> BucketPrecision:
    """``None`` means: reduce 16-bit grads in fp32 and others in their own dtype; no master copy."""
    if reduce_dtype is None:
        reduce_dtype = torch.float32 if param_dtype.itemsize < 4 else param_dtype
    return BucketPrecision(param_dtype, reduce_dtype, master_dtype or param_dtype)


class BucketCommunicator:
    """Owns the comm stream, the per-bucket local tensors the inner optimizer steps, and the
    pending collective handles.

    In sharded mode (``sharded=True`` and more than one rank) a bucket's grads are
    reduce-scattered (averaged, as DDP does) into a persistent shard-sized tensor and the updated
    shard is all-gathered back into the bucket in place. Otherwise grads are all-reduced (or, on
    one rank, left as they are) and the whole bucket is stepped. See Note [Mixed precision].
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
        self._param_views: list[Tensor] = []
        self._param_versions: list[int] = []
        self._reduced_grads: list[Tensor] = []
        self.local_params: list[Tensor] = []
        """Per bucket, the leaf tensor the inner optimizer steps (its ``.grad`` the reduced grad)."""
        for bucket, precision in zip(buffers.plan.buckets, precisions, strict=True):
            self._allocate(bucket.index, precision)

    def _allocate(self, bucket_index: int, precision: BucketPrecision) -> None:
        if self.sharded:
            param_view = self.buffers.param_shard(bucket_index, self.rank)
        else:
            param_view = self.buffers.param_buffers[bucket_index]
        grad_buffer = self.buffers.grad_buffers[bucket_index]
        if self.sharded or self.world_size > 1 and precision.reduce_dtype != precision.param_dtype:
            reduced = torch.zeros(param_view.numel(), dtype=precision.reduce_dtype, device=param_view.device)
        else:
            reduced = grad_buffer  # reduced in place (all-reduce), or nothing to reduce on one rank
        if precision.master_dtype == precision.param_dtype:
            local = param_view.detach()
        else:
            local = param_view.detach().to(precision.master_dtype, copy=True)
        local.requires_grad_(True)
        local.grad = reduced if reduced.dtype == local.dtype else torch.zeros_like(local)
        self._param_views.append(param_view)
        self._param_versions.append(self._version_of(bucket_index))
        self._reduced_grads.append(reduced)
        self.local_params.append(local)

    def start_grad_sync(self, bucket_index: int) -> None:
        """Issue the bucket's grad reduction; its input must be final (see Note [Streams and events])."""
        if self.world_size == 1:
            return
        wait_compute(self.stream)
        grad_buffer = self.buffers.grad_buffers[bucket_index]
        reduced = self._reduced_grads[bucket_index]
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
        for local, reduced in zip(self.local_params, self._reduced_grads, strict=True):
            if local.grad is not reduced:
                local.grad.copy_(reduced)

    def launched_grad_buckets(self) -> list[int]:
        """Buckets whose grad reduction is issued and not yet finished."""
        return [index for index, work in enumerate(self._grad_works) if work is not None]

    def start_param_sync(self, bucket_order: Iterable[int]) -> None:
        """Cast master shards back into the param buffer and all-gather the updated shards,
        behind the last optimizer op."""
        for local, param_view in zip(self.local_params, self._param_views, strict=True):
            if local.dtype != param_view.dtype:
                param_view.copy_(local.detach())
        if not self.sharded:
            return
        wait_compute(self.stream)
        with on_stream(self.stream):
            for bucket_index in bucket_order:
                self._param_works[bucket_index] = collectives.all_gather(
                    self.buffers.param_buffers[bucket_index],
                    self._param_views[bucket_index],
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

    def refresh_stale_masters(self) -> None:
        """Re-copy master shards whose params were written by someone else since the last step,
        see Note [Mixed precision]."""
        for index, (local, param_view) in enumerate(zip(self.local_params, self._param_views, strict=True)):
            if local.dtype == param_view.dtype:
                continue
            version = self._version_of(index)
            if version != self._param_versions[index]:
                local.detach().copy_(param_view)
                self._param_versions[index] = version

    def master_copies(self) -> list[Tensor | None]:
        """Per bucket, the master copy of the local shard (detached), or None without one."""
        return [
            local.detach() if local.dtype != view.dtype else None
            for local, view in zip(self.local_params, self._param_views, strict=True)
        ]

    def load_master_copies(self, masters: list[Tensor | None]) -> None:
        """Install loaded master copies; the params as they are now count as current."""
        for index, (local, master) in enumerate(zip(self.local_params, masters, strict=True)):
            if master is not None:
                local.detach().copy_(master)
                self._param_versions[index] = self._version_of(index)

    def _version_of(self, bucket_index: int) -> int:
        params = self.buffers.params
        return sum(
            params[slot.param_index]._version for slot in self.buffers.plan.buckets[bucket_index].slots
        )

    def pending_param_buckets(self) -> list[int]:
        """Buckets whose updated params are still being all-gathered."""
        return [index for index, work in enumerate(self._param_works) if work is not None]

    def reduced_grad_tensors(self) -> list[Tensor]:
        """The persistent grad tensors this class allocated beyond the flat grad buffers: the
        averaged shard grads and, with a master copy of another dtype, the master's grads."""
        buffers = {id(g) for g in self.buffers.grad_buffers}
        tensors = {id(t): t for t in (*self._reduced_grads, *self.local_grads()) if id(t) not in buffers}
        return list(tensors.values())

    def local_grads(self) -> list[Tensor]:
        """The reduced grads the optimizer steps, one flat tensor per bucket."""
        return [local.grad for local in self.local_params]
