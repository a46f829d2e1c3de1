"""Stateless wrappers over the torch.distributed collectives the wrapper uses.

torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to
``reduce_scatter_single``/``all_gather_single`` and warns on the old names; older releases only
have the old ones. These wrappers pick whichever exists so users see no warning on any version.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp, Work

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_avg(output: Tensor, input: Tensor, group: ProcessGroup, async_op: bool) -> Work | None:
    """Average ``input`` over the group; rank r receives the r-th equal slice in ``output``."""
    return _reduce_scatter(output, input, op=ReduceOp.AVG, group=group, async_op=async_op)


def all_reduce_avg(tensor: Tensor, group: ProcessGroup, async_op: bool) -> Work | None:
    """Average ``tensor`` in place over the group."""
    return dist.all_reduce(tensor, op=ReduceOp.AVG, group=group, async_op=async_op)


def all_gather(output: Tensor, input: Tensor, group: ProcessGroup, async_op: bool) -> Work | None:
    """Concatenate every rank's ``input`` into ``output``; ``input`` may be a view of ``output``
    at this rank's slice (an in-place all-gather, as FSDP2 uses)."""
    return _all_gather(output, input, group=group, async_op=async_op)
