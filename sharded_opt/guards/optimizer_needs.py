"""What an optimizer class needs from the layout: any flat slice of a param, or whole params.

ShardingStage1 knows torch's own classes. Any other class declares its needs with a class
attribute, so a third-party optimizer opts in without a special case here::

    class MyShampoo(torch.optim.Optimizer):
        sharded_opt_needs = OptimizerNeeds(whole_params=True, param_cost=math.prod)

A subclass inherits the attribute; a class without it that is not one of torch's (a subclass of
``AdamW`` included: its ``step`` may do anything) is refused unless the caller passes
``assume_elementwise=True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from fusion.block_layout import BlockGrid
from sharded_opt.guards import bitsandbytes_settings as bnb
from sharded_opt.guards import torchao_state

NEEDS_ATTRIBUTE = "sharded_opt_needs"
"""The class attribute through which an optimizer class declares its :class:`OptimizerNeeds`."""


def numel_cost(shape: tuple[int, ...]) -> int:
    """Work to step a param that is linear in its numel (Adafactor, any element-wise class)."""
    return math.prod(shape)


def newton_schulz_cost(shape: tuple[int, ...]) -> int:
    """Muon's work per matrix of shape ``(m, n)``: each Newton-Schulz iteration multiplies the
    ``min(m, n)``-square Gram matrix with the ``m x n`` one, ``m * n * min(m, n)`` multiply-adds."""
    if len(shape) < 2:
        return math.prod(shape)
    rows, cols = shape[0], math.prod(shape[1:])
    return rows * cols * min(rows, cols)


FreshState = Callable[[torch.optim.Optimizer, dict[str, Any], torch.Tensor, bool], dict[str, Any]]
"""``(optimizer, param group, tensor, quantized)`` to the state the class creates for ``tensor``
at its first step, had it decided to quantize it (``quantized``) or not."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyedQuantizedState:
    """Quantized state kept as plain tensors under keys of the param's state (bitsandbytes:
    codes ``state1``/``state2`` of the param's shape, scales ``absmax1``/``absmax2``, code books
    ``qmap1``/``qmap2``) rather than as one tensor subclass per moment (torchao). Codes are
    element-wise and code books the same for every piece; only the scales need telling apart."""

    per_block_keys: tuple[str, ...]
    """Keys holding one value per block of the tensor, the last block possibly partial."""
    saved_under: str | None = None
    """The key under which the class's ``state_dict()`` nests ``saved_keys`` of each param's
    state (bitsandbytes' ``__bnb_optimizer_quant_state__``, which its ``load_state_dict``
    unnests); None: saved as kept."""
    saved_keys: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantizedBlocks:
    """How a class quantizes its state: per state tensor, codes and one scale per block of
    ``block_size`` elements counted from the tensor's start, for tensors of at least
    ``min_numel`` elements holding whole blocks, or any last block with ``partial_last_block``
    (plain state otherwise). The wrapper then cuts params only on block edges that keep every
    piece's decision, see Note [Cuts on quantization blocks] in ``fusion/block_layout.py``."""

    block_size: int | Callable[[torch.optim.Optimizer], int]
    """The class's fixed block size (bitsandbytes: 256), or how to read an instance's off it
    (torchao keeps it in ``optimizer.block_size``, a constructor argument)."""
    min_numel: int | Callable[[torch.optim.Optimizer], int] = 4096
    """The smallest tensor the class quantizes (torchao: 4096), or how to read it off an instance
    (bitsandbytes' ``min_8bit_size``, a constructor argument)."""
    partial_last_block: bool = False
    """Whether a tensor of ``min_numel`` or more is quantized whatever its last block
    (bitsandbytes) rather than only when it holds whole blocks (torchao)."""
    shared_parts: tuple[str, ...] = ("qmap",)
    """Inner tensors of a quantized value (``__tensor_flatten__``) that every piece holds whole,
    such as a lookup table of codes; every other inner tensor holds a fixed number of entries
    per element (codes) or per block (scales), in the tensor's order."""
    keyed: KeyedQuantizedState | None = None
    """Set for a class that keeps its quantized state as plain tensors under keys."""
    fresh_state: FreshState | None = None
    """How the class builds a tensor's state before its first step, quantized or plain. Set, the
    wrapper gives a piece whose own size would make the class decide otherwise its param's
    kind of state, and params are cut on any block edge (Note [Cuts on quantization blocks]);
    None: pieces are cut only where their size keeps the decision."""

    def grid(self, optimizer: torch.optim.Optimizer) -> BlockGrid:
        min_numel = self.min_numel if isinstance(self.min_numel, int) else self.min_numel(optimizer)
        block_size = self.block_size if isinstance(self.block_size, int) else self.block_size(optimizer)
        return BlockGrid(block_size, min_numel, self.partial_last_block, self.fresh_state is not None)


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerNeeds:
    """How ShardingStage1 may cut the params of an optimizer class.

    The memory per rank is about 1/N of the class's state either way; only where the cuts fall
    differs, see Note [Whole params per owner] in ``fusion/layout.py``.
    """

    whole_params: bool
    """False: each element's update depends only on its own grad and state (SGD, AdamW), so a
    rank may step any flat slice of a param. True: the update of a param depends on the whole
    param (Muon's orthogonalization, Adafactor's row and column factors), so each param is
    stepped whole, in its own shape, by one owning rank."""
    param_cost: Callable[[tuple[int, ...]], int] = field(default=numel_cost)
    """Work to step one param of a shape; owners of whole params are balanced by it."""
    state_per_param: bool = False
    """Every piece of the class's state belongs to one param (no per-``step()`` counters), so
    several ``step()`` calls over disjoint params compute what one call over all of them does,
    and each bucket is stepped as soon as its reduction lands (Note [Step pipeline] in
    ``optimizer``). False: one ``step()`` over every bucket after every reduction."""
    quantized_blocks: QuantizedBlocks | None = None
    """Set for an element-wise class whose state is quantized block by block (torchao's
    ``AdamW8bit``): pieces are cut on its blocks. Not with ``whole_params``."""
    settings: Callable[[torch.optim.Optimizer], dict[str, Any]] | None = None
    """Constructor arguments an instance keeps outside ``defaults`` (bitsandbytes' ``args``),
    passed to every copy of the class the wrapper builds, so that it steps as the instance."""
    check: Callable[[torch.optim.Optimizer], None] | None = None
    """Raises ``ValueError`` for an instance configured in a way the wrapper cannot shard
    exactly (bitsandbytes' per-param overrides), before anything is built."""

    def __post_init__(self) -> None:
        if self.whole_params and self.quantized_blocks is not None:
            raise ValueError(
                "OptimizerNeeds expects whole_params=True or quantized_blocks, not both: a whole "
                "param is never cut, so its blocks need no declaration; drop quantized_blocks"
            )


