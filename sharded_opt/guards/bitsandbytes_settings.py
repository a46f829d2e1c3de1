"""What ShardingStage1 reads off, and refuses in, bitsandbytes' 8-bit Adam(W) (0.50).

Their state per param is ``step`` (an int) and, for a param of ``min_8bit_size`` elements or
more, uint8 codes ``state1``/``state2`` of its shape, one fp32 scale ``absmax1``/``absmax2`` per
block of 256 elements (the last block possibly partial) and the code books ``qmap1``/``qmap2``
(fp32 ``state1``/``state2`` below the threshold). Their math is element-wise given the blocks,
so pieces cut on block edges step as the whole param (Note [Cuts on quantization blocks] in
``fusion/block_layout.py``), except where a setting looks at a whole param or at the param
object itself, which :func:`check_shardable` refuses.
"""

from __future__ import annotations

from typing import Any

import torch

BLOCK_NUMEL = 256
"""bitsandbytes' block: hard-coded in 0.50 (``init_state`` and its CPU kernel)."""
PER_BLOCK_KEYS = ("absmax1", "absmax2")
SAVED_UNDER = "__bnb_optimizer_quant_state__"
"""Where bitsandbytes' ``state_dict()`` nests its tensors (an FSDP workaround); its
``load_state_dict`` takes them nested or not."""
SAVED_KEYS = frozenset({"qmap1", "qmap2", "state1", "state2", "absmax1", "absmax2"})
"""The keys of ``Optimizer8bit.non_castable_tensor_keys`` that AdamW8bit and Adam8bit keep."""


def min_8bit_size(optimizer: torch.optim.Optimizer) -> int:
    """The fewest elements the instance quantizes (a constructor argument kept in ``args``)."""
    return int(optimizer.args.min_8bit_size)


def constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The instance's ``args`` (``min_8bit_size``, ``max_unorm``, ``skip_zeros``), which its
    ``defaults`` lack: a copy built without them would quantize with the default threshold."""
    return {"args": optimizer.args}


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse the settings whose numbers a rank stepping pieces cannot reproduce.

    Raises:
        ValueError: paged state, ``max_unorm > 0`` (a norm over the whole param's update) or
            per-param ``GlobalOptimManager`` overrides (keyed by the param object or its
            position, which the pieces do not share).
    """
    name = type(optimizer).__name__
    if getattr(optimizer, "is_paged", False):
        raise ValueError(
            f"ShardingStage1 expects an unpaged bitsandbytes optimizer but got {name} with "
            "is_paged=True; paged state is not tested under sharding. Use bnb.optim.AdamW8bit or "
            "Adam8bit with is_paged=False (sharding already divides the state by the world size)"
        )
    if float(optimizer.args.max_unorm) > 0:
        raise ValueError(
            f"ShardingStage1 expects {name} with max_unorm=0 but got max_unorm="
            f"{optimizer.args.max_unorm}: it clips each param's update by the norm over the whole "
            "param, which a rank holding a piece cannot compute. Drop max_unorm (or clip grads "
            "with ShardingStage1.clip_grad_norm_)"
        )
    _check_no_overrides(optimizer)


def _check_no_overrides(optimizer: torch.optim.Optimizer) -> None:
    manager = optimizer.mng
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    overridden = [i for i in manager.pid2config if i in ids]
    if overridden or manager.index2config or manager.module_weight_config_triple:
        raise ValueError(
            f"ShardingStage1 expects {type(optimizer).__name__} without bitsandbytes "
            "GlobalOptimManager overrides but the manager holds some (override_config / "
            "register_module_override): they are keyed by param object or position, which the "
            "pieces the wrapper steps do not share, so they would silently not apply. Remove the "
            "overrides (e.g. put such params in their own optimizer), or do not shard this optimizer"
        )
