"""The torch function mode that makes every read of a param still being gathered wait for its
bucket's all-gather first, from the end of ``step()`` until the next forward has waited for all
of them; under ``torch.compile`` it puts the waits into the graph instead.

Note [Reads right after step]
    Users read and write params right after ``step()``: an EMA update (timm's ``ModelEmaV3``,
    ``AveragedModel.update_parameters``), logging weight norms, ``param.copy_(best)``. Plain
    torch and DDP have the new values there; here the all-gather may still be writing them,
    so such a read silently mixes old and new weights (a hand EMA differed from plain torch by
    2e-2 after four steps). Inside a forward the per-module waits cover a module's own params
    but not a parent that reads a child's weight before the child runs (a weight-norm or
    regularization term computed up front, a tied weight used functionally), nor params of a
    module the forward skipped. So from the end of ``step()`` until every all-gather has been
    waited for, a ``TorchFunctionMode`` watches every torch function: one given a tensor that
    lives in a param buffer still being gathered (the param itself, ``.data``, a view) first
    waits for that bucket's all-gather, and only that one, so the forward keeps overlapping
    the later buckets' all-gathers. Where Dynamo traces it, it puts the wait into the graph
    instead (Note [torch.compile] in ``compiled_waits``). When the last pending bucket is
    waited for, by a module's pre-hook or by the mode itself, the mode stops watching and leaves the stack (a
    mode cannot leave the stack from inside its own handler, where torch has taken it off; it
    then leaves at the next wait). The end of the model's forward waits for whatever is still
    pending (buckets of modules the forward skipped, gathered long before), so the mode never
    stays into backward, where the grad hooks' every tensor access would pass through it. Each
    watched call costs a Python call of the mode's handler, only while all-gathers are pending,
    i.e. between ``step()`` and the end of the next forward (measured in
    ``benchmarks/results/2026-12-03-flags-once-cpu-2core.md``, the read guard's cost).

    torch's own modules that hand their children's params to one op without calling the
    children (``nn.MultiheadAttention``'s ``out_proj``, the transformer layers' fast path in
    evaluation) take that fast path only while no torch function mode is active, so plain torch
    and the wrapper would compute differently there. They wait for their whole subtree when
    they start and set the mode aside until they end (an encoder-decoder trained 1e-4 off
    plain torch when ``out_proj`` was read stale).

    The mode goes to the bottom of the mode stack, not the top: a ``with`` block of another
    mode (``with torch.device(...):``) around ``step()`` then pops its own mode when it ends,
    not this one, and modes above pass every call down to it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from sharded_opt.model_hooks.compiled_waits import WAIT_OP, GraphWaits, inline_only

_METADATA_GETTERS = (
    "grad", "requires_grad", "_version", "shape", "dtype", "device", "layout", "is_leaf", "ndim",
)  # fmt: skip
_METADATA_METHODS = (
    "size", "dim", "numel", "stride", "storage_offset", "element_size", "is_contiguous", "data_ptr",
    "untyped_storage", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
)  # fmt: skip
_METADATA_FUNCTIONS = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in _METADATA_GETTERS]
    + [getattr(torch.Tensor, name) for name in _METADATA_METHODS]
    + [torch.Tensor.grad.__set__, torch.Tensor.requires_grad.__set__]
)
"""Torch functions that read or set a param's metadata, never its values: ``zero_grad()``,
freezing, or a grad hook right after ``step()`` need not wait for the all-gathers."""


def _function_modes() -> list[TorchFunctionMode]:
    """The torch function mode stack of this thread, bottom first."""
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _set_function_modes(modes: list[TorchFunctionMode]) -> None:
    for _ in range(torch._C._len_torch_function_stack()):
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


class ReadGuard(TorchFunctionMode):
    """Before a torch function that touches a param buffer still being gathered, waits for that
    bucket's all-gather (where Dynamo traces it: puts the wait into the graph), see Note [Reads
    right after step]. ``remove()`` makes it a handle of its waiter."""

    def __init__(
        self,
        param_buffers: list[torch.Tensor],
        finish: Callable[[Iterable[int] | None], None],
        graph_waits: GraphWaits | None,
    ) -> None:
        super().__init__()
        self._graph_waits = graph_waits
        self._bucket_of_storage = {
            buffer.untyped_storage().data_ptr(): index for index, buffer in enumerate(param_buffers)
        }
        self._finish = weakref.WeakMethod(finish)
        self._pending: frozenset[int] = frozenset()
        self._handling = 0
        """Depth of this mode's own handler (torch takes the mode off the stack while it runs,
        including the function it calls: a module called inside a checkpointed function)."""
        self._aside = 0
        """How many modules of ``param_hooks._READS_CHILDRENS_PARAMS`` are running (the mode is
        off then)."""

    def start(self, pending: frozenset[int]) -> None:
        """``step()`` issued all-gathers: watch them (no module is running now)."""
        self._aside = 0
        self.watch(pending)

    def set_aside(self, aside: bool) -> None:
        """Leave the stack while a module of ``param_hooks._READS_CHILDRENS_PARAMS`` runs (its
        subtree is current), so its fast path sees no torch function mode; come back after it."""
        self._aside = self._aside + 1 if aside else max(0, self._aside - 1)
        self.watch(self._pending)

    def watch(self, pending: frozenset[int]) -> None:
        """Watch reads of the buckets in ``pending`` (their all-gathers are running); with none,
        stop and leave the mode stack. Inside this mode's own handler torch has taken it off
        the stack and puts it back afterwards, so the stack is left alone there (a later call
        outside it removes it)."""
        self._pending = pending
        if self._handling:
            return
        modes = _function_modes()
        on_stack = any(mode is self for mode in modes)
        wanted = bool(pending) and not self._aside
        if wanted and not on_stack:
            _set_function_modes([self, *modes])
        elif not wanted and on_stack:
            _set_function_modes([mode for mode in modes if mode is not self])

    def remove(self) -> None:
        self.watch(frozenset())

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if self._graph_waits is not None and torch.compiler.is_compiling():
            # Dynamo traces this: the waits become ops of the graph (Note [torch.compile] in
            # ``compiled_waits``).
            if isinstance(func, torch._ops.HigherOrderOperator):
                self._graph_waits.before_body()
            elif func not in _METADATA_FUNCTIONS:
                tensors = _tensors_in((args, tuple(kwargs.values())), [])
                self._graph_waits.before_reads(tensors, tensors)
            return func(*args, **kwargs)
        self._handling += 1
        try:
            if (
                self._pending
                and not self._aside
                and func not in _METADATA_FUNCTIONS
                and not _is_wait(func, args)
            ):
                touched = self._pending_buckets_in(_tensors_in((args, tuple(kwargs.values())), []))
                finish = self._finish() if touched else None
                if finish is not None:
                    # Without traced waits a wait inside a compiled region is a graph break:
                    # wait for all at once.
                    finish(None if torch.compiler.is_compiling() else sorted(touched))
            return func(*args, **kwargs)
        finally:
            self._handling -= 1

    def _pending_buckets_in(self, tensors: list[torch.Tensor]) -> set[int]:
        touched: set[int] = set()
        for tensor in tensors:
            if tensor.layout != torch.strided:
                continue
            try:
                storage = tensor.untyped_storage().data_ptr()
            except NotImplementedError:  # a wrapper without storage (torch.func.vmap's)
                continue
            bucket = self._bucket_of_storage.get(storage)
            if bucket is not None and bucket in self._pending:
                touched.add(bucket)
        return touched


def _is_wait(func: Callable, args: tuple) -> bool:
    """``func`` is a compiled graph's wait op (run as is, or inside the functionalization op of
    a backend that runs graphs in Python): it waits by itself, see Note [torch.compile] in
    ``compiled_waits``."""
    return func is WAIT_OP or (len(args) > 0 and args[0] is WAIT_OP)


def _tensors_in(values: Iterable[object], found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors among ``values``, in nested lists and tuples too."""
    for value in values:
        if isinstance(value, (list, tuple)):
            _tensors_in(value, found)
        elif isinstance(value, torch.Tensor):
            found.append(value)
    return found


inline_only(ReadGuard.__torch_function__)
