"""Hooks on the attached model: per-module waits for the all-gathered params (so the next
forward overlaps the all-gather), the same waits before ``state_dict``/``load_state_dict``,
detection of writes into params that are still being gathered, and DDP's buffer broadcast.
Reads between ``step()`` and the modules' waits go through the read guard (``read_guard``).

Note [No stale params]
    After ``step()`` in overlap mode with a model attached, the updated params are still being
    all-gathered when ``step()`` returns. A forward pre-hook on every module that directly owns
    laid-out params waits for each bucket holding any of them, whatever the bucket order, so a
    module can never run on last step's weights even if its params were registered in a
    different order than forward uses them (the cause of stale weights in Megatron-LM #950). The
    all-gathers themselves are issued in one fixed order on every rank (registration order), as
    collectives must be. The wait is the first of a module's pre-hooks, so one registered
    before wrapping that computes from the params (the old hook-based
    ``torch.nn.utils.weight_norm``) reads final values. ``module.state_dict()`` and
    ``module.load_state_dict()`` wait the same way (a pre-hook on the same modules), so saving
    reads and loading writes final params.

    On an accelerator a wait makes the stream current in the hook wait (on an event recorded
    after the bucket's all-gather, see Note [Streams and events]), so a forward run on another
    stream than the last one waits too; each stream waits once per all-gather.

    The contract: every param is current when anything reads it through torch: a module's own
    params when its forward starts, and any other read (code between ``step()`` and the next
    forward, a parent reading a child's weight before the child ran, a loss term over all
    params after forward) through the read guard of Note [Reads right after step] in
    ``read_guard``. Only reads torch functions cannot see (another thread,
    ``torch._C.DisableTorchFunction()``, a CUDA graph replay) need
    ``ShardingStage1.sync_params()`` first; ``step()``, ``state_dict()`` and the wrapper's
    other entry points do so themselves.

Note [Writes while params are gathered]
    A write into a param while its all-gather is running is partly overwritten when the
    gathered values land: a silent mix of old and new weights. Writes by torch functions right
    after ``step()`` (``param.copy_(best)``) wait first (Note [Reads right after step]); the
    others (another thread, inside a forward before the owning module ran, torch functions
    disabled) cannot be intercepted, but they can be seen afterwards: each param has
    an autograd version counter that every in-place write through it bumps. The counters are
    recorded when ``step()`` issues the all-gathers and compared when a bucket's all-gather is
    finished; a moved counter raises. The wrapper's own writes (the optimizer step on the local
    shard, the all-gather itself) go through the flat buffer, whose views have a version counter
    of their own (``param.data`` was pointed at them), and forward never writes params, so only
    outside writes are seen.

Note [Scripted submodules]
    A ``torch.jit.script``-ed or traced module (a ``ScriptModule``) refuses Python hooks, and its
    forward runs in TorchScript, where no torch function mode sees its reads. So no hook goes on
    it or its submodules; the nearest eager module above it waits, in its own forward pre-hook
    and state-dict hooks, for every bucket holding the scripted subtree's params: a scripted
    block inside an eager model starts on this step's weights, a little earlier than a hook of
    its own would wait. A model that is itself a ``ScriptModule`` has no eager module to wait
    in and is refused as ``model=`` (``check_trained_modules``); without a model, ``step()``
    waits for its all-gathers before it returns, which any model can use.

Under ``torch.compile`` the waits are ops of the graph instead: see Note [torch.compile] in
``compiled_waits``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from fusion.buffers import FlatBuffers
from sharded_opt.comm import collectives
from sharded_opt.model_hooks.compiled_waits import TRACED_WAITS, GraphWaits
from sharded_opt.model_hooks.read_guard import ReadGuard
from sharded_opt.model_hooks.weak_hooks import WeakMethodHook

_READS_CHILDRENS_PARAMS = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.TransformerEncoder,
)
"""torch modules whose forward hands their children's params to one op without calling the
children (``MultiheadAttention``'s ``out_proj``, the transformer layers' and encoder's fast path in
evaluation), and take that fast path only while no torch function mode is active. They wait for
their whole subtree and run with the read guard set aside, see Note [Reads right after step]."""


class GatheredBucket(Protocol):
    """A bucket whose params are all-gathered after each step (``sharded_opt.step.bucket.Bucket``);
    ``index`` is its position in the layout, as ``slot.bucket_index`` names it."""

    index: int

    def finish_param_sync(self) -> None:
        """Make the current stream (on CPU: the host) wait for the bucket's latest all-gather."""


