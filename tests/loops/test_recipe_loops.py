"""Common training recipes written the way users write them (the first round of user loops): a
nanoGPT-style causal LM (decay groups, accumulation, clipping, autocast; one bucket, activation
checkpointing both ways), LM fine-tuning with gradual unfreezing, GANs (the DCGAN tutorial among
them), an EMA (``AveragedModel`` and by hand) right after ``step()``, ``torch.compile`` after
eager steps, steps inside ``with torch.device(...)``, reads of params that no module hook covers,
a padded encoder evaluated right after each step, schedulers built before or after wrapping, and
optimizer flags. Each runs through ShardingStage1 on 2 gloo ranks (sync and overlap; a few on 3
ranks too) and through the plain torch optimizer on one process over the full batch.

Each loop is written once against the :class:`~tests.harness.user_loops.Loop` harness of
``tests/harness/user_loops.py`` (sharded, or plain over every slice with grads averaged as the reduction
does); all loops of the module run in one spawn. The comparison is bitwise where nothing but the
averaging differs; the global norm of ``clip_grad_norm_`` sums per shard, so clipped loops use the
fp32 bound of ``tests/parity/test_differential.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sharded_opt import ShardingStage1
from tests.harness.user_loops import (
    SLICE,
    Loop,
    SmallNet,
    _both,
    _late_gathers,
    _mse,
    _snapshot,
    _xy,
    assert_matches_plain,
    loop_outcome_fixtures,
    run_loop_jobs,
)

VOCAB, CONTEXT, WIDTH = 17, 6, 16


# -- a small Hugging Face-style causal LM ----------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln_1(x)).split(WIDTH, dim=-1)
        heads = [t.view(*t.shape[:2], 2, WIDTH // 2).transpose(1, 2) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(x.shape)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class TinyCausalLM(nn.Module):
    """GPT-2 shaped: token and position embeddings, blocks, a final norm and an LM head tied to
    the token embedding; ``forward(ids, labels)`` returns the loss with ``-100`` labels ignored."""

    def __init__(self, checkpointing: str | None = None) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        self.checkpointing = checkpointing

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            if self.checkpointing is None or not self.training:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        shifted = logits[:, :-1].reshape(-1, VOCAB)
        return F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=-100)


def _tokens(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + index)
    ids = torch.randint(0, VOCAB, (SLICE, CONTEXT), generator=generator)
    labels = ids.clone()
    labels[:, : 1 + index % 2] = -100  # a prompt not to learn, of a different length per slice
    labels[ids == 3] = -100  # padding
    return ids, labels


def _nanogpt_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _cosine_lr(step: int, warmup: int = 2, total: int = 8, peak: float = 3e-3) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / (total - warmup)
    return 0.1 * peak + 0.5 * (1 + math.cos(math.pi * progress)) * 0.9 * peak


def nanogpt_loop(loop: Loop, checkpointing: str | None = None, accumulate: int = 2) -> dict:
    """nanoGPT's loop: decay/no-decay groups, lr set by hand each step, grad accumulation,
    clipping, bf16 autocast, and an eval pass under ``no_grad`` between steps."""
    torch.manual_seed(0)
    model = TinyCausalLM(checkpointing)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(_nanogpt_groups(model, 0.1), betas=(0.9, 0.95)), model)
    evals, norms = [], []
    for step in range(5):
        for group in opt.param_groups:
            group["lr"] = _cosine_lr(step)
        model.train()
        for micro in range(accumulate):

            def loss_of(index: int, step: int = step, micro: int = micro) -> torch.Tensor:
                torch.manual_seed(7 + 10 * step + index)  # dropout draws what rank `index` draws
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model(*_tokens(10 * step + micro, index)) / accumulate

            loop.backward(opt, params, loss_of, no_sync=micro < accumulate - 1)
        norms.append(loop.clip(opt, params, 1.0))
        opt.step()
        loop.zero_grad(opt)
        model.eval()
        with torch.no_grad():
            evals.append(model(*_tokens(999, 0)))
    return {"params": _snapshot(model), "evals": evals, "norms": norms}


def lm_finetune_loop(loop: Loop) -> dict:
    """Fine-tuning: the blocks frozen before wrapping, in a group of their own with a lower lr,
    the embeddings frozen after wrapping; blocks unfrozen one by one (gradual unfreezing),
    dropout on, and ``zero_grad(set_to_none=False)`` as older scripts call it."""
    torch.manual_seed(0)
    model = TinyCausalLM()
    params = list(model.parameters())
    model.blocks.requires_grad_(False)
    backbone = list(model.blocks.parameters())
    rest = [p for p in params if all(p is not q for q in backbone)]
    groups = [{"params": backbone, "lr": 1e-3}, {"params": rest}]
    opt = loop.wrap(torch.optim.Adam(groups, lr=1e-2), model)
    model.wte.requires_grad_(False)
    model.wpe.requires_grad_(False)
    for step in range(5):
        if step == 2:
            model.blocks[1].requires_grad_(True)
        if step == 3:
            model.blocks[0].requires_grad_(True)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            torch.manual_seed(3 + 10 * step + index)
            return model(*_tokens(step, index))

        loop.backward(opt, params, loss_of)
        opt.step()
        loop.zero_grad(opt, set_to_none=False)
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- a GAN -------------------------------------------------------------------------------------


def _gan(loop: Loop) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """A small generator and discriminator, each with its own (wrapped) Adam, DCGAN's betas."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
    discriminator = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    dcgan_adam = {"lr": 2e-3, "betas": (0.5, 0.999)}
    opt_g = loop.wrap(torch.optim.Adam(generator.parameters(), **dcgan_adam), generator)
    opt_d = loop.wrap(torch.optim.Adam(discriminator.parameters(), **dcgan_adam), discriminator)
    return generator, discriminator, opt_g, opt_d


