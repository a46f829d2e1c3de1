"""Flat param and grad buffers that execute a :class:`~fusion.layout.LayoutPlan`.

After construction every laid-out param's ``.data`` is a view into its bucket's flat param
buffer (contiguous, or with the param's own strides, see Note [Memory format] in ``layout``)
and, once the bucket has a grad buffer, its ``.grad`` a view of the same shape and strides into
that buffer, so a bucket's params or grads can be handed to one collective or one optimizer
kernel as a single tensor (except in a bucket that stages its grads: there ``.grad`` stays
autograd's tensor and :meth:`FlatBuffers.stage_grads` copies it in, see Note [Staged grads] in
``layout``). A bucket of params that were frozen when the plan was made gets its
grad buffer only when :meth:`FlatBuffers.allocate_grads` is called (a param of it was unfrozen),
so frozen weights cost no grad memory. This module knows nothing of communication; it only owns
memory and views.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from fusion.layout import BucketPlan, LayoutPlan, ParamSlot

_grad_of = operator.attrgetter("grad")

_LAID_OUT_IN: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Each param -> a weak reference to the :class:`FlatBuffers` that laid it out last (see
:meth:`FlatBuffers.owns`). Kept here rather than on the param, so pickles and copies of params
carry nothing of it (``torch.load(weights_only=True)`` of a saved param keeps working)."""


