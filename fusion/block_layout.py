"""Where params lie in a bucket when the optimizer quantizes its state block by block.

Note [Cuts on quantization blocks]
    Low-bit optimizers (torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and their ``Adam``
    variants) keep each state tensor as codes plus one scale per block of ``block_size``
    elements, the blocks counted from the start of the tensor they are given (its flat memory
    order), and they quantize a tensor only if it has at least ``min_numel`` (4096) elements and
    a whole number of blocks; any other tensor keeps plain state. bitsandbytes' ``AdamW8bit``
    and ``Adam8bit`` do the same with blocks of 256 except that they quantize a tensor of
    ``min_numel`` or more whatever its last block (``partial_last_block``): there the last block
    of a piece is the param's own last block, so the cut rule below holds unchanged, and every
    param of ``min_numel`` or more is quantized. Sharded, the optimizer is given
    each param's piece in a rank's shard instead of the param, so a piece gets the numbers of the
    unsharded optimizer only if it makes the same decision and has the same blocks. So a cut
    (a shard boundary inside a param, ``at`` elements from its start) is allowed when:

    - the param has fewer than ``min_numel`` elements: it is not quantized, and neither is any
      piece of it, so it is cut anywhere, as for AdamW;
    - the param is quantized and ``at`` is a multiple of ``block_size`` with at least
      ``min_numel`` elements on each side: every piece is then a whole number of the param's
      own blocks and is quantized too, its scales computed over the same elements;
    - never, for a param of ``min_numel`` elements or more that is not a whole number of blocks:
      unsharded it keeps plain state, while a piece of it could be quantized. It lies whole in
      one shard.

    Params are packed as for element-wise optimizers, with quantized params starting on a
    multiple of ``block_size`` (and of the alignment) and every shard a multiple of both, so
    every cut inside a quantized param is on one of its block edges. Where a shard boundary
    would still fall within ``min_numel`` of a quantized param's end or start, or inside a
    param that must stay whole, the param moves forward to the first start that puts every
    boundary on an allowed cut: at most about ``2 * min_numel`` padding elements per shard
    boundary (8192 for torchao's threshold), and none where no boundary falls near a param. A
    shard is at least ``2 * min_numel`` plus one unit long when the bucket holds a quantized
    param, which guarantees a start that works exists within one shard, and at least as long
    as the largest param that must stay whole.

    The other choice, keeping every param that the threshold could split badly whole on one
    owner (Note [Whole params per owner] in ``layout``), gives exact numbers too but leaves a
    rank holding a whole large param's state; moving params costs only padding, and the state
    per rank stays within one shard's share plus the blocks that padding displaces.

    Where the wrapper can give a piece its param's decision itself (``pieces_keep_decision``:
    the class declares how its fresh state is built, ``QuantizedBlocks.fresh_state``, and each
    piece whose own size would decide otherwise starts from its param's kind of state; torchao
    does, in ``sharded_opt/guards/torchao_state.py``, bitsandbytes keeps the rules above), the
    size of a piece no longer matters and the rules shrink to the blocks: a quantized param is
    cut on any of its block edges, any other param anywhere. Nothing moves, no param lies
    whole, and a large param the class keeps plain (4096 or more elements that are not whole
    blocks: a 1000 x 5000 weight) is shared out like any other instead of leaving one rank its
    whole fp32 state.

    Shards split a bucket's elements evenly, but not its state: a plain element holds 8 bytes
    of Adam state, a quantized one 2 (1 at 4 bits). So the order params are placed in within a
    bucket is chosen (``_candidate_orders``) to spread the plain ones over the shards, or,
    where a bucket has too few to split, to put them on the rank that has held the fewest so
    far; each rank then holds about 1/N of the class's state. The order inside a bucket
    changes nothing else: the bucket is reduced when its last grad is ready, whatever the
    order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockGrid:
    """How an optimizer quantizes state: blocks of ``block_size`` elements from each tensor's
    start, only for tensors of at least ``min_numel`` elements that hold whole blocks (or any
    last block, with ``partial_last_block``: bitsandbytes)."""

    block_size: int
    min_numel: int
    partial_last_block: bool = False
    pieces_keep_decision: bool = False
    """Every piece gets its param's decision (quantized or plain), whatever its own size."""

    def quantizes(self, numel: int) -> bool:
        """Whether the optimizer keeps quantized state for a tensor of ``numel`` elements."""
        whole_blocks = self.partial_last_block or numel % self.block_size == 0
        return numel >= self.min_numel and whole_blocks

    @property
    def first_quantized_numel(self) -> int:
        """The fewest elements of a tensor the optimizer quantizes."""
        return _round_up(self.min_numel, self.block_size)

    def allows_cut(self, numel: int, at: int) -> bool:
        """Whether a param of ``numel`` elements may be cut ``at`` elements from its start (``0 <
        at < numel``), see Note [Cuts on quantization blocks]."""
        if not self.quantizes(numel):
            return numel < self.min_numel or self.pieces_keep_decision
        on_edge = at % self.block_size == 0
        return on_edge and (self.pieces_keep_decision or self.min_numel <= at <= numel - self.min_numel)