def gan_loop(loop: Loop) -> dict:
    """DCGAN-style: two wrapped optimizers, D stepped twice per G step, D frozen while G trains,
    fake samples detached for D, and a G loss of two terms backpropagated through one graph."""
    generator, discriminator, opt_g, opt_d = _gan(loop)
    g_params, d_params = list(generator.parameters()), list(discriminator.parameters())
    bce = nn.BCEWithLogitsLoss()

    def real(step: int, index: int) -> torch.Tensor:
        return torch.randn(SLICE, 6, generator=torch.Generator().manual_seed(step * 10 + index)) + 2

    def noise(step: int, index: int) -> torch.Tensor:
        return torch.randn(SLICE, 4, generator=torch.Generator().manual_seed(step * 10 + index + 5000))

    for step in range(4):
        discriminator.requires_grad_(True)
        for d_step in range(2):
            loop.zero_grad(opt_d)

            def d_loss(index: int, s: int = 2 * step + d_step) -> torch.Tensor:
                fake = generator(noise(s, index)).detach()
                on_real, on_fake = discriminator(real(s, index)), discriminator(fake)
                return bce(on_real, torch.ones_like(on_real)) + bce(on_fake, torch.zeros_like(on_fake))

            loop.backward(opt_d, d_params, d_loss)
            opt_d.step()
        discriminator.requires_grad_(False)
        loop.zero_grad(opt_g)

        def g_loss(index: int, step: int = step) -> torch.Tensor:
            fake = generator(noise(100 + step, index))
            on_fake = discriminator(fake)
            feature_matching = (fake.mean(0) - real(step, index).mean(0)).square().sum()
            return bce(on_fake, torch.ones_like(on_fake)) + 0.1 * feature_matching

        loop.backward(opt_g, g_params, g_loss)
        opt_g.step()
    loop.sync(opt_g)
    loop.sync(opt_d)
    return {"params": _snapshot(generator) + _snapshot(discriminator)}


