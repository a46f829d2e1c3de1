"""Quantized state kept as plain tensors under keys (bitsandbytes' ``state1``, ``absmax1``,
``qmap1``...), in the standard state dict.

Codes have the param's shape and are assembled and cut like any element-wise value; code books
are the same in every piece and travel like ``step``; scales hold one value per block of the
param, the last possibly partial, so a piece starting on a block edge (Note [Cuts on
quantization blocks] in ``fusion/block_layout.py``) holds the param's scales
``[start // block, ceil(end / block))``. The class's own ``state_dict()`` may nest some keys
under one (``KeyedQuantizedState.saved_under``): saved states are nested as it does, and loaded
ones unnested, so the plain class and the wrapper load each other's.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from sharded_opt.guards.optimizer_needs import KeyedQuantizedState


def per_block_slice(value: Tensor, start: int, numel: int, block_size: int) -> Tensor:
    """A copy of the scales of elements ``[start, start + numel)`` of a param, ``start`` on a
    block edge."""
    if start % block_size:
        raise ValueError(f"keyed quantized state: a piece starts at {start}, not on a block of {block_size}")
    return value[start // block_size : -(-(start + numel) // block_size)].clone()


def nested(entry: dict[str, Any], keyed: KeyedQuantizedState) -> dict[str, Any]:
    """One param's state as the class's ``state_dict()`` writes it."""
    if keyed.saved_under is None:
        return entry
    inner = {key: value for key, value in entry.items() if key in keyed.saved_keys}
    outer = {key: value for key, value in entry.items() if key not in keyed.saved_keys}
    return {**outer, keyed.saved_under: inner} if inner else outer


def unnested(entry: Any, keyed: KeyedQuantizedState) -> Any:
    """One param's saved state with the nested keys put back (as the class's
    ``load_state_dict`` does); an entry saved unnested, or not a dict, as it is."""
    if keyed.saved_under is None or not isinstance(entry, dict) or keyed.saved_under not in entry:
        return entry
    inner = entry[keyed.saved_under]
    if not isinstance(inner, dict):
        raise ValueError(
            f"ShardingStage1.load_state_dict expects {keyed.saved_under!r} of a param's state to be a "
            f"dict of state tensors but got {type(inner).__name__}"
        )
    return {**{k: v for k, v in entry.items() if k != keyed.saved_under}, **inner}
