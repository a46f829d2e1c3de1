"""What DDP users do without thinking must work with ShardingStage1, or fail with a message
that names the fix: reentrant activation checkpointing, re-creating the optimizer, nested
``no_sync()``, copies of the model, writes into params right after ``step()``, and DDP's
initial broadcast of the whole model state.

One spawned 2-rank job runs every multi-rank scenario (each small) and the tests check its
results; scenarios that need no peer run in the pytest process on a one-rank group.
"""

from __future__ import annotations

import copy
import gc
import io
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.comm import collectives
from tests.harness.dist_helper import run_ranks
from tests.harness.training import ATOL, IN_FEATURES, RTOL, batch, local_slice, make_model
from tests.harness.user_loops import _late_all_gather

STEPS = 3


def _strategy(overlap: bool, **fields) -> Strategy:
    return Strategy(sharding=ShardingConfig(bucket_size_mb=0.001, enable_overlap=overlap, **fields))


def _overlap_adamw(model: nn.Module) -> ShardingStage1:
    return ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2), strategy=_strategy(True), model=model
    )


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, first_step: int = 0) -> None:
    """``steps`` steps on this rank's slice of the shared batches (the whole batch on one
    process without a group)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for step in range(first_step, first_step + steps):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        output = model(local_slice(inputs, rank, world_size))
        torch.nn.functional.mse_loss(output, local_slice(targets, rank, world_size)).backward()
        optimizer.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- 1. reentrant activation checkpointing ----------------------------------------------------


class CheckpointedMLP(nn.Module):
    """The head is differentiated first and inside a reentrant checkpoint, so the first grads
    of every backward land in a nested backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.fc1(x))
        hidden = checkpoint(lambda h: torch.tanh(self.fc2(h)), hidden, use_reentrant=True)
        return checkpoint(self.head, hidden, use_reentrant=True)


def _checkpointed_run(overlap: bool, attach: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = CheckpointedMLP()
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        strategy=_strategy(overlap),
        model=model if attach else None,
    )
    _train(model, optimizer, STEPS)
    optimizer.sync_params()
    return _params(model)


def _reentrant_checkpointing() -> dict[str, list[torch.Tensor]]:
    return {
        "sync": _checkpointed_run(overlap=False, attach=True),
        "overlap_model": _checkpointed_run(overlap=True, attach=True),
        "overlap_no_model": _checkpointed_run(overlap=True, attach=False),
    }


# -- 2. re-creating the optimizer -------------------------------------------------------------


def _recreate() -> dict:
    model = make_model()
    first = _overlap_adamw(model)
    _train(model, first, 2)
    first_ref = weakref.ref(first)
    del first  # a sweep's next run, a notebook cell run again
    gc.collect()
    collected = first_ref() is None
    second = _overlap_adamw(model)
    _train(model, second, 2, first_step=2)
    # A wrapper still referenced somewhere (an IPython Out cache) must not disturb a new one.
    # (Its last all-gathers must be finished before the new wrapper copies the params: close()
    # or sync_params(); a dropped wrapper does it when collected.)
    second.sync_params()
    third = _overlap_adamw(model)
    _train(model, third, 2, first_step=4)
    third.sync_params()
    hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters() if p.requires_grad]
    second.close()
    third.close()
    return {"collected": collected, "params": _params(model), "hooks": hooks}


def _recreate_reference() -> list[torch.Tensor]:
    model = make_model()
    for first_step in (0, 2, 4):
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 2, first_step=first_step)
    return _params(model)


# -- 3. nested no_sync -------------------------------------------------------------------------


