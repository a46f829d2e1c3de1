"""Global grad-norm clipping and bf16 params with fp32 master shards, against single-process
references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from sharded_opt import ShardingStage1
from tests.harness.dist_helper import run_ranks
from tests.harness.training import (
    ATOL,
    GLOBAL_BATCH,
    RTOL,
    RunConfig,
    make_model,
    train_many,
    train_reference,
)

CLIP_CONFIGS = {
    "l2_sync": RunConfig(optimizer="adamw", clip_norm=0.05),
    "l2_overlap": RunConfig(optimizer="adamw", clip_norm=0.05, overlap=True),
    "inf_overlap": RunConfig(optimizer="sgd", clip_norm=0.02, clip_norm_type=math.inf, overlap=True),
    "l2_data_parallel": RunConfig(optimizer="adamw", clip_norm=0.05, enable=False),
}

# bf16 params, fp32 master shards, against a reference that computes the same per-rank bf16
# grads and averages them in fp32 (see train_reference). What remains is the order of the fp32
# averaging, which can flip the bf16 rounding of a master value: one bf16 ulp (2^-8 relative).
BF16_RTOL, BF16_ATOL = 2**-8, 1e-5
# Reducing in bf16 on 3 ranks: gloo's ring adds the three bf16 grads in another order than the
# reference's left fold, so a sum can round one bf16 ulp apart, and Adam can turn that into a
# fraction of an lr-sized (1e-2) step. Measured here: at most 2e-3 after 10 steps.
BF16_REDUCE_ATOL = 4e-3
MIXED_CONFIGS = {
    "bf16_fp32_master": RunConfig(optimizer="adamw", param_dtype=torch.bfloat16, master_dtype=torch.float32),
    "bf16_fp32_master_overlap": RunConfig(
        optimizer="adamw_groups", param_dtype=torch.bfloat16, master_dtype=torch.float32, overlap=True
    ),
    "bf16_bf16_reduce": RunConfig(
        optimizer="adamw",
        param_dtype=torch.bfloat16,
        master_dtype=torch.float32,
        reduce_dtype=torch.bfloat16,
    ),
}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"world{ws}")
def runs(request) -> dict[str, list[dict]]:
    configs = {**CLIP_CONFIGS, **MIXED_CONFIGS}
    per_rank = run_ranks(train_many, request.param, list(configs.values()))
    return {name: [rank_results[i] for rank_results in per_rank] for i, name in enumerate(configs)}


@pytest.mark.parametrize("name", list(CLIP_CONFIGS))
def test_clip_grad_norm_matches_torch_on_unsharded_grads(runs, name: str) -> None:
    reference = train_reference(CLIP_CONFIGS[name])
    for result in runs[name]:
        torch.testing.assert_close(result["norms"], reference["norms"], rtol=1e-5, atol=0)
        # Clipping was active: the norms exceed the threshold.
        assert min(result["norms"]) > CLIP_CONFIGS[name].clip_norm
        for got, expected in zip(result["params"], reference["params"], strict=True):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(MIXED_CONFIGS))
def test_bf16_params_with_fp32_master_match_reference(runs, name: str) -> None:
    world_size = len(runs[name])
    reference = train_reference(MIXED_CONFIGS[name], grad_slices=world_size)
    atol = BF16_REDUCE_ATOL if MIXED_CONFIGS[name].reduce_dtype == torch.bfloat16 else BF16_ATOL
    for result in runs[name]:
        assert all(p.dtype == torch.bfloat16 for p in result["params"])
        for got, expected in zip(result["params"], reference["params"], strict=True):
            torch.testing.assert_close(got, expected, rtol=BF16_RTOL, atol=atol)
    # Ranks agree bitwise, and the fp32 master keeps state in fp32 for the shard only.
    for result in runs[name][1:]:
        for a, b in zip(result["params"], runs[name][0]["params"], strict=True):
            assert torch.equal(a, b)


def _master_state_dtypes() -> dict:
    from sharded_opt import ShardingConfig, Strategy

    model = make_model(dtype=torch.bfloat16)
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters()),
        strategy=Strategy(sharding=ShardingConfig(master_dtype=torch.float32)),
    )
    optimizer.zero_grad()
    model(torch.randn(GLOBAL_BATCH, 12, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    shards = optimizer.shards.live_shards()
    return {
        "state_dtypes": {
            v.dtype for s in optimizer.shards.inner.state.values() for v in s.values() if v.dim() == 1
        },
        "master_dtypes": {s.master.dtype for s in shards},
        "local_numel": sum(s.master.numel() for s in shards),
        "padded_numel": sum(s.bucket.padded_numel for s in shards),
    }


def test_master_copy_is_fp32_and_covers_the_shard_only() -> None:
    for result in run_ranks(_master_state_dtypes, 2):
        assert result["state_dtypes"] == {torch.float32}
        assert result["master_dtypes"] == {torch.float32}
        assert result["local_numel"] * 2 == result["padded_numel"]


def _clip_nan(error_if_nonfinite: bool) -> str:
    model = make_model()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
    inputs = torch.randn(GLOBAL_BATCH // 2, 12)
    if dist.get_rank() == 1:
        inputs[0, 0] = float("nan")  # a nan on one rank only
    model(inputs).sum().backward()
    try:
        return str(float(optimizer.clip_grad_norm_(1.0, error_if_nonfinite=error_if_nonfinite)))
    except RuntimeError as error:
        optimizer.zero_grad()
        return str(error)


def test_nan_grad_on_one_rank_gives_nan_norm_on_every_rank() -> None:
    assert run_ranks(_clip_nan, 2, False) == ["nan", "nan"]
    for message in run_ranks(_clip_nan, 2, True):
        assert "total norm of order 2.0 is nan" in message


def test_clip_grad_norm_rejects_bad_norm_type(single_rank_group) -> None:
    optimizer = ShardingStage1(torch.optim.SGD(make_model().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="norm_type > 0"):
        optimizer.clip_grad_norm_(1.0, norm_type=0)


def _master_keeps_precision_and_follows_loaded_params() -> dict:
    from sharded_opt import ShardingConfig, Strategy

    model = make_model(dtype=torch.bfloat16)
    optimizer = ShardingStage1(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        strategy=Strategy(sharding=ShardingConfig(master_dtype=torch.float32)),
        overlap=True,
        model=model,
    )
    inputs = torch.randn(
        GLOBAL_BATCH // 2, 12, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3)
    )
    for _ in range(3):
        optimizer.zero_grad()
        model(inputs).sum().backward()
        optimizer.step()
    optimizer.sync_params()
    masters = torch.cat([s.master for s in optimizer.shards.live_shards()])
    keeps_fp32_bits = not torch.equal(masters, masters.to(torch.bfloat16).float())

    # Loading weights into the wrapped model must win over the stale master copy.
    loaded = make_model(seed=5, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    optimizer.zero_grad()
    model(inputs).sum().backward()
    optimizer.step()
    optimizer.sync_params()
    expected = make_model(seed=5, dtype=torch.bfloat16)
    plain = torch.optim.SGD(expected.parameters(), lr=1e-3)
    expected(inputs).sum().backward()
    for param in expected.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
    plain.step()
    follows = all(
        torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-3)
        for a, b in zip(model.parameters(), expected.parameters(), strict=True)
    )
    return {"keeps_fp32_bits": keeps_fp32_bits, "follows_loaded_params": follows}


def test_master_keeps_fp32_bits_and_follows_params_loaded_after_wrapping() -> None:
    for result in run_ranks(_master_keeps_precision_and_follows_loaded_params, 2):
        assert result == {"keeps_fp32_bits": True, "follows_loaded_params": True}


def _scaled_fp16_training(inf_step: int) -> dict:
    from sharded_opt import ShardedGradScaler, ShardingConfig, Strategy

    rank = dist.get_rank()
    model = make_model(dtype=torch.float16)
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        strategy=Strategy(sharding=ShardingConfig(master_dtype=torch.float32)),
        overlap=True,
        model=model,
    )
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    scales, changed = [], []
    for step in range(5):
        inputs = torch.randn(GLOBAL_BATCH // 2, 12, generator=torch.Generator().manual_seed(step)).half()
        if step == inf_step and rank == 1:
            inputs[0, 0] = float("inf")  # an overflow on one rank only
        before = [p.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)  # not opt.zero_grad(): a skipped step must not need it
        scaler.scale(model(inputs).float().square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.sync_params()
        scales.append(scaler.get_scale())
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
    return {"scales": scales, "changed": changed, "params": [p.detach().clone() for p in model.parameters()]}


def test_grad_scaler_skips_the_same_steps_on_every_rank() -> None:
    results = run_ranks(_scaled_fp16_training, 2, 2)
    for result in results:
        assert result["changed"] == [True, True, False, True, True]
        assert result["scales"] == [256.0, 256.0, 128.0, 128.0, 128.0]
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


def _bytes_per_param() -> list[dict[str, float]]:
    from sharded_opt import ShardingConfig, Strategy

    results = []
    for dtype, master in ((torch.float32, None), (torch.bfloat16, torch.float32)):
        # 1024-multiples: no padding, so the bytes per param are exactly the formula's.
        model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 1024)).to(dtype)
        numel = sum(p.numel() for p in model.parameters())
        optimizer = ShardingStage1(
            torch.optim.AdamW(model.parameters()),
            strategy=Strategy(sharding=ShardingConfig(master_dtype=master)),
        )
        optimizer.zero_grad()
        model(torch.randn(2, 1024, dtype=dtype)).sum().backward()
        optimizer.step()
        results.append({key: value / numel for key, value in optimizer.memory_bytes().items()})
    return results


def test_memory_per_param_matches_the_readme_formula() -> None:
    world_size = 4
    fp32, bf16 = run_ranks(_bytes_per_param, world_size)[0]
    # fp32 params and grads, fp32 averaged shard grads, Adam state: 8 + 12/N bytes per param.
    assert fp32["params"] + fp32["grads"] == 8
    assert fp32["reduced_grads"] + fp32["master"] == pytest.approx(4 / world_size)
    assert fp32["optimizer_state"] == pytest.approx(8 / world_size, rel=1e-3)  # + scalar steps
    # bf16 params and grads, fp32 averaged shard grads, fp32 master, Adam state: 4 + 16/N.
    assert bf16["params"] + bf16["grads"] == 4
    assert bf16["reduced_grads"] + bf16["master"] == pytest.approx(8 / world_size)
    assert bf16["optimizer_state"] == pytest.approx(8 / world_size, rel=1e-3)


def _frozen_after_training_then_clipped(overlap: bool, zero_with: str) -> list[float]:
    """Fine-tuning that freezes the first layer after two steps and clips every step: the
    frozen layer's last grads (in its bucket's reduced shard, or left in the grad buffer when
    ``model.zero_grad()`` set them to None) must not count in the norm, as torch's
    ``clip_grad_norm_`` sees no grad for it. Returns the largest difference to plain torch."""
    from sharded_opt import ShardingConfig, Strategy

    rank, world_size = dist.get_rank(), dist.get_world_size()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
    plain_model, model = models
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    sharded = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.0002)),  # the first layer fills buckets
        overlap=overlap,
        model=model,
    )
    for step in range(5):
        if step == 2:
            plain_model[0].requires_grad_(False)
            model[0].requires_grad_(False)
        generator = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(8, 6, generator=generator), torch.randn(8, 2, generator=generator)
        for opt, net, rows in (
            (plain, plain_model, slice(None)),
            (sharded, model, slice(4 * rank, 4 * rank + 4)),
        ):
            if zero_with == "model":
                net.zero_grad()
            else:
                opt.zero_grad()
            torch.nn.functional.mse_loss(net(inputs[rows]), targets[rows]).backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.05)
        sharded.clip_grad_norm_(0.05)
        plain.step()
        sharded.step()
    sharded.sync_params()
    assert world_size == 2
    return [
        (a - b).abs().max().item() for a, b in zip(model.parameters(), plain_model.parameters(), strict=True)
    ]


@pytest.mark.parametrize("zero_with", ["optimizer", "model"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_clip_norm_leaves_out_layers_frozen_after_training(overlap: bool, zero_with: str) -> None:
    for differences in run_ranks(_frozen_after_training_then_clipped, 2, overlap, zero_with):
        assert max(differences) < 1e-6, differences


def _overflow_then_frozen(overlap: bool) -> list[bool]:
    """An overflow in the first layer's grads makes the scaler skip that step; the layer is then
    frozen. Its inf must not stay in the wrapper's reduced grads: torch's scaler sees no grad
    for a frozen layer, so the following steps run. Returns which steps changed the params."""
    from sharded_opt import ShardedGradScaler, ShardingConfig, Strategy

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.0002)),
        overlap=overlap,
        model=model,
    )
    scaler = ShardedGradScaler("cpu", init_scale=2.0**4)
    changed = []
    for step in range(4):
        if step == 2:
            model[0].requires_grad_(False)
        optimizer.zero_grad()
        inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(inputs).square().mean()
        if step == 1:
            loss = loss + model[0].weight.sum() * float("inf")  # an overflow in the first layer only
        before = [p.detach().clone() for p in model[2].parameters()]
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.sync_params()
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, model[2].parameters(), strict=True)))
    return changed


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_scaler_forgets_an_overflow_of_a_layer_frozen_since(overlap: bool) -> None:
    for changed in run_ranks(_overflow_then_frozen, 2, overlap):
        assert changed == [True, False, True, True]


def _scaled_tiny_model() -> list[torch.Tensor]:
    from sharded_opt import ShardedGradScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)  # 3 elements: the ranks after the first hold only padding
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert dist.get_rank() == 0 or not optimizer.shards.inner.param_groups[0]["params"]
    scaler = ShardedGradScaler("cpu", init_scale=2.0**4)
    for step in range(3):
        optimizer.zero_grad()
        inputs = torch.randn(2, 2, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        scaler.scale(model(inputs).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]


def test_scaler_on_ranks_that_hold_no_param_elements() -> None:
    """Every rank joins the scaler's inf all-reduce, also one whose shards are all padding (it
    used to skip it and deadlock the others)."""
    results = run_ranks(_scaled_tiny_model, 3, timeout_s=20)
    for params in results[1:]:
        for a, b in zip(params, results[0], strict=True):
            assert torch.equal(a, b)


def _fp64_norms() -> list[tuple[str, float, float]]:
    """Per norm type: the norm's dtype, and the wrapper's and torch's norm of the averaged
    fp64 grads."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for norm_type in (2.0, 1.0, math.inf):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
        reference = [torch.zeros_like(p) for p in model.parameters()]
        batch = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for slice_rank in range(world_size):
            model.zero_grad()
            model(batch[slice_rank::world_size]).square().mean().backward()
            reference = [total + p.grad for total, p in zip(reference, model.parameters(), strict=True)]
        expected = torch.nn.utils.get_total_norm([total / world_size for total in reference], norm_type)
        opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1))
        opt.zero_grad()
        model(batch[rank::world_size]).square().mean().backward()
        norm = opt.clip_grad_norm_(1e-3, norm_type)
        results.append((str(norm.dtype), norm.item(), expected.item()))
        opt.close()
    return results


def test_clip_grad_norm_of_fp64_params_is_computed_in_fp64() -> None:
    for rank_results in run_ranks(_fp64_norms, 2):
        for dtype, norm, expected in rank_results:
            assert dtype == "torch.float64"
            assert norm == pytest.approx(expected, rel=1e-13), (norm, expected)
