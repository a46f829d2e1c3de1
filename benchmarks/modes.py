"""The four training modes under comparison, plus a communication-only pseudo-mode.

Every mode owns its model copy, built from the same seed, and the same optimizer
hyperparameters, so the only difference between them is how grads are averaged and where
optimizer state lives. The optimizer is AdamW over every param, or (``--optimizer muon``)
torch's Muon over the hidden matrices and AdamW over the rest, as Muon users split them
(``benchmarks.models.hidden_matrix_names``, docs/muon-adafactor.md): two optimizers per mode,
two ``ShardingStage1`` wrappers in the sharded modes.

With a compressed wire (``--grad-compression``, ``--param-compression``), the sync and overlap
modes also run a second time with ``ShardingConfig.grad_compression``/``param_compression`` set,
as modes of their own named ``sync+TAG`` and ``overlap+TAG`` (:class:`Compression`), beside the
exact ones in the same run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from benchmarks.models import build_model, hidden_matrix_names
from sharded_opt import ShardingConfig, ShardingStage1, Strategy, compile_backend
from sharded_opt.step.bucket import finish_grad_syncs, start_param_syncs

MODES = ("ddp", "zero", "sync", "overlap", "hybrid")
"""Measured modes, in the interleaving order A B C D E. ``hybrid`` (ShardingStage1 overlap with
``Strategy().sharding.degree``) runs only when ``--degree`` is given. The compressed variants
(:func:`compressed_modes`) follow them."""

COMPRESSIBLE = ("sync", "overlap")
"""The modes that run a compressed variant too when the wire is compressed."""

COMM_ONLY = "comm"
"""Pseudo-mode: the sharded modes' collectives on their own buffers, with no compute."""

COMPUTE_ONLY = "compute"
"""Pseudo-mode: forward, backward and a full AdamW step on this rank's batch, no communication.
With :data:`COMM_ONLY` it gives max(compute, comm), the best any overlap can do."""

PSEUDO_MODES = (COMM_ONLY, COMPUTE_ONLY)

OPTIMIZERS = ("adamw", "muon")
"""``--optimizer``: AdamW over every param, or Muon over the hidden matrices and AdamW over the rest."""

MUON_MODES = ("ddp", "sync", "overlap", "hybrid")
"""The modes that run with Muon (``ZeroRedundancyOptimizer`` is left out of that comparison)."""

MUST_AGREE = ("ddp", "sync", "overlap", "hybrid")
"""Modes that run the same arithmetic and so must end with the same params (to tolerance)."""

LABELS = {
    "ddp": "DDP + AdamW",
    "zero": "DDP + ZeroRedundancyOptimizer",
    "sync": "ShardingStage1 sync",
    "overlap": "ShardingStage1 overlap",
    "hybrid": "ShardingStage1 overlap, hybrid",
    COMM_ONLY: "comm only (RS + AG)",
    COMPUTE_ONLY: "compute only (no comm)",
}


def label(name: str, optimizer: str = "adamw") -> str:
    """A mode's label in tables and plots; with Muon, DDP's names both of its optimizers; a
    compressed variant is its exact mode's label and its tag (``... overlap +int8g+int8p``)."""
    base, tag = split_mode(name)
    if tag:
        return f"{label(base, optimizer)} +{tag}"
    if optimizer == "muon" and name == "ddp":
        return "DDP + Muon/AdamW"
    return LABELS[name]


@dataclass(frozen=True, slots=True)
class Compression:
    """The wire a setting uses: ``ShardingConfig.grad_compression`` and ``param_compression``
    (None: exact, as sent without compression)."""

    grad: str | None = None
    param: str | None = None

    @property
    def exact(self) -> bool:
        return self.grad is None and self.param is None

    @property
    def tag(self) -> str:
        """The suffix of the compressed modes' names: what grads (``g``) and params (``p``) are
        sent as, e.g. ``int8g+int8p``, ``bf16g``; empty when exact."""
        parts = [f"{self.grad}g" if self.grad else "", f"{self.param}p" if self.param else ""]
        return "+".join(part for part in parts if part)

    def words(self) -> str:
        """The setting in words, e.g. ``grads int8, params int8``."""
        return ", ".join(
            f"{kind} {value or 'exact'}" for kind, value in (("grads", self.grad), ("params", self.param))
        )


def split_mode(name: str) -> tuple[str, str]:
    """A mode's exact mode and compression tag: ``("overlap", "int8g+int8p")``, ``("ddp", "")``."""
    base, _, tag = name.partition("+")
    return base, tag


