"""Boundary checks for ShardingStage1: each user mistake is caught once, before anything is
changed, with a message that names the problem and the fix."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from fusion.buffers import FlatBuffers
from fusion.layout import ParamSpec
from sharded_opt.guards.messages import DROP_DDP
from sharded_opt.guards.optimizer_needs import (
    ASSUMED_ELEMENTWISE,
    ELEMENTWISE,
    NEEDS_ATTRIBUTE,
    TORCH_OPTIMIZERS,
    OptimizerNeeds,
    declared_needs,
)

_MEMORY_OVERLAPS = 1
"""``torch._debug_has_internal_overlap``'s answer for a tensor some of whose elements share
memory; torch's in-place ops (every optimizer update) refuse exactly those."""

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls for cls, needs in TORCH_OPTIMIZERS.items() if needs is ELEMENTWISE
)
"""Optimizers whose update of each element depends only on that element's own grad and state
(plus scalars), so running them on an arbitrary flat slice of the params gives the same result
as running them on whole params."""


def check_optimizer(optimizer: object, assume_elementwise: bool) -> OptimizerNeeds:
    """The optimizer's needs (see ``optimizer_needs``), or raise for what cannot be wrapped."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "ShardingStage1 expects a torch.optim.Optimizer instance, e.g. "
            f"ShardingStage1(torch.optim.AdamW(model.parameters())), but got {type(optimizer).__name__}"
        )
    wrapper = getattr(optimizer, "_sharded_opt_wrapper", None)  # a weakref, see ShardingStage1.close
    if wrapper is not None and wrapper() is not None:
        raise ValueError(
            "ShardingStage1 was given an optimizer that is already wrapped by a ShardingStage1; "
            "wrap each optimizer once and use the wrapper, or call the first wrapper's close() "
            "before wrapping it again"
        )
    needs = declared_needs(type(optimizer))
    if needs is not None:
        if needs.check is not None:
            needs.check(optimizer)
        return needs
    if assume_elementwise:
        return ASSUMED_ELEMENTWISE
    if type(optimizer).__module__.startswith("bitsandbytes."):
        raise TypeError(
            f"ShardingStage1 shards bitsandbytes' AdamW8bit and Adam8bit but got {type(optimizer).__name__}: "
            "its update is not element-wise (LAMB/LARS trust ratios over the whole param), its state "
            "is 32-bit or paged, or it is untested under sharding. Use bnb.optim.AdamW8bit or "
            "Adam8bit, pass assume_elementwise=True for an element-wise one (32-bit AdamW), or "
            "wrap the optimizer without ShardingStage1"
        )
    elementwise = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    whole = ", ".join(cls.__name__ for cls, n in TORCH_OPTIMIZERS.items() if n.whole_params)
    name = type(optimizer).__name__
    raise TypeError(
        f"ShardingStage1 shards flat slices of params, which is only correct for element-wise "
        f"optimizers ({elementwise}), and steps whole params, one owning rank each, for optimizers "
        f"that need them ({whole}), but got {name}. If every element's update depends only on its "
        "own grad and state, pass assume_elementwise=True; if the class needs whole params, declare "
        f"it: {name}.{NEEDS_ATTRIBUTE} = sharded_opt.OptimizerNeeds(whole_params=True, "
        "param_cost=...), see docs/muon-adafactor.md"
    )


def collect_params(optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], list[ParamSpec]]:
    """Flatten the optimizer's params in registration order with a spec each (frozen ones
    included: they may be unfrozen later, and then are stepped like any other)."""
    params: list[Tensor] = []
    specs: list[ParamSpec] = []
    seen: dict[int, int] = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) in seen:
                raise ValueError(
                    f"ShardingStage1 expects each param once but param {len(params)} (group "
                    f"{group_index}) is the same tensor as param {seen[id(param)]}; remove the "
                    "duplicate from the optimizer's param groups"
                )
            seen[id(param)] = len(params)
            if nn.parameter.is_lazy(param):
                raise ValueError(
                    f"ShardingStage1 expects initialized params but param {len(params)} (group "
                    f"{group_index}) is an uninitialized param of a lazy module (nn.LazyLinear, "
                    "nn.LazyConv2d, ...), whose shape is only known after its first forward; run one "
                    "forward with a sample batch before wrapping: `model(sample); opt = "
                    "ShardingStage1(optimizer, ...)` (the torch optimizer may be built before it)"
                )
            if param.is_sparse or param.layout != torch.strided:
                raise ValueError(
                    f"ShardingStage1 expects dense params but param {len(params)} (group "
                    f"{group_index}) has layout {param.layout}; sparse params cannot live in flat buffers"
                )
            if torch._debug_has_internal_overlap(param) == _MEMORY_OVERLAPS:
                raise ValueError(
                    f"ShardingStage1 expects params whose elements have memory of their own but param "
                    f"{len(params)} (group {group_index}) of shape {list(param.shape)} has strides "
                    f"{list(param.stride())}, so several elements share memory (made by expand() or "
                    "as_strided); torch.optim cannot update it in place either. Make it with .clone(): "
                    "nn.Parameter(t.expand(...).clone())"
                )
            params.append(param)
            specs.append(ParamSpec.of(param, group_index))
    if not params:
        raise ValueError("ShardingStage1 expects an optimizer with params but its param groups are empty")
    _refuse_shared_memory(params)
    devices = sorted({str(spec.device) for spec in specs})
    if len(devices) > 1:
        raise ValueError(
            f"ShardingStage1 expects all params on one device but got params on {devices}; move "
            "the model to one device (the rank's own) before building the optimizer"
        )
    return params, specs


def _refuse_shared_memory(params: list[Tensor]) -> None:
    """Refuse two params with elements in common (``dec.weight = nn.Parameter(enc.weight.t())``):
    torch.optim updates the shared memory once per param, and they stay tied; laid out, each
    gets memory of its own and they silently drift apart (3.3e-2 after three SGD steps)."""
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for index, param in enumerate(params):
        if param.numel() > 0 and param.device.type != "meta":  # meta tensors have no memory
            start, end = _byte_span(param)
            spans.setdefault(param.untyped_storage().data_ptr(), []).append((start, end, index))
    for ranges in spans.values():
        ranges.sort()
        open_spans: list[tuple[int, int, int]] = []  # those reaching past the current start
        for start, end, index in ranges:
            open_spans = [span for span in open_spans if span[1] > start]
            shared = [other for _, _, other in open_spans if _share_elements(params[other], params[index])]
            if shared:
                first, second = sorted((shared[0], index))
                raise ValueError(
                    f"ShardingStage1 expects params with memory of their own but params {first} and "
                    f"{second} share memory (one was made from the other, e.g. nn.Parameter(w.t())); "
                    "torch.optim would update that memory once for each, the flat buffers would give "
                    "each a copy of its own. To tie weights, use one Parameter in both places "
                    "(decoder.weight = encoder.weight, or F.linear(x, encoder.weight.t())); for "
                    "independent params, .clone() one of them"
                )
            open_spans.append((start, end, index))


def _byte_span(tensor: Tensor) -> tuple[int, int]:
    """First and one-past-last byte of ``tensor``'s elements in its storage."""
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.storage_offset() * tensor.element_size()
    return start, start + (last + 1) * tensor.element_size()


