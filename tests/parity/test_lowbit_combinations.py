"""torchao's low-bit Adam(W) (and bitsandbytes' AdamW8bit) under ShardingStage1 combined with the
rest of the wrapper: global clipping, ``ShardedGradScaler`` with fp16 params and fp32 masters,
bf16 params with and without fp32 masters, hybrid sharding (2 x 2), and DDP as the reference
users compare with. The model and loops: ``tests/harness/lowbit.py``; the cut rules:
Note [Cuts on quantization blocks] in ``fusion/block_layout.py``.

Every comparison is bitwise, against one process that averages the same slice grads in fp32 as
the ranks' reduction does (quantized state turns a last-bit difference of a grad into a code a
step apart, so no tolerance would tell a bug from rounding; see
``tests/parity/test_lowbit_optimizers.py``). Where the sharded run sums something in another
order than torch, the reference takes the sharded value: clipping uses the sharded run's global
norm, which is compared with torch's norm of the same grads separately (rtol 1e-5, as
``tests/precision`` does).

The runs step the same fp32 pieces as ``test_lowbit_optimizers.py`` (masters are fp32), so
torchao's compiled steps are mostly inductor cache hits; the bf16 run without masters compiles
its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.harness.dist_helper import run_ranks
from tests.harness.lowbit import (
    BATCH,
    INF_STEP,
    INIT_SCALE,
    STEPS,
    Run,
    batch,
    loss_of,
    make_model,
    make_optimizer,
    train_plain,
    train_sharded,
)

pytest.importorskip("torchao.optim")
pytestmark = pytest.mark.timeout(1800)  # torchao compiles its step per shape and dtype

CLIP_NORM = 0.05
"""Below every step's global grad norm of the model (checked), so clipping is active."""

RUNS = {
    "clip_overlap": Run("AdamWFp8", overlap=True, clip_norm=CLIP_NORM),
    "clip_sync": Run("AdamW8bit", clip_norm=CLIP_NORM),
    "scaler_fp16_fp32_master": Run(
        "AdamW8bit", overlap=True, param_dtype=torch.float16, master_dtype=torch.float32, scaler=True
    ),
    "bf16_fp32_master": Run(
        "AdamW4bit", overlap=True, param_dtype=torch.bfloat16, master_dtype=torch.float32
    ),
    "bf16_no_master": Run("AdamW8bit", overlap=True, param_dtype=torch.bfloat16),
    "fp32_overlap": Run("AdamW8bit", overlap=True),
    # bitsandbytes' AdamW8bit (cut by its own rules: 4096 or more each side of a block edge).
    "bnb_clip_sync": Run("bnb.AdamW8bit", clip_norm=CLIP_NORM),
    "bnb_scaler_fp16_fp32_master": Run(
        "bnb.AdamW8bit", overlap=True, param_dtype=torch.float16, master_dtype=torch.float32, scaler=True
    ),
    "bnb_bf16_fp32_master": Run(
        "bnb.AdamW8bit", overlap=True, param_dtype=torch.bfloat16, master_dtype=torch.float32
    ),
}
HYBRID_RUN = Run("AdamW8bit", overlap=True, clip_norm=CLIP_NORM, degree=2)


