"""Hugging Face ``transformers`` models trained the way their users write loops (red-team round
three, on the :class:`~tests.harness.user_loops.Loop` harness, job runner and assertion of
``tests/harness/user_loops.py``).

Tiny models built from configs (nothing is downloaded; ``from_pretrained`` only reads a folder
that ``save_pretrained`` wrote, on rank 0, as it does under a process group): GPT-2 (tied LM
head, dropout on, ``labels=`` loss, accumulation with ``no_sync``, ``generate()`` on one rank
right after ``step()``), Llama (RMSNorm, rotary, gradient checkpointing both ways, also enabled
after wrapping, frozen then unfrozen embeddings, LoRA by hand, bf16 autocast), BERT (masked LM
with a pooler no loss reaches; sequence classification loaded from the MLM model's folder,
fine-tuned head first with layers unfrozen later), T5 (encoder-decoder, shared embeddings,
``model.zero_grad()``, ``generate()`` under ``inference_mode``), two mixtures of experts
(Mixtral's fused experts; Switch Transformers' expert modules, some reached by no token),
ALBERT's layer shared by all layers (also under reentrant checkpointing, in Llama), HF's
decay/no-decay groups by name and its schedules, batches padded per rank to their own length,
resuming from ``save_pretrained`` plus ``opt.state_dict()``, and what must fail at once
(``resize_token_embeddings`` after wrapping, HF's factored ``Adafactor``).

Each loop runs plain (one process, every slice), sharded sync and sharded overlap on every rank;
all loops of a world size run in one spawn. ``transformers`` is imported only inside the jobs,
so the rest of the suite does not pay for it.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sharded_opt import ShardingStage1
from tests.harness.user_loops import (
    SLICE,
    Loop,
    _both,
    _late_gathers,
    _snapshot,
    assert_matches_plain,
    loop_outcome_fixtures,
    run_loop_jobs,
)

VOCAB, SEQ, WIDTH = 32, 8, 16
PAD, BOS, EOS = 0, 1, 2


def _quiet() -> None:
    """No progress bars or advice on stderr from the jobs."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# -- configs -------------------------------------------------------------------------------------


def _gpt2(**overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=WIDTH, n_layer=2, n_head=2,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _bert_config():
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * WIDTH, max_position_embeddings=2 * SEQ, type_vocab_size=2,
        pad_token_id=PAD, num_labels=3,
    )  # fmt: skip


# -- data ----------------------------------------------------------------------------------------


def _causal_batch(step: int, index: int) -> dict[str, torch.Tensor]:
    """Right-padded token ids of a different length per sample, labels ``-100`` on padding;
    padded to the longest sample of the slice (dynamic padding), so ranks differ in length."""
    generator = torch.Generator().manual_seed(100 * step + index)
    ids = torch.randint(3, VOCAB, (SLICE, SEQ), generator=generator)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (SLICE,), generator=generator)
    ids = ids[:, : int(lengths.max())]
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    ids = ids * mask + PAD * (1 - mask)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _seeded(step: int, index: int) -> None:
    """Dropout of slice ``index`` draws what rank ``index`` draws."""
    torch.manual_seed(7 + 10 * step + index)


