"""Training loops from other domains, written the way their users write them (the third round of
user loops, on the harness of ``tests/harness/user_loops.py``): vision (a ResNet-style CNN with BatchNorm,
``channels_last``, bf16 autocast, mixup, label smoothing and SWA; ``channels_last`` after wrapping;
adversarial training; pruning), self-supervised and contrastive learning (a MoCo/BYOL momentum
encoder, DINO, SimCLR over the differentiable ``all_gather``, OpenCLIP's gather without grad),
sequences (an LSTM language model with packed sequences, a tied decoder and truncated BPTT; an RNN
made orthogonal after wrapping), reinforcement learning (actor-critic with one or two optimizers
and two backwards of one graph, target networks, PPO), ``torch.func`` (MAML, Reptile,
``functional_call`` and per-sample grads right after ``step()``, an ensemble from
``stack_module_state``) and distillation from a frozen teacher.

Each loop runs plain (one process, every slice), sharded sync, sharded overlap with the model
attached, and sharded overlap without a model; all loops of a world size run in one spawn.
Loops that touch params between ``step()`` and the next forward run with all-gathers that land
only when waited for, so any read that does not wait sees last step's weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.optim import swa_utils

from sharded_opt import ShardingStage1
from sharded_opt.comm import collectives
from tests.harness.differential import _average
from tests.harness.user_loops import (
    SLICE,
    BufferLoop,
    Loop,
    ModelFreeLoop,
    _average_grads,
    _late_all_gather,
    _snapshot,
    assert_matches_plain,
    loop_outcome_fixtures,
    run_loop_jobs,
)

CLASSES = 5


def _modes(
    loop_fn: Callable[[Loop], object], late_gathers: bool = True, model_free: bool = True
) -> dict[str, object]:
    """``loop_fn`` plain, sharded sync, overlap with the model attached and (``model_free``)
    overlap without; ``late_gathers``: all-gathers land only when waited for. Loops whose every
    rank reads BatchNorm running statistics (an evaluation forward on every rank) run without
    the model-free mode: with no model to attach there is no broadcast of buffers from rank 0,
    as the README says, so each rank keeps its own statistics."""
    with (
        mock.patch.object(collectives, "all_gather", _late_all_gather)
        if late_gathers
        else contextlib.nullcontext()
    ):
        results = {
            "plain": loop_fn(BufferLoop(False, False)),
            "sync": loop_fn(BufferLoop(True, False)),
            "overlap": loop_fn(BufferLoop(True, True)),
        }
        if model_free:
            results["overlap_no_model"] = loop_fn(ModelFreeLoop(True, True))
        return results


# -- vision ----------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width // stride, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut = nn.Sequential()
        if stride != 1:
            self.shortcut = nn.Sequential(
                nn.Conv2d(width // stride, width, 1, stride, bias=False), nn.BatchNorm2d(width)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.layer1 = BasicBlock(4, 1)
        self.layer2 = BasicBlock(8, 2)
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _with_reference_convs(fn: Callable) -> Callable:
    """Run ``fn`` with torch's oneDNN convolutions turned off.

    On the AVX2-only CPUs CI runs on (AMD EPYC, torch 2.13.0 CPU build, oneDNN 3.12), the weight
    grad of a 1x1, stride-2 convolution on a channels_last input, as in TinyResNet's shortcut,
    is wrong in plain torch (13 off against a float64 reference, a different value each call) and
    the heap gets corrupted ("double free or corruption"). The comparisons here are of the
    wrapper against plain torch, so both run torch's reference convolutions instead."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.backends.mkldnn.flags(enabled=False):
            return fn(*args, **kwargs)

    return wrapped


def _images(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + index)
    images = torch.randn(SLICE, 3, 8, 8, generator=generator).contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, CLASSES, (SLICE,), generator=generator)


