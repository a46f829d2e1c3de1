"""One named regression test per way the wrapper used to differ from the torch optimizer it
wraps (with torch's defaults). Each runs the habit on 2 gloo ranks (or one, where the habit has
nothing to do with communication) and compares with plain torch on one process.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, load_checkpoint, save_checkpoint
from tests.harness.dist_helper import run_jobs, run_ranks
from tests.harness.training import _to_bytes

SMALL_BUCKETS = Strategy(sharding=ShardingConfig(bucket_size_mb=0.0005))


class TwoLayers(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 8).to(dtype)
        self.expert = nn.Linear(8, 8).to(dtype)
        self.last = nn.Linear(8, 2).to(dtype)

    def forward(self, x: torch.Tensor, use_expert: bool = True) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        if use_expert:
            hidden = hidden + self.expert(hidden)
        return self.last(hidden)


def _inputs(step: int, rank: int | None, world_size: int, dtype=torch.float32) -> torch.Tensor:
    data = torch.randn(12, 6, generator=torch.Generator().manual_seed(step)).to(dtype)
    if rank is None:
        return data
    size = 12 // world_size
    return data[rank * size : (rank + 1) * size]


def _train_sharded(make_optimizer, steps: int, before_step=None, overlap: bool = False, **kwargs):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = TwoLayers()
    opt = ShardingStage1(
        make_optimizer(model), overlap=overlap, strategy=SMALL_BUCKETS, model=model, **kwargs
    )
    history = []
    for step in range(steps):
        if before_step is not None:
            before_step(model, step)
        opt.zero_grad()
        use_expert = getattr(model, "use_expert", True)
        model(_inputs(step, rank, world_size), use_expert=use_expert).square().mean().backward()
        opt.step()
        opt.sync_params()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _train_plain(make_optimizer, steps: int, before_step=None):
    model = TwoLayers()
    opt = make_optimizer(model)
    for step in range(steps):
        if before_step is not None:
            before_step(model, step)
        opt.zero_grad()
        model(
            _inputs(step, None, 1), use_expert=getattr(model, "use_expert", True)
        ).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> dict[str, list]:
    """Every multi-rank habit of this file in one 2-rank job (starting ranks costs seconds);
    maps a job name to its per-rank results."""
    state, params, _, _ = _plain_run_with_different_step_counts()
    folder = tmp_path_factory.mktemp("checkpoints")
    jobs: list[tuple[str, object, tuple]] = []
    for overlap in (False, True):
        for habit in (_freeze_expert_at_step_2, _skip_expert_from_step_2):
            jobs.append((f"{habit.__name__}-{overlap}", _train_sharded, (_adamw, 6, habit, overlap)))
        jobs.append(
            (f"unfreeze-{overlap}", _train_sharded, (_frozen_at_wrap, 5, _unfreeze_expert_at_step_2, overlap))
        )
    jobs.append(("resume", _resume_from_plain_state, (state, params)))
    for write in ("none", "noop_inplace", "data_clamp"):
        jobs.append((f"bf16-{write}", _bf16_written_param, (write,)))
    jobs.append(("fp64", _fp64_master_run, ()))
    for lr_kind in ("int", "tensor"):
        jobs.append((f"lr-{lr_kind}", _checkpoint_lr_types, (str(folder / f"lr-{lr_kind}"), lr_kind)))
    jobs.append(("int_lr", _int_lr_survives, (str(folder / "int_lr"),)))
    for overlap in (False, True):
        jobs.append((f"step_hooks-{overlap}", _ema_by_step_hooks, (overlap,)))
        jobs.append((f"params_outside_model-{overlap}", _multitask_with_loss_weights, (overlap,)))
    per_rank = run_ranks(run_jobs, 2, jobs)
    return {name: [results[name] for results in per_rank] for name, _, _ in jobs}


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _assert_all_close(got, expected) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, i=index: f"param {i}: {m}")


def _freeze_expert_at_step_2(model: nn.Module, step: int) -> None:
    if step == 2:
        model.expert.requires_grad_(False)


def _skip_expert_from_step_2(model: nn.Module, step: int) -> None:
    model.use_expert = step < 2


def _unfreeze_expert_at_step_2(model: nn.Module, step: int) -> None:
    model.expert.requires_grad_(step >= 2)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize(
    "habit",
    [_freeze_expert_at_step_2, _skip_expert_from_step_2],
    ids=["frozen_after_wrap", "unused_on_all_ranks"],
)
def test_params_without_grad_on_every_rank_are_left_untouched(on_two_ranks, habit, overlap: bool) -> None:
    """Observation 1: no weight decay, no momentum, no step for a param nobody gave a grad."""
    results = on_two_ranks[f"{habit.__name__}-{overlap}"]
    expected = _train_plain(_adamw, 6, habit)
    for history in results:
        _assert_all_close(history[-1], expected)
        # The expert's weight and bias (params 2, 3) keep exactly their value after step 2.
        for index in (2, 3):
            assert torch.equal(history[-1][index], history[1][index])


def _frozen_at_wrap(model: nn.Module) -> torch.optim.Optimizer:
    model.expert.requires_grad_(False)
    return _adamw(model)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_param_frozen_at_wrap_and_unfrozen_later_is_stepped(on_two_ranks, overlap: bool) -> None:
    """Observation 2: gradual unfreezing."""
    results = on_two_ranks[f"unfreeze-{overlap}"]
    expected = _train_plain(_frozen_at_wrap, 5, _unfreeze_expert_at_step_2)
    initial = [p.detach() for p in TwoLayers().parameters()]
    assert not torch.equal(expected[2], initial[2])
    for history in results:
        _assert_all_close(history[-1], expected)


def _resume_from_plain_state(plain_state: bytes, plain_params: bytes) -> list:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = TwoLayers()
    model.load_state_dict(torch.load(io.BytesIO(plain_params)))
    opt = ShardingStage1(_adamw(model), strategy=SMALL_BUCKETS, model=model)
    opt.load_state_dict(torch.load(io.BytesIO(plain_state)))
    steps = [int(entry["step"]) for entry in opt.state_dict()["state"].values()]
    opt.zero_grad()
    model(_inputs(9, rank, world_size)).square().mean().backward()
    opt.step()
    return steps, [p.detach().clone() for p in model.parameters()]


def _plain_run_with_different_step_counts() -> tuple[bytes, bytes, list[int], list[torch.Tensor]]:
    """A plain AdamW run whose params have different step counts, its state and params as bytes,
    and its params after one more step."""
    model = TwoLayers()
    opt = _adamw(model)
    for step in range(4):
        _skip_expert_from_step_2(model, step)
        opt.zero_grad()
        model(_inputs(step, None, 1), use_expert=model.use_expert).square().mean().backward()
        opt.step()
    plain_steps = [int(entry["step"]) for entry in opt.state_dict()["state"].values()]
    state, params = _to_bytes(opt.state_dict()), _to_bytes(model.state_dict())
    opt.zero_grad()
    model(_inputs(9, None, 1)).square().mean().backward()
    opt.step()
    return state, params, plain_steps, [p.detach().clone() for p in model.parameters()]


def test_each_param_keeps_its_own_step_count_through_a_checkpoint(on_two_ranks) -> None:
    """Observation 3: params of one bucket with different step counts load and resume exactly."""
    _, _, plain_steps, plain_after = _plain_run_with_different_step_counts()
    assert sorted(set(plain_steps)) == [2, 4]
    for steps, resumed in on_two_ranks["resume"]:
        assert steps == plain_steps
        _assert_all_close(resumed, plain_after)


def _bf16_written_param(write: str) -> list:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = TwoLayers(torch.bfloat16)
    config = ShardingConfig(master_dtype=torch.float32, bucket_size_mb=25.0)
    opt = ShardingStage1(
        torch.optim.SGD(model.parameters(), lr=1e-3), strategy=Strategy(sharding=config), model=model
    )
    history = []
    for step in range(6):
        opt.zero_grad()
        model(_inputs(step, rank, world_size, torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.sync_params()
        with torch.no_grad():
            if write == "noop_inplace":  # like open_clip's logit_scale.clamp_ (here: a no-op)
                model.last.bias.clamp_(-1e4, 1e4)
            elif write == "data_clamp":  # a WGAN critic's weight clipping
                model.last.weight.data.clamp_(-0.05, 0.05)
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def test_writing_one_bf16_param_does_not_reset_the_masters_of_others(on_two_ranks) -> None:
    """Observation 4: with fp32 masters, an in-place write to one param re-reads that param's
    master only; writes through ``.data`` are seen too."""
    untouched = on_two_ranks["bf16-none"][0]
    noop = on_two_ranks["bf16-noop_inplace"][0]
    for a, b in zip(noop[-1], untouched[-1], strict=True):
        assert torch.equal(a, b)  # a write that changes no value changes nothing
    clamped = on_two_ranks["bf16-data_clamp"]
    for history in clamped:
        for step, params in enumerate(history[1:], start=1):
            weight = params[4]
            # The step after a clamp starts from the clamped value, so the weight leaves the
            # bound by at most one small update, never back to its unclamped master (~0.3).
            assert weight.float().abs().max() <= 0.06, step


def _fp64_master_run() -> tuple[list, int]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = TwoLayers(torch.float64)
    config = ShardingConfig(master_dtype=torch.float32)
    opt = ShardingStage1(_adamw(model), strategy=Strategy(sharding=config), model=model)
    for step in range(4):
        opt.zero_grad()
        model(_inputs(step, rank, world_size, torch.float64)).square().mean().backward()
        opt.step()
    opt.sync_params()
    return [p.detach().clone() for p in model.parameters()], opt.memory_bytes()["master"]


def test_fp64_params_are_not_rounded_to_an_fp32_master(on_two_ranks) -> None:
    """Observation 5: a master is kept only where master_dtype is wider than the params."""
    model = TwoLayers(torch.float64)
    opt = _adamw(model)
    for step in range(4):
        opt.zero_grad()
        model(_inputs(step, None, 1, torch.float64)).square().mean().backward()
        opt.step()
    for params, master_bytes in on_two_ranks["fp64"]:
        assert master_bytes == 0
        for a, b in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-14)


def test_scheduler_built_before_wrapping_drives_the_step(single_rank_group) -> None:
    """Observation 6: the wrapper's param groups are the wrapped optimizer's group dicts."""
    model = TwoLayers()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.1)
    opt = ShardingStage1(inner)
    assert opt.param_groups is inner.param_groups
    lrs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        for step in range(3):
            opt.zero_grad()
            model(_inputs(step, None, 1)).sum().backward()
            opt.step()
            lrs.append(opt.shards.inner.param_groups[0]["lr"])
            scheduler.step()
    assert lrs == pytest.approx([1.0, 0.1, 0.01])
    inner.param_groups[0]["custom_key"] = 3
    assert opt.param_groups[0]["custom_key"] == 3


def test_add_param_group_on_the_wrapped_optimizer_raises(single_rank_group) -> None:
    """Observation 6: params added to the original after wrapping would never be stepped."""
    model = TwoLayers()
    inner = torch.optim.SGD(model.first.parameters(), lr=1.0)
    ShardingStage1(inner)
    with pytest.raises(RuntimeError, match="add every param group to the torch optimizer first"):
        inner.add_param_group({"params": list(model.last.parameters())})


def test_load_state_dict_checks_keys_against_the_loaded_configuration(single_rank_group) -> None:
    """Observation 7: momentum comes with the loaded groups, as in plain torch."""
    source_model = TwoLayers()
    source = torch.optim.SGD(source_model.parameters(), lr=0.01, momentum=0.9)
    for step in range(2):
        source.zero_grad()
        source_model(_inputs(step, None, 1)).square().mean().backward()
        source.step()
    saved = source.state_dict()
    plain_model, wrapped_model = TwoLayers(), TwoLayers()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    plain.load_state_dict(saved)
    wrapped = ShardingStage1(torch.optim.SGD(wrapped_model.parameters(), lr=0.01))
    wrapped.load_state_dict(saved)
    assert wrapped.param_groups[0]["momentum"] == 0.9
    for model, opt in ((plain_model, plain), (wrapped_model, wrapped)):
        opt.zero_grad()
        model(_inputs(5, None, 1)).square().mean().backward()
        opt.step()
    for a, b in zip(wrapped_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(a, b)


def _checkpoint_lr_types(path: str, lr_kind: str) -> list:
    lr = 1 if lr_kind == "int" else torch.tensor(0.5)  # made here: tensors sent to ranks share memory
    model = TwoLayers()
    opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=lr), model=model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.zero_grad()
    model(_inputs(0, dist.get_rank(), dist.get_world_size())).sum().backward()
    opt.step()
    scheduler.step()
    saved_lr = opt.param_groups[0]["lr"]
    save_checkpoint(path, model, opt)
    fresh_model = TwoLayers()
    fresh_lr = 1 if lr_kind == "int" else torch.tensor(0.5)
    fresh = ShardingStage1(torch.optim.SGD(fresh_model.parameters(), lr=fresh_lr), model=fresh_model)
    load_checkpoint(path, fresh_model, fresh)
    loaded = fresh.param_groups[0]["lr"]
    return [repr(saved_lr), repr(loaded), type(loaded).__name__]


@pytest.mark.parametrize(
    ("lr_kind", "expected"),
    [("int", ["0.5", "0.5", "float"]), ("tensor", ["tensor(0.2500)", "tensor(0.2500)", "Tensor"])],
    ids=["int_lr", "tensor_lr"],
)
def test_checkpoint_keeps_hyperparameter_types(on_two_ranks, lr_kind, expected) -> None:
    """Observation 8: an int lr stays an int (halved by StepLR it is a float, as in torch);
    a Tensor lr comes back as a Tensor with its value."""
    for result in on_two_ranks[f"lr-{lr_kind}"]:
        assert result == expected


def _int_lr_survives(path: str) -> list:
    model = TwoLayers()
    opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=2, momentum=0.5), model=model)
    save_checkpoint(path, model, opt)
    opt.param_groups[0]["lr"] = 7
    load_checkpoint(path, model, opt)
    return [repr(opt.param_groups[0]["lr"])]


def test_checkpoint_keeps_an_int_lr_an_int(on_two_ranks) -> None:
    assert on_two_ranks["int_lr"] == [["2"], ["2"]]


class _SGDWithScale(torch.optim.SGD):
    """An optimizer whose step takes a keyword, as some do (``grad_scaler`` fused steps, ...)."""

    seen: list = []

    @torch.no_grad()
    def step(self, closure=None, *, scale: float = 1.0):
        _SGDWithScale.seen.append(scale)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"] * scale)


def test_step_forwards_keyword_arguments(single_rank_group) -> None:
    """Observation 9: ``step(**kwargs)`` reaches the wrapped optimizer's step."""
    model = TwoLayers()
    opt = ShardingStage1(_SGDWithScale(model.parameters(), lr=0.1), assume_elementwise=True)
    _SGDWithScale.seen.clear()
    opt.zero_grad()
    model(_inputs(0, None, 1)).sum().backward()
    opt.step(scale=0.5)
    assert _SGDWithScale.seen == [0.5]


