"""Unusual params and modules through ShardingStage1 against plain torch (red-team round six):
complex (also with a real ``reduce_dtype`` and clipping), fp64, mixed fp32/bf16 params and fp16
params with fp32 masters and loss scaling, params of odd shapes (0-dim, no elements, larger than
a bucket, a thousand scalars, fewer elements than ranks, strided, views), lazy, scripted, traced
and ``fx``-traced modules, parametrizations (LoRA's among them) registered before and after
wrapping, attention and recurrent layers with their rarer options, grouped and transposed
convolutions, backward hooks that rescale grads, custom autograd functions,
``checkpoint_sequential``, dict containers, modules called twice, through ``.forward`` or not at
all, a model trained through methods other than ``forward``, and params replaced, cast or
re-initialized after wrapping. What cannot work is refused at wrapping (uninitialized lazy
params, params sharing memory, a scripted ``model=``) or at the step (a cast model, fp16 grads
scaled without a master), with the fix in the message.

Each loop runs plain (one process, every slice), sharded sync, sharded overlap with the model
attached and sharded overlap without a model (the harness of ``tests/harness/user_loops.py``), with
all-gathers that land only when waited for; all loops of a world size run in one spawn.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.checkpoint import checkpoint_sequential

from sharded_opt import ShardedGradScaler, ShardingConfig, ShardingStage1, Strategy
from sharded_opt.comm import collectives
from tests.harness.differential import _average
from tests.harness.user_loops import (
    SLICE,
    BufferLoop,
    Loop,
    SmallNet,
    _late_all_gather,
    _mse,
    _snapshot,
    _xy,
    assert_matches_plain,
    loop_outcome_fixtures,
    run_loop_jobs,
)


class CastLoop(BufferLoop):
    """A :class:`BufferLoop` whose plain run casts each averaged grad (summed in the reduction
    dtype, fp32 for 16-bit params) back to its param's dtype, which is what the wrapper steps
    when it keeps no master copy, or, given ``masters``, hands it as it is to the param's
    master copy."""

    masters: list[torch.Tensor] | None = None

    def backward(  # type: ignore[override]
        self,
        opt: torch.optim.Optimizer,
        params: list[nn.Parameter],
        loss_of: Callable[[int], torch.Tensor],
        **kwargs,
    ) -> None:
        if self.sharded:
            super().backward(opt, params, loss_of, **kwargs)
            return
        per_slice = []
        for index in range(self.world_size):
            for p in params:
                p.grad = None
            loss_of(index).backward()
            per_slice.append([None if p.grad is None else p.grad.clone() for p in params])
        for i, p in enumerate(params):
            grad = _average([grads[i] for grads in per_slice], p.dtype, self.world_size)
            if self.masters is None:
                p.grad = None if grad is None else grad.to(p.dtype)
            else:
                p.grad, self.masters[i].grad = None, grad


class ConfiguredLoop(BufferLoop):
    """A :class:`BufferLoop` whose wrapper gets more ``ShardingConfig`` settings and, unless
    ``attach``, no model."""

    def __init__(self, sharded: bool, overlap: bool, attach: bool = True, **config) -> None:
        super().__init__(sharded, overlap, config.pop("bucket_size_mb", 0.002))
        self.attach = attach
        self.config = config

    def wrap(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        if not self.sharded:
            return optimizer
        strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=self.bucket_size_mb, **self.config))
        model = model if self.attach else None
        return ShardingStage1(optimizer, overlap=self.overlap, strategy=strategy, model=model)


def _modes(
    loop_fn: Callable[[Loop], object],
    model_free: bool = True,
    plain: type[Loop] = BufferLoop,
    **config,
) -> dict[str, object]:
    """``loop_fn`` plain, sharded sync, overlap with the model attached and (``model_free``)
    overlap without, with all-gathers that land only when waited for; ``config``: settings of
    ``ShardingConfig`` (buckets of 2 KB unless ``bucket_size_mb`` is given)."""
    with mock.patch.object(collectives, "all_gather", _late_all_gather):
        results = {
            "plain": loop_fn(plain(False, False)),
            "sync": loop_fn(ConfiguredLoop(True, False, **config)),
            "overlap": loop_fn(ConfiguredLoop(True, True, **config)),
        }
        if model_free:
            results["overlap_no_model"] = loop_fn(ConfiguredLoop(True, True, attach=False, **config))
        return results


def _train(
    loop: Loop,
    model: nn.Module,
    loss_of: Callable[[int], Callable[[int], torch.Tensor]],
    steps: int = 3,
    make_optimizer: Callable = lambda params: torch.optim.AdamW(params, lr=1e-2),
    after_step: Callable[[int], None] = lambda step: None,
    attach: bool = True,
    max_norm: float | None = None,
) -> dict:
    """The common loop: ``steps`` of zero_grad, backward of ``loss_of(step)``, clipping to
    ``max_norm`` if given, step, then ``after_step(step)`` right after ``step()`` (its
    all-gathers still pending); ``attach``: the model is given to the wrapper."""
    params = list(model.parameters())
    opt = loop.wrap(make_optimizer(params), model if attach else None)
    for step in range(steps):
        loop.zero_grad(opt)
        loop.backward(opt, params, loss_of(step))
        if max_norm is not None:
            loop.clip(opt, params, max_norm)
        opt.step()
        after_step(step)
    loop.sync(opt)
    return {"params": _snapshot(model)}


def _regression(model: nn.Module, dtype: torch.dtype = torch.float32) -> Callable[[int], Callable]:
    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        def loss(index: int) -> torch.Tensor:
            x, y = _xy(step, index)
            return F.mse_loss(model(x.to(dtype)).float(), y)

        return loss

    return loss_of


# -- dtypes ----------------------------------------------------------------------------------------


class ComplexNet(nn.Module):
    """A complex-valued layer (torch.optim steps complex params as real pairs) before a real
    head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(6, 5, dtype=torch.cfloat) / 3)
        self.bias = nn.Parameter(torch.randn(5, dtype=torch.cfloat) / 3)
        self.head = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.to(torch.cfloat) @ self.weight + self.bias
        return self.head(torch.cat([z.real, z.imag], dim=-1))