class FlatBuffers:
    """One flat param tensor per bucket of ``plan`` and, for buckets that need one, a flat grad
    tensor.

    Args:
        plan: the layout to execute.
        params: the params the plan was made for, in the same order; entries whose slot is
            ``None`` in the plan are left untouched.

    Param values are copied in unchanged; padding is zero. A grad the param already had is
    copied into its view, so wrapping after a backward loses nothing. Grad buffers are allocated
    at once for buckets planned with ``requires_grad`` and on demand for the others.
    """

    def __init__(self, plan: LayoutPlan, params: list[Tensor]) -> None:
        if len(params) != len(plan.slots):
            raise ValueError(
                f"FlatBuffers expects {len(plan.slots)} params (one per planned slot) but got {len(params)}"
            )
        self.plan = plan
        self.params = params
        self.param_buffers: list[Tensor] = []
        self.grad_buffers: list[Tensor | None] = [None] * len(plan.buckets)
        self.param_views: list[Tensor | None] = [None] * len(params)
        self.grad_views: list[Tensor | None] = [None] * len(params)
        self.grad_addresses: list[int | None] = [None] * len(params)
        """Where each grad view starts in its bucket's grad buffer (see :meth:`adopt_grad`)."""
        self.laid_out_indices = [slot.param_index for bucket in plan.buckets for slot in bucket.slots]
        with torch.no_grad():
            for bucket in plan.buckets:
                self._allocate_params(bucket)
                if bucket.requires_grad:
                    self.allocate_grads(bucket.index)
        self._laid_out_params = [params[index] for index in self.laid_out_indices]
        self._slot_addresses = [self.param_views[index].data_ptr() for index in self.laid_out_indices]  # type: ignore[union-attr]

    def _allocate_params(self, bucket: BucketPlan) -> None:
        param_buffer = torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
        for slot in bucket.slots:
            param = self.params[slot.param_index]
            param_view = view_slot(param_buffer[slot.offset : slot.offset + slot.numel], slot)
            param_view.copy_(param.detach())
            param.data = param_view
            _LAID_OUT_IN[param] = weakref.ref(self)
            self.param_views[slot.param_index] = param_view
        self.param_buffers.append(param_buffer)

    @torch.no_grad()
    def allocate_grads(self, bucket_index: int) -> bool:
        """Give the bucket its grad buffer and its params their grad views (a grad a param
        already has is copied in, unless its shape is not the param's: ``param.data`` was
        replaced by a tensor of another shape, as ``resize_token_embeddings`` does, and a grad
        of the old shape means nothing for it); return False if the bucket already had one.
        A bucket that stages its grads keeps the views to itself and ``.grad`` as it is."""
        if self.grad_buffers[bucket_index] is not None:
            return False
        bucket = self.plan.buckets[bucket_index]
        grad_buffer = torch.zeros_like(self.param_buffers[bucket_index])
        for slot in bucket.slots:
            param = self.params[slot.param_index]
            grad_view = view_slot(grad_buffer[slot.offset : slot.offset + slot.numel], slot)
            self.grad_views[slot.param_index] = grad_view
            self.grad_addresses[slot.param_index] = grad_view.data_ptr()
            if bucket.staged_grads:
                continue
            if param.grad is not None and param.grad.shape == param.shape:
                grad_view.copy_(param.grad)
            param.grad = grad_view
        self.grad_buffers[bucket_index] = grad_buffer
        return True

    def param_shard(self, bucket_index: int, rank: int) -> Tensor:
        """``rank``'s shard of the bucket's flat param buffer (a view)."""
        start, end = self.plan.buckets[bucket_index].shard_range(rank)
        return self.param_buffers[bucket_index][start:end]

    def grad_shard(self, bucket_index: int, rank: int) -> Tensor:
        """``rank``'s shard of the bucket's flat grad buffer (a view); the bucket must have one."""
        start, end = self.plan.buckets[bucket_index].shard_range(rank)
        return self._grad_buffer(bucket_index)[start:end]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every grad buffer in place (one kernel per bucket) and keep grads attached; the
        grads that are the params' own (a bucket that stages them, or one without a grad buffer
        whose params got a grad all the same) are set to None, or zeroed in place, as torch's
        ``zero_grad(set_to_none)`` does."""
        for bucket_index, grad_buffer in enumerate(self.grad_buffers):
            if grad_buffer is None or self.plan.buckets[bucket_index].staged_grads:
                self._zero_own_grads(bucket_index, set_to_none)
                continue
            for slot in self.plan.buckets[bucket_index].slots:
                self._reattach_grad_view(slot.param_index, keep_values=False)  # zeroed next
                self.params[slot.param_index].grad = self.grad_views[slot.param_index]
            grad_buffer.zero_()

    def _zero_own_grads(self, bucket_index: int, set_to_none: bool) -> None:
        params = [self.params[slot.param_index] for slot in self.plan.buckets[bucket_index].slots]
        if set_to_none:
            for param in params:
                param.grad = None
            return
        grads = [grad for grad in map(_grad_of, params) if grad is not None]
        for grad in grads:  # as torch.optim.Optimizer.zero_grad: out of any graph first
            if grad.grad_fn is not None:
                grad.detach_()
            else:
                grad.requires_grad_(False)
        if grads:
            torch._foreach_zero_(grads)

    @torch.no_grad()
    def stage_grads(self, bucket_index: int) -> list[bool]:
        """Copy the params' own grads into the grad buffer of a bucket that stages them (zeros
        where a param has none, and in the padding), in one foreach copy; return per slot
        whether its param has a grad. See Note [Staged grads] in ``layout``."""
        slots = self.plan.buckets[bucket_index].slots
        grads = [self.params[slot.param_index].grad for slot in slots]
        present = [grad is not None for grad in grads]
        views = [self.grad_views[slot.param_index] for slot, has in zip(slots, present, strict=True) if has]
        self._grad_buffer(bucket_index).zero_()
        if views:
            torch._foreach_copy_(views, [grad for grad in grads if grad is not None])
        return present

    def adopt_grad(self, param_index: int) -> bool:
        """Make ``param.grad`` its buffer view again; return True if it had to be re-pointed.

        Code outside the wrapper may set ``.grad = None`` (``model.zero_grad()``) or assign a new
        tensor. ``None`` means "no grad": the view is zeroed. A foreign tensor's values are copied
        into the view. A grad that already is the view is left alone, values included, but put
        back into the buffer if its own ``.data`` was replaced (see
        :meth:`_reattach_grad_view`). The param's bucket must have a grad buffer.
        """
        param = self.params[param_index]
        view = self.grad_views[param_index]
        grad = param.grad
        if grad is view:
            if view is not None:
                self._reattach_grad_view(param_index)
            return False
        if view is None:
            raise RuntimeError(f"FlatBuffers.adopt_grad: param {param_index}'s bucket has no grad buffer")
        # The view itself may have been moved out of the buffer with the grad it was then
        # (``model.to(torch.device("cpu", 0))`` copies it); its old values are overwritten here.
        self._reattach_grad_view(param_index, keep_values=False)
        with torch.no_grad():
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
        param.grad = view
        return True

    def _reattach_grad_view(self, param_index: int, keep_values: bool = True) -> None:
        """Point a grad view whose ``.data`` was replaced back into its bucket's grad buffer,
        keeping the tensor object (hooks and ``param.grad`` hold it) and, with ``keep_values``,
        its values.

        ``nn.Module._apply`` (``model.to(memory_format=...)``, ``model.cpu()``) replaces
        ``param.grad.data`` as well as ``param.data``: the grad view then no longer aliases the
        buffer, backward accumulates into memory the collectives never read, and the step would
        use zeros or stale grads for that param (a channels_last conversion after wrapping left
        a conv's first step 7e-3 off plain torch)."""
        view = self.grad_views[param_index]
        if view is None or view.data_ptr() == self.grad_addresses[param_index]:
            return
        slot = self.plan.slot(param_index)
        grad_buffer = self._grad_buffer(slot.bucket_index)
        home = view_slot(grad_buffer[slot.offset : slot.offset + slot.numel], slot)
        if keep_values:
            with torch.no_grad():
                home.copy_(view)
        view.data = home

    def zero_grad_view(self, param_index: int) -> None:
        """Zero a param's slot in its grad buffer, leaving ``param.grad`` as it is."""
        view = self.grad_views[param_index]
        if view is None:
            raise RuntimeError(f"FlatBuffers.zero_grad_view: param {param_index}'s bucket has no grad buffer")
        self._reattach_grad_view(param_index, keep_values=False)
        with torch.no_grad():
            view.zero_()

    def adopt_param(self, param_index: int) -> None:
        """Copy the values of a param whose ``.data`` was replaced (``param.data = t``) into its
        slot and make ``.data`` the slot's view again. The replacement must have the param's
        shape, dtype and device (see :meth:`conversion_of`)."""
        param, view = self.params[param_index], self.param_views[param_index]
        if view is None or param.shape != view.shape or self.conversion_of(param_index) is not None:
            raise RuntimeError(f"FlatBuffers.adopt_param: param {param_index} no longer fits its slot")
        with torch.no_grad():
            view.copy_(param.data)
        param.data = view

    def conversion_of(self, param_index: int) -> str | None:
        """How a param's dtype or device now differs from what it was laid out as (after
        ``model.half()`` or ``model.to(device)``, which replace ``param.data``), or None."""
        param, view = self.params[param_index], self.param_views[param_index]
        if param.dtype != view.dtype:
            return f"is now {param.dtype} but was laid out as {view.dtype}"
        if param.device != view.device:
            return f"is now on {param.device} but was laid out on {view.device}"
        return None

    def detached_params(self) -> list[int]:
        """Indices of params whose ``.data`` no longer lives in the flat buffer."""
        return [
            index
            for index in self.laid_out_indices
            if self.params[index].data_ptr() != self.param_views[index].data_ptr()
        ]

    def any_param_detached(self) -> bool:
        """Whether :meth:`detached_params` is not empty, in one C-level pass (cheap enough for a
        check before every forward)."""
        return list(map(Tensor.data_ptr, self._laid_out_params)) != self._slot_addresses

    def owns(self, param_index: int) -> bool:
        """Whether the param was last laid out here: a newer ``FlatBuffers`` over the same params
        (a new wrapper built while this one is alive) takes them over."""
        owner = _LAID_OUT_IN.get(self.params[param_index])
        return owner is not None and owner() is self

    def _grad_buffer(self, bucket_index: int) -> Tensor:
        grad_buffer = self.grad_buffers[bucket_index]
        if grad_buffer is None:
            raise RuntimeError(f"FlatBuffers: bucket {bucket_index} has no grad buffer yet")
        return grad_buffer


def view_slot(flat: Tensor, slot: ParamSlot) -> Tensor:
    """``flat`` (the ``slot.numel`` elements of one slot, 1-D and contiguous) as a tensor of the
    param's shape and strides: a view, see Note [Memory format]."""
    if slot.strides is None:
        return flat.view(slot.shape)
    return flat.as_strided(slot.shape, slot.strides)


def flatten_to_slot(tensor: Tensor, slot: ParamSlot) -> Tensor:
    """``tensor`` (of the param's shape) as 1-D, in the slot's memory order; the inverse of
    :func:`view_slot`."""
    if slot.strides is None:
        return tensor.reshape(-1)
    laid_out = torch.empty_strided(slot.shape, slot.strides, dtype=tensor.dtype, device=tensor.device)
    laid_out.copy_(tensor)
    return laid_out.as_strided((slot.numel,), (1,))