def test_per_param_state_lookups_and_writes_raise_naming_state_dict(single_rank_group) -> None:
    """``opt.state`` iterates empty (device-moving loops do nothing, rightly); looking up or
    writing one param's state raises instead of reading ``{}`` or writing into nothing."""
    model = nn.Linear(3, 2)
    opt = ShardingStage1(torch.optim.Adam(model.parameters()), model=model)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    moved = [value for state in opt.state.values() for value in state.values()]
    assert moved == [] and len(opt.state) == 0 and model.weight not in opt.state
    with pytest.raises(KeyError, match=r"not per param.*opt\.state_dict\(\)"):
        opt.state[model.weight]["exp_avg"].zero_()
    with pytest.raises(TypeError, match=r"opt\.load_state_dict\(\)"):
        opt.state[model.weight] = {}
    assert opt.state.get(model.weight) is None


class _EmaByHooks:
    """An EMA of the params kept by a step post-hook on the torch optimizer, a common way to keep
    one without touching the training loop; it also counts pre-hook and global-hook calls."""

    def __init__(self, model: nn.Module) -> None:
        self.average = [p.detach().clone() for p in model.parameters()]
        self.params = list(model.parameters())
        self.calls = {"pre": 0, "post": 0, "global": 0}

    @torch.no_grad()
    def post(self, optimizer, args, kwargs) -> None:
        self.calls["post"] += 1
        torch._foreach_lerp_(self.average, self.params, 0.25)

    def pre(self, optimizer, args, kwargs) -> None:
        assert isinstance(optimizer, torch.optim.AdamW) and args[0] is optimizer
        self.calls["pre"] += 1

    def global_post(self, optimizer, args, kwargs) -> None:
        self.calls["global"] += 1


