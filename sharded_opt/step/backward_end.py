"""``BackwardEnd``: a callback at the end of the outermost backward, found through the nested
backwards of reentrant checkpointing (the grad hooks' end-of-backward flush, ``grad_hooks``).

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

from sharded_opt.model_hooks.weak_hooks import WeakMethodHook


class BackwardEnd:
    """Calls ``at_end`` once at the end of the outermost backward that is running when
    :meth:`queue` is called; see Note [End of backward under reentrant checkpointing].

    Args:
        at_end: called with no arguments when that backward ends.
    """

    def __init__(self, at_end: Callable[[], None]) -> None:
        self._at_end = at_end
        self._ended = 0
        """Outermost backwards ended so far; tells a retained graph's node hook it belongs to an
        old one."""

    def queue(self) -> None:
        """Call ``at_end`` when the running backward ends (once per backward: each call queues
        one more)."""
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        enclosing = torch._C._current_autograd_node()
        if enclosing is not None:
            # See Note [End of backward under reentrant checkpointing].
            enclosing.register_hook(WeakMethodHook(self._requeue_in_enclosing_backward, self._ended))
            return
        self._ended += 1
        self._at_end()

    def _requeue_in_enclosing_backward(self, ended: int, grad_inputs: object, grad_outputs: object) -> None:
        # A retained graph runs this node hook again in later backwards; only the first counts.
        if ended == self._ended:
            self.queue()
