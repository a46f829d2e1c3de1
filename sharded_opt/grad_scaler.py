"""A ``torch.amp.GradScaler`` that unscales the reduced shard grads and agrees across ranks.

Note [Loss scaling with sharded grads]
    The stock scaler unscales and checks the grads of ``optimizer.param_groups``: here those are
    the users' local, unreduced grads, which (in overlap mode) were already reduce-scattered
    while still scaled, and whose inf/nan check differs per rank. A rank that alone saw an inf
    would skip ``step()`` while the others enter it: their collectives then wait for a peer that
    never comes, and their scales drift apart. This scaler instead finishes the grad reduction,
    unscales and checks the averaged shard grads the optimizer will step, and takes the maximum
    of the inf flag over the process group (one all-reduce of a scalar), so every rank skips the
    same steps and keeps the same scale. For any other optimizer it is the stock scaler.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharded_opt.optimizer import ShardingStage1


class ShardedGradScaler(torch.amp.GradScaler):
    """Use exactly like ``torch.amp.GradScaler`` (``scale``, ``unscale_``, ``step``, ``update``)
    with a :class:`ShardingStage1`; see Note [Loss scaling with sharded grads]."""

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """As ``GradScaler.step``; a step skipped for an inf also ends the wrapper's iteration,
        so the next backward starts clean whichever way grads are zeroed."""
        result = super().step(optimizer, *args, **kwargs)
        if isinstance(optimizer, ShardingStage1) and optimizer._grads_reduced:
            optimizer._start_iteration()  # the step was skipped: its grads are discarded
        return result

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        if not isinstance(optimizer, ShardingStage1):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        optimizer._reduce_grads()
        per_device = super()._unscale_grads_(optimizer._inner, inv_scale, found_inf, allow_fp16)
        for device_found_inf in per_device.values():
            dist.all_reduce(device_found_inf, op=dist.ReduceOp.MAX, group=optimizer.process_group)
        return per_device
