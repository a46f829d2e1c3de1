"""``ParamSync``: the param side of the wrapper, from the all-gathers ``step()`` starts to the
waits that make every read see the updated params.

The all-gathers run in the communicator; with a model attached in overlap mode, the per-module
waits, the read guard and the check for writes during a gather run in ``ParamReadyWaiter``
(Note [No stale params] in ``param_hooks``). This class decides which of the two waits, and
when. It also holds the broadcasts that make every rank start from the first rank's params.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from fusion.buffers import FlatBuffers
from sharded_opt import collectives
from sharded_opt.bucket_comm import BucketCommunicator
from sharded_opt.param_hooks import ParamReadyWaiter
from sharded_opt.streams import on_stream


class ParamSync:
    """Starts the all-gathers of the buckets a step changed, in forward order, and waits for
    them: all of them before ``step()`` returns, or (overlap mode with a model attached) per
    module in the next forward.

    Args:
        comm: issues and finishes the all-gathers.
    """

    def __init__(self, comm: BucketCommunicator) -> None:
        self._comm = comm
        # Forward order is registration order (buckets are laid out in reverse), see
        # Note [No stale params].
        self._gather_order = list(reversed(range(len(comm.buffers.plan.buckets))))
        self.waiter: ParamReadyWaiter | None = None
        """The attached model's per-module waits (overlap mode); None: ``step()`` waits."""

    def start_param_sync(self, bucket_indices: list[int]) -> None:
        """Issue the all-gathers of ``bucket_indices`` in forward order, see Note [Step
        pipeline] in ``step_pipeline``."""
        self._comm.start_param_sync(b for b in self._gather_order if b in bucket_indices)

    def hand_over(self) -> None:
        """At the end of ``step()``: wait for the all-gathers now, or leave them to the next
        forward's per-module waits (not when that forward ran compiled, see Note
        [torch.compile] in ``param_hooks``)."""
        if self.waiter is None or self.waiter.forward_compiled:
            self._comm.finish_param_sync()
        else:
            self.waiter.gathers_started(self._comm.pending_param_buckets())

    def finish_param_sync(self) -> None:
        """Wait until every param holds its updated value; see ``ShardingStage1.sync_params``."""
        if self.waiter is None:
            self._comm.finish_param_sync()
        else:
            self.waiter.finish()

    def wait_for_params(self, stream: torch.Stream | None) -> None:
        """Make ``stream`` wait for every param; see ``ShardingStage1.wait_for_params``."""
        device = self._comm.buffers.plan.buckets[0].device
        if stream is not None and not isinstance(stream, torch.Stream):
            raise TypeError(
                f"ShardingStage1.wait_for_params expects stream to be a torch.Stream or None but got "
                f"{type(stream).__name__}; pass e.g. torch.cuda.current_stream()"
            )
        if stream is not None and stream.device != device:
            raise ValueError(
                f"ShardingStage1.wait_for_params expects a stream on the params' device {device} but "
                f"got one on {stream.device}; pass a stream of {device} or stream=None"
            )
        with on_stream(None if self._comm.stream is None else stream):
            self.finish_param_sync()


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