def _accumulate(nested: bool) -> list[torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    optimizer = _overlap_adamw(model)
    for step in range(2):
        optimizer.zero_grad()
        losses = []
        for micro in range(3):
            inputs, targets = batch(step, micro)
            out = model(local_slice(inputs, rank, world_size))
            losses.append(torch.nn.functional.mse_loss(out, local_slice(targets, rank, world_size)) / 3)
        if nested:
            with optimizer.no_sync():
                with optimizer.no_sync():
                    losses[0].backward()
                losses[1].backward()  # still inside the outer block: accumulate only
        else:
            with optimizer.no_sync():
                losses[0].backward()
                losses[1].backward()
        losses[2].backward()
        optimizer.step()
    optimizer.sync_params()
    return _params(model)


# -- 4. copies of an attached model ------------------------------------------------------------


def _copies() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    optimizer = _overlap_adamw(model)
    swa = torch.optim.swa_utils.AveragedModel(model)
    snapshots = []
    for step in range(STEPS):
        _train(model, optimizer, 1, first_step=step)
        optimizer.sync_params()
        swa.update_parameters(model)
        snapshots.append(_params(model))
    duplicate = copy.deepcopy(model)
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    inputs, _ = batch(0)
    expected = model(inputs).detach()
    same_outputs = all(torch.equal(m(inputs).detach(), expected) for m in (duplicate, loaded))

    # The copies' forward and backward run while the original's all-gathers are pending and
    # must neither wait for them nor count grads for the wrapper.
    _train(model, optimizer, 1, first_step=STEPS)
    pending = _pending_gathers(optimizer)
    for copied in (duplicate, loaded, swa):
        copied(local_slice(inputs, rank, world_size)).sum().backward()
    counted = any(bucket.count for bucket in optimizer.shards.buckets)
    untouched = _pending_gathers(optimizer) == pending and not counted
    mean = [torch.stack(values).mean(dim=0) for values in zip(*snapshots, strict=True)]
    return {
        "same_outputs": same_outputs,
        "untouched": untouched,
        "swa": _params(swa.module),
        "mean": mean,
        "pending": pending,
    }


def _pending_gathers(optimizer: ShardingStage1) -> list[int]:
    return [bucket.index for bucket in optimizer.shards.buckets if bucket.param_sync_pending]


# -- 5. writes right after step() -------------------------------------------------------------


def _writes_after_step() -> dict:
    model = make_model()
    optimizer = _overlap_adamw(model)
    best = {name: value.clone() for name, value in model.state_dict().items()}
    result: dict = {}
    with mock.patch.object(collectives, "all_gather", _late_all_gather):
        _train(model, optimizer, 1)
        assert _pending_gathers(optimizer)
        saved = {name: value.clone() for name, value in model.state_dict().items()}
        optimizer.sync_params()
        result["state_dict_final"] = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())

        _train(model, optimizer, 1, first_step=1)
        model.load_state_dict(best)  # restore the best weights right after step()
        optimizer.sync_params()
        result["load_exact"] = all(torch.equal(best[k], v) for k, v in model.state_dict().items())

        _train(model, optimizer, 1, first_step=2)
        with torch.no_grad():
            model.fc2.weight.copy_(torch.zeros_like(model.fc2.weight))  # waits, then writes
        optimizer.sync_params()
        result["copy_lands"] = not model.fc2.weight.any()

        _train(model, optimizer, 1, first_step=3)
        with torch.no_grad(), torch._C.DisableTorchFunction():  # a write the guard cannot see
            model.fc2.weight.copy_(torch.zeros_like(model.fc2.weight))
        try:
            optimizer.sync_params()
        except RuntimeError as error:
            result["copy_error"] = str(error)
        _train(model, optimizer, 2, first_step=4)  # training goes on after the error
        optimizer.sync_params()
    return result


# -- 6. initial state like DDP -----------------------------------------------------------------


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN_FEATURES, 8)
        self.norm = nn.BatchNorm1d(8)
        self.frozen = nn.Linear(8, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.norm(self.fc(x)))


def _running_means_seen(broadcast_buffers: bool) -> list[torch.Tensor]:
    """Running means BatchNorm starts each forward with, on ranks that see different data."""
    torch.manual_seed(dist.get_rank())  # different initial weights and buffers per rank
    model = NormedMLP()
    model.norm.running_mean.add_(dist.get_rank())
    optimizer = ShardingStage1(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        strategy=_strategy(False, broadcast_buffers=broadcast_buffers),
        model=model,
    )
    seen = [torch.cat([t.flatten() for t in model.state_dict().values()])]
    model.norm.register_forward_pre_hook(lambda module, args: seen.append(module.running_mean.clone()))
    _train(model, optimizer, STEPS)
    model.eval()
    with torch.no_grad():  # evaluation issues no collective: safe on one rank alone
        if dist.get_rank() == 0:
            model(torch.randn(4, IN_FEATURES))
    return seen


