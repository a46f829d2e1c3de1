"""``StepGrads``: the grads the last ``step()`` used, to tell whether they changed since.

Note [A step without backward]
    torch's ``step()`` reads ``param.grad``, and after a step those are the grads it stepped
    with, averaged (by DDP), clipped, unscaled: a second ``step()`` with no backward in between
    (an SAM-like loop, a retried step, a skipped iteration without ``zero_grad()``) steps again
    with exactly them. Here ``param.grad`` holds the local grads and the averaged shard the
    optimizer stepped sits in the shard's own tensors; reducing the local grads again would
    drop a clip or an unscaling done on the shard (and on some world sizes round the mean anew).
    So ``step()`` records the grad buffers' versions and which params' grads are the buffers'
    views, and the next reduction (``step()``, ``clip_grad_norm_``, ``clip_grad_value_``, the
    scaler's) reuses the shard's grads when nothing changed since: no backward accumulated
    (it bumps the buffer's version), no ``zero_grad`` ran, no grad was assigned or set to None.
    Only the presence flags are shared again, so params without a grad stay unstepped.
"""

from __future__ import annotations

import operator

from torch import Tensor

from fusion.buffers import FlatBuffers

_Snapshot = tuple[list[int | None], list[bool], list[Tensor | None], list[int | None]]
"""Grad buffer versions, grads that are views, staged grads and their versions."""


class StepGrads:
    """What tells whether grads changed since the last ``step()``: the grad buffers' versions,
    which params' grads are their buffer views, and the staged grads themselves with their
    versions (Note [Staged grads] in ``fusion.layout``); see Note [A step without backward].

    Args:
        buffers: the flat buffers whose grads are watched.
        staged_indices: the params of buckets that stage their grads, whose ``.grad`` tensors
            are autograd's own.
    """

    def __init__(self, buffers: FlatBuffers, staged_indices: list[int]) -> None:
        self._buffers = buffers
        self._staged_indices = staged_indices
        self._at_step: tuple[list[int | None], list[bool], list[Tensor | None], list[int | None]] | None = (
            None
        )

    def record(self) -> None:
        """The grads just stepped with."""
        staged = self._staged_grads()
        self._at_step = self._grad_versions(), self._grads_are_views(), staged, _versions(staged)

    def forget(self) -> None:
        """Grads changed, or were discarded: no step's grads to reuse."""
        self._at_step = None

    def unchanged(self) -> bool:
        """Whether the grads are exactly those of the last recorded step."""
        if self._at_step is None:
            return False
        versions, are_views, staged, staged_versions = self._at_step
        staged_now = self._staged_grads()
        return (
            versions == self._grad_versions()
            and are_views == self._grads_are_views()
            and all(map(operator.is_, staged, staged_now))
            and staged_versions == _versions(staged_now)
        )

    def _grad_versions(self) -> list[int | None]:
        return [None if buffer is None else buffer._version for buffer in self._buffers.grad_buffers]

    def _grads_are_views(self) -> list[bool]:
        views = self._buffers.grad_views
        return [param.grad is views[index] for index, param in enumerate(self._buffers.params)]

    def _staged_grads(self) -> list[Tensor | None]:
        return [self._buffers.params[index].grad for index in self._staged_indices]


def _versions(grads: list[Tensor | None]) -> list[int | None]:
    return [None if grad is None else grad._version for grad in grads]