def compressed_modes(modes: tuple[str, ...], compression: Compression) -> tuple[str, ...]:
    """The compressed variants of the :data:`COMPRESSIBLE` modes among ``modes``, in order."""
    if compression.exact:
        return ()
    return tuple(f"{name}+{compression.tag}" for name in COMPRESSIBLE if name in modes)


@dataclass(frozen=True, slots=True)
class AdamWConfig:
    """One set of hyperparameters for every mode (weight decay on, so decoupled decay is tested)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8

    def kwargs(self) -> dict[str, object]:
        return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay, "eps": self.eps}


@dataclass(frozen=True, slots=True)
class MuonConfig:
    """Muon's hyperparameters for the hidden matrices under ``--optimizer muon`` (torch's defaults
    but the learning rate, 0.02 as in Muon's own examples); the other params keep AdamWConfig."""

    lr: float = 0.02
    momentum: float = 0.95
    weight_decay: float = 0.1

    def kwargs(self) -> dict[str, object]:
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}


@dataclass(frozen=True, slots=True)
class ModeSpec:
    """What a rank needs to build any mode."""

    model_name: str
    seed: int
    bucket_mb: float | None
    """None: each library's default (DDP's 25 MiB, ShardingStage1's model-derived sizes)."""
    adamw: AdamWConfig
    device: torch.device
    group: ProcessGroup
    degree: int | None = None
    """Ranks per shard group of the ``hybrid`` mode."""
    gloo_point_to_point: bool = False
    """``ShardingConfig.gloo_point_to_point`` for the wrapper's modes (``--gloo-p2p``)."""
    optimizer: str = "adamw"
    """One of :data:`OPTIMIZERS` (``--optimizer``)."""
    muon: MuonConfig = MuonConfig()
    compile_backend: str | None = None
    """``torch.compile`` every mode's forward with this backend (``--compile``); None: eager."""
    compression: Compression = Compression()
    """The wire of the compressed modes (``sync+TAG``, ``overlap+TAG``); the others are exact."""


class Runner:
    """One mode's model, optimizers (one, or Muon then AdamW) and training step.

    ``step`` returns the loss without waiting for anything still in flight; ``settle`` waits for
    all of it (pending all-gathers, device kernels) so that a timed block is charged for all of
    its own work and none of it leaks into the next mode's block.
    """

    def __init__(
        self,
        name: str,
        model: nn.Module,
        forward: nn.Module,
        optimizer: torch.optim.Optimizer,
        *more: torch.optim.Optimizer,
    ):
        self.name = name
        self.model = model
        self.forward = forward
        self.optimizers = (optimizer, *more)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first optimizer (the only one with AdamW; Muon's with ``--optimizer muon``)."""
        return self.optimizers[0]

    @property
    def wrappers(self) -> list[ShardingStage1]:
        return [o for o in self.optimizers if isinstance(o, ShardingStage1)]

    def step(self, inputs: Tensor, targets: Tensor) -> Tensor:
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        with torch.profiler.record_function("forward"):
            loss = self.forward(inputs, targets)
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("optimizer.step"):
            for optimizer in self.optimizers:
                optimizer.step()
        return loss.detach()

    def settle(self) -> None:
        for wrapper in self.wrappers:
            wrapper.sync_params()
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def state_bytes(self) -> int:
        """Optimizer state held by this rank, in bytes."""
        return sum(self.state_bytes_by_optimizer().values())

    def wire_bytes(self) -> dict[str, int] | None:
        """What this rank's wrappers sent since they were built (``ShardingStage1.wire_bytes()``,
        summed over the wrappers), or None for a mode without one (DDP, ZeRO, compute only)."""
        wrappers = self.wrappers
        if not wrappers:
            return None
        sent = [wrapper.wire_bytes() for wrapper in wrappers]
        return {kind: sum(each[kind] for each in sent) for kind in sent[0]}

    def state_bytes_by_optimizer(self) -> dict[str, int]:
        """Optimizer state held by this rank, in bytes, per wrapped class (``{"Muon": ...,
        "AdamW": ...}``): ``optimizer_state_bytes()`` of a wrapper, every state tensor otherwise."""
        found: dict[str, int] = {}
        for optimizer in self.optimizers:
            if isinstance(optimizer, ShardingStage1):
                name = type(optimizer.shards.inner).__name__  # the wrapped class; no public name for it
                found[name] = found.get(name, 0) + optimizer.optimizer_state_bytes()
                continue
            inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
            found[type(inner).__name__] = found.get(type(inner).__name__, 0) + _state_bytes(inner)
        return found

    def flat_params(self) -> Tensor:
        """All params concatenated on the CPU, after waiting for pending updates."""
        self.settle()
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.model.parameters()])


