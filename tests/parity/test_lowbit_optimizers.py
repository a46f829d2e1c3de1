"""torchao's low-bit Adam(W) (state quantized per block) under ShardingStage1 on 2 and 3 gloo
ranks, against the same class in one process (Note [Cuts on quantization blocks] in
``fusion/block_layout.py``). The model and loops: ``tests/harness/lowbit.py``.

Tolerances: against one process over the whole batch, the project's fp32 parity tolerance
(rtol=1e-6, atol=1e-7) is for AdamW's fp32 state; quantized state rounds each moment to its
code, and a last-bit difference in a grad can move a value across a code boundary, so the
comparison is bitwise against one process that averages the same slice grads as the reduction
does (``tests/parity/test_lowbit_combinations.py`` measures the whole-batch gap, and compares
with DDP).

torchao compiles its step per tensor shape (tens of seconds on a loaded 2-core CPU the first
time; inductor's cache keeps them), so the runs share one spawn per world size and the model is
small.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.harness.lowbit import (
    Run,
    assert_params_equal,
    assert_same_state,
    assert_state_is_shared_out,
    make_model,
    make_optimizer,
    sharded_runs_fixture,
    train_plain,
)

pytest.importorskip("torchao.optim")
pytestmark = pytest.mark.timeout(1800)  # torchao compiles its step per shape, see above

RUNS = {
    "adamw8bit_sync": Run("AdamW8bit", overlap=False),
    "adamw8bit_overlap": Run("AdamW8bit", overlap=True),
    "adamw4bit_overlap": Run("AdamW4bit", overlap=True),
    "adamwfp8_sync": Run("AdamWFp8", overlap=False),
}


sharded_runs = sharded_runs_fixture(RUNS)


@pytest.mark.parametrize("name", list(RUNS))
def test_bitwise_equal_to_one_process_averaging_the_same_slices(sharded_runs, name: str) -> None:
    world_size, results = sharded_runs
    assert_params_equal(results[name], train_plain(RUNS[name], slices=world_size)["params"])


def test_resumed_from_a_plain_state_dict_is_bitwise_the_plain_run(sharded_runs) -> None:
    world_size, results = sharded_runs
    expected = train_plain(RUNS["adamw8bit_sync"], slices=world_size)["params"]
    assert_params_equal(results["resumed_from_plain"], expected)


@pytest.mark.parametrize("name", list(RUNS))
def test_state_dict_is_the_plain_classs_own_and_loads_into_it(sharded_runs, name: str) -> None:
    """The wrapper saves torchao's format (codes, scales and code book of each quantized
    moment, plain tensors for the others), equal to the plain run's; the plain class loads it
    and steps on as the plain run does."""
    world_size, results = sharded_runs
    plain = train_plain(RUNS[name], slices=world_size)
    want = plain["optimizer"].state_dict()
    for result in results[name]:
        assert_same_state(torch.load(io.BytesIO(result["state_dict"]), weights_only=False), want)
    saved = torch.load(io.BytesIO(results[name][0]["state_dict"]), weights_only=False)
    model = make_model()
    with torch.no_grad():
        for param, value in zip(model.parameters(), plain["params"], strict=True):
            param.copy_(value)
    reloaded = make_optimizer(RUNS[name].cls, model.parameters())
    reloaded.load_state_dict(saved)
    assert_same_state(reloaded.state_dict(), want)


@pytest.mark.parametrize("name", list(RUNS))
def test_state_per_rank_is_a_share_of_the_plain_classs(sharded_runs, name: str) -> None:
    """Each code, scale and plain moment's element on exactly one rank, one set of code books
    per rank (Note [Shared code books]), and each rank within its 1/N share plus the two fp32
    moments of the model's largest param kept plain (the 4097-element gain): the layout
    spreads those over the ranks (Note [Cuts on quantization blocks])."""
    _, results = sharded_runs
    plain = train_plain(RUNS[name])["optimizer"]
    assert_state_is_shared_out(results[name], plain, slack=4097 * 8)


def test_params_are_cut_on_blocks() -> None:
    """The model's largest weight is cut (so the runs above step pieces of a quantized param)."""
    from fusion.block_layout import BlockGrid
    from fusion.layout import ParamSpec, plan_layout

    model = make_model()
    specs = [ParamSpec.of(p, 0) for p in model.parameters()]
    index = [p is model.fc1.weight for p in model.parameters()].index(True)
    for world_size in (2, 3):
        plan = plan_layout(specs, world_size, bucket_size_bytes=64 * 1024, block_grid=BlockGrid(256, 4096))
        bucket = plan.buckets[plan.slot(index).bucket_index]
        pieces = [p for r in range(world_size) for p in bucket.shard_pieces(r) if p.param_index == index]
        assert len(pieces) == world_size and all(p.param_start % 256 == 0 for p in pieces)


@pytest.mark.parametrize("cls", ["AdamW8bit", "AdamW4bit", "AdamWFp8", "Adam8bit"])
@pytest.mark.parametrize("numel", [4096, 300])
def test_the_fresh_state_the_wrapper_builds_is_torchaos_own(cls: str, numel: int) -> None:
    """``torchao_state.fresh_state`` (what a piece gets before its first step when its own size
    would decide otherwise than its param) is the state the class builds itself: for a tensor
    it quantizes (4096 elements) and one it keeps plain (300), the same keys, kinds and inner
    tensors, and one step from it is bitwise the class's own first step. Guards the copy of
    torchao's initialization against a torchao that changes it."""
    from sharded_opt.guards.torchao_state import fresh_state

    generator = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator)
    results = []
    for prefill in (False, True):
        param = torch.nn.Parameter(values.clone())
        param.grad = grad.clone()
        optimizer = make_optimizer(cls, [param])
        if prefill:
            optimizer.state[param] = fresh_state(optimizer, optimizer.param_groups[0], param, numel >= 4096)
        with torch.compiler.set_stance("force_eager"):
            optimizer.step()
        results.append((param.detach().clone(), optimizer.state_dict()))
    (own_param, own_state), (param, state) = results
    assert torch.equal(param, own_param)
    assert_same_state(state, own_state)
