"""channels_last params keep their memory format through wrapping, training, state dicts and
checkpoints, and train exactly like plain torch (see Note [Memory format] in fusion.layout)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fusion.layout import ParamSpec
from sharded_opt import ShardingConfig, ShardingStage1, Strategy, load_checkpoint, save_checkpoint
from tests.harness.dist_helper import run_ranks

STEPS = 3
BATCH = 4


def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.Flatten(), nn.Linear(64, 2))
    return model.to(memory_format=torch.channels_last)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        inputs = torch.randn(BATCH, 3, 6, 6, generator=generator).to(memory_format=torch.channels_last)
        targets = torch.randn(BATCH, 2, generator=generator)
        share = BATCH // world_size
        rows = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        optimizer.step()


def _channels_last_run(folder: Path) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Tiny buckets, so params are split between the ranks' shards mid-tensor.
    strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=0.0005))
    model = _conv_model()
    optimizer = ShardingStage1(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy=strategy)
    strides = [tuple(p.stride()) for p in model.parameters()]
    _train(model, optimizer, rank, world_size)
    reference = _conv_model()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train(reference, reference_optimizer, 0, 1)
    state = optimizer.state_dict()
    save_checkpoint(folder / "ckpt", model, optimizer)
    restored = _conv_model()
    restored_optimizer = ShardingStage1(torch.optim.AdamW(restored.parameters(), lr=1e-2), strategy=strategy)
    load_checkpoint(folder / "ckpt", restored, restored_optimizer)
    plain = torch.optim.AdamW(_conv_model().parameters(), lr=1e-2)
    plain.load_state_dict(state)
    return {
        "strides_before": [tuple(p.stride()) for p in _conv_model().parameters()],
        "strides_after": strides,
        "grad_strides": [tuple(p.grad.stride()) for p in model.parameters()],
        "params": [p.detach().clone() for p in model.parameters()],
        "reference_params": [p.detach().clone() for p in reference.parameters()],
        "state": state,
        "reference_state": reference_optimizer.state_dict(),
        "restored_state": restored_optimizer.state_dict(),
        "restored_params": [p.detach().clone() for p in restored.parameters()],
    }


def test_channels_last_trains_like_plain_torch_and_round_trips(tmp_path: Path) -> None:
    for result in run_ranks(_channels_last_run, 2, tmp_path):
        assert result["strides_after"] == result["strides_before"] == result["grad_strides"]
        assert result["strides_after"][0] == (27, 1, 9, 3)  # the first conv weight is channels_last
        for got, expected in zip(result["params"], result["reference_params"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        reference_state = result["reference_state"]["state"]
        for index, entry in result["state"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(entry[key], reference_state[index][key], rtol=1e-5, atol=1e-8)
                restored = result["restored_state"]["state"][index][key]
                assert torch.equal(restored, entry[key])
        for got, expected in zip(result["restored_params"], result["params"], strict=True):
            assert torch.equal(got, expected)


def test_param_spec_keeps_dense_strides_only() -> None:
    channels_last = torch.empty(4, 3, 2, 2).to(memory_format=torch.channels_last)
    assert ParamSpec.of(channels_last, 0).strides == (12, 1, 6, 3)
    assert ParamSpec.of(torch.empty(4, 3), 0).strides is None
    assert ParamSpec.of(torch.empty(4, 6)[:, ::2], 0).strides is None  # gaps: laid out contiguous
    assert ParamSpec.of(torch.empty(3, 4).t(), 0).strides == (1, 4)
    assert ParamSpec.of(torch.empty(4, 8, 1, 1).to(memory_format=torch.channels_last), 0).strides == (
        8,
        1,
        8,
        8,
    )
