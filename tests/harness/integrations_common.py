"""What the framework tests share: a tiny GPT-2 built from a config (nothing downloaded), a
fixed token data set, a folder all ranks see, and the comparison with the one-process run.

Every framework test runs the same training twice: with the framework's own data-parallel
path replaced by the adapter on 2 ranks, and with the framework alone on one process and a
plain AdamW over the same global batch (micro-batches split in order over the ranks). Dropout
is off, so the two differ only by how the grads are summed (per rank, then averaged) and by
the norm's summation order; measured agreement is stated by each module's tolerance.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

VOCAB, SEQ, WIDTH = 32, 8, 16
SAMPLES = 32
"""Token sequences in the data set: 4 optimizer steps of a global batch of 4 with 2 micro-batches
of accumulation per epoch."""

LOSS_ATOL = 1e-5
NORM_RTOL = 1e-5
PARAM_ATOL = 5e-5
"""Bounds for summation order only. Measured with Accelerate (8 AdamW steps, lr 1e-2, clipping
active): losses within 4.8e-7, logged norms within 1.1e-7 relative, every param within 6e-7
except the key third of ``c_attn.bias``, whose grad is zero in exact arithmetic (softmax ignores
a per-query constant) and is rounding noise that AdamW normalizes to lr-sized steps: 1.3e-5
there, where DDP on the same 2 ranks differs from the one-process run by 1.2e-5 as well."""


def quiet_rank() -> None:
    """Offline, one intra-op thread (Accelerate otherwise sets cores / ranks threads), no advice
    or progress bars on stderr."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def tiny_gpt2(width: int = WIDTH):
    """A 2-layer GPT-2 with a tied LM head, dropout off, seeded weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=width, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def token_ids() -> torch.Tensor:
    """``SAMPLES`` sequences of ``SEQ`` token ids, the same in every process."""
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))


def decay_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """HF's decay/no-decay split: no decay for biases and LayerNorm weights."""
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if "bias" in n or "ln_" in n]
    decay = [p for n, p in named if all(p is not q for q in no_decay)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@contextlib.contextmanager
def shared_folder() -> Iterator[str]:
    """One temporary folder for all ranks (created on rank 0), removed at the end."""
    initialized = dist.is_initialized()
    name = [tempfile.mkdtemp() if not initialized or dist.get_rank() == 0 else None]
    if initialized:
        dist.broadcast_object_list(name, src=0)
    yield name[0]
    # Not in a `finally`: a rank that raised must not wait here for peers that wait for it.
    if initialized:
        dist.barrier()
    if not initialized or dist.get_rank() == 0:
        shutil.rmtree(name[0])


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def measured(sharded: dict, plain: dict) -> dict[str, float]:
    """Max differences of losses, logged norms (relative) and final params."""
    assert len(sharded["losses"]) == len(plain["losses"]), (sharded["losses"], plain["losses"])
    losses = torch.tensor(sharded["losses"], dtype=torch.float64)
    plain_losses = torch.tensor(plain["losses"], dtype=torch.float64)
    result = {
        "loss": (losses - plain_losses).abs().max().item(),
        "param": max_diff(sharded["params"], plain["params"]),
    }
    if "norms" in plain:
        assert len(sharded["norms"]) == len(plain["norms"]), (sharded["norms"], plain["norms"])
        norms = torch.tensor(sharded["norms"], dtype=torch.float64)
        plain_norms = torch.tensor(plain["norms"], dtype=torch.float64)
        result["norm_rel"] = ((norms - plain_norms).abs() / plain_norms).max().item()
    return result


def assert_close_run(sharded: dict, plain: dict) -> None:
    """Losses, logged grad norms and final params of a sharded run agree with the plain one
    (``pytest -s`` shows the measured differences)."""
    diffs = measured(sharded, plain)
    print("measured against the one-process run:", diffs)
    assert diffs["loss"] <= LOSS_ATOL and diffs["param"] <= PARAM_ATOL, diffs
    assert diffs.get("norm_rel", 0.0) <= NORM_RTOL, diffs
