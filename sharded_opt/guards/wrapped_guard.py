"""``WrappedOptimizerGuard``: the torch optimizer a ``ShardingStage1`` wraps, kept from being used
behind the wrapper's back, and its step hooks run around the wrapper's ``step()``.

Note [Step hooks]
    Hooks registered with ``register_step_pre_hook``/``register_step_post_hook`` on the wrapped
    torch optimizer (an EMA update, a logger, a library's bookkeeping), before or after
    wrapping, fire around every ``step()`` of the wrapper, as they fired around the torch
    optimizer's own step: the wrapper registers two hooks of its own, first in its hook lists,
    that run the wrapped optimizer's current hooks with the wrapped optimizer as their first
    argument (a pre-hook may replace the arguments, as in torch). The wrapper's own hooks and
    torch's global ones fire as for any optimizer. The inner optimizer's per-bucket steps are
    an implementation detail: they run its class's step without torch's hook wrapper, so a
    global hook (``register_optimizer_step_post_hook``) fires once per ``step()``, never once
    per bucket with the inner optimizer. When ``ShardedGradScaler`` skips the update, the
    wrapper's step (and its own hooks) still runs, as a fused optimizer's does; the wrapped
    optimizer's hooks fire then only if its class takes ``found_inf`` itself (fused Adam):
    for any other class ``GradScaler.step`` would not have called its ``step`` at all, and an
    EMA hook would average in a step that never happened.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from sharded_opt.model_hooks.weak_hooks import remove_handles

ADD_GROUPS_FIRST = (
    "add every param group to the torch optimizer first, then wrap it. For gradual unfreezing, "
    "give the frozen params their group (and lr) before wrapping and unfreeze them later with "
    "requires_grad_(True): frozen params cost no grad memory and no communication until then"
)


class WrappedOptimizerGuard:
    """Makes ``optimizer`` refuse to be wrapped again while ``wrapper`` lives, and to step,
    save or load its state until :meth:`release` (stepping it is a mistake even after the
    wrapper was dropped: ranks would diverge; its own state is empty, so a checkpoint of it
    would silently hold no moments, and state loaded into it would never be used); forwards
    its step hooks to the wrapper's ``step()``, see Note [Step hooks]; refuses params appended
    to the shared param groups after wrapping.

    Args:
        wrapper: the ``ShardingStage1``, held weakly by ``optimizer``.
        optimizer: the wrapped torch optimizer.
    """

    def __init__(self, wrapper: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        optimizer._sharded_opt_wrapper = weakref.ref(wrapper)
        self._refusals = [
            optimizer.register_step_pre_hook(_refuse_wrapped_step),
            optimizer.register_state_dict_pre_hook(_refuse_wrapped_state_dict),
            optimizer.register_load_state_dict_pre_hook(_refuse_wrapped_load_state_dict),
        ]
        # Note [Step hooks]: first in the wrapper's lists, before any hook a user adds to it.
        self.wrapper_handles: list[RemovableHandle] = [
            wrapper.register_step_pre_hook(self._run_pre_hooks),
            wrapper.register_step_post_hook(self._run_post_hooks),
        ]
        """The hooks on the wrapper, removed with the wrapper's own."""
        optimizer.add_param_group = functools.partial(_refuse_wrapped_add_param_group, type(optimizer))
        self._optimizer_ref = weakref.ref(optimizer)
        self._num_params_per_group = [len(g["params"]) for g in optimizer.param_groups]

    def check_param_groups_unchanged(self, param_groups: list[dict[str, Any]]) -> None:
        """Refuse params appended to the group dicts since wrapping (``group["params"].append(p)``
        goes around ``add_param_group``'s refusal): the layout has no slot for them.
        ``param_groups`` is the wrapper's list, which holds the wrapped optimizer's dicts."""
        counts = [len(g["params"]) for g in param_groups]
        if counts != self._num_params_per_group:
            raise RuntimeError(
                f"ShardingStage1.step: the param groups now hold {counts} params but the wrapper laid "
                f"out {self._num_params_per_group}; params cannot be added after wrapping. Add every "
                "param group to the torch optimizer first, then wrap it"
            )

    def stepped(self) -> None:
        """The wrapper stepped: a scheduler built on the wrapped optimizer checks that its step
        ran before the scheduler's own."""
        self.optimizer._opt_called = True

    def release(self) -> None:
        """The wrapped optimizer works on its own again (``ShardingStage1.close``)."""
        remove_handles(self._refusals)
        original = self._optimizer_ref()
        if original is not None:
            original._sharded_opt_wrapper = None
            original.__dict__.pop("add_param_group", None)

    def _run_pre_hooks(self, wrapper: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The wrapped optimizer's step pre-hooks, see Note [Step hooks]."""
        original = self.optimizer
        hooks = _user_hooks(original._optimizer_step_pre_hooks)
        if not hooks or self._scaler_skips_wrapped_step(wrapper):
            return None
        original_args = (original, *args[1:])
        for hook in hooks:
            result = hook(original, original_args, kwargs)
            if result is None:
                continue
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"the step pre-hook {hook} of the wrapped {type(original).__name__} must return None "
                    f"or a tuple (new_args, new_kwargs) but returned {result!r}"
                )
            original_args, kwargs = result
        return (wrapper, *original_args[1:]), kwargs

    def _run_post_hooks(self, wrapper: Any, args: tuple, kwargs: dict) -> None:
        """The wrapped optimizer's step post-hooks, see Note [Step hooks]."""
        original = self.optimizer
        if self._scaler_skips_wrapped_step(wrapper):
            return
        for hook in _user_hooks(original._optimizer_step_post_hooks):
            hook(original, (original, *args[1:]), kwargs)

    def _scaler_skips_wrapped_step(self, wrapper: Any) -> bool:
        """Whether plain torch would not call the wrapped optimizer's ``step`` at all: a
        ``ShardedGradScaler`` found an inf (the agreed flag it set on the wrapper, as ``GradScaler``
        does) and the wrapped class does not take ``found_inf`` itself, so ``GradScaler.step`` would
        skip it, hooks included. See Note [Step hooks]."""
        found_inf = getattr(wrapper, "found_inf", None)
        if found_inf is None or not getattr(wrapper, "_scaled_by_sharded_scaler", False):
            return False
        return not getattr(self.optimizer, "_step_supports_amp_scaling", False) and float(found_inf) > 0


def _refuse_wrapped_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    raise RuntimeError(
        f"this {type(optimizer).__name__} is wrapped by ShardingStage1; call the wrapper's step()"
    )


def _user_hooks(hooks: dict[int, Callable[..., Any]]) -> list[Callable[..., Any]]:
    return [hook for hook in hooks.values() if hook is not _refuse_wrapped_step]


def _refuse_wrapped_state_dict(optimizer: torch.optim.Optimizer) -> None:
    raise RuntimeError(
        f"this {type(optimizer).__name__} is wrapped by ShardingStage1 and holds none of the "
        "optimizer state (it lives in the wrapper's shards); call the wrapper's state_dict() on "
        "every rank (state_dict(to_rank=0) to keep it on rank 0 only)"
    )


def _refuse_wrapped_load_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    raise RuntimeError(
        f"this {type(optimizer).__name__} is wrapped by ShardingStage1, which would never use state "
        "loaded into it; call the wrapper's load_state_dict(state_dict) on every rank"
    )


def _refuse_wrapped_add_param_group(optimizer_class: type, param_group: dict[str, Any]) -> None:
    raise RuntimeError(
        f"this {optimizer_class.__name__} is wrapped by ShardingStage1, which laid its params out "
        f"when it was built; {ADD_GROUPS_FIRST}"
    )
