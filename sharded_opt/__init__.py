"""sharded_opt: ZeRO stage-1 sharded optimizer states for element-wise torch optimizers and for
those that need whole params (Muon, Adafactor)."""

from sharded_opt.checkpoint import load_checkpoint, save_checkpoint
from sharded_opt.comm.streams import wait_comm, wait_compute
from sharded_opt.compiled_cuts import compile_backend
from sharded_opt.grad_scaler import ShardedGradScaler
from sharded_opt.guards.optimizer_needs import OptimizerNeeds, QuantizedBlocks
from sharded_opt.launch.launcher import init_parallel_env, spawn
from sharded_opt.optimizer import ShardingStage1
from sharded_opt.strategy import ShardingConfig, Strategy

__all__ = [
    "OptimizerNeeds",
    "QuantizedBlocks",
    "ShardedGradScaler",
    "ShardingConfig",
    "ShardingStage1",
    "Strategy",
    "compile_backend",
    "init_parallel_env",
    "load_checkpoint",
    "save_checkpoint",
    "spawn",
    "wait_comm",
    "wait_compute",
]
