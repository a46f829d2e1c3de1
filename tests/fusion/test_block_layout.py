"""Layouts for optimizers that quantize state per block: every shard boundary is an allowed cut
(Note [Cuts on quantization blocks] in ``fusion/block_layout.py``), checked over random models
and on a worked example. Pure planning: nothing is allocated or stepped."""

from __future__ import annotations

import random

import pytest
import torch

from fusion.block_layout import BlockGrid
from fusion.layout import ParamSpec, plan_layout

TORCHAO_8BIT = BlockGrid(block_size=256, min_numel=4096)
BITSANDBYTES_8BIT = BlockGrid(block_size=256, min_numel=4096, partial_last_block=True)


def specs(numels: list[int]) -> list[ParamSpec]:
    return [ParamSpec((n,), torch.float32, torch.device("cpu"), 0) for n in numels]


@pytest.mark.parametrize("seed", range(40))
def test_every_piece_gets_the_decision_and_blocks_of_its_whole_param(seed: int) -> None:
    rng = random.Random(seed)
    grid = rng.choice([TORCHAO_8BIT, BlockGrid(128, 4096), BlockGrid(2048, 4096), BITSANDBYTES_8BIT])
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


def test_worked_example_two_ranks() -> None:
    """8192 elements (quantized, cut on a block edge with 4096 on each side), 4352 (quantized,
    too small to cut), 4100 (plain state but 4096 or more: whole) and a bias (cut anywhere)."""
    plan = plan_layout(specs([8192, 4352, 4100, 17]), 2, bucket_size_bytes=10**6, block_grid=TORCHAO_8BIT)
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
