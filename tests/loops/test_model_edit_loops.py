"""Training loops that edit the model or drive the optimizer beyond the plain loop, written the way
users write them (the second round of user loops, on the :class:`~tests.harness.user_loops.Loop` harness of
``tests/harness/user_loops.py``): copies of the wrapped model, weights rewritten after wrapping
(``p.data = t`` included), parametrizations, attention and recurrent models, LoRA, two
optimizers, closures, clipping by value, accumulation without ``no_sync``, gradient penalties,
activation checkpointing with frozen layers, and resuming from a saved file (also on one more
rank, and from a plain torch optimizer's state dict).

Each loop runs plain (one process, every slice), sharded sync and sharded overlap on every rank;
all loops of a world size run in one spawn. Loops that touch params between ``step()`` and the
next forward, or whose modules read other modules' params, run with all-gathers that land only
when waited for, so any read that does not wait sees last step's weights.
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.comm import collectives
from tests.harness.user_loops import (
    SLICE,
    BufferLoop,
    Loop,
    SmallNet,
    _average_grads,
    _both,
    _late_all_gather,
    _late_gathers,
    _mse,
    _snapshot,
    _xy,
    assert_matches_plain,
    loop_outcome_fixtures,
    run_loop_jobs,
)


def _buffer_loops(loop_fn: Callable[[Loop], object], late_gathers: bool = False) -> dict[str, object]:
    """``loop_fn`` with :class:`BufferLoop`s; ``late_gathers``: all-gathers land only when
    waited for, so a read that does not wait sees last step's weights."""
    with (
        mock.patch.object(collectives, "all_gather", _late_all_gather)
        if late_gathers
        else contextlib.nullcontext()
    ):
        return {
            "plain": loop_fn(BufferLoop(False, False)),
            "sync": loop_fn(BufferLoop(True, False)),
            "overlap": loop_fn(BufferLoop(True, True)),
        }


def _flat_storages(opt: torch.optim.Optimizer) -> set[int]:
    if not isinstance(opt, ShardingStage1):
        return set()
    return {buffer.untyped_storage().data_ptr() for buffer in opt.shards.buffers.param_buffers}


# -- copies of the wrapped model -----------------------------------------------------------------


def deepcopy_loop(loop: Loop) -> dict:
    """A frozen teacher copied after wrapping and one step (distillation, DPO's reference
    model), and timm's ModelEmaV2: a deepcopy updated from ``state_dict()`` right after step."""
    model = SmallNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    ema = copy.deepcopy(model).eval()
    teacher = None
    independent = []
    for step in range(4):
        loop.zero_grad(opt)
        if teacher is None:
            loss_of = _mse(model, step)
        else:

            def loss_of(index: int, step: int = step, teacher: nn.Module = teacher) -> torch.Tensor:
                x, y = _xy(step, index)
                out = model(x)
                with torch.no_grad():
                    target = teacher(x)
                return F.mse_loss(out, y) + 0.5 * F.mse_loss(out, target)

        loop.backward(opt, params, loss_of)
        opt.step()
        with torch.no_grad():
            for e, m in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
                if e.dtype.is_floating_point:
                    e.copy_(e * 0.9 + m * 0.1)
                else:
                    e.copy_(m)
        if step == 0:
            teacher = copy.deepcopy(model).requires_grad_(False)
            flat = _flat_storages(opt)
            independent = [
                p.untyped_storage().data_ptr() not in flat and p.untyped_storage().nbytes() == p.nbytes
                for p in list(teacher.parameters()) + list(ema.parameters())
            ]
    loop.sync(opt)
    return {
        "params": _snapshot(model),
        "teacher": _snapshot(teacher),
        "ema": _snapshot(ema),
        "independent": independent,
    }


# -- weights rewritten after wrapping ------------------------------------------------------------


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.2)
        nn.init.zeros_(module.bias)


