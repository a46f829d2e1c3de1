"""The inner optimizer: the user's optimizer class, rebuilt over this rank's per-param pieces.

It has one param group per user group (same hyperparameters, copied from the user's group dicts
before every step), holding the inner params of every local shard of that group; see Note
[Per-param pieces] in ``local_shard``. Its state is therefore per piece (or chunk of a piece),
and this module converts it to and from per-param state: element-wise values (``exp_avg``, of
the piece's shape) are concatenated over a param's pieces in param order, scalar values
(``step``) are the same in every piece of a param and are taken from the first.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from fusion.buffers import flatten_to_slot, view_slot
from fusion.layout import ParamSlot
from sharded_opt.guards.optimizer_needs import declared_needs
from sharded_opt.step.local_shard import LocalShard

ParamState = dict[str, Any]
"""One param's optimizer state: element-wise values hold only this rank's elements, in param
order (the concatenation of its local pieces)."""


def constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW's defaults, for one, carry
    ``decoupled_weight_decay``, which its constructor does not take), and the settings its
    class declares it keeps outside them (``OptimizerNeeds.settings``)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    needs = declared_needs(type(optimizer))
    if needs is not None and needs.settings is not None:
        kwargs.update(needs.settings(optimizer))
    return kwargs


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def build_inner_optimizer(
    optimizer: torch.optim.Optimizer, shards: list[LocalShard]
) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class with one group per user group holding the inner
    params of ``shards`` that belong to it (a group may start empty)."""
    groups: list[dict[str, Any]] = []
    for group_index, group in enumerate(optimizer.param_groups):
        params = [p for s in shards if s.bucket.group_index == group_index for p in s.inner_params]
        groups.append({**hyperparameters(group), "params": params})
    inner = type(optimizer)(groups, **constructor_kwargs(optimizer))
    _copy_settings(optimizer, inner)
    return inner


