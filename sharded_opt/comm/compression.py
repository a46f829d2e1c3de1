"""Fewer bytes on the wire: grads and param deltas sent as bf16 or block-wise int8 codes.

Note [Compressed wire]
    ZeRO-1 sends DDP's bytes: a reduce-scatter of the grads and an all-gather of the params,
    each (N-1)/N of the model per rank. ``ShardingConfig.grad_compression`` and
    ``param_compression`` send fewer, and keep what the exact path promises: every rank ends
    every step with bitwise the same params, and a result that does not depend on timing (sync
    and overlap agree bitwise with each other).

    Grads (``"bf16"`` or ``"int8"``): rank r encodes slice p of its grad bucket for each peer p
    and sends it in one exchange (gloo's all-to-all, or point-to-point pairs with
    ``gloo_point_to_point``): each element is quantized once, by its sender, never re-quantized
    on a ring's hops. The owner decodes the N-1 received slices to fp32, adds its own slice
    exactly (it never leaves the rank, so it is not quantized), sums the N in rank order and
    divides by N: the same inputs give the same bits, on every run. int8 codes are block-wise:
    ``INT8_BLOCK_NUMEL`` consecutive elements share one fp32 scale, their absolute maximum / 127,
    and each element is rounded to the nearest multiple of it (ties to even); blocks count from
    the start of each slice. A block of zeros has scale 0 and codes 0. A block holding an inf or
    a nan decodes to non-finite values only (scale inf or nan), so ``ShardedGradScaler`` and
    ``clip_grad_norm_`` still see it in the averaged grads and every rank skips the step.
    ``"bf16"`` rounds each element to bf16 (to nearest even). bf16 params' grads are bf16
    already: they go out as they are, exact (Note [Widening on receipt] in ``collectives``).

    By default no error feedback: the rounding errors of one step are not carried into the
    next. The error of an int8 code is at most half a step of its block's scale, fresh grads
    arrive each step and Adam divides by their running magnitude, and a feedback buffer costs
    an fp32 copy of the grads a rank sends (4 (N-1)/N bytes per param, half of what sharding
    Adam's fp32 state saves). ``grad_error_feedback`` opts in (Note [Error feedback]).
    ``benchmarks/convergence.py`` measures the held-out loss with and without compression
    (``docs/compression.md``).

    Params (``"int8"``): the owner of a shard keeps an exact master of it, which the optimizer
    steps. After the step it sends ``int8(master - replica)``, the delta against the params
    every rank holds (the replica), and every rank, the owner included, adds the same decoded
    delta to its replica in the same arithmetic: ``(replica.float() + decoded).to(dtype)``. So
    all replicas stay bitwise equal, and each trails the master by at most one step's rounding
    error, which the next delta carries. The owner also keeps a copy of the replica as it last
    published it, to tell a user's write to a param (``model.load_state_dict``, ``clamp_``)
    from its own: before each step, an element whose param differs from that copy is re-read
    into the master (Note [Master copies] in ``local_shard``), or the next delta would undo the
    write. Deltas cannot repair ranks that hold different params: every rank starts from the
    first rank's params (the broadcast at construction) and must write the same values to
    them. A checkpoint saves the exact master; a load rebuilds every replica exactly from it
    with one uncompressed all-gather.

    Supported: sharded data parallel on CPU gloo, sync and overlap, with or without a model
    attached, with clipping, ``ShardedGradScaler``, whole-param owners (Muon, Adafactor),
    gradient accumulation, checkpoints and hybrid sharding, where each shard's average across
    the replicate group is compressed too: every replica all-gathers the others' codes of its
    reduced shard, decodes all of them, its own included, and sums them in replica order, so
    the replicas agree bitwise (:func:`average_compressed`). Refused by name at construction:
    ``enable=False`` and accelerator tensors (NCCL), neither of which has been run.

Note [Error feedback]
    With ``ShardingConfig.grad_error_feedback`` each rank keeps, per compressed bucket, an fp32
    residual of the N-1 slices it sends (its own slice is exact and has none). Before encoding
    peer p's slice it adds the residual to the grads, ``v = grad + residual`` (in fp32), sends
    the codes of ``v`` and keeps ``v - decode(codes)`` as the new residual
    (:func:`encode_with_feedback`): what one step's codes missed is sent in the next, so the
    rounding errors no longer add up over the steps, only the last one is outstanding. The owner
    is unchanged: it decodes, adds its own slice, sums in rank order, divides by N. The residual
    is a function of the grads sent and nothing else, so every rank still ends with bitwise the
    same params and sync equals overlap bitwise.

    The residual is updated once per reduction, where the codes are made: accumulated grads
    (``no_sync``, micro-batches) are reduced once, so it is applied once per step. An element
    whose code decodes non-finite (an inf or nan grad, or for int8 any element of a block
    holding one) gets residual zero instead of inf or nan: the average shows the non-finite
    value, ``ShardedGradScaler`` skips the step on every rank, and the next step starts that
    element's feedback afresh, losing at most one step's rounding error, as without feedback.
    The finite elements of a skipped step keep their new residuals: the scaler's skip is decided
    after the reduction, and keeping the old ones would cost a second copy. With a scaler the
    residual is in scaled units; a change of the scale mis-scales one step's carried error by
    the factor of the change (at most the rounding error of one step, again).

    Costs 4 bytes per element sent, (N-1)/N of every bucket whose grads are compressed (bf16
    params' grads travel exact and have none), reported as ``memory_bytes()["grad_residual"]``
    and counted by the planner; one more add, subtract and ``nan_to_num`` per element sent; no
    byte more on the wire. Not saved in checkpoints (``state_dict`` nor ``save_checkpoint``):
    it is transient, at most one step's rounding error of the grads. A wrapper built to resume
    starts it from zero, as the first step does, so a resumed run differs from an uninterrupted
    one by that error; a load into a wrapper that has trained leaves its residual as it is.
    Refused with hybrid sharding, whose average across groups is compressed again and would need
    a residual of its own. ``benchmarks/convergence.py``'s ``bf16-ef`` setting measures what it
    buys: over four seeds of its 1000-step run, bf16 grads ended +0.19 % above exact's held-out
    loss on average with feedback (-0.26 % to +0.56 %) and +0.54 % without, lower with feedback
    on three seeds of four: suggested, not proven
    (``benchmarks/results/2026-12-07-convergence-cpu-2core.md``). So it stays off by default.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, Work
from torch.futures import Future

from sharded_opt.comm.collectives import all_gather, exchange, run_after

INT8_BLOCK_NUMEL = 256
"""Elements that share one int8 scale. Small enough that a block's scale follows the local
magnitude of a layer's values (one large grad costs precision to its 255 neighbours only), large
enough that the fp32 scales add 1.6 % to the int8 codes' bytes (Note [Compressed wire])."""

