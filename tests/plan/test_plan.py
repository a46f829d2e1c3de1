"""The planner (``sharded_opt.plan``): its bytes held and sent against the wrapper's own
``memory_bytes()`` and ``wire_bytes()`` on spawned gloo ranks, exact and compressed, its cost model
on stated numbers, its command line and its errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.plan import (
    AlphaBeta,
    Cluster,
    ComputeTimes,
    LinkModel,
    ModePlan,
    TrainingPlan,
    format_plan,
    plan_training,
)
from sharded_opt.plan.__main__ import main
from sharded_opt.plan.model import resolve_optimizer
from sharded_opt.plan.schedule import BucketCosts, StepCosts, Transfer, simulate
from tests.harness.dist_helper import run_ranks

COMPUTE = ComputeTimes(forward_s=0.1, backward_s=0.2, step_s=0.03)
FAST_LINK = LinkModel.stated(100.0, latency_us=10)


class OddNet(nn.Module):
    """Sizes that force padding at every world size, a scalar param packed between larger ones,
    and enough bytes for several default buckets (they are at least 64 KiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(37, 301)
        self.scale = nn.Parameter(torch.ones(()))
        self.middle = nn.Linear(301, 299)
        self.last = nn.Linear(299, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)) * self.scale)))


def odd_net() -> nn.Module:
    return OddNet()