def _mixup(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """timm/torchvision-style mixup within the slice: a Beta-drawn weight, a permuted partner."""
    images, labels = _images(step, index)
    generator = torch.Generator().manual_seed(77 + 1000 * step + index)
    lam = float(torch.rand((), generator=generator))
    order = torch.randperm(SLICE, generator=generator)
    return lam * images + (1 - lam) * images[order], labels, labels[order], lam


@_with_reference_convs
def vision_loop(loop: Loop) -> dict:
    """CIFAR recipe: SGD with nesterov and weight decay, channels_last, bf16 autocast, mixup
    with label smoothing, an evaluation in ``model.eval()`` on rank 0 after each step; from
    step 3 SWA (``AveragedModel`` updated right after ``step()``, ``SWALR`` on the optimizer),
    and ``update_bn`` over a loader at the end."""
    model = TinyResNet().to(memory_format=torch.channels_last)
    params = list(model.parameters())
    opt = loop.wrap(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4), model
    )
    swa_model = swa_utils.AveragedModel(model)
    swa_scheduler = swa_utils.SWALR(opt, swa_lr=0.02, anneal_epochs=2)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    evals = []
    for step in range(5):
        model.train()
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            mixed, labels_a, labels_b, lam = _mixup(step, index)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(mixed)
            return lam * criterion(logits.float(), labels_a) + (1 - lam) * criterion(logits.float(), labels_b)

        loop.backward(opt, params, loss_of, module=model)
        opt.step()
        if step >= 3:
            swa_model.update_parameters(model)
            swa_scheduler.step()
        if loop.rank == 0:
            model.eval()
            with torch.no_grad():
                evals.append(model(_images(99, 0)[0]))
    loop.sync(opt)
    swa_utils.update_bn([_images(50 + i, 0)[0] for i in range(2)], swa_model)
    return {
        "params": _snapshot(model),
        "swa": _snapshot(swa_model.module),
        "swa_buffers": [b.clone() for b in swa_model.module.buffers()],
        "evals": evals,
        "lrs": [g["lr"] for g in opt.param_groups],
    }


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16))
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(torch.relu(self.body(x))), dim=1)


def momentum_encoder_loop(loop: Loop) -> dict:
    """MoCo: the key encoder a deepcopy of the query encoder, frozen, updated right after
    ``step()`` as ``k.data = k.data * m + q.data * (1 - m)`` (BYOL's ``mul_().add_()`` on the
    second half of the params); InfoNCE over the slice's keys."""
    query = Encoder()
    key = copy.deepcopy(query).requires_grad_(False)
    params = list(query.parameters())
    opt = loop.wrap(torch.optim.SGD(query.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4), query)
    half = len(params) // 2
    for step in range(4):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            generator = torch.Generator().manual_seed(10 * step + index)
            x = torch.randn(SLICE, 6, generator=generator)
            q = query(x + 0.1 * torch.randn(SLICE, 6, generator=generator))
            with torch.no_grad():
                k = key(x + 0.1 * torch.randn(SLICE, 6, generator=generator))
            return F.cross_entropy(q @ k.t() / 0.2, torch.arange(SLICE))

        loop.backward(opt, params, loss_of)
        opt.step()
        with torch.no_grad():
            for i, (k, q) in enumerate(zip(key.parameters(), query.parameters(), strict=True)):
                if i < half:
                    k.data = k.data * 0.9 + q.data * 0.1
                else:
                    k.data.mul_(0.9).add_(q.data, alpha=0.1)
    loop.sync(opt)
    return {"params": _snapshot(query), "key": _snapshot(key)}


# -- sequence --------------------------------------------------------------------------------------

TOKENS, PAD = 13, 0


