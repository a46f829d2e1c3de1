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
        if numel < self.min_numel:
            return True
        if not self.quantizes(numel):
            return False
        return at % self.block_size == 0 and self.min_numel <= at <= numel - self.min_numel


def place_on_blocks(
    numels: list[int], world_size: int, align: int, grid: BlockGrid, place: Callable[[int, int], int]
) -> tuple[list[int], int]:
    """Offsets of params of ``numels`` in one bucket and its shard size, every shard boundary on
    an allowed cut (Note [Cuts on quantization blocks]).

    ``place(cursor, numel)`` is where a param starts after ``cursor`` by the element-wise rules
    (Note [Alignment and padding] in ``layout``); ``align`` is the shard alignment in elements.
    """
    unit = math.lcm(align, grid.block_size)
    placed, end = _place(numels, 0, unit, grid, place)  # unsharded: no boundary to respect
    shard = _round_up(max(1, -(-end // world_size)), unit)
    if any(grid.quantizes(n) for n in numels) and world_size > 1:
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
    first_cut = grid.first_quantized_numel
    return numel < grid.min_numel or (grid.quantizes(numel) and first_cut <= numel - grid.min_numel)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
