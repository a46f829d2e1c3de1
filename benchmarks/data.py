"""A byte-level corpus every machine has: the Python standard library's own source files.

Batches are a pure function of (seed, step): every mode, rank and rerun sees the same tokens, so
losses of different modes can be compared step by step. Each rank takes a disjoint slice of the
global batch, as data parallel training does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DEFAULT_MAX_BYTES = 4 * 2**20
"""Enough distinct text that a short benchmark never memorizes it; reads in well under a second."""


@dataclass(frozen=True, slots=True)
class DataConfig:
    """Per-rank batch shape and the seed that fixes which windows are drawn."""

    seq_len: int
    micro_batch: int
    seed: int = 0
    max_bytes: int = DEFAULT_MAX_BYTES

    def tokens_per_rank(self) -> int:
        return self.seq_len * self.micro_batch


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
    """The top-level ``*.py`` files of the standard library, sorted by name and concatenated,
    as a uint8 tensor of at most ``max_bytes`` bytes.

    Only the top level is read so site-packages (which differs between machines) never leaks in.
    """
    root = Path(os.path.dirname(os.__file__))
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    corpus = b"\n".join(chunks)[:max_bytes]
    if len(corpus) < 2:
        raise RuntimeError(f"stdlib_corpus found no Python sources under {root}")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


class RankBatches:
    """This rank's slice of the global batch of every step: ``batch(step)`` or iterate.

    Global batch ``step`` is ``micro_batch * world_size`` windows at offsets drawn from a
    generator seeded with ``(seed, step)``; rank ``r`` gets windows ``[r*micro, (r+1)*micro)``.
    """

    def __init__(self, corpus: Tensor, config: DataConfig, rank: int, world_size: int) -> None:
        if len(corpus) <= config.seq_len + 1:
            raise ValueError(f"RankBatches needs a corpus longer than seq_len+1={config.seq_len + 1}")
        self.corpus = corpus
        self.config = config
        self.rank = rank
        self.world_size = world_size

    def batch(self, step: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """Inputs and next-byte targets, both int64 of shape (micro_batch, seq_len)."""
        config = self.config
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        global_batch = config.micro_batch * self.world_size
        offsets = torch.randint(len(self.corpus) - config.seq_len - 1, (global_batch,), generator=generator)
        mine = offsets[self.rank * config.micro_batch : (self.rank + 1) * config.micro_batch]
        window = torch.arange(config.seq_len + 1)
        tokens = self.corpus[mine[:, None] + window].long()
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