class LSTMLanguageModel(nn.Module):
    """word_language_model-style: embedding, dropout, LSTM, decoder tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Embedding(TOKENS, 8, padding_idx=PAD)
        self.drop = nn.Dropout(0.2)
        self.rnn = nn.LSTM(8, 8, num_layers=2, batch_first=True, dropout=0.2)
        self.decoder = nn.Linear(8, TOKENS)
        self.decoder.weight = self.encoder.weight

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, hidden):
        packed = pack_padded_sequence(
            self.drop(self.encoder(ids)), lengths, batch_first=True, enforce_sorted=False
        )
        out, hidden = self.rnn(packed, hidden)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        return self.decoder(self.drop(out)), hidden


def lstm_lm_loop(loop: Loop) -> dict:
    """Truncated BPTT with the hidden state carried and detached between steps, padded
    sequences packed, the grad norm clipped, the lr annealed by hand."""
    model = LSTMLanguageModel()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.5), model)
    hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    norms = []
    for step in range(4):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            torch.manual_seed(5 + 10 * step + index)
            generator = torch.Generator().manual_seed(10 * step + index)
            ids = torch.randint(1, TOKENS, (SLICE, 7), generator=generator)
            lengths = torch.randint(3, 7, (SLICE,), generator=generator)
            ids[torch.arange(7) > lengths[:, None]] = PAD
            logits, state = model(ids[:, :-1], lengths, hidden.get(index))
            hidden[index] = (state[0].detach(), state[1].detach())
            return F.cross_entropy(logits.reshape(-1, TOKENS), ids[:, 1:].reshape(-1), ignore_index=PAD)

        loop.backward(opt, params, loss_of)
        norms.append(loop.clip(opt, params, 0.25))
        opt.step()
        if step == 2:
            for group in opt.param_groups:
                group["lr"] /= 4.0
    loop.sync(opt)
    return {"params": _snapshot(model), "norms": norms, "tied": model.decoder.weight is model.encoder.weight}


# -- reinforcement learning ------------------------------------------------------------------------


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.actor = nn.Linear(16, 4)
        self.critic = nn.Linear(16, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.distributions.Categorical, torch.Tensor]:
        h = self.body(obs)
        return torch.distributions.Categorical(logits=self.actor(h)), self.critic(h).squeeze(-1)


def _rollout(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * step + index)
    obs = torch.randn(SLICE, 6, generator=generator)
    return obs, torch.randint(0, 4, (SLICE,), generator=generator), torch.randn(SLICE, generator=generator)


def actor_critic_loop(loop: Loop, two_backwards: bool) -> dict:
    """A2C: body and actor under a wrapped Adam, the critic under a plain RMSprop whose grads
    are averaged by hand; the advantage detached, an entropy bonus. Either one backward of the
    summed losses, or the actor loss backpropagated with ``retain_graph=True`` and then the
    critic loss through the same graph."""
    model = ActorCritic()
    params = list(model.parameters())
    critic = list(model.critic.parameters())
    shared = [p for p in params if all(p is not c for c in critic)]
    opt_actor = loop.wrap(torch.optim.Adam(shared, lr=1e-2), model)
    opt_critic = torch.optim.RMSprop(critic, lr=1e-2)
    losses: dict[int, torch.Tensor] = {}
    for step in range(4):
        loop.zero_grad(opt_actor)
        if loop.sharded:
            opt_critic.zero_grad()
        else:
            loop.zero_grad(opt_critic)

        def actor_loss(index: int, step: int = step) -> torch.Tensor:
            obs, actions, returns = _rollout(step, index)
            dist_, values = model(obs)
            advantage = returns - values
            actor = -(dist_.log_prob(actions) * advantage.detach()).mean() - 0.01 * dist_.entropy().mean()
            critic_loss = advantage.square().mean()
            if not two_backwards:
                return actor + 0.5 * critic_loss
            losses[index] = 0.5 * critic_loss
            return actor

        loop.backward(opt_actor, params, actor_loss, retain_graph=two_backwards)
        if two_backwards:
            loop.backward(opt_actor, params, lambda index: losses.pop(index))
        if loop.sharded:
            _average_grads(critic)
        opt_actor.step()
        opt_critic.step()
    loop.sync(opt_actor)
    return {"params": _snapshot(model)}


# -- torch.func ------------------------------------------------------------------------------------


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(1, 16)
        self.second = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.second(torch.relu(self.first(x)))))


def _sine_task(step: int, index: int, shots: int = 5) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(10 * step + index)
    amplitude, phase = (
        0.5 + 4.5 * torch.rand((), generator=generator),
        3.0 * torch.rand((), generator=generator),
    )
    x = 10 * torch.rand(2 * shots, 1, generator=generator) - 5
    y = amplitude * torch.sin(x + phase)
    return x[:shots], y[:shots], x[shots:], y[shots:]


def maml_loop(loop: Loop) -> dict:
    """MAML on sine regression: two inner SGD steps from ``torch.autograd.grad(...,
    create_graph=True)`` applied through ``torch.func.functional_call``, the query loss
    backpropagated (second order) through the wrapped meta-optimizer."""
    model = Regressor()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    for step in range(3):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            x_support, y_support, x_query, y_query = _sine_task(step, index)
            fast = dict(model.named_parameters())
            for _ in range(2):
                inner = F.mse_loss(torch.func.functional_call(model, fast, (x_support,)), y_support)
                grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
                fast = {name: p - 0.01 * g for (name, p), g in zip(fast.items(), grads, strict=True)}
            return F.mse_loss(torch.func.functional_call(model, fast, (x_query,)), y_query)

        loop.backward(opt, params, loss_of)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


def functional_reads_loop(loop: Loop) -> dict:
    """Right after ``step()``: ``functional_call`` with the model's own params (detached) and
    with perturbed ones, and per-sample grad norms from ``torch.func.vmap(torch.func.grad)``
    for logging; none of it may see last step's weights."""
    model = Regressor()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    logs = []

    def per_sample_loss(weights: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, weights, (x[None],)), y[None])

    per_sample_grads = torch.func.vmap(torch.func.grad(per_sample_loss), in_dims=(None, 0, 0))
    for step in range(3):
        loop.zero_grad(opt)
        loop.backward(
            opt,
            params,
            lambda index, step=step: F.mse_loss(
                model(_sine_task(step, index)[0]), _sine_task(step, index)[1]
            ),
        )
        opt.step()
        x, y = _sine_task(50 + step, 0)[:2]
        weights = {name: p.detach() for name, p in model.named_parameters()}
        logs.append(torch.func.functional_call(model, weights, (x,)))
        noisy = {name: p + 0.01 for name, p in model.named_parameters()}
        with torch.no_grad():
            logs.append(torch.func.functional_call(model, noisy, (x,)))
        grads = per_sample_grads(weights, x, y)
        logs.append(torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]))
    loop.sync(opt)
    return {"params": _snapshot(model), "logs": [t.detach() for t in logs]}


