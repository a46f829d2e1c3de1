"""``ParamSync``: the param side of the wrapper, from the all-gathers ``step()`` starts to the
waits that make every read see the updated params.

The all-gathers are the buckets' own (:class:`~sharded_opt.step.bucket.Bucket`); with a model
attached in overlap mode, the per-module waits, the read guard and the check for writes during a
gather run in ``ParamReadyWaiter`` (Note [No stale params] in ``param_hooks``). This class
decides which of the two waits, and when.
"""

from __future__ import annotations

import torch

from sharded_opt.comm.comm_context import CommContext
from sharded_opt.comm.streams import on_stream
from sharded_opt.model_hooks.param_hooks import ParamReadyWaiter
from sharded_opt.step.bucket import Bucket, start_param_syncs


class ParamSync:
    """Starts the all-gathers of the buckets a step changed, in forward order, and waits for
    them: all of them before ``step()`` returns, or (overlap mode with a model attached) per
    module in the next forward.

    Args:
        buckets: the wrapper's buckets, in bucket order.
        comm: what the buckets share (the comm stream).
    """

    def __init__(self, buckets: list[Bucket], comm: CommContext) -> None:
        self._buckets = buckets
        self._comm = comm
        # Forward order is registration order (buckets are laid out in reverse), see
        # Note [No stale params].
        self._gather_order = buckets[::-1]
        self._waiter: ParamReadyWaiter | None = None
        """The attached model's per-module waits (overlap mode); None: ``step()`` waits."""

    def wait_per_module(self, waiter: ParamReadyWaiter) -> None:
        """From now on leave the all-gathers to the attached model's per-module waits (a model
        attached in overlap mode), so that ``step()`` returns while they run."""
        self._waiter = waiter

    def start_param_sync(self, buckets: list[Bucket]) -> None:
        """Issue the all-gathers of ``buckets`` in forward order, see Note [Step pipeline] in
        ``step_pipeline``."""
        start_param_syncs([b for b in self._gather_order if b in buckets], self._comm)

    def pending_buckets(self) -> list[Bucket]:
        """Buckets whose updated params are still being all-gathered."""
        return [bucket for bucket in self._buckets if bucket.param_sync_pending]

    def finish_gathers(self) -> None:
        """Make the current stream (on CPU: the host) wait for every bucket's latest all-gather,
        without the attached model's check for writes during them (also what a dropped wrapper's
        finalizer runs)."""
        for bucket in self._buckets:
            bucket.finish_param_sync()

    def hand_over(self) -> None:
        """At the end of ``step()``: wait for the all-gathers now, or leave them to the next
        forward's per-module waits (not when that forward ran compiled, see Note
        [torch.compile] in ``param_hooks``)."""
        if self._waiter is None or self._waiter.forward_compiled:
            self.finish_gathers()
        else:
            self._waiter.gathers_started(self.pending_buckets())

    def finish_param_sync(self) -> None:
        """Wait until every param holds its updated value; see ``ShardingStage1.sync_params``."""
        if self._waiter is None:
            self.finish_gathers()
        else:
            self._waiter.finish()

    def wait_for_params(self, stream: torch.Stream | None) -> None:
        """Make ``stream`` wait for every param; see ``ShardingStage1.wait_for_params``."""
        device = self._buckets[0].plan.device
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