class CommOnlyRunner(Runner):
    """Issues exactly the collectives of a sharded step (reduce-scatter of every bucket, then
    all-gather of every bucket, in the wrapper's order) on the wrapper's own buffers: the
    T_comm against which hidden communication is measured.

    Harmless to interleave with training: reduce-scatter only writes the shard-sized averaged
    grad that the next step overwrites, and all-gather rewrites params with the values all
    ranks already hold.
    """

    def __init__(self, wrapped: Runner) -> None:
        super().__init__(COMM_ONLY, wrapped.model, wrapped.forward, *wrapped.optimizers)

    def step(self, inputs: Tensor, targets: Tensor) -> Tensor:
        # Every wrapper's collectives (Muon's and AdamW's) in flight together, each wrapper on a
        # group of its own, as in a step. No public comm-only entry point yet.
        shards = [wrapper.shards for wrapper in self.wrappers]
        for each in shards:
            for bucket in each.buckets:
                bucket.start_grad_sync()
        for each in shards:
            finish_grad_syncs(each.buckets, each.comm)
        for each in shards:
            start_param_syncs(each.buckets[::-1], each.comm)
        for each in shards:
            for bucket in each.buckets:
                bucket.finish_param_sync()
        return torch.zeros(())

    def state_bytes(self) -> int:
        return 0


def build_runner(name: str, spec: ModeSpec) -> Runner:
    """Build mode ``name`` from ``spec``; every call returns an independent model copy. A
    compressed variant (``overlap+TAG``) must carry the tag of ``spec.compression``."""
    model = build_model(spec.model_name, spec.seed).to(spec.device)
    base, tag = split_mode(name)
    if not tag:
        return _compiled(_BUILDERS[name](model, spec), spec)
    if base not in COMPRESSIBLE or tag != spec.compression.tag:
        known = compressed_modes(COMPRESSIBLE, spec.compression)
        raise ValueError(
            f"unknown mode {name!r}; the compressed modes of this run: {', '.join(known) or 'none'}"
        )
    return _compiled(_sharded(model, spec, overlap=base == "overlap", compression=spec.compression), spec)


def _compiled(runner: Runner, spec: ModeSpec) -> Runner:
    """``runner`` with its forward (the model, or DDP around it) compiled, as a user who compiles
    writes it: DDP is compiled whole (Dynamo cuts its graph at DDP's buckets), the sharded
    modes compile the attached model with the backend cut at the wrappers' buckets
    (:func:`sharded_opt.compile_backend`, Note [Graph cuts at buckets])."""
    if spec.compile_backend is None:
        return runner
    backend: object = spec.compile_backend
    if runner.wrappers:
        backend = compile_backend(*runner.wrappers, backend=spec.compile_backend)
    runner.forward = torch.compile(runner.forward, backend=backend)
    return runner


def _ddp_wrap(model: nn.Module, spec: ModeSpec) -> nn.Module:
    """DDP around ``model``; at one rank there is nothing to average, so the plain model."""
    if dist.get_world_size(spec.group) == 1:
        return model
    device_ids = None if spec.device.type == "cpu" else [spec.device.index]
    return DistributedDataParallel(
        model, device_ids=device_ids, process_group=spec.group, bucket_cap_mb=spec.bucket_mb
    )


def plain_optimizers(model: nn.Module, spec: ModeSpec) -> list[torch.optim.Optimizer]:
    """``spec.optimizer``'s plain torch optimizers over ``model``: AdamW over every param, or
    Muon over the hidden matrices and AdamW over the rest (in that order)."""
    if spec.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), **spec.adamw.kwargs())]
    if spec.optimizer != "muon":
        raise ValueError(f"expected an optimizer of {', '.join(OPTIMIZERS)} but got {spec.optimizer!r}")
    hidden = hidden_matrix_names(model)
    named = list(model.named_parameters())
    return [
        torch.optim.Muon([p for name, p in named if name in hidden], **spec.muon.kwargs()),
        torch.optim.AdamW([p for name, p in named if name not in hidden], **spec.adamw.kwargs()),
    ]


def build_compute_runner(spec: ModeSpec) -> Runner:
    """The :data:`COMPUTE_ONLY` pseudo-mode: the plain model and optimizers, no wrapper at all."""
    model = build_model(spec.model_name, spec.seed).to(spec.device)
    return _compiled(Runner(COMPUTE_ONLY, model, model, *plain_optimizers(model, spec)), spec)


def _build_ddp(model: nn.Module, spec: ModeSpec) -> Runner:
    forward = _ddp_wrap(model, spec)
    return Runner("ddp", model, forward, *plain_optimizers(model, spec))