def reptile_loop(loop: Loop) -> dict:
    """Reptile: a copy of the model trained for a few plain SGD steps on this rank's task, then
    the meta-grad assigned by hand (``p.grad = p.data - fast.data``) and the wrapped meta-step;
    no backward ever reaches the wrapped model's params."""
    model = Regressor()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.Adam(model.parameters(), lr=1e-2), model)

    def meta_grads(step: int, index: int) -> list[torch.Tensor]:
        fast = copy.deepcopy(model)
        inner = torch.optim.SGD(fast.parameters(), lr=0.02)
        x, y = _sine_task(step, index)[:2]
        for _ in range(3):
            inner.zero_grad()
            F.mse_loss(fast(x), y).backward()
            inner.step()
        return [p.data - q.data for p, q in zip(model.parameters(), fast.parameters(), strict=True)]

    for step in range(3):
        opt.zero_grad()
        if loop.sharded:
            grads = meta_grads(step, loop.rank)
        else:
            per_slice = [meta_grads(step, index) for index in range(loop.world_size)]
            grads = [_average(list(g), g[0].dtype, loop.world_size) for g in zip(*per_slice, strict=True)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


def target_network_loop(loop: Loop) -> dict:
    """DQN/SAC: a target network updated right after ``step()``, by Polyak averaging with
    ``torch._foreach_lerp_`` on the param lists (TD3/SAC implementations) and every second
    step by ``load_state_dict(online.state_dict())``; the TD target from the target network."""
    online = Regressor()
    target = copy.deepcopy(online).requires_grad_(False)
    params = list(online.parameters())
    opt = loop.wrap(torch.optim.Adam(online.parameters(), lr=1e-2), online)
    for step in range(4):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            x, y, x_next, _ = _sine_task(step, index)
            with torch.no_grad():
                td_target = y + 0.9 * target(x_next)
            return F.smooth_l1_loss(online(x), td_target)

        loop.backward(opt, params, loss_of)
        opt.step()
        if step % 2 == 0:
            with torch.no_grad():
                torch._foreach_lerp_(list(target.parameters()), list(online.parameters()), 0.05)
        else:
            target.load_state_dict(online.state_dict())
    loop.sync(opt)
    return {"params": _snapshot(online), "target": _snapshot(target)}


def actor_critic_both_wrapped_loop(loop: Loop) -> dict:
    """Actor (body and policy head) and critic head each under a wrapped optimizer attached to
    the same model; the actor loss backpropagated with ``retain_graph=True``, then the critic
    loss through the same graph (it reaches the body again)."""
    model = ActorCritic()
    params = list(model.parameters())
    critic = list(model.critic.parameters())
    shared = [p for p in params if all(p is not c for c in critic)]
    opt_actor = loop.wrap(torch.optim.Adam(shared, lr=1e-2), model)
    opt_critic = loop.wrap(torch.optim.Adam(critic, lr=1e-2), model)
    losses: dict[int, torch.Tensor] = {}
    for step in range(3):
        loop.zero_grad(opt_actor)
        loop.zero_grad(opt_critic)

        def actor_loss(index: int, step: int = step) -> torch.Tensor:
            obs, actions, returns = _rollout(step, index)
            policy, values = model(obs)
            advantage = returns - values
            losses[index] = advantage.square().mean()
            return -(policy.log_prob(actions) * advantage.detach()).mean() - 0.01 * policy.entropy().mean()

        loop.backward(opt_actor, params, actor_loss, retain_graph=True)
        loop.backward(opt_critic, params, lambda index: losses.pop(index))
        opt_actor.step()
        opt_critic.step()
    loop.sync(opt_actor)
    loop.sync(opt_critic)
    return {"params": _snapshot(model)}


@_with_reference_convs
def channels_last_after_wrapping_loop(loop: Loop) -> dict:
    """``model.to(memory_format=torch.channels_last)`` after the optimizer was wrapped (it sets
    ``param.data`` of every conv weight to a channels_last copy)."""
    model = TinyResNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    model.to(memory_format=torch.channels_last)
    for step in range(3):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            images, labels = _images(step, index)
            return F.cross_entropy(model(images), labels)

        loop.backward(opt, params, loss_of, module=model)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


@_with_reference_convs
def adversarial_loop(loop: Loop) -> dict:
    """Madry-style adversarial training: a two-step PGD attack on the inputs in ``model.eval()``
    from ``torch.autograd.grad(loss, x)`` (no param grads), then a training step on the
    perturbed batch; params' grads clamped by hooks registered on them (``p.register_hook``)."""
    model = TinyResNet()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4), model)
    for p in params:
        p.register_hook(lambda grad: grad.clamp(-0.5, 0.5))
    for step in range(3):

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            images, labels = _images(step, index)
            model.eval()
            attacked = images.clone()
            for _ in range(2):
                attacked.requires_grad_(True)
                (grad,) = torch.autograd.grad(F.cross_entropy(model(attacked), labels), attacked)
                attacked = (attacked.detach() + 0.05 * grad.sign()).clamp(images - 0.1, images + 0.1)
            model.train()
            return F.cross_entropy(model(attacked), labels)

        loop.zero_grad(opt)
        loop.backward(opt, params, loss_of, module=model)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