def _initial_state() -> dict:
    with_broadcast = _running_means_seen(True)
    without = _running_means_seen(False)
    model = make_model()  # no buffers: no broadcast per forward
    optimizer = ShardingStage1(torch.optim.AdamW(model.parameters()), strategy=_strategy(False), model=model)
    # Counted at the buffers' broadcast itself: on CPU gloo the all-gathers are broadcasts too.
    with mock.patch.object(
        collectives, "broadcast_coalesced", wraps=collectives.broadcast_coalesced
    ) as broadcast:
        _train(model, optimizer, 2)
    issued = sum(1 for call in broadcast.call_args_list if call.args[0])
    return {"with": with_broadcast, "without": without, "broadcasts_without_buffers": issued}


# -- 7. torch.compile with a model attached -----------------------------------------------------


def _compiled(compile_model: bool, overlap: bool) -> list[torch.Tensor]:
    model = make_model()
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2), strategy=_strategy(overlap), model=model
    )
    # The eager backend runs Dynamo's tracing (where graph breaks come from) without a compiler,
    # so the numbers stay bitwise those of eager mode and the test stays fast.
    forward = torch.compile(model, fullgraph=True, backend="eager") if compile_model else model
    _train(forward, optimizer, STEPS)
    optimizer.sync_params()
    return _params(model)


# -- 8. a DDP wrapper kept around the model ----------------------------------------------------


def _errors_with_ddp_kept() -> dict[str, str]:
    """What a user who keeps ``DistributedDataParallel`` (as torch's ZeroRedundancyOptimizer is
    used) gets: an error at once, never grads averaged twice while being reduced."""
    errors = {}
    for case in ("model", "sync", "overlap", "bucket_view_overlap"):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=case.startswith("bucket"))
        try:
            optimizer = ShardingStage1(
                torch.optim.AdamW(ddp.parameters(), lr=1e-2),
                strategy=_strategy(case != "sync"),
                model=ddp if case == "model" else None,
            )
            _train(ddp, optimizer, 1)
        except (ValueError, RuntimeError) as error:
            errors[case] = f"{type(error).__name__}: {error}"
    return errors


def _ddp_added_after_wrapping() -> dict[str, tuple[str, str]]:
    """What the frameworks do (the optimizer is wrapped, then the model is wrapped in DDP and
    trained through it): per case, the phase that raised and its message."""
    outcomes = {}
    for case in ("sync", "overlap", "overlap_model", "bucket_view_model"):
        model = make_model()
        optimizer = ShardingStage1(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            strategy=_strategy(case.startswith("overlap")),
            model=model if case.endswith("model") else None,
        )
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=case.startswith("bucket"))
        inputs, targets = batch(0)
        phase = "forward"
        try:
            loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
            phase = "backward"
            loss.backward()
            phase = "step"
            optimizer.step()
            outcomes[case] = ("none", "")
        except RuntimeError as error:
            outcomes[case] = (phase, str(error))
        optimizer.close()
    return outcomes


# -- 9. a same-device .to() after wrapping ------------------------------------------------------


def _moved_to_the_same_device_run(overlap: bool, zero_with_model: bool) -> dict:
    """Hugging Face Trainer's ``model.to(args.device)`` (``cpu:0`` under torchrun on CPU) after
    the optimizer was wrapped, with grads already held: torch copies every param and grad."""
    model = make_model()
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2), strategy=_strategy(overlap), model=model
    )
    _train(model, optimizer, 1)
    model.to(torch.device("cpu", 0))
    norms = []
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(1, STEPS):
        (model if zero_with_model else optimizer).zero_grad()
        inputs, targets = batch(step)
        output = model(local_slice(inputs, rank, world_size))
        torch.nn.functional.mse_loss(output, local_slice(targets, rank, world_size)).backward()
        norms.append(optimizer.clip_grad_norm_(1e6).item())
        optimizer.step()
    optimizer.sync_params()
    return {"norms": norms, "params": _params(model)}


