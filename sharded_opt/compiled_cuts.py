"""A ``torch.compile`` backend that cuts a forward's graph where a new bucket's params are first
read, so a compiled model's backward hands each bucket's grads to the reduce-scatter as the
eager one does.

Note [Graph cuts at buckets]
    A compiled forward's backward is one autograd node (``CompiledFunctionBackward``) with every
    param's ``AccumulateGrad`` after it, so every grad hook fires when the whole backward is
    done: compiled overlap mode issued all its reduce-scatters then, and hid only the
    all-gathers behind compute. Dynamo cuts the graph of a module wrapped in DDP at DDP's
    buckets for the same reason (``DDPOptimizer``); nothing cuts ours. :func:`compile_backend`
    does: it walks the graph Dynamo traced in order and starts a new piece right before the
    first node that reads a param of a bucket no earlier node read, once the current piece read a
    bucket. Each piece is compiled on its own by the given backend (AOTAutograd
    makes each its own autograd node), so in backward a bucket's grads are all accumulated once
    the piece holding its first reads is done, and its hooks start the bucket's reduce-scatter
    while earlier pieces still run.

    The cut goes before the waits of Note [torch.compile] that precede the reading node (and
    the grad-mode switches around them), so a wait and the read it guards sit in one piece.
    The pieces run in the graph's own order (``keep_original_order``): a wait mutates its
    param and returns nothing, so torch's default order, which follows data only, ran a piece
    holding only a wait after the pieces that read the param (DDPOptimizer's own cuts did: its
    pieces follow DDP's byte counts, not ours, and broke a tied weight's version check). In
    sync mode, where no wait is traced, the same nodes fall into the same pieces, so compiled
    sync and compiled overlap run the same kernels and end bitwise equal.

    The pieces are compiled by torch's own machinery for DDP's cuts (``SubmodCompiler``: each
    piece compiled with fake inputs, AOTAutograd's metadata kept per piece); only where the
    cuts go is ours. With a torch older than ``TRACED_WAITS_SINCE`` the backend compiles the
    graph whole.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, fx

from sharded_opt.model_hooks.compiled_waits import TRACED_WAITS, WAIT_OP
from sharded_opt.optimizer import ShardingStage1

CompilerFn = Callable[..., Callable[..., Any]]
"""A ``torch.compile`` backend: ``(graph_module, example_inputs, **configs) -> callable``."""

BucketKey = tuple[int, int]
"""(index of the optimizer among those given, bucket index)."""

_PRELUDE_TARGETS = (
    WAIT_OP,
    torch.ops.sharded_opt.wait_for_param,
    torch._C._set_grad_enabled,
    builtins.getattr,
)
"""Nodes that precede a module's reads and compute nothing: the waits, the grad-mode switches
Dynamo records around them, and attribute reads (``tensor.is_leaf``)."""


def compile_backend(*optimizers: ShardingStage1, backend: str | CompilerFn = "inductor") -> CompilerFn:
    """A ``torch.compile`` backend that compiles a forward in pieces cut at the buckets of
    ``optimizers``, so that in backward each bucket's reduce-scatter starts while the rest of
    the backward runs (Note [Graph cuts at buckets]).

    Without it a compiled model's grads all arrive at the end of backward: overlap mode still
    hides the all-gathers behind the next forward, but none of the reduce-scatters. The cost is
    one compiled graph per bucket: kernels are not fused across a cut, as with DDP's own cuts.

    Args:
        optimizers: the :class:`~sharded_opt.ShardingStage1` wrappers whose params the model
            reads (two with Muon and AdamW side by side).
        backend: the backend that compiles each piece, a name (``"inductor"``, ``"aot_eager"``)
            or a callable, as ``torch.compile`` takes it. ``torch.compile``'s own ``mode`` and
            ``options`` reach it (``torch.compile(model, backend=compile_backend(opt),
            mode="max-autotune")``).

    Returns:
        A backend to pass as ``torch.compile(model, backend=...)``.

    Raises:
        TypeError: an optimizer is not a ``ShardingStage1``, or none is given.

    Example::

        opt = ShardingStage1(torch.optim.AdamW(model.parameters()), model=model, overlap=True)
        forward = torch.compile(model, backend=compile_backend(opt))
    """
    if not optimizers or not all(isinstance(o, ShardingStage1) for o in optimizers):
        got = ", ".join(type(o).__name__ for o in optimizers) or "nothing"
        raise TypeError(
            f"compile_backend expects the ShardingStage1 wrappers whose params the model reads, but got {got}"
        )
    key_of_param = {
        id(opt.shards.buffers.params[slot.param_index]): (index, slot.bucket_index)
        for index, opt in enumerate(optimizers)
        for bucket in opt.plan.buckets
        for slot in bucket.slots
    }
    return _BucketCuts(backend, key_of_param)


class _BucketCuts:
    """The backend :func:`compile_backend` returns; holds ids and the inner backend only, so a
    compiled model does not keep a wrapper alive."""

    def __init__(self, backend: str | CompilerFn, key_of_param: dict[int, BucketKey]) -> None:
        self._backend = backend
        self._key_of_param = key_of_param

    def __call__(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any], **configs: Any) -> Any:
        inner, configs = self._inner(configs)
        pieces = piece_of_nodes(graph_module, self._buckets_read_by(graph_module, example_inputs))
        if not TRACED_WAITS or max(pieces.values(), default=0) == 0:
            return inner(graph_module, example_inputs, **configs)
        return _compile_pieces(graph_module, example_inputs, pieces, inner, configs)

    def _inner(self, configs: dict[str, Any]) -> tuple[CompilerFn, dict[str, Any]]:
        """The backend for the pieces, and what is left of ``configs`` for it: ``torch.compile``
        hands its ``mode`` and ``options`` to a backend given as a callable (this one); for
        inductor they configure inductor as ``torch.compile(backend="inductor", mode=...)``
        would, through torch's own wrapper for that."""
        if self._backend == "inductor" and configs:
            mode, options = configs.pop("mode", None), configs.pop("options", None)
            return torch._TorchCompileInductorWrapper(mode, options, dynamic=None), configs
        if isinstance(self._backend, str):
            return torch._dynamo.backends.registry.lookup_backend(self._backend), configs
        return self._backend, configs

    def _buckets_read_by(
        self, graph_module: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[[fx.Node], set[BucketKey]]:
        tensor_of_node: dict[fx.Node, object] = dict(
            zip(graph_module.graph.find_nodes(op="placeholder"), example_inputs, strict=False)
        )
        for node in graph_module.graph.find_nodes(op="get_attr"):
            tensor_of_node[node] = getattr(graph_module, str(node.target), None)

        def buckets_read_by(node: fx.Node) -> set[BucketKey]:
            keys = (
                self._key_of_param.get(id(tensor_of_node.get(arg)))
                for arg in node.all_input_nodes
                if isinstance(tensor_of_node.get(arg), Tensor)
            )
            return {key for key in keys if key is not None}

        return buckets_read_by


def piece_of_nodes(
    graph_module: fx.GraphModule, buckets_read_by: Callable[[fx.Node], Iterable[BucketKey]]
) -> dict[fx.Node, int]:
    """Each node's piece: a new piece starts before the first node that reads a bucket no earlier
    node read, moved back over the prelude nodes right before it, once the current piece read a
    bucket (a piece that reads none would only add a graph), see Note [Graph cuts at buckets]."""
    piece_of: dict[fx.Node, int] = {}
    piece, piece_read, seen = 0, False, set()
    prelude: list[fx.Node] = []
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr" or (node.op == "call_function" and node.target in _PRELUDE_TARGETS):
            prelude.append(node)
            continue
        new = set(buckets_read_by(node)) - seen
        if new and piece_read:
            piece += 1
        seen |= new
        for waiting in prelude:
            piece_of[waiting] = piece
        prelude.clear()
        piece_of[node] = piece
        piece_read = piece_read or bool(new)
    for waiting in prelude:
        piece_of[waiting] = piece
    return piece_of


def _compile_pieces(
    graph_module: fx.GraphModule,
    example_inputs: Sequence[Any],
    piece_of: dict[fx.Node, int],
    inner: CompilerFn,
    configs: dict[str, Any],
) -> fx.GraphModule:
    """Split ``graph_module`` into its pieces, run in the graph's order, and compile each with
    ``inner`` as Dynamo's DDPOptimizer compiles its own (Note [Graph cuts at buckets])."""
    from torch._dynamo.backends import distributed as ddp_cuts
    from torch._guards import detect_fake_mode

    split = fx.passes.split_module.split_module(
        graph_module, None, lambda node: piece_of[node], keep_original_order=True
    )
    ddp_cuts.propagate_dynamo_source(graph_module, split)
    ddp_cuts.propagate_metadata(graph_module, split)
    fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.fake_tensor.FakeTensorMode()
    compiler = ddp_cuts.SubmodCompiler(split, inner, fake_mode, **configs)
    with torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing():
        compiler.run(*example_inputs)
    split.recompile()
    return split