class LowBitNet(nn.Module):
    """OddNet's input with weights torchao quantizes: 37 x 1024 (148 blocks of 256, cut on its
    blocks on 2 and 3 ranks) and 1024 x 5 (quantized, too small to cut: whole on one rank);
    biases too small to quantize."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(37, 1024)
        self.last = nn.Linear(1024, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x)))


def lowbit_net() -> nn.Module:
    return LowBitNet()


def partial_block_net() -> nn.Module:
    """Weights bitsandbytes quantizes whatever their last block: 37 x 300 (43 blocks of 256 and
    a partial one, cut on 2 ranks) and 300 x 17 (19 and a partial one, whole on one rank)."""
    return nn.Sequential(nn.Linear(37, 300), nn.ReLU(), nn.Linear(300, 17))


def bf16_net() -> nn.Module:
    return OddNet().to(torch.bfloat16)


def partly_frozen_net() -> nn.Module:
    model = OddNet()
    model.first.weight.requires_grad_(False)
    return model


@dataclasses.dataclass(frozen=True)
class Case:
    factory: str
    optimizer: str
    kwargs: dict
    master_dtype: torch.dtype | None = None
    degree: int | None = None
    grad_compression: str | None = None
    param_compression: str | None = None
    grad_error_feedback: bool = False

    def sharding(self) -> ShardingConfig:
        return ShardingConfig(
            master_dtype=self.master_dtype,
            degree=self.degree,
            grad_compression=self.grad_compression,
            param_compression=self.param_compression,
            grad_error_feedback=self.grad_error_feedback,
        )

    def planned(self, plan: TrainingPlan) -> ModePlan:
        """The mode of ``plan`` the wrapper of this case runs."""
        mode = "hybrid" if self.degree else "sync"
        return next(
            m
            for m in plan.modes
            if m.mode == mode
            and (m.grad_compression, m.param_compression) == (self.grad_compression, self.param_compression)
        )


INT8 = {"grad_compression": "int8", "param_compression": "int8"}

LOW_BIT_CASES = {
    1: [Case("lowbit_net", "AdamW8bit", {})],
    2: [Case("lowbit_net", "AdamW8bit", {}), Case("lowbit_net", "AdamW4bit", {})],
    3: [Case("lowbit_net", "AdamWFp8", {}), Case("lowbit_net", "AdamW8bit", {"block_size": 128})],
}
"""torchao's classes (codes, scales and code books per quantized piece); world size 1 steps
whole params."""


CASES = {
    1: [
        Case("partly_frozen_net", "SGD", {"momentum": 0.9}),
        Case("bf16_net", "AdamW", {}, torch.float32),
        Case("odd_net", "AdamW", {}, **INT8),  # one rank: nothing is sent, nothing compressed
    ],
    2: [
        Case("odd_net", "AdamW", {}),
        Case("bf16_net", "Adam", {"amsgrad": True}, torch.float32),
        Case("partly_frozen_net", "Adagrad", {}),  # state at construction: frozen buckets too
        Case("partly_frozen_net", "RMSprop", {"momentum": 0.9, "centered": True}),
        # Note [Compressed wire]: bf16 and int8 rows of grads, int8 param deltas with an exact
        # master (fp32 params: in their own dtype) and the published copy of the shard
        Case("odd_net", "AdamW", {}, grad_compression="bf16"),
        Case("odd_net", "AdamW", {}, **INT8),
        Case("odd_net", "AdamW", {}, param_compression="int8"),
        Case("partly_frozen_net", "Adagrad", {}, **INT8),
        Case("bf16_net", "AdamW", {}, torch.float32, **INT8),
        Case("bf16_net", "SGD", {}, grad_compression="bf16"),  # bf16 grads go out exact
        # Note [Error feedback]: an fp32 residual of the slices sent, frozen buckets' too where
        # they get their shard at construction, 16-bit grads' under int8, none where bf16 grads
        # go out exact
        Case("odd_net", "AdamW", {}, grad_compression="bf16", grad_error_feedback=True),
        Case("partly_frozen_net", "Adagrad", {}, **INT8, grad_error_feedback=True),
        Case("bf16_net", "AdamW", {}, torch.float32, grad_compression="int8", grad_error_feedback=True),
        Case("bf16_net", "SGD", {}, grad_compression="bf16", grad_error_feedback=True),
    ],
    3: [
        Case("odd_net", "AdamW", {}),
        Case("bf16_net", "SGD", {"momentum": 0.9}),
        Case("odd_net", "AdamW", {}, **INT8),
        Case("odd_net", "AdamW", {}, grad_compression="int8", grad_error_feedback=True),  # 2 rows
    ],
    4: [
        Case("odd_net", "AdamW", {}, degree=2),
        Case("odd_net", "AdamW", {}, degree=2, **INT8),  # the replicas' average as int8 rows
        Case("odd_net", "AdamW", {}, degree=2, grad_compression="bf16"),
    ],
}


def _wrapped_bytes(cases: list[Case]) -> list[tuple[dict[str, int], dict[str, int]]]:
    """Each case's ``memory_bytes()`` on this rank after one training step, and the bytes
    ``wire_bytes()`` counted over that step."""
    reports = []
    for case in cases:
        torch.manual_seed(0)
        model = globals()[case.factory]()
        optimizer = resolve_optimizer(case.optimizer)(model.parameters(), **case.kwargs)
        wrapper = ShardingStage1(optimizer, strategy=Strategy(sharding=case.sharding()), model=model)
        before = wrapper.wire_bytes()
        dtype = next(model.parameters()).dtype
        model(torch.randn(4, 37, dtype=dtype)).float().square().mean().backward()
        # Eagerly: torchao compiles its step per piece shape (tens of seconds each on CPU).
        with torch.compiler.set_stance("force_eager"):
            wrapper.step()
        wrapper.sync_params()
        sent = {key: count - before[key] for key, count in wrapper.wire_bytes().items()}
        reports.append((wrapper.memory_bytes(), sent))
        wrapper.close()
    return reports


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_bytes_equal_the_wrappers_report(world_size: int) -> None:
    _check_against_the_wrapper(world_size, CASES[world_size])


@pytest.mark.parametrize("world_size", sorted(LOW_BIT_CASES))
def test_low_bit_state_bytes_equal_the_wrappers_report(world_size: int) -> None:
    pytest.importorskip("torchao.optim")
    _check_against_the_wrapper(world_size, LOW_BIT_CASES[world_size])


def test_bitsandbytes_state_bytes_equal_the_wrappers_report() -> None:
    """Codes, a scale per block begun (the last one partial) and code books, per rank."""
    pytest.importorskip("bitsandbytes")
    _check_against_the_wrapper(2, [Case("partial_block_net", "bnb.AdamW8bit", {})])


def _check_against_the_wrapper(world_size: int, cases: list[Case]) -> None:
    per_rank = run_ranks(_wrapped_bytes, world_size, cases)
    for index, case in enumerate(cases):
        cluster = Cluster(world_size=world_size, ranks_per_node=world_size, node_link=FAST_LINK)
        plan = plan_training(
            f"tests.plan.test_plan:{case.factory}",
            case.optimizer,
            cluster=cluster,
            compute=COMPUTE,
            optimizer_kwargs=case.kwargs,
            sharding=case.sharding(),
        )
        mode = case.planned(plan)
        shard_size = case.degree or world_size
        for rank, reports in enumerate(per_rank):
            memory, sent = reports[index]
            assert memory == mode.memory_per_rank[rank % shard_size].as_report(), (case, rank)
            assert sent == mode.wire.as_report(), (case, rank)


def _step_ms(gbps: float, mode: str, world_size: int = 2) -> float:
    cluster = Cluster(world_size=world_size, ranks_per_node=world_size, node_link=LinkModel.stated(gbps, 20))
    plan = plan_training("tests.plan.test_plan:odd_net", "AdamW", cluster=cluster, compute=COMPUTE)
    return next(m for m in plan.modes if m.mode == mode).step_s * 1e3


@pytest.mark.parametrize("mode", ["ddp", "sync", "overlap"])
def test_step_time_falls_as_bandwidth_grows(mode: str) -> None:
    times = [_step_ms(gbps, mode) for gbps in (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)]
    assert times == sorted(times, reverse=True)
    assert times[0] > 2 * times[-1]  # at 1 Mbit/s communication dominates


def test_overlap_is_never_slower_than_sync_when_comm_dominates() -> None:
    for gbps in (0.005, 0.02, 0.1):
        for world_size in (2, 4):
            assert _step_ms(gbps, "overlap", world_size) <= _step_ms(gbps, "sync", world_size) * 1.001


def test_sync_is_compute_then_every_collective() -> None:
    buckets = tuple(
        BucketCosts(
            compute_share=share,
            step_share=share / 2,
            reduce=Transfer("link", 0.02 * (i + 1), 0.01 * (i + 1)),
            gather=Transfer("link", 0.005, 0.005),
        )
        for i, share in enumerate((0.25, 0.75))
    )
    costs = StepCosts(buckets, COMPUTE, step_s=0.04, flags_s=0.001)
    sync = simulate(costs, "sync", steps=3)
    # forward + backward, the reductions back to back, the first alone and the second in flight
    # behind it (the step of bucket 0 hides behind the second), bucket 1's step, then both
    # all-gathers
    one_step = 0.1 + 0.2 + (0.02 + 0.02) + 0.04 * 0.75 / 2 + 2 * 0.005
    assert sync.steady_step_s() == pytest.approx(one_step)
    assert sync.block_step_s() == pytest.approx(one_step)
    overlap = simulate(costs, "overlap", steps=3)
    assert overlap.steady_step_s() < one_step
    assert overlap.block_step_s() > overlap.steady_step_s()  # the last all-gathers are not hidden


def test_buckets_that_stage_their_grads_are_reduced_by_step() -> None:
    # Note [Staged grads]: in overlap mode too, such a bucket's reduce-scatter starts after
    # backward, as in sync mode; the all-gathers still overlap the next forward.
    def costs(at_step: bool) -> StepCosts:
        buckets = tuple(
            BucketCosts(
                compute_share=0.5,
                step_share=0.25,
                reduce=Transfer("link", 0.05, 0.05),
                gather=Transfer("link", 0.05, 0.05),
                at_step=at_step and i == 0,
            )
            for i in range(2)
        )
        return StepCosts(buckets, COMPUTE, step_s=0.04)

    overlap = simulate(costs(False), "overlap", steps=4).steady_step_s()
    staged = simulate(costs(True), "overlap", steps=4).steady_step_s()
    sync = simulate(costs(True), "sync", steps=4).steady_step_s()
    assert overlap < staged < sync
    assert simulate(costs(True), "sync", steps=4).steady_step_s() == sync


def test_link_between_nodes_carries_hybrid_replicas_only() -> None:
    slow = LinkModel.stated(0.1, 20)
    cluster = Cluster(world_size=4, ranks_per_node=2, node_link=FAST_LINK, link=slow)
    plan = plan_training("tests.plan.test_plan:odd_net", "AdamW", cluster=cluster, compute=COMPUTE)
    by_mode = {m.label: m for m in plan.modes}
    # 2 x 2: only the 1/2 shard crosses between nodes, once (all-reduce) instead of twice; each
    # rank holds state / 2 instead of state / 4 (up to where the shards cut the padding)
    assert by_mode["hybrid 2"].comm_s < by_mode["overlap"].comm_s
    hybrid_state, full_state = (by_mode[k].memory.optimizer_state for k in ("hybrid 2", "overlap"))
    assert hybrid_state == pytest.approx(2 * full_state, rel=0.01)


def test_compressed_modes_beside_exact() -> None:
    # Note [Compressed wire]: int8 rows are a byte per element and an fp32 scale per block, about
    # a quarter of fp32's bytes; on a slow link the step follows the bytes. The exact master of
    # fp32 params and the published copy of the shard each hold params / N.
    cluster = Cluster(world_size=2, ranks_per_node=2, node_link=LinkModel.stated(0.01, 20))
    sharding = ShardingConfig(grad_compression="int8", param_compression="int8")
    plan = plan_training(
        "tests.plan.test_plan:odd_net", "AdamW", cluster=cluster, compute=COMPUTE, sharding=sharding
    )
    by_label = {m.label: m for m in plan.modes}
    assert list(by_label) == ["ddp", "sync", "sync [int8/int8]", "overlap", "overlap [int8/int8]"]
    assert plan.compressed_sweep and all(m.label == "overlap [int8/int8]" for m in plan.compressed_sweep)
    for mode in ("sync", "overlap"):
        exact, int8 = by_label[mode], by_label[f"{mode} [int8/int8]"]
        assert 0.25 < int8.wire.total / exact.wire.total < 0.26
        assert int8.step_s < exact.step_s
        assert exact.memory.master == exact.memory.published == 0
        assert int8.memory.master == int8.memory.published == int8.memory.params // 2
    assert "sync [int8/int8]: sends 0.25x" in format_plan(plan)
    exact_only = plan_training("tests.plan.test_plan:odd_net", "AdamW", cluster=cluster, compute=COMPUTE)
    assert not any(m.compressed for m in exact_only.modes) and exact_only.compressed_sweep == ()
    assert "[" not in format_plan(exact_only) and "publ." not in format_plan(exact_only)


def test_recommends_the_fastest_unless_a_leaner_mode_ties() -> None:
    cluster = Cluster(world_size=2, ranks_per_node=2, node_link=LinkModel.stated(0.05, 20))
    plan = plan_training("tests.plan.test_plan:odd_net", "AdamW", cluster=cluster, compute=COMPUTE)
    fastest = min(m.step_s for m in plan.modes)
    assert plan.recommended.step_s <= fastest * 1.03
    assert all(
        plan.recommended.memory.total <= m.memory.total for m in plan.modes if m.step_s <= fastest * 1.03
    )


def test_cli_with_stated_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--world-size", "4", "--compute-ms", "300", "--step-ms", "10"]
    assert main([*argv, "--node-link", "10,20", "--ranks-per-node", "2", "--link", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("ddp", "sync", "overlap", "hybrid 2", "recommended:"):
        assert label in out


def test_cli_plans_compressed_modes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--world-size", "4", "--compute-ms", "300", "--node-link", "1,20"]
    assert main([*argv, "--grad-compression", "int8", "--param-compression", "int8"]) == 0
    out = capsys.readouterr().out
    for label in ("sync [int8/int8]", "overlap [int8/int8]", "hybrid 2 [int8/int8]", "publ.", "sent MiB"):
        assert label in out
    assert "compressed [grads/params] against exact" in out
    assert main([*argv, "--grad-compression", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "overlap [bf16/exact]: sends 0." in out and "publ." not in out and "resid." not in out
    # Note [Error feedback]: the residual's column; refused with hybrid sharding, so not planned
    assert main([*argv, "--grad-compression", "bf16", "--grad-error-feedback"]) == 0
    out = capsys.readouterr().out
    assert "resid." in out and "hybrid 2 [bf16/exact]" not in out and "hybrid 2 " in out
    assert main([*argv, "--grad-error-feedback"]) == 2
    assert "grad_error_feedback=True with grad_compression=None" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--param-compression", "bf16"])


def test_cli_plans_low_bit_optimizers_with_their_real_state_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """8-bit state is about 2 bytes per param (codes, a scale per 256, code books) against
    AdamW's 8, held by DDP on every rank, where nearly every param is quantized (the default
    GPT; the tiny one's many small params keep plain state)."""
    pytest.importorskip("torchao.optim")
    argv = ["--model", "tiny", "--compute-ms", "300", "--node-link", "1"]
    assert main([*argv, "--optimizer", "AdamW8bit", "--optimizer-kwargs", '{"lr": 1e-3}']) == 0
    assert "recommended:" in capsys.readouterr().out
    cluster = Cluster(world_size=2, ranks_per_node=2, node_link=FAST_LINK)
    ddp_state = {
        name: plan_training("default", name, cluster=cluster, compute=COMPUTE).modes[0].memory.optimizer_state
        for name in ("AdamW", "AdamW8bit")
    }
    assert ddp_state["AdamW"] / 4.2 < ddp_state["AdamW8bit"] < ddp_state["AdamW"] / 3.5