def _hf_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The groups of HF's examples and Trainer: no decay for biases and norm weights, by name."""
    named = [(n, p) for n, p in model.named_parameters()]
    no_decay = [p for n, p in named if "bias" in n or "norm" in n.lower() or "ln_" in n]
    decay = [p for n, p in named if all(p is not q for q in no_decay)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@contextlib.contextmanager
def _shared_folder() -> Iterator[str]:
    """One folder for all ranks, as a job's output directory is: ``save_pretrained`` writes
    on rank 0 only once a process group exists."""
    name = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    try:
        yield name[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(name[0])


def _save_pretrained(model: nn.Module, folder: str) -> None:
    model.save_pretrained(folder)
    dist.barrier()  # the other ranks read what rank 0 wrote


def _prompt() -> torch.Tensor:
    return torch.tensor([[BOS, 5, 9, 4], [BOS, 7, 3, 8]])


# -- GPT-2 ---------------------------------------------------------------------------------------


def gpt2_loop(loop: Loop, accumulate: int = 2) -> dict:
    """run_clm style: decay/no-decay groups, ``tie_weights()`` after wrapping, linear warmup,
    ``loss / accumulate`` with ``no_sync`` on all micro-batches but the last,
    ``train()``/``eval()`` switching, greedy ``generate()`` on rank 0 only right after
    ``step()`` while its all-gathers are pending, then an evaluation forward on every rank."""
    from transformers import get_linear_schedule_with_warmup

    _quiet()
    model = _gpt2()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.01), lr=3e-3), model)
    model.tie_weights()  # re-ties from the config, as scripts do after changing heads
    scheduler = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)
    generated, lrs = [], []
    for step in range(4):
        model.train()
        for micro in range(accumulate):

            def loss_of(index: int, step: int = step, micro: int = micro) -> torch.Tensor:
                _seeded(10 * step + micro, index)
                return model(**_causal_batch(10 * step + micro, index)).loss / accumulate

            loop.backward(opt, params, loss_of, no_sync=micro < accumulate - 1)
        opt.step()
        scheduler.step()
        loop.zero_grad(opt)
        lrs.append(scheduler.get_last_lr())
        model.eval()
        if loop.rank == 0:  # samples logged by one rank
            out = model.generate(_prompt(), max_new_tokens=3, do_sample=False, pad_token_id=PAD)
            generated.append(out.float())
        with torch.no_grad():
            generated.append(model(_prompt()).logits)
    loop.sync(opt)
    tied = model.lm_head.weight is model.transformer.wte.weight
    return {"params": _snapshot(model), "generated": generated, "lrs": lrs, "tied": [float(tied)]}


# -- Llama ---------------------------------------------------------------------------------------


def llama_loop(loop: Loop, checkpointing: bool | None = None, autocast: bool = False) -> dict:
    """Cosine schedule with warmup; ``gradient_checkpointing_enable`` (``use_reentrant`` as
    given) called after wrapping with reentrant checkpointing, with two micro-batches per step
    (``no_sync`` on the first); before wrapping otherwise, and then the input embeddings frozen
    before wrapping and unfrozen after two steps; optionally a bf16 autocast forward."""
    from transformers import get_cosine_schedule_with_warmup

    _quiet()
    model = _llama()
    model.config.use_cache = False
    kwargs = {"use_reentrant": checkpointing}
    if checkpointing is False:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.get_input_embeddings().requires_grad_(False)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95)), model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    scheduler = get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=5)
    accumulate = 2 if checkpointing else 1
    for step in range(4):
        if step == 2:
            model.get_input_embeddings().requires_grad_(True)
        model.train()
        for micro in range(accumulate):

            def loss_of(index: int, step: int = step, micro: int = micro) -> torch.Tensor:
                with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                    return model(**_causal_batch(10 * step + micro, index)).loss / accumulate

            loop.backward(opt, params, loss_of, no_sync=micro < accumulate - 1)
        opt.step()
        scheduler.step()
        loop.zero_grad(opt)
    loop.sync(opt)
    return {"params": _snapshot(model)}


