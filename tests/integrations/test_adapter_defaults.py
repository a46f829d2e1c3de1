"""The adapters default to sync, as ``ShardingStage1`` does (one default across the library)."""

from __future__ import annotations

import inspect

import pytest

from sharded_opt import ShardingConfig


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("sharded_opt.integrations.accelerate", "ShardingStage1Accelerator"),
        ("sharded_opt.integrations.transformers", "ShardingStage1Trainer"),
        ("sharded_opt.integrations.lightning", "ShardingStage1Strategy"),
    ],
)
def test_adapters_default_to_sync_like_the_wrapper(module, name):
    adapter = getattr(pytest.importorskip(module), name)
    assert inspect.signature(adapter.__init__).parameters["overlap"].default is False
    assert ShardingConfig().enable_overlap is False


def test_lightning_registers_zero1():
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    import sharded_opt.integrations.lightning as adapter

    assert StrategyRegistry[adapter.REGISTERED_NAME]["strategy"] is adapter.ShardingStage1Strategy
