"""Hooks that neither keep the wrapper alive nor travel with copies of the model.

Note [Hook lifetimes and copies]
    The wrapper installs hooks on the user's objects: post-accumulate-grad hooks on params,
    forward pre-hooks and state-dict hooks on modules, a step pre-hook on the wrapped torch
    optimizer. Those objects usually outlive the wrapper (a sweep or a notebook builds a new
    optimizer over the same model), so every hook refers to its owner weakly: once the owner is
    collected the hook does nothing, and the owner's finalizer removes the hooks altogether
    (``ShardingStage1.close()`` does the same at once).

    A hook is stored in the hooked object's hook dict, so ``copy.deepcopy(model)``,
    ``torch.save(model)`` and ``torch.optim.swa_utils.AveragedModel(model)`` copy it along. A
    hook that holds the process group cannot be pickled, and a live one would make the copy's
    forward wait for the original's collectives. So a copied or unpickled hook is
    :class:`InertHook`: the copy carries a do-nothing entry and never touches the wrapper.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle


class InertHook:
    """What a :class:`WeakMethodHook` becomes in a copy of the hooked object: does nothing."""

    __slots__ = ()

    def __call__(self, *args: Any) -> None:
        return None


class CopiesAsInert:
    """Mixin of hooks whose copies and pickles are :class:`InertHook` (see Note [Hook lifetimes
    and copies]): a copied model must not call back into the original's wrapper."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict) -> InertHook:
        return InertHook()

    def __copy__(self) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        return (InertHook, ())


class WeakMethodHook(CopiesAsInert):
    """Call ``method(*bound_args, *hook_args)`` while ``method``'s object is alive; afterwards do
    nothing. Copies and pickles are :class:`InertHook` (see Note [Hook lifetimes and copies])."""

    __slots__ = ("_method", "_bound_args")

    def __init__(self, method: Callable[..., Any], *bound_args: Any) -> None:
        self._method = weakref.WeakMethod(method)
        self._bound_args = bound_args

    def __call__(self, *hook_args: Any) -> Any:
        method = self._method()
        if method is None:
            return None
        return method(*self._bound_args, *hook_args)


def remove_handles(handles: list[RemovableHandle]) -> None:
    """Remove every hook in ``handles`` and empty the list."""
    for handle in handles:
        handle.remove()
    handles.clear()


def register_accumulate_hook(param: Tensor, hook: Callable[[Tensor], None]) -> RemovableHandle:
    """``param``'s post-accumulate-grad hook, frozen params included (see
    ``GradReadyTracker.scan`` in ``grad_hooks``): torch refuses to register one on a tensor
    that does not require grad, but keeps it on the tensor, where the param's grad accumulator
    finds it once the param is unfrozen; so the flag is set for the registration only (no torch
    function mode sees it)."""
    if param.requires_grad:
        return param.register_post_accumulate_grad_hook(hook)
    with torch._C.DisableTorchFunction():
        param.requires_grad_(True)
        try:
            return param.register_post_accumulate_grad_hook(hook)
        finally:
            param.requires_grad_(False)


def retire_hooks(params: list[Tensor], hook_type: type) -> None:
    """Silence the hooks of ``hook_type`` (each with a ``retired`` flag) that an older tracker (a
    previous wrapper still alive, not yet closed or collected) left on ``params``: the params'
    grads now belong to the new tracker's buffers. Ownership is decided here, once, and not by
    where ``param.data`` lives, so a param whose data the user replaced (Note [Params replaced
    after wrapping] in ``param_guard``) keeps reporting its grads."""
    for param in params:
        hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
        for hook in hooks.values():
            if isinstance(hook, hook_type):
                hook.retired = True