def complex_loop(loop: Loop, max_norm: float | None = None) -> dict:
    model = ComplexNet()
    return _train(loop, model, _regression(model), max_norm=max_norm)


class SpectralNet(nn.Module):
    """A Fourier layer whose complex weights are kept as real pairs and read with
    ``torch.view_as_complex`` (FNO-style), which needs an even storage offset; the scalar and
    the 2-wide head before it in the layout would start it at an odd one if packed densely."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.modes = nn.Parameter(torch.randn(3, 2) / 2)
        self.head = nn.Linear(2, 2, bias=False)
        self.shift = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x, dim=-1)[..., :3] * torch.view_as_complex(self.modes)
        return self.head(torch.fft.irfft(spectrum, n=6, dim=-1)[..., :2]) * self.gain + self.shift


def spectral_loop(loop: Loop) -> dict:
    model = SpectralNet()
    return _train(loop, model, _regression(model))


def fp64_loop(loop: Loop) -> dict:
    model = SmallNet().double()
    return _train(loop, model, _regression(model, torch.float64))


class MixedNet(nn.Module):
    """A bf16 layer and fp32 layers in one optimizer (one bucket per dtype)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 12)
        self.middle = nn.Linear(12, 12).to(torch.bfloat16)
        self.last = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x)).to(torch.bfloat16)
        return self.last(torch.tanh(self.middle(h)).float())


def mixed_dtype_loop(loop: Loop) -> dict:
    model = MixedNet()
    return _train(loop, model, _regression(model))