def dcgan_tutorial_loop(loop: Loop) -> dict:
    """The PyTorch DCGAN tutorial's loop: ``netD.zero_grad()``, ``errD_real.backward()`` and
    ``errD_fake.backward()`` (two backwards, no ``no_sync``), D's step; then ``netG.zero_grad()``
    and G's loss backward through an unfrozen D (D's grads are dropped by the next
    ``netD.zero_grad()``)."""
    net_g, net_d, opt_g, opt_d = _gan(loop)
    g_params, d_params = list(net_g.parameters()), list(net_d.parameters())
    bce = nn.BCEWithLogitsLoss()
    for step in range(3):
        seeds = range(10 * step, 10 * step + loop.world_size)
        real = [torch.randn(SLICE, 6, generator=torch.Generator().manual_seed(seed)) for seed in seeds]
        noise = [torch.randn(SLICE, 4, generator=torch.Generator().manual_seed(99 + seed)) for seed in seeds]
        net_d.zero_grad()
        if not loop.sharded:
            loop._sums = {}

        def err_d_real(index: int, real: list = real) -> torch.Tensor:
            output = net_d(real[index])
            return bce(output, torch.ones_like(output))

        def err_d_fake(index: int, noise: list = noise) -> torch.Tensor:
            output = net_d(net_g(noise[index]).detach())
            return bce(output, torch.zeros_like(output))

        loop.backward(opt_d, d_params, err_d_real)
        loop.backward(opt_d, d_params, err_d_fake)
        opt_d.step()
        net_g.zero_grad()
        if not loop.sharded:
            loop._sums = {}

        def err_g(index: int, noise: list = noise) -> torch.Tensor:
            output = net_d(net_g(noise[index]))
            return bce(output, torch.ones_like(output))

        loop.backward(opt_g, g_params, err_g)
        opt_g.step()
    loop.sync(opt_g)
    loop.sync(opt_d)
    return {"params": _snapshot(net_g) + _snapshot(net_d)}


# -- EMA -----------------------------------------------------------------------------------------


def ema_loop(loop: Loop) -> dict:
    """What users do right after ``step()``, without ``opt.sync_params()``: update an
    ``AveragedModel`` EMA and a hand-written one, log weight norms and per-sample input norms
    (``torch.func.vmap``). Run with all-gathers that
    land only when waited for, so a read that does not wait sees last step's weights."""
    model = SmallNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    swa = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    hand = [p.detach().clone() for p in params]
    norms = []
    for step in range(4):
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step))
        opt.step()
        inputs = _xy(step, 0)[0]
        norms.append(torch.func.vmap(torch.linalg.vector_norm)(inputs))  # per-sample, via functorch
        norms.append(torch.stack([p.detach().norm() for p in params]))
        with torch.no_grad():
            for average, p in zip(hand, params, strict=True):
                average.lerp_(p, 0.1)
        swa.update_parameters(model)
    loop.sync(opt)
    return {"params": _snapshot(model), "swa": _snapshot(swa.module), "hand": hand, "norms": norms}


def device_block_loop(loop: Loop) -> dict:
    """Each step inside ``with torch.device("cpu"):`` (a torch function mode of its own), which
    must pop its own mode when it ends, also while step()'s all-gathers are pending."""
    model = SmallNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for step in range(3):
        with torch.device("cpu"):
            loop.zero_grad(opt)
            loop.backward(opt, params, _mse(model, step))
            opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model), "modes_left": torch._C._len_torch_function_stack()}


def compile_later_loop(loop: Loop) -> dict:
    """Two eager steps, then ``torch.compile(model)``: its first compiled forward traces hooks
    that cannot wait, while the last eager step's all-gathers are still pending."""
    model = SmallNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.Adam(model.parameters(), lr=1e-2), model)
    forward = model
    for step in range(4):
        if step == 2:
            forward = torch.compile(model, backend="eager")
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(forward, step))
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


