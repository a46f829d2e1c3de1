"""``BucketWire``: the collectives that carry one bucket's grads and params, chosen once.

A bucket's grads are reduced exactly (a reduce-scatter, widened on receipt on CPU gloo: Note
[Widening on receipt] in ``collectives``), cast into a staging buffer first (Note [Bounded
staging] in ``comm_context``), or sent compressed (Note [Compressed wire] in ``compression``),
then averaged across replicas with hybrid sharding; unsharded, they are all-reduced. Its updated
params are all-gathered, or shared as compressed deltas. Which of these applies follows from
the bucket's dtype and the wrapper's settings alone, so it is decided when the bucket is built,
and every payload is counted in ``CommContext.wire`` as it is issued.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import Work
from torch.futures import Future

from sharded_opt.comm import collectives, compression
from sharded_opt.comm.comm_context import CommContext


class BucketWire:
    """Issues one bucket's grad reduction and param all-gather, on the current stream (the
    caller runs them on the comm stream).

    Args:
        comm: what the bucket shares with the others.
        shard_numel: elements of one rank's shard of the bucket.
        dtype: the bucket's params' (and grads') dtype.
    """

    def __init__(self, comm: CommContext, shard_numel: int, dtype: torch.dtype) -> None:
        self._comm = comm
        self._grad_codec = grad_codec(comm.grad_compression, shard_numel, dtype)
        self._param_codec = None
        if comm.param_compression is not None:
            self._param_codec = compression.make_codec(comm.param_compression, shard_numel)
        self._replica_codec = None
        """The reduced shard's codes across replicas (fp32 whatever the params' dtype, so bf16
        compresses it even where the grads travel exact)."""
        if comm.replicate_group is not None and comm.grad_compression is not None:
            self._replica_codec = compression.make_codec(comm.grad_compression, shard_numel)
        self.residual: Tensor | None = None
        """With error feedback, the fp32 residual of the slices this rank sends, one row per peer
        (Note [Error feedback] in ``compression``); allocated with the bucket's grad buffer."""

    def allocate_residual(self, device: torch.device) -> None:
        """Give the bucket its error feedback residual, zero, where its grads are compressed
        with ``grad_error_feedback``."""
        codec, comm = self._grad_codec, self._comm
        if codec is not None and comm.grad_error_feedback and self.residual is None:
            self.residual = torch.zeros(comm.world_size - 1, codec.numel, dtype=torch.float32, device=device)

    @property
    def publishes_deltas(self) -> bool:
        """Updated params are shared as compressed deltas against the replicas."""
        return self._param_codec is not None

    def reduce(self, reduced: Tensor, grad_buffer: Tensor) -> Work | Future | None:
        """Average ``grad_buffer`` over the group into ``reduced`` (this rank's shard, or the
        whole bucket unsharded); returns the handle whose ``wait()`` makes ``reduced`` final."""
        comm = self._comm
        if not comm.sharded:
            if reduced is not grad_buffer:
                reduced.copy_(grad_buffer)
            comm.wire.grads += 2 * _sent_by_each(reduced, comm.world_size)
            # ``.data`` has a version counter of its own: gloo's in-place average bumps the
            # counter when it completes, which would read as a user's write to the grads (Note
            # [Grads written after backward] in ``grad_hooks``); this write is the wrapper's.
            return collectives.all_reduce_avg(reduced.data, comm.group, async_op=True)
        if comm.receives is not None:
            comm.receives.admit(grad_buffer.nbytes)
        if self._grad_codec is not None:
            work = compression.reduce_scatter_compressed(
                reduced, grad_buffer, self._grad_codec, comm.group, comm.point_to_point, self.residual
            )
            comm.wire.grads += compression.payload_bytes(self._grad_codec, comm.world_size)
        elif grad_buffer.dtype == reduced.dtype or comm.widens_on_receipt:
            work = collectives.reduce_scatter_avg(
                reduced, grad_buffer, comm.group, async_op=True, point_to_point=comm.point_to_point
            )
            comm.wire.grads += _sent_by_each(grad_buffer, comm.world_size)
        else:
            work = self._reduce_scatter_cast(reduced, grad_buffer)
        if comm.replicate_group is not None:
            work = self._average_replicas_after(work, reduced)
        if comm.receives is not None:
            comm.receives.track(work, grad_buffer.nbytes)
        return work

    def _reduce_scatter_cast(self, reduced: Tensor, grad_buffer: Tensor) -> Work | Future | None:
        """Cast the grads into a staging buffer and reduce-scatter that."""
        comm = self._comm
        slot, staging = comm.staging.acquire(grad_buffer.numel(), reduced.dtype)
        staging.copy_(grad_buffer)
        work = collectives.reduce_scatter_avg(
            reduced, staging, comm.group, async_op=True, point_to_point=comm.point_to_point
        )
        comm.staging.read_by(slot, work)
        comm.wire.grads += _sent_by_each(staging, comm.world_size)
        return work

    def _average_replicas_after(self, work: Work | Future | None, reduced: Tensor) -> Work | Future | None:
        """Average the reduced shard over the replicate group once ``work`` wrote it (Note
        [Hybrid sharding] in ``hybrid_groups``), compressed as the grads are."""
        comm, codec = self._comm, self._replica_codec
        group = comm.replicate_group
        assert group is not None
        if codec is not None:
            comm.wire.replicas += compression.payload_bytes(codec, group.size())
        else:
            comm.wire.replicas += 2 * _sent_by_each(reduced, group.size())
        return comm.replica_chain.all_reduce_after(work, reduced, group, codec)

    def gather(self, param_buffer: Tensor, param_view: Tensor) -> Work | Future | None:
        """All-gather every rank's ``param_view`` (this rank's slice of ``param_buffer``)."""
        comm = self._comm
        comm.wire.params += (comm.world_size - 1) * param_view.nbytes
        return collectives.all_gather(
            param_buffer, param_view, comm.group, async_op=True, point_to_point=comm.point_to_point
        )

    @torch.no_grad()
    def publish_deltas(
        self, param_buffer: Tensor, master: Tensor, replica: Tensor, published: Tensor
    ) -> Future:
        """Encode ``master - replica`` (this rank's slice of ``param_buffer``), add it to the
        replica and copy that into ``published``, then share it: every peer adds it to its
        replica too (Note [Compressed wire] in ``compression``)."""
        comm, codec = self._comm, self._param_codec
        assert codec is not None
        sent = torch.empty(comm.world_size, codec.row_numel, dtype=codec.wire_dtype)
        compression.publish_delta(master, replica, published, sent[comm.rank], codec)
        comm.wire.params += compression.payload_bytes(codec, comm.world_size)
        return compression.all_gather_deltas(param_buffer, sent, codec, comm.group, comm.point_to_point)


def grad_codec(
    grad_compression: str | None, shard_numel: int, dtype: torch.dtype
) -> compression.Codec | None:
    """The codec the grads travel in, or None for the exact path: also for ``"bf16"`` over
    16-bit grads, which the exact path sends as they are (Note [Compressed wire])."""
    if grad_compression is None or (grad_compression == "bf16" and dtype.itemsize <= 2):
        return None
    return compression.make_codec(grad_compression, shard_numel)


def _sent_by_each(bucket_tensor: Tensor, world_size: int) -> int:
    """Bytes one rank sends in a reduce-scatter or all-gather of ``bucket_tensor`` (or half a ring
    all-reduce of it): (N-1)/N of it."""
    return bucket_tensor.nbytes * (world_size - 1) // world_size
