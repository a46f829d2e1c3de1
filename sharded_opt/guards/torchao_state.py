"""How torchao's low-bit Adam(W) (0.18) builds a tensor's state, so a piece gets its param's kind.

torchao decides per tensor it is given: at its first step a tensor of 4096 elements or more that
holds whole blocks gets quantized moments, any other plain ones (``_AdamBase._new_buffer``).
Sharded, the tensor is a rank's piece of a param, so left alone a piece would decide by its own
size: a small piece of a quantized param would keep fp32 moments, a whole-blocks piece of a
plain 1000 x 5000 weight quantized ones. :func:`fresh_state` builds the state torchao would
have built for the piece had it decided as for the whole param, and the wrapper sets it before
the piece's first step (Note [Cuts on quantization blocks] in ``fusion/block_layout.py``).
torchao then steps it as it finds it, quantized or not, block by block: the numbers are the
whole param's. ``tests/parity/test_lowbit_optimizers.py`` checks that this is the state each
class builds for itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def fresh_state(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], tensor: Tensor, quantized: bool
) -> dict[str, Any]:
    """torchao's state of ``tensor`` before its first step (``_AdamBase.step``'s initialization):
    ``step`` 0 and zero moments, quantized by the class's own ``_subclass_zeros`` on its block
    size when ``quantized``, plain ``zeros_like`` otherwise."""

    def moment(signed: bool) -> Tensor:
        if quantized:
            zeros = type(optimizer)._subclass_zeros(tensor, signed, optimizer.block_size)
            return zeros.to(tensor.device)
        return torch.zeros_like(tensor)

    state: dict[str, Any] = {"step": torch.tensor(0.0), "exp_avg": moment(True), "exp_avg_sq": moment(False)}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = moment(False)
    return state