ELEMENTWISE = OptimizerNeeds(whole_params=False, state_per_param=True)
"""torch's element-wise classes (their state is per param, ``step`` included)."""

MUON = OptimizerNeeds(whole_params=True, param_cost=newton_schulz_cost, state_per_param=True)
ADAFACTOR = OptimizerNeeds(whole_params=True, param_cost=numel_cost, state_per_param=True)
TORCHAO_LOW_BIT = OptimizerNeeds(
    whole_params=False,
    state_per_param=True,
    quantized_blocks=QuantizedBlocks(
        block_size=lambda optimizer: optimizer.block_size, fresh_state=torchao_state.fresh_state
    ),
)
"""torchao's 8-bit, 4-bit and fp8 Adam(W): element-wise math, state quantized per block, all of
it per param (``step`` included)."""
BITSANDBYTES_8BIT = OptimizerNeeds(
    whole_params=False,
    state_per_param=True,
    quantized_blocks=QuantizedBlocks(
        block_size=bnb.BLOCK_NUMEL,
        min_numel=bnb.min_8bit_size,
        partial_last_block=True,
        keyed=KeyedQuantizedState(
            per_block_keys=bnb.PER_BLOCK_KEYS, saved_under=bnb.SAVED_UNDER, saved_keys=bnb.SAVED_KEYS
        ),
    ),
    settings=bnb.constructor_settings,
    check=bnb.check_shardable,
)
"""bitsandbytes' ``AdamW8bit`` and ``Adam8bit``: element-wise math, state quantized per block
of 256 (the last one possibly partial), all of it per param (``step`` an int)."""
ASSUMED_ELEMENTWISE = OptimizerNeeds(whole_params=False)
"""A class taken on the caller's word (``assume_elementwise=True``): it may keep state per
``step()`` call, so it is stepped once per ``step()``."""

ELEMENTWISE_CLASSES = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
)  # fmt: skip
WHOLE_PARAM_NEEDS_BY_NAME = {"Muon": MUON, "Adafactor": ADAFACTOR}
"""torch's whole-param classes, by name: both are newer than the element-wise ones (Muon ships
from torch 2.9), and a torch without one has no entry for it, so ``import sharded_opt`` works
there too."""


THIRD_PARTY_NEEDS_BY_PATH = {
    **{
        f"torchao.optim.adam.{name}": TORCHAO_LOW_BIT
        for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8", "Adam8bit", "Adam4bit", "AdamFp8")
    },
    "bitsandbytes.optim.adamw.AdamW8bit": BITSANDBYTES_8BIT,
    "bitsandbytes.optim.adam.Adam8bit": BITSANDBYTES_8BIT,
}
"""Classes of optional packages, by module and name: known without importing the package (an
import of torchao costs seconds), and by exact type, as torch's."""


def torch_optimizers(optim: object = torch.optim) -> Mapping[type[torch.optim.Optimizer], OptimizerNeeds]:
    """torch's classes with their needs; of the whole-param ones, those ``optim`` (the installed
    ``torch.optim``) has."""
    needs = dict.fromkeys(ELEMENTWISE_CLASSES, ELEMENTWISE)
    for name, whole in WHOLE_PARAM_NEEDS_BY_NAME.items():
        if hasattr(optim, name):
            needs[getattr(optim, name)] = whole
    return MappingProxyType(needs)


TORCH_OPTIMIZERS = torch_optimizers()
"""torch's classes, by exact type (a subclass may change ``step``)."""


def block_grid_of(optimizer: torch.optim.Optimizer) -> BlockGrid | None:
    """How the optimizer quantizes its state, by its class's declared needs; None: plain state."""
    needs = declared_needs(type(optimizer))
    return None if needs is None or needs.quantized_blocks is None else needs.quantized_blocks.grid(optimizer)


def declared_needs(optimizer_class: type) -> OptimizerNeeds | None:
    """The class's declared needs, torch's known ones, or None.

    Raises:
        TypeError: the class attribute is not an :class:`OptimizerNeeds`.
    """
    declared = getattr(optimizer_class, NEEDS_ATTRIBUTE, None)
    if declared is None:
        path = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
        return TORCH_OPTIMIZERS.get(optimizer_class, THIRD_PARTY_NEEDS_BY_PATH.get(path))
    if not isinstance(declared, OptimizerNeeds):
        raise TypeError(
            f"ShardingStage1 expects {optimizer_class.__name__}.{NEEDS_ATTRIBUTE} to be a "
            f"sharded_opt.OptimizerNeeds but got {type(declared).__name__}"
        )
    return declared
