"""Quantized optimizer state (torchao's values, bitsandbytes' keys) as DCP entries that any
number of ranks reads.

Note [Quantized state in checkpoints]
    Quantized state is not element-wise: its codes hold a fixed number of entries per element
    (one for 8-bit and fp8, half of one for torchao's 4-bit), its scales one per block, its code
    book the same for the whole tensor. So each per-element part of a param's state is saved as
    a 1-D tensor of the part's entries for the whole param (entry ``j`` the one the unsharded
    state holds at ``j``), of which every rank writes the entries of its own piece, as for
    element-wise state (Note [Checkpoint layout] in ``checkpoint``). On any number of ranks a
    piece starts and ends on block edges counted from the param's start (Note [Cuts on
    quantization blocks] in ``fusion/block_layout.py``), so its entries are whole codes and
    whole scales, and M ranks read their pieces from whichever saved pieces overlap them:
    nothing is dequantized or requantized, and the state after a load is bitwise the state that
    was saved. A code book is a replicated entry, written once. The two layouts of such state:

    - torchao keeps each moment as one tensor subclass (``quantized_state``): its per-element
      parts are ``state_quantized.<param>.<key>.<part>`` (entries per element: the saved size
      over the param's numel), its code book ``state_quantized_shared.<param>.<key>.<part>``.
      A checkpoint holds only tensors, so which subclass the parts make and its attributes
      (signed or not, the dtype it stands for) are taken on load from the loading class: a
      throwaway copy of it steps, eagerly, one small tensor it quantizes, in the param's
      stepped dtype.
    - bitsandbytes keeps plain tensors under keys (``keyed_state``): its uint8 codes
      ``state1``/``state2`` are element-wise entries (``state.<param>.<key>``), its code books
      ``qmap1``/``qmap2`` replicated ones (``state_whole.<param>.<key>``), its int ``step`` an
      int scalar (``state_int.<param>.step``), and its scales ``absmax1``/``absmax2``
      ``state_per_block.<param>.<key>``: one entry per block of the bucket's grid, the last
      block possibly partial, so the entry has ``ceil(numel / block)`` entries and only a piece
      that ends at the param's end holds a block begun (its partial block's scale).

    Both readings are right only for the class and block size that wrote the entries, which the
    checkpoint records (``meta.quantized_by``: the class's module and name as UTF-8 bytes;
    ``meta.block_size``); a load into another class or block size, or from or into a class
    that keeps plain state, is refused before any state is read.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fusion.layout import ShardPiece
from sharded_opt.guards.optimizer_needs import THIRD_PARTY_NEEDS_BY_PATH, block_grid_of
from sharded_opt.state.checkpoint_pieces import ParamPiece
from sharded_opt.step.inner_optimizer import hyperparameters, probe_state
from sharded_opt.step.optimizer_shards import OptimizerShards
from sharded_opt.step.quantized_state import QuantizedFormat, flat_parts, format_of, is_quantized

PARTS = "state_quantized"
SHARED = "state_quantized_shared"
PER_BLOCK = "state_per_block"
"""Entries of state kept as one value per block under a key (bitsandbytes' scales)."""
META_QUANTIZED_BY = "meta.quantized_by"
META_BLOCK_SIZE = "meta.block_size"

PieceEntry = Callable[[int, Tensor | None, torch.dtype, Fraction], Tensor | ParamPiece]
"""``(param, this rank's entries or None, dtype, entries per element)`` to the param's entry
(``_PerParamEntries.entry`` in ``checkpoint``)."""


def quantizer_entries(shards: OptimizerShards) -> dict[str, Tensor]:
    """The record of the class and block size that quantize the state; none for a class that
    keeps plain state. See Note [Quantized state in checkpoints]."""
    quantizer = _quantizer(shards.inner)
    if quantizer is None:
        return {}
    name, block_size = quantizer
    return {
        META_QUANTIZED_BY: torch.tensor(list(name.encode()), dtype=torch.uint8),
        META_BLOCK_SIZE: torch.tensor(block_size, dtype=torch.int64),
    }


def saved_quantizer_entries(saved: dict[str, Any]) -> dict[str, Tensor]:
    """Tensors to read the checkpoint's record into (none where it has no record)."""
    return {
        name: torch.zeros(tuple(saved[name].size), dtype=saved[name].properties.dtype)
        for name in (META_QUANTIZED_BY, META_BLOCK_SIZE)
        if name in saved
    }


def check_quantizer(folder: Path, loaded: dict[str, Tensor], shards: OptimizerShards) -> None:
    """Refuse a checkpoint whose state was quantized by another class or block size, or was not
    quantized while this optimizer quantizes (and the reverse).

    Raises:
        ValueError: the checkpoint's record (``loaded``, read from the checkpoint's
            :func:`saved_quantizer_entries`) differs from this optimizer's.
    """
    ours = _quantizer(shards.inner)
    theirs = None
    if META_QUANTIZED_BY in loaded:
        theirs = bytes(loaded[META_QUANTIZED_BY].tolist()).decode(), int(loaded[META_BLOCK_SIZE])
    if ours == theirs:
        return
    cls = type(shards.inner)
    ours_path = f"{cls.__module__}.{cls.__qualname__}"
    ours_name, fix = cls.__name__, "build the optimizer that saved it"
    saved = "plain state"
    if theirs is not None:
        saved = f"state quantized by {theirs[0]} with block_size={theirs[1]}"
        theirs_name = theirs[0].rsplit(".", 1)[-1]
        if theirs_name == ours_name and theirs[0] != ours_path:
            ours_name, theirs_name = ours_path, theirs[0]  # torchao's and bitsandbytes' AdamW8bit
        setting = f"(..., block_size={theirs[1]})" if _block_size_is_a_setting(theirs[0]) else ""
        fix = f"build {theirs_name}{setting} to load it"
    this = "keeps plain state" if ours is None else f"quantizes with block_size={ours[1]}"
    raise ValueError(
        f"load_checkpoint: the checkpoint at {folder} holds {saved}, but this optimizer ({ours_name}) "
        f"{this}; quantized state does not convert between classes or block sizes. To resume, {fix}; to "
        "change optimizers, load the model's weights alone and start the new optimizer fresh"
    )


def _block_size_is_a_setting(path: str) -> bool:
    """Whether the class at ``path`` takes its block size as a setting (torchao's
    ``block_size=``), as any class not known by path is taken to; bitsandbytes' is fixed."""
    needs = THIRD_PARTY_NEEDS_BY_PATH.get(path)
    return needs is None or needs.quantized_blocks is None or callable(needs.quantized_blocks.block_size)


def _quantizer(inner: torch.optim.Optimizer) -> tuple[str, int] | None:
    """The class's module and name and its block size, if it quantizes its state."""
    grid = block_grid_of(inner)
    cls = type(inner)
    return None if grid is None else (f"{cls.__module__}.{cls.__qualname__}", grid.block_size)


def quantized_save_entries(
    index: int, key: str, fmt: QuantizedFormat, local: Tensor | None, piece_entry: PieceEntry
) -> dict[str, Tensor | ParamPiece]:
    """The entries of param ``index``'s quantized ``key``, of format ``fmt``; ``local`` is this
    rank's piece of it (None: this rank has none)."""
    parts = {} if local is None else flat_parts(local, fmt)
    entries: dict[str, Tensor | ParamPiece] = {
        f"{PARTS}.{index}.{key}.{part}": piece_entry(index, parts.get(part), dtype, ratio)
        for part, (ratio, dtype) in fmt.ratios.items()
    }
    entries.update((f"{SHARED}.{index}.{key}.{part}", tensor) for part, tensor in fmt.shared.items())
    return entries


class QuantizedLoad:
    """The quantized entries of a checkpoint this rank reads, and the values of its pieces built
    from them (Note [Quantized state in checkpoints]).

    Args:
        shards: the loading optimizer's.
        saved: the checkpoint's metadata per entry.
        pieces: this rank's piece of each param it holds a piece of.
        piece_entry: what to read one part of a param into.

    Raises:
        ValueError: the checkpoint holds quantized state under a key that this optimizer, as
            configured, does not quantize (raised on every rank alike, before any read).
    """

    def __init__(
        self,
        shards: OptimizerShards,
        saved: dict[str, Any],
        pieces: dict[int, ShardPiece],
        piece_entry: PieceEntry,
    ) -> None:
        self._shards = shards
        self._pieces = pieces
        self.entries: dict[str, Tensor | ParamPiece] = {}
        self._parts: dict[tuple[int, str], dict[str, Tensor]] = {}
        self._shared: dict[tuple[int, str], dict[str, Tensor]] = {}
        params = shards.buffers.params
        for name, meta in saved.items():
            parsed = _parse_name(name)
            if parsed is None:
                continue
            prefix, index, key, part = parsed
            if not 0 <= index < len(params):
                raise ValueError(f"load_checkpoint: the checkpoint holds state for unknown param {index}")
            device, dtype = params[index].device, meta.properties.dtype
            if prefix == SHARED:
                value = torch.zeros(tuple(meta.size), dtype=dtype, device=device)
                self.entries[name] = value
                self._shared.setdefault((index, key), {})[part] = value
                continue
            ratio = Fraction(meta.size[0], params[index].numel())
            piece = pieces.get(index)
            value = torch.zeros(0 if piece is None else int(piece.numel * ratio), dtype=dtype, device=device)
            self.entries[name] = piece_entry(index, value, dtype, ratio)
            parts = self._parts.setdefault((index, key), {})
            if piece is not None:
                parts[part] = value
        self._formats = self._loading_formats()

    def values(self) -> dict[int, dict[str, Tensor]]:
        """Per param with a piece on this rank, its quantized state values (after the read)."""
        values: dict[int, dict[str, Tensor]] = {}
        for (index, key), parts in self._parts.items():
            if parts:
                fmt = self._formats[index, key]
                shared = self._shared.get((index, key), {})
                loaded = QuantizedFormat(fmt.cls, fmt.attributes, fmt.ratios, shared)
                values.setdefault(index, {})[key] = loaded.build(parts, (self._pieces[index].numel,))
        return values

    def _loading_formats(self) -> dict[tuple[int, str], QuantizedFormat]:
        """The loading class's format of every quantized value the checkpoint holds, this rank
        holding a piece of it or not (so every rank raises alike)."""
        probed: dict[tuple[int, torch.dtype], dict[str, QuantizedFormat]] = {}
        formats = {}
        for index, key in self._parts:
            bucket = self._shards.bucket_of(index)
            where = (bucket.plan.group_index, bucket.precision.master_dtype)
            if where not in probed:
                probed[where] = self._probe(*where)
            if key not in probed[where]:
                raise ValueError(
                    f"load_checkpoint: the checkpoint holds quantized state {key!r} of param {index}, "
                    f"but {type(self._shards.inner).__name__} configured as param group {where[0]} keeps "
                    f"quantized {sorted(probed[where])}; build the optimizer with the settings that "
                    "saved it (amsgrad, for one)"
                )
            formats[index, key] = probed[where][key]
        return formats

    def _probe(self, group_index: int, dtype: torch.dtype) -> dict[str, QuantizedFormat]:
        """The formats of the loading class's quantized values, by key, for ``dtype`` params of
        group ``group_index``."""
        inner = self._shards.inner
        grid = block_grid_of(inner)
        if grid is None:
            raise RuntimeError("checkpoint: quantized entries reached an optimizer that keeps plain state")
        probe = torch.zeros(grid.first_quantized_numel, dtype=dtype, requires_grad=True)
        state = probe_state(inner, hyperparameters(self._shards.param_groups[group_index]), probe)
        shared = self._shards.shared_state_parts
        return {key: format_of(value, shared) for key, value in state.items() if is_quantized(value)}


def _parse_name(name: str) -> tuple[str, int, str, str] | None:
    """``(prefix, param, key, part)`` of a quantized entry's name, or None."""
    prefix, _, rest = name.partition(".")
    index, _, key_part = rest.partition(".")
    key, _, part = key_part.rpartition(".")
    if prefix not in (PARTS, SHARED) or not index.isdigit() or not key or not part:
        return None
    return prefix, int(index), key, part