class ReadsAhead(nn.Module):
    """A parent that reads children's weights in ways their forward pre-hooks never see: a
    penalty on the head's weight computed before the head runs, a layer used functionally
    (``F.linear`` on its weight, as tied or shared weights often are), params held in an
    ``nn.ParameterList`` (a module that never runs), and a branch that odd steps skip, whose
    params the loss still reads after forward. The functional use runs under activation
    checkpointing: compiled, Dynamo traces its body without torch function modes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 8)
        self.skipped = nn.Linear(8, 8)
        self.scales = nn.ParameterList(nn.Parameter(torch.rand(8) + 0.5) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_skipped: bool) -> tuple[torch.Tensor, torch.Tensor]:
        penalty = self.head.weight.square().sum()
        h = checkpoint(self._second_functionally, torch.tanh(self.first(x)), use_reentrant=False)
        if use_skipped:
            h = self.skipped(h)
        return self.head(h * self.scales[0] + self.scales[1]), penalty

    def _second_functionally(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(h, self.second.weight, self.second.bias))


def reads_ahead_loop(loop: Loop, backend: str | None = None) -> dict:
    """Reads of params inside and right after forward that no module hook covers, while
    step()'s all-gathers (one per param: tiny buckets) are still pending: each must see this
    step's weights. With ``backend``, the forward runs under ``torch.compile(fullgraph=True)``
    and the waits are ops of its graph (Note [torch.compile] in ``sharded_opt/compiled_waits``)."""
    model = ReadsAhead()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    forward = model if backend is None else torch.compile(model, fullgraph=True, backend=backend)
    modes_after_forward = []

    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        def loss(index: int) -> torch.Tensor:
            x, y = _xy(step, index)
            out, penalty = forward(x, use_skipped=step % 2 == 0)
            if backend is None:  # a compiled forward leaves a skipped branch's bucket to the next read
                modes_after_forward.append(torch._C._len_torch_function_stack())  # none into backward
            decay = sum(p.square().sum() for p in model.skipped.parameters())
            return F.mse_loss(out, y) + 1e-2 * penalty + 1e-2 * decay

        return loss

    for step in range(4):
        loop.zero_grad(opt)
        loop.backward(opt, params, loss_of(step))
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model), "modes_after_forward": max(modes_after_forward, default=0)}


class PaddedEncoder(nn.Module):
    """``nn.TransformerEncoder`` over padded sequences: in evaluation under ``no_grad`` torch
    takes its fused fast path (nested tensors from the padding mask, zeros at padded positions)
    only while no torch function mode is active."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
        self.head = nn.Linear(WIDTH, 40)  # a bucket of its own, still pending when the encoder runs

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), src_key_padding_mask=padding))


def _padded(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + index)
    x, y = torch.randn(SLICE, 5, 6, generator=generator), torch.randn(SLICE, 5, 40, generator=generator)
    lengths = torch.randint(2, 6, (SLICE,), generator=generator)
    return x, y, torch.arange(5) >= lengths[:, None]


def padded_encoder_loop(loop: Loop) -> dict:
    """Train on padded sequences, evaluate under ``no_grad`` right after each ``step()`` while
    its all-gathers are pending: the evaluation takes torch's fast path, as in plain torch."""
    model = PaddedEncoder()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model)

    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        def loss(index: int) -> torch.Tensor:
            x, y, padding = _padded(step, index)
            return F.mse_loss(model(x, padding)[~padding], y[~padding])

        return loss

    evals = []
    for step in range(3):
        loop.zero_grad(opt)
        loop.backward(opt, params, loss_of(step))
        opt.step()
        model.eval()
        with torch.no_grad():
            x, _, padding = _padded(99, 0)
            evals.append(model(x, padding))
        model.train()
    loop.sync(opt)
    return {"params": _snapshot(model), "evals": evals}


# -- schedulers --------------------------------------------------------------------------------


SCHEDULERS = {
    "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6),
    "warm_restarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
    "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.8),
        ],
        milestones=[2],
    ),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.9**s, lambda s: 1 / (1 + s)]),
}


def scheduler_loop(loop: Loop, name: str, before_wrap: bool) -> dict:
    """A scheduler of each common kind, built on the torch optimizer before wrapping or on the
    wrapper after, stepped each iteration; ``get_last_lr()`` read as users log it."""
    model = SmallNet()
    params = list(model.parameters())
    rest = list(model.norm.parameters()) + list(model.last.parameters())
    groups = [{"params": list(model.first.parameters())}, {"params": rest}]
    optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    scheduler = SCHEDULERS[name](optimizer) if before_wrap else None
    opt = loop.wrap(optimizer, model)
    if scheduler is None:
        scheduler = SCHEDULERS[name](opt)
    lrs = []
    for step in range(6):
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step))
        opt.step()
        if name == "plateau":
            scheduler.step(1.0)  # a metric that never improves
        else:
            scheduler.step()
        lrs.append(scheduler.get_last_lr())
    loop.sync(opt)
    return {"params": _snapshot(model), "lrs": lrs, "momenta": [g["momentum"] for g in opt.param_groups]}


# -- optimizer flags ---------------------------------------------------------------------------


