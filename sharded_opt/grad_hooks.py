"""Overlap of grad reduction with backward: launch each bucket's reduction when it is ready.

Note [Launching reductions during backward]
    A post-accumulate-grad hook on every param counts the grads that landed in each bucket. When
    a bucket's count reaches its number of params, it is ready. Collectives must be issued in the
    same order on every rank (a mismatch deadlocks NCCL and mixes data under gloo), and ranks can
    see buckets complete in different orders, so buckets are launched strictly in bucket order:
    a ready bucket waits until every earlier bucket has been launched.

    A param that gets no grad in an iteration (an unused branch, possibly only on some ranks)
    would keep its bucket from ever being ready. So the first hook of a backward queues an
    end-of-backward callback that launches every bucket still pending, in order, treating the
    missing grads as zeros. A leaf used twice in forward (tied weights) has its contributions
    summed by autograd before its single accumulation, so its hook fires once per backward.

    The hook body is kept tiny (a counter and an identity check) because it runs once per param
    per backward; all real work happens once per bucket.

Note [End of backward under reentrant checkpointing]
    ``queue_callback`` queues on the backward that is running when it is called. With
    ``torch.utils.checkpoint(..., use_reentrant=True)`` a checkpointed segment's grads are
    computed by a nested backward inside the outer one, so a callback queued by a grad of that
    segment runs when the segment's backward ends, long before the outer backward does;
    flushing there would launch every bucket and the outer backward's later grads would look
    like a second backward. While a nested backward ends, autograd still reports the outer
    backward's node (the checkpoint's backward) as the one executing
    (``torch._C._current_autograd_node()``; None at the end of the outermost backward). So at
    the end of a nested backward the callback hooks that node instead, and the hook, which runs
    in the enclosing backward once the node is done, queues the callback again there. Nesting
    of any depth unwinds one level at a time, and the flush happens once, at the very end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from fusion.buffers import FlatBuffers
from sharded_opt.weak_hooks import WeakMethodHook, remove_handles


class GradReadyTracker:
    """Counts accumulated grads per bucket and launches bucket reductions in bucket order.

    Args:
        buffers: the flat buffers whose params get hooks.
        start_grad_sync: issues one bucket's reduction; called once per bucket per iteration.
    """

    def __init__(self, buffers: FlatBuffers, start_grad_sync: Callable[[int], None]) -> None:
        self._buffers = buffers
        self._start_grad_sync = start_grad_sync
        self._buckets = buffers.plan.buckets
        self._expected = [len(bucket.slots) for bucket in self._buckets]
        self.accumulate_only = False
        """True inside ``no_sync()``: grads accumulate in the buffers and nothing is launched."""
        # Where each param's data lives while this tracker owns it; a param that moved on (into
        # another wrapper's buffers) is no longer this tracker's business.
        self._data_ptrs = [None if view is None else view.data_ptr() for view in buffers.param_views]
        self.handles: list[RemovableHandle] = []
        """The hooks this tracker installed; see Note [Hook lifetimes and copies]."""
        for bucket in self._buckets:
            for slot in bucket.slots:
                hook = WeakMethodHook(self._on_grad_accumulated, slot.param_index, bucket.index)
                param = buffers.params[slot.param_index]
                self.handles.append(param.register_post_accumulate_grad_hook(hook))
        self._iteration = 0
        self.reset()

    def reset(self) -> None:
        """Start a new iteration: no grad counted, no bucket launched."""
        self._counts = [0] * len(self._buckets)
        self._counted = bytearray(len(self._buffers.params))
        self._next_to_launch = 0
        self._callback_queued = False
        self._flushed_at_end = False
        self._iteration += 1

    @property
    def backward_unfinished(self) -> bool:
        """A backward counted grads but never reached its end (it raised midway)."""
        return self._callback_queued and not self._flushed_at_end

    def _flush_at_end_of_backward(self) -> None:
        enclosing = torch._C._current_autograd_node()
        if enclosing is not None:
            # See Note [End of backward under reentrant checkpointing].
            enclosing.register_hook(WeakMethodHook(self._requeue_in_enclosing_backward, self._iteration))
            return
        self._flushed_at_end = True
        self.flush()

    def _requeue_in_enclosing_backward(
        self, iteration: int, grad_inputs: object, grad_outputs: object
    ) -> None:
        # A retained graph runs this node hook again in later backwards; only the first counts.
        if iteration == self._iteration and not self._flushed_at_end:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_at_end_of_backward)

    def remove_hooks(self) -> None:
        remove_handles(self.handles)

    def _on_grad_accumulated(self, param_index: int, bucket_index: int, param: Tensor) -> None:
        if param.data_ptr() != self._data_ptrs[param_index]:
            return
        self._buffers.adopt_grad(param_index)
        if self.accumulate_only:
            return
        if self._counted[param_index] or bucket_index < self._next_to_launch:
            raise RuntimeError(
                "ShardingStage1(overlap=True): a second backward ran before step(), after the "
                "grads of this iteration were already reduced; they would be lost. Run all but the "
                "last micro-batch's backward inside `with opt.no_sync():` for gradient accumulation"
            )
        self._counted[param_index] = 1
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_at_end_of_backward)
        self._counts[bucket_index] += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while (
            self._next_to_launch < len(self._buckets)
            and self._counts[self._next_to_launch] == self._expected[self._next_to_launch]
        ):
            self._start_grad_sync(self._next_to_launch)
            self._next_to_launch += 1

    def flush(self) -> None:
        """Launch every bucket not launched yet, in order, with missing grads as zeros."""
        if self.accumulate_only:
            return
        for bucket in self._buckets[self._next_to_launch :]:
            for slot in bucket.slots:
                if not self._counted[slot.param_index]:
                    self._buffers.adopt_grad(slot.param_index)
            self._start_grad_sync(bucket.index)
        self._next_to_launch = len(self._buckets)