class LoRA(nn.Module):
    """A low-rank adapter beside a frozen ``nn.Linear`` (PEFT's LoRA, by hand)."""

    def __init__(self, base: nn.Linear, rank: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def llama_lora_loop(loop: Loop) -> dict:
    """The model frozen, adapters on every layer's ``q_proj`` and ``v_proj``, only the trainable
    params handed to AdamW (``filter(lambda p: p.requires_grad, ...)``); as PEFT prepares a
    model for training: reentrant gradient checkpointing with ``enable_input_require_grads()``
    (the frozen embedding's output must require grad for the checkpointed layers' adapters to
    get any)."""
    _quiet()
    model = _llama()
    model.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    params = list(model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = loop.wrap(torch.optim.AdamW(trainable, lr=1e-2), model)
    for step in range(3):

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(**_causal_batch(step, index)).loss

        loop.backward(opt, params, loss_of)
        opt.step()
        loop.zero_grad(opt)
    loop.sync(opt)
    trained = all(layer.self_attn.v_proj.lora_B.weight.any() for layer in model.model.layers)
    return {"params": _snapshot(model), "adapters_trained": [float(trained)]}


# -- BERT ----------------------------------------------------------------------------------------


def _mlm_batch(step: int, index: int) -> dict[str, torch.Tensor]:
    """Two segments (``token_type_ids`` 0 then 1), 15 % of tokens masked to id 3."""
    generator = torch.Generator().manual_seed(50 * step + index)
    ids = torch.randint(4, VOCAB, (SLICE, SEQ), generator=generator)
    masked = torch.rand(SLICE, SEQ, generator=generator) < 0.3
    masked[:, 1] = True
    labels = ids.masked_fill(~masked, -100)
    token_types = (torch.arange(SEQ) >= SEQ // 2).long().expand(SLICE, SEQ)
    return {"input_ids": ids.masked_fill(masked, 3), "token_type_ids": token_types, "labels": labels}


def bert_mlm_loop(loop: Loop) -> dict:
    """BertForPreTraining trained on the masked-LM loss alone: the pooler and the next-sentence
    head get no grad on any rank and must stay as they are (no weight decay, no state)."""
    from transformers import BertForPreTraining

    _quiet()
    torch.manual_seed(0)
    model = BertForPreTraining(_bert_config())
    params = list(model.parameters())
    untouched = _snapshot(model.bert.pooler) + _snapshot(model.cls.seq_relationship)
    opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.01), lr=3e-3), model)
    for step in range(3):

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            _seeded(step, index)
            batch = _mlm_batch(step, index)
            labels = batch.pop("labels")
            logits = model(**batch).prediction_logits
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

        loop.backward(opt, params, loss_of)
        opt.step()
        loop.zero_grad(opt)
    loop.sync(opt)
    after = _snapshot(model.bert.pooler) + _snapshot(model.cls.seq_relationship)
    unchanged = all(torch.equal(a, b) for a, b in zip(untouched, after, strict=True))
    return {"params": _snapshot(model), "heads_unchanged": [float(unchanged)]}


def _classify_batch(step: int, index: int) -> dict[str, torch.Tensor]:
    batch = _mlm_batch(step, index)
    batch.pop("labels")
    generator = torch.Generator().manual_seed(70 * step + index)
    batch["labels"] = torch.randint(0, 3, (SLICE,), generator=generator)
    return batch


def bert_classify_loop(loop: Loop) -> dict:
    """Fine-tuning: BertForSequenceClassification from the folder a BertForMaskedLM was saved
    to (its classifier newly initialized), BERT frozen before wrapping so only the head trains,
    the last layer unfrozen after two steps, all of BERT after three; ``num_parameters``."""
    from transformers import BertForMaskedLM, BertForSequenceClassification

    _quiet()
    torch.manual_seed(0)
    with _shared_folder() as folder:
        _save_pretrained(BertForMaskedLM(_bert_config()), folder)
        torch.manual_seed(1)
        model = BertForSequenceClassification.from_pretrained(folder, num_labels=3)
    model.bert.requires_grad_(False)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.01), lr=5e-3), model)
    counts = [model.num_parameters(), model.num_parameters(only_trainable=True)]
    for step in range(5):
        if step == 2:
            model.bert.encoder.layer[-1].requires_grad_(True)
        if step == 3:
            model.bert.requires_grad_(True)
            counts.append(model.num_parameters(only_trainable=True))

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            _seeded(step, index)
            return model(**_classify_batch(step, index)).loss

        loop.backward(opt, params, loss_of)
        opt.step()
        loop.zero_grad(opt)
    loop.sync(opt)
    return {"params": _snapshot(model), "counts": [float(c) for c in counts]}