def rewrite_loop(loop: Loop) -> dict:
    """Re-initialization with ``model.apply``, loading a checkpoint, ``p.data.copy_``,
    ``p.data = t`` and a scaling under ``no_grad``, each right after a step."""
    model = SmallNet()
    params = list(model.parameters())
    torch.manual_seed(5)
    other = SmallNet().state_dict()
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    torch.manual_seed(11)
    model.apply(_init_weights)
    for step in range(6):
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step))
        opt.step()
        if step == 0:
            model.load_state_dict(other)
        elif step == 1:
            model.first.weight.data.copy_(torch.full_like(model.first.weight, 0.1))
        elif step == 2:
            model.last.weight.data = model.last.weight.data * 0.5 + 0.01
        elif step == 3:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.9)
        elif step == 4:
            torch.manual_seed(12)
            model.last.apply(_init_weights)
    loop.sync(opt)
    return {"params": _snapshot(model)}


def wgan_clip_loop(loop: Loop) -> dict:
    """WGAN: RMSprop, three critic steps per generator step, the critic's weights clipped with
    ``p.data.clamp_(-c, c)`` right after each critic step."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(3, 12), nn.ReLU(), nn.Linear(12, 5))
    critic = nn.Sequential(nn.Linear(5, 12), nn.LeakyReLU(0.2), nn.Linear(12, 1))
    opt_g = loop.wrap(torch.optim.RMSprop(gen.parameters(), lr=5e-3), gen)
    opt_c = loop.wrap(torch.optim.RMSprop(critic.parameters(), lr=5e-3), critic)
    g_params, c_params = list(gen.parameters()), list(critic.parameters())

    def batch(seed: int, index: int, width: int) -> torch.Tensor:
        return torch.randn(SLICE, width, generator=torch.Generator().manual_seed(100 * seed + index))

    def critic_loss(index: int, seed: int) -> torch.Tensor:
        return critic(gen(batch(seed, index, 3)).detach()).mean() - critic(batch(seed, index, 5) + 1).mean()

    for step in range(3):
        for c_step in range(3):
            loop.zero_grad(opt_c)
            loop.backward(opt_c, c_params, lambda i, s=3 * step + c_step: critic_loss(i, s))
            opt_c.step()
            for p in critic.parameters():
                p.data.clamp_(-0.05, 0.05)
        loop.zero_grad(opt_g)
        loop.backward(opt_g, g_params, lambda i, s=step: -critic(gen(batch(50 + s, i, 3))).mean())
        opt_g.step()
    loop.sync(opt_g)
    loop.sync(opt_c)
    return {"params": _snapshot(gen) + _snapshot(critic)}


def wgan_gp_loop(loop: Loop) -> dict:
    """WGAN-GP: the gradient penalty from ``torch.autograd.grad(create_graph=True)`` on
    interpolates, then one backward of critic loss plus penalty; Adam(0, 0.9)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(3, 12), nn.ReLU(), nn.Linear(12, 5))
    critic = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 1))
    opt_g = loop.wrap(torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.0, 0.9)), gen)
    opt_c = loop.wrap(torch.optim.Adam(critic.parameters(), lr=1e-3, betas=(0.0, 0.9)), critic)
    g_params, c_params = list(gen.parameters()), list(critic.parameters())

    def critic_loss(index: int, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(10 * step + index)
        real = torch.randn(SLICE, 5, generator=generator) + 1
        fake = gen(torch.randn(SLICE, 3, generator=generator)).detach()
        alpha = torch.rand(SLICE, 1, generator=generator)
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        return critic(fake).mean() - critic(real).mean() + 10 * penalty

    for step in range(3):
        loop.zero_grad(opt_c)
        loop.backward(opt_c, c_params, lambda i, s=step: critic_loss(i, s))
        opt_c.step()
        loop.zero_grad(opt_g)
        noise = [
            torch.randn(SLICE, 3, generator=torch.Generator().manual_seed(77 + step + i)) for i in range(3)
        ]
        loop.backward(opt_g, g_params, lambda i, n=noise: -critic(gen(n[i])).mean())
        opt_g.step()
    loop.sync(opt_g)
    loop.sync(opt_c)
    return {"params": _snapshot(gen) + _snapshot(critic)}


# -- parametrizations ----------------------------------------------------------------------------


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(0, 1)


class ParametrizedNet(nn.Module):
    """weight_norm, spectral_norm (power iteration buffers updated in every training forward)
    and a custom parametrization, whose params live under ``parametrizations.weight.original*``,
    and the old hook-based weight_norm (``weight_g``, ``weight_v``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        P = torch.nn.utils.parametrizations
        self.first = P.weight_norm(nn.Linear(6, 8))
        self.middle = P.spectral_norm(nn.Linear(8, 8))
        self.square = nn.Linear(8, 8)
        parametrize.register_parametrization(self.square, "weight", Symmetric())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated, still in older models
            self.last = torch.nn.utils.weight_norm(nn.Linear(8, 96))  # a forward pre-hook computes it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.first(x))
        x = torch.tanh(self.middle(x))
        return self.last(torch.tanh(self.square(x))).view(-1, 48, 2).mean(1)


def parametrization_loop(loop: Loop) -> dict:
    """The custom parametrization removed after two steps (``remove_parametrizations`` sets its
    original to the computed weight with ``set_``) and training goes on."""
    model = ParametrizedNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.Adam(model.parameters(), lr=1e-2), model)
    for step in range(4):
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step), module=model)
        opt.step()
        if step == 1:
            parametrize.remove_parametrizations(model.square, "weight")
    loop.sync(opt)
    buffers = [b.clone() for b in model.buffers()] if loop.rank == 0 else []
    return {"params": _snapshot(model), "buffers": buffers}


# -- attention, recurrent and normalization layers -----------------------------------------------

TOKENS, PAD = 11, 0


class Seq2Seq(nn.Module):
    """An encoder-decoder: shared embedding with ``padding_idx``, ``nn.Transformer`` with
    ``batch_first`` and key padding masks, a GRU over the decoder output, BatchNorm1d."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(TOKENS, 8, padding_idx=PAD)
        self.transformer = nn.Transformer(
            d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
            dropout=0.1, batch_first=True,
        )  # fmt: skip
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, TOKENS)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        src_pad, tgt_pad = src == PAD, tgt == PAD
        out = self.transformer(
            self.embed(src), self.embed(tgt), tgt_mask=causal,
            src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad,
        )  # fmt: skip
        out, _ = self.gru(out)
        out = self.norm(out.transpose(1, 2)).transpose(1, 2)
        return self.head(out)