class ParamReadyWaiter:
    """Hooks on ``model``'s modules that wait for their params' buckets (forward, state_dict,
    load_state_dict), and the check for writes during the all-gather.

    Params the optimizer trains that ``model`` does not hold (a loss module's learnable
    temperature, multi-task loss weights) are waited for like any read right after ``step()``
    (Note [Reads right after step]) and at the end of the model's forward at the latest.

    Args:
        model: the module that holds the optimizer's trainable params (some may live elsewhere;
            ``check_holds_trained_params`` refused one that holds none).
        buffers: the flat buffers holding the params.
        buckets: the wrapper's buckets, in bucket order, whose all-gathers the hooks wait for (a
            module's buckets are positions in the layout, ``slot.bucket_index``).
    """

    def __init__(
        self,
        model: nn.Module,
        buffers: FlatBuffers,
        buckets: Sequence[GatheredBucket],
    ) -> None:
        slot_of_param = {
            id(buffers.params[slot.param_index]): (slot.param_index, slot.bucket_index)
            for bucket in buffers.plan.buckets
            for slot in bucket.slots
        }
        self._buffers = buffers
        self._buckets = buckets
        names = {id(param): name for name, param in model.named_parameters()}
        self._names = [names.get(id(param), f"param {index}") for index, param in enumerate(buffers.params)]
        self._gathered_versions: dict[int, tuple[int, ...]] = {}
        self._compiled = _CompiledForward()
        laid_out = [buffers.params[index] for index in buffers.laid_out_indices]
        graph_waits = GraphWaits(self, laid_out, slot_of_param) if TRACED_WAITS else None
        self._read_guard = ReadGuard(buffers.param_buffers, self.finish, graph_waits)
        self.handles: list[RemovableHandle] = [
            model.register_forward_hook(_EagerOnly(self._end_of_forward)),
            self._read_guard,
        ]
        """The hooks this waiter installed; see Note [Hook lifetimes and copies]."""
        for module in model.modules():
            if isinstance(module, torch.jit.ScriptModule):
                continue  # runs no Python hooks: its eager parent waits for it, Note [Scripted submodules]
            fused = isinstance(module, _READS_CHILDRENS_PARAMS)
            buckets = tuple(
                sorted(
                    {
                        slot_of_param[id(p)][1]
                        for p in _params_read_by(module, fused)
                        if id(p) in slot_of_param
                    }
                )
            )
            if buckets:
                hook = WeakMethodHook(self._wait_for, buckets)
                forward_hook = _ForwardWait(
                    self._wait_and_set_guard_aside if fused else self._wait_for,
                    buckets,
                    _CompiledWait(self._compiled, graph_waits, fused),
                )
                # First among the module's pre-hooks: one registered before wrapping may compute
                # from the params (the old hook-based torch.nn.utils.weight_norm).
                self.handles.append(module.register_forward_pre_hook(forward_hook, prepend=True))
                if fused:
                    restore = _EagerOnly(self._restore_guard)
                    self.handles.append(module.register_forward_hook(restore, always_call=True))
                self.handles.append(module.register_state_dict_pre_hook(hook))
                self.handles.append(module.register_load_state_dict_pre_hook(hook))

    @property
    def forward_compiled(self) -> bool:
        """The model's forward ran under ``torch.compile`` of a torch that cannot trace the
        waits: ``step()`` must wait for its all-gathers itself, see Note [torch.compile] in
        ``compiled_waits``."""
        return self._compiled.seen

    def wait_in_graph(self, bucket_index: int) -> None:
        """The wait op of a compiled forward: wait for the bucket's all-gather if it is still
        pending, see Note [torch.compile] in ``compiled_waits``. A compiled graph that
        mutates a param (as its wait op is declared to) may bump the param's version before
        the op runs, so writes are not checked here (Note [Writes while params are gathered])."""
        if bucket_index in self._gathered_versions:
            self.finish([bucket_index], check_writes=False)

    def gathers_started(self, buckets: Iterable[GatheredBucket]) -> None:
        """Record the params' version counters as ``step()`` issues the ``buckets``' all-gathers,
        see Note [Writes while params are gathered]."""
        for bucket in buckets:
            self._gathered_versions[bucket.index] = self._versions(bucket.index)
        self._read_guard.start(frozenset(self._gathered_versions))

    def finish(self, bucket_indices: Iterable[int] | None = None, check_writes: bool = True) -> None:
        """Wait for the all-gathers of ``bucket_indices`` (default: all).

        Raises:
            RuntimeError: a param of these buckets was written while it was being gathered
                (unless not ``check_writes``).
        """
        buckets = self._buckets
        for bucket in buckets if bucket_indices is None else (buckets[i] for i in bucket_indices):
            bucket.finish_param_sync()
        if bucket_indices is None:
            bucket_indices = list(self._gathered_versions)
        written: list[int] = []
        for index in bucket_indices:
            before = self._gathered_versions.pop(index, None)
            if check_writes and before is not None and before != self._versions(index):
                slots = self._buffers.plan.buckets[index].slots
                written += [
                    s.param_index
                    for s, old, new in zip(slots, before, self._versions(index), strict=True)
                    if old != new
                ]
        self._read_guard.watch(frozenset(self._gathered_versions))
        if written:
            names = [self._names[index] for index in sorted(written)]
            raise RuntimeError(
                f"ShardingStage1(overlap=True, model=...): {names[:8]} were written while step()'s "
                "all-gather of their updated values was still running, so the write was partly "
                "overwritten. After opt.step(), call opt.sync_params() before writing params outside "
                "forward (param.copy_, torch.nn.init, an EMA copy-back); model.load_state_dict() "
                "waits by itself"
            )

    def _wait_for(self, buckets: tuple[int, ...], module: nn.Module, *hook_args: object) -> None:
        self.finish(buckets)

    def _wait_and_set_guard_aside(self, buckets: tuple[int, ...], module: nn.Module, args: tuple) -> None:
        self.finish(buckets)
        self._read_guard.set_aside(True)

    def _restore_guard(self, module: nn.Module, args: tuple, output: object) -> None:
        self._read_guard.set_aside(False)

    def _end_of_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        """The model's forward is done: what it did not wait for (a skipped branch's buckets)
        landed long ago; waiting for it now ends the read guard before backward, see Note
        [Reads right after step]."""
        self.finish()

    def _versions(self, bucket_index: int) -> tuple[int, ...]:
        params = self._buffers.params
        return tuple(
            params[slot.param_index]._version for slot in self._buffers.plan.buckets[bucket_index].slots
        )