def albert_loop(loop: Loop) -> dict:
    """ALBERT: one layer's params shared by all four layers (accumulated from four uses in one
    backward), factorized embeddings, a classification head on the pooler."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    _quiet()
    config = AlbertConfig(
        vocab_size=VOCAB, embedding_size=8, hidden_size=WIDTH, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=2 * WIDTH, max_position_embeddings=2 * SEQ, num_labels=3, pad_token_id=PAD,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AlbertForSequenceClassification(config)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.01), lr=5e-3), model)
    return _train(loop, model, opt, params, 2, lambda step, index: _seeded_classify_loss(model, step, index))


def shared_layer_loop(loop: Loop) -> dict:
    """ALBERT-style sharing in a model that supports reentrant gradient checkpointing: Llama's
    second layer is its first, so each backward's two nested (checkpointed) backwards
    accumulate into the same params one after the other."""
    _quiet()
    model = _llama()
    model.config.use_cache = False
    model.model.layers[1] = model.model.layers[0]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=3e-3), model)
    return _train(loop, model, opt, params, 2, lambda step, index: model(**_causal_batch(step, index)).loss)


def _train(
    loop: Loop,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    steps: int,
    loss: Callable[[int, int], torch.Tensor],
) -> dict:
    """``steps`` plain training steps of ``loss(step, slice_index)`` (each slice's backward, the
    step, the loop's zero_grad); returns the final params."""
    for step in range(steps):
        loop.backward(opt, params, lambda index, step=step: loss(step, index))
        opt.step()
        loop.zero_grad(opt)
    loop.sync(opt)
    return {"params": _snapshot(model)}


def _seeded_classify_loss(model: nn.Module, step: int, index: int) -> torch.Tensor:
    _seeded(step, index)
    return model(**_classify_batch(step, index)).loss


# -- T5 ------------------------------------------------------------------------------------------


def t5_loop(loop: Loop) -> dict:
    """T5ForConditionalGeneration: ``labels=`` (decoder inputs shifted from them), shared
    embeddings, relative attention bias in each stack's first layer only; grads dropped with
    ``model.zero_grad()`` and ``generate()`` under ``inference_mode`` right after ``step()``."""
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet()
    config = T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=2 * WIDTH, num_layers=2, num_decoder_layers=2,
        num_heads=2, relative_attention_num_buckets=8, decoder_start_token_id=PAD, pad_token_id=PAD,
        eos_token_id=EOS,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=3e-3), model)
    generated = []
    for step in range(3):
        model.train()

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            _seeded(step, index)
            batch = _causal_batch(step, index)
            target = _causal_batch(step + 50, index)["labels"][:, : SEQ // 2].contiguous()
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            return model(**inputs, labels=target).loss

        loop.backward(opt, params, loss_of)
        opt.step()
        model.zero_grad()  # as HF's Trainer does after each step
        loop._sums = {}
        model.eval()
        with torch.inference_mode():  # as HF pipelines run
            generated.append(model.generate(_prompt(), max_new_tokens=3, do_sample=False).float())
    loop.sync(opt)
    return {"params": _snapshot(model), "generated": generated}


# -- Mixtral -------------------------------------------------------------------------------------


def mixtral_loop(loop: Loop) -> dict:
    """A tiny mixture of experts, top-1 of 4 routing with the router's auxiliary loss: experts
    reached on some ranks and steps only."""
    from transformers import MixtralConfig, MixtralForCausalLM

    _quiet()
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=WIDTH, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=2 * SEQ, output_router_logits=True, router_aux_loss_coef=0.01,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=3e-3), model)
    return _train(loop, model, opt, params, 2, lambda step, index: model(**_causal_batch(step, index)).loss)