def fp16_scaler_loop(loop: Loop) -> dict:
    """fp16 params with fp32 masters and loss scaling (apex O2 style): the wrapper with
    ``master_dtype=torch.float32`` and ``ShardedGradScaler``; plain torch with fp32 master
    copies, their grads the averaged fp16 grads, and ``torch.amp.GradScaler``. The first two
    scales overflow fp16 (skipped steps on every rank), as scales do at the start of training;
    the scale grows again after two good steps."""
    model = Plain().half()
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_(True) for p in params]
    if loop.sharded:
        opt = loop.wrap(torch.optim.Adam(params, lr=1e-2), model)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**17, growth_interval=2)
    else:
        opt = torch.optim.Adam(masters, lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17, growth_interval=2)
        loop.masters = masters
    loss_of = _regression(model, torch.float16)
    scales = []
    for step in range(4):
        loop.zero_grad(opt)
        loop.backward(opt, params, lambda index, step=step: scaler.scale(loss_of(step)(index)))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if not loop.sharded:
            with torch.no_grad():
                for p, master in zip(params, masters, strict=True):
                    p.copy_(master)
    loop.sync(opt)
    return {"params": _snapshot(model), "scales": scales}


# -- shapes ----------------------------------------------------------------------------------------


class ShapesNet(nn.Module):
    """A 0-dim param, params without elements, one larger than a bucket, one of a single
    element (fewer than ranks), a transposed weight, a weight made by ``as_strided`` with gaps
    and a param made from a view of another tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.empty = nn.Parameter(torch.empty(0))
        self.empty_matrix = nn.Parameter(torch.empty(3, 0))
        self.big = nn.Linear(6, 200)  # 4.8 KB of weight, buckets of 2 KB
        self.one = nn.Parameter(torch.tensor([0.3]))
        self.transposed = nn.Parameter(torch.randn(8, 200).t() / 10)  # (200, 8) with strides (1, 200)
        self.gapped = nn.Parameter(torch.randn(40).as_strided((8, 2), (4, 2)))
        base = torch.randn(4, 6)
        self.view = nn.Parameter(base[1:3])  # a view of `base`'s storage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.big(x)) @ self.transposed
        extra = self.empty.sum() + (x[:, :3] @ self.empty_matrix).sum()
        h = h @ self.gapped * self.scale + self.one + extra
        return h + (x @ self.view.t()).sum(-1, keepdim=True)


def shapes_loop(loop: Loop) -> dict:
    model = ShapesNet()
    return _train(loop, model, _regression(model))


class TinyParams(nn.Module):
    """A thousand scalar params (per-feature gains, as some models keep them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gains = nn.ParameterList(nn.Parameter(torch.tensor(1.0 + i / 1000)) for i in range(1000))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gains = torch.stack(list(self.gains)).view(-1, 2).mean(0)
        return self.head(x) * gains


def tiny_params_loop(loop: Loop) -> dict:
    model = TinyParams()
    return _train(loop, model, _regression(model))


# -- module kinds ----------------------------------------------------------------------------------


def lazy_loop(loop: Loop, optimizer_before_dry_run: bool) -> dict:
    """``nn.LazyLinear``/``LazyConv1d`` materialized by a dry run; the torch optimizer built
    before or after it, the wrapper after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConv1d(3, 3), nn.Flatten(), nn.LazyLinear(8), nn.Tanh(), nn.LazyLinear(2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2) if optimizer_before_dry_run else None
    model(torch.zeros(1, 1, 6))
    params = list(model.parameters())
    opt = loop.wrap(optimizer or torch.optim.Adam(params, lr=1e-2), model)
    for step in range(3):
        loop.zero_grad(opt)
        loop.backward(
            opt, params, lambda i, step=step: F.mse_loss(model(_xy(step, i)[0][:, None]), _xy(step, i)[1])
        )
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


class Plain(nn.Module):
    """SmallNet without BatchNorm (scripting and tracing keep it as it is), with a param of the
    root read directly (a ``get_attr`` node once traced by ``torch.fx``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 12)
        self.last = nn.Linear(12, 2)
        self.scale = nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x))) * self.scale