def _pairs(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(31 * step + index)
    src = torch.randint(1, TOKENS, (SLICE, 5), generator=generator)
    tgt = torch.randint(1, TOKENS, (SLICE, 4), generator=generator)
    src[:, 5 - 1 - index % 2 :] = PAD
    tgt[:, -1] = PAD
    return src, tgt


def seq2seq_loop(loop: Loop, evaluate: bool = True) -> dict:
    model = Seq2Seq()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=5e-3), model)
    evals = []
    for step in range(3):
        model.train()
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            torch.manual_seed(7 + 10 * step + index)
            src, tgt = _pairs(step, index)
            logits = model(src, tgt[:, :-1])
            return F.cross_entropy(logits.reshape(-1, TOKENS), tgt[:, 1:].reshape(-1), ignore_index=PAD)

        loop.backward(opt, params, loss_of, module=model)
        opt.step()
        if evaluate and loop.rank == 0:
            model.eval()
            with torch.no_grad():  # the encoder's fast path (nested tensors from the padding mask)
                evals.append(model(*_pairs(99, 0)))
    loop.sync(opt)
    return {"params": _snapshot(model), "evals": evals}


class CharRNN(nn.Module):
    """A 2-layer LSTM language model whose weights are views of one blob, as cuDNN's
    ``flatten_parameters`` leaves them on a GPU. With ``reflatten`` every forward moves them
    into a new blob (``set_``, as ``flatten_parameters`` does on a GPU when it finds them
    scattered, e.g. in flat buffers); otherwise ``flatten_parameters`` is the CPU no-op."""

    def __init__(self, reflatten: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(TOKENS, 6, padding_idx=PAD)
        self.lstm = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, TOKENS)
        self.reflatten = reflatten
        _flatten_into_one_blob(self.lstm)

    def forward(
        self, ids: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.reflatten:
            _flatten_into_one_blob(self.lstm)
        else:
            self.lstm.flatten_parameters()
        out, hidden = self.lstm(self.embed(ids), hidden)
        return self.head(out), hidden


@torch.no_grad()
def _flatten_into_one_blob(rnn: nn.RNNBase) -> None:
    weights = [getattr(rnn, name) for name in rnn._flat_weights_names]
    blob = torch.cat([w.detach().reshape(-1) for w in weights])
    offset = 0
    for w in weights:
        w.set_(blob[offset : offset + w.numel()].view_as(w))
        offset += w.numel()


def char_rnn_loop(loop: Loop, reflatten: bool) -> dict:
    """Truncated BPTT: each slice's hidden state carried, detached, to its next batch."""
    model = CharRNN(reflatten)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.Adam(model.parameters(), lr=1e-2), model)
    hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(3):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            generator = torch.Generator().manual_seed(10 * step + index)
            ids = torch.randint(0, TOKENS, (SLICE, 6), generator=generator)
            logits, state = model(ids[:, :-1], hidden.get(index))
            hidden[index] = (state[0].detach(), state[1].detach())
            return F.cross_entropy(logits.reshape(-1, TOKENS), ids[:, 1:].reshape(-1), ignore_index=PAD)

        loop.backward(opt, params, loss_of)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- LoRA ------------------------------------------------------------------------------------------


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()

    @torch.no_grad()
    def merge(self) -> None:
        self.base.weight += self.lora_b @ self.lora_a
        self.lora_b.zero_()


