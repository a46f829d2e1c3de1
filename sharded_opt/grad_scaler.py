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

    The wrapper declares torch's ``_step_supports_amp_scaling``, so ``GradScaler.step`` hands it
    ``grad_scale`` and ``found_inf`` instead of skipping ``step()`` itself. With this scaler the
    flag is the agreed one and the wrapper skips or unscales accordingly; with the stock scaler
    the flag is one rank's own, so the wrapper refuses the step with an error naming this class.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharded_opt.optimizer import ShardingStage1


class ShardedGradScaler(torch.amp.GradScaler):
    """Use exactly like ``torch.amp.GradScaler`` (``scale``, ``unscale_``, ``step``, ``update``)
    with a :class:`ShardingStage1`; see Note [Loss scaling with sharded grads]."""

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """As ``GradScaler.step``. With a :class:`ShardingStage1`, the wrapper's step receives
        the agreed inf flag and the scale (torch's ``_step_supports_amp_scaling`` protocol),
        unscales the reduced grads itself and skips the step on every rank alike."""
        if not isinstance(optimizer, ShardingStage1):
            return super().step(optimizer, *args, **kwargs)
        optimizer._scaled_by_sharded_scaler = True
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            optimizer._scaled_by_sharded_scaler = False

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        if not isinstance(optimizer, ShardingStage1):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        _refuse_fp16_steps(optimizer)
        optimizer.grad_sync.reduce_grads()
        if not _any_param_has_grad(optimizer):
            # No param has a grad on any rank (a step with no backward since opt.zero_grad()):
            # no flag at all, so GradScaler.step raises on every rank as it does in torch.
            return {}
        per_device = super()._unscale_grads_(optimizer.shards.inner, inv_scale, found_inf, allow_fp16)
        optimizer.grad_sync.tracker.accept_grad_writes()
        # The stock method has a flag only for devices where this rank's shard has grads, and a
        # rank can hold no param elements at all (a small model: its shards are all padding). So
        # every rank gives a flag for each device of the wrapper's buckets, in one order, and
        # every rank joins the same all-reduces.
        for device in sorted({bucket.device for bucket in optimizer.plan.buckets}, key=str):
            if device not in per_device:
                per_device[device] = found_inf.to(device, copy=True)
            # Replicas hold equal shards (hybrid sharding): the shard group sees every element.
            dist.all_reduce(per_device[device], op=dist.ReduceOp.MAX, group=optimizer.shards.comm.group)
        return per_device


def _any_param_has_grad(optimizer: ShardingStage1) -> bool:
    """Whether some param got a grad on some rank (the agreed presence flags: alike everywhere)."""
    return any(bucket.params_with_grads() for bucket in optimizer.shards.buckets)


def _refuse_fp16_steps(optimizer: ShardingStage1) -> None:
    """Refuse fp16 grads stepped without a master copy, as the stock scaler does for every
    optimizer but torch's fused ones (whose kernels unscale in fp32): unscaled in fp16, small
    grads flush to zero. The wrapper declares ``_step_supports_amp_scaling`` like the fused
    optimizers, so without this check it would train where plain torch refuses."""
    if any(group.get("fused") for group in optimizer.param_groups):
        return
    if any(bucket.precision.master_dtype == torch.float16 for bucket in optimizer.shards.buckets):
        raise ValueError(
            "ShardedGradScaler: attempting to unscale FP16 gradients, which torch.amp.GradScaler "
            "refuses too (small grads would flush to zero). Keep an fp32 master copy: "
            "Strategy(sharding=ShardingConfig(master_dtype=torch.float32)), or keep the params in "
            "fp32 and use torch.autocast"
        )