def _moved_to_the_same_device() -> dict[str, dict]:
    return {
        f"{mode}_{zero}": _moved_to_the_same_device_run(mode == "overlap", zero == "model")
        for mode in ("sync", "overlap")
        for zero in ("model", "opt")
    }


def _all_scenarios() -> dict:
    return {
        "ddp_kept": _errors_with_ddp_kept(),
        "ddp_added": _ddp_added_after_wrapping(),
        "moved": _moved_to_the_same_device(),
        "reentrant": _reentrant_checkpointing(),
        "recreate": _recreate(),
        "nested_no_sync": (_accumulate(nested=True), _accumulate(nested=False)),
        "copies": _copies(),
        "writes": _writes_after_step(),
        "initial": _initial_state(),
        "compiled": (
            _compiled(compile_model=True, overlap=True),
            _compiled(compile_model=False, overlap=False),
        ),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_all_scenarios, 2)


def _assert_equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        assert torch.equal(a, b), f"param {index} differs"


def test_reentrant_checkpointing_overlap_equals_sync_and_reference(two_ranks) -> None:
    torch.manual_seed(0)
    model = CheckpointedMLP()
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), STEPS)
    for runs in two_ranks:
        _assert_equal(runs["reentrant"]["sync"], runs["reentrant"]["overlap_model"])
        _assert_equal(runs["reentrant"]["sync"], runs["reentrant"]["overlap_no_model"])
        for got, expected in zip(runs["reentrant"]["overlap_model"], _params(model), strict=True):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_recreated_optimizer_over_the_same_model_trains_like_a_fresh_one(two_ranks) -> None:
    reference = _recreate_reference()
    for runs in two_ranks:
        assert runs["recreate"]["collected"]
        # The dropped wrapper's hooks are gone; the live old one's are inert, not counted here.
        assert runs["recreate"]["hooks"] == [2] * len(runs["recreate"]["hooks"])
        for got, expected in zip(runs["recreate"]["params"], reference, strict=True):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_nested_no_sync_keeps_accumulating(two_ranks) -> None:
    for runs in two_ranks:
        _assert_equal(*runs["nested_no_sync"])