def lora_loop(loop: Loop) -> dict:
    """PEFT-style: the base frozen before building the optimizer, adapters in a group of their
    own, the head in another with weight decay; adapters merged into the base after step 2
    (ReLoRA: B reset to zero) and training goes on."""
    model = SmallNet()
    model.requires_grad_(False)
    model.first = LoRALinear(model.first)
    model.last = LoRALinear(model.last)
    model.last.base.bias.requires_grad_(True)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    groups = [{"params": adapters, "lr": 2e-2}, {"params": [model.last.base.bias], "weight_decay": 0.1}]
    params = adapters + [model.last.base.bias]
    opt = loop.wrap(torch.optim.AdamW(groups, lr=1e-2), model)
    for step in range(5):
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step))
        opt.step()
        if step == 2:
            model.first.merge()
            model.last.merge()
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- two optimizers, closures ----------------------------------------------------------------------


def two_optimizers_loop(loop: Loop, head_wrapped: bool) -> dict:
    """The body (wrapped AdamW) steps every batch; the head (SGD, wrapped or plain with grads
    averaged by hand) accumulates over two batches and steps every second one."""
    model = SmallNet()
    params = list(model.parameters())
    head = list(model.last.parameters())
    body = [p for p in params if all(p is not h for h in head)]
    opt_body = loop.wrap(torch.optim.AdamW(body, lr=1e-2), None)
    head_sgd = torch.optim.SGD(head, lr=0.05, momentum=0.9)
    opt_head = loop.wrap(head_sgd, None) if head_wrapped else head_sgd
    for step in range(4):
        loop.zero_grad(opt_body)
        if step % 2 == 0:
            if loop.sharded and not head_wrapped:
                opt_head.zero_grad()
            else:
                loop.zero_grad(opt_head)
        loop.backward(opt_body, params, _mse(model, step))
        opt_body.step()
        if step % 2 == 1:
            if loop.sharded and not head_wrapped:
                _average_grads(head)
            opt_head.step()
            if loop.sharded and not head_wrapped:
                opt_head.zero_grad()  # the hand-averaged grads must not add up again
    loop.sync(opt_body)
    if head_wrapped:
        loop.sync(opt_head)
    return {"params": _snapshot(model)}


