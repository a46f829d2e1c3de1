"""DCP checkpoints of low-bit state, torchao's and bitsandbytes'
(Note [Quantized state in checkpoints]): written by N ranks, loaded by M, the state after the
load is bitwise the saved one and training goes on bitwise as the plain class in one process
that averages the same slice grads (N slices before the save, M after), as
``tests/parity/test_lowbit_optimizers.py`` and ``tests/parity/test_bitsandbytes_optimizers.py``
measure for a run without a checkpoint. A checkpoint of another class or block size is refused.
bitsandbytes' runs add a param with a partial last block that 2 and 3 ranks cut
(``Run.tail_numel``); 1 rank holds it whole.

Every step here runs eagerly (``torch.compiler.set_stance("force_eager")``, in the ranks and in
the reference alike): what a checkpoint holds does not depend on how the step is computed, and
torchao compiles its step once per piece shape, tens of seconds each on this 2-core CPU; the
compiled step's parity is the parity test's.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sharded_opt import ShardingStage1, load_checkpoint, save_checkpoint
from tests.harness.dist_helper import run_ranks
from tests.harness.lowbit import (
    BATCH,
    RESUME_AT,
    STEPS,
    Run,
    assert_same_state,
    batch,
    loss_of,
    make_model,
    make_optimizer,
    train_plain,
)

pytest.importorskip("torchao.optim")
pytest.importorskip("bitsandbytes")

CASES = {
    "adamw8bit_2to2": ("AdamW8bit", 2, 2, True),
    "adamw8bit_2to3": ("AdamW8bit", 2, 3, True),
    "adamw8bit_3to2": ("AdamW8bit", 3, 2, False),
    "adamw8bit_2to1": ("AdamW8bit", 2, 1, False),
    "adamw4bit_2to3": ("AdamW4bit", 2, 3, True),
    "adamwfp8_3to2": ("AdamWFp8", 3, 2, True),
    "bnb_adamw8bit_2to2": ("bnb.AdamW8bit", 2, 2, False),
    "bnb_adamw8bit_2to3": ("bnb.AdamW8bit", 2, 3, True),
    "bnb_adamw8bit_3to2": ("bnb.AdamW8bit", 3, 2, True),
    "bnb_adamw8bit_2to1": ("bnb.AdamW8bit", 2, 1, False),
    "bnb_adam8bit_2to3": ("bnb.Adam8bit", 2, 3, False),
}
"""Per case: the class, ranks that save, ranks that load, overlap when saving (loading uses the
other mode)."""


def _steps(model: torch.nn.Module, opt: ShardingStage1, cls: str, steps: range) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    size = BATCH // world_size
    for step in steps:
        inputs, targets = batch(step, Run(cls))
        opt.zero_grad()
        part = slice(rank * size, (rank + 1) * size)
        loss_of(model, inputs[part], targets[part]).backward()
        opt.step()


def _serialized(state_dict: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()


def _train_save_continue(path: str, cls: str, overlap: bool) -> dict:
    """The uninterrupted run: saves after ``RESUME_AT`` steps and goes on to ``STEPS``."""
    model = make_model(tail_numel=Run(cls).tail_numel)
    opt = ShardingStage1(make_optimizer(cls, model.parameters()), overlap=overlap, model=model)
    _steps(model, opt, cls, range(RESUME_AT))
    saved = _serialized(opt.state_dict())
    save_checkpoint(path, model, opt)
    _steps(model, opt, cls, range(RESUME_AT, STEPS))
    opt.sync_params()
    return {"state_dict": saved, "params": [p.detach().clone() for p in model.parameters()]}


def _load_continue(path: str, cls: str, overlap: bool) -> dict:
    model = make_model(seed=99, tail_numel=Run(cls).tail_numel)  # everything must come from the checkpoint
    opt = ShardingStage1(make_optimizer(cls, model.parameters()), overlap=overlap, model=model)
    load_checkpoint(path, model, opt)
    loaded = _serialized(opt.state_dict())
    _steps(model, opt, cls, range(RESUME_AT, STEPS))
    opt.sync_params()
    return {"state_dict": loaded, "params": [p.detach().clone() for p in model.parameters()]}


def _eagerly(fn, jobs: list[tuple]) -> list[dict]:
    with torch.compiler.set_stance("force_eager"):
        return [fn(*job) for job in jobs]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict], list[dict]]]:
    """Per case: the checkpoint, each saving rank's uninterrupted run and each loading rank's
    resumed run; one spawn per world size and phase."""
    root = tmp_path_factory.mktemp("lowbit")
    paths = {name: root / name / "ckpt" for name in CASES}
    saved, resumed = {}, {}
    for world_size in (2, 3):
        names = [name for name, case in CASES.items() if case[1] == world_size]
        jobs = [(str(paths[name]), CASES[name][0], CASES[name][3]) for name in names]
        per_rank = run_ranks(_eagerly, world_size, _train_save_continue, jobs)
        saved.update((name, [r[i] for r in per_rank]) for i, name in enumerate(names))
    for world_size in (1, 2, 3):
        names = [name for name, case in CASES.items() if case[2] == world_size]
        jobs = [(str(paths[name]), CASES[name][0], not CASES[name][3]) for name in names]
        per_rank = run_ranks(_eagerly, world_size, _load_continue, jobs)
        resumed.update((name, [r[i] for r in per_rank]) for i, name in enumerate(names))
    return {name: (paths[name], saved[name], resumed[name]) for name in CASES}


def _state(serialized: bytes) -> dict:
    return torch.load(io.BytesIO(serialized), weights_only=False)


@pytest.mark.parametrize("name", CASES)
def test_state_after_the_load_is_the_saved_state(resharded, name: str) -> None:
    """Codes, scales and code books come back bit for bit, whatever the two world sizes."""
    _, saved, resumed = resharded[name]
    want = _state(saved[0]["state_dict"])
    for result in resumed:
        assert_same_state(_state(result["state_dict"]), want)


@pytest.mark.parametrize("name", CASES)
def test_training_goes_on_bitwise(resharded, name: str) -> None:
    cls, saved_on, loaded_on, _ = CASES[name]
    _, saved, resumed = resharded[name]
    with torch.compiler.set_stance("force_eager"):
        before = _state(train_plain(Run(cls), slices=saved_on)["snapshot"])
        expected = train_plain(Run(cls), slices=loaded_on, start=before)["params"]
    for rank, result in enumerate(resumed):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert torch.equal(got, want), f"rank {rank} param {index}: {(got - want).abs().max()}"
    if saved_on == loaded_on:
        for got, want in zip(resumed[0]["params"], saved[0]["params"], strict=True):
            assert torch.equal(got, want)


def _load_error(path: str, cls: str, kwargs: dict, tail_numel: int = 0) -> str:
    model = make_model(tail_numel=tail_numel)
    params = model.parameters()
    inner = torch.optim.AdamW(params) if cls == "AdamW" else make_optimizer(cls, params, **kwargs)
    opt = ShardingStage1(inner, model=model)
    try:
        load_checkpoint(path, model, opt)
    except ValueError as error:
        return str(error)
    return "loaded"


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        ("AdamW4bit", {}, "but this optimizer (AdamW4bit) quantizes with block_size=128"),
        ("AdamW8bit", {"block_size": 128}, "but this optimizer (AdamW8bit) quantizes with block_size=128"),
        ("AdamW", {}, "but this optimizer (AdamW) keeps plain state"),
    ],
)
def test_a_checkpoint_of_another_class_or_block_size_is_refused(
    resharded, cls: str, kwargs: dict, message: str
) -> None:
    path = resharded["adamw8bit_2to1"][0]
    error = run_ranks(_load_error, 1, str(path), cls, kwargs)[0]
    assert "holds state quantized by torchao.optim.adam.AdamW8bit with block_size=256" in error
    assert message in error and "build AdamW8bit(..., block_size=256) to load it" in error


BNB_REFUSALS = {
    "bnb_into_torchao": (
        "bnb_adamw8bit_2to1",
        "AdamW8bit",
        "state quantized by bitsandbytes.optim.adamw.AdamW8bit with block_size=256",
        "torchao.optim.adam.AdamW8bit) quantizes with block_size=256",
        "build bitsandbytes.optim.adamw.AdamW8bit to load it",
    ),
    "bnb_into_plain": (
        "bnb_adamw8bit_2to1",
        "AdamW",
        "state quantized by bitsandbytes.optim.adamw.AdamW8bit with block_size=256",
        "AdamW) keeps plain state",
        "build AdamW8bit to load it",
    ),
    "torchao_into_bnb": (
        "adamw8bit_2to1",
        "bnb.AdamW8bit",
        "state quantized by torchao.optim.adam.AdamW8bit with block_size=256",
        "bitsandbytes.optim.adamw.AdamW8bit) quantizes with block_size=256",
        "build torchao.optim.adam.AdamW8bit(..., block_size=256) to load it",
    ),
    "plain_into_bnb": (
        None,
        "bnb.AdamW8bit",
        "plain state",
        "AdamW8bit) quantizes with block_size=256",
        "build the optimizer that saved it",
    ),
}
"""Per case: the checkpoint (a ``CASES`` one, None: plain AdamW's), the loading class, and what
the error says the checkpoint holds, the loading optimizer is and to build. torchao's and
bitsandbytes' ``AdamW8bit`` share a name, so between them both are named by module."""


def _save_plain_then_load_errors(plain: str, loads: list[tuple]) -> list[str]:
    model = make_model()
    save_checkpoint(plain, model, ShardingStage1(torch.optim.AdamW(model.parameters()), model=model))
    return [_load_error(*load) for load in loads]


@pytest.fixture(scope="module")
def bnb_refusals(resharded, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Per ``BNB_REFUSALS`` case, the error of the load, into a model like the saved one (one
    spawn for all)."""
    plain = tmp_path_factory.mktemp("plain") / "ckpt"
    loads = [
        (str(plain), cls, {}, 0)
        if saved is None
        else (str(resharded[saved][0]), cls, {}, Run(CASES[saved][0]).tail_numel)
        for saved, cls, *_ in BNB_REFUSALS.values()
    ]
    return dict(
        zip(BNB_REFUSALS, run_ranks(_save_plain_then_load_errors, 1, str(plain), loads)[0], strict=True)
    )


@pytest.mark.parametrize("name", BNB_REFUSALS)
def test_bitsandbytes_checkpoints_and_others_do_not_cross(bnb_refusals, name: str) -> None:
    _, _, holds, this, fix = BNB_REFUSALS[name]
    error = bnb_refusals[name]
    assert f"holds {holds}, but this optimizer (" in error, error
    assert this in error and fix in error, error
