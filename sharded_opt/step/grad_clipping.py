"""``GradClipping``: the global norm of the averaged grads, and clipping by it or by value, on
the shards each rank holds (``ShardingStage1.clip_grad_norm_``, ``grad_norm`` and
``clip_grad_value_``)."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from sharded_opt.guards.param_guard import ParamGuard
from sharded_opt.step.grad_sync import GradSync
from sharded_opt.step.optimizer_shards import OptimizerShards


class GradClipping:
    """Measures and clips the averaged grads of this rank's shards. A norm combines every rank's
    shard norm with one all-reduce of a scalar, so every rank gets the same norm and clips alike
    (a norm of the local grads would differ per rank); a clamp is element-wise and needs no
    communication. Each finishes the grad reduction first: the shards hold no averaged grads
    before it.

    Args:
        grad_sync: reduces the grads now and is told of the writes into them (Note [Grads
            written after backward] in ``grad_hooks``).
        shards: the shards' averaged grads, and the group that holds each element once.
        param_guard: takes back params replaced since wrapping before their grads are reduced,
            as ``step()`` does (Note [Params replaced after wrapping] in ``param_guard``).
    """

    def __init__(self, grad_sync: GradSync, shards: OptimizerShards, param_guard: ParamGuard) -> None:
        self._grad_sync = grad_sync
        self._shards = shards
        self._param_guard = param_guard

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """See ``ShardingStage1.clip_grad_norm_``."""
        _check_norm_type("clip_grad_norm_", norm_type)
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} is {total.item()}; set "
                "error_if_nonfinite=False to clip anyway (grads then become nan)"
            )
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in self._shards.local_grads():
            grad.mul_(coefficient.to(grad.dtype))
        self._grad_sync.tracker.accept_grad_writes()
        return total

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """See ``ShardingStage1.grad_norm``."""
        norm_type = _check_norm_type("grad_norm", norm_type)
        self._param_guard.take_back_replaced()
        self._grad_sync.reduce_grads()
        grads = self._shards.local_grads()
        dtype = _norm_dtype(grads)
        if norm_type == math.inf:
            local = torch.stack([g.abs().max().to(dtype) for g in grads]).max()
            op = dist.ReduceOp.MAX
        else:
            local = torch.stack(
                [torch.linalg.vector_norm(g, norm_type).to(dtype) ** norm_type for g in grads]
            ).sum()
            op = dist.ReduceOp.SUM
        comm = self._shards.comm
        if comm.sharded:
            # Replicas hold equal shards after the replicate all-reduce: each element counts once.
            dist.all_reduce(local, op=op, group=comm.group)
        return local if norm_type == math.inf else local ** (1.0 / norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        """See ``ShardingStage1.clip_grad_value_``."""
        clip_value = float(clip_value)
        self._param_guard.take_back_replaced()
        self._grad_sync.reduce_grads()
        for grad in self._shards.local_grads():
            grad.clamp_(-clip_value, clip_value)
        self._grad_sync.tracker.accept_grad_writes()


def _norm_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    """The dtype the norm is summed and returned in: the widest of the grads' and fp32, as
    torch's ``get_total_norm`` stacks the per-param norms in their promoted dtype (fp64 for fp64
    params; fp32 for 16-bit grads, which are reduced in fp32 here); real for complex grads,
    whose norms are real."""
    return functools.reduce(torch.promote_types, (g.dtype.to_real() for g in grads), torch.float32)


def _check_norm_type(api: str, norm_type: float) -> float:
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"ShardingStage1.{api} expects norm_type > 0 (or inf) but got {norm_type}")
    return norm_type
