"""``ParamGuard``: params whose ``.data`` was replaced after wrapping, and models whose grads
another data-parallel wrapper would write, caught where they would otherwise go wrong silently.

Note [Params replaced after wrapping]
    Code outside the wrapper replaces ``param.data`` rather than writing into it: WGAN and
    old scripts write ``p.data = p.data.clamp(-c, c)``, weight loading code assigns
    ``p.data = tensor``, and cuDNN's ``flatten_parameters`` on a GPU moves an RNN's weights into
    a new blob of its own (after ``model.cuda()``, or when it finds them scattered). In plain
    torch the param simply holds the new values from then on. Here the optimizer steps the flat
    buffer, so ``step()`` (and ``clip_grad_norm_``) first takes such a param back: the new
    values are copied into its slot and ``.data`` is pointed at the slot again, as
    ``adopt_grad`` does for an assigned grad. Its grads keep flowing meanwhile: a param's grad
    hook stops reporting only when a newer wrapper takes the param, never because ``.data``
    moved. What cannot be taken back raises: a new dtype or device (``model.half()``,
    ``model.to(...)``), a new shape, or memory of another param (``a.data = b.data`` ties two
    params, which separate slots cannot). Every rank must replace alike, as every write to
    params must be.

    A new shape (Hugging Face's ``resize_token_embeddings`` after wrapping) would not even reach
    ``step()``: the next backward fails inside autograd adding the new-shape grad to the param's
    old-shape grad view. So the attached model's first forward pre-hook refuses it in forwards
    with grad enabled (one C-level pass over the params' data pointers per forward; forwards
    without grad, such as ``generate()``, work as in torch). The fix it names, a new optimizer
    and wrapper, must work while the old wrapper lives on: the new layout drops the leftover
    grad of the old shape (in torch it would be None after ``zero_grad()``), and the old
    wrapper's check passes over params a newer layout took (``FlatBuffers.owns``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fusion.buffers import FlatBuffers
from sharded_opt.guards.messages import DROP_DDP
from sharded_opt.model_hooks.param_hooks import register_eager_pre_hook


class ParamWaiter(Protocol):
    """Waits until every param holds its updated value (no all-gather still writing them)."""

    def finish_param_sync(self) -> None: ...


class ParamGuard:
    """Takes back params whose ``.data`` was replaced, or refuses where that cannot be right
    (Note [Params replaced after wrapping]); refuses a ``DistributedDataParallel`` added around
    the attached model (Note [Grads written at the end of backward] in ``grad_hooks``).

    Args:
        buffers: the flat buffers the params should be views of.
        params_ready: waits for the all-gathers before a param is taken back.
    """

    def __init__(self, buffers: FlatBuffers, params_ready: ParamWaiter) -> None:
        self._buffers = buffers
        self._params_ready = params_ready
        self._param_names: dict[int, str] = {}
        """Per param index, its name in the attached model (for the errors)."""

    def watch(self, model: nn.Module) -> RemovableHandle:
        """Check each forward of the attached ``model`` (:meth:`check_before_forward` as its first
        forward pre-hook) and name its params in the errors; returns the hook's handle, which
        ``close()`` removes."""
        names = {id(param): name for name, param in model.named_parameters()}
        self._param_names = {
            index: names[id(param)] for index, param in enumerate(self._buffers.params) if id(param) in names
        }
        return register_eager_pre_hook(model, self.check_before_forward)

    def take_back_replaced(self) -> None:
        """Take back params whose ``.data`` was replaced, or raise where that cannot be right;
        see Note [Params replaced after wrapping]."""
        moved = self._buffers.detached_params()
        if not moved:
            return
        self._refuse_unadoptable(moved)
        # An all-gather still running must not land over the adopted values.
        self._params_ready.finish_param_sync()
        for index in moved:
            self._buffers.adopt_param(index)

    def check_before_forward(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of the attached model, for forwards with grad enabled (forwards
        without grad, ``generate()`` and evaluation, work as in torch).

        A ``DistributedDataParallel`` added around the model after wrapping (as Hugging Face
        Trainer, Accelerate and Lightning do) is refused at its first forward, see Note [Grads
        written at the end of backward] in ``grad_hooks``. A param that ``param.data = t`` gave
        another shape (``model.resize_token_embeddings(n)`` after wrapping) is refused instead of
        by torch's shape error when the next backward adds its grad to the old-shape grad view,
        see Note [Params replaced after wrapping]."""
        if not torch.is_grad_enabled():
            return
        if nn.parallel.DistributedDataParallel._active_ddp_module is not None:
            self._refuse_data_parallel(nn.parallel.DistributedDataParallel._active_ddp_module)
        with torch._C.DisableTorchFunction():  # plain pointer reads, never the read guard's waits
            if not self._buffers.any_param_detached():
                return
            moved = [index for index in self._buffers.detached_params() if self._buffers.owns(index)]
        self._refuse_reshaped(moved)

    def _refuse_data_parallel(self, wrapper: nn.Module) -> None:
        ours = {id(param) for param in self._buffers.params}
        if any(id(param) in ours for param in wrapper.parameters()):
            raise RuntimeError(
                "ShardingStage1: the model runs inside a DistributedDataParallel wrapper added "
                "after the optimizer was wrapped (the accelerator of Hugging Face Trainer, Accelerate "
                "and Lightning adds one: use the adapters of sharded_opt.integrations). It would "
                f"average the grads a second time. {DROP_DDP}"
            )

    def refuse_converted_before_zero_grad(self) -> None:
        """``zero_grad()`` points every grad at its buffer view again; a param that
        ``model.half()`` or ``model.to(...)`` moved out of the buffers (or gave a new shape) is
        refused with the fix, instead of torch's "assign a gradient with dtype 'float' to a
        tensor with grad_dtype 'Half'"; see Note [Params replaced after wrapping]."""
        with torch._C.DisableTorchFunction():  # plain pointer reads, never the read guard's waits
            if not self._buffers.any_param_detached():
                return
            moved = [index for index in self._buffers.detached_params() if self._buffers.owns(index)]
        self._refuse_converted(moved)
        self._refuse_reshaped(moved)

    def _refuse_unadoptable(self, moved: list[int]) -> None:
        self._refuse_converted(moved)
        self._refuse_reshaped(moved)
        params = self._buffers.params
        flat = {buffer.untyped_storage().data_ptr() for buffer in self._buffers.param_buffers}
        aliased = [index for index in sorted(moved) if params[index].untyped_storage().data_ptr() in flat]
        if aliased:
            raise RuntimeError(
                f"ShardingStage1: params {aliased[:8]} (optimizer order) were pointed at another "
                "param's memory (`param.data = other.data`); the wrapper keeps every param in a slot "
                "of its own, so the two would no longer be tied. Tie params before building the "
                "optimizer (`module.weight = other.weight`) and wrap it then"
            )

    def _refuse_converted(self, moved: list[int]) -> None:
        converted = [(index, self._buffers.conversion_of(index)) for index in sorted(moved)]
        converted = [(index, change) for index, change in converted if change is not None]
        if converted:
            index, change = converted[0]
            raise RuntimeError(
                f"ShardingStage1: param {self._describe_param(index)} {change} ({len(converted)} "
                "param(s) converted, e.g. by model.half() or model.to(...) after wrapping), so it "
                "no longer lives in the flat buffers and updates would be lost. Cast or move the "
                "model before building the optimizer and wrapping it"
            )

    def _refuse_reshaped(self, moved: list[int]) -> None:
        params, views = self._buffers.params, self._buffers.param_views
        reshaped = [index for index in sorted(moved) if params[index].shape != views[index].shape]
        if reshaped:
            index = reshaped[0]
            raise RuntimeError(
                f"ShardingStage1: `param.data = ...` gave param {self._describe_param(index)} the shape "
                f"{tuple(params[index].shape)} but it was laid out as {tuple(views[index].shape)} (Hugging "
                "Face's model.resize_token_embeddings(n) does this); the optimizer's state and the flat "
                "buffers cannot change shape. Resize the model before building the optimizer and "
                "wrapping it, or build a new optimizer and ShardingStage1 after resizing (close() this one)"
            )

    def _describe_param(self, index: int) -> str:
        name = self._param_names.get(index)
        return f"{index} (optimizer order{'' if name is None else f', {name!r}'})"