def _params_read_by(module: nn.Module, whole_subtree: bool) -> Iterable[torch.Tensor]:
    """The params ``module``'s forward reads without a hook of their own module running first:
    its own, its scripted children's (Note [Scripted submodules]) and, with ``whole_subtree``,
    all of its subtree's."""
    if whole_subtree:
        return module.parameters()
    scripted = (child for child in module.children() if isinstance(child, torch.jit.ScriptModule))
    return [*module.parameters(recurse=False), *(p for child in scripted for p in child.parameters())]


class _CompiledForward:
    """Whether Dynamo traced one of the forward pre-hooks where it cannot trace the waits, see
    Note [torch.compile] in ``compiled_waits``."""

    def __init__(self) -> None:
        self.seen = False


class _CompiledWait:
    """What a module's forward pre-hook does while Dynamo traces it: the waits for the params
    the module reads as ops of the graph, or (a torch that cannot trace them) record that the
    forward runs compiled. See Note [torch.compile] in ``compiled_waits``."""

    __slots__ = ("_compiled", "_graph_waits", "_whole_subtree")

    def __init__(
        self, compiled: _CompiledForward, graph_waits: GraphWaits | None, whole_subtree: bool
    ) -> None:
        self._compiled = compiled
        self._graph_waits = graph_waits
        self._whole_subtree = whole_subtree

    def trace(self, module: nn.Module, args: tuple) -> None:
        if self._graph_waits is None:
            self._compiled.seen = True
        else:
            self._graph_waits.before_reads(_params_read_by(module, self._whole_subtree), args)


class _EagerOnly(WeakMethodHook):
    """A forward hook that traces to nothing under ``torch.compile`` (its waits are ops of the
    graph there, Note [torch.compile] in ``compiled_waits``)."""

    __slots__ = ()

    def __call__(self, *hook_args: object) -> None:
        if torch.compiler.is_compiling():
            return None
        return super().__call__(*hook_args)


class _ForwardWait(WeakMethodHook):
    """The forward pre-hook: waits in eager mode, traces its waits into the graph under
    ``torch.compile``."""

    __slots__ = ("_compiled",)

    def __init__(
        self, method: Callable[..., None], buckets: tuple[int, ...], compiled: _CompiledWait
    ) -> None:
        super().__init__(method, buckets)
        self._compiled = compiled

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            self._compiled.trace(module, args)
            return None
        return super().__call__(module, args)


def register_eager_pre_hook(module: nn.Module, method: Callable[[nn.Module, tuple], None]) -> RemovableHandle:
    """``method`` as ``module``'s first forward pre-hook, held weakly (Note [Hook lifetimes and
    copies]) and tracing to nothing under ``torch.compile``."""
    return module.register_forward_pre_hook(_EagerOnly(method), prepend=True)


class BufferBroadcaster:
    """DDP's ``broadcast_buffers``: a forward pre-hook on the root module that copies every
    buffer from the group's first rank before each forward with grad enabled.

    Forwards under ``torch.no_grad()`` / ``torch.inference_mode()`` (evaluation, possibly on one
    rank only) skip it, so they issue no collective and cannot hang.
    """

    def __init__(self, model: nn.Module, group: ProcessGroup, source_rank: int) -> None:
        self._group = group
        self._source_rank = source_rank
        self.handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(WeakMethodHook(self._broadcast))
        ]

    def _broadcast(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            collectives.broadcast_coalesced(list(module.buffers()), self._group, self._source_rank)
