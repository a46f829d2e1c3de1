"""``OptimizerShards``: this rank's shards of every bucket and the inner optimizer that steps them.

The one object that knows where the optimizer state lives. The wrapper's runtime pieces (the
grad hooks, which give a bucket its shard when a param of it starts to require grad) and the
state conversions (``state_dict``, DCP checkpoints) reach the state through it, so none of them
needs the wrapper itself.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
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
from sharded_opt.step.quantized_state import SharedCodeBooks, states_nbytes

if TYPE_CHECKING:
    from sharded_opt.guards.optimizer_needs import FreshState, KeyedQuantizedState


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
    fresh_state: FreshState | None = None
    """How the class builds a tensor's first state, quantized or plain
    (``QuantizedBlocks.fresh_state``), see :meth:`start_pieces`."""
    code_books: SharedCodeBooks | None = None
    """The code books the pieces' quantized values share, see Note [Shared code books]."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.owner.param_groups

    def materialize(self, bucket: Bucket) -> None:
        """Give the bucket its grad buffer and shard, and the inner optimizer the shard's pieces
        (idempotent)."""
        shard = bucket.materialize()
        if shard is not None:
            add_shard(self.inner, shard)

    def start_pieces(self, shard: LocalShard, owners: Container[int] | None) -> None:
        """Before a step over ``shard``'s pieces (of the params in ``owners``; None: all of
        them): give each piece without state whose own size would make the class decide
        otherwise than for its param the state the class builds for its param's decision (Note
        [Cuts on quantization blocks] in ``fusion/block_layout.py``); the class then steps it as
        it finds it. Nothing to do for a class that declares no ``fresh_state``."""
        grid = shard.bucket.block_grid
        if self.fresh_state is None or grid is None:
            return
        group = self.inner.param_groups[shard.bucket.group_index]
        for piece, owner in zip(shard.inner_params, shard.inner_owners, strict=True):
            if owners is not None and owner not in owners:
                continue
            quantized = grid.quantizes(self.buffers.params[owner].numel())
            if not self.inner.state.get(piece) and quantized != grid.quantizes(piece.numel()):
                self.inner.state[piece] = self.fresh_state(self.inner, group, piece, quantized)

    def share_code_books(self, pieces: Iterable[Tensor]) -> None:
        """After a step over ``pieces``: one code book per distinct table on this rank, see Note
        [Shared code books] in ``quantized_state``."""
        if self.code_books is not None:
            for piece in pieces:
                state = self.inner.state.get(piece)
                if state:
                    self.code_books.share(state)

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
        and code book, see ``quantized_state``), a tensor shared by several values once."""
        return states_nbytes(self.inner.state.values())

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
            "grad_residual": nbytes(b.grad_residual for b in self.buckets if b.grad_residual is not None),
        }
