"""What one rank steps of one bucket: its shard, as per-param pieces the inner optimizer owns.

Note [Per-param pieces]
    A rank's shard of a bucket is a flat range that ignores param boundaries. Stepping it as one
    tensor would make every param of the bucket share one optimizer state entry (one ``step``
    counter, one "has this param had a grad" decision), which is not what ``torch.optim`` does:
    a param that got no grad (``grad is None``) is skipped, its state untouched, and each param
    counts its own steps. So the inner optimizer is given one leaf tensor per *piece* (the
    intersection of a param with the shard, as Megatron's distributed optimizer does), each a view
    into the flat shard with a grad that views the flat reduced grad. The collectives still read
    and write whole buckets; only the optimizer sees pieces, and torch's own rules then hold per
    param: before a step, the pieces of params that got no grad on any rank get ``grad=None``.

    On CPU each piece is further cut into views of at most ``CPU_CHUNK_BYTES`` (not for state
    quantized per block, which a chunk would change): torch's default
    single-tensor kernels make one pass over memory per element-wise op, and over multi-MiB
    tensors every pass streams from DRAM. Chunks of 1 MiB keep a chunk's param, grad and two Adam
    moments close to a core's L2 between passes; smaller chunks cost a kernel launch each for
    nothing once the params fit in L3 (both measured against plain torch, per layer width and
    chunk size, in ``benchmarks/results/2026-12-03-presence-group-cpu-2core.md``, "World size
    1"). The math per element is unchanged, so results stay bitwise equal. Accelerators keep one
    tensor per piece and step them through torch's multi-tensor (foreach) kernels.

Note [Master copies]
    With a ``master_dtype`` wider than the params' dtype (fp32 for bf16 params), the pieces view
    a master copy of the shard instead of the param buffer, and after a step the master is cast
    back into the param buffer. The params stay the truth: anything that writes a param in place
    (``model.load_state_dict``, ``param.data.clamp_``, an embedding's ``max_norm`` renorm) makes
    it differ from its master rounded to the param dtype, so before each step every element whose
    param value differs from its rounded master is re-read from the param. The check is by value
    and per element: it catches writes through ``.data`` that no version counter sees, and it
    touches no other element. No master is kept when ``master_dtype`` is not wider than the
    params (an fp64 param is never rounded to fp32), unless updated params are shared as
    compressed deltas: the params then trail the master by the last delta's rounding error, so an
    element counts as written where the param differs from the copy of the params as this rank
    last wrote them (``LocalShard.published``, Note [Compressed wire] in ``compression``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fusion.buffers import FlatBuffers, view_slot
from fusion.layout import BucketPlan, ShardPiece

CPU_CHUNK_BYTES = 1024 * 1024
"""Largest inner-optimizer tensor on CPU, see Note [Per-param pieces]."""


@dataclass(frozen=True, slots=True)
class BucketPrecision:
    """Resolved dtypes of one bucket: params/grads, the reduction, the tensor the optimizer steps."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    delta_params: bool = False
    """Updated params are shared as compressed deltas against the replicas, which needs an
    exact master even in the params' own dtype (Note [Compressed wire] in ``compression``)."""

    @property
    def has_master(self) -> bool:
        return self.master_dtype != self.param_dtype or self.delta_params


def resolve_precision(
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype | None,
    master_dtype: torch.dtype | None,
    delta_params: bool = False,
) -> BucketPrecision:
    """``None`` means: reduce 16-bit grads in fp32 and others in their own dtype; no master copy.
    A master dtype that is not wider than the params' dtype is no master, see Note [Master copies].
    Both settings are real dtypes, which would drop the imaginary parts of complex params (2.8e-2
    off plain torch after three steps): complex params are reduced and stepped in their own dtype."""
    if param_dtype.is_complex:
        return BucketPrecision(param_dtype, param_dtype, param_dtype)
    if reduce_dtype is None:
        reduce_dtype = torch.float32 if param_dtype.itemsize < 4 else param_dtype
    if master_dtype is None or master_dtype.itemsize <= param_dtype.itemsize:
        master_dtype = param_dtype
    return BucketPrecision(param_dtype, reduce_dtype, master_dtype, delta_params)