CHUNK_NUMEL = 1 << 18
"""Elements encoded or decoded per pass. Every op of a pass costs some microseconds of dispatch
whatever its length, as much as the arithmetic at 64 Ki elements; longer passes measured slower
again in the owner's delta publish, whose several 4 MiB temporaries per pass at 1 Mi went back
to the kernel in between and faulted their pages in anew."""

SMALLEST_INVERTED = 1e-36
"""Absolute maxima are clamped to at least this before 127 is divided by them, so the inverse
stays finite (127 / 1e-36 < fp32's largest value): a block whose values are all smaller decodes
with an error below this instead of overflowing."""


class Codec(Protocol):
    """How one slice of ``numel`` elements travels: a row of ``row_numel`` elements of
    ``wire_dtype``."""

    numel: int
    row_numel: int
    wire_dtype: torch.dtype

    def encode(self, values: Tensor, row: Tensor) -> None:
        """Write the codes of ``values`` (the whole slice) into ``row``."""
        ...

    def encode_range(self, values: Tensor, row: Tensor, start: int, end: int) -> None:
        """Write the codes of elements ``[start, end)`` of the slice, given as ``values``
        (``start`` a multiple of the block size), into ``row``."""
        ...

    def decode(self, row: Tensor, start: int, end: int) -> Tensor:
        """fp32 values of elements ``[start, end)`` (``start`` a multiple of the block size)."""
        ...


class Bf16Codec:
    """A slice as bf16 values (round to nearest even)."""

    wire_dtype = torch.bfloat16

    def __init__(self, numel: int) -> None:
        self.numel = self.row_numel = numel

    def encode(self, values: Tensor, row: Tensor) -> None:
        row.copy_(values)

    def encode_range(self, values: Tensor, row: Tensor, start: int, end: int) -> None:
        row[start:end].copy_(values)

    def decode(self, row: Tensor, start: int, end: int) -> Tensor:
        return row[start:end].float()