def test_copies_of_an_attached_model_work_and_stay_apart(two_ranks) -> None:
    for runs in two_ranks:
        copies = runs["copies"]
        assert copies["same_outputs"]
        assert copies["pending"], "the scenario must run the copies while all-gathers are pending"
        assert copies["untouched"]
        for got, expected in zip(copies["swa"], copies["mean"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_state_dict_and_load_state_dict_right_after_step_wait_for_params(two_ranks) -> None:
    for runs in two_ranks:
        assert runs["writes"]["state_dict_final"]
        assert runs["writes"]["load_exact"]


def test_param_write_right_after_step_lands_and_one_unseen_raises(two_ranks) -> None:
    for runs in two_ranks:
        assert runs["writes"]["copy_lands"]
        message = runs["writes"].get("copy_error", "")
        assert "['fc2.weight'] were written while step()'s all-gather" in message
        assert "call opt.sync_params() before writing params" in message


def test_whole_model_state_starts_equal_and_buffers_follow_rank_zero(two_ranks) -> None:
    first, second = (runs["initial"] for runs in two_ranks)
    # The whole state after wrapping (trainable and frozen params, buffers), and the running
    # statistics every training forward starts from: equal with broadcast_buffers. (A
    # rank-0-only evaluation under no_grad ran too: it issued no collective.)
    assert len(first["with"]) == 2 + STEPS and len(second["with"]) == 1 + STEPS  # rank 0 evaluated
    for a, b in zip(first["with"][: 1 + STEPS], second["with"], strict=True):
        assert torch.equal(a, b)
    # Without it, the initial state is still rank 0's but the ranks' data make them drift.
    assert torch.equal(first["without"][0], second["without"][0])
    assert not torch.equal(first["without"][-1], second["without"][-1])
    assert first["broadcasts_without_buffers"] == second["broadcasts_without_buffers"] == 0


# -- one-rank scenarios in the pytest process ---------------------------------------------------


def test_close_and_context_manager_remove_every_hook(single_rank_group) -> None:
    model = make_model()
    hooks_before = _hook_counts(model)
    original = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ShardingStage1(original, strategy=_strategy(True), model=model) as optimizer:
        assert _hook_counts(model) != hooks_before
        _train(model, optimizer, 1)
    assert _hook_counts(model) == hooks_before
    with pytest.raises(RuntimeError, match=r"ShardingStage1.step: this ShardingStage1 was closed .* new"):
        optimizer.step()
    # The original torch optimizer is free again: wrap it anew (it never stepped itself).
    rewrapped = ShardingStage1(original, strategy=_strategy(True), model=model)
    _train(model, rewrapped, 1, first_step=1)
    rewrapped.close()
    rewrapped.close()  # idempotent
    assert _hook_counts(model) == hooks_before
    original.step()  # an unwrapped torch optimizer steps again, and saves and loads its state
    original.load_state_dict(original.state_dict())


def test_wrapping_an_original_whose_wrapper_is_alive_names_close(single_rank_group) -> None:
    original = torch.optim.AdamW(make_model().parameters())
    first = ShardingStage1(original)
    with pytest.raises(ValueError, match=r"already wrapped .* call the first wrapper's close\(\)"):
        ShardingStage1(original)
    first.close()


def _hook_counts(model: nn.Module) -> list[int]:
    return [
        len(m._forward_pre_hooks) + len(m._state_dict_pre_hooks) + len(m._load_state_dict_pre_hooks)
        for m in model.modules()
    ] + [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]


def test_compiled_model_fullgraph_trains_like_eager_sync(two_ranks) -> None:
    for runs in two_ranks:
        _assert_equal(*runs["compiled"])


def test_a_kept_ddp_wrapper_fails_at_once_naming_the_fix(two_ranks) -> None:
    for errors in two_ranks:
        assert set(errors["ddp_kept"]) == {"model", "sync", "overlap", "bucket_view_overlap"}
        assert errors["ddp_kept"]["model"].startswith("ValueError: ShardingStage1 averages the grads")
        for message in errors["ddp_kept"].values():
            assert "Drop the DistributedDataParallel wrapper" in message
            assert "pass that module as model=" in message


def test_ddp_added_after_wrapping_is_named_first_and_at_once(two_ranks) -> None:
    """Issue 22: the frameworks' DDP was named only at step(), at the tail of a clipping message."""
    for runs in two_ranks:
        for case, (phase, message) in runs["ddp_added"].items():
            # A model attached: its first forward (inside DDP's); otherwise the first backward.
            assert phase == ("forward" if case.endswith("model") else "backward"), (case, phase, message)
            first_sentence = message.split(". ")[0]
            assert "DistributedDataParallel" in first_sentence, (case, message)
            assert "clip" not in message, (case, message)
            assert "sharded_opt.integrations" in message and "Drop the DistributedDataParallel" in message


def _moved_reference() -> dict:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 1)
    norms = []
    for step in range(1, STEPS):
        optimizer.zero_grad()
        inputs, targets = batch(step)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6).item())
        optimizer.step()
    return {"norms": norms, "params": _params(model)}


def test_same_device_to_after_wrapping_keeps_training_on_the_real_grads(two_ranks) -> None:
    """Issue 22: ``model.to(torch.device("cpu", 0))`` copied the grads off the flat buffer; after
    ``model.zero_grad()`` overlap mode reduced zeros (a norm of 0.0, steps on zero grads)."""
    reference = _moved_reference()
    for runs in two_ranks:
        for case, run in runs["moved"].items():
            torch.testing.assert_close(run["norms"], reference["norms"], rtol=1e-5, atol=0, msg=case)
            for got, expected in zip(run["params"], reference["params"], strict=True):
                torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=case)
