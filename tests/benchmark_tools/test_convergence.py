"""``benchmarks.convergence`` in short: a tiny GPT trained a few dozen steps on the documentation's
text on 2 gloo ranks learns (its losses fall well below a uniform guess's) and both ranks end
with bitwise the same params; and the pieces around it (the split, the schedule, the control's
one-ulp nudge, the comparison with exact, the table and the plot) on made-up numbers."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from benchmarks import convergence, plots
from benchmarks.models import GPTConfig, build_gpt

TINY = convergence.ConvergenceConfig(
    model=GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2),
    steps=40,
    micro_batch=8,
    warmup_steps=5,
    eval_every=20,
    eval_batches=2,
)

UNIFORM_LOSS = math.log(256)
"""The loss of a uniform guess over bytes, near where an untrained model starts."""


@pytest.mark.parametrize("setting", ["exact", "int8"])
def test_a_setting_learns_and_keeps_the_ranks_params_identical(setting: str) -> None:
    """The short version of the convergence run: exact, and int8 grads with int8 param deltas."""
    result = convergence.run_setting(TINY, setting)
    assert result["all_finite"]
    assert result["params_identical"]
    assert len(result["train_loss"]) == TINY.steps
    assert result["heldout_steps"] == [0, 20, 40]
    assert result["heldout_loss"][0] > UNIFORM_LOSS - 0.1
    assert result["final_heldout_loss"] < UNIFORM_LOSS - 1.5, result["heldout_loss"]
    assert sum(result["train_loss"][-10:]) / 10 < UNIFORM_LOSS - 1.5, result["train_loss"]


def test_the_last_tenth_of_the_text_is_held_out() -> None:
    corpus = convergence.pydoc_corpus()
    train, heldout = convergence.split_corpus(corpus)
    assert len(corpus) > 400_000
    assert len(heldout) == int(len(corpus) * convergence.HELDOUT_FRACTION)
    assert bytes(train.numpy()) + bytes(heldout.numpy()) == bytes(corpus.numpy())


def test_learning_rate_warms_up_then_decays_to_its_floor() -> None:
    factors = [convergence.lr_factor(step, TINY) for step in range(TINY.steps)]
    assert factors[TINY.warmup_steps] == pytest.approx(1.0)
    assert factors[: TINY.warmup_steps + 1] == sorted(factors[: TINY.warmup_steps + 1])
    assert factors[TINY.warmup_steps :] == sorted(factors[TINY.warmup_steps :], reverse=True)
    assert convergence.lr_factor(TINY.steps, TINY) == pytest.approx(convergence.MIN_LR_RATIO)


def test_heldout_steps_end_at_the_last_step() -> None:
    assert convergence.heldout_steps(TINY) == [0, 20, 40]
    longer = convergence.ConvergenceConfig(steps=45, eval_every=20)
    assert convergence.heldout_steps(longer) == [0, 20, 40, 45]


@pytest.mark.parametrize("setting", ["bf16", "int8-grads"])
def test_error_feedback_settings_differ_from_theirs_in_the_feedback_alone(setting: str) -> None:
    plain = convergence.strategy_for(setting, overlap=False)
    fed_back = convergence.strategy_for(f"{setting}-ef", overlap=False)
    assert fed_back.sharding.grad_error_feedback and not plain.sharding.grad_error_feedback
    fed_back.sharding.grad_error_feedback = False
    assert fed_back == plain


def test_the_control_nudges_every_param_one_ulp_up_or_down_the_same_on_every_rank() -> None:
    """``exact-ulp``: the exact wire; each element moved to its neighbouring float, the
    directions a coin drawn from the seed alone (each rank draws them itself)."""
    exact_wire = convergence.strategy_for("exact", overlap=False)
    assert convergence.strategy_for("exact-ulp", overlap=False) == exact_wire
    assert convergence.SETTINGS["exact-ulp"].ulp_nudge and not convergence.SETTINGS["exact"].ulp_nudge
    original, nudged, again, other_seed = (build_gpt(TINY.model, seed=0) for _ in range(4))
    convergence.nudge_one_ulp(nudged, seed=7)
    convergence.nudge_one_ulp(again, seed=7)
    convergence.nudge_one_ulp(other_seed, seed=8)
    ups = []
    for before, after, same, other in zip(
        original.parameters(), nudged.parameters(), again.parameters(), other_seed.parameters(), strict=True
    ):
        assert torch.equal(torch.nextafter(before, after), after)
        assert (after != before).all()
        assert torch.equal(after, same)
        ups.append((after > before).flatten())
        assert not torch.equal(after, other)
    up_fraction = torch.cat(ups).float().mean().item()
    assert 0.45 < up_fraction < 0.55


def _summary(final: float, finite: bool = True) -> dict:
    return {
        "train_loss": [5.0, 4.0, 3.0],
        "heldout_steps": [0, 3],
        "heldout_loss": [5.5, final],
        "final_heldout_loss": final,
        "all_finite": finite,
        "params_identical": True,
        "median_step_s": 0.1,
        "train_s": 0.3,
    }


def test_settings_are_compared_with_exact_in_the_table_and_the_plot(tmp_path: pathlib.Path) -> None:
    results = {"exact": _summary(2.0), "int8": _summary(2.1, finite=False)}
    convergence.add_relative_to_exact(results)
    assert results["exact"]["heldout_vs_exact"] == 0.0
    assert results["int8"]["heldout_vs_exact"] == pytest.approx(0.05)
    rows = convergence.table(results).splitlines()[2:]
    assert "+5.00%" in rows[1] and "| NO |" in rows[1]
    plots.plot_convergence(results, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_without_exact_there_is_nothing_to_compare_with() -> None:
    results = {"bf16": _summary(2.0)}
    convergence.add_relative_to_exact(results)
    assert results["bf16"]["heldout_vs_exact"] is None


def test_running_mean_averages_the_window_before_each_value() -> None:
    assert plots.running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
