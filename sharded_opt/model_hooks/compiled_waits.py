"""Waits for ``step()``'s all-gathers as ops of a compiled forward's graph.

Note [torch.compile]
    In eager mode a module waits for its buckets' all-gathers in a forward pre-hook, and the
    read guard waits before any other read of a param still being gathered (Note [No stale
    params], Note [Reads right after step] in ``read_guard``). Inside a compiled forward a
    Python wait (``Work.wait()``) is a graph break, and an error with ``fullgraph=True``. So
    there the wait is an op of the graph: where Dynamo traces the first read of a laid-out param
    in a graph (a module's pre-hook for the module's own params; the read guard, which Dynamo
    traces like any torch function mode, for every other torch function given a param), it
    inserts ``sharded_opt::wait_for_param(param, param, after, waiter, bucket)`` before the
    read.

    The op waits for the bucket's all-gather if it is still pending and is declared to mutate
    ``param``. After functionalization every later read of the param in the graph takes the
    op's result, so neither AOTAutograd nor Inductor can move a read before its wait, and
    Inductor runs the op in place on the param (no copy: checked in its generated code). A
    backend that does not (``aot_eager``) hands the op a copy of the param taken before the
    wait and copies the op's result back after the graph; so the op also takes the param
    unmutated (``gathered``, the graph's input itself) and copies the gathered values into a
    copy it was given. A compiled forward thus waits per param where the eager one waits per
    module, and keeps the all-gather's overlap with the forward. Only the first read of a param
    in a graph gets the op: a second mutation of a param autograd saved for backward (a tied
    weight read again by the head) would fail autograd's version check. AOTAutograd may bump
    the version counter of a param the graph mutates before the op runs, so the waits of a
    graph do not check for writes during the all-gather (Note [Writes while params are
    gathered] holds for eager forwards and reads outside the graph).

Note [Waits after their inputs]
    The op also takes the input of the module (or the other tensor arguments of the call) whose
    read of the param it precedes, and ignores it: the dependency keeps Inductor from running
    the wait before that input exists. Without it Inductor fused each block's residual add with
    the next block's layer norm into one kernel, which needs the layer norm's weight, so the
    next block's all-gather was waited for before the current block's last kernels ran: on the
    comm-bound preset a compiled overlap hid much less of the communication than eager
    (``benchmarks/results/2026-12-05-compiled-waits-cpu-2core.md``). With the input an argument
    of the wait, the add must finish before the wait and the layer norm start after it, so the
    two stay separate kernels and each wait sits where the eager pre-hook waits.

    Three lookups are module-level because a graph carries only ints and tensors: the op finds
    its waiter by token in a weak dictionary (as torch's functional collectives find their
    process group by name); "first read in this graph" is decided at trace time by a function
    Dynamo evaluates as a constant, keyed weakly on the tracing context Dynamo makes for each
    tracing attempt (a restarted trace starts afresh); and the params waited for before a
    higher-order op are reached from a module global (reached through the mode, Dynamo 2.13's
    guards fail with a NameError). The waiter's finalizer drops its params there; nothing else
    keeps a wrapper or a graph alive.

    Dynamo also compiles a torch function mode's handler as a frame of its own where eager code
    inside a compiled call (after a graph break) calls a torch function: one recompile per
    argument kind, and on torch 2.13 a TypeError from slicing once the recompile limit is hit
    (a do-nothing mode is enough). The read guard's handler is therefore never compiled as a
    frame (``inline_only``); where Dynamo traces a forward it is still traced inline.

    With a torch older than ``TRACED_WAITS_SINCE`` (not checked there) the hooks trace to
    nothing instead, and once a forward ran compiled ``step()`` waits for its all-gathers before
    it returns: correct, without the overlap.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.torch_version import TorchVersion

TRACED_WAITS_SINCE = (2, 13)
"""The first torch whose Dynamo, AOTAutograd and Inductor were checked to keep the op's order."""

TRACED_WAITS = TorchVersion(torch.__version__) >= TRACED_WAITS_SINCE


class BucketWaiter(Protocol):
    def wait_in_graph(self, bucket_index: int) -> None:
        """Wait for the bucket's all-gather if it is still pending."""


