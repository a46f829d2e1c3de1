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

from collections.abc import Iterable, Iterator
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
    return states_nbytes([state])


def states_nbytes(states: Iterable[dict[str, Any]]) -> int:
    """Bytes the tensors of ``states`` (of at least one dim) hold, a tensor that several values
    share counted once: a code book the pieces share (:class:`SharedCodeBooks`), bitsandbytes'
    ``qmap1``, one tensor for all params."""
    seen: set[tuple[int, int, int, torch.dtype]] = set()
    total = 0
    for state in states:
        for value in state.values():
            if not isinstance(value, Tensor) or value.dim() == 0:
                continue
            for tensor in _held_tensors(value):
                storage = tensor.untyped_storage().data_ptr()
                key = (storage, tensor.storage_offset(), tensor.numel(), tensor.dtype)
                if key not in seen:
                    seen.add(key)
                    total += tensor.numel() * tensor.element_size()
    return total


def _held_tensors(value: Tensor) -> Iterator[Tensor]:
    """The plain tensors that hold a state value's data: itself, or a quantized value's inner
    tensors."""
    if not is_quantized(value):
        yield value
        return
    names, _ = value.__tensor_flatten__()
    for name in names:
        yield from _held_tensors(getattr(value, name))


class SharedCodeBooks:
    """One tensor per rank for each distinct code book its quantized state values hold.

    Note [Shared code books]
        torchao gives every quantized value a code book of its own (``qmap``: 256 fp32 values
        for 8-bit, 1 KiB), the same table for every tensor of a kind (signed or not), which it
        only reads (its ``copy_`` leaves it alone: "qmap should be the same"). Sharded, a param
        cut in k pieces would hold k code books per moment where one process holds one, 2 KiB
        per cut for AdamW8bit, more than the blocks the cut costs. So after each step the
        pieces stepped point their code books at one tensor per distinct table on this rank;
        ``memory_bytes()`` counts a shared tensor once. State loaded from a state dict or a
        checkpoint comes with copies, shared again at its first step.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names
        self._by_content: dict[tuple[Any, ...], Tensor] = {}
        self._shared_ids: set[int] = set()

    def share(self, state: dict[str, Any]) -> None:
        """Point the code books of ``state``'s quantized values at this rank's copy of each."""
        for value in state.values():
            if not is_quantized(value):
                continue
            for name in self._names:
                book = getattr(value, name, None)
                if book is None or id(book) in self._shared_ids:
                    continue
                content = book.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
                key = (book.dtype, tuple(book.shape), book.device, content)
                shared = self._by_content.setdefault(key, book)
                self._shared_ids.add(id(shared))  # alive while ``_by_content`` holds it
                setattr(value, name, shared)


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