def ensemble_loop(loop: Loop) -> dict:
    """An ensemble trained as one: ``torch.func.stack_module_state`` stacks three models'
    params into plain tensors (not ``nn.Parameter``), ``vmap(functional_call)`` runs them on
    the batch, and the optimizer (no model to attach) steps the stacked tensors."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)) for _ in range(3)]
    weights, buffers = torch.func.stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    params = list(weights.values())
    opt = loop.wrap(torch.optim.Adam(params, lr=1e-2), None)

    def ensemble(x: torch.Tensor) -> torch.Tensor:
        call = lambda w, b, x: torch.func.functional_call(base, (w, b), (x,))  # noqa: E731
        return torch.func.vmap(call, in_dims=(0, 0, None))(weights, buffers, x)

    for step in range(3):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            generator = torch.Generator().manual_seed(10 * step + index)
            x, y = torch.randn(SLICE, 6, generator=generator), torch.randn(SLICE, 2, generator=generator)
            return F.mse_loss(ensemble(x), y.expand(3, -1, -1))

        loop.backward(opt, params, loss_of)
        opt.step()
    loop.sync(opt)
    return {"params": [p.detach().clone() for p in params]}


def pruning_loop(loop: Loop) -> dict:
    """Iterative magnitude pruning after wrapping: ``torch.nn.utils.prune.l1_unstructured``
    (the weight becomes ``weight_orig`` times a mask in a forward pre-hook), fine-tuning,
    global pruning of two layers, then ``prune.remove`` (``orig.data = pruned``) and more
    training."""
    from torch.nn.utils import prune

    model = Regressor()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    for step in range(6):
        if step == 1:
            prune.l1_unstructured(model.second, "weight", amount=0.3)
        elif step == 3:
            prune.global_unstructured(
                [(model.first, "weight"), (model.head, "weight")], prune.L1Unstructured, amount=0.4
            )
        elif step == 5:
            for module in (model.first, model.second, model.head):
                prune.remove(module, "weight")
        loop.zero_grad(opt)
        loop.backward(
            opt,
            params,
            lambda index, step=step: F.mse_loss(
                model(_sine_task(step, index)[0]), _sine_task(step, index)[1]
            ),
        )
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- distillation, contrastive ---------------------------------------------------------------------


def distillation_loop(loop: Loop) -> dict:
    """A frozen teacher in eval mode (another model, no shared params, its BatchNorm using
    running stats); KL at temperature 2 plus hard-label cross entropy; AdamW on the student."""
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, CLASSES))
    teacher.eval().requires_grad_(False)
    torch.manual_seed(2)
    student = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, CLASSES))
    params = list(student.parameters())
    opt = loop.wrap(torch.optim.AdamW(student.parameters(), lr=1e-2), student)
    for step in range(4):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            generator = torch.Generator().manual_seed(10 * step + index)
            x, labels = (
                torch.randn(SLICE, 6, generator=generator),
                torch.randint(0, CLASSES, (SLICE,), generator=generator),
            )
            with torch.no_grad():
                soft = F.softmax(teacher(x) / 2.0, dim=-1)
            logits = student(x)
            kl = F.kl_div(F.log_softmax(logits / 2.0, dim=-1), soft, reduction="batchmean") * 4.0
            return 0.7 * kl + 0.3 * F.cross_entropy(logits, labels)

        loop.backward(opt, params, loss_of)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(student)}


def contrastive_loop(loop: Loop) -> dict:
    """SimCLR/CLIP-style: two views' embeddings gathered from every rank with the
    differentiable ``torch.distributed.nn.functional.all_gather``, the NT-Xent loss of this
    rank's rows against all columns (labels offset by rank). The plain reference computes every
    slice's embeddings with grad in each slice's loss, so the averaged grads are those of the
    mean of the per-rank losses, which is what the gather's backward (a sum over ranks) and the
    wrapper's average give."""
    encoder = Encoder()
    params = list(encoder.parameters())
    opt = loop.wrap(torch.optim.AdamW(encoder.parameters(), lr=1e-2), encoder)

    def views(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(10 * step + index)
        x = torch.randn(SLICE, 6, generator=generator)
        return x + 0.1 * torch.randn(SLICE, 6, generator=generator), x * 0.9

    for step in range(3):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            if loop.sharded:
                a, b = (encoder(v) for v in views(step, index))
                all_a, all_b = torch.cat(dist_fn.all_gather(a)), torch.cat(dist_fn.all_gather(b))
            else:
                pairs = [[encoder(v) for v in views(step, r)] for r in range(loop.world_size)]
                a, b = pairs[index]
                all_a, all_b = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
            labels = torch.arange(SLICE) + index * SLICE
            return (
                F.cross_entropy(a @ all_b.t() / 0.1, labels) + F.cross_entropy(b @ all_a.t() / 0.1, labels)
            ) / 2

        loop.backward(opt, params, loss_of)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(encoder)}