_WAITERS: weakref.WeakValueDictionary[int, BucketWaiter] = weakref.WeakValueDictionary()
_PARAMS: dict[int, list[Tensor]] = {}
"""Each waiter's laid-out params, where Dynamo can reach them (Note [torch.compile])."""
_TOKENS = itertools.count()
_FIRST_READS: weakref.WeakKeyDictionary[object, set[tuple[int, int]]] = weakref.WeakKeyDictionary()


@torch.library.custom_op("sharded_opt::wait_for_param", mutates_args=("param",))
def _wait_for_param(param: Tensor, gathered: Tensor, after: Tensor | None, waiter: int, bucket: int) -> None:
    found = _WAITERS.get(waiter)
    if found is not None:
        found.wait_in_graph(bucket)
    if param.data_ptr() != gathered.data_ptr():
        # A backend that did not run the op in place handed it a copy of the param taken
        # before the wait, see Note [torch.compile].
        param.copy_(gathered)


@_wait_for_param.register_fake
def _(param: Tensor, gathered: Tensor, after: Tensor | None, waiter: int, bucket: int) -> None:
    return None


WAIT_OP = torch.ops.sharded_opt.wait_for_param.default
"""The op, as the read guard sees it where a graph runs in Python (it lets it pass)."""


@torch.compiler.assume_constant_result
def _first_read_in_graph(waiter: int, param_index: int) -> bool:
    """Called by Dynamo while it traces, never at run time (see Note [torch.compile])."""
    context = torch._guards.TracingContext.try_get()
    if context is None:  # not under Dynamo: every call is a first read
        return True
    seen = _FIRST_READS.setdefault(context, set())
    first = (waiter, param_index) not in seen
    seen.add((waiter, param_index))
    return first


def inline_only(function: Callable[..., object]) -> None:
    """Dynamo traces ``function`` where a traced frame calls it but never compiles a frame of
    its own for it, see Note [torch.compile]."""
    if TRACED_WAITS:
        torch._dynamo.eval_frame.skip_code(function.__code__)


class GraphWaits:
    """Inserts the wait op before the first read of each laid-out param in the graph Dynamo is
    tracing, see Note [torch.compile].

    Args:
        waiter: waits for a bucket's all-gather when the op runs; held weakly.
        params: every laid-out param.
        slot_of_param: ``id(param)`` -> (param index, bucket index) for each of ``params``.
    """

    def __init__(
        self, waiter: BucketWaiter, params: list[Tensor], slot_of_param: dict[int, tuple[int, int]]
    ) -> None:
        self._token = next(_TOKENS)
        _WAITERS[self._token] = waiter
        _PARAMS[self._token] = params
        weakref.finalize(waiter, _PARAMS.pop, self._token, None)
        self._slot_of_param = slot_of_param

    def before_body(self) -> None:
        """Trace the waits of every param not read yet in the graph: a higher-order op's body
        follows, which Dynamo traces without torch function modes (Note [torch.compile])."""
        self.before_reads(_PARAMS[self._token])

    def before_reads(self, tensors: Iterable[object], inputs: Iterable[object] = ()) -> None:
        """Trace the waits of the params among ``tensors`` whose first read this is, each after
        the first tensor among ``inputs`` that is not a param (the module's input, the other
        arguments of the call), see Note [Waits after their inputs]."""
        after = next((t for t in inputs if isinstance(t, Tensor) and not _is_param(t)), None)
        for tensor in tensors:
            # ``id()`` of a traced tensor is guarded on: only on params (stable objects), never
            # on inputs or activations, which would recompile every step.
            if not _is_param(tensor):
                continue
            slot = self._slot_of_param.get(id(tensor))
            if slot is not None and _first_read_in_graph(self._token, slot[0]):
                with torch.no_grad():
                    torch.ops.sharded_opt.wait_for_param(tensor, tensor, after, self._token, slot[1])


def _is_param(tensor: object) -> bool:
    return isinstance(tensor, nn.Parameter) or (
        isinstance(tensor, Tensor) and tensor.is_leaf and tensor.requires_grad
    )
