"""``OptimizerShards``: this rank's shards of every bucket and the inner optimizer that steps them.

The one object that knows where the optimizer state lives. The wrapper's runtime pieces (the
grad hooks, which give a bucket its shard when a param of it starts to require grad) and the
state conversions (``state_dict``, DCP checkpoints) reach the state through it, so none of them
needs the wrapper itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from fusion.buffers import FlatBuffers
from fusion.layout import LayoutPlan
from sharded_opt.comm.comm_context import CommContext
from sharded_opt.comm.hybrid_groups import ShardGroups
from sharded_opt.step.bucket import Bucket
from sharded_opt.step.inner_optimizer import add_shard
from sharded_opt.step.local_shard import LocalShard
from sharded_opt.step.quantized_state import state_nbytes

if TYPE_CHECKING:
    from sharded_opt.guards.optimizer_needs import KeyedQuantizedState


class ParamGroupsOwner(Protocol):
    """The optimizer whose ``param_groups`` the user (and schedulers) see."""

    param_groups: list[dict[str, Any]]


@dataclass(eq=False)
class OptimizerShards:
    """The layout, the flat buffers, the buckets (each holding this rank's shard of it) and
    the inner optimizer, with the groups they are sharded over.

    ``owner`` is the wrapper, whose ``param_groups`` (the wrapped optimizer's group dicts) are
    read from it at each use, as the wrapper's own methods read them; ``groups`` are the
    wrapper's process groups (see Note [Hybrid sharding] in ``hybrid_groups``), ``comm`` what
    the buckets share to run their collectives.
    """

    plan: LayoutPlan
    buffers: FlatBuffers
    comm: CommContext
    buckets: list[Bucket]
    inner: torch.optim.Optimizer
    owner: ParamGroupsOwner
    groups: ShardGroups
    shared_state_parts: tuple[str, ...] = ()
    """Inner tensors of quantized state values that every piece holds whole
    (``QuantizedBlocks.shared_parts``), see ``quantized_state``."""
    keyed_state: KeyedQuantizedState | None = None
    """How a class that keeps quantized state under keys lays it out (bitsandbytes), see
    ``keyed_state``."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.owner.param_groups

    def materialize(self, bucket: Bucket) -> None:
        """Give the bucket its grad buffer and shard, and the inner optimizer the shard's pieces
        (idempotent)."""
        shard = bucket.materialize()
        if shard is not None:
            add_shard(self.inner, shard)

    def live_shards(self) -> list[LocalShard]:
        """This rank's shards of the buckets that have one, in bucket order."""
        return [bucket.shard for bucket in self.buckets if bucket.shard is not None]

    def bucket_of(self, param_index: int) -> Bucket:
        """The bucket holding the (laid-out) param."""
        return self.buckets[self.plan.slot(param_index).bucket_index]

    def shard_of(self, param_index: int) -> LocalShard | None:
        """This rank's shard of the bucket holding the param."""
        return self.bucket_of(param_index).shard

    def local_grads(self) -> list[Tensor]:
        """The reduced grads the optimizer steps, one flat tensor per bucket with a shard."""
        return [shard.stepped_grad for shard in self.live_shards()]

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank (a quantized value's codes, scales
        and code book, see ``quantized_state``)."""
        return sum(state_nbytes(state) for state in self.inner.state.values())

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training, by kind (see ``ShardingStage1.memory_bytes``)."""

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "params": nbytes(self.buffers.param_buffers),
            "grads": nbytes(g for g in self.buffers.grad_buffers if g is not None),
            "reduced_grads": nbytes(t for bucket in self.buckets for t in bucket.reduced_grad_tensors()),
            "master": nbytes(s.master for s in self.live_shards() if s.master is not None),
            "published": nbytes(s.published for s in self.live_shards() if s.published is not None),
            "optimizer_state": self.optimizer_state_bytes(),
            "staging": self.comm.staging.nbytes,
        }
