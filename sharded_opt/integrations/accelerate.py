"""``ShardingStage1Accelerator``: ``accelerate.Accelerator`` with ZeRO-1 instead of DDP.

Note [Accelerate without DDP]
    ``Accelerator.prepare`` wraps a trainable model in ``DistributedDataParallel`` whenever more
    than one process runs, and DDP averages the grads after backward, which the sharded optimizer
    already does (its own reduce-scatter, during backward in overlap mode): the grads would be
    averaged twice and written after backward, which ``ShardingStage1`` refuses. So this class
    prepares models the way Accelerate prepares models it must not distribute (its
    ``evaluation_mode=True``, which skips exactly the data-parallel wrappers but keeps device
    placement, autocast and ``torch.compile``) and wraps each prepared optimizer in a
    ``ShardingStage1`` attached to the prepared model that holds its params. The calls that
    reach DDP or ``param.grad`` then go to the wrapper instead: ``no_sync``/``accumulate`` enter
    ``opt.no_sync()``, ``clip_grad_norm_``/``clip_grad_value_`` clip the averaged grads over all
    shards (``opt.clip_grad_norm_``; ``max_norm=inf``, Accelerate's way of reading the norm, is
    ``opt.grad_norm()``), and fp16's loss scaler is a ``ShardedGradScaler``. Everything else
    (dataloaders, schedulers, ``backward``, ``save_state``/``load_state``, ``gather``) is
    Accelerate's own: the optimizer's ``state_dict()``/``load_state_dict()`` that ``save_state``
    and ``load_state`` call on every rank are collective and give torch's format.

    On one process without a process group there is nothing to shard: optimizers are prepared
    as Accelerate prepares them, so the same script runs there too.

Note [Weights are views of buckets]
    Every param is a view of its bucket's flat buffer. Accelerate's safetensors path
    (``save_state``/``save_model`` with ``safe_serialization=True``, their default) removes
    "shared tensors" by storage before writing: it would silently keep one param per bucket and
    drop the rest, and ``load_state`` of such a folder fails in safetensors' ``load_model`` ("None
    is covering the entire storage"). So both default to ``safe_serialization=False`` here and
    refuse ``True``: ``torch.save`` writes each bucket once and the params load back as they
    were. ``model.save_pretrained`` (transformers' own check for shared tensors) is unaffected.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn

from sharded_opt.grad_scaler import ShardedGradScaler
from sharded_opt.optimizer import ShardingStage1
from sharded_opt.strategy import Strategy

__all__ = ["ShardingStage1Accelerator", "sharded_optimizer"]

_SUPPORTED_TYPES = (
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
)
"""Plain data parallel, whose DDP this replaces; DeepSpeed, FSDP, Megatron and XLA shard or
distribute in their own way and are refused."""


class ShardingStage1Accelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose optimizers are ZeRO-1 sharded instead of DDP.

    Used exactly like ``Accelerator`` (see Note [Accelerate without DDP]): ``prepare(model,
    optimizer, dataloader, scheduler)`` returns the model unwrapped and the optimizer wrapped in
    a :class:`~sharded_opt.ShardingStage1` (inside Accelerate's own optimizer wrapper);
    ``backward``, ``accumulate``, ``no_sync``, ``clip_grad_norm_``, ``save_state`` and
    ``load_state`` work as with DDP, with the differences ``docs/trainers.md`` lists (the norm
    ``clip_grad_norm_`` returns is the global one; ``param.grad`` holds local grads).

    Args:
        *args: ``Accelerator``'s own arguments.
        overlap: reduce grads during backward and all-gather params during the next forward
            (``ShardingStage1(overlap=...)``); default False (sync), as ``ShardingStage1``'s own:
            overlap pays off only where communication is a large part of the step (between
            nodes), and can cost time where it is not; ``python -m benchmarks.compare`` says which
            one a machine wants.
        strategy: a :class:`~sharded_opt.Strategy` for every wrapped optimizer (bucket sizes,
            mixed precision, hybrid sharding); default ``Strategy()``.
        **kwargs: ``Accelerator``'s own keyword arguments.

    Raises:
        ValueError: DeepSpeed, FSDP, Megatron-LM or XLA is configured (they shard or distribute
            themselves).
    """

    def __init__(
        self, *args: Any, overlap: bool = False, strategy: Strategy | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.distributed_type not in _SUPPORTED_TYPES:
            raise ValueError(
                "ShardingStage1Accelerator replaces DistributedDataParallel and expects plain data "
                f"parallel but got distributed_type {self.distributed_type.value}; drop the "
                "DeepSpeed/FSDP/Megatron-LM/XLA configuration, or use Accelerator with it instead"
            )
        self.sharding_overlap = overlap
        self.sharding_strategy = strategy
        self._modules_in_prepare: list[nn.Module] = []
        if self.scaler is not None:
            # Accelerate built torch's GradScaler for fp16; each rank would check only its local
            # grads, and the wrapper refuses a step driven by it.
            kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
            self.scaler = ShardedGradScaler(self.device.type, **kwargs)

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """As ``Accelerator.prepare``; the modules among ``args`` are what the optimizers among
        them are attached to, in whatever order they come."""
        self._modules_in_prepare = [arg for arg in args if isinstance(arg, nn.Module)]
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._modules_in_prepare = []

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """As ``Accelerator.prepare_model``, never wrapped for data parallel (Note [Accelerate
        without DDP]): ``evaluation_mode=True`` is Accelerate's switch for exactly that."""
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` in a ``ShardingStage1`` (attached to the prepared model that holds
        its params), then prepare it as Accelerate does."""
        if not getattr(optimizer, "_is_accelerate_prepared", False):
            optimizer = self._shard(optimizer)
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate grads of ``model``'s params without communicating: ``opt.no_sync()`` of
        every sharded optimizer over them (what DDP's ``no_sync`` is for a DDP model)."""
        with contextlib.ExitStack() as stack:
            for optimizer in self._sharded_optimizers_over(model.parameters()):
                stack.enter_context(optimizer.no_sync())
            yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Clip the averaged grads of ``parameters`` by their global norm and return that norm
        (the same on every rank); ``max_norm=inf`` only reads it (``opt.grad_norm()``).

        ``parameters`` must cover every param of the sharded optimizer that holds any of them
        (the norm is over all of them); params of no sharded optimizer are clipped by
        Accelerate as before.

        Raises:
            ValueError: ``parameters`` cover part of a sharded optimizer, or several.
        """
        params = list(parameters)
        optimizer = self._single_sharded_optimizer_over(params, "clip_grad_norm_")
        if optimizer is None:
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        self.unscale_gradients(optimizer=optimizer)
        if math.isinf(max_norm):
            return optimizer.grad_norm(norm_type)
        return optimizer.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp the averaged grads of ``parameters`` (``opt.clip_grad_value_``); see
        :meth:`clip_grad_norm_` for which ``parameters`` are accepted."""
        params = list(parameters)
        optimizer = self._single_sharded_optimizer_over(params, "clip_grad_value_")
        if optimizer is None:
            return super().clip_grad_value_(params, clip_value)
        self.unscale_gradients(optimizer=optimizer)
        optimizer.clip_grad_value_(clip_value)

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = False, **save_model_func_kwargs: Any
    ) -> str:
        """As ``Accelerator.save_state``, with the weights written by ``torch.save`` (Note
        [Weights are views of buckets]).

        Raises:
            ValueError: ``safe_serialization=True``.
        """
        _refuse_safetensors("save_state", safe_serialization)
        return super().save_state(output_dir, safe_serialization=False, **save_model_func_kwargs)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = False,
    ) -> None:
        """As ``Accelerator.save_model``, with the weights written by ``torch.save`` (Note
        [Weights are views of buckets]).

        Raises:
            ValueError: ``safe_serialization=True``.
        """
        _refuse_safetensors("save_model", safe_serialization)
        super().save_model(model, save_directory, max_shard_size=max_shard_size, safe_serialization=False)

    # -- internals ---------------------------------------------------------------------------

    def _shard(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, ShardingStage1) or not dist.is_initialized():
            return optimizer
        return ShardingStage1(
            optimizer,
            overlap=self.sharding_overlap,
            strategy=self.sharding_strategy,
            model=self._model_holding(optimizer),
        )

    def _model_holding(self, optimizer: torch.optim.Optimizer) -> nn.Module | None:
        """The module being or already prepared that holds ``optimizer``'s first param (None:
        the wrapper then waits for its all-gathers in ``step()`` instead of per module)."""
        first = next(p for group in optimizer.param_groups for p in group["params"])
        for model in [*self._modules_in_prepare, *self._models]:
            if any(param is first for param in model.parameters()):
                return model
        return None

    def _sharded_optimizers_over(self, params: Iterable[torch.Tensor]) -> list[ShardingStage1]:
        ids = {id(param) for param in params}
        return [
            optimizer
            for optimizer in map(sharded_optimizer, self._optimizers)
            if optimizer is not None and any(id(param) in ids for param in _params_of(optimizer))
        ]

    def _single_sharded_optimizer_over(self, params: list[torch.Tensor], api: str) -> ShardingStage1 | None:
        owners = self._sharded_optimizers_over(params)
        if not owners:
            return None
        ids = {id(param) for param in params}
        if len(owners) > 1 or not all(id(param) in ids for param in _params_of(owners[0])):
            raise ValueError(
                f"ShardingStage1Accelerator.{api} expects the params of one sharded optimizer (all of "
                f"them: the norm is global over its shards) but got params of {len(owners)} sharded "
                "optimizers or part of one; pass model.parameters() of the model that optimizer trains"
            )
        return owners[0]


def sharded_optimizer(optimizer: Any) -> ShardingStage1 | None:
    """The ``ShardingStage1`` inside Accelerate's optimizer wrapper(s), if any."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, ShardingStage1) else None


def _refuse_safetensors(api: str, safe_serialization: bool) -> None:
    if safe_serialization:
        raise ValueError(
            f"ShardingStage1Accelerator.{api} expects safe_serialization=False but got True: Accelerate "
            "drops every param but one per flat buffer as 'shared tensors' before safetensors writes "
            "them (Note [Weights are views of buckets]); model.save_pretrained(...) writes safetensors "
            "correctly"
        )


def _params_of(optimizer: ShardingStage1) -> Iterator[torch.Tensor]:
    return (param for group in optimizer.param_groups for param in group["params"])
