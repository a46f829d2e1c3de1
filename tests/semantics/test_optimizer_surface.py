"""The ``torch.optim`` surface through ShardingStage1 (a fifth round of user loops, on the
:class:`~tests.harness.user_loops.Loop` harness, job runner and fixture factory of
``tests/harness/user_loops.py``): every optimizer class the wrapper accepts with the flags users set (drawn
by hypothesis, one (class, flags) combination per example), schedulers that move more than the
learning rate (momentum, betas), built before or after wrapping or on the torch optimizer after
wrapping, resumed in the middle of their schedule, and the warnings they give; param-group habits
(hand edits of hyperparameters, groups without grads, a 0-dim param in a group of its own,
closures, state dicts right after construction, named params), and the rest of the optimizer API
users touch (state-dict hooks, resuming into a torch optimizer before wrapping).

Each loop runs plain (one process, every slice), sharded sync and sharded overlap with the model
attached, and (except the optimizer and scheduler loops, whose step is the same either way)
sharded overlap without a model; all loops of a world size run in one spawn. A program that
plain torch refuses at its first ``step()`` (``capturable=True`` on CPU, ``differentiable=True``
over leaf params) must be refused by the wrapper too: with torch's error, or at construction
(Note [Refused at the first step] in ``sharded_opt/step/inner_optimizer.py``).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.swa_utils import SWALR

from sharded_opt import ShardingStage1
from tests.harness.user_loops import (
    FP32_TOLERANCE,
    SLICE,
    Loop,
    ModelFreeLoop,
    _snapshot,
    loop_outcome_fixtures,
    run_loop_jobs,
)

STEPS = 4


class SurfaceNet(nn.Module):
    """Four param groups' worth of params: a first layer (its own learning rate), a body, a 0-dim
    gate (a group of its own) and an auxiliary head that only some steps use (a group whose
    params get no grad in those steps)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.tensor(0.7))
        self.aux = nn.Linear(8, 2)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        hidden = torch.tanh(self.second(torch.tanh(self.first(x)))) * self.gate
        out = self.head(hidden)
        return out + self.aux(hidden) if use_aux else out


def _groups(model: SurfaceNet, first_lr: float = 2e-2) -> list[dict[str, Any]]:
    return [
        {"params": list(model.first.parameters()), "lr": first_lr},
        {"params": list(model.second.parameters()) + list(model.head.parameters())},
        {"params": [model.gate]},
        {"params": list(model.aux.parameters())},
    ]


