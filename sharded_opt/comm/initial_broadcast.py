"""The broadcasts that make every rank start from the first rank's values.

Each rank builds the model and optimizer on its own, and nothing makes their values equal: an
unseeded init, or weights loaded on one rank only, leaves them apart. The first ``step()`` would
then average grads taken at different weights, and frozen params and buffers, which no
all-gather covers, would stay apart for good. So, as DDP's constructor does, every rank takes the
group's first rank's values once: the optimizer's params at construction, the rest of an
attached model (its other params and its buffers) when it is attached; from then on
``step()``'s all-gathers keep the trained params equal.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from fusion.buffers import FlatBuffers
from sharded_opt.comm import collectives


def first_rank(group: ProcessGroup) -> int:
    """The global rank of the group's first rank, the source of every broadcast."""
    return dist.get_global_rank(group, 0)


def broadcast_from_first_rank(buffers: FlatBuffers, group: ProcessGroup, world_size: int) -> None:
    """Make every rank's flat param buffers the first rank's (collective)."""
    if world_size == 1:
        return
    for buffer in buffers.param_buffers:
        dist.broadcast(buffer, src=first_rank(group), group=group)


def broadcast_model_state(
    model: nn.Module, buffers: FlatBuffers, group: ProcessGroup, world_size: int
) -> None:
    """Broadcast what the flat buffers did not cover: frozen params, params the optimizer
    does not hold, and buffers."""
    if world_size == 1:
        return
    laid_out = {id(buffers.params[index]) for index in buffers.laid_out_indices}
    tensors = [p for p in model.parameters() if id(p) not in laid_out] + list(model.buffers())
    if tensors:
        collectives.broadcast_coalesced(tensors, group, first_rank(group))