def _ema_by_step_hooks(overlap: bool | None) -> tuple[list[torch.Tensor], dict[str, int]]:
    """Plain torch when ``overlap`` is None, else the wrapper on this rank's slice."""
    model = TwoLayers()
    optimizer = _adamw(model)
    ema = _EmaByHooks(model)
    optimizer.register_step_post_hook(ema.post)
    global_hook = register_optimizer_step_post_hook(ema.global_post)
    try:
        if overlap is None:
            opt, rank, world_size = optimizer, None, 1
        else:
            opt = ShardingStage1(optimizer, overlap=overlap, strategy=SMALL_BUCKETS, model=model)
            rank, world_size = dist.get_rank(), dist.get_world_size()
        optimizer.register_step_pre_hook(ema.pre)  # after wrapping: it fires too
        for step in range(4):
            opt.zero_grad()
            model(_inputs(step, rank, world_size)).square().mean().backward()
            opt.step()
    finally:
        global_hook.remove()
    return ema.average, ema.calls


def test_step_hooks_of_the_wrapped_optimizer_fire_around_the_wrappers_step(on_two_ranks) -> None:
    """Hooks registered on the torch optimizer, before or after wrapping, fire once per
    ``step()`` with that optimizer, and a global hook once per step, not once per bucket; an
    EMA kept by a post-hook equals plain torch's."""
    expected_average, expected_calls = _ema_by_step_hooks(None)
    assert expected_calls == {"pre": 4, "post": 4, "global": 4}
    for overlap in (False, True):
        for average, calls in on_two_ranks[f"step_hooks-{overlap}"]:
            assert calls == expected_calls
            _assert_all_close(average, expected_average)


