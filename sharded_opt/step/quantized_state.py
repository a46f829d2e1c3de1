"""Quantized state values (torchao's ``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``)
taken apart into their inner tensors and put back together, per piece of a param.

A quantized value is a tensor subclass of the param's shape that stores inner tensors
(``__tensor_flatten__``): some hold a fixed number of entries per element or per block, in the
tensor's order (codes; scales), others are the same for every tensor (a code book,
``QuantizedBlocks.shared_parts``). A piece's value is therefore the param's value cut at the
same place in every per-element part, which is exact because pieces start on block edges (Note
[Cuts on quantization blocks] in ``fusion/block_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor


def is_quantized(value: Any) -> bool:
    """Whether a state value is a tensor subclass holding inner tensors."""
    return isinstance(value, Tensor) and type(value) is not Tensor and hasattr(value, "__tensor_flatten__")


def stored_bytes(value: Tensor) -> int:
    """Bytes a state tensor really holds: a quantized value's inner tensors (codes, scales, code
    book), not its appearance dtype times its numel."""
    if not is_quantized(value):
        return value.numel() * value.element_size()
    names, _ = value.__tensor_flatten__()
    return sum(stored_bytes(getattr(value, name)) for name in names)


def state_nbytes(state: dict[str, Any]) -> int:
    """Bytes one param's (or piece's) optimizer state really holds in tensors of at least one
    dim; scalars such as ``step`` are not counted."""
    return sum(stored_bytes(v) for v in state.values() if isinstance(v, Tensor) and v.dim() > 0)


@dataclass(frozen=True)
class QuantizedFormat:
    """How one quantized value is built: everything but its per-element parts' data, small
    enough to share between ranks (picklable).

    Attributes:
        cls: the tensor subclass.
        attributes: its ``__tensor_flatten__`` context, with the tensor's shape where it holds
            one (written back as the shape of the value rebuilt).
        ratios: per inner tensor with entries per element, its entries per element and dtype.
        shared: the inner tensors every value holds whole (its code book).
    """

    cls: type
    attributes: tuple[Any, ...]
    ratios: dict[str, tuple[Fraction, torch.dtype]]
    shared: dict[str, Tensor]

    def build(self, parts: dict[str, Tensor], shape: tuple[int, ...]) -> Tensor:
        """A value of ``shape`` from flat per-element ``parts``; a part of one entry per element
        takes the shape (codes of an 8-bit value have the tensor's shape)."""
        numel = int(torch.Size(shape).numel())
        inner = {name: part.view(shape) if part.numel() == numel else part for name, part in parts.items()}
        inner.update((name, tensor.clone()) for name, tensor in self.shared.items())
        attributes = [torch.Size(shape) if _is_shape(a) else a for a in self.attributes]
        return self.cls.__tensor_unflatten__(inner, attributes, torch.Size(shape), None)


def format_of(value: Tensor, shared_names: tuple[str, ...]) -> QuantizedFormat:
    """The format of a quantized ``value``; ``shared_names`` are its inner tensors held whole."""
    names, attributes = value.__tensor_flatten__()
    numel = value.numel()
    ratios = {
        name: (Fraction(getattr(value, name).numel(), numel), getattr(value, name).dtype)
        for name in names
        if name not in shared_names
    }
    shared = {name: getattr(value, name).detach().clone() for name in names if name in shared_names}
    return QuantizedFormat(type(value), tuple(attributes), ratios, shared)


def flat_parts(value: Tensor, fmt: QuantizedFormat) -> dict[str, Tensor]:
    """The per-element inner tensors of ``value``, flat, in the tensor's order."""
    return {name: getattr(value, name).reshape(-1) for name in fmt.ratios}


def cut(value: Tensor, start: int, numel: int, shared_names: tuple[str, ...]) -> Tensor:
    """A copy of elements ``[start, start + numel)`` of a quantized ``value`` (in its flat order)
    as a quantized 1-D value; ``start`` and ``numel`` lie on its block edges."""
    fmt = format_of(value, shared_names)
    parts = {}
    for name, flat in flat_parts(value, fmt).items():
        ratio = fmt.ratios[name][0]
        first, count = start * ratio, numel * ratio
        if first.denominator != 1 or count.denominator != 1:
            raise ValueError(
                f"quantized state: elements [{start}, {start + numel}) do not fall on whole entries of "
                f"{fmt.cls.__name__}.{name}; cut on its blocks"
            )
        parts[name] = flat[int(first) : int(first + count)].clone()
    return fmt.build(parts, (numel,))


def _is_shape(value: Any) -> bool:
    if isinstance(value, torch.Size):
        return True
    return isinstance(value, (tuple, list)) and all(type(v) is int for v in value)