def _train_ddp(run: Run) -> list[torch.Tensor]:
    """The plain class over the whole params, its grads averaged by DDP over the same slices."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(run.param_dtype)
    ddp = DistributedDataParallel(model)
    opt = make_optimizer(run.cls, model.parameters())
    size = BATCH // world_size
    for step in range(STEPS):
        inputs, targets = batch(step, run)
        opt.zero_grad()
        part = slice(rank * size, (rank + 1) * size)
        loss_of(ddp, inputs[part], targets[part]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _two_rank_job(runs: list[Run]) -> dict:
    return {"sharded": [train_sharded(run) for run in runs], "ddp": _train_ddp(RUNS["fp32_overlap"])}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[dict]]:
    per_rank = run_ranks(_two_rank_job, 2, list(RUNS.values()))
    results = {name: [r["sharded"][i] for r in per_rank] for i, name in enumerate(RUNS)}
    results["ddp"] = [r["ddp"] for r in per_rank]
    return results


@pytest.fixture(scope="module")
def hybrid_ranks() -> list[dict]:
    return run_ranks(train_sharded, 4, HYBRID_RUN)


def _assert_bitwise(results: list[dict], expected: list[torch.Tensor]) -> None:
    for rank, result in enumerate(results):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert got.dtype == want.dtype, (rank, index, got.dtype, want.dtype)
            assert torch.equal(got, want), (
                f"rank {rank} param {index}: {(got.float() - want.float()).abs().max()}"
            )


def _assert_clipped_alike(results: list[dict], run: Run, slices: int) -> None:
    """Bitwise params given the sharded norms; those norms are torch's within summation order
    and above the threshold at every step (clipping was active)."""
    norms = results[0]["norms"]
    for result in results[1:]:
        assert [float(n) for n in result["norms"]] == [float(n) for n in norms]  # ranks agree bitwise
    reference = train_plain(run, slices=slices, norms=norms)
    _assert_bitwise(results, reference["params"])
    torch.testing.assert_close(torch.stack(norms), torch.stack(reference["norms"]), rtol=1e-5, atol=0)
    assert min(float(n) for n in norms) > CLIP_NORM


@pytest.mark.parametrize("name", ["clip_overlap", "clip_sync", "bnb_clip_sync"])
def test_clipped_by_the_global_norm(two_ranks, name: str) -> None:
    _assert_clipped_alike(two_ranks[name], RUNS[name], slices=2)


@pytest.mark.parametrize("name", ["scaler_fp16_fp32_master", "bnb_scaler_fp16_fp32_master"])
def test_grad_scaler_with_fp16_params_and_fp32_masters(two_ranks, name: str) -> None:
    """``ShardedGradScaler`` against ``torch.amp.GradScaler`` over the plain class on fp32
    masters: the step whose last sample holds an inf is skipped on both ranks, the scale halves
    once, and every other step is the plain one bitwise."""
    results = two_ranks[name]
    reference = train_plain(RUNS[name], slices=2)
    assert reference["scale"] == INIT_SCALE / 2 and 0 <= INF_STEP < STEPS
    for result in results:
        assert result["scale"] == reference["scale"]
    _assert_bitwise(results, reference["params"])


@pytest.mark.parametrize("name", ["bf16_fp32_master", "bnb_bf16_fp32_master"])
def test_bf16_params_with_fp32_masters_step_the_masters(two_ranks, name: str) -> None:
    """The wrapper steps fp32 masters of its pieces, so the reference is the plain class over
    fp32 masters of the bf16 params, cast back after every step (not the plain class over the
    bf16 params, which keeps bf16 state for small params and rounds every update to bf16)."""
    _assert_bitwise(two_ranks[name], train_plain(RUNS[name], slices=2)["params"])


def test_bf16_params_without_masters_are_the_plain_class_on_bf16(two_ranks) -> None:
    """Without ``master_dtype`` the pieces are bf16, as the params are for the plain class: the
    grads averaged in fp32 and rounded to bf16, bf16 state for small params, bf16 updates."""
    results = two_ranks["bf16_no_master"]
    _assert_bitwise(results, train_plain(RUNS["bf16_no_master"], slices=2)["params"])


def test_equal_to_ddp_over_the_same_slices(two_ranks) -> None:
    """DDP with the plain class on the same 2 ranks is the run users compare with: it averages
    the same slice grads (halves summed, bitwise the sum halved), so the params are equal
    bitwise, and the two differ alike from one process over the whole batch."""
    ddp = two_ranks["ddp"]
    for result in ddp[1:]:
        for a, b in zip(result, ddp[0], strict=True):
            assert torch.equal(a, b)
    _assert_bitwise(two_ranks["fp32_overlap"], ddp[0])


def test_hybrid_two_by_two_clipped(hybrid_ranks) -> None:
    """Shard groups of 2 ranks, 2 replicas: each group averages its slices, the replicas average
    the groups' means; the norm counts each element once (over the shard group)."""
    _assert_clipped_alike(hybrid_ranks, HYBRID_RUN, slices=4)