def closure_loop(loop: Loop) -> dict:
    """``opt.step(closure)`` whose closure zeroes grads, recomputes the loss and backpropagates."""
    model = SmallNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True), model)
    losses = []
    for step in range(3):

        def closure(step: int = step) -> torch.Tensor:
            loop.zero_grad(opt)
            loop.backward(opt, params, _mse(model, step))
            with torch.no_grad():
                return _mse(model, step)(0)

        losses.append(opt.step(closure))
    loop.sync(opt)
    return {"params": _snapshot(model), "losses": losses}


def clip_value_loop(loop: Loop) -> dict:
    """Grads clamped by value before each step (RL code, old RNN scripts)."""
    model = SmallNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    for step in range(3):
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step))
        if loop.sharded:
            opt.clip_grad_value_(0.05)
        else:
            torch.nn.utils.clip_grad_value_(params, 0.05)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- accumulation, partial backward ----------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 8)
        self.rare = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if use_rare:
            h = h + torch.tanh(self.rare(h))
        return self.head(h)


def accumulate_loop(loop: Loop) -> dict:
    """Three micro-batches, each with its own backward and no ``no_sync``; ``rare`` is reached
    only on some micro-batches of some ranks; every third micro-batch backpropagates into the
    head only (``backward(inputs=...)``)."""
    model = Branchy()
    params = list(model.parameters())
    head = list(model.head.parameters())
    opt = loop.wrap(torch.optim.Adam(model.parameters(), lr=1e-2), model)
    for step in range(3):
        loop.zero_grad(opt)
        for micro in range(3):

            def loss_of(index: int, step: int = step, micro: int = micro) -> torch.Tensor:
                x, y = _xy(10 * step + micro, index)
                return F.mse_loss(model(x, use_rare=(step + micro + index) % 4 == 0), y) / 3

            inputs = head if (step + micro) % 3 == 2 else None
            loop.backward(opt, params, loss_of, inputs=inputs)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- activation checkpointing with frozen layers ---------------------------------------------------


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