OPTIMIZER_FLAGS = {
    "sgd_nesterov_maximize": lambda p: torch.optim.SGD(p, 0.05, momentum=0.9, nesterov=True, maximize=True),
    "sgd_foreach_false": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam_amsgrad_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_fused_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, fused=True),
    "adamw_tensor_lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-2)),
    "adam_maximize": lambda p: torch.optim.Adam(p, lr=1e-2, maximize=True, foreach=False),
    "rmsprop_centered": lambda p: torch.optim.RMSprop(p, lr=1e-3, centered=True, momentum=0.5, foreach=False),
    "adagrad_decay": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    "adamax_foreach": lambda p: torch.optim.Adamax(p, lr=1e-2, foreach=True),
    "nadam_decoupled": lambda p: torch.optim.NAdam(p, 1e-2, weight_decay=0.01, decoupled_weight_decay=True),
    "radam_decoupled": lambda p: torch.optim.RAdam(p, 1e-2, weight_decay=0.01, decoupled_weight_decay=True),
}


def optimizer_loop(loop: Loop, name: str) -> dict:
    model = SmallNet()
    params = list(model.parameters())
    opt = loop.wrap(OPTIMIZER_FLAGS[name](model.parameters()), model)
    for step in range(3):
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step))
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- the fixture -------------------------------------------------------------------------------


def _jobs() -> dict[str, Callable[[], dict]]:
    jobs: dict[str, Callable[[], dict]] = {
        "nanogpt": lambda: _both(nanogpt_loop),
        "nanogpt_one_bucket": lambda: _both(nanogpt_loop, bucket_size_mb=None),
        "nanogpt_reentrant": lambda: _both(lambda loop: nanogpt_loop(loop, "reentrant", 1)),
        "nanogpt_non_reentrant": lambda: _both(lambda loop: nanogpt_loop(loop, "non_reentrant", 1)),
        "finetune": lambda: _both(lm_finetune_loop),
        "gan": lambda: _both(gan_loop),
        "dcgan_tutorial": lambda: _both(dcgan_tutorial_loop),
        "ema": lambda: _late_gathers(ema_loop),
        "compile_later": lambda: _late_gathers(compile_later_loop),
        "device_block": lambda: _late_gathers(device_block_loop),
        "reads_ahead": lambda: _late_gathers(reads_ahead_loop, bucket_size_mb=0.0001),
        "reads_ahead_compiled": lambda: _late_gathers(
            lambda loop: reads_ahead_loop(loop, backend="inductor"), bucket_size_mb=0.0001
        ),
        "padded_encoder_eval": lambda: _late_gathers(padded_encoder_loop),
    }
    for name in SCHEDULERS:
        for before in (False, True):
            jobs[f"scheduler_{name}_{'before' if before else 'after'}"] = lambda name=name, before=before: (
                _both(lambda loop: scheduler_loop(loop, name, before))
            )
    for name in OPTIMIZER_FLAGS:
        jobs[f"optimizer_{name}"] = lambda name=name: _both(lambda loop: optimizer_loop(loop, name))
    return jobs


THREE_RANK_JOBS = ("nanogpt", "finetune", "dcgan_tutorial", "ema")
"""Loops run on 3 ranks too: shards then split params and groups at other offsets."""


def _run_all(names: tuple[str, ...] | None = None) -> dict[str, object]:
    return run_loop_jobs(_jobs(), names)


outcomes, outcomes_on_three = loop_outcome_fixtures(_run_all, THREE_RANK_JOBS)


@pytest.mark.parametrize("name", sorted(_jobs()))
def test_user_loop_matches_plain_torch(outcomes, name: str) -> None:
    assert_matches_plain(outcomes, name)


@pytest.mark.parametrize("name", THREE_RANK_JOBS)
def test_user_loop_on_three_ranks_matches_plain_torch(outcomes_on_three, name: str) -> None:
    assert_matches_plain(outcomes_on_three, name)


def test_add_param_group_for_gradual_unfreezing_names_the_way(single_rank_group) -> None:
    model = SmallNet()
    opt = ShardingStage1(torch.optim.AdamW(model.last.parameters()))
    with pytest.raises(RuntimeError, match=r"gradual unfreezing.*before wrapping.*requires_grad_\(True\)"):
        opt.add_param_group({"params": list(model.first.parameters()), "lr": 1e-4})


def test_backward_after_clipping_is_refused(single_rank_group) -> None:
    """A second backward reduces the accumulated local grads again, which would drop a clip
    applied to the first reduction (torch would add the new grads to the clipped ones)."""
    model = SmallNet()
    opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, model=model)
    model(_xy(0, 0)[0]).sum().backward()
    opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match=r"backward ran after opt.clip_grad_norm_.*Clip .* after the last"):
        model(_xy(0, 0)[0]).sum().backward()
