"""The catalog of wrong uses: each row is one mistake, the exception it gets and the message
that names the fix. The README's "Errors" table lists the same mistakes.

Rows run in the pytest process on a one-rank gloo group (or with none, where the mistake is the
missing group); mistakes that need several ranks run together in one spawned job at the end.
"""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, save_checkpoint
from tests.harness.dist_helper import run_ranks
from tests.harness.training import GLOBAL_BATCH, IN_FEATURES, make_model


@dataclass(frozen=True)
class BadInput:
    name: str
    call: Callable[[], object]
    error: type[BaseException]
    match: str
    needs_group: bool = True


def _param(*shape: int, **kwargs) -> nn.Parameter:
    return nn.Parameter(torch.ones(*shape, **kwargs))


def _same_param_twice_in_one_group() -> None:
    param = _param(3)
    with pytest.warns(UserWarning, match="duplicate"):
        optimizer = torch.optim.SGD([param, param], lr=0.1)
    ShardingStage1(optimizer)


def _same_param_in_two_groups() -> None:
    first, second = _param(3), _param(2)
    optimizer = torch.optim.SGD([{"params": [first]}, {"params": [second]}], lr=0.1)
    optimizer.param_groups[1]["params"].append(first)
    ShardingStage1(optimizer)


def _empty_optimizer() -> None:
    optimizer = torch.optim.AdamW([_param(3)])
    optimizer.param_groups[0]["params"].clear()
    ShardingStage1(optimizer)


def _wrapped_twice() -> None:
    inner = torch.optim.AdamW([_param(3)])
    with ShardingStage1(inner):  # the first wrapper is alive (and not closed) here
        ShardingStage1(inner)


def _original_stepped_after_wrapping() -> None:
    inner = torch.optim.AdamW([_param(3)])
    ShardingStage1(inner)
    inner.step()


def _original_state_dict_after_wrapping() -> None:
    inner = torch.optim.AdamW([_param(3)])
    ShardingStage1(inner)
    inner.state_dict()


def _original_load_state_dict_after_wrapping() -> None:
    inner = torch.optim.AdamW([_param(3)])
    state = inner.state_dict()
    ShardingStage1(inner)
    inner.load_state_dict(state)


def _already_stepped() -> None:
    param = _param(3)
    inner = torch.optim.Adam([param])
    param.grad = torch.ones(3)
    inner.step()
    ShardingStage1(inner)


def _add_param_group_after_wrapping() -> None:
    ShardingStage1(torch.optim.AdamW([_param(3)])).add_param_group({"params": [_param(2)]})


def _attach_foreign_model() -> None:
    model = make_model()
    ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True).attach(nn.Linear(2, 2))


def _attach_twice(overlap: bool) -> Callable[[], None]:
    def attach_twice() -> None:
        model = make_model()
        optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap, model=model)
        optimizer.attach(model)  # sync mode keeps no per-module waiter: it once hooked the model twice

    return attach_twice


def _param_data_resized() -> None:
    model = make_model()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1))
    model.fc1.weight.data = torch.zeros(3, 3)
    optimizer.step()


def _param_data_resized_then_forward() -> None:
    """With a model attached the training forward refuses, before backward would fail on
    torch's shape mismatch (resize_token_embeddings after wrapping); see tests/loops/test_hf_models.py."""
    model = make_model()
    ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    model.fc1.weight.data = torch.zeros(3, 3)
    model(torch.zeros(2, 3))


def _param_data_tied_to_another_param() -> None:
    model = make_model()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1))
    model.fc1.bias.data = model.fc2.weight.data[0, :24]
    optimizer.step()


def _model_cast_after_wrapping() -> None:
    model = make_model()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1))
    model.half()
    optimizer.step()