def scripted_loop(loop: Loop, kind: str) -> dict:
    """A scripted or traced model, or an ``fx.GraphModule``; a ``ScriptModule`` runs no Python
    hooks, so it is trained without ``model=`` (as its refusal as ``model=`` says)."""
    model = Plain()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "script":
            converted = torch.jit.script(model)
        elif kind == "trace":
            converted = torch.jit.trace(model, torch.zeros(1, 6))
        else:
            converted = torch.fx.symbolic_trace(model)
    return _train(loop, converted, _regression(converted), attach=kind == "fx")


class WithScriptedBlock(nn.Module):
    """An eager model with a scripted block and a traced head inside."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            block = nn.Sequential(nn.Linear(8, 40), nn.Tanh(), nn.Linear(40, 8))  # buckets of its own
            self.block = torch.jit.script(block)
            self.head = torch.jit.trace(nn.Linear(8, 2), torch.zeros(1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(torch.tanh(self.embed(x)))))


def scripted_submodule_loop(loop: Loop) -> dict:
    """The scripted block reads its params in TorchScript, where neither a hook of its own nor
    the read guard runs: its eager parent waits for them."""
    model = WithScriptedBlock()
    return _train(loop, model, _regression(model), steps=4)


class LowRank(nn.Module):
    """A parametrization with params of its own: LoRA as ``register_parametrization`` (minLoRA)."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.randn(width, rank) / 4)
        self.up = nn.Parameter(torch.randn(rank, width) / 4)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.down @ self.up


class Parametrized(nn.Module):
    """Layers for parametrizations; ``low_rank`` gets a frozen weight and a LoRA
    parametrization before wrapping, always."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 8)
        self.middle = nn.Linear(8, 8)
        self.square = nn.Linear(8, 8)
        self.low_rank = nn.Linear(8, 8)
        parametrize.register_parametrization(self.low_rank, "weight", LowRank(8))
        self.low_rank.parametrizations.weight.original.requires_grad_(False)
        self.legacy = nn.Linear(8, 8)
        self.legacy_spectral = nn.Linear(8, 8)
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.first, self.middle, self.square, self.low_rank, self.legacy, self.legacy_spectral):
            x = torch.tanh(layer(x))
        return self.last(x)


def _parametrize(model: Parametrized) -> None:
    parametrizations.weight_norm(model.first)
    parametrizations.spectral_norm(model.middle)
    parametrizations.orthogonal(model.square)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still in older models
        torch.nn.utils.weight_norm(model.legacy)
        torch.nn.utils.spectral_norm(model.legacy_spectral)


def parametrized_loop(loop: Loop, after_wrapping: bool) -> dict:
    """weight_norm, spectral_norm and orthogonal (and the old hook-based weight_norm and
    spectral_norm) registered before wrapping, or after wrapping and one step: then torch's
    optimizer keeps the replaced weight_norm weights (no longer used, never stepped) and not
    their new ``original0``/``original1`` or ``weight_g``/``weight_v``, spectral_norm and
    orthogonal rewrite their original in place, and the old spectral_norm renames its weight
    ``weight_orig``."""
    model = Parametrized()
    if not after_wrapping:
        _parametrize(model)
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.Adam(params, lr=1e-2), model)
    loss_of = _regression(model)
    for step in range(4):
        if after_wrapping and step == 1:
            _parametrize(model)
        loop.zero_grad(opt)
        loop.backward(opt, params, loss_of(step), module=model)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model), "buffers": [b.clone() for b in model.buffers()]}


class Attention(nn.Module):
    """``nn.MultiheadAttention`` with kdim/vdim (separate q, k, v weights) and batch_first, one
    with learned key and value biases (``add_bias_kv``) and sequence first, and an
    encoder-decoder ``nn.Transformer`` with causal and padding masks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attention = nn.MultiheadAttention(8, 2, kdim=6, vdim=5, batch_first=True)
        self.biased = nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True)
        self.embed = nn.Linear(6, 8)
        self.transformer = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = self.embed(x)
        attended, _ = self.attention(query, x, x[..., :5], need_weights=False)
        sequence_first = attended.transpose(0, 1)
        attended = attended + self.biased(sequence_first, sequence_first, sequence_first)[0].transpose(0, 1)
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[:, -1] = True
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        out = self.transformer(query, attended, tgt_mask=causal, src_key_padding_mask=padding)
        return self.head(out.mean(1))