def place_on_blocks(
    numels: list[int],
    world_size: int,
    align: int,
    grid: BlockGrid,
    place: Callable[[int, int], int],
    plain_held: list[int] | None = None,
) -> tuple[list[int], int]:
    """Offsets of params of ``numels`` in one bucket and its shard size, every shard boundary on
    an allowed cut (Note [Cuts on quantization blocks]).

    ``place(cursor, numel)`` is where a param starts after ``cursor`` by the element-wise rules
    (Note [Alignment and padding] in ``layout``); ``align`` is the shard alignment in elements.
    ``plain_held``: elements of params the class keeps plain that each rank holds in the
    buckets placed before this one; of the orders :func:`_candidate_orders` offers whose shard
    is at most one block longer than the shortest's, the one that leaves these totals most
    even is taken, and they are updated.
    """
    plain_held = [0] * world_size if plain_held is None else plain_held
    unit = math.lcm(align, grid.block_size)
    candidates = []
    for order in _candidate_orders(numels, world_size, grid):
        placed, shard = _place_in_shards([numels[i] for i in order], world_size, align, grid, place)
        offsets = [0] * len(numels)
        for position, index in enumerate(order):
            offsets[index] = placed[position]
        now = _plain_per_shard(numels, offsets, shard, world_size, grid)
        held = [before + here for before, here in zip(plain_held, now, strict=True)]
        candidates.append(((max(held), shard, *sorted(held, reverse=True)), offsets, shard, held))
    smallest = min(shard for _, _, shard, _ in candidates)
    _, offsets, shard, plain_held[:] = min(
        (c for c in candidates if c[2] <= smallest + unit), key=lambda candidate: candidate[0]
    )
    return offsets, shard


def _candidate_orders(numels: list[int], world_size: int, grid: BlockGrid) -> list[list[int]]:
    """Orders to place params in: the ones the class quantizes in their order, with the ones it
    keeps plain spread evenly between them (each where its share of the plain elements is
    due), or all together before any one of them. Shards split elements evenly, but a plain
    element costs several times a quantized one (8 bytes of Adam state against 2, or 1 at 4
    bits): in registration order a bucket's biases and norms would land in one shard, and
    that rank would hold more than its share of the state. Spread evens a bucket with many
    params; where a bucket's plain params are too few to split (a 1024-element bias beside a
    262144-element weight on 3 ranks), putting them together on the rank that has held the
    fewest so far evens the totals over buckets (Note [Cuts on quantization blocks])."""
    quantized = [i for i, numel in enumerate(numels) if grid.quantizes(numel)]
    plain = [i for i, numel in enumerate(numels) if not grid.quantizes(numel)]
    if world_size == 1 or not quantized or not plain:
        return [list(range(len(numels)))]
    together = [quantized[:k] + plain + quantized[k:] for k in range(len(quantized) + 1)]
    return [_spread_order(numels, quantized, plain), *together]


