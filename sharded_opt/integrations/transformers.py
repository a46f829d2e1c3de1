"""``ShardingStage1Trainer``: ``transformers.Trainer`` with ZeRO-1 instead of DDP.

Note [Trainer on the sharded Accelerator]
    Trainer does all of its distributed work through its ``accelerator``: ``prepare(model,
    optimizer)`` (which would wrap the model in DDP), ``no_sync`` for accumulation,
    ``clip_grad_norm_`` for ``max_grad_norm`` and for the logged ``grad_norm`` (with
    ``max_norm=inf`` when not clipping), ``backward`` with the fp16 scaler. So this Trainer builds
    a :class:`~sharded_opt.integrations.accelerate.ShardingStage1Accelerator` from the very
    arguments Trainer built its own ``Accelerator`` from, and everything above goes through the
    sharded optimizer (see Note [Accelerate without DDP]): the optimizer Trainer creates from
    ``TrainingArguments`` (or the one passed in ``optimizers=``) is wrapped at ``prepare``, the
    model is never DDP-wrapped, clipping and the logged norm are global.

    Checkpoints: Trainer calls ``optimizer.state_dict()`` on the saving rank only. Every rank
    first gathers the full state to that rank (``consolidate_state_dict``, torch ZeRO's
    protocol), so ``optimizer.pt`` holds torch's standard format, as a plain run's does, and
    ``resume_from_checkpoint`` loads it on every rank through the collective
    ``load_state_dict``. ``save_on_each_node`` (a saving rank per node) is refused.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from transformers import Trainer

from sharded_opt.integrations.accelerate import ShardingStage1Accelerator, sharded_optimizer
from sharded_opt.strategy import Strategy

__all__ = ["ShardingStage1Trainer"]

_SAVING_RANK = 0
"""The rank Trainer saves ``optimizer.pt`` on (``args.should_save``; ``save_on_each_node`` is refused)."""


class ShardingStage1Trainer(Trainer):
    """A ``transformers.Trainer`` that shards optimizer state over the ranks (ZeRO-1) instead
    of wrapping the model in DDP; used exactly like ``Trainer`` (see Note [Trainer on the sharded
    Accelerator]).

    Args:
        *args: ``Trainer``'s own arguments.
        overlap: reduce grads during backward and all-gather params during the next forward;
            default False (sync), as ``ShardingStage1``'s own: overlap pays off only where
            communication is a large part of the step (between nodes), and can cost time where it is
            not; ``python -m benchmarks.compare`` says which one a machine wants.
        strategy: a :class:`~sharded_opt.Strategy` for the wrapped optimizer; default ``Strategy()``.
        **kwargs: ``Trainer``'s own keyword arguments (``optimizers=(optimizer, scheduler)``
            takes a plain torch optimizer, which is wrapped).

    Raises:
        ValueError: ``TrainingArguments(save_on_each_node=True)``, or a DeepSpeed/FSDP setup (see
            :class:`~sharded_opt.integrations.accelerate.ShardingStage1Accelerator`).
    """

    def __init__(
        self, *args: Any, overlap: bool = False, strategy: Strategy | None = None, **kwargs: Any
    ) -> None:
        # Read by create_accelerator_and_postprocess, which Trainer.__init__ calls.
        self._sharding_overlap = overlap
        self._sharding_strategy = strategy
        super().__init__(*args, **kwargs)
        if self.args.save_on_each_node:
            raise ValueError(
                "ShardingStage1Trainer expects one saving rank but got save_on_each_node=True: the "
                "optimizer state is gathered to rank 0 for optimizer.pt; set save_on_each_node=False"
            )

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # Private in transformers 5.23 (pinned in constraints-cpu.txt): the one place that sees
        # the exact arguments Trainer's Accelerator is built from, which the sharded Accelerator
        # needs too. Overriding the public create_accelerator_and_postprocess instead would copy
        # its ~90 lines.
        self._accelerator_args = super()._build_accelerator_args(**kwargs)
        return self._accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        """As Trainer's, with the accelerator replaced by a ``ShardingStage1Accelerator`` built
        from the same arguments (Note [Trainer on the sharded Accelerator])."""
        super().create_accelerator_and_postprocess()
        self.accelerator = ShardingStage1Accelerator(
            **self._accelerator_args, overlap=self._sharding_overlap, strategy=self._sharding_strategy
        )
        # Trainer bound its first accelerator's gather_for_metrics; bind it as Trainer does.
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Private in transformers 5.23 (pinned): Trainer's only hook around the optimizer's
        # state_dict(), which it calls on the saving rank alone. Every rank gathers first.
        optimizer = sharded_optimizer(self.optimizer)
        if optimizer is not None:
            optimizer.consolidate_state_dict(to=_SAVING_RANK)
        super()._save_optimizer_and_scheduler(output_dir)
