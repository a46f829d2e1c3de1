"""The planner's inputs from the user's words: a model factory built on the meta device (no
param memory), a ``torch.optim`` class (or one of torchao's low-bit classes), and the bytes of
optimizer state it keeps for a tensor."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from fusion.block_layout import BlockGrid
from fusion.layout import ParamSpec
from sharded_opt.guards.optimizer_needs import THIRD_PARTY_NEEDS_BY_PATH, block_grid_of, declared_needs
from sharded_opt.guards.validation import ELEMENTWISE_OPTIMIZERS, collect_params
from sharded_opt.plan.memory import StateSize
from sharded_opt.step.inner_optimizer import constructor_kwargs, hyperparameters, probe_state
from sharded_opt.step.quantized_state import state_nbytes

BUILTIN_MODEL_MODULE = "benchmarks.models"
"""Where the benchmark's built-in models live (``--model default`` and the other preset names)."""

STATE_PROBE_NUMEL = 64
"""Elements of the small CPU tensor one step of the optimizer runs on to learn its state bytes
per element (some classes, ASGD, call ``.item()`` and cannot step on the meta device)."""

BITSANDBYTES_PREFIX = "bnb."
LOW_BIT_OPTIMIZERS = {
    (BITSANDBYTES_PREFIX if path.startswith("bitsandbytes.") else "") + path.rpartition(".")[2]: path
    for path in THIRD_PARTY_NEEDS_BY_PATH
}
"""torchao's low-bit classes by name (``AdamW8bit``...) and bitsandbytes' by ``bnb.`` and name
(``bnb.AdamW8bit``: the names are the same), their module imported only when named."""