def _build_zero(model: nn.Module, spec: ModeSpec) -> Runner:
    if spec.optimizer != "adamw":
        raise ValueError(f"the zero mode runs AdamW only, not {spec.optimizer!r}")
    forward = _ddp_wrap(model, spec)
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(),
        optimizer_class=torch.optim.AdamW,
        process_group=spec.group,
        **spec.adamw.kwargs(),
    )
    return Runner("zero", model, forward, optimizer)


def _build_sharded(overlap: bool, hybrid: bool = False) -> Callable[[nn.Module, ModeSpec], Runner]:
    def build(model: nn.Module, spec: ModeSpec) -> Runner:
        if hybrid and spec.degree is None:
            raise ValueError("the hybrid mode needs --degree (ranks per shard group)")
        return _sharded(model, spec, overlap, spec.degree if hybrid else None)

    return build


def _sharded(
    model: nn.Module,
    spec: ModeSpec,
    overlap: bool,
    degree: int | None = None,
    compression: Compression = Compression(),
) -> Runner:
    """A ``ShardingStage1`` mode: each of the mode's optimizers wrapped, with the model attached."""
    config = ShardingConfig(
        enable=True,
        bucket_size_mb=spec.bucket_mb,
        degree=degree,
        gloo_point_to_point=spec.gloo_point_to_point,
        grad_compression=compression.grad,
        param_compression=compression.param,
    )
    strategy = Strategy(sharding=config)
    wrappers = [
        ShardingStage1(plain, overlap=overlap, strategy=strategy, process_group=spec.group, model=model)
        for plain in plain_optimizers(model, spec)
    ]
    name = "hybrid" if degree is not None else "overlap" if overlap else "sync"
    if not compression.exact:
        name = f"{name}+{compression.tag}"
    return Runner(name, model, model, *wrappers)


_BUILDERS: dict[str, Callable[[nn.Module, ModeSpec], Runner]] = {
    "ddp": _build_ddp,
    "zero": _build_zero,
    "sync": _build_sharded(overlap=False),
    "overlap": _build_sharded(overlap=True),
    "hybrid": _build_sharded(overlap=True, hybrid=True),
}


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor)
    )


def comm_bytes_per_step(runner: Runner, world_size: int) -> dict[str, float]:
    """Bytes a step hands to collectives (``payload``) and a ring estimate of what each rank
    sends (``wire_per_rank``).

    Formulas, with P the param bytes, B the padded bucket bytes and N the world size:
      hybrid (k ranks per shard group, r = N/k replicas): reduce-scatter + all-gather within the
        shard group, wire 2(k-1)/k * B, plus an all-reduce of the B/k shard across replicas,
        wire 2(r-1)/r * B/k (the only bytes that cross between shard groups).
      DDP: one all-reduce of the grads: payload P, wire 2(N-1)/N * P.
      sharded: reduce-scatter + all-gather of every padded bucket: payload 2B,
        wire (N-1)/N * B + (N-1)/N * B = 2(N-1)/N * B (same as DDP up to padding).
      ZeroRedundancyOptimizer: DDP's all-reduce plus one broadcast of each param from its owner:
        payload 2P, wire >= 3(N-1)/N * P.
    gloo's own reduce-scatter is a full all-reduce; ShardingStage1 therefore reduce-scatters CPU
    tensors on gloo as an all-to-all plus a local sum, and with ``gloo_point_to_point`` runs both
    collectives as point-to-point messages; either way each sends the same (N-1)/N * B (see
    Note [Reduce-scatter on gloo] in sharded_opt/comm/collectives.py).

    These are estimates of the exact wire, also for a compressed mode; what the wrapper's modes
    really sent is counted from their payloads (:meth:`Runner.wire_bytes`, ``benchmarks.session``).
    """
    if world_size == 1 or runner.name == COMPUTE_ONLY:
        return {"payload": 0.0, "wire_per_rank": 0.0}
    ring = (world_size - 1) / world_size
    if runner.wrappers:
        padded = sum(b.padded_numel * b.dtype.itemsize for w in runner.wrappers for b in w.plan.buckets)
        groups = runner.wrappers[0].shard_groups
        if groups.num_replicas > 1 and groups.shard_size > 1:
            k, r = groups.shard_size, groups.num_replicas
            across = 2 * (r - 1) / r * padded / k
            return {"payload": 2.0 * padded + padded / k, "wire_per_rank": 2 * (k - 1) / k * padded + across}
        return {"payload": 2.0 * padded, "wire_per_rank": 2 * ring * padded}
    params = sum(p.numel() * p.element_size() for p in runner.model.parameters() if p.requires_grad)
    if runner.name == "zero":
        return {"payload": 2.0 * params, "wire_per_rank": 3 * ring * params}
    return {"payload": float(params), "wire_per_rank": 2 * ring * params}
