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
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from fusion.buffers import FlatBuffers


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
        self._handles: list[RemovableHandle] = []
        for bucket in self._buckets:
            for slot in bucket.slots:
                hook = functools.partial(self._on_grad_accumulated, slot.param_index, bucket.index)
                param = buffers.params[slot.param_index]
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
        self.reset()

    def reset(self) -> None:
        """Start a new iteration: no grad counted, no bucket launched."""
        self._counts = [0] * len(self._buckets)
        self._counted = bytearray(len(self._buffers.params))
        self._next_to_launch = 0
        self._callback_queued = False
        self._flushed_at_end = False

    @property
    def backward_unfinished(self) -> bool:
        """A backward counted grads but never reached its end (it raised midway)."""
        return self._callback_queued and not self._flushed_at_end

    def _flush_at_end_of_backward(self) -> None:
        self._flushed_at_end = True
        self.flush()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_grad_accumulated(self, param_index: int, bucket_index: int, param: Tensor) -> None:
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