def _multitask_with_loss_weights(overlap: bool | None) -> list[torch.Tensor]:
    """Multi-task training whose optimizer also holds params the model does not: learnable
    input scales read before the model's forward and uncertainty weights of the two losses
    read after it (Kendall et al.'s weighting). Plain torch when ``overlap`` is None."""
    model = TwoLayers()
    input_scale = nn.Parameter(torch.ones(6))
    log_vars = nn.Parameter(torch.zeros(2))
    params = [*model.parameters(), input_scale, log_vars]
    optimizer = torch.optim.AdamW(params, lr=5e-2, weight_decay=0.1)
    if overlap is None:
        opt, rank, world_size = optimizer, None, 1
    else:
        opt = ShardingStage1(optimizer, overlap=overlap, strategy=SMALL_BUCKETS, model=model)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(5):
        opt.zero_grad()
        out = model(_inputs(step, rank, world_size) * input_scale)
        losses = torch.stack([out[:, 0].square().mean(), (out[:, 1] - 1).abs().mean()])
        (torch.exp(-log_vars) * losses + log_vars).sum().backward()
        opt.step()
    if overlap is not None:
        opt.sync_params()
    return [p.detach().clone() for p in params]


def test_params_outside_the_attached_model_train_as_in_torch(on_two_ranks) -> None:
    """``model=`` may hold only some of the optimizer's params; the others (a loss module's,
    multi-task loss weights) are waited for like any read right after ``step()``."""
    expected = _multitask_with_loss_weights(None)
    for overlap in (False, True):
        for params in on_two_ranks[f"params_outside_model-{overlap}"]:
            _assert_all_close(params, expected)