def resolve_optimizer(name: str | type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class named ``name`` (``"AdamW"``), torchao's low-bit class of that
    name (``"AdamW8bit"``), bitsandbytes' of that name after ``bnb.`` (``"bnb.AdamW8bit"``), or
    the class itself.

    Raises:
        ValueError: no such class, not one the planner models (element-wise optimizers, and
            torchao's low-bit ones), or torchao is not installed.
    """
    cls = _named_class(name) if isinstance(name, str) else name
    if cls not in ELEMENTWISE_OPTIMIZERS and not (isinstance(cls, type) and _quantizes(cls)):
        known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"plan expects optimizer to name one of torch.optim's {known} or the low-bit "
            f"{', '.join(LOW_BIT_OPTIMIZERS)} but got {name!r}"
        )
    return cls


def _named_class(name: str) -> Any:
    if name not in LOW_BIT_OPTIMIZERS:
        return getattr(torch.optim, name, None)
    module, _, attribute = LOW_BIT_OPTIMIZERS[name].rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except ImportError as error:
        raise ValueError(
            f"plan: {name} is {'bitsandbytes' if name.startswith(BITSANDBYTES_PREFIX) else 'torchao'}'s; "
            f"install it (pip install -e '.[lowbit]'): {error}"
        ) from error


def _quantizes(cls: type) -> bool:
    needs = declared_needs(cls)
    return needs is not None and needs.quantized_blocks is not None


def load_factory(path: str) -> Callable[[], nn.Module]:
    """``module:callable`` (called with no arguments), or a built-in benchmark model's name.

    Raises:
        ValueError: the path is malformed, its module cannot be imported, or it has no such
            callable.
    """
    if ":" not in path:
        return _builtin_factory(path)
    return load_callable(path, "model factory")


def load_callable(path: str, what: str) -> Callable[[], Any]:
    """The callable ``module:callable`` names; ``what`` says what it is for, in errors.

    Raises:
        ValueError: the path is malformed, its module cannot be imported, or it has no such
            callable.
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"plan expects the {what} as 'module:callable' but got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"plan could not import the {what}'s module {module_name!r}: {error}") from error
    found = getattr(module, attribute, None)
    if not callable(found):
        raise ValueError(f"plan expects {module_name!r} to have a callable {attribute!r} ({what})")
    return found


def _builtin_factory(name: str) -> Callable[[], nn.Module]:
    try:
        models = importlib.import_module(BUILTIN_MODEL_MODULE)
    except ImportError as error:
        raise ValueError(
            f"plan expects model as 'module:callable' or a built-in name, but got {name!r} and the "
            f"built-in models ({BUILTIN_MODEL_MODULE}) cannot be imported: {error}"
        ) from error
    if name not in models.MODEL_NAMES:
        raise ValueError(
            f"plan expects model as 'module:callable' or one of {', '.join(models.MODEL_NAMES)} "
            f"but got {name!r}"
        )
    return lambda: models.build_model(name, seed=0)


def meta_model(factory: Callable[[], nn.Module]) -> nn.Module:
    """The factory's model with every param on the meta device: shapes and dtypes, no memory."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"plan expects the model factory to return an nn.Module but got {type(model).__name__}"
        )
    return model


def param_specs(
    model: nn.Module, optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> tuple[list[ParamSpec], torch.optim.Optimizer]:
    """The wrapper's view of ``model.parameters()`` under ``optimizer_class(**kwargs)`` (built on
    the meta params: torch checks the arguments), in registration order."""
    try:
        optimizer = optimizer_class(model.parameters(), **kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"plan could not build {optimizer_class.__name__} with {kwargs}: {error}") from error
    _, specs = collect_params(optimizer)
    return specs, optimizer


def state_sizes(
    optimizer: torch.optim.Optimizer, dtypes: Sequence[torch.dtype]
) -> tuple[dict[tuple[int, torch.dtype], StateSize], bool]:
    """The optimizer's state bytes of a stepped tensor, by (param group, dtype), from one step of
    its class with each group's settings on small CPU tensors: one it keeps plain state for and,
    for a class that quantizes, one and two times the smallest tensor it quantizes (the bytes
    grow linearly from a fixed code book); and whether the class creates its state at
    construction (Adagrad), which makes the wrapper materialize every bucket."""
    grid = block_grid_of(optimizer)
    sizes: dict[tuple[int, torch.dtype], StateSize] = {}
    at_construction = False
    for group_index, group in enumerate(optimizer.param_groups):
        hyper = hyperparameters(group)
        for dtype in dtypes:
            plain = _probed_nbytes(optimizer, hyper, STATE_PROBE_NUMEL, dtype) // STATE_PROBE_NUMEL
            size = StateSize(plain)
            if grid is not None:
                size = _quantized_size(optimizer, hyper, dtype, grid, plain)
            sizes[(group_index, dtype)] = size
        probe = torch.zeros(1, requires_grad=True)
        built = type(optimizer)([{**hyper, "params": [probe]}], **constructor_kwargs(optimizer))
        at_construction = at_construction or bool(built.state)
    return sizes, at_construction


def _quantized_size(
    optimizer: torch.optim.Optimizer, hyper: dict[str, Any], dtype: torch.dtype, grid: BlockGrid, plain: int
) -> StateSize:
    """Bytes of the smallest quantized tensor and of twice it give codes and scales per element
    and the code books; where the last block may be partial, one element more (one block more)
    tells the scales of a block from the codes of an element."""
    first = grid.first_quantized_numel
    once = _probed_nbytes(optimizer, hyper, first, dtype)
    growth = _probed_nbytes(optimizer, hyper, 2 * first, dtype) - once
    if not grid.partial_last_block:
        per_element = Fraction(growth, first)
        return StateSize(plain, grid, per_element, once - int(per_element * first))
    one_more = _probed_nbytes(optimizer, hyper, first + 1, dtype) - once
    blocks = first // grid.block_size
    per_block = Fraction(one_more * first - growth, first - blocks)
    per_element = one_more - per_block
    if per_block.denominator != 1:
        raise RuntimeError(f"plan: {type(optimizer).__name__}'s state grows by {per_block} bytes per block")
    fixed = once - int(per_element * first) - int(per_block) * blocks
    return StateSize(plain, grid, per_element, fixed, int(per_block))


def _probed_nbytes(
    optimizer: torch.optim.Optimizer, hyper: dict[str, Any], numel: int, dtype: torch.dtype
) -> int:
    probe = torch.zeros(numel, dtype=dtype, requires_grad=True)
    return state_nbytes(probe_state(optimizer, hyper, probe))


def load_batch(path: str | None, model: str, micro_batch: int) -> tuple[torch.Tensor, ...]:
    """One batch for timing the model's forward and backward: ``module:callable`` returning the
    forward's arguments (a tensor or a tuple of them), or for a built-in model ``micro_batch``
    random byte sequences (tokens and targets) of its preset's length.

    Raises:
        ValueError: no batch for a model that is not built in, or a bad path.
    """
    if path is not None:
        batch = load_callable(path, "batch")()
        return batch if isinstance(batch, tuple) else (batch,)
    if ":" in model:
        raise ValueError(
            f"plan --calibrate expects --batch MODULE:CALLABLE (the forward's arguments) for the model "
            f"{model!r}, or stated times (--compute-ms, --step-ms) instead of --calibrate"
        )
    models = importlib.import_module(BUILTIN_MODEL_MODULE)
    tokens = torch.randint(0, models.BYTE_VOCAB, (micro_batch, models.model_seq_len(model, None)))
    return tokens, tokens