def test_cli_calibrates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tiny", "--calibrate"]) == 0
    out = capsys.readouterr().out
    assert "measured: ComputeTimes(forward_s=" in out
    assert "recommended:" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer", "Lion"], "plan expects optimizer to name one of torch.optim's"),
        (["--optimizer", "LBFGS"], "plan expects optimizer to name one of"),
        (["--world-size", "0"], "plan expects world_size to be an int >= 1 but got 0"),
        (
            ["--ranks-per-node", "3"],
            "plan expects ranks_per_node to be an int >= 1 that divides world_size 2",
        ),
        (
            ["--model", "no_such_module:factory"],
            "could not import the model factory's module 'no_such_module'",
        ),
        (["--model", "tests.plan.test_plan:no_such_factory"], "to have a callable 'no_such_factory'"),
        (["--model", "odd_net:"], "plan expects the model factory as 'module:callable' but got 'odd_net:'"),
        (["--model", "gpt9"], "plan expects model as 'module:callable' or one of"),
        (["--optimizer-kwargs", '{"lr": -1}'], "plan could not build AdamW with {'lr': -1}"),
    ],
)
def test_cli_answers_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--compute-ms", "100", "--node-link", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_needs_compute_and_link() -> None:
    with pytest.raises(SystemExit):
        main(["--node-link", "1"])
    with pytest.raises(SystemExit):
        main(["--compute-ms", "100"])


def test_stated_numbers_are_checked() -> None:
    with pytest.raises(ValueError, match="LinkModel.stated expects gbps > 0"):
        LinkModel.stated(0.0)
    with pytest.raises(ValueError, match="AlphaBeta expects alpha_s >= 0"):
        AlphaBeta(alpha_s=-1.0, beta_s_per_byte=0.0)
    with pytest.raises(ValueError, match="ComputeTimes expects forward_s >= 0"):
        ComputeTimes(forward_s=float("nan"), backward_s=0.0, step_s=0.0)
    with pytest.raises(ValueError, match="plan expects a link between nodes"):
        Cluster(world_size=4, ranks_per_node=2, node_link=FAST_LINK)