@dataclass(eq=False, slots=True)
class LocalShard:
    """One bucket as this rank steps it.

    Attributes:
        bucket: the bucket's plan.
        param_view: this rank's slice of the bucket's param buffer (the whole buffer unsharded).
        reduced_grad: the averaged grads of ``param_view``'s elements, in the reduction dtype;
            the bucket's grad buffer itself when it is reduced in place or not at all.
        stepped: the tensor the optimizer updates: ``param_view`` or its master copy.
        stepped_grad: the grad of ``stepped`` as one flat tensor: ``reduced_grad`` itself, or a
            copy of it in the stepped dtype.
        pieces: the params' pieces in ``param_view``, in layout order.
        inner_params: leaf views of ``stepped``, one per piece (or per chunk of one on CPU);
            ``inner_grads[i]`` is the grad view the optimizer reads for ``inner_params[i]``.
        inner_owners: the param index of each inner param.
        published: with compressed param deltas, ``param_view`` as this rank last wrote it
            (Note [Compressed wire] in ``compression``); None otherwise.
    """

    bucket: BucketPlan
    param_view: Tensor
    reduced_grad: Tensor
    stepped: Tensor
    stepped_grad: Tensor
    pieces: tuple[ShardPiece, ...]
    inner_params: list[Tensor]
    inner_grads: list[Tensor]
    inner_owners: list[int]
    published: Tensor | None = None

    @property
    def master(self) -> Tensor | None:
        """The master copy, or None when the optimizer steps the params themselves."""
        return None if self.stepped.data_ptr() == self.param_view.data_ptr() else self.stepped

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-read every master element whose param was written since, see Note [Master copies]."""
        master = self.master
        if master is None:
            return
        if self.published is not None:  # the replica trails the master: compare with what was written
            if _bitwise_equal(self.published, self.param_view):
                return
            stale = _bits(self.published) != _bits(self.param_view)
        else:
            stale = master.to(self.param_view.dtype) != self.param_view
            if master.device.type == "cpu" and not stale.any():  # on an accelerator .any() would sync
                return
        master.copy_(torch.where(stale, self.param_view.to(master.dtype), master))

    @torch.no_grad()
    def write_back(self) -> None:
        """Cast the stepped master back into the params (nothing to do without a master)."""
        if self.master is not None:
            self.param_view.copy_(self.master)

    @torch.no_grad()
    def copy_reduced_to_stepped_grad(self) -> None:
        if self.stepped_grad is not self.reduced_grad:
            self.stepped_grad.copy_(self.reduced_grad)


_INTEGER_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: Tensor) -> Tensor:
    """``tensor``'s bits as integers of its width: compared, they tell any write, one of -0.0 over
    0.0 or of a nan included, which a float comparison misses."""
    return tensor.view(_INTEGER_OF_WIDTH[tensor.element_size()])


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (``torch.equal`` stops at the first difference
    and builds no mask, so the common case, nothing written, costs one read of each)."""
    return torch.equal(_bits(a), _bits(b))


def build_local_shard(
    buffers: FlatBuffers,
    bucket: BucketPlan,
    rank: int,
    sharded: bool,
    reduced_grad: Tensor,
    precision: BucketPrecision,
) -> LocalShard:
    """The local shard of ``bucket``; see Note [Per-param pieces] and Note [Master copies].

    ``reduced_grad`` is where the bucket's averaged grads of the local range arrive.
    """
    if sharded:
        param_view = buffers.param_shard(bucket.index, rank)
        pieces = bucket.shard_pieces(rank)
    else:
        param_view = buffers.param_buffers[bucket.index]
        pieces = tuple(ShardPiece(s.param_index, 0, s.offset, s.numel) for s in bucket.slots)
    if precision.has_master:
        stepped = param_view.detach().to(precision.master_dtype, copy=True)
    else:
        stepped = param_view.detach()
    stepped_grad = reduced_grad if reduced_grad.dtype == stepped.dtype else torch.zeros_like(stepped)
    published = param_view.detach().clone() if precision.delta_params else None
    shard = LocalShard(bucket, param_view, reduced_grad, stepped, stepped_grad, pieces, [], [], [], published)
    if bucket.whole_params:
        _add_whole_params(shard)
        return shard
    chunk_numel = _chunk_numel(stepped, bucket)
    for piece in pieces:
        # A zero-element param's empty piece still gets one (empty) inner param: torch steps it.
        for start in range(piece.shard_start, piece.shard_start + max(1, piece.numel), chunk_numel):
            end = min(start + chunk_numel, piece.shard_start + piece.numel)
            inner = stepped.detach()[start:end].detach().requires_grad_(True)
            grad = stepped_grad[start:end]
            inner.grad = grad
            shard.inner_params.append(inner)
            shard.inner_grads.append(grad)
            shard.inner_owners.append(piece.param_index)
    return shard


def _add_whole_params(shard: LocalShard) -> None:
    """One inner param per piece, each a whole param in its own shape and strides (never cut
    into chunks): see Note [Whole params per owner] in ``fusion/layout.py``."""
    slots = {slot.param_index: slot for slot in shard.bucket.slots}
    for piece in shard.pieces:
        slot = slots[piece.param_index]
        if piece.param_start != 0 or piece.numel != slot.numel:
            raise RuntimeError(
                f"build_local_shard: param {piece.param_index} is not whole in its owner's shard"
            )
        end = piece.shard_start + piece.numel
        inner = view_slot(shard.stepped.detach()[piece.shard_start : end], slot).detach().requires_grad_(True)
        grad = view_slot(shard.stepped_grad[piece.shard_start : end], slot)
        inner.grad = grad
        shard.inner_params.append(inner)
        shard.inner_grads.append(grad)
        shard.inner_owners.append(piece.param_index)


def _chunk_numel(stepped: Tensor, bucket: BucketPlan) -> int:
    """Quantized state is never chunked: a chunk is a tensor of its own to the optimizer, which
    would decide anew whether to quantize it (Note [Cuts on quantization blocks] in
    ``fusion/block_layout.py``)."""
    if stepped.device.type != "cpu" or bucket.block_grid is not None:
        return max(1, stepped.numel())
    return max(1, CPU_CHUNK_BYTES // stepped.element_size())