def _loss(model: SurfaceNet, step: int, use_aux: bool) -> Callable[[int], torch.Tensor]:
    def loss(index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(10 * step + index)
        x, y = torch.randn(SLICE, 6, generator=generator), torch.randn(SLICE, 2, generator=generator)
        return F.mse_loss(model(x, use_aux), y)

    return loss


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state value of ``opt.state_dict()`` in param and key order, as tensors."""
    state = opt.state_dict()["state"]
    return [torch.as_tensor(v) for index in sorted(state) for _, v in sorted(state[index].items())]


def _modes(loop_fn: Callable[[Loop], object], model_free: bool = True) -> dict[str, object]:
    """``loop_fn`` plain, sharded sync, overlap with the model attached and (``model_free``)
    overlap without; a mode that raises is recorded as its exception type (see
    :func:`assert_surface_matches`)."""
    loops = {"plain": Loop(False, False), "sync": Loop(True, False), "overlap": Loop(True, True)}
    if model_free:
        loops["overlap_no_model"] = ModelFreeLoop(True, True)
    results: dict[str, object] = {}
    for mode, loop in loops.items():
        try:
            results[mode] = loop_fn(loop)
        except Exception as error:  # noqa: BLE001 - compared with plain torch's own error
            results[mode] = {"raised": type(error).__name__, "message": str(error)}
    return results


def _same_refusal(mine: dict[str, str], plain: dict[str, str]) -> bool:
    """The wrapper raised what plain torch raised, or refused the same settings at construction
    (a ``ValueError`` quoting torch's error, see Note [Refused at the first step])."""
    if "raised" not in plain:
        return False
    quoted = f"{plain['raised']}: {plain['message'].splitlines()[0]}"
    return mine["raised"] == plain["raised"] or (mine["raised"] == "ValueError" and quoted in mine["message"])


def assert_surface_matches(outcomes: list[dict[str, object]], name: str) -> None:
    """Every sharded mode gives what plain torch gives: an error where plain torch raises (see
    :func:`_same_refusal`), the same warnings, and values within the fp32 bound of the earlier
    rounds."""
    for rank, results in enumerate(outcomes):
        result = results[name]
        assert not isinstance(result, str), f"rank {rank}: {result}"
        plain = result["plain"]
        for mode in [m for m in result if m != "plain"]:
            mine, where = result[mode], f"rank {rank}, {mode}"
            if "raised" in plain or "raised" in mine:
                assert "raised" in mine and _same_refusal(mine, plain), (
                    f"{where}: {mine} but plain torch gave {plain}"
                )
                continue
            assert mine.get("warnings") == plain.get("warnings"), where
            values = {k: v for k, v in mine.items() if k != "warnings"}
            expected = {k: v for k, v in plain.items() if k != "warnings"}
            torch.testing.assert_close(
                values, expected, **FP32_TOLERANCE, msg=lambda m, where=where: f"{where}: {m}"
            )


# -- every optimizer class with the flags users set ----------------------------------------------

_rare = st.integers(0, 5).map(lambda n: n == 5)
"""Flags that plain torch refuses on CPU at the first step (``capturable``, ``differentiable``)."""
_REFUSED_ON_CPU = ("capturable", "differentiable")
_weight_decay = st.sampled_from([0.0, 1e-2])
_implementation = {"foreach": st.sampled_from([None, True, False]), "maximize": st.booleans()}
_compiled_flags = {**_implementation, "capturable": _rare, "differentiable": _rare}

FLAGS: dict[str, dict[str, st.SearchStrategy]] = {
    "SGD": {
        **_implementation,
        "differentiable": _rare,
        "momentum": st.sampled_from([0.0, 0.5, 0.9]),
        "dampening": st.sampled_from([0.0, 0.1]),
        "nesterov": st.booleans(),
        "weight_decay": _weight_decay,
        "fused": st.sampled_from([None, None, True]),
    },
    "Adam": {
        **_compiled_flags,
        "amsgrad": st.booleans(),
        "weight_decay": _weight_decay,
        "betas": st.sampled_from([(0.9, 0.999), (0.8, 0.99)]),
        "decoupled_weight_decay": st.booleans(),
        "fused": st.sampled_from([None, None, True]),
    },
    "AdamW": {
        **_compiled_flags,
        "amsgrad": st.booleans(),
        "weight_decay": st.sampled_from([0.0, 1e-2, 0.1]),
        "fused": st.sampled_from([None, None, True]),
    },
    "Adamax": {**_compiled_flags, "weight_decay": _weight_decay},
    "NAdam": {
        **_compiled_flags,
        "weight_decay": _weight_decay,
        "momentum_decay": st.sampled_from([4e-3, 1e-2]),
        "decoupled_weight_decay": st.booleans(),
    },
    "RAdam": {**_compiled_flags, "weight_decay": _weight_decay, "decoupled_weight_decay": st.booleans()},
    "Adagrad": {
        **_implementation,
        "differentiable": _rare,
        "lr_decay": st.sampled_from([0.0, 1e-2]),
        "initial_accumulator_value": st.sampled_from([0.0, 0.1]),
        "weight_decay": _weight_decay,
        "fused": st.sampled_from([None, None, True]),
    },
    "Adadelta": {**_compiled_flags, "rho": st.sampled_from([0.9, 0.7]), "weight_decay": _weight_decay},
    "RMSprop": {
        **_compiled_flags,
        "alpha": st.sampled_from([0.99, 0.9]),
        "momentum": st.sampled_from([0.0, 0.5]),
        "centered": st.booleans(),
        "weight_decay": _weight_decay,
    },
    "Rprop": {
        **_compiled_flags,
        "etas": st.sampled_from([(0.5, 1.2), (0.3, 1.5)]),
        "step_sizes": st.sampled_from([(1e-6, 50.0), (1e-4, 0.5)]),
    },
    "ASGD": {
        **_compiled_flags,
        "lambd": st.sampled_from([1e-4, 1e-2]),
        "alpha": st.sampled_from([0.75, 0.5]),
        "t0": st.sampled_from([1.0, 1e6]),
        "weight_decay": _weight_decay,
    },
}
LEARNING_RATES = {"SGD": 0.05, "Adagrad": 0.05, "Adadelta": 1.0}


@st.composite
def optimizer_programs(draw, name: str) -> dict[str, Any]:
    """A (class, flags) combination plain torch builds, with the loop's habits: a ``Tensor``
    learning rate, hand edits of ``lr`` and ``weight_decay`` in the middle of the run, and
    ``zero_grad(set_to_none=False)``."""
    flags = {key: draw(strategy) for key, strategy in FLAGS[name].items()}
    if flags.get("nesterov") and (flags["momentum"] == 0 or flags["dampening"] != 0):
        flags["nesterov"] = False
    if flags.get("fused"):
        flags["foreach"] = None
        flags["differentiable"] = False
    tensor_lr = draw(_rare) and not (flags["foreach"] and not flags.get("capturable"))
    program = {
        "name": name,
        "flags": flags,
        "tensor_lr": tensor_lr,
        "edit": draw(st.booleans()),
        "keep_zeros": draw(st.booleans()),
    }
    try:
        build_optimizer(program, [nn.Parameter(torch.zeros(2))])
    except (ValueError, RuntimeError):
        assume(False)  # plain torch refuses it at construction, before any wrapper could
    return program


def draw_optimizer_programs(per_class: int) -> list[dict[str, Any]]:
    """``per_class`` distinct programs of every class, drawn from a fixed seed (see
    ``tests/parity/test_differential.py`` for why drawing happens once, outside the ranks)."""
    drawn: list[dict[str, Any]] = []
    for name in sorted(FLAGS):
        of_class: list[dict[str, Any]] = []

        @settings(
            max_examples=10 * per_class,
            derandomize=True,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(program=optimizer_programs(name))
        def collect(program: dict[str, Any]) -> None:
            if program not in of_class:  # noqa: B023 - collect runs within this iteration
                of_class.append(program)  # noqa: B023

        collect()
        drawn += _most_varied(of_class, per_class)
    return drawn


def _most_varied(programs: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The first program (the simplest draw: torch's defaults), then one at a time the program
    that sets the most (flag, value) pairs not chosen yet, so a few programs per class still
    set every flag both ways (flags plain torch refuses on CPU count for nothing: they would
    crowd out programs that step)."""

    def pairs(program: dict[str, Any]) -> set[tuple[str, str]]:
        settings = {**program["flags"], **{k: v for k, v in program.items() if k not in ("name", "flags")}}
        return {(key, repr(value)) for key, value in settings.items() if key not in _REFUSED_ON_CPU}

    chosen, seen = [programs[0]], pairs(programs[0])
    while len(chosen) < min(count, len(programs)):
        best = max((p for p in programs if p not in chosen), key=lambda p: len(pairs(p) - seen))
        chosen.append(best)
        seen |= pairs(best)
    return chosen


def build_optimizer(program: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    lr = LEARNING_RATES.get(program["name"], 1e-2)
    return getattr(torch.optim, program["name"])(
        groups, lr=torch.tensor(lr) if program["tensor_lr"] else lr, **program["flags"]
    )


def optimizer_loop(loop: Loop, program: dict[str, Any]) -> dict:
    """Four steps; the auxiliary head only on even steps; with ``edit``, after the second step
    the first group's ``lr`` is halved and the body's ``weight_decay`` set by hand."""
    model = SurfaceNet()
    params = list(model.parameters())
    opt = loop.wrap(build_optimizer(program, _groups(model)), model)
    for step in range(STEPS):
        loop.zero_grad(opt, set_to_none=not program["keep_zeros"])
        loop.backward(opt, params, _loss(model, step, use_aux=step % 2 == 0))
        opt.step()
        if program["edit"] and step == 1:
            opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.5
            if "weight_decay" in opt.param_groups[1]:
                opt.param_groups[1]["weight_decay"] = 0.05
    loop.sync(opt)
    return {"params": _snapshot(model), "state": _state_tensors(opt)}


OPTIMIZER_PROGRAMS = draw_optimizer_programs(2)


# -- schedulers that move more than the learning rate --------------------------------------------

PLATEAU_METRICS = [1.0, 0.9, 0.95, 0.96, 0.5, 0.6]
"""Validation losses for ``ReduceLROnPlateau``: an improvement, then a plateau longer than its
patience, then a drop."""

SCHEDULERS: dict[str, tuple[str, dict[str, Any], Callable[[Any], Any]]] = {
    "one_cycle_adam_betas": (
        "Adam",
        {"lr": 1e-2},
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.02, 0.01, 0.03], total_steps=6),
    ),
    "one_cycle_tensor_lr": (
        "AdamW",
        {"lr": 1e-2, "foreach": False, "tensor_lr": True},
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6),
    ),
    "cyclic_sgd_momentum": (
        "SGD",
        {"lr": 1e-2, "momentum": 0.9},
        lambda o: lr_scheduler.CyclicLR(o, 1e-3, 5e-2, step_size_up=2, mode="triangular2"),
    ),
    "cyclic_adamw_betas": (
        "AdamW",
        {"lr": 1e-2},
        lambda o: lr_scheduler.CyclicLR(o, 1e-3, 5e-2, step_size_up=2, base_momentum=0.8, max_momentum=0.95),
    ),
    "cyclic_rmsprop_exp_range": (
        "RMSprop",
        {"lr": 1e-2, "momentum": 0.5},
        lambda o: lr_scheduler.CyclicLR(o, 1e-3, 5e-2, step_size_up=3, mode="exp_range", gamma=0.9),
    ),
    "plateau_min_patience": (
        "Adam",
        {"lr": 1e-2},
        lambda o: lr_scheduler.ReduceLROnPlateau(o, mode="min", factor=0.5, patience=1, threshold=0.05),
    ),
    "sequential": (
        "SGD",
        {"lr": 5e-2, "momentum": 0.9},
        lambda o: lr_scheduler.SequentialLR(
            o, [lr_scheduler.LinearLR(o, 0.1, total_iters=3), lr_scheduler.CosineAnnealingLR(o, T_max=5)], [3]
        ),
    ),
    "chained": (
        "AdamW",
        {"lr": 1e-2},
        lambda o: lr_scheduler.ChainedScheduler(
            [lr_scheduler.ConstantLR(o, 0.5, total_iters=2), lr_scheduler.ExponentialLR(o, 0.9)], optimizer=o
        ),
    ),
    "warm_restarts": (
        "Adam",
        {"lr": 1e-2},
        lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2, eta_min=1e-4),
    ),
    "lambda_per_group": (
        "Adam",
        {"lr": 1e-2},
        lambda o: lr_scheduler.LambdaLR(
            o, [lambda s: 0.9**s, lambda s: 1 / (1 + s), lambda s: 1.0, lambda s: 0.5]
        ),
    ),
    "swa_lr": ("SGD", {"lr": 5e-2}, lambda o: SWALR(o, swa_lr=0.01, anneal_epochs=3)),
}


def _build_scheduled(loop: Loop, name: str, where: str, seed: int) -> tuple[SurfaceNet, Any, Any]:
    """Model, (wrapped) optimizer and scheduler; the scheduler is built on the torch optimizer
    ``before`` wrapping, on the wrapper ``after``, or on the torch optimizer after wrapping
    (``original_after``: code that keeps both names)."""
    class_name, kwargs, make = SCHEDULERS[name]
    kwargs = dict(kwargs)
    if kwargs.pop("tensor_lr", False):
        kwargs["lr"] = torch.tensor(kwargs["lr"])
    torch.manual_seed(seed)
    model = SurfaceNet()
    optimizer = getattr(torch.optim, class_name)(_groups(model), **kwargs)
    scheduler = make(optimizer) if where == "before" else None
    opt = loop.wrap(optimizer, model)
    if scheduler is None:
        scheduler = make(opt if where == "after" else optimizer)
    return model, opt, scheduler


def _train_scheduled(loop: Loop, model: SurfaceNet, opt, scheduler, steps: range, early: bool) -> list:
    """Steps with the scheduler after ``opt.step()`` (or, ``early``, before it, as old scripts
    do); returns what users log: every group's lr and momentum or betas."""
    params = list(model.parameters())
    logged = []
    for step in steps:
        if early:
            scheduler.step()
        loop.zero_grad(opt)
        loop.backward(opt, params, _loss(model, step, use_aux=step % 2 == 0))
        opt.step()
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step(PLATEAU_METRICS[step])
        elif not early:
            scheduler.step()
        logged.append([float(g["lr"]) for g in opt.param_groups])
        logged.append([float(g.get("betas", (g.get("momentum", 0.0),))[0]) for g in opt.param_groups])
    return logged


def scheduler_loop(loop: Loop, name: str, where: str, resume: bool = False, early: bool = False) -> dict:
    """Six steps; with ``resume``, three steps, ``torch.save`` of model, optimizer and scheduler,
    a rebuild from another seed, ``load_state_dict`` of all three and three more steps. Warnings
    are recorded (torch's own order check of ``scheduler.step()`` and ``optimizer.step()``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, scheduler = _build_scheduled(loop, name, where, 0)
        if not resume:
            logged = _train_scheduled(loop, model, opt, scheduler, range(6), early)
        else:
            logged = _train_scheduled(loop, model, opt, scheduler, range(3), early)
            saved = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict()}, saved
            )
            del model, opt, scheduler
            model, opt, scheduler = _build_scheduled(loop, name, where, 1)
            loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["opt"])
            scheduler.load_state_dict(loaded["sched"])
            logged += _train_scheduled(loop, model, opt, scheduler, range(3, 6), early)
        loop.sync(opt)
    messages = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return {"params": _snapshot(model), "logged": logged, "warnings": messages}


SCHEDULER_JOBS: dict[str, Callable[[Loop], dict]] = {
    **{
        f"scheduler_{name}": lambda loop, name=name: scheduler_loop(loop, name, "after")
        for name in SCHEDULERS
    },
    **{
        f"scheduler_{name}_before_wrap": lambda loop, name=name: scheduler_loop(loop, name, "before")
        for name in ("one_cycle_adam_betas", "plateau_min_patience")
    },
    **{
        f"scheduler_{name}_on_torch_optimizer": lambda loop, name=name: scheduler_loop(
            loop, name, "original_after"
        )
        for name in ("lambda_per_group",)
    },
    **{
        f"scheduler_{name}_resumed": lambda loop, name=name: scheduler_loop(loop, name, "after", resume=True)
        for name in ("one_cycle_adam_betas", "cyclic_sgd_momentum", "plateau_min_patience")
    },
    "scheduler_sequential_resumed_before_wrap": lambda loop: scheduler_loop(
        loop, "sequential", "before", True
    ),
    "scheduler_stepped_first_before_wrap": lambda loop: scheduler_loop(
        loop, "warm_restarts", "before", early=True
    ),
}


# -- param-group habits --------------------------------------------------------------------------


def hand_edit_loop(loop: Loop, class_name: str, kwargs: dict[str, Any]) -> dict:
    """Hyperparameters edited by hand between steps: ``lr`` of one group, ``weight_decay`` of
    another, ``betas`` or ``momentum`` of the 0-dim param's group, then ``maximize`` and
    ``foreach`` of the auxiliary group; ``opt.defaults`` read as users read it."""
    model = SurfaceNet()
    params = list(model.parameters())
    opt = loop.wrap(getattr(torch.optim, class_name)(_groups(model), **kwargs), model)
    for step in range(5):
        loop.zero_grad(opt)
        loop.backward(opt, params, _loss(model, step, use_aux=True))
        if step == 1:
            opt.param_groups[0]["lr"] *= 0.3
            opt.param_groups[1]["weight_decay"] = 0.05
            if "betas" in opt.param_groups[2]:
                opt.param_groups[2]["betas"] = (0.8, 0.9)
            if "momentum" in opt.param_groups[2]:
                opt.param_groups[2]["momentum"] = 0.5
        if step == 3:
            opt.param_groups[3]["maximize"] = True
            opt.param_groups[1]["foreach"] = True
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model), "state": _state_tensors(opt), "lr_default": opt.defaults["lr"]}


def stop_getting_grads_loop(loop: Loop, class_name: str, kwargs: dict[str, Any], set_to_none: bool) -> dict:
    """The auxiliary head gets grads in the first two steps only; grads zeroed with
    ``zero_grad(set_to_none=...)``: zeros keep momentum (and weight decay) going, as in torch,
    None leaves the head alone."""
    model = SurfaceNet()
    params = list(model.parameters())
    opt = loop.wrap(getattr(torch.optim, class_name)(_groups(model), **kwargs), model)
    for step in range(5):
        loop.zero_grad(opt, set_to_none=set_to_none)
        loop.backward(opt, params, _loss(model, step, use_aux=step < 2))
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model), "state": _state_tensors(opt)}


def group_without_grads_loop(loop: Loop) -> dict:
    """A whole param group (the auxiliary head) that never gets a grad, with weight decay: it
    is never stepped and has no state, as in torch."""
    model = SurfaceNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(_groups(model), lr=1e-2, weight_decay=0.1), model)
    for step in range(3):
        loop.zero_grad(opt)
        loop.backward(opt, params, _loss(model, step, use_aux=False))
        opt.step()
    loop.sync(opt)
    params_with_state = sorted(opt.state_dict()["state"])
    return {"params": _snapshot(model), "with_state": torch.tensor(params_with_state)}


def closure_loop(loop: Loop, class_name: str, kwargs: dict[str, Any]) -> dict:
    """``loss = opt.step(closure)`` whose closure zeroes grads, runs forward and backward and
    returns the loss; one step's forward skips the auxiliary head."""
    model = SurfaceNet()
    params = list(model.parameters())
    opt = loop.wrap(getattr(torch.optim, class_name)(_groups(model), **kwargs), model)
    losses = []
    for step in range(3):

        def closure(step: int = step) -> torch.Tensor:
            loop.zero_grad(opt)
            loop.backward(opt, params, _loss(model, step, use_aux=step != 1))
            with torch.no_grad():
                return _loss(model, step, use_aux=step != 1)(0)

        losses.append(opt.step(closure))
    loop.sync(opt)
    return {"params": _snapshot(model), "losses": losses}


def fresh_state_dict_loop(loop: Loop, class_name: str, kwargs: dict[str, Any]) -> dict:
    """``opt.state_dict()`` before any step (Adagrad already has state then), loaded back at
    once; a round trip through ``state_dict()`` in the middle of the run. The first state dict's
    values are copied at once: plain torch hands out its live state tensors and keeps the loaded
    ones, going on to step them in place; the wrapper copies in both directions."""
    model = SurfaceNet()
    params = list(model.parameters())
    opt = loop.wrap(getattr(torch.optim, class_name)(_groups(model), **kwargs), model)
    fresh = opt.state_dict()
    fresh_state = [
        torch.as_tensor(v).clone() for i in sorted(fresh["state"]) for v in fresh["state"][i].values()
    ]
    opt.load_state_dict(fresh)
    for step in range(3):
        loop.zero_grad(opt)
        loop.backward(opt, params, _loss(model, step, use_aux=True))
        opt.step()
        if step == 1:
            opt.load_state_dict(opt.state_dict())
    loop.sync(opt)
    return {"params": _snapshot(model), "fresh_state": fresh_state, "state": _state_tensors(opt)}


def _named_build(loop: Loop, seed: int) -> tuple[SurfaceNet, Any, Any]:
    torch.manual_seed(seed)
    model = SurfaceNet()
    named = list(model.named_parameters())
    groups = [{"params": named[:2], "lr": 2e-2}, {"params": named[2:]}]
    opt = loop.wrap(torch.optim.AdamW(groups, lr=1e-2), model)
    return model, opt, lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)


def _named_train(loop: Loop, model: SurfaceNet, opt, scheduler, steps: range) -> None:
    params = list(model.parameters())
    for step in steps:
        loop.zero_grad(opt)
        loop.backward(opt, params, _loss(model, step, use_aux=step % 2 == 0))
        opt.step()
        scheduler.step()


def named_params_loop(loop: Loop, plain_file: bytes | None = None) -> dict:
    """``AdamW(model.named_parameters())`` in two groups (torch keeps ``param_names``), a OneCycle
    schedule; saved after three steps and resumed into a fresh rebuild from the same run's file
    or, with ``plain_file``, from plain torch's."""
    model, opt, scheduler = _named_build(loop, 0)
    _named_train(loop, model, opt, scheduler, range(3))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict()}, saved)
    model, opt, scheduler = _named_build(loop, 1)
    loaded = torch.load(io.BytesIO(plain_file or saved.getvalue()), weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    scheduler.load_state_dict(loaded["sched"])
    _named_train(loop, model, opt, scheduler, range(3, 6))
    loop.sync(opt)
    names = [group["param_names"] for group in opt.state_dict()["param_groups"]]
    expected = [name for name, _ in model.named_parameters()]
    kept = torch.tensor(names == [expected[:2], expected[2:]])
    return {"params": _snapshot(model), "saved": saved.getvalue(), "names_kept": kept}


def named_params_jobs() -> dict[str, object]:
    """:func:`named_params_loop` in every mode, and resumed from the plain run's file."""
    results = _modes(named_params_loop)
    plain_file = results["plain"]["saved"]
    results["sync_from_plain"] = named_params_loop(Loop(True, False), plain_file)
    results["overlap_from_plain"] = named_params_loop(ModelFreeLoop(True, True), plain_file)
    for result in results.values():
        result.pop("saved", None)
    return results


HABIT_CLASSES = {
    "sgd": ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}),
    "adam": ("Adam", {"lr": 1e-2, "weight_decay": 1e-2, "amsgrad": True}),
    "rmsprop": ("RMSprop", {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    "adagrad": ("Adagrad", {"lr": 0.05, "initial_accumulator_value": 0.1}),
}

HABIT_JOBS: dict[str, Callable[[Loop], dict]] = {
    **{
        f"hand_edits_{key}": lambda loop, c=HABIT_CLASSES[key]: hand_edit_loop(loop, *c)
        for key in ("sgd", "adam", "rmsprop")
    },
    "stop_getting_grads_sgd_zeros": lambda loop: stop_getting_grads_loop(loop, *HABIT_CLASSES["sgd"], False),
    "stop_getting_grads_sgd_none": lambda loop: stop_getting_grads_loop(loop, *HABIT_CLASSES["sgd"], True),
    "stop_getting_grads_adam_zeros": lambda loop: stop_getting_grads_loop(
        loop, *HABIT_CLASSES["adam"], False
    ),
    "group_without_grads": group_without_grads_loop,
    "closure_adam": lambda loop: closure_loop(loop, *HABIT_CLASSES["adam"]),
    "closure_rprop": lambda loop: closure_loop(loop, "Rprop", {"lr": 1e-2}),
    "fresh_state_dict_adagrad": lambda loop: fresh_state_dict_loop(loop, *HABIT_CLASSES["adagrad"]),
    "fresh_state_dict_adam": lambda loop: fresh_state_dict_loop(loop, *HABIT_CLASSES["adam"]),
}


# -- the fixtures --------------------------------------------------------------------------------


def _jobs() -> dict[str, Callable[[], object]]:
    jobs: dict[str, Callable[[], object]] = {
        f"optimizer_{i}_{program['name']}": lambda program=program: _modes(
            lambda loop: optimizer_loop(loop, program), model_free=False
        )
        for i, program in enumerate(OPTIMIZER_PROGRAMS)
    }
    for name, loop_fn in SCHEDULER_JOBS.items():
        jobs[name] = lambda loop_fn=loop_fn: _modes(loop_fn, model_free=False)
    for name, loop_fn in HABIT_JOBS.items():
        jobs[name] = lambda loop_fn=loop_fn: _modes(loop_fn)
    jobs["named_params"] = named_params_jobs
    return jobs


THREE_RANK_JOBS = (
    *(f"optimizer_{i}_{p['name']}" for i, p in enumerate(OPTIMIZER_PROGRAMS) if i % 4 == 1),
    "scheduler_one_cycle_adam_betas_resumed",
    "stop_getting_grads_sgd_zeros",
    "named_params",
)
"""Jobs run on 3 ranks too: shards then split params and groups at other offsets."""


def _run_all(names: tuple[str, ...] | None = None) -> dict[str, object]:
    return run_loop_jobs(_jobs(), names)


outcomes, outcomes_on_three = loop_outcome_fixtures(_run_all, THREE_RANK_JOBS)


@pytest.mark.parametrize("name", sorted(_jobs()))
def test_optimizer_surface_matches_plain_torch(outcomes, name: str) -> None:
    assert_surface_matches(outcomes, name)


@pytest.mark.parametrize("name", THREE_RANK_JOBS)
def test_optimizer_surface_on_three_ranks_matches_plain_torch(outcomes_on_three, name: str) -> None:
    assert_surface_matches(outcomes_on_three, name)


def test_drawn_programs_cover_every_accepted_class_and_flag() -> None:
    """The draw is not vacuous: every class, and each flag that changes the arithmetic, set both ways."""
    assert {p["name"] for p in OPTIMIZER_PROGRAMS} == set(FLAGS)
    for flag in ("maximize", "amsgrad", "nesterov", "centered", "decoupled_weight_decay", "fused"):
        values = {bool(p["flags"][flag]) for p in OPTIMIZER_PROGRAMS if flag in p["flags"]}
        assert values == {False, True}, flag
    assert {p["flags"]["foreach"] for p in OPTIMIZER_PROGRAMS} == {None, True, False}
    assert any(p["tensor_lr"] for p in OPTIMIZER_PROGRAMS)


# -- the rest of the optimizer API -----------------------------------------------------------------


def _stepped(opt: torch.optim.Optimizer, model: SurfaceNet) -> None:
    opt.zero_grad()
    _loss(model, 0, use_aux=True)(0).backward()
    opt.step()


def test_state_dict_hooks_run_as_in_torch(single_rank_group) -> None:
    """Hooks registered on the wrapper with ``register_state_dict_pre_hook`` and the three
    others run as on a torch optimizer, in the same order, and what post-hooks and load
    pre-hooks return replaces the state dict."""

    def register(opt: torch.optim.Optimizer, calls: list[str]) -> None:
        opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "saved_by": "post hook"})
        opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(f"load pre {sd.get('saved_by')}"))
        opt.register_load_state_dict_pre_hook(
            lambda o, sd: {**sd, "param_groups": [{**g, "lr": 0.5} for g in sd["param_groups"]]}
        )
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))

    model, reference = SurfaceNet(), SurfaceNet()
    opt = ShardingStage1(torch.optim.Adam(_groups(model)), model=model)
    plain = torch.optim.Adam(_groups(reference))
    calls: dict[str, list[str]] = {"sharded": [], "plain": []}
    for name, optimizer, net in (("sharded", opt, model), ("plain", plain, reference)):
        register(optimizer, calls[name])
        _stepped(optimizer, net)
        saved = optimizer.state_dict()
        assert saved["saved_by"] == "post hook", name
        optimizer.load_state_dict(saved)
        assert [g["lr"] for g in optimizer.param_groups] == [0.5] * 4, name
    assert calls["sharded"] == calls["plain"] == ["save pre", "load pre post hook", "load post"]
    opt.close()


