"""Bytes one rank holds, by kind, computed from a layout plan: nothing is allocated.

The sharded modes follow what the wrapper allocates (``ShardingStage1.memory_bytes()`` reports the
same keys, and tests/plan/test_plan.py checks they agree exactly): every bucket's flat param buffer,
a grad buffer for each bucket that takes part (Note [Buckets that take part]), per bucket a
persistent averaged grad of the shard in the reduce dtype, a grad in the master dtype when the
optimizer steps a master copy of another dtype, the master copy (with ``param_compression`` one
even in the params' own dtype, and the shard's params as last published, Note [Compressed wire]
in ``sharded_opt/comm/compression.py``), with ``grad_error_feedback`` an fp32 residual of the
grads each compressed bucket sends (Note [Error feedback]), the optimizer's state for the rank's
pieces (padding has none, Note [Per-param pieces]; a low-bit optimizer's codes and scales for each
piece it quantizes, Note [Cuts on quantization blocks], and its code books once per rank, Note
[Shared code books]); no staging pool (Note [Bounded staging]): on CPU gloo, which the planner
models, 16-bit grads are widened on receipt. Nor the
compressed collectives' rows of codes, which live while a bucket's collective is in flight, as
the receive buffers of the exact ones do (``memory_bytes()`` counts neither). DDP holds the
params and grads unpadded, the optimizer's state for every param, and its reducer's flat bucket
buffers (one copy of the grads; torch's default ``gradient_as_bucket_view=False``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from fractions import Fraction

import torch

from fusion.block_layout import BlockGrid
from fusion.layout import BucketPlan, LayoutPlan, ParamSpec
from sharded_opt.comm.bucket_wire import grad_codec
from sharded_opt.step.local_shard import BucketPrecision


@dataclass(frozen=True, slots=True)
class StateSize:
    """Optimizer state bytes of one tensor the optimizer steps (a param, or a rank's piece of
    one) by its numel: ``per_element`` bytes each, or, for a tensor that ``grid`` quantizes,
    ``quantized_per_element`` (codes, and scales where blocks are whole) each plus
    ``quantized_per_block`` per block begun (scales where the last block may be partial) plus
    ``quantized_fixed`` (code books)."""

    per_element: int
    grid: BlockGrid | None = None
    quantized_per_element: Fraction = Fraction(0)
    quantized_fixed: int = 0
    quantized_per_block: int = 0

    def quantizes(self, param_numel: int) -> bool:
        """Whether the class quantizes the state of a param of ``param_numel`` elements (and so
        of each piece of it, Note [Cuts on quantization blocks])."""
        return self.grid is not None and self.grid.quantizes(param_numel)

    def nbytes(self, numel: int, param_numel: int | None = None, *, with_code_books: bool = True) -> int:
        """Bytes of a tensor of ``numel`` elements, a piece of a param of ``param_numel`` (by
        default the whole param), quantized or not as the class decides for the param; without
        the code books a rank shares between its pieces (Note [Shared code books])."""
        if self.quantizes(numel if param_numel is None else param_numel):
            assert self.grid is not None
            blocks = -(-numel // self.grid.block_size)
            fixed = self.quantized_per_block * blocks + (self.quantized_fixed if with_code_books else 0)
            return int(self.quantized_per_element * numel) + fixed
        return self.per_element * numel


StateBytes = Mapping[tuple[int, torch.dtype], StateSize]
"""Optimizer state bytes of a stepped tensor, by (param group index, stepped dtype)."""


@dataclass(frozen=True, slots=True)
class MemoryBytes:
    """Bytes one rank holds, by kind; the keys of ``ShardingStage1.memory_bytes()`` plus DDP's
    bucket buffers and the padding inside the flat buffers."""

    params: int
    grads: int
    reduced_grads: int
    master: int
    optimizer_state: int
    staging: int
    """Casts of grads to the reduce dtype (the wrapper's communication buffers)."""
    ddp_buckets: int = 0
    """DDP's flat buckets the grads are copied into for the all-reduce."""
    padding: int = 0
    """Of ``params`` and ``grads``: bytes of padding in the flat buffers."""
    published: int = 0
    """With ``param_compression``: the local shard's params as this rank last sent them."""
    grad_residual: int = 0
    """With ``grad_error_feedback``: the fp32 residual of the grads this rank sends."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "padding")

    def as_report(self) -> dict[str, int]:
        """In the form of ``ShardingStage1.memory_bytes()``."""
        keys = (
            "params",
            "grads",
            "reduced_grads",
            "master",
            "published",
            "optimizer_state",
            "staging",
            "grad_residual",
        )
        return {key: getattr(self, key) for key in keys}


def sharded_memory(
    plan: LayoutPlan,
    precisions: Sequence[BucketPrecision],
    state_bytes: StateBytes,
    rank: int,
    *,
    materialize_all: bool = False,
    fed_back: str | None = None,
) -> MemoryBytes:
    """Bytes ``rank`` holds under the wrapper with ``plan`` (made for the shard group's size).

    Args:
        plan: the layout, as ``plan_layout`` makes it for the wrapper: for the shard group's
            size, which is 1 on one rank (nothing is reduced then; the grads are stepped in
            place).
        precisions: each bucket's dtypes (``resolve_precision``; with ``delta_params`` the
            shards keep a master and a published copy).
        state_bytes: optimizer state bytes of a stepped tensor.
        rank: the rank's index in its shard group.
        materialize_all: the optimizer creates state at construction (Adagrad), so every bucket,
            frozen ones included, gets its grad buffer and shard at once.
        fed_back: the ``grad_compression`` sent with ``grad_error_feedback`` (None without):
            each bucket whose grads it compresses keeps an fp32 residual of the N-1 slices
            sent (Note [Error feedback] in ``sharded_opt/comm/compression.py``).
    """
    sharded = plan.world_size > 1
    params = sum(_nbytes(b.padded_numel, b.dtype) for b in plan.buckets)
    live = [b for b in plan.buckets if b.requires_grad or materialize_all]
    grads = sum(_nbytes(b.padded_numel, b.dtype) for b in live)
    # A bucket that stages its grads also leaves autograd's own grad tensors in place (Note
    # [Staged grads] in ``fusion.layout``).
    grads += sum(_nbytes(b.used_numel, b.dtype) for b in live if b.staged_grads)
    reduced = master = published = state = code_books = residual = 0
    for bucket in live:
        if sharded and grad_codec(fed_back, bucket.shard_numel, bucket.dtype) is not None:
            residual += _nbytes((plan.world_size - 1) * bucket.shard_numel, torch.float32)
        precision = precisions[bucket.index]
        stepped_numel = bucket.shard_numel if sharded else bucket.padded_numel
        reduced_dtype = bucket.dtype
        if sharded:
            reduced_dtype = precision.reduce_dtype
            reduced += _nbytes(stepped_numel, reduced_dtype)
        if reduced_dtype != precision.master_dtype:
            reduced += _nbytes(stepped_numel, precision.master_dtype)  # the stepped grad
        if precision.has_master:
            master += _nbytes(stepped_numel, precision.master_dtype)
        if precision.delta_params:
            published += _nbytes(stepped_numel, bucket.dtype)
        size = state_bytes[(bucket.group_index, precision.master_dtype)]
        for numel, param_numel in _stepped_numels(bucket, rank, sharded):
            state += size.nbytes(numel, param_numel, with_code_books=False)
            if size.quantizes(param_numel):
                code_books = max(code_books, size.quantized_fixed)
    state += code_books  # one copy per rank, Note [Shared code books] in ``quantized_state``
    used = sum(_nbytes(b.used_numel, b.dtype) for b in plan.buckets)
    used_live = sum(_nbytes(b.used_numel, b.dtype) for b in live)
    padding = (params - used) + (grads - used_live)
    # No staging: the planner models CPU tensors on gloo, whose reduce-scatter widens 16-bit grads
    # on receipt (Note [Widening on receipt] in ``collectives``).
    return MemoryBytes(
        params,
        grads,
        reduced,
        master,
        state,
        staging=0,
        padding=padding,
        published=published,
        grad_residual=residual,
    )


def _stepped_numels(bucket: BucketPlan, rank: int, sharded: bool) -> list[tuple[int, int]]:
    """The numel of each param piece ``rank`` steps, with its param's (a low-bit optimizer
    keeps codes and scales per piece, as its param decides)."""
    if sharded:
        numels = {slot.param_index: slot.numel for slot in bucket.slots}
        return [(piece.numel, numels[piece.param_index]) for piece in bucket.shard_pieces(rank)]
    return [(slot.numel, slot.numel) for slot in bucket.slots]


def ddp_memory(specs: Sequence[ParamSpec | None], state_bytes: StateBytes) -> MemoryBytes:
    """Bytes one rank holds under DDP with the plain optimizer over ``specs``."""
    laid_out = [spec for spec in specs if spec is not None]
    params = sum(_nbytes(spec.numel, spec.dtype) for spec in laid_out)
    trainable = [spec for spec in laid_out if spec.requires_grad]
    grads = sum(_nbytes(spec.numel, spec.dtype) for spec in trainable)
    state = sum(state_bytes[(spec.group_index, spec.dtype)].nbytes(spec.numel) for spec in trainable)
    return MemoryBytes(params, grads, 0, 0, state, 0, ddp_buckets=grads)


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * dtype.itemsize