def attention_loop(loop: Loop) -> dict:
    model = Attention()

    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        def loss(index: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(10 * step + index)
            x, y = torch.randn(SLICE, 5, 6, generator=generator), torch.randn(SLICE, 2, generator=generator)
            return F.mse_loss(model(x), y)

        return loss

    return _train(loop, model, loss_of)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(6, 8, num_layers=2, proj_size=3, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(6, 4, bidirectional=True)
        self.head = nn.Linear(14, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        gru_out, _ = self.gru(x.transpose(0, 1))
        return self.head(torch.cat([out[:, -1], gru_out[-1]], dim=-1))


def recurrent_loop(loop: Loop) -> dict:
    model = Recurrent()

    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        def loss(index: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(10 * step + index)
            x, y = torch.randn(SLICE, 4, 6, generator=generator), torch.randn(SLICE, 2, generator=generator)
            return F.mse_loss(model(x), y)

        return loss

    return _train(loop, model, loss_of)


class Convolutions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.grouped = nn.Conv2d(4, 8, 3, groups=2, dilation=2, padding=2)
        self.depthwise = nn.Conv2d(8, 8, 3, groups=8, padding=1, bias=False)
        self.up = nn.ConvTranspose2d(8, 3, 3, stride=2, padding=1, output_padding=1, groups=1)
        self.grouped_up = nn.ConvTranspose1d(4, 4, 2, stride=2, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = self.up(torch.relu(self.depthwise(torch.relu(self.grouped(x)))))
        line = self.grouped_up(x.mean(-1))
        return image.mean((1, 2, 3))[:, None] + line.mean((1, 2))[:, None]


def convolution_loop(loop: Loop) -> dict:
    model = Convolutions()

    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        def loss(index: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(10 * step + index)
            x, y = (
                torch.randn(SLICE, 4, 6, 6, generator=generator),
                torch.randn(SLICE, 1, generator=generator),
            )
            return F.mse_loss(model(x), y)

        return loss

    return _train(loop, model, loss_of)


class ScaledMatmul(torch.autograd.Function):
    """``x @ weight.t() * 2`` with the weight saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t() * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight * 2, grad.t() @ x * 2


class Hooked(nn.Module):
    """A full backward hook that halves a module's grad input, a hook on an activation that
    triples its grad, and a custom autograd function that saves its weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 8)
        self.weight = nn.Parameter(torch.randn(2, 8) / 3)
        self.second.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if h.requires_grad:
            h.register_hook(lambda grad: grad * 3)
        return ScaledMatmul.apply(torch.tanh(self.second(h)), self.weight)


def hooked_loop(loop: Loop) -> dict:
    model = Hooked()
    return _train(loop, model, _regression(model))


def checkpoint_sequential_loop(loop: Loop, reentrant: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))

    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        def loss(index: int) -> torch.Tensor:
            x, y = _xy(step, index)
            x = x.requires_grad_(reentrant)  # the reentrant variant needs an input that requires grad
            return F.mse_loss(checkpoint_sequential(model, 2, x, use_reentrant=reentrant), y)

        return loss

    return _train(loop, model, loss_of)


class Containers(nn.Module):
    """``nn.ModuleDict`` and ``nn.ParameterDict``; a block called twice per forward, a branch
    only even steps call, and a layer called through ``.forward`` (no hooks run)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict(
            {
                "embed": nn.Linear(6, 8),
                "shared": nn.Linear(8, 8),
                "rare": nn.Linear(8, 8),
                "direct": nn.Linear(8, 8),
            }
        )
        self.scales = nn.ParameterDict({"a": nn.Parameter(torch.ones(8)), "b": nn.Parameter(torch.zeros(2))})
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        h = torch.tanh(self.layers["embed"](x))
        h = torch.tanh(self.layers["shared"](torch.tanh(self.layers["shared"](h))))
        if use_rare:
            h = self.layers["rare"](h)
        h = self.layers["direct"].forward(h)
        return self.head(h * self.scales["a"]) + self.scales["b"]


class TwoTowers(nn.Module):
    """CLIP-shaped: trained through ``encode_*`` methods, never through ``forward``, with a
    learned temperature owned by the root."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
        self.text = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 4))
        self.logit_scale = nn.Parameter(torch.tensor(1.0))

    def encode_image(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image(x), dim=-1)

    def encode_text(self, y: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(y), dim=-1)


def two_towers_loop(loop: Loop) -> dict:
    model = TwoTowers()

    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        def loss(index: int) -> torch.Tensor:
            x, y = _xy(step, index)
            logits = model.encode_image(x) @ model.encode_text(y).t() * model.logit_scale.exp()
            return F.cross_entropy(logits, torch.arange(len(x)))

        return loss

    return _train(loop, model, loss_of)


def containers_loop(loop: Loop) -> dict:
    model = Containers()

    def loss_of(step: int) -> Callable[[int], torch.Tensor]:
        return lambda index: F.mse_loss(model(_xy(step, index)[0], step % 2 == 0), _xy(step, index)[1])

    return _train(loop, model, loss_of, steps=4)


# -- params changed after wrapping -----------------------------------------------------------------


def replaced_module_loop(loop: Loop) -> dict:
    """``model.last = nn.Linear(...)`` after wrapping and one step: as in torch, the optimizer
    keeps the old layer's params (no longer used, so never stepped again) and the new layer is
    not trained."""
    model = SmallNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(params, lr=1e-2), model)
    for step in range(3):
        if step == 1:
            torch.manual_seed(3)
            model.last = nn.Linear(12, 2)
        loop.zero_grad(opt)
        loop.backward(opt, params, _mse(model, step), module=model)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model), "old": [p.detach().clone() for p in params]}


