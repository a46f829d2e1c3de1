"""On CPU the inner optimizer steps cache-sized chunks of each flat shard; chunking must not
change a bit of the math or of the state dict (one rank, so the reference is exact)."""

from __future__ import annotations

import torch
from torch import nn

from sharded_opt import ShardingStage1
from sharded_opt.step.local_shard import CPU_CHUNK_BYTES


def _wide_model() -> nn.Module:
    torch.manual_seed(0)
    # 300K fp32 weights: several chunks in one bucket, and a small bias in the same bucket.
    return nn.Sequential(nn.Linear(600, 500), nn.Tanh(), nn.Linear(500, 3))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(8, 600, generator=generator)
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()


def test_chunked_step_and_state_dict_are_bitwise_plain(single_rank_group) -> None:
    plain_model, wrapped_model = _wide_model(), _wide_model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    wrapped = ShardingStage1(torch.optim.AdamW(wrapped_model.parameters(), lr=1e-3))
    shards = wrapped.shards.live_shards()
    owners = [owner for shard in shards for owner in shard.inner_owners]
    assert max(owners.count(owner) for owner in owners) > 1, "the test needs a param cut into chunks"
    inner_params = [p for shard in shards for p in shard.inner_params]
    assert max(c.numel() * c.element_size() for c in inner_params) <= CPU_CHUNK_BYTES

    _train(plain_model, plain, range(3))
    _train(wrapped_model, wrapped, range(3))
    for a, b in zip(plain_model.parameters(), wrapped_model.parameters(), strict=True):
        assert torch.equal(a, b)

    saved = wrapped.state_dict()
    expected = plain.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(saved["state"][index][key], value), (index, key)

    # Load the plain state into a fresh wrapper; both continue identically.
    resumed_model = _wide_model()
    resumed_model.load_state_dict(plain_model.state_dict())
    resumed = ShardingStage1(torch.optim.AdamW(resumed_model.parameters(), lr=1e-3))
    resumed.load_state_dict(expected)
    _train(plain_model, plain, range(3, 5))
    _train(resumed_model, resumed, range(3, 5))
    for a, b in zip(plain_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