def _model_cast_after_a_step_then_zero_grad() -> None:
    """The usual loop after ``model.half()``: zero_grad() first (torch's own error there said
    "assign a gradient with dtype 'float' to a tensor with grad_dtype 'Half'")."""
    model = make_model()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    model(torch.randn(4, IN_FEATURES)).sum().backward()
    optimizer.step()
    model.half()
    optimizer.zero_grad()


def _wrapper() -> ShardingStage1:
    return ShardingStage1(torch.optim.SGD(make_model().parameters(), lr=0.1))


def _bad_norm_type() -> None:
    ShardingStage1(torch.optim.SGD(make_model().parameters(), lr=0.1)).clip_grad_norm_(1.0, norm_type=0)


def _bad_to_rank() -> None:
    ShardingStage1(torch.optim.SGD(make_model().parameters(), lr=0.1)).state_dict(to_rank=3)


def _save_over_foreign_folder(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model = make_model()
    save_checkpoint(folder, model, ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1)))


def _my_adam(param: nn.Parameter) -> torch.optim.Optimizer:
    return type("MyAdam", (torch.optim.Adam,), {})([param])


CASES = [
    BadInput("not_an_optimizer", lambda: ShardingStage1([_param(2)]), TypeError,
             "expects a torch.optim.Optimizer instance.*got list"),
    BadInput("no_params", _empty_optimizer, ValueError, "with params but its param groups are empty"),
    BadInput("same_param_twice_in_one_group", _same_param_twice_in_one_group, ValueError,
             "each param once but param 1 .*same tensor as param 0"),
    BadInput("same_param_in_two_groups", _same_param_in_two_groups, ValueError,
             r"param 2 \(group 1\) is the same tensor as param 0"),
    BadInput("params_on_two_devices",
             lambda: ShardingStage1(torch.optim.SGD([_param(3), _param(3, device="meta")], lr=0.1)),
             ValueError, r"all params on one device but got params on \['cpu', 'meta'\]"),
    BadInput("sparse_param",
             lambda: ShardingStage1(torch.optim.SGD(
                 [nn.Parameter(torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True))], lr=0.1)),
             ValueError, "dense params but param 0 .* has layout torch.sparse_coo"),
    BadInput("lbfgs", lambda: ShardingStage1(torch.optim.LBFGS([_param(3)])), TypeError,
             "only correct for element-wise optimizers .*AdamW.*assume_elementwise"),
    BadInput("sparse_adam", lambda: ShardingStage1(torch.optim.SparseAdam([_param(3)])), TypeError,
             "only correct for element-wise optimizers"),
    BadInput("unknown_optimizer_subclass", lambda: ShardingStage1(_my_adam(_param(3))), TypeError,
             "but got MyAdam. If every element's update depends only on its own grad"),
    BadInput("no_process_group", lambda: ShardingStage1(torch.optim.AdamW([_param(3)])), RuntimeError,
             "initialized torch.distributed process group.*init_parallel_env", needs_group=False),
    BadInput("strategy_not_a_strategy", lambda: ShardingStage1(torch.optim.AdamW([_param(3)]), strategy={}),
             TypeError, "strategy to be a sharded_opt.Strategy but got dict"),
    BadInput("overlap_not_a_bool", lambda: ShardingStage1(torch.optim.AdamW([_param(3)]), overlap="yes"),
             TypeError, "overlap to be a bool or None but got 'yes'"),
    BadInput("strategy_overlap_not_a_bool", lambda: setattr(Strategy().sharding, "enable_overlap", 1),
             ValueError, "enable_overlap expects a bool but got 1", needs_group=False),
    BadInput("strategy_bucket_size_zero", lambda: ShardingConfig(bucket_size_mb=0), ValueError,
             "bucket_size_mb expects a number > 0 .*but got 0", needs_group=False),
    BadInput("strategy_bucket_size_inf", lambda: ShardingConfig(bucket_size_mb=float("inf")), ValueError,
             "bucket_size_mb expects a number > 0 \\(finite\\).*but got inf", needs_group=False),
    BadInput("strategy_bucket_size_nan", lambda: ShardingConfig(bucket_size_mb=float("nan")), ValueError,
             "bucket_size_mb expects a number > 0 .*but got nan", needs_group=False),
    BadInput("strategy_entry_timeout_not_positive",
             lambda: ShardingConfig(collective_entry_timeout_s=0), ValueError,
             "collective_entry_timeout_s expects None or a finite number of seconds > 0 but got 0",
             needs_group=False),
    BadInput("strategy_align_not_power_of_two", lambda: ShardingConfig(align_bytes=100), ValueError,
             "align_bytes expects a power of two >= 1 but got 100", needs_group=False),
    BadInput("strategy_dtype_not_floating", lambda: ShardingConfig(master_dtype=torch.int32), ValueError,
             "master_dtype expects None or a floating torch.dtype but got torch.int32", needs_group=False),
    BadInput("strategy_unknown_setting", lambda: setattr(Strategy().sharding, "overlap", True),
             AttributeError, "has no setting 'overlap'", needs_group=False),
    BadInput("strategy_section_not_a_config", lambda: Strategy(sharding={"enable": True}), TypeError,
             "sharding to be a ShardingConfig", needs_group=False),
    BadInput("wrapped_twice", _wrapped_twice, ValueError, "already wrapped"),
    BadInput("original_stepped_after_wrapping", _original_stepped_after_wrapping, RuntimeError,
             "wrapped by ShardingStage1; call the wrapper's step"),
    BadInput("original_state_dict_after_wrapping", _original_state_dict_after_wrapping, RuntimeError,
             r"holds none of the optimizer state .*call the wrapper's state_dict\(\) on every rank"),
    BadInput("original_load_state_dict_after_wrapping", _original_load_state_dict_after_wrapping,
             RuntimeError, r"would never use state loaded into it; call the wrapper's load_state_dict"),
    BadInput("optimizer_already_stepped", _already_stepped, ValueError,
             "has not stepped yet but it holds state for 1 params"),
    BadInput("add_param_group_after_wrapping", _add_param_group_after_wrapping, RuntimeError,
             "add every param group to the torch optimizer first"),
    BadInput("attach_model_not_owning_params", _attach_foreign_model, ValueError,
             r"the model whose params the optimizer trains but Linear.parameters\(\) holds none"),
    BadInput("attach_twice_sync", _attach_twice(overlap=False), ValueError, "a model is already attached"),
    BadInput("attach_twice_overlap", _attach_twice(overlap=True), ValueError, "a model is already attached"),
    BadInput("param_data_resized", _param_data_resized, RuntimeError,
             r"`param.data = ...` gave param \d+ \(optimizer order\) the shape \(3, 3\) but it was laid "
             r"out as \(24, \d+\).*build a new optimizer and ShardingStage1 after resizing"),
    BadInput("param_data_resized_then_forward", _param_data_resized_then_forward, RuntimeError,
             r"gave param \d+ \(optimizer order, 'fc1.weight'\) the shape \(3, 3\) .*Resize the model "
             "before building the optimizer"),
    BadInput("param_data_tied_to_another_param", _param_data_tied_to_another_param, RuntimeError,
             r"were pointed at another param's memory \(`param.data = other.data`\).*Tie params before"),
    BadInput("model_cast_after_wrapping", _model_cast_after_wrapping, RuntimeError,
             r"param 0 \(optimizer order\) is now torch.float16 but was laid out as torch.float32 .*"
             "Cast or move the model before building the optimizer and wrapping it"),
    BadInput("model_cast_then_zero_grad", _model_cast_after_a_step_then_zero_grad, RuntimeError,
             r"param 0 \(optimizer order, 'scale'\) is now torch.float16 but was laid out as "
             "torch.float32 .*Cast or move the model before building the optimizer and wrapping it"),
    BadInput("pickle_the_wrapper", lambda: pickle.dumps(_wrapper()), TypeError,
             r"cannot be pickled or copied: it holds a process group, the flat buffers .*opt.state_dict\(\)"),
    BadInput("deepcopy_the_wrapper", lambda: copy.deepcopy(_wrapper()), TypeError,
             r"cannot be pickled or copied.*save_checkpoint\(path, model, opt\)"),
    BadInput("clip_norm_type_not_positive", _bad_norm_type, ValueError, "norm_type > 0"),
    BadInput("state_dict_to_rank_out_of_range", _bad_to_rank, ValueError, r"to_rank in \[0, 1\) but got 3"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_gets_a_clear_error(case: BadInput, request: pytest.FixtureRequest) -> None:
    if case.needs_group:
        request.getfixturevalue("single_rank_group")
    else:
        assert not dist.is_initialized()
    with pytest.raises(case.error, match=case.match):
        case.call()


def test_save_over_a_folder_it_did_not_write(single_rank_group, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="exists and is not a checkpoint written by save_checkpoint"):
        _save_over_foreign_folder(tmp_path / "not_a_checkpoint")


def test_custom_optimizer_accepted_on_opt_in(single_rank_group) -> None:
    param = _param(3)
    optimizer = ShardingStage1(_my_adam(param), assume_elementwise=True)
    param.grad = torch.ones(3)
    optimizer.step()
    assert torch.all(param < 1.0)


def test_adagrad_eager_state_is_not_mistaken_for_a_step(single_rank_group) -> None:
    ShardingStage1(torch.optim.Adagrad([_param(3)]))


def test_strategy_is_copied_and_overlap_argument_overrides(single_rank_group) -> None:
    strategy = Strategy()
    optimizer = ShardingStage1(torch.optim.AdamW([_param(3)]), strategy=strategy, overlap=True)
    strategy.sharding.enable_overlap = False
    assert optimizer.overlap is True
    assert strategy.sharding.enable_overlap is False


# -- mistakes that need several ranks: each returns the error message it got ------------------------


def _ranks_with_different_models() -> str:
    size = 3 if dist.get_rank() == 0 else 4
    ShardingStage1(torch.optim.SGD([_param(size)], lr=0.1))
    return "no error"


def _second_backward_outside_no_sync() -> str:
    model = make_model()
    # Plain data parallel: the all-reduce averages the grad buffers in place, so a second
    # backward cannot be reduced again (sharded, it can: tests/loops/test_recipe_loops.py).
    data_parallel = Strategy(sharding=ShardingConfig(enable=False))
    optimizer = ShardingStage1(
        torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, strategy=data_parallel
    )
    inputs = torch.randn(GLOBAL_BATCH, 12)
    model(inputs).sum().backward()
    try:
        model(inputs).sum().backward()
    finally:
        optimizer.zero_grad()  # the first backward's reductions are still in flight
    return "no error"


MULTI_RANK_CASES: dict[str, tuple[Callable[[], str], str]] = {
    "ranks_with_different_models": (
        _ranks_with_different_models,
        r"rank 1 differs from rank 0: param 0 is shape \[4\] torch.float32 in group 0 instead of shape \[3\]",
    ),
    "second_backward_outside_no_sync": (
        _second_backward_outside_no_sync,
        "a second backward ran before step\\(\\).*`with opt.no_sync\\(\\):`",
    ),
}


def _run_multi_rank_cases() -> dict[str, str]:
    outcomes = {}
    for name, (call, _) in MULTI_RANK_CASES.items():
        try:
            outcomes[name] = call()
        except (ValueError, RuntimeError) as error:
            outcomes[name] = f"{type(error).__name__}: {error}"
    return outcomes


def test_multi_rank_mistakes_get_clear_errors_on_every_rank() -> None:
    for outcomes in run_ranks(_run_multi_rank_cases, 2):
        for name, (_, pattern) in MULTI_RANK_CASES.items():
            assert re.search(pattern, outcomes[name], re.DOTALL), (name, outcomes[name])
