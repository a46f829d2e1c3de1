"""PEFT/LoRA under ``ShardingStage1``: frozen base weights cost nothing.

``get_peft_model`` leaves the base weights with ``requires_grad=False``; AdamW over the trainable
(LoRA) params is wrapped as any optimizer. On 2 ranks: optimizer state is AdamW's 8 bytes per
trainable param split over the ranks (4 per rank, plus bucket padding), the frozen base adds no
grads, state or communication, and training matches a plain AdamW over the full batch on the
same process, with the base weights untouched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness.dist_helper import run_ranks
from tests.harness.integrations_common import (
    PARAM_ATOL,
    max_diff,
    params_of,
    quiet_rank,
    tiny_gpt2,
    token_ids,
)

STEPS = 4
GLOBAL_BATCH = 4
RANK_TIMEOUT_S = 300.0
PADDING_ALLOWANCE_BYTES = 4096
"""Per rank: alignment and per-bucket padding of a few small LoRA buckets (256-byte alignment,
padded to world_size * 256 per bucket)."""


def _lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT zeroes B; non-zero values make every LoRA param move
            torch.nn.init.normal_(param, std=0.02)
    return model


def _train(model, optimizer, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _lora_job() -> dict:
    from sharded_opt import ShardingStage1

    quiet_rank()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = list(token_ids()[: STEPS * GLOBAL_BATCH].split(GLOBAL_BATCH))
    per_rank = GLOBAL_BATCH // world_size

    plain = _lora_model()
    base_before = {n: p.detach().clone() for n, p in plain.named_parameters() if not p.requires_grad}
    _train(plain, torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2), batches)

    model = _lora_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = ShardingStage1(torch.optim.AdamW(trainable, lr=1e-2), overlap=True, model=model)
    _train(model, optimizer, [b[rank * per_rank : (rank + 1) * per_rank] for b in batches])
    optimizer.sync_params()
    return {
        "trainable_numel": sum(p.numel() for p in trainable),
        "frozen_numel": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "state_bytes": optimizer.optimizer_state_bytes(),
        "memory": optimizer.memory_bytes(),
        "param_diff": max_diff(params_of(model), params_of(plain)),
        "base_moved": max_diff({n: params_of(model)[n] for n in base_before}, base_before),
    }


def test_lora_state_is_sharded_and_training_matches() -> None:
    results = run_ranks(_lora_job, 2, timeout_s=RANK_TIMEOUT_S)
    for result in results:
        trainable, frozen = result["trainable_numel"], result["frozen_numel"]
        assert 0 < trainable < frozen
        # AdamW: exp_avg and exp_avg_sq, fp32, half of them on each of 2 ranks.
        assert 4 * trainable <= result["state_bytes"] + PADDING_ALLOWANCE_BYTES
        assert result["state_bytes"] <= 4 * trainable + PADDING_ALLOWANCE_BYTES
        # Frozen base weights: no grad buffers, no reduced grads, no state.
        assert result["memory"]["grads"] <= 4 * trainable + PADDING_ALLOWANCE_BYTES
        assert result["param_diff"] <= PARAM_ATOL
        assert result["base_moved"] == 0.0
    assert sum(r["state_bytes"] for r in results) >= 8 * results[0]["trainable_numel"]