class LayerStack(nn.Module):
    """HF-style: ``for layer in self.layers: x = checkpoint(layer, x, use_reentrant=...)``."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList([Layer() for _ in range(4)])
        self.out = nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=self.reentrant) if self.training else layer(x)
        return self.out(x)


def checkpointing_loop(loop: Loop, reentrant: bool) -> dict:
    """The embedding and the first layer frozen before wrapping (so with reentrant checkpointing
    the second layer's input needs no grad and its params get none, as in plain torch), the
    third frozen after two steps, bf16 autocast."""
    model = LayerStack(reentrant)
    model.embed.requires_grad_(False)
    model.layers[0].requires_grad_(False)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    for step in range(4):
        if step == 2:
            model.layers[2].requires_grad_(False)
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            x, y = _xy(step, index)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.mse_loss(model(x).float(), y)

        loop.backward(opt, params, loss_of)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- resume from a file ----------------------------------------------------------------------------


def _resume_build(loop: Loop, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = SmallNet()
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05), model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    return model, opt, scheduler


def _resume_train(loop: Loop, model: nn.Module, opt, scheduler, steps: range) -> None:
    params = list(model.parameters())
    for step in steps:
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step))
        opt.step()
        scheduler.step()


def _save(model: nn.Module, opt, scheduler) -> bytes:
    """Every rank gathers the optimizer state (collective); the file is written once."""
    checkpoint_dict = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict()}
    buffer = io.BytesIO()
    torch.save(checkpoint_dict, buffer)
    return buffer.getvalue()


def resume_loop(loop: Loop, plain_file: bytes | None = None) -> dict:
    """Three steps, ``torch.save`` of model, optimizer and scheduler, a fresh rebuild (other
    init), ``load_state_dict`` of all three, three more steps; also the uninterrupted run. With
    ``plain_file`` the checkpoint loaded is the plain torch optimizer's."""
    model, opt, scheduler = _resume_build(loop, 0)
    _resume_train(loop, model, opt, scheduler, range(6))
    loop.sync(opt)
    uninterrupted = _snapshot(model)
    model, opt, scheduler = _resume_build(loop, 0)
    _resume_train(loop, model, opt, scheduler, range(3))
    saved = _save(model, opt, scheduler)
    del model, opt, scheduler
    model, opt, scheduler = _resume_build(loop, 1)
    loaded = torch.load(io.BytesIO(plain_file or saved), weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    scheduler.load_state_dict(loaded["sched"])
    _resume_train(loop, model, opt, scheduler, range(3, 6))
    loop.sync(opt)
    return {"params": uninterrupted, "resumed": _snapshot(model), "saved": saved}


def resume_jobs() -> dict[str, object]:
    plain = resume_loop(Loop(False, False))
    results = {"plain": plain}
    for mode, overlap in (("sync", False), ("overlap", True)):
        results[mode] = resume_loop(Loop(True, overlap))
        results[f"{mode}_from_plain"] = resume_loop(Loop(True, overlap), plain["saved"])
    for result in results.values():
        del result["saved"]
    return results


class SubgroupLoop(Loop):
    """A :class:`Loop` over the first ``world_size`` ranks only, sharded over ``group``."""

    def __init__(self, sharded: bool, overlap: bool, world_size: int, group: dist.ProcessGroup) -> None:
        super().__init__(sharded, overlap)
        self.world_size = world_size
        self.group = group

    def wrap(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        if not self.sharded:
            return optimizer
        strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=self.bucket_size_mb))
        return ShardingStage1(
            optimizer, overlap=self.overlap, strategy=strategy, model=model, process_group=self.group
        )


def more_ranks_loop(sharded: bool, overlap: bool, group: dist.ProcessGroup) -> dict:
    """Three steps on all ranks but the last, ``torch.save``, then all ranks load and go on
    (a job restarted with one more rank): the state dict does not depend on the world size."""
    first = SubgroupLoop(sharded, overlap, dist.get_world_size() - 1, group)
    saved = [None]
    if not sharded or first.rank < first.world_size:
        model, opt, scheduler = _resume_build(first, 0)
        _resume_train(first, model, opt, scheduler, range(3))
        saved = [_save(model, opt, scheduler)]
        del model, opt, scheduler
    if sharded:
        dist.broadcast_object_list(saved, src=0)
    second = Loop(sharded, overlap)
    model, opt, scheduler = _resume_build(second, 1)
    loaded = torch.load(io.BytesIO(saved[0]), weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    scheduler.load_state_dict(loaded["sched"])
    _resume_train(second, model, opt, scheduler, range(3, 6))
    second.sync(opt)
    return {"params": _snapshot(model)}


def more_ranks_jobs() -> dict[str, object]:
    group = dist.new_group(list(range(dist.get_world_size() - 1)))
    return {
        "plain": more_ranks_loop(False, False, group),
        "sync": more_ranks_loop(True, False, group),
        "overlap": more_ranks_loop(True, True, group),
    }


# -- the fixture -------------------------------------------------------------------------------


def _jobs() -> dict[str, Callable[[], object]]:
    return {
        "deepcopy": lambda: _late_gathers(deepcopy_loop),
        "rewrite": lambda: _late_gathers(rewrite_loop),
        "wgan_clip": lambda: _late_gathers(wgan_clip_loop),
        "wgan_gp": lambda: _both(wgan_gp_loop),
        "parametrizations": lambda: _buffer_loops(parametrization_loop, late_gathers=True),
        "seq2seq": lambda: _buffer_loops(seq2seq_loop, late_gathers=True),
        "seq2seq_train_only": lambda: _buffer_loops(
            lambda loop: seq2seq_loop(loop, False), late_gathers=True
        ),
        "char_rnn": lambda: _both(lambda loop: char_rnn_loop(loop, False)),
        "char_rnn_reflattened": lambda: _both(lambda loop: char_rnn_loop(loop, True)),
        "lora": lambda: _late_gathers(lora_loop),
        "two_wrapped_optimizers": lambda: _buffer_loops(lambda loop: two_optimizers_loop(loop, True)),
        "one_wrapped_one_plain": lambda: _buffer_loops(lambda loop: two_optimizers_loop(loop, False)),
        "closure": lambda: _both(closure_loop),
        "clip_value": lambda: _both(clip_value_loop),
        "accumulate": lambda: _buffer_loops(accumulate_loop),
        "checkpointing_reentrant": lambda: _both(lambda loop: checkpointing_loop(loop, True)),
        "checkpointing_non_reentrant": lambda: _both(lambda loop: checkpointing_loop(loop, False)),
        "resume": resume_jobs,
        "more_ranks": more_ranks_jobs,
    }


THREE_RANK_JOBS = ("accumulate", "resume", "more_ranks")
"""Loops run on 3 ranks too: shards then split params and groups at other offsets."""


def _run_all(names: tuple[str, ...] | None = None) -> dict[str, object]:
    return run_loop_jobs(_jobs(), names)


outcomes, outcomes_on_three = loop_outcome_fixtures(_run_all, THREE_RANK_JOBS)


@pytest.mark.parametrize("name", sorted(set(_jobs()) - {"more_ranks"}))
def test_user_loop_matches_plain_torch(outcomes, name: str) -> None:
    assert_matches_plain(outcomes, name)


@pytest.mark.parametrize("name", THREE_RANK_JOBS)
def test_user_loop_on_three_ranks_matches_plain_torch(outcomes_on_three, name: str) -> None:
    assert_matches_plain(outcomes_on_three, name)


@pytest.mark.parametrize("attach_later", [False, True])
def test_sparse_embedding_is_refused_naming_sparse_false(single_rank_group, attach_later: bool) -> None:
    """``nn.Embedding(sparse=True)``: its sparse grads would be added into the dense flat grad
    buffer (Adam, which refuses sparse grads in torch, would train anyway)."""
    model = nn.Sequential(nn.Embedding(TOKENS, 4, sparse=True), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"dense grads but 0 \(Embedding\) has sparse=True.*sparse=False"):
        if attach_later:
            ShardingStage1(optimizer).attach(model)
        else:
            ShardingStage1(optimizer, model=model)


def test_sparse_embedding_outside_the_optimizer_is_accepted(single_rank_group) -> None:
    model = nn.Sequential(nn.Embedding(TOKENS, 4, sparse=True), nn.Linear(4, 2))
    ShardingStage1(torch.optim.Adam(model[1].parameters()), model=model).close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_resuming_from_a_saved_file_is_bitwise_the_uninterrupted_run(
    outcomes, outcomes_on_three, world_size
) -> None:
    """Model, optimizer and scheduler saved with ``torch.save`` after three steps, loaded into a
    fresh model, optimizer and wrapper: the same bits as never stopping."""
    for rank, results in enumerate(outcomes if world_size == 2 else outcomes_on_three):
        result = results["resume"]
        assert not isinstance(result, str), f"rank {rank}: {result}"
        for mode in ("plain", "sync", "overlap"):
            for resumed, uninterrupted in zip(result[mode]["resumed"], result[mode]["params"], strict=True):
                assert torch.equal(resumed, uninterrupted), f"rank {rank}, {mode}"


def test_stock_clip_grad_value_is_refused_naming_the_wrappers(single_rank_group) -> None:
    model = SmallNet()
    opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1))
    _mse(model, 0)(0).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    with pytest.raises(
        RuntimeError, match=r"modified in place after backward.*opt.clip_grad_value_\(clip_value\)"
    ):
        opt.step()


def test_a_new_wrapper_over_the_same_params_takes_their_grads(single_rank_group) -> None:
    """A notebook re-running its optimizer cell while the old wrapper is still referenced: the
    old wrapper's grad hooks are retired (they no longer tell ownership by where ``.data``
    lives, since ``param.data = t`` is taken back at ``step()``)."""
    model = SmallNet()
    reference = copy.deepcopy(model)
    old = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
    new = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        for net, opt in ((model, new), (reference, plain)):
            opt.zero_grad()
            _mse(net, step)(0).backward()
            opt.step()
    torch.testing.assert_close(_snapshot(model), _snapshot(reference), rtol=0, atol=0)
    assert not any(old.grad_sync.tracker.received), "the old wrapper's hooks still count grads"
    old.close()
    new.close()
