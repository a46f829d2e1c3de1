"""bitsandbytes' 8-bit Adam(W) (state quantized per block of 256, the last block possibly
partial) under ShardingStage1 on 2 and 3 gloo ranks, against the same class in one process that
averages the same slice grads, bitwise (Note [Cuts on quantization blocks] in
``fusion/block_layout.py``; why bitwise against the slices rather than the whole batch: see
``tests/parity/test_lowbit_optimizers.py``). The model and loops: ``tests/harness/lowbit.py``,
with a 20000-element param that bitsandbytes quantizes and the layout cuts.

bitsandbytes steps eagerly on CPU (no compile), so these runs take seconds.
"""

from __future__ import annotations

import io

import pytest
import torch

from fusion.block_layout import BlockGrid
from fusion.layout import ParamSpec
from sharded_opt import ShardingConfig, ShardingStage1
from sharded_opt.guards.optimizer_needs import block_grid_of
from sharded_opt.plan.planner import layout_for
from sharded_opt.step.inner_optimizer import constructor_kwargs
from tests.harness.lowbit import (
    BNB_TAIL_NUMEL,
    Run,
    assert_params_equal,
    assert_same_state,
    assert_state_is_shared_out,
    make_model,
    make_optimizer,
    sharded_runs_fixture,
    train_plain,
)

pytest.importorskip("bitsandbytes")

RUNS = {
    "adamw8bit_sync": Run("bnb.AdamW8bit", overlap=False),
    "adamw8bit_overlap": Run("bnb.AdamW8bit", overlap=True),
    "adam8bit_overlap": Run("bnb.Adam8bit", overlap=True),
}


sharded_runs = sharded_runs_fixture(RUNS)


REFERENCES = {**RUNS, "resumed_from_plain": RUNS["adamw8bit_sync"]}
"""Each sharded run's reference; ``resumed_from_plain`` started from the plain class's
``state_dict()`` (keys nested under ``__bnb_optimizer_quant_state__``), so the wrapper loads it."""


@pytest.mark.parametrize("name", list(REFERENCES))
def test_params_are_bitwise_one_process_averaging_the_same_slices(sharded_runs, name: str) -> None:
    world_size, results = sharded_runs
    assert_params_equal(results[name], train_plain(REFERENCES[name], slices=world_size)["params"])


@pytest.mark.parametrize("name", list(RUNS))
def test_state_dict_is_the_plain_classs_own_and_loads_into_it(sharded_runs, name: str) -> None:
    """The wrapper saves bitsandbytes' format (codes, per-block scales and code books nested as
    its ``state_dict()`` nests them), equal to the plain run's; the plain class loads it."""
    world_size, results = sharded_runs
    plain = train_plain(RUNS[name], slices=world_size)
    want = plain["optimizer"].state_dict()
    for result in results[name]:
        assert_same_state(torch.load(io.BytesIO(result["state_dict"]), weights_only=False), want)
    saved = torch.load(io.BytesIO(results[name][0]["state_dict"]), weights_only=False)
    reloaded = make_optimizer(RUNS[name].cls, make_model(tail_numel=BNB_TAIL_NUMEL).parameters())
    reloaded.load_state_dict(saved)
    assert_same_state(reloaded.state_dict(), want)


@pytest.mark.parametrize("name", list(RUNS))
def test_state_per_rank_is_a_share_of_the_plain_classs(sharded_runs, name: str) -> None:
    """Each code, scale and plain moment's element on exactly one rank, one set of code books
    per rank, and each rank within its 1/N share plus the two fp32 moments of the model's
    largest param kept plain (the 4097-element gain): the layout spreads those over the
    ranks (Note [Cuts on quantization blocks])."""
    _, results = sharded_runs
    plain = train_plain(RUNS[name])["optimizer"]
    assert_state_is_shared_out(results[name], plain, slack=4097 * 8)


@pytest.mark.parametrize("world_size", [2, 3])
def test_params_are_cut_on_blocks_whatever_their_last_block(world_size: int) -> None:
    """The runs above step pieces of quantized params, the one with a partial last block
    included, laid out as the wrapper lays them out."""
    model = make_model(tail_numel=BNB_TAIL_NUMEL)
    grid = block_grid_of(make_optimizer("bnb.AdamW8bit", model.parameters()))
    assert grid == BlockGrid(256, 4096, partial_last_block=True)
    plan = layout_for([ParamSpec.of(p, 0) for p in model.parameters()], world_size, ShardingConfig(), grid)
    for param in (model.fc1.weight, model.tail):
        index = [p is param for p in model.parameters()].index(True)
        bucket = plan.buckets[plan.slot(index).bucket_index]
        pieces = [p for r in range(world_size) for p in bucket.shard_pieces(r) if p.param_index == index]
        assert len(pieces) > 1 and all(p.param_start % 256 == 0 for p in pieces)
        assert all(p.numel >= 4096 for p in pieces)


def _bnb_optimizer(cls: str = "AdamW8bit", **kwargs) -> torch.optim.Optimizer:
    import bitsandbytes.optim

    return getattr(bitsandbytes.optim, cls)(make_model().parameters(), **kwargs)


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: _bnb_optimizer(is_paged=True), ValueError, "with is_paged=True"),
        (lambda: _bnb_optimizer("PagedAdamW8bit"), TypeError, "but got PagedAdamW8bit"),
        (lambda: _bnb_optimizer("LAMB8bit"), TypeError, "LAMB/LARS trust ratios"),
        (lambda: _bnb_optimizer("AdamW"), TypeError, "pass assume_elementwise=True"),
        (
            lambda: _bnb_optimizer(args=_args(max_unorm=1.0)),
            ValueError,
            "with max_unorm=0 but got max_unorm=1.0",
        ),
    ],
)
def test_settings_it_cannot_shard_exactly_are_refused(build, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        ShardingStage1(build())


def test_per_param_overrides_are_refused() -> None:
    from bitsandbytes.optim import GlobalOptimManager

    model = make_model()
    manager = GlobalOptimManager.get_instance()
    manager.override_config(model.fc1.weight, "optim_bits", 32)
    try:
        optimizer = make_optimizer("bnb.AdamW8bit", model.parameters())
        with pytest.raises(ValueError, match="without bitsandbytes GlobalOptimManager overrides"):
            ShardingStage1(optimizer)
    finally:
        manager.initialize()


def _args(**overrides) -> object:
    from bitsandbytes.optim.optimizer import MockArgs

    return MockArgs(
        {"optim_bits": 8, "min_8bit_size": 4096, "max_unorm": 0.0, "skip_zeros": False, **overrides}
    )


def test_the_pieces_are_stepped_with_the_instances_threshold() -> None:
    """``min_8bit_size`` lives in bitsandbytes' ``args``, not in ``defaults``: the inner
    optimizer and the layout both take it from the instance."""
    optimizer = _bnb_optimizer(min_8bit_size=8192)
    assert constructor_kwargs(optimizer)["args"].min_8bit_size == 8192
    assert block_grid_of(optimizer) == BlockGrid(256, 8192, partial_last_block=True)