def _share_elements(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` (spans overlapping in one storage) have an element in common;
    interleaved views (``w[:, ::2]``, ``w[:, 1::2]``) do not. Views of other dtypes count as
    sharing."""
    if a.element_size() != b.element_size():
        return True
    extent = max(_byte_span(a)[1], _byte_span(b)[1]) // a.element_size()
    offsets = torch.arange(extent)
    mine = offsets.as_strided(a.shape, a.stride(), a.storage_offset())
    theirs = offsets.as_strided(b.shape, b.stride(), b.storage_offset())
    return bool(torch.isin(mine, theirs).any())


def check_trained_modules(model: nn.Module, params: list[Tensor]) -> None:
    """Refuse modules of ``model`` whose use of the optimizer's params the flat buffers cannot
    follow:

    - sparse grads (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): autograd
      would add each sparse grad into the param's dense flat grad view, silently giving up the
      memory the user asked sparse grads for, and an optimizer that refuses sparse grads (Adam)
      would train instead of raising as it does in plain torch;
    - ``max_norm`` on an embedding: every forward renormalizes, in place, the rows its own
      batch looks up, so each rank renormalizes other rows; the owner of a shard steps its copy
      and the all-gather overwrites the renormalized rows of every other rank (on 2 ranks a
      row ended 2.97 off plain torch, which renormalizes every row looked up by any sample);
    - a ``DistributedDataParallel`` (or FSDP) wrapper: it averages the grads itself and writes
      them after backward, which the wrapper's own reduction already covers (torch's
      ``ZeroRedundancyOptimizer`` is used beside DDP; this one replaces it);
    - a model that is itself a ``torch.jit.ScriptModule`` (scripted or traced): it takes no
      Python hooks, so there is nowhere to wait for its params, broadcast its buffers or check
      its params' shapes before a forward (Note [Scripted submodules] in ``param_hooks``).
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"ShardingStage1(model=...) expects an eager nn.Module but got a {type(model).__name__} "
            "(torch.jit.script or torch.jit.trace), which runs no Python hooks. Leave model= out "
            "(step() then waits for its all-gathers before it returns), or pass the eager model "
            "and script only its submodules"
        )
    data_parallel = _data_parallel_wrappers()
    trained = {id(param) for param in params}
    for name, module in model.named_modules():
        where = f"{name or 'the model'} ({type(module).__name__})"
        if isinstance(module, data_parallel):
            raise ValueError(
                f"ShardingStage1 averages the grads over the ranks itself, but {where} is a data "
                f"parallel wrapper that all-reduces them again and writes them after backward. {DROP_DDP}"
            )
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or id(module.weight) not in trained:
            continue
        if module.sparse:
            raise ValueError(
                f"ShardingStage1 expects dense grads but {where} has sparse=True; the wrapper "
                "reduces flat dense grad buffers, so build it with sparse=False (its grads then "
                "cost the weight's size), or keep the sparse module out of the wrapped optimizer "
                "and train it with torch.optim.SparseAdam, averaging its grads yourself"
            )
        if module.max_norm is not None:
            raise ValueError(
                f"ShardingStage1 expects params that only the optimizer writes but {where} has "
                f"max_norm={module.max_norm}: each forward renormalizes in place the rows its own "
                "rank looks up, and the shards' all-gather would undo other ranks' renormalization. "
                "Build it with max_norm=None and renormalize on every rank after opt.step(): "
                f"`with torch.no_grad(): {name or 'embedding'}.weight.renorm_(2, 0, max_norm)` "
                "(every row, not only the ones looked up), or keep it out of the wrapped optimizer"
            )


def check_holds_trained_params(model: nn.Module, buffers: FlatBuffers) -> None:
    """Refuse a model that holds none of the params the optimizer trains: it is the wrong model
    (a GAN's generator attached to the discriminator's optimizer), and the one that needs the
    per-module waits and the initial broadcast would get neither. One that holds only some of
    them is fine (a loss module's temperature may live outside it)."""
    owned = {id(param) for param in model.parameters()}
    if not any(id(buffers.params[index]) in owned for index in buffers.laid_out_indices):
        raise ValueError(
            "ShardingStage1.attach expects the model whose params the optimizer trains but "
            f"{type(model).__name__}.parameters() holds none of them; attach the model the "
            "optimizer was built from (each wrapper of a GAN takes its own network)"
        )


def _data_parallel_wrappers() -> tuple[type, ...]:
    """DDP, and FSDP where it was imported (no FSDP module can exist otherwise)."""
    wrappers: list[type] = [nn.parallel.DistributedDataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and hasattr(fsdp, "FullyShardedDataParallel"):
        wrappers.append(fsdp.FullyShardedDataParallel)
    return tuple(wrappers)


def check_same_layout(specs: list[ParamSpec], group: ProcessGroup, world_size: int) -> None:
    """Raise on every rank if any rank's params differ from rank 0's (collective)."""
    signature = [
        (spec.shape, str(spec.dtype), spec.group_index, spec.requires_grad, spec.strides) for spec in specs
    ]
    signatures: list[object] = [None] * world_size
    dist.all_gather_object(signatures, signature, group=group)
    reference = signatures[0]
    for rank, other in enumerate(signatures):
        if other != reference:
            raise ValueError(
                f"ShardingStage1 expects the same params on every rank but rank {rank} differs from "
                f"rank 0: {_first_difference(reference, other)}. Build the same model and optimizer "
                "(same param groups, shapes, dtypes and frozen params) on every rank"
            )


def _first_difference(reference: list, other: list) -> str:
    if len(reference) != len(other):
        return f"{len(other)} params instead of {len(reference)}"
    for index, (mine, theirs) in enumerate(zip(reference, other, strict=True)):
        if mine != theirs:
            return f"param {index} is {_describe(theirs)} instead of {_describe(mine)}"
    return "no difference found"


def _describe(signature: tuple) -> str:
    shape, dtype, group_index, requires_grad, strides = signature
    frozen = "" if requires_grad else " (frozen)"
    layout = "" if strides is None else f" with strides {list(strides)}"
    return f"shape {list(shape)} {dtype}{layout} in group {group_index}{frozen}"


def check_compression(
    grad_compression: str | None,
    param_compression: str | None,
    *,
    sharded: bool,
    specs: list[ParamSpec],
    grad_error_feedback: bool = False,
    hybrid: bool = False,
) -> None:
    """Refuse a ``grad_compression``/``param_compression``/``grad_error_feedback`` setting the
    compressed collectives do not support (Note [Compressed wire] in
    ``sharded_opt/comm/compression.py``): they replace the sharded reduce-scatter and all-gather
    of CPU tensors on gloo and nothing else; error feedback needs compressed grads and covers
    the reduce-scatter only, not hybrid sharding's average across groups (Note [Error feedback]).

    Raises:
        ValueError: naming the setting, what it met and what is accepted.
    """
    if grad_error_feedback:
        check_error_feedback(grad_compression, hybrid)
    chosen = [
        f"{name}={value!r}"
        for name, value in (("grad_compression", grad_compression), ("param_compression", param_compression))
        if value is not None
    ]
    if not chosen:
        return
    setting = "Strategy().sharding." + " and ".join(chosen)
    off = "or leave grad_compression and param_compression at None (exact)"
    if not sharded:
        raise ValueError(
            f"ShardingStage1 got {setting} with enable=False: compression replaces the sharded "
            f"reduce-scatter and all-gather, which plain data parallel does not run. Set enable=True, {off}"
        )
    devices = sorted({spec.device.type for spec in specs} - {"cpu"})
    if devices:
        raise ValueError(
            f"ShardingStage1 got {setting} for params on {devices[0]}: compressed collectives run "
            "on CPU tensors over gloo only (not tried on accelerators or NCCL). Keep the params on "
            f"the CPU, {off}"
        )
    kinds = sorted({str(spec.dtype) for spec in specs if not spec.dtype.is_floating_point})
    if kinds:
        raise ValueError(
            f"ShardingStage1 got {setting} for params of dtype {kinds[0]}: compression accepts real "
            f"floating-point params only (float32, bfloat16, float16, float64). Exclude those params, {off}"
        )


def check_error_feedback(grad_compression: str | None, hybrid: bool) -> None:
    """Refuse ``grad_error_feedback`` without compressed grads, or with hybrid sharding (Note
    [Error feedback] in ``sharded_opt/comm/compression.py``).

    Raises:
        ValueError: naming the setting and what it met.
    """
    if grad_compression is None:
        raise ValueError(
            "ShardingStage1 got Strategy().sharding.grad_error_feedback=True with grad_compression=None: "
            "error feedback carries the rounding error of compressed grads, and exact grads have none. "
            "Set grad_compression to 'bf16' or 'int8', or leave grad_error_feedback at False"
        )
    if hybrid:
        raise ValueError(
            "ShardingStage1 got Strategy().sharding.grad_error_feedback=True with hybrid sharding "
            "(degree below the world size): the residual covers the reduce-scatter within a shard "
            "group, not the compressed average across the groups (not supported). Shard over every "
            "rank (degree=None), or leave grad_error_feedback at False"
        )
