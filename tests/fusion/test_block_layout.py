"""Layouts for optimizers that quantize state per block: every shard boundary is an allowed cut
(Note [Cuts on quantization blocks] in ``fusion/block_layout.py``), checked over random models
and on a worked example. Pure planning: nothing is allocated or stepped."""

from __future__ import annotations

import random

import pytest
import torch

from fusion.block_layout import BlockGrid
from fusion.layout import ParamSpec, plan_layout

TORCHAO_8BIT = BlockGrid(block_size=256, min_numel=4096, pieces_keep_decision=True)
"""torchao as the wrapper steps it: each piece starts from its param's kind of state."""
BY_PIECE_SIZE = BlockGrid(block_size=256, min_numel=4096)
"""A class whose pieces decide by their own size (no declared ``fresh_state``)."""
BITSANDBYTES_8BIT = BlockGrid(block_size=256, min_numel=4096, partial_last_block=True)


def specs(numels: list[int]) -> list[ParamSpec]:
    return [ParamSpec((n,), torch.float32, torch.device("cpu"), 0) for n in numels]


@pytest.mark.parametrize("seed", range(40))
def test_every_piece_gets_the_decision_and_blocks_of_its_whole_param(seed: int) -> None:
    rng = random.Random(seed)
    big_blocks = BlockGrid(2048, 4096, pieces_keep_decision=True)
    grid = rng.choice([TORCHAO_8BIT, BY_PIECE_SIZE, BlockGrid(128, 4096), big_blocks, BITSANDBYTES_8BIT])
    world_size = rng.choice([2, 3, 4, 8])
    sizes = [1, 7, 100, 4095, 4096, 4100, 4352, 8192, 8448, 12288, 65536, 100_000]
    numels = [rng.choice([*sizes, 256 * rng.randint(1, 200), rng.randint(1, 30_000)]) for _ in range(12)]
    plan = plan_layout(
        specs(numels), world_size, bucket_size_bytes=rng.choice([1000, 100_000, 10**7]), block_grid=grid
    )
    for bucket in plan.buckets:
        assert bucket.block_grid == grid
        for rank in range(world_size):
            for piece in bucket.shard_pieces(rank):
                whole = numels[piece.param_index]
                if not grid.pieces_keep_decision:
                    assert grid.quantizes(piece.numel) == grid.quantizes(whole), (whole, piece)
                if grid.quantizes(whole):
                    assert piece.param_start % grid.block_size == 0, (whole, piece)


@pytest.mark.parametrize(
    ("numel", "at", "allowed"),
    [(16384, 8192, True), (10000, 5120, True), (12288, 4096, True), (8192, 4096, True),
     (10000, 5000, False), (6000, 3072, False), (4097, 4096, False), (4095, 1000, True)],
)  # fmt: skip
def test_bitsandbytes_cuts_are_the_measured_ones(numel: int, at: int, allowed: bool) -> None:
    """The cuts measured bitwise (or not) against the whole param in one process, bitsandbytes
    0.50.2 (benchmarks/results/2026-12-07-lowbit-combinations-cpu-2core.md): block edges with
    4096 or more elements each side, whatever the param's last block."""
    assert BITSANDBYTES_8BIT.allows_cut(numel, at) is allowed
    assert BITSANDBYTES_8BIT.quantizes(10000) and not TORCHAO_8BIT.quantizes(10000)


@pytest.mark.parametrize("seed", range(20))
def test_pieces_that_keep_their_decision_move_nothing_and_share_the_plain_state(seed: int) -> None:
    """With ``pieces_keep_decision`` (torchao) no param is moved to keep a piece's size: the only
    padding is the alignment of each param (a quantized one to a block) and of the bucket to
    its shards. The params kept plain (8 bytes of Adam state per element against 2 quantized) are
    spread over the bucket, so each shard holds its share of them, off by at most what lies
    under the largest quantized param plus the largest plain one."""
    rng = random.Random(seed)
    world_size = rng.choice([2, 3, 4])
    quantized = [256 * rng.randint(16, 400) for _ in range(rng.randint(2, 8))]
    plain = [rng.randint(1, 3000) for _ in range(rng.randint(4, 30))] + [rng.choice([5000, 300_000])]
    numels = rng.sample(quantized + plain, len(quantized) + len(plain))
    plan = plan_layout(specs(numels), world_size, bucket_size_bytes=10**9, block_grid=TORCHAO_8BIT)
    (bucket,) = plan.buckets
    unit, align = 256, 64  # the block (a multiple of fp32's alignment), the default 256 bytes
    padding = unit * (len(quantized) + world_size) + align * len(plain)
    assert bucket.padded_numel - sum(numels) <= padding
    plain_total, total = sum(plain), sum(numels)
    slack = plain_total * max(quantized) / total + max(plain) + unit * len(quantized)
    for rank in range(world_size):
        pieces = bucket.shard_pieces(rank)
        held = sum(p.numel for p in pieces if not TORCHAO_8BIT.quantizes(numels[p.param_index]))
        assert abs(held - plain_total / world_size) <= slack, (rank, held, plain_total / world_size, slack)


def test_a_large_param_kept_plain_is_shared_out() -> None:
    """A 1000 x 5000 weight holds no whole number of 256-blocks, so torchao keeps its moments in
    fp32: it is cut like any plain param instead of leaving one rank its whole state."""
    plan = plan_layout(specs([5_000_000, 1000]), 2, bucket_size_bytes=10**9, block_grid=TORCHAO_8BIT)
    (bucket,) = plan.buckets
    held = [sum(p.numel for p in bucket.shard_pieces(rank) if p.param_index == 0) for rank in (0, 1)]
    assert abs(held[0] - held[1]) <= 1000 + 256


def test_worked_example_two_ranks() -> None:
    """8192 elements (quantized, cut on a block edge with 4096 on each side), 4352 (quantized,
    too small to cut), 4100 (plain state but 4096 or more: whole) and a bias (cut anywhere), for
    a class whose pieces decide by their own size."""
    plan = plan_layout(specs([8192, 4352, 4100, 17]), 2, bucket_size_bytes=10**6, block_grid=BY_PIECE_SIZE)
    (bucket,) = plan.buckets
    pieces = {
        rank: {p.param_index: (p.param_start, p.numel) for p in bucket.shard_pieces(rank)} for rank in (0, 1)
    }
    cut = [index for index in range(4) if index in pieces[0] and index in pieces[1]]
    for index in cut:
        assert index in (0, 3)
        if index == 0:
            start = pieces[1][0][0]
            assert start % 256 == 0 and 4096 <= start <= 8192 - 4096
    assert sum(numel for rank in (0, 1) for _, numel in pieces[rank].values()) == 8192 + 4352 + 4100 + 17


def test_whole_param_and_block_layouts_are_exclusive() -> None:
    with pytest.raises(ValueError, match="not both"):
        plan_layout(specs([8]), 2, bucket_size_bytes=100, whole_param_cost=len, block_grid=TORCHAO_8BIT)