def _spread_order(numels: list[int], quantized: list[int], plain: list[int]) -> list[int]:
    """``quantized`` in order, each of ``plain`` placed before the first quantized param whose
    middle lies past where that plain param's share of the plain elements is due."""
    total, plain_total = sum(numels), sum(numels[i] for i in plain)
    order: list[int] = []
    placed = plain_placed = 0
    pending = iter(plain)
    next_plain = next(pending, None)
    for index in quantized:
        middle = 2 * placed + numels[index]  # twice the position of this param's middle
        while next_plain is not None and 2 * plain_placed * total < plain_total * middle:
            order.append(next_plain)
            placed += numels[next_plain]
            plain_placed += numels[next_plain]
            middle += 2 * numels[next_plain]
            next_plain = next(pending, None)
        order.append(index)
        placed += numels[index]
    if next_plain is not None:
        order += [next_plain, *pending]
    return order


def _plain_per_shard(
    numels: list[int], offsets: list[int], shard: int, world_size: int, grid: BlockGrid
) -> list[int]:
    """Elements of params the class keeps plain in each shard of a bucket so laid out."""
    held = [0] * world_size
    for offset, numel in zip(offsets, numels, strict=True):
        if grid.quantizes(numel):
            continue
        for rank in range(offset // shard, -(-(offset + numel) // shard)):
            held[rank] += min(offset + numel, (rank + 1) * shard) - max(offset, rank * shard)
    return held


def _place_in_shards(
    numels: list[int], world_size: int, align: int, grid: BlockGrid, place: Callable[[int, int], int]
) -> tuple[list[int], int]:
    """Offsets of params of ``numels`` placed in this order, and the shard size."""
    unit = math.lcm(align, grid.block_size)
    placed, end = _place(numels, 0, unit, grid, place)  # unsharded: no boundary to respect
    shard = _round_up(max(1, -(-end // world_size)), unit)
    if any(grid.quantizes(n) for n in numels) and world_size > 1 and not grid.pieces_keep_decision:
        shard = max(shard, _round_up(2 * grid.min_numel + unit, unit))
    whole = [n for n in numels if not _cuttable(n, grid)]
    if whole and world_size > 1:
        shard = max(shard, _round_up(max(whole), unit))
    while world_size > 1:
        placed, end = _place(numels, shard, unit, grid, place)
        if end <= shard * world_size:
            break
        shard = max(shard + unit, _round_up(-(-end // world_size), unit))
    return placed, shard


def _place(
    numels: list[int], shard: int, unit: int, grid: BlockGrid, place: Callable[[int, int], int]
) -> tuple[list[int], int]:
    """Offsets with every boundary at a multiple of ``shard`` on an allowed cut (``shard`` 0: no
    boundaries), and the end of the last param."""
    offsets, cursor = [], 0
    for numel in numels:
        start = place(cursor, numel)
        if grid.quantizes(numel):
            start = _round_up(start, unit)
        while shard and (bad := _first_bad_boundary(start, numel, shard, grid)) is not None:
            start = bad if not _cuttable(numel, grid) else start + unit
        offsets.append(start)
        cursor = start + numel
    return offsets, cursor


def _first_bad_boundary(start: int, numel: int, shard: int, grid: BlockGrid) -> int | None:
    """The first shard boundary strictly inside ``[start, start + numel)`` that is not an allowed
    cut, or None."""
    boundary = (start // shard + 1) * shard
    while boundary < start + numel:
        if not grid.allows_cut(numel, boundary - start):
            return boundary
        boundary += shard
    return None


def _cuttable(numel: int, grid: BlockGrid) -> bool:
    """Whether some cut of the param is allowed."""
    if grid.pieces_keep_decision or numel < grid.min_numel:
        return True
    return grid.quantizes(numel) and grid.first_quantized_numel <= numel - grid.min_numel


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
