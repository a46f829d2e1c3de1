"""Per-module waits for the all-gathered params, so the next forward overlaps the all-gather.

Note [No stale params]
    After ``step()`` in overlap mode with a model attached, the updated params are still being
    all-gathered when ``step()`` returns. A forward pre-hook on every module that directly owns
    laid-out params waits for each bucket holding any of them, whatever the bucket order, so a
    module can never run on last step's weights even if its params were registered in a
    different order than forward uses them (the cause of stale weights in Megatron-LM #950). The
    all-gathers themselves are issued in one fixed order on every rank (registration order), as
    collectives must be.

    The contract: a module's own params are current when its forward starts. Code that reads
    params outside the forward of the module that owns them (evaluation code reading weights,
    a parent module reaching into a child's weight, checkpointing) must call
    ``ShardingStage1.sync_params()`` first; ``step()``, ``state_dict()`` and the wrapper's other
    entry points do so themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

from fusion.buffers import FlatBuffers


class ParamReadyWaiter:
    """Forward pre-hooks on ``model``'s modules that wait for their params' buckets.

    Raises:
        ValueError: ``model`` does not own every param the optimizer trains.
    """

    def __init__(
        self,
        model: nn.Module,
        buffers: FlatBuffers,
        finish_param_sync: Callable[[Iterable[int]], None],
    ) -> None:
        bucket_of = {
            id(buffers.params[slot.param_index]): slot.bucket_index
            for bucket in buffers.plan.buckets
            for slot in bucket.slots
        }
        owned = {id(param) for param in model.parameters()}
        missing = [index for index in buffers.laid_out_indices if id(buffers.params[index]) not in owned]
        if missing:
            raise ValueError(
                f"ShardingStage1.attach expects the model that owns the optimizer's params but "
                f"{len(missing)} param(s) (optimizer indices {missing[:8]}) are not in "
                f"{type(model).__name__}.parameters(); attach the model the optimizer was built from"
            )
        self._handles: list[RemovableHandle] = []
        for module in model.modules():
            buckets = sorted(
                {bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of}
            )
            if buckets:
                hook = functools.partial(_wait_for_buckets, finish_param_sync, tuple(buckets))
                self._handles.append(module.register_forward_pre_hook(hook))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _wait_for_buckets(
    finish_param_sync: Callable[[Iterable[int]], None],
    buckets: tuple[int, ...],
    module: nn.Module,
    args: tuple,
) -> None:
    finish_param_sync(buckets)