class TwoTowers(nn.Module):
    """CLIP-shaped: an image and a text tower and a learned temperature (a 0-dim param)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Embedding(TOKENS, 8), nn.Flatten(), nn.Linear(24, 8))
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)


def clip_loop(loop: Loop) -> dict:
    """OpenCLIP's loop with ``gather_with_grad=False``: other ranks' features gathered by the
    plain ``dist.all_gather`` (no grad) with this rank's own features put back in their place,
    ``logit_scale.exp()`` as the temperature, and ``logit_scale.clamp_(0, log 100)`` under
    ``no_grad`` right after ``step()``. The plain reference detaches the other slices'
    features in each slice's loss, as the gather does."""
    model = TwoTowers()
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.2}, {"params": rest, "weight_decay": 0.0}]
    opt = loop.wrap(torch.optim.AdamW(groups, lr=5e-2, betas=(0.9, 0.98), eps=1e-6), model)

    def pair(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(10 * step + index)
        return torch.randn(SLICE, 6, generator=generator), torch.randint(
            0, TOKENS, (SLICE, 3), generator=generator
        )

    for step in range(4):
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            image, text = model(*pair(step, index))
            if loop.sharded:
                images = [torch.empty_like(image) for _ in range(loop.world_size)]
                texts = [torch.empty_like(text) for _ in range(loop.world_size)]
                dist.all_gather(images, image)
                dist.all_gather(texts, text)
            else:
                with torch.no_grad():
                    features = [model(*pair(step, r)) for r in range(loop.world_size)]
                images, texts = [f[0] for f in features], [f[1] for f in features]
            images[index], texts[index] = image, text
            logits = model.logit_scale.exp() * image @ torch.cat(texts).t()
            logits_text = model.logit_scale.exp() * text @ torch.cat(images).t()
            labels = torch.arange(SLICE) + index * SLICE
            return (F.cross_entropy(logits, labels) + F.cross_entropy(logits_text, labels)) / 2

        loop.backward(opt, params, loss_of)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 3.0)
    loop.sync(opt)
    return {"params": _snapshot(model)}


