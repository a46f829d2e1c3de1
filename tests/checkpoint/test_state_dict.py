"""Standard-format optimizer state dicts: plain <-> sharded in both directions, any world size,
validated before anything changes."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch

from sharded_opt import ShardingStage1
from tests.harness.dist_helper import run_ranks
from tests.harness.training import (
    ATOL,
    RTOL,
    STEPS_AFTER,
    STEPS_BEFORE,
    _sharded_steps,
    _to_bytes,
    batch,
    make_model,
    make_optimizer,
)


def _plain_steps(model, optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        inputs, targets = batch(step)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _plain_checkpoint(name: str) -> tuple[bytes, list[torch.Tensor]]:
    """Train plain for STEPS_BEFORE, return (checkpoint bytes, params after STEPS_AFTER more)."""
    model = make_model()
    optimizer = make_optimizer(name, model)
    _plain_steps(model, optimizer, range(STEPS_BEFORE))
    checkpoint = _to_bytes({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    _plain_steps(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return checkpoint, [p.detach().clone() for p in model.parameters()]


def _resume_sharded_both_modes(checkpoint: bytes, name: str) -> list[list[torch.Tensor]]:
    return [_resume_sharded(checkpoint, name, overlap) for overlap in (False, True)]


def _resume_sharded(checkpoint: bytes, name: str, overlap: bool) -> list[torch.Tensor]:
    saved = _from_bytes(checkpoint)
    model = make_model(seed=123)  # different init: everything must come from the checkpoint
    model.load_state_dict(saved["model"])
    optimizer = ShardingStage1(make_optimizer(name, model), overlap=overlap, model=model)
    optimizer.load_state_dict(saved["optimizer"])
    _sharded_steps(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    optimizer.sync_params()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["adamw_groups", "sgd"])
def test_plain_checkpoint_resumes_sharded(world_size: int, name: str) -> None:
    checkpoint, expected = _plain_checkpoint(name)
    for per_mode in run_ranks(_resume_sharded_both_modes, world_size, checkpoint, name):
        for params in per_mode:
            for got, want in zip(params, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _sharded_checkpoint(name: str) -> dict:
    """Train sharded, take a full state dict, continue; also round-trip into a fresh wrapper."""
    model = make_model()
    optimizer = ShardingStage1(make_optimizer(name, model))
    _sharded_steps(model, optimizer, range(STEPS_BEFORE))
    state = optimizer.state_dict()
    only_on_first = optimizer.state_dict(to_rank=0)
    model_state = copy.deepcopy(model.state_dict())
    _sharded_steps(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    continued = [p.detach().clone() for p in model.parameters()]

    fresh_model = make_model(seed=7)
    fresh_model.load_state_dict(model_state)
    fresh = ShardingStage1(make_optimizer(name, fresh_model))
    fresh.load_state_dict(_from_bytes(_to_bytes(state)))
    _sharded_steps(fresh_model, fresh, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return {
        "checkpoint": _to_bytes({"model": model_state, "optimizer": state}),
        "only_on_first": only_on_first is not None,
        "continued": continued,
        "round_trip": [p.detach().clone() for p in fresh_model.parameters()],
    }


@pytest.mark.parametrize("name", ["adamw_groups", "sgd"])
def test_sharded_state_dict_is_the_plain_format(name: str) -> None:
    results = run_ranks(_sharded_checkpoint, 3, name)
    assert [r["only_on_first"] for r in results] == [True, False, False]
    for result in results:
        # Same world size: resuming is bitwise identical to never stopping.
        for got, want in zip(result["round_trip"], result["continued"], strict=True):
            assert torch.equal(got, want)

    saved = _from_bytes(results[0]["checkpoint"])
    reference_model = make_model()
    reference = make_optimizer(name, reference_model)
    _plain_steps(reference_model, reference, range(STEPS_BEFORE))
    expected_state = reference.state_dict()
    assert saved["optimizer"]["param_groups"] == expected_state["param_groups"]
    assert saved["optimizer"]["state"].keys() == expected_state["state"].keys()
    for index, entry in expected_state["state"].items():
        assert entry.keys() == saved["optimizer"]["state"][index].keys()
        for key, value in entry.items():
            torch.testing.assert_close(saved["optimizer"]["state"][index][key], value, rtol=1e-5, atol=1e-7)

    # And the sharded state dict loads into the plain optimizer and continues like the sharded run.
    plain_model = make_model(seed=9)
    plain_model.load_state_dict(saved["model"])
    plain = make_optimizer(name, plain_model)
    plain.load_state_dict(saved["optimizer"])
    _plain_steps(plain_model, plain, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    for got, want in zip(plain_model.parameters(), results[0]["continued"], strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=RTOL, atol=ATOL)


def _trained_wrapper(name: str = "adamw_groups"):
    model = make_model()
    optimizer = ShardingStage1(make_optimizer(name, model))
    _sharded_steps(model, optimizer, range(2))
    return model, optimizer


def _mutations() -> dict:
    def fewer_groups(sd):
        sd["param_groups"] = sd["param_groups"][:1]

    def fewer_params(sd):
        sd["param_groups"][1]["params"] = sd["param_groups"][1]["params"][:-1]

    def wrong_shape(sd):
        sd["state"][2]["exp_avg"] = torch.zeros(3, 3)

    def other_optimizer(sd):
        for entry in sd["state"].values():
            entry.pop("exp_avg_sq")
            entry["momentum_buffer"] = entry.pop("exp_avg")

    def not_a_state_dict(sd):
        sd.clear()
        sd["weights"] = 1

    return {
        "fewer_groups": (fewer_groups, "expects 2 param groups but the state dict has 1"),
        "fewer_params": (fewer_params, "params in group 1 but the state dict has"),
        "wrong_shape": (
            wrong_shape,
            r"state 'exp_avg' of param 2 has shape \(3, 3\) but the param has shape",
        ),
        "other_optimizer": (other_optimizer, "another optimizer class or configuration"),
        "not_a_state_dict": (not_a_state_dict, "with 'state' and 'param_groups' but got dict with keys"),
    }


def _load_bad_state_dicts() -> dict[str, str]:
    model, optimizer = _trained_wrapper()
    outcomes = {}
    for name, (mutate, _) in _mutations().items():
        before = _to_bytes(optimizer.state_dict())
        bad = optimizer.state_dict()
        mutate(bad)
        try:
            optimizer.load_state_dict(bad)
            outcomes[name] = "loaded"
        except ValueError as error:
            unchanged = _to_bytes(optimizer.state_dict()) == before
            outcomes[name] = f"{error} | unchanged={unchanged}"
    return outcomes


def test_bad_state_dicts_are_refused_and_change_nothing() -> None:
    outcomes = run_ranks(_load_bad_state_dicts, 2)
    for rank_outcomes in outcomes:
        for name, (_, message) in _mutations().items():
            assert re.search(message, rank_outcomes[name]), (name, rank_outcomes[name])
            assert rank_outcomes[name].endswith("unchanged=True"), (name, rank_outcomes[name])