def init_after_step_loop(loop: Loop) -> dict:
    """``nn.init`` functions on params right after ``step()`` (re-initializing a layer, as
    reset or pruning schemes do), while the step's all-gathers are pending."""
    model = Plain()
    inits = [
        lambda: nn.init.zeros_(model.first.bias),
        lambda: nn.init.orthogonal_(model.first.weight),
        lambda: (nn.init.kaiming_uniform_(model.last.weight, a=1.0), nn.init.constant_(model.last.bias, 0.1)),
    ]

    def after_step(step: int) -> None:
        torch.manual_seed(50 + step)
        inits[step]()

    return _train(loop, model, _regression(model), after_step=after_step)


# -- the fixture -----------------------------------------------------------------------------------


def _jobs() -> dict[str, Callable[[], object]]:
    return {
        "complex": lambda: _modes(complex_loop),
        "complex_reduce_dtype": lambda: _modes(complex_loop, reduce_dtype=torch.float32),
        "complex_clipped": lambda: _modes(lambda loop: complex_loop(loop, max_norm=0.05)),
        "complex_as_real_pairs": lambda: _modes(spectral_loop),
        "fp64": lambda: _modes(fp64_loop),
        "mixed_fp32_bf16": lambda: _modes(mixed_dtype_loop, plain=CastLoop),
        "fp16_scaler_master": lambda: _modes(fp16_scaler_loop, plain=CastLoop, master_dtype=torch.float32),
        "shapes": lambda: _modes(shapes_loop),
        "shapes_auto_buckets": lambda: _modes(shapes_loop, bucket_size_mb=None),
        "tiny_params": lambda: _modes(tiny_params_loop, bucket_size_mb=None),
        "lazy_optimizer_after_dry_run": lambda: _modes(lambda loop: lazy_loop(loop, False)),
        "lazy_optimizer_before_dry_run": lambda: _modes(lambda loop: lazy_loop(loop, True)),
        "jit_script": lambda: _modes(lambda loop: scripted_loop(loop, "script")),
        "jit_trace": lambda: _modes(lambda loop: scripted_loop(loop, "trace")),
        "scripted_submodule": lambda: _modes(scripted_submodule_loop),
        "fx_symbolic_trace": lambda: _modes(lambda loop: scripted_loop(loop, "fx")),
        "parametrized_before": lambda: _modes(lambda loop: parametrized_loop(loop, False), model_free=False),
        "parametrized_after": lambda: _modes(lambda loop: parametrized_loop(loop, True), model_free=False),
        "attention": lambda: _modes(attention_loop),
        "recurrent": lambda: _modes(recurrent_loop),
        "convolutions": lambda: _modes(convolution_loop),
        "hooked": lambda: _modes(hooked_loop),
        "checkpoint_sequential": lambda: _modes(lambda loop: checkpoint_sequential_loop(loop, False)),
        "checkpoint_sequential_reentrant": lambda: _modes(
            lambda loop: checkpoint_sequential_loop(loop, True)
        ),
        "containers": lambda: _modes(containers_loop),
        "two_towers": lambda: _modes(two_towers_loop),
        "replaced_module": lambda: _modes(replaced_module_loop, model_free=False),
        "init_after_step": lambda: _modes(init_after_step_loop),
    }


