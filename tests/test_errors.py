"""Every wrong use named by the foundation issue gets a clear error that names the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from tests.dist_helper import run_ranks
from tests.training import make_model


def _adamw(*params: nn.Parameter) -> torch.optim.AdamW:
    return torch.optim.AdamW(params or [nn.Parameter(torch.ones(3))])


def test_not_a_torch_optimizer(single_rank_group) -> None:
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer instance.*got list"):
        ShardingStage1([nn.Parameter(torch.ones(2))])


def test_only_frozen_params(single_rank_group) -> None:
    frozen = nn.Parameter(torch.ones(3), requires_grad=False)
    with pytest.raises(ValueError, match="trainable params but got 1 params, none with requires_grad"):
        ShardingStage1(torch.optim.SGD([frozen], lr=0.1))


def test_empty_optimizer(single_rank_group) -> None:
    optimizer = _adamw()
    optimizer.param_groups[0]["params"].clear()
    with pytest.raises(ValueError, match="trainable params but got 0 params"):
        ShardingStage1(optimizer)


def test_same_param_twice_in_one_group(single_rank_group) -> None:
    param = nn.Parameter(torch.ones(3))
    with pytest.warns(UserWarning, match="duplicate"):
        optimizer = torch.optim.SGD([param, param], lr=0.1)
    with pytest.raises(ValueError, match="each param once but param 1 .*same tensor as param 0"):
        ShardingStage1(optimizer)


def test_same_param_in_two_groups(single_rank_group) -> None:
    first, second = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([{"params": [first]}, {"params": [second]}], lr=0.1)
    optimizer.param_groups[1]["params"].append(first)
    with pytest.raises(ValueError, match=r"param 2 \(group 1\) is the same tensor as param 0"):
        ShardingStage1(optimizer)


def test_params_on_different_devices(single_rank_group) -> None:
    on_cpu = nn.Parameter(torch.ones(3))
    on_meta = nn.Parameter(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match=r"all params on one device but got params on \['cpu', 'meta'\]"):
        ShardingStage1(torch.optim.SGD([on_cpu, on_meta], lr=0.1))


def test_sparse_param(single_rank_group) -> None:
    sparse = nn.Parameter(torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True))
    with pytest.raises(ValueError, match="dense params but param 0 .* has layout torch.sparse_coo"):
        ShardingStage1(torch.optim.SGD([sparse], lr=0.1))


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.LBFGS([p]),
        lambda p: torch.optim.SparseAdam([p]),
        lambda p: type("MyAdam", (torch.optim.Adam,), {})([p]),
    ],
    ids=["LBFGS", "SparseAdam", "unknown_subclass"],
)
def test_non_elementwise_optimizer(single_rank_group, make) -> None:
    optimizer = make(nn.Parameter(torch.ones(3)))
    with pytest.raises(
        TypeError, match="only correct for element-wise optimizers .*AdamW.*assume_elementwise"
    ):
        ShardingStage1(optimizer)


def test_custom_optimizer_accepted_on_opt_in(single_rank_group) -> None:
    param = nn.Parameter(torch.ones(3))
    optimizer = ShardingStage1(
        type("MyAdam", (torch.optim.Adam,), {})([param], lr=0.1), assume_elementwise=True
    )
    param.grad.fill_(1.0)
    optimizer.step()
    assert torch.all(param < 1.0)


def test_process_group_not_initialized() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group.*init_parallel_env"):
        ShardingStage1(_adamw())


def test_invalid_strategy_values() -> None:
    with pytest.raises(ValueError, match="enable_overlap expects a bool but got 1"):
        Strategy().sharding.enable_overlap = 1
    with pytest.raises(ValueError, match="bucket_size_mb expects a number > 0 but got 0"):
        ShardingConfig(bucket_size_mb=0)
    with pytest.raises(ValueError, match="align_bytes expects a power of two >= 1 but got 100"):
        ShardingConfig(align_bytes=100)
    with pytest.raises(AttributeError):
        Strategy().sharding.overlap = True
    with pytest.raises(TypeError, match="sharding to be a ShardingConfig"):
        Strategy(sharding={"enable": True})


def test_invalid_wrapper_arguments(single_rank_group) -> None:
    with pytest.raises(TypeError, match="strategy to be a sharded_opt.Strategy but got dict"):
        ShardingStage1(_adamw(), strategy={"enable_overlap": True})
    with pytest.raises(TypeError, match="overlap to be a bool or None but got 'yes'"):
        ShardingStage1(_adamw(), overlap="yes")


def test_strategy_is_copied_and_overlap_argument_overrides(single_rank_group) -> None:
    strategy = Strategy()
    optimizer = ShardingStage1(_adamw(), strategy=strategy, overlap=True)
    strategy.sharding.enable_overlap = False
    assert optimizer.overlap is True
    assert strategy.sharding.enable_overlap is False


def test_wrapped_twice_and_original_step_refused(single_rank_group) -> None:
    inner = _adamw()
    ShardingStage1(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        ShardingStage1(inner)
    with pytest.raises(RuntimeError, match="wrapped by ShardingStage1; call the wrapper's step"):
        inner.step()


def test_optimizer_that_already_stepped(single_rank_group) -> None:
    param = nn.Parameter(torch.ones(3))
    inner = torch.optim.Adam([param])
    param.grad = torch.ones(3)
    inner.step()
    with pytest.raises(ValueError, match="has not stepped yet but it holds state for 1 params"):
        ShardingStage1(inner)


def test_adagrad_eager_state_is_not_mistaken_for_a_step(single_rank_group) -> None:
    ShardingStage1(torch.optim.Adagrad([nn.Parameter(torch.ones(3))]))


def test_add_param_group_after_wrapping(single_rank_group) -> None:
    optimizer = ShardingStage1(_adamw())
    with pytest.raises(RuntimeError, match="add every param group to the torch optimizer first"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2))]})


def test_attach_model_that_does_not_own_the_params(single_rank_group) -> None:
    model = make_model()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
    with pytest.raises(ValueError, match="model that owns the optimizer's params but 7 trainable"):
        optimizer.attach(nn.Linear(2, 2))


def test_param_data_reassigned_is_detected(single_rank_group) -> None:
    model = make_model()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1))
    model.fc1.weight.data = torch.zeros_like(model.fc1.weight)
    with pytest.raises(RuntimeError, match=r"no longer live in the flat buffers .*param.data = "):
        optimizer.step()


def test_ranks_with_different_models() -> None:
    with pytest.raises(Exception, match=r"rank 1 differs from rank 0: param 0 is shape \[4\]"):
        run_ranks(_mismatched_models, 2)


def _mismatched_models() -> None:
    size = 3 if dist.get_rank() == 0 else 4
    ShardingStage1(torch.optim.SGD([nn.Parameter(torch.ones(size))], lr=0.1))
