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

import torch

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


ELEMENTWISE = OptimizerNeeds(whole_params=False, state_per_param=True)
"""torch's element-wise classes (their state is per param, ``step`` included)."""

MUON = OptimizerNeeds(whole_params=True, param_cost=newton_schulz_cost, state_per_param=True)
ADAFACTOR = OptimizerNeeds(whole_params=True, param_cost=numel_cost, state_per_param=True)
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


def declared_needs(optimizer_class: type) -> OptimizerNeeds | None:
    """The class's declared needs, torch's known ones, or None.

    Raises:
        TypeError: the class attribute is not an :class:`OptimizerNeeds`.
    """
    declared = getattr(optimizer_class, NEEDS_ATTRIBUTE, None)
    if declared is None:
        return TORCH_OPTIMIZERS.get(optimizer_class)
    if not isinstance(declared, OptimizerNeeds):
        raise TypeError(
            f"ShardingStage1 expects {optimizer_class.__name__}.{NEEDS_ATTRIBUTE} to be a "
            f"sharded_opt.OptimizerNeeds but got {type(declared).__name__}"
        )
    return declared
