"""A collective API called by only some ranks fails fast with an error that names the API, says
it is collective and gives the fix, instead of hanging for the group's timeout."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, load_checkpoint, save_checkpoint
from tests.harness.dist_helper import run_ranks
from tests.harness.training import make_model

ENTRY_TIMEOUT_S = 2.0
"""Short, so a test never waits for the group's timeout; only for calls that one rank skips.
Calls every rank makes keep the default (the collective timeout), so a loaded machine where
one rank gets there seconds later never fails them."""


def _state_dict(opt: ShardingStage1, model, folder: Path) -> None:
    opt.state_dict()


def _load_state_dict(opt: ShardingStage1, model, folder: Path) -> None:
    opt.load_state_dict(torch.optim.AdamW(make_model().parameters()).state_dict())


def _save_checkpoint(opt: ShardingStage1, model, folder: Path) -> None:
    save_checkpoint(folder / "ckpt", model, opt)


def _load_checkpoint(opt: ShardingStage1, model, folder: Path) -> None:
    load_checkpoint(folder / "ckpt", model, opt)


CASES: dict[str, tuple[Callable, int, str]] = {
    # name: (call, the one rank that calls it, expected error)
    "state_dict": (_state_dict, 0,
                   r"ShardingStage1.state_dict is collective.*rank\(s\) \[1\] did not call it within 2 s"
                   r".*opt.state_dict\(to_rank=0\) on every rank"),
    "load_state_dict": (_load_state_dict, 1,
                        r"ShardingStage1.load_state_dict is collective.*rank\(s\) \[0\] did not call it"),
    "save_checkpoint": (_save_checkpoint, 0,
                        r"save_checkpoint is collective.*Call save_checkpoint\(path, model, opt\) on every"),
    "load_checkpoint": (_load_checkpoint, 1, r"load_checkpoint is collective.*\[0\] did not call it"),
}  # fmt: skip


def _called_by_one_rank(folder: Path) -> dict[str, str]:
    """Each case with a fresh optimizer on a fresh group, as each leaves the ranks' call counts
    apart; returns what this rank got per case."""
    strategy = Strategy(sharding=ShardingConfig(collective_entry_timeout_s=ENTRY_TIMEOUT_S))
    model = make_model()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters()))
    save_checkpoint(folder / "ckpt", model, opt)  # for load_checkpoint; every rank calls it
    outcomes = {}
    for name, (call, caller, _) in CASES.items():
        group = dist.new_group()
        model = make_model()
        opt = ShardingStage1(torch.optim.AdamW(model.parameters()), strategy=strategy, process_group=group)
        outcomes[name] = "not called"
        if dist.get_rank() == caller:
            try:
                call(opt, model, folder)
                outcomes[name] = "no error"
            except RuntimeError as error:
                outcomes[name] = str(error)
    # Two different collective calls at once: each rank learns what the other one called.
    group = dist.new_group()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters()), process_group=group)
    try:
        _state_dict(opt, model, folder) if dist.get_rank() == 0 else _load_state_dict(opt, model, folder)
    except RuntimeError as error:
        outcomes["different_calls"] = str(error)
    return outcomes


def test_collective_called_by_some_ranks_names_the_api_the_ranks_and_the_fix(tmp_path: Path) -> None:
    for rank, outcomes in enumerate(run_ranks(_called_by_one_rank, 2, tmp_path)):
        for name, (_, caller, pattern) in CASES.items():
            if rank == caller:
                assert re.search(pattern, outcomes[name], re.DOTALL), (name, outcomes[name])
            else:
                assert outcomes[name] == "not called"
        other = "ShardingStage1.load_state_dict" if rank == 0 else "ShardingStage1.state_dict"
        expected = f"every rank of the process group must call it, but rank {1 - rank} called {other} instead"
        assert expected in outcomes["different_calls"]


def _state_dict_on_rank_zero_only() -> str:
    model = make_model()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters()))
    if dist.get_rank() != 0:
        return "not called"
    try:
        opt.state_dict()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_the_default_entry_timeout_is_the_collective_timeout() -> None:
    """Not the rendezvous store's longer one (Note [Rendezvous apart from collectives])."""
    outcome, _ = run_ranks(_state_dict_on_rank_zero_only, 2, timeout_s=3.0)
    assert "rank(s) [1] did not call it within 3 s" in outcome, outcome