_SETTING_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _copy_settings(optimizer: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> None:
    """Give ``inner`` the settings ``optimizer``'s constructor kept outside ``defaults``.

    The inner optimizer is built from the defaults the constructor accepts; a class may keep
    other constructor arguments as attributes only (``lion_pytorch.Lion`` keeps
    ``decoupled_weight_decay`` as ``self.decoupled_wd`` and its initial lr as ``self._init_lr``),
    and rebuilt without them it would step silently differently. So every plain-data attribute
    that the constructor set on both (scalars, strings, dtypes: never a tensor, a param or a
    method bound to the wrapped optimizer) is copied where the two differ.
    """
    built = vars(inner)
    for key, value in vars(optimizer).items():
        if key in built and isinstance(value, _SETTING_TYPES) and built[key] != value:
            setattr(inner, key, value)


def probe_state(optimizer: torch.optim.Optimizer, hyper: dict[str, Any], probe: Tensor) -> dict[str, Any]:
    """The state ``optimizer``'s class keeps for ``probe`` after one step with a zero grad, of a
    throwaway copy configured as ``hyper`` with the optimizer's settings (torchao's
    ``block_size`` included). The step runs eagerly: only the state's form is wanted, and
    torchao compiles its step for every new tensor shape (tens of seconds on a CPU)."""
    probe.grad = torch.zeros_like(probe)
    throwaway = type(optimizer)([{**hyper, "params": [probe]}], **constructor_kwargs(optimizer))
    _copy_settings(optimizer, throwaway)
    with torch.compiler.set_stance("force_eager"):
        step_without_hooks(throwaway, {})
    return throwaway.state[probe]


def check_steps(
    optimizer: torch.optim.Optimizer,
    stepped: set[tuple[int, torch.dtype, torch.device]],
    probe_shape: tuple[int, ...] = (2,),
) -> None:
    """Raise at once if the optimizer's class, configured as a param group, cannot step a tensor
    of the dtype and device the shards of that group will be stepped in (``stepped``: group
    index, dtype, device), as the plain optimizer would at its first ``step()``.

    Note [Refused at the first step]
        Some settings are refused by torch only when ``step()`` runs: ``capturable=True`` on a
        device it cannot capture on (CPU), ``differentiable=True`` over leaf params, ``fused``
        on an unsupported dtype or device. Sharded, a rank raises only if its shard of a
        bucket holds a piece of a param that got a grad, so on some ranks the step would raise
        and on others go on into the all-gather, which then waits for ranks that never come.
        So a throwaway optimizer of the same class and group settings steps a 2-element param
        (2x2 for Muon and Adafactor, which step whole matrices and refuse complex params only
        in ``step()``) of each (group, dtype, device) at construction, the same on every rank. It steps
        without torch's hook wrapper, so no global optimizer step hook fires for it.
    """
    for group_index, dtype, device in sorted(stepped, key=str):
        probe = torch.zeros(probe_shape, dtype=dtype, device=device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        hyper = hyperparameters(optimizer.param_groups[group_index])
        try:
            throwaway = type(optimizer)([{**hyper, "params": [probe]}], **constructor_kwargs(optimizer))
            step_without_hooks(throwaway, {})
        except Exception as error:
            torch_error = f"{type(error).__name__}: {str(error).rstrip('.')}"
            raise ValueError(
                f"ShardingStage1: the wrapped {type(optimizer).__name__}, configured as param group "
                f"{group_index}, cannot step {dtype} params on {device}; plain torch would raise at the "
                f"first step(): {torch_error}. Change the optimizer's settings (e.g. capturable=False "
                "on CPU, differentiable=False over model params) and wrap it again"
            ) from error


def step_without_hooks(optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> None:
    """``optimizer.step(**kwargs)`` without the pre/post-hook wrapper torch puts around every
    optimizer class's ``step`` (Note [Step hooks] in ``wrapped_guard``); the profiler range stays."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    with torch.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        step(optimizer, **kwargs)


def copy_group_updates(inner_groups: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Copy into the user's ``groups`` what the inner optimizer's ``step`` set in its own groups.

    Optimizers keep per-group scalars in their groups and update them in ``step`` (schedule-free
    AdamW's ``k``, ``weight_sum`` and ``lr_max``): with the plain optimizer they show up in
    ``param_groups`` and ``state_dict()``, and the next step reads them back. The user's groups
    are copied into the inner ones before every step, so without this the next step would read
    the old values again (schedule-free's warmup would never advance).
    """
    for inner, group in zip(inner_groups, groups, strict=True):
        group.update(hyperparameters(inner))


def add_shard(inner: torch.optim.Optimizer, shard: LocalShard) -> None:
    """Let the inner optimizer step a shard that was materialized after it was built."""
    inner.param_groups[shard.bucket.group_index]["params"].extend(shard.inner_params)


def param_states(inner: torch.optim.Optimizer, shards: list[LocalShard]) -> dict[int, ParamState]:
    """Per param index with local pieces that have state, its local state (see :data:`ParamState`)."""
    chunks: dict[int, list[tuple[Tensor, dict[str, Any]]]] = {}
    for shard in shards:
        slots = {slot.param_index: slot for slot in shard.bucket.slots}
        for param, owner in zip(shard.inner_params, shard.inner_owners, strict=True):
            state = inner.state.get(param)
            if state and shard.bucket.whole_params:
                state = _flattened(state, param, slots[owner])
            if state:
                chunks.setdefault(owner, []).append((param, state))
    result: dict[int, ParamState] = {}
    for owner, entries in chunks.items():
        first_param, first_state = entries[0]
        merged: ParamState = {}
        for key, value in first_state.items():
            if is_elementwise(value, first_param):
                parts = [state[key] for _, state in entries]
                merged[key] = torch.cat(parts) if len(parts) > 1 else value
            else:
                merged[key] = value
        result[owner] = merged
    return result


def _flattened(state: dict[str, Any], param: Tensor, slot: ParamSlot) -> dict[str, Any]:
    """A whole param's state with its element-wise values (of the param's shape) flattened in
    the slot's memory order, as the pieces of element-wise classes are; other values (Adafactor's
    row and column factors) as they are."""
    return {
        key: flatten_to_slot(value, slot) if is_elementwise(value, param) else value
        for key, value in state.items()
    }


def _unflattened(state: ParamState, param: Tensor, slot: ParamSlot) -> dict[str, Any]:
    """The inverse of :func:`_flattened` for a whole param's local state: a 1-D value of the
    param's numel becomes a tensor of the param's shape and strides (for a 1-D param it already
    is one); other values are copied as they are."""
    return {
        key: view_slot(value.clone(), slot)
        if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == param.numel()
        else _copy(value)
        for key, value in state.items()
    }


def load_param_states(
    inner: torch.optim.Optimizer,
    shards: list[LocalShard],
    states: dict[int, ParamState],
    groups: list[dict[str, Any]],
) -> None:
    """Replace the inner state by per-param local states (element-wise values of the local
    elements in param order, as :func:`param_states` returns them) and set the groups'
    hyperparameters, through ``torch.optim.Optimizer.load_state_dict`` so dtypes and devices are
    handled as torch does. Params missing from ``states`` get no state, as in torch."""
    position = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    offsets: dict[int, int] = {}
    inner_state: dict[int, dict[str, Any]] = {}
    for shard in shards:
        slots = {slot.param_index: slot for slot in shard.bucket.slots}
        for param, owner in zip(shard.inner_params, shard.inner_owners, strict=True):
            state = states.get(owner)
            start = offsets.get(owner, 0)
            offsets[owner] = start + param.numel()
            if not state:
                continue
            if shard.bucket.whole_params:
                inner_state[position[id(param)]] = _unflattened(state, param, slots[owner])
                continue
            # Scalars are cloned per inner param: optimizers update ``step`` in place, so a
            # tensor shared by a param's chunks would be advanced once per chunk.
            inner_state[position[id(param)]] = {
                key: _local_part(value, start, param.numel())
                if _is_local_elementwise(value)
                else _copy(value)
                for key, value in state.items()
            }
    configured = [
        {**hyperparameters(group), "params": inner_group["params"]}
        for inner_group, group in zip(inner.param_groups, groups, strict=True)
    ]
    inner.load_state_dict({"state": inner_state, "param_groups": indexed_groups(configured)})


def indexed_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``param_groups`` whose params are replaced by consecutive indices, as
    ``torch.optim.Optimizer.state_dict`` numbers them."""
    groups, start = [], 0
    for group in param_groups:
        count = len(group["params"])
        groups.append({**hyperparameters(group), "params": list(range(start, start + count))})
        start += count
    return groups


def is_elementwise(value: Any, inner_param: Tensor) -> bool:
    """Whether a state value is per element of ``inner_param`` (``exp_avg``...) rather than a
    scalar (``step``). Inner params are 1-D, scalars 0-dim, so the shape tells them apart."""
    return isinstance(value, Tensor) and value.shape == inner_param.shape


def _local_part(value: Tensor, start: int, numel: int) -> Tensor:
    """Elements ``[start, start + numel)`` of a param's local state; all of it as it is when
    that is all (a quantized value, whose pieces are never chunked, cannot be sliced
    everywhere)."""
    return value if start == 0 and value.numel() == numel else value[start : start + numel]


def _is_local_elementwise(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value