def switch_loop(loop: Loop) -> dict:
    """Switch Transformers: an encoder-decoder whose experts are modules of their own, top-1 of
    8 with a capacity of 2 tokens (the rest dropped) and the router's z-loss and auxiliary loss:
    experts no token reached get no grad on some ranks, some on none."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    _quiet()
    config = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=WIDTH, num_layers=2, num_decoder_layers=2,
        num_heads=2, num_experts=8, expert_capacity=2, encoder_sparse_step=2, decoder_sparse_step=2,
        relative_attention_num_buckets=8, decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    torch.manual_seed(0)
    model = SwitchTransformersForConditionalGeneration(config)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.01), lr=3e-3), model)
    for step in range(2):

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            _seeded(step, index)
            batch = _causal_batch(step, index)
            target = _causal_batch(step + 50, index)["labels"][:, : SEQ // 2].contiguous()
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            return model(**inputs, labels=target, output_router_logits=True).loss

        loop.backward(opt, params, loss_of)
        opt.step()
        loop.zero_grad(opt)
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- resuming from save_pretrained ---------------------------------------------------------------


def _resume_run(loop: Loop, steps: range, folder: str | None, saved: bytes | None) -> tuple:
    """GPT-2 with HF groups and a linear schedule, built fresh or ``from_pretrained(folder)``
    with optimizer and scheduler state loaded from ``saved``."""
    from transformers import GPT2LMHeadModel, get_linear_schedule_with_warmup

    model = _gpt2() if folder is None else GPT2LMHeadModel.from_pretrained(folder)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.01), lr=3e-3), model)
    scheduler = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)
    if saved is not None:
        state = torch.load(io.BytesIO(saved), weights_only=True)
        opt.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    for step in steps:
        model.train()

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            _seeded(step, index)
            return model(**_causal_batch(step, index)).loss

        loop.backward(opt, params, loss_of)
        opt.step()
        scheduler.step()
        loop.zero_grad(opt)
    return model, opt, scheduler


def resume_loop(loop: Loop) -> dict:
    """Trainer's checkpoint: ``save_pretrained`` of the model, ``torch.save`` of the optimizer's
    and scheduler's state dicts after two steps; a new process would rebuild with
    ``from_pretrained`` and load both, then go on: bitwise the uninterrupted run."""
    _quiet()
    model, opt, _ = _resume_run(loop, range(4), None, None)
    loop.sync(opt)
    uninterrupted = _snapshot(model)
    model, opt, scheduler = _resume_run(loop, range(2), None, None)
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    with _shared_folder() as folder:
        _save_pretrained(model, folder)
        if loop.sharded:
            opt.close()
        del model, opt, scheduler
        model, opt, _ = _resume_run(loop, range(2, 4), folder, buffer.getvalue())
    loop.sync(opt)
    return {"params": uninterrupted, "resumed": _snapshot(model)}


# -- what fails at once --------------------------------------------------------------------------


def _error_of(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


RESIZE_REFUSAL = (
    r"gave param 0 \(optimizer order, 'transformer.wte.weight'\) the shape \(40, 16\) but it was laid "
    r"out as \(32, 16\) \(Hugging Face's model.resize_token_embeddings\(n\) does this\).*Resize the model "
    r"before building the optimizer and wrapping it, or build a new optimizer and ShardingStage1 "
    r"after resizing"
)


def resize_loop(loop: Loop) -> dict:
    """Two steps, then ``resize_token_embeddings`` (the tied embedding and head grow by 8
    tokens): ``generate()`` works as in torch, the next training forward refuses (sharded),
    and the fix the error names, a new optimizer and wrapper with the old one still
    referenced, trains on as plain torch does with a new optimizer (whose old state no longer
    fits the resized weight)."""
    _quiet()
    model = _gpt2()
    opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.01), lr=3e-3), model)
    old = opt
    refused = 1.0
    for step in range(5):
        if step == 2:
            torch.manual_seed(3)  # the new rows are drawn around the old rows' mean
            model.resize_token_embeddings(VOCAB + 8)
            model.eval()
            generated = model.generate(_prompt(), max_new_tokens=3, do_sample=False, pad_token_id=PAD)
            model.train()
            if loop.sharded:
                error = _error_of(lambda: model(**_causal_batch(2, loop.rank)))
                refused = float(re.search(RESIZE_REFUSAL, error) is not None)
            opt = loop.wrap(torch.optim.AdamW(_hf_groups(model, 0.01), lr=3e-3), model)
            loop.zero_grad(opt)
        params = list(model.parameters())

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            _seeded(step, index)
            return model(**_causal_batch(step, index)).loss

        loop.backward(opt, params, loss_of)
        opt.step()
        loop.zero_grad(opt)
    loop.sync(opt)
    del old
    return {"params": _snapshot(model), "refused": [refused], "generated": generated.float()}


def resize_after_wrapping(overlap: bool) -> str:
    """The message of the refusal, right after ``resize_token_embeddings``."""
    _quiet()
    model = _gpt2()
    with ShardingStage1(torch.optim.AdamW(model.parameters()), overlap=overlap, model=model):
        model.resize_token_embeddings(VOCAB + 8)
        return _error_of(lambda: model(**_causal_batch(0, 0)))


def adafactor_wrapped() -> str:
    from transformers.optimization import Adafactor

    _quiet()
    model = _gpt2()
    return _error_of(lambda: ShardingStage1(Adafactor(model.parameters(), lr=1e-3, relative_step=False)))


# -- the fixture -------------------------------------------------------------------------------


def _jobs() -> dict[str, Callable[[], object]]:
    return {
        "gpt2": lambda: _late_gathers(gpt2_loop),
        "llama": lambda: _both(llama_loop, bucket_size_mb=None),  # the automatic bucket sizes
        "llama_checkpointing_reentrant": lambda: _both(lambda loop: llama_loop(loop, True)),
        "llama_checkpointing_non_reentrant": lambda: _both(lambda loop: llama_loop(loop, False, True)),
        "llama_lora": lambda: _both(llama_lora_loop),
        "bert_mlm": lambda: _both(bert_mlm_loop),
        "bert_classify": lambda: _both(bert_classify_loop),
        "albert": lambda: _both(albert_loop),
        "shared_layer_checkpointing_reentrant": lambda: _both(shared_layer_loop),
        "t5": lambda: _late_gathers(t5_loop),
        "mixtral": lambda: _both(mixtral_loop),
        "switch_moe": lambda: _both(switch_loop),
        "resume": lambda: _late_gathers(resume_loop),
        "resize_then_rewrap": lambda: _both(resize_loop),
        "resize_sync": lambda: resize_after_wrapping(False),
        "resize_overlap": lambda: resize_after_wrapping(True),
        "adafactor": adafactor_wrapped,
    }


LOOP_JOBS = (
    "gpt2", "llama", "llama_checkpointing_reentrant",
    "llama_checkpointing_non_reentrant", "llama_lora", "bert_mlm", "bert_classify", "t5", "mixtral",
    "switch_moe", "albert", "shared_layer_checkpointing_reentrant", "resume", "resize_then_rewrap",
)  # fmt: skip
THREE_RANK_JOBS = ("bert_classify", "llama_lora")
"""Loops run on 3 ranks too: shards then split params and groups at other offsets."""


def _run_all(names: tuple[str, ...] | None = None) -> dict[str, object]:
    return run_loop_jobs(_jobs(), names)


outcomes, outcomes_on_three = loop_outcome_fixtures(_run_all, THREE_RANK_JOBS)


@pytest.mark.parametrize("name", LOOP_JOBS)
def test_hf_loop_matches_plain_torch(outcomes, name: str) -> None:
    assert_matches_plain(outcomes, name)


@pytest.mark.parametrize("name", THREE_RANK_JOBS)
def test_hf_loop_on_three_ranks_matches_plain_torch(outcomes_on_three, name: str) -> None:
    assert_matches_plain(outcomes_on_three, name)


def test_resuming_from_save_pretrained_is_bitwise_the_uninterrupted_run(outcomes) -> None:
    for rank, results in enumerate(outcomes):
        result = results["resume"]
        assert not isinstance(result, str), f"rank {rank}: {result}"
        for mode in ("plain", "sync", "overlap"):
            for resumed, uninterrupted in zip(result[mode]["resumed"], result[mode]["params"], strict=True):
                assert torch.equal(resumed, uninterrupted), f"rank {rank}, {mode}"


def test_params_no_loss_reaches_stay_untouched(outcomes) -> None:
    for results in outcomes:
        for mode in ("plain", "sync", "overlap"):
            assert results["bert_mlm"][mode]["heads_unchanged"] == [1.0], mode


def test_gpt2_head_stays_tied_to_the_embedding(outcomes) -> None:
    for results in outcomes:
        for mode in ("plain", "sync", "overlap"):
            assert results["gpt2"][mode]["tied"] == [1.0], mode


def test_lora_adapters_under_reentrant_checkpointing_train(outcomes) -> None:
    """Not vacuous: with ``enable_input_require_grads()`` the adapters get grads."""
    for results in outcomes:
        for mode in ("plain", "sync", "overlap"):
            assert results["llama_lora"][mode]["adapters_trained"] == [1.0], mode


@pytest.mark.parametrize("name", ["resize_sync", "resize_overlap"])
def test_resize_token_embeddings_after_wrapping_fails_naming_the_fix(outcomes, name: str) -> None:
    for results in outcomes:
        assert re.search(RESIZE_REFUSAL, results[name]), results[name]
        assert results["resize_then_rewrap"]["sync"]["refused"] == [1.0]


def test_adafactor_is_refused_as_not_elementwise(outcomes) -> None:
    for results in outcomes:
        assert "assume_elementwise" in results["adafactor"], results["adafactor"]
