"""Lightning precision plugins that clip through ``ShardingStage1`` (global norm, averaged grads).

Lightning clips in its precision plugin (``Precision.clip_gradients``), with torch's
``clip_grad_norm_``/``clip_grad_value_`` over ``param.grad``: here the local, unreduced grads, which
the wrapper refuses to see written after backward. ``MixedPrecision`` also refuses to clip for any
optimizer that unscales inside ``step()`` (torch's ``_step_supports_amp_scaling``, which the
wrapper declares so that ``ShardedGradScaler`` can hand it the scale). Each plugin here is
Lightning's own class with ``clip_gradients`` going to ``opt.clip_grad_norm_`` /
``opt.clip_grad_value_`` for a ``ShardingStage1`` (after ``scaler.unscale_`` under fp16), and the
fp16 scaler is a ``ShardedGradScaler``, so every rank skips the same steps.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from sharded_opt.grad_scaler import ShardedGradScaler
from sharded_opt.optimizer import ShardingStage1

__all__ = ["with_global_clipping"]


class _GlobalClipping:
    """Clipping of a ``ShardingStage1``'s averaged grads; other optimizers as Lightning clips them."""

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        sharded = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        if clip_val <= 0 or not isinstance(sharded, ShardingStage1):
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]
        scaler = getattr(self, "scaler", None)
        if scaler is not None:
            scaler.unscale_(sharded)  # MixedPrecision leaves it to step() for this optimizer
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            sharded.clip_grad_value_(clip_val)
        else:
            sharded.clip_grad_norm_(clip_val)


class _ShardedPrecision(_GlobalClipping, Precision):
    pass


class _ShardedMixedPrecision(_GlobalClipping, MixedPrecision):
    pass


class _ShardedHalfPrecision(_GlobalClipping, HalfPrecision):
    pass


class _ShardedDoublePrecision(_GlobalClipping, DoublePrecision):
    pass


def with_global_clipping(plugin: Precision) -> Precision:
    """The same precision setting as ``plugin``, clipping through the sharded optimizer.

    Raises:
        ValueError: a plugin other than Lightning's plain, mixed, half or double precision
            (bitsandbytes, Transformer Engine, ...), which the strategy cannot rebuild.
    """
    if isinstance(plugin, _GlobalClipping):
        return plugin
    if type(plugin) is Precision:
        return _ShardedPrecision()
    if type(plugin) is MixedPrecision:
        return _ShardedMixedPrecision(plugin.precision, plugin.device, _sharded_scaler(plugin))
    if type(plugin) is HalfPrecision:
        return _ShardedHalfPrecision(plugin.precision)
    if type(plugin) is DoublePrecision:
        return _ShardedDoublePrecision()
    raise ValueError(
        "ShardingStage1Strategy expects precision '32-true', '16-mixed', 'bf16-mixed', '16-true', "
        f"'bf16-true' or '64-true' but got the plugin {type(plugin).__name__}"
    )


def _sharded_scaler(plugin: MixedPrecision) -> torch.amp.GradScaler | None:
    """fp16's scaler with the same settings as a ``ShardedGradScaler`` (each rank would check
    only its local grads with torch's, and the wrapper refuses a step driven by it)."""
    scaler = plugin.scaler
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        plugin.device,
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
    )