class DinoHead(nn.Module):
    """DINO's projection head: an MLP, then a weight-normalized last layer whose norm is frozen
    at 1 (``norm_last_layer``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8))
        self.last_layer = torch.nn.utils.parametrizations.weight_norm(nn.Linear(8, 10, bias=False))
        self.last_layer.parametrizations.weight.original0.data.fill_(1.0)
        self.last_layer.parametrizations.weight.original0.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.backbone(x), dim=-1))


def dino_loop(loop: Loop) -> dict:
    """DINO: two crops through student and EMA teacher, the teacher's outputs centered and
    sharpened, the center updated from every rank's teacher outputs (``dist.all_reduce``);
    during the first two steps the last layer is left out of the update (DINO sets its grads
    to None after backward; in overlap mode, where that is refused, it is frozen before the
    forward, the fix the error names)."""
    student = DinoHead()
    teacher = copy.deepcopy(student).requires_grad_(False)
    params = list(student.parameters())
    last = [p for p in student.last_layer.parameters() if p.requires_grad]
    opt = loop.wrap(torch.optim.AdamW(student.parameters(), lr=1e-2, weight_decay=0.04), student)
    center = torch.zeros(10)

    def crops(step: int, index: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(10 * step + index)
        x = torch.randn(SLICE, 6, generator=generator)
        return [x + 0.2 * torch.randn(SLICE, 6, generator=generator) for _ in range(2)]

    for step in range(4):
        cancel_last = step < 2
        if cancel_last and loop.overlap:
            for p in last:
                p.requires_grad_(False)
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step, center: torch.Tensor = center) -> torch.Tensor:
            views = crops(step, index)
            with torch.no_grad():
                targets = [F.softmax((teacher(v) - center) / 0.04, dim=-1) for v in views]
            outputs = [F.log_softmax(student(v) / 0.1, dim=-1) for v in views]
            terms = [-(targets[i] * outputs[j]).sum(-1).mean() for i in range(2) for j in range(2) if i != j]
            return sum(terms) / len(terms)

        loop.backward(opt, params, loss_of)
        if cancel_last and not loop.overlap:
            for p in last:
                p.grad = None
        opt.step()
        for p in last:
            p.requires_grad_(True)
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters(), strict=True):
                t.data.mul_(0.9).add_(0.1 * s.detach().data)
            slices = loop.slices()
            batch_center = sum(teacher(torch.cat(crops(step, index))).sum(0) for index in slices)
            if loop.sharded:
                dist.all_reduce(batch_center)
            center = center * 0.9 + 0.1 * batch_center / (2 * SLICE * loop.world_size)
    loop.sync(opt)
    return {"params": _snapshot(student), "teacher": _snapshot(teacher), "center": center}


def ppo_loop(loop: Loop) -> dict:
    """PPO (CleanRL-style): a rollout's old log-probs and values under ``no_grad``, then two
    epochs of two minibatches each with normalized advantages, the clipped surrogate, a clipped
    value loss and an entropy bonus, ``clip_grad_norm_(0.5)`` and a linearly annealed lr."""
    model = ActorCritic()
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.Adam(model.parameters(), lr=3e-2, eps=1e-5), model)
    rollouts = {index: _rollout(0, index) for index in range(loop.world_size)}
    with torch.no_grad():
        old = {}
        for index, (obs, actions, _) in rollouts.items():
            policy, values = model(obs)
            old[index] = (policy.log_prob(actions), values)
    norms = []
    for epoch in range(2):
        opt.param_groups[0]["lr"] = 3e-2 * (1 - epoch / 2)
        for minibatch in range(2):
            loop.zero_grad(opt)

            def loss_of(index: int, minibatch: int = minibatch) -> torch.Tensor:
                rows = slice(2 * minibatch, 2 * minibatch + 2)
                obs, actions, returns = (t[rows] for t in rollouts[index])
                old_log_prob, old_values = (t[rows] for t in old[index])
                advantages = returns - old_values
                advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
                policy, values = model(obs)
                ratio = (policy.log_prob(actions) - old_log_prob).exp()
                surrogate = torch.max(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)).mean()
                clipped = old_values + (values - old_values).clamp(-0.2, 0.2)
                value_loss = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2).mean()
                return surrogate + 0.5 * value_loss - 0.01 * policy.entropy().mean()

            loop.backward(opt, params, loss_of)
            norms.append(loop.clip(opt, params, 0.5))
            opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model), "norms": norms}


def orthogonal_rnn_loop(loop: Loop) -> dict:
    """An RNN whose recurrent weight gets ``parametrizations.orthogonal`` after wrapping and
    one step (its original is rewritten in place by ``right_inverse``), trained on."""
    torch.manual_seed(0)
    rnn = nn.RNN(4, 6, batch_first=True)
    head = nn.Linear(6, 1)
    model = nn.ModuleDict({"rnn": rnn, "head": head})
    params = list(model.parameters())
    opt = loop.wrap(torch.optim.RMSprop(model.parameters(), lr=1e-2), model)
    for step in range(4):
        if step == 1:
            torch.nn.utils.parametrizations.orthogonal(rnn, "weight_hh_l0")
        loop.zero_grad(opt)

        def loss_of(index: int, step: int = step) -> torch.Tensor:
            generator = torch.Generator().manual_seed(10 * step + index)
            x, y = torch.randn(SLICE, 5, 4, generator=generator), torch.randn(SLICE, 1, generator=generator)
            out, _ = rnn(x)
            return F.mse_loss(head(out[:, -1]), y)

        loop.backward(opt, params, loss_of)
        opt.step()
    loop.sync(opt)
    return {"params": _snapshot(model)}


# -- the fixture -----------------------------------------------------------------------------------


def _jobs() -> dict[str, Callable[[], object]]:
    return {
        "vision": lambda: _modes(vision_loop),
        "momentum_encoder": lambda: _modes(momentum_encoder_loop),
        "lstm_lm": lambda: _modes(lstm_lm_loop),
        "actor_critic_summed": lambda: _modes(lambda loop: actor_critic_loop(loop, False)),
        "actor_critic_two_backwards": lambda: _modes(lambda loop: actor_critic_loop(loop, True)),
        "maml": lambda: _modes(maml_loop),
        "functional_reads": lambda: _modes(functional_reads_loop),
        "distillation": lambda: _modes(distillation_loop),
        "contrastive": lambda: _modes(contrastive_loop),
        "reptile": lambda: _modes(reptile_loop),
        "target_network": lambda: _modes(target_network_loop),
        "actor_critic_both_wrapped": lambda: _modes(actor_critic_both_wrapped_loop),
        "channels_last_after_wrapping": lambda: _modes(channels_last_after_wrapping_loop),
        "adversarial": lambda: _modes(adversarial_loop, model_free=False),
        "ensemble": lambda: _modes(ensemble_loop),
        "pruning": lambda: _modes(pruning_loop),
        "clip": lambda: _modes(clip_loop),
        "dino": lambda: _modes(dino_loop),
        "ppo": lambda: _modes(ppo_loop),
        "orthogonal_rnn": lambda: _modes(orthogonal_rnn_loop),
    }


THREE_RANK_JOBS = ("actor_critic_two_backwards", "contrastive", "clip", "momentum_encoder")
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


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("moment", ["before_zero_grad", "before_backward"])
@_with_reference_convs
def test_memory_format_change_after_wrapping_keeps_grads_in_the_buffers(
    single_rank_group, overlap: bool, moment: str
) -> None:
    """``model.to(memory_format=...)`` replaces ``param.grad.data`` too; the next zero_grad (or
    the param's grad hook, when it comes after zero_grad) puts the grad back into the buffer."""
    model = TinyResNet()
    reference = copy.deepcopy(model)
    opt = ShardingStage1(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), overlap=overlap, model=model
    )
    plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        for net, optimizer in ((model, opt), (reference, plain)):
            if moment == "before_zero_grad":
                net.to(memory_format=torch.channels_last if step == 0 else torch.contiguous_format)
            optimizer.zero_grad()
            if moment == "before_backward":
                net.to(memory_format=torch.channels_last if step == 0 else torch.contiguous_format)
            images, labels = _images(step, 0)
            F.cross_entropy(net(images), labels).backward()
            optimizer.step()
    opt.sync_params()
    torch.testing.assert_close(_snapshot(model), _snapshot(reference), rtol=0, atol=0)
    opt.close()


