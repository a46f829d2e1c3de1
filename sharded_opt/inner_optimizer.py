"""The inner optimizer: the user's optimizer class, rebuilt over this rank's flat local tensors."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from fusion.layout import LayoutPlan


def constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW's defaults, for one, carry
    ``decoupled_weight_decay``, which its constructor does not take)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


def build_inner_optimizer(
    optimizer: torch.optim.Optimizer, plan: LayoutPlan, local_params: list[Tensor]
) -> torch.optim.Optimizer:
    """A new optimizer of the same class with one group per user group (same hyperparameters)
    holding the local tensors of that group's buckets."""
    groups = []
    for group_index, group in enumerate(optimizer.param_groups):
        local = [local_params[b.index] for b in plan.buckets if b.group_index == group_index]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": local})
    return type(optimizer)(groups, **constructor_kwargs(optimizer))
