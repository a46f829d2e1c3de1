"""``ShardingStage1Strategy``: Lightning's DDP strategy with ZeRO-1 in place of the DDP wrapper.

Note [Lightning without DDP]
    ``DDPStrategy`` contributes the processes (launchers, cluster environments), the process
    group, the distributed samplers and the collectives (``reduce``, ``broadcast``, ``barrier``);
    only its model wrapper is the sharded optimizer's job (it reduces the grads itself). So this
    strategy is a ``DDPStrategy`` whose ``configure_ddp`` leaves the module as it is and whose
    ``setup_optimizers`` wraps each optimizer ``configure_optimizers`` returned in a
    ``ShardingStage1`` attached to the module (schedulers keep working: the wrapper shares the
    torch optimizer's param groups). The rest goes through Lightning's own extension points:
    ``block_backward_sync`` (accumulation) enters ``opt.no_sync()``, the precision plugin
    clips through the wrapper (``lightning_precision``), and checkpoints use torch ZeRO's
    protocol, which ``Strategy.optimizer_state`` already speaks: ``consolidate_state_dict()``
    on every rank, ``state_dict()`` on rank 0, so the ``.ckpt`` holds torch's standard
    optimizer format; ``fit(ckpt_path=...)`` loads it on every rank.

Importing this module registers ``strategy="zero1"`` in Lightning's ``StrategyRegistry``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from sharded_opt.integrations.lightning_precision import with_global_clipping
from sharded_opt.optimizer import ShardingStage1
from sharded_opt.strategy import Strategy

__all__ = ["ShardingStage1Strategy"]

REGISTERED_NAME = "zero1"


class ShardingStage1Strategy(DDPStrategy):
    """Lightning's DDP processes, samplers and collectives, with optimizer state sharded over
    the ranks (ZeRO-1) instead of the DDP wrapper (Note [Lightning without DDP]).

    ``Trainer(strategy=ShardingStage1Strategy())`` (or ``strategy="zero1"`` after importing this
    module); ``configure_optimizers`` returns plain torch optimizers. ``gradient_clip_val`` (norm
    or value) clips the averaged grads over all shards; ``accumulate_grad_batches`` accumulates
    without communicating.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for ``DDPStrategy``.
        overlap: reduce grads during backward and all-gather params during the next forward;
            default False (sync), as ``ShardingStage1``'s own: overlap pays off only where
            communication is a large part of the step (between nodes), and can cost time where it is
            not; ``python -m benchmarks.compare`` says which one a machine wants.
        strategy: a :class:`~sharded_opt.Strategy` for every wrapped optimizer.

    Raises:
        ValueError: a precision plugin the strategy cannot clip through (see
            :func:`~sharded_opt.integrations.lightning_precision.with_global_clipping`).
    """

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        overlap: bool = False,
        strategy: Strategy | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.sharding_overlap = overlap
        self.sharding_strategy = strategy

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # The Trainer's connector sets the plugin for the `precision=` flag here.
        self._precision_plugin = None if precision_plugin is None else with_global_clipping(precision_plugin)

    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: the sharded optimizer reduces the grads."""

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers, each wrapped in a ``ShardingStage1`` attached to the module."""
        super().setup_optimizers(trainer)
        self.optimizers = [
            ShardingStage1(
                optimizer,
                overlap=self.sharding_overlap,
                strategy=self.sharding_strategy,
                model=self.lightning_module,
            )
            for optimizer in self.optimizers
        ]

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate without communicating: ``opt.no_sync()`` of every wrapped optimizer."""
        with contextlib.ExitStack() as stack:
            for optimizer in self.optimizers:
                if isinstance(optimizer, ShardingStage1):
                    stack.enter_context(optimizer.no_sync())
            yield

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if REGISTERED_NAME not in strategy_registry:
            description = "ZeRO-1 sharded optimizer state (sharded_opt) on DDP's processes"
            strategy_registry.register(REGISTERED_NAME, cls, description=description)


ShardingStage1Strategy.register_strategies(StrategyRegistry)