class Int8BlockCodec:
    """A slice as int8 codes, ``INT8_BLOCK_NUMEL`` to a block with one fp32 scale each, packed in
    one byte row: the scales first (4-byte aligned), then the codes."""

    wire_dtype = torch.uint8

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.blocks = math.ceil(numel / INT8_BLOCK_NUMEL)
        self._codes_at = 4 * self.blocks
        self.row_numel = self._codes_at + 4 * math.ceil(numel / 4)

    def _parts(self, row: Tensor) -> tuple[Tensor, Tensor]:
        scales = row[: self._codes_at].view(torch.float32)
        return scales, row[self._codes_at : self._codes_at + self.numel].view(torch.int8)

    @torch.no_grad()
    def encode(self, values: Tensor, row: Tensor) -> None:
        for start in range(0, self.numel, CHUNK_NUMEL):
            end = min(start + CHUNK_NUMEL, self.numel)
            self.encode_range(values[start:end], row, start, end)

    @torch.no_grad()
    def encode_range(self, values: Tensor, row: Tensor, start: int, end: int) -> None:
        scales, codes = self._parts(row)
        first = start // INT8_BLOCK_NUMEL
        full = (end - start) // INT8_BLOCK_NUMEL * INT8_BLOCK_NUMEL
        if full:
            _quantize_blocks(
                values[:full].view(-1, INT8_BLOCK_NUMEL),
                scales[first : first + full // INT8_BLOCK_NUMEL],
                codes[start : start + full].view(-1, INT8_BLOCK_NUMEL),
            )
        if full < end - start:  # the slice's last, partial block
            _quantize_blocks(values[full:].view(1, -1), scales[-1:], codes[start + full : end].view(1, -1))

    def decode(self, row: Tensor, start: int, end: int) -> Tensor:
        scales, codes = self._parts(row)
        first = start // INT8_BLOCK_NUMEL
        out = torch.empty(end - start, dtype=torch.float32, device=row.device)
        full = (end - start) // INT8_BLOCK_NUMEL * INT8_BLOCK_NUMEL
        if full:
            blocks = full // INT8_BLOCK_NUMEL
            torch.mul(
                codes[start : start + full].view(blocks, INT8_BLOCK_NUMEL),
                scales[first : first + blocks, None],
                out=out[:full].view(blocks, INT8_BLOCK_NUMEL),
            )
        if full < end - start:
            torch.mul(codes[start + full : end], scales[first + full // INT8_BLOCK_NUMEL], out=out[full:])
        return out


def _quantize_blocks(values: Tensor, scales: Tensor, codes: Tensor) -> None:
    """Each row of ``values`` (fp32 or a 16-bit float) as codes of ``scales``' entry: absmax /
    127, rounded to nearest even.

    The absolute maximum is the larger of the row's maximum and its negated minimum: two
    reductions without the full-size temporary of ``abs()``. Codes stay within [-127, 127]
    without a clamp: the largest magnitude maps to 127 up to a rounding of the product. In a row
    holding an inf or a nan the codes are whatever the cast makes of non-finite products: the
    row's scale is non-finite, so it decodes to inf or nan alone, whatever its codes (every
    decoder reads the same codes)."""
    absmax = torch.maximum(values.amax(dim=1), values.amin(dim=1).neg_()).float()
    torch.div(absmax, 127.0, out=scales)
    inverse = absmax.clamp_min_(SMALLEST_INVERTED).reciprocal_().mul_(127.0)
    codes.copy_(torch.mul(values, inverse[:, None]).round_())  # 16-bit values promote to fp32


def make_codec(compression: str, numel: int) -> Codec:
    """The codec of a ``grad_compression``/``param_compression`` value for slices of ``numel``."""
    if compression == "bf16":
        return Bf16Codec(numel)
    if compression == "int8":
        return Int8BlockCodec(numel)
    raise ValueError(f"make_codec: unknown compression {compression!r}")


def reduce_scatter_compressed(
    output: Tensor,
    input: Tensor,
    codec: Codec,
    group: ProcessGroup,
    point_to_point: bool,
    residual: Tensor | None = None,
) -> Future:
    """Average ``input`` over the group into ``output`` (this rank's slice, fp32) with every peer's
    slice sent as ``codec`` codes; see Note [Compressed wire]. With ``residual`` (fp32, one row
    per peer in rank order, this rank's skipped) each slice is sent with error feedback and its
    row updated (Note [Error feedback]). Returns a future fulfilled once ``output`` is final.
    ``input`` may be reused once this returns: what is sent is encoded and this rank's own slice
    copied before it does."""
    world_size, rank = group.size(), group.rank()
    slices = input.view(world_size, -1)
    sent = torch.empty(world_size, codec.row_numel, dtype=codec.wire_dtype, device=input.device)
    for peer in range(world_size):
        if peer == rank:
            continue
        if residual is None:
            codec.encode(slices[peer], sent[peer])
        else:
            encode_with_feedback(slices[peer], residual[peer - (peer > rank)], sent[peer], codec)
    own = slices[rank].to(torch.float32, copy=True)
    received = torch.empty_like(sent)
    if point_to_point:
        works = exchange(list(sent.unbind()), list(received.unbind()), group)
    else:
        works = dist.all_to_all_single(received, sent, group=group, async_op=True)

    def part(peer: int, start: int, end: int) -> Tensor:
        return own[start:end] if peer == rank else codec.decode(received[peer], start, end)

    def average() -> None:
        _average_parts(output, world_size, part)

    return run_after(works, average, "sharded_opt: sum of the compressed slices")


@torch.no_grad()
def encode_with_feedback(values: Tensor, residual: Tensor, row: Tensor, codec: Codec) -> None:
    """Write the codes of ``values + residual`` (in fp32) into ``row`` and leave in ``residual``
    what they miss, zero where they decode non-finite; a chunk at a time (Note [Error
    feedback])."""
    for start in range(0, codec.numel, CHUNK_NUMEL):
        end = min(start + CHUNK_NUMEL, codec.numel)
        carried = residual[start:end]
        carried.add_(values[start:end])  # a 16-bit grad promotes to fp32
        codec.encode_range(carried, row, start, end)
        carried.sub_(codec.decode(row, start, end)).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def _average_parts(output: Tensor, world_size: int, part: Callable[[int, int, int], Tensor]) -> None:
    """``output`` = the mean of ``part(peer, ...)`` over the peers: summed in fp32 in rank order
    (a left fold: ``((part 0 + part 1) + part 2) + ...``), a chunk of elements at a time, then
    divided by the number of peers."""
    for start in range(0, output.numel(), CHUNK_NUMEL):
        end = min(start + CHUNK_NUMEL, output.numel())
        total = output[start:end]
        total.copy_(part(0, start, end))
        for peer in range(1, world_size):
            total.add_(part(peer, start, end))
    output.div_(world_size)


@torch.no_grad()
def apply_delta(replica: Tensor, row: Tensor, codec: Codec) -> None:
    """``replica += decoded delta`` in fp32, rounded to the replica's dtype; every rank runs this
    with the same row on the same replica, so all get the same bits."""
    for start in range(0, codec.numel, CHUNK_NUMEL):
        end = min(start + CHUNK_NUMEL, codec.numel)
        _add_decoded(replica[start:end], codec.decode(row, start, end))


@torch.no_grad()
def publish_delta(master: Tensor, replica: Tensor, published: Tensor, row: Tensor, codec: Codec) -> None:
    """The owner's side of a param delta, a chunk at a time so each chunk stays in cache: encode
    ``master - replica`` into ``row``, add the decoded delta to its own ``replica`` as every peer
    will (:func:`apply_delta`), and copy the result into ``published``."""
    for start in range(0, codec.numel, CHUNK_NUMEL):
        end = min(start + CHUNK_NUMEL, codec.numel)
        part = replica[start:end]
        codec.encode_range(master[start:end] - part, row, start, end)  # a 16-bit part promotes
        _add_decoded(part, codec.decode(row, start, end))
        published[start:end].copy_(part)


def _add_decoded(part: Tensor, decoded: Tensor) -> None:
    """``part += decoded`` in fp32, rounded to ``part``'s dtype (in place for fp32 params): the
    one arithmetic every rank applies a delta with."""
    if part.dtype == torch.float32:
        part.add_(decoded)
    else:
        part.copy_(decoded.add_(part))


def all_gather_deltas(
    replicas: Tensor, sent: Tensor, codec: Codec, group: ProcessGroup, point_to_point: bool
) -> Work | Future:
    """Share this rank's encoded delta (row ``rank`` of ``sent``, already applied to its own
    slice) and add every peer's to its slice of ``replicas`` (the bucket's param buffer);
    returns a future fulfilled once every slice is updated. See Note [Compressed wire]."""
    world_size, rank = group.size(), group.rank()
    slices = replicas.view(world_size, -1)
    work = all_gather(sent.view(-1), sent[rank], group, async_op=True, point_to_point=point_to_point)

    def apply() -> None:
        for peer in range(world_size):
            if peer != rank:
                apply_delta(slices[peer].data, sent[peer], codec)

    return run_after(work, apply, "sharded_opt: add the param deltas")


def average_compressed(tensor: Tensor, codec: Codec, group: ProcessGroup) -> Future:
    """Average ``tensor`` (fp32) in place over ``group`` with every rank's value sent as
    ``codec`` codes to every other (an all-gather of the codes): each rank decodes all rows, its
    own included, and sums them in rank order, so every rank ends with the same bits. The
    cross-group average of hybrid sharding (Note [Compressed wire])."""
    world_size, rank = group.size(), group.rank()
    sent = torch.empty(world_size, codec.row_numel, dtype=codec.wire_dtype, device=tensor.device)
    codec.encode(tensor, sent[rank])
    work = all_gather(sent.view(-1), sent[rank], group, async_op=True)

    def average() -> None:
        _average_parts(tensor, world_size, lambda peer, start, end: codec.decode(sent[peer], start, end))

    return run_after(work, average, "sharded_opt: average of the compressed replicas")


def payload_bytes(codec: Codec, world_size: int) -> int:
    """Bytes one rank sends for one compressed collective of a bucket: a row to each peer."""
    return (world_size - 1) * codec.row_numel * codec.wire_dtype.itemsize
