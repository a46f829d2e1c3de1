"""Adapters for the training frameworks people train with instead of their own loop.

Each submodule imports its framework, so import the one you use (the package itself imports
none of them, and ``import sharded_opt`` works without any installed):

- :mod:`sharded_opt.integrations.transformers`: ``ShardingStage1Trainer``, a ``transformers.Trainer``
- :mod:`sharded_opt.integrations.accelerate`: ``ShardingStage1Accelerator``, an ``accelerate.Accelerator``
- :mod:`sharded_opt.integrations.lightning`: ``ShardingStage1Strategy``, a Lightning strategy
  (also ``strategy="zero1"`` once the module is imported)

What each one changes against the framework's DDP path is in ``docs/trainers.md``.
"""

__all__: list[str] = []