def test_state_dict_lists_params_in_order_on_one_rank(single_rank_group) -> None:
    """``state_dict()["state"]`` lists params in param order as torch does (it listed them in
    bucket order, the reverse, where nothing was gathered: one rank or ``enable=False``)."""
    model, reference = SurfaceNet(), SurfaceNet()
    opt = ShardingStage1(torch.optim.AdamW(_groups(model)), model=model)
    plain = torch.optim.AdamW(_groups(reference))
    _stepped(opt, model)
    _stepped(plain, reference)
    assert list(opt.state_dict()["state"]) == list(plain.state_dict()["state"])
    opt.close()


@pytest.mark.parametrize(
    "group_flags, flags, torch_error",
    [
        (
            {"capturable": True},  # only the 0-dim param's group
            {},
            r"group 2, cannot step .*AssertionError: If capturable=True, params and state_steps must be on",
        ),
        (
            {},
            {"differentiable": True},  # read from the optimizer's defaults, so every group
            r"group 0, cannot step .*RuntimeError: a leaf Variable that requires grad is being used in",
        ),
    ],
)
def test_settings_torch_refuses_at_the_first_step_are_refused_at_construction(
    single_rank_group, group_flags: dict[str, bool], flags: dict[str, bool], torch_error: str
) -> None:
    """Plain torch refuses these only inside ``step()``; sharded, only the ranks whose shard holds
    a piece of a param with a grad would raise, and the others would wait in the all-gather (the
    3-rank run of this module hung there). Refused on every rank at construction, naming the
    group, the setting and torch's own error; nothing is changed (the params are not moved)."""
    model = SurfaceNet()
    groups = _groups(model)
    groups[2].update(group_flags)
    with pytest.raises(ValueError, match=rf"Adam, configured as param {torch_error}"):
        ShardingStage1(torch.optim.Adam(groups, lr=1e-2, **flags), model=model)
    assert model.gate.untyped_storage().size() == model.gate.element_size()


def test_state_loaded_before_wrapping_is_refused_naming_the_wrappers_load(single_rank_group) -> None:
    """A resume script that loads the checkpoint into the torch optimizer and wraps it after:
    the state would be dropped, so it is refused, naming the call that resumes."""
    model, reference = SurfaceNet(), SurfaceNet()
    plain = torch.optim.AdamW(_groups(reference))
    _stepped(plain, reference)
    optimizer = torch.optim.AdamW(_groups(model))
    optimizer.load_state_dict(plain.state_dict())
    with pytest.raises(
        ValueError, match=r"has not stepped yet.*ShardingStage1\(optimizer, \.\.\.\); opt.load_state_dict"
    ):
        ShardingStage1(optimizer, model=model)