THREE_RANK_JOBS = ("complex", "shapes", "mixed_fp32_bf16", "fp16_scaler_master", "scripted_submodule")
"""Loops run on 3 ranks too: shards then split params at other offsets."""


def _run_all(names: tuple[str, ...] | None = None) -> dict[str, object]:
    return run_loop_jobs(_jobs(), names)


outcomes, outcomes_on_three = loop_outcome_fixtures(_run_all, THREE_RANK_JOBS)


@pytest.mark.parametrize("name", sorted(_jobs()))
def test_param_kind_matches_plain_torch(outcomes, name: str) -> None:
    assert_matches_plain(outcomes, name)


@pytest.mark.parametrize("name", THREE_RANK_JOBS)
def test_param_kind_on_three_ranks_matches_plain_torch(outcomes_on_three, name: str) -> None:
    assert_matches_plain(outcomes_on_three, name)


# -- refused at once -------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_uninitialized_lazy_params_are_refused_naming_a_dry_run(single_rank_group, optimizer_first) -> None:
    """Their shape is unknown until the first forward, so they cannot be laid out (torch's own
    optimizer accepts them and steps them once a forward has materialized them)."""
    model = nn.Sequential(nn.Linear(6, 4), nn.LazyLinear(2))
    optimizer = torch.optim.Adam(model.parameters())
    if optimizer_first:
        model(torch.zeros(1, 6))  # materialized after the torch optimizer was built: accepted
        ShardingStage1(optimizer, model=model).close()
        return
    with pytest.raises(ValueError, match=r"param 2 \(group 0\) is an uninitialized param.*model\(sample\)"):
        ShardingStage1(optimizer, model=model)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("attach_later", [False, True])
@pytest.mark.parametrize("convert", ["script", "trace"])
def test_scripted_model_is_refused_naming_the_ways(single_rank_group, attach_later, convert) -> None:
    """A ScriptModule takes no Python hooks; without model= it trains (job ``jit_script``)."""
    eager = Plain()
    model = torch.jit.script(eager) if convert == "script" else torch.jit.trace(eager, torch.zeros(1, 6))
    optimizer = torch.optim.Adam(model.parameters())
    message = r"expects an eager nn.Module but got a .*Leave model= out.*script only its submodules"
    if attach_later:
        with ShardingStage1(optimizer, overlap=True) as opt, pytest.raises(TypeError, match=message):
            opt.attach(model)
    else:
        with pytest.raises(TypeError, match=message):
            ShardingStage1(optimizer, overlap=True, model=model)


