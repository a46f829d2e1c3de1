"""Optimizer state dicts in torch's format and sharded DCP checkpoints."""