@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
@pytest.mark.parametrize("attach_later", [False, True])
def test_embedding_with_max_norm_is_refused_naming_the_fix(
    single_rank_group, kind: type, attach_later: bool
) -> None:
    """Recommenders' and word2vec's ``max_norm``: every forward renormalizes in place the rows
    its rank looked up, so the ranks' copies disagree and the all-gather keeps the shard
    owner's rows (2.97 off plain torch on 2 ranks)."""
    model = nn.Sequential(kind(9, 4, max_norm=1.0), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"0 \(Embedding(Bag)?\) has max_norm=1.0.*max_norm=None.*renorm_"):
        if attach_later:
            ShardingStage1(optimizer).attach(model)
        else:
            ShardingStage1(optimizer, model=model)


def test_embedding_with_max_norm_outside_the_optimizer_is_accepted(single_rank_group) -> None:
    model = nn.Sequential(nn.Embedding(9, 4, max_norm=1.0), nn.Linear(4, 2))
    ShardingStage1(torch.optim.Adam(model[1].parameters()), model=model).close()


def test_grads_dropped_after_backward_in_overlap_mode_name_freezing(single_rank_group) -> None:
    """DINO's ``cancel_gradients_last_layer`` (``p.grad = None`` after backward) in overlap mode,
    where the grads were already being reduced: the error names freezing before the forward."""
    model = DinoHead()
    opt = ShardingStage1(torch.optim.AdamW(model.parameters()), overlap=True, model=model)
    model(torch.randn(SLICE, 6)).sum().backward()
    for p in model.last_layer.parameters():
        p.grad = None
    with pytest.raises(
        RuntimeError, match=r"set to None after backward.*requires_grad_\(False\).*overlap=False"
    ):
        opt.step()
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_backward_through_a_graph_from_before_step_raises_as_in_torch(
    single_rank_group, overlap: bool
) -> None:
    """RL and GAN code that steps between two backwards of one graph
    (``loss1.backward(retain_graph=True); opt.step(); loss2.backward()``): torch raises, as the
    graph saved weights the step changed in place; the wrapper raises the same error instead
    of differentiating through the new weights."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap, model=model)
    out = model(torch.randn(2, 3))
    out.sum().backward(retain_graph=True)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().sum().backward()
    opt.close()


def test_params_left_out_of_a_step_keep_their_versions(single_rank_group) -> None:
    """Only the params the step changed count as modified, as in torch: a param no backward
    reached keeps its version, so a graph that saved it can still be differentiated."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, model=model)
    model[0](torch.randn(2, 3)).sum().backward()
    reached, left_out = ([p._version for p in m.parameters()] for m in model)
    opt.step()
    assert [p._version for p in model[1].parameters()] == left_out
    assert all(p._version > v for p, v in zip(model[0].parameters(), reached, strict=True))
    opt.close()


def test_grads_replaced_after_backward_in_overlap_mode_are_refused(single_rank_group) -> None:
    """``p.grad = p.grad.clamp(...)`` after backward (RL code clipping by hand): in overlap mode
    the buckets were already being reduced from the grads backward produced, so the new grads
    were silently ignored (a step 1.8e-2 off plain torch); now it raises naming the wrappers'
    clipping."""
    model = Regressor()
    opt = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, model=model)
    x, y = _sine_task(0, 0)[:2]
    F.mse_loss(model(x), y).backward()
    for p in model.parameters():
        p.grad = p.grad.clamp(-0.1, 0.1)
    with pytest.raises(
        RuntimeError, match=r"replaced \(`param.grad = g`\) after backward.*opt.clip_grad_value_"
    ):
        opt.step()
    opt.close()