@pytest.mark.parametrize("overlap", [False, True])
def test_model_cast_to_float64_after_wrapping_fails_at_the_next_step(single_rank_group, overlap) -> None:
    model = Plain()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters()), overlap=overlap, model=model)
    model.to(torch.float64)
    model(torch.zeros(2, 6, dtype=torch.float64)).sum().backward()
    with pytest.raises(
        RuntimeError, match=r"is now torch.float64 but was laid out as torch.float32.*before building"
    ):
        opt.step()


def test_param_whose_elements_share_memory_is_refused_naming_clone(single_rank_group) -> None:
    """torch.optim refuses to update it in place at its first step; laid out, each element
    would have got memory of its own and trained apart, silently."""
    shared = nn.Parameter(torch.randn(1, 4).expand(3, 4))
    with pytest.raises(ValueError, match=r"param 1 .* strides \[0, 1\].*share memory.*\.clone\(\)"):
        ShardingStage1(torch.optim.Adam([nn.Parameter(torch.ones(2)), shared]))


def test_params_sharing_memory_are_refused_naming_one_parameter(single_rank_group) -> None:
    """A decoder "tied" to its encoder as ``nn.Parameter(enc.weight.t())``: torch updates the
    shared memory once per param and they stay tied; laid out, they drifted apart (3.3e-2 off
    after three SGD steps)."""
    encoder, decoder = nn.Linear(6, 3), nn.Linear(3, 6)
    decoder.weight = nn.Parameter(encoder.weight.t())
    params = [*encoder.parameters(), *decoder.parameters()]
    with pytest.raises(ValueError, match=r"params 0 and 2 share memory.*decoder.weight = encoder.weight"):
        ShardingStage1(torch.optim.SGD(params, lr=0.1))


def test_params_that_are_disjoint_views_of_one_tensor_are_accepted(single_rank_group) -> None:
    """Chunks and interleaved columns of one tensor share a storage but no element."""
    base = torch.randn(4, 6)
    params = [
        nn.Parameter(base[:2]),
        nn.Parameter(base[2:]),
        nn.Parameter(base[:, ::2]),
        nn.Parameter(base[:, 1::2]),
    ]
    ShardingStage1(torch.optim.SGD(params[:2], lr=0.1)).close()
    ShardingStage1(torch.optim.SGD(params[2:], lr=0.1)).close()


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_params_without_master_are_scaled_as_torch_does(single_rank_group, fused) -> None:
    """torch.amp.GradScaler refuses fp16 grads unless the optimizer is fused (its kernels
    unscale in fp32); the wrapper follows, naming an fp32 master copy."""
    model = Plain().half()
    opt = ShardingStage1(torch.optim.Adam(model.parameters(), fused=fused))
    scaler = ShardedGradScaler("cpu")
    scaler.scale(model(torch.ones(2, 6, dtype=torch.float16)).float().sum()).backward()
    if fused:
        scaler.step(opt)
        return
    with pytest.raises(ValueError, match=r"unscale FP16 gradients.*master_dtype=torch.float32"):
        scaler.step(opt)
    with pytest.raises(ValueError, match=r"unscale FP16 gradients.*master_dtype=torch.float32"):
        scaler.unscale_(opt)


def test_model_weights_round_trip_through_safetensors_save_file(single_rank_group, tmp_path) -> None:
    """The way the README names for safetensors (``save_model`` refuses params that are views of
    a shared storage); the file holds only the params, not their buckets' padding."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = Plain()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters(), lr=0.1), overlap=True, model=model)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), path)
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(safetensors_torch.load_file(path))
    torch.testing.assert_close(dict(model.named_parameters()), saved, rtol=0, atol=0)
    assert path.stat().st_size < 1024 + 4 * sum(p.numel() for p in saved.values())
