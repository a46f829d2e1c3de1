"""Agreeing, bucket by bucket, which params got a grad on some rank.

Note [Presence per bucket]
    ``torch.optim`` skips a param whose grad is None, so before a bucket's shard is stepped
    every rank must agree which of its params got a grad on *some* rank (Note [Which params got
    a grad] in ``grad_hooks``): one byte per param, combined by a MAX all-reduce. That agreement
    used to be one all-reduce over every param, issued after the last bucket was launched. Gloo
    runs a group's collectives in issue order, so it completed only after every reduce-scatter,
    and no shard could be stepped before all of them had landed.

    A bucket's flags are final when the bucket is launched (a later grad for it raises in
    overlap mode; sync mode launches at ``step()``). Where the flags share the reductions' group
    (NCCL), each bucket's flags are all-reduced right before its own reduce-scatter: they land
    just before its grads, and the step can take the bucket as soon as its reduce-scatter
    completes (Note [Step pipeline] in ``step_pipeline``). Buckets that take no part in the
    reduction (every param frozen now, though a param may still hold an old grad that torch
    would step) share theirs in one all-reduce after the last launch.

    On gloo that per-bucket all-reduce queued behind the previous bucket's bytes on the socket
    and held one of the group's two worker threads while it waited, so a single reduce-scatter
    was on the wire at a time: the flags get a group of their own there. Nothing then orders
    them behind the reductions, so every bucket's flags travel in one all-reduce after the last
    launch (``per_bucket`` is False): it lands long before the last reduce-scatter, and one
    small collective per step instead of one per bucket wakes fewer gloo threads while backward
    fills the cores (measured in ``benchmarks/results/2026-12-03-flags-once-cpu-2core.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, Work

from fusion.layout import BucketPlan
from sharded_opt import collectives
from sharded_opt.validation import new_communicator


def presence_group(world: ProcessGroup, shard: ProcessGroup) -> ProcessGroup:
    """The group the presence flags are all-reduced on, for a wrapper communicating on ``world``
    and reducing its buckets on ``shard``: every rank of the wrapper, as a group of its own when
    the bucket reductions run on the same ranks over gloo (collective when it creates one; see
    Note [Presence per bucket])."""
    on_gloo = collectives.backend_for_device(world, "cpu") == "gloo"
    if not on_gloo or shard is not world or dist.get_world_size(world) == 1:
        return world
    ranks = dist.get_process_group_ranks(world)
    return new_communicator(ranks, world, local=len(ranks) != dist.get_world_size())


@dataclass(eq=False, slots=True)
class _SharedFlags:
    """One all-reduce of the flags of one or more buckets' params, in slot order (none on a
    single rank: ``agreed`` is then the flags themselves)."""

    flags: Tensor | None
    work: Work | None
    agreed: list[int] | None = None

    def values(self) -> list[int]:
        if self.agreed is None:  # then flags holds the all-reduce's tensor
            if self.work is not None:
                self.work.wait()
            self.agreed = self.flags.tolist()
        return self.agreed


class GradPresence:
    """Per bucket, the agreed "got a grad" flag of each of its params; see Note [Presence per
    bucket].

    Args:
        buckets: the layout's buckets.
        group: the group to agree over; ``world_size == 1`` agrees with nobody.
        device: where the flags are reduced (CPU on gloo, so reading them needs no device sync).
        per_bucket: share each bucket's flags right before its reduction; else all of them once,
            after the last launch.
    """

    def __init__(
        self,
        buckets: Sequence[BucketPlan],
        group: ProcessGroup,
        world_size: int,
        device: torch.device,
        per_bucket: bool,
    ) -> None:
        self.per_bucket = per_bucket
        self._buckets = buckets
        self.group = group
        self._world_size = world_size
        self._device = device
        self._pending: dict[int, tuple[_SharedFlags, int]] = {}
        """Per bucket whose flags were shared this iteration: the all-reduce and its offset."""

    def start(self, bucket_indices: Sequence[int], flags: list[int]) -> None:
        """Share ``flags``, one per slot of ``bucket_indices``' buckets in that order (1: the
        slot's param got a grad on this rank), in one asynchronous all-reduce; every rank must
        pass the same buckets in the same order."""
        if self._world_size == 1:
            shared = _SharedFlags(None, None, flags)
        else:
            shared_flags = torch.tensor(flags, dtype=torch.uint8, device=self._device)
            work = dist.all_reduce(shared_flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            shared = _SharedFlags(shared_flags, work)
        offset = 0
        for bucket_index in bucket_indices:
            self._pending[bucket_index] = (shared, offset)
            offset += len(self._buckets[bucket_index].slots)

    def ranks_flagging(self, flag: bool) -> list[int]:
        """The global ranks whose ``flag`` is set, agreed now by every rank of the group (a
        blocking all-reduce of one byte per rank; none on a single rank)."""
        if self._world_size == 1:
            return [dist.get_rank()] if flag else []
        flags = torch.zeros(self._world_size, dtype=torch.uint8, device=self._device)
        flags[dist.get_rank(self.group)] = flag
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [dist.get_global_rank(self.group, rank) for rank, set_ in enumerate(flags.tolist()) if set_]

    def unshared(self) -> list[int]:
        """Buckets whose flags were not shared this iteration, in bucket order."""
        return [bucket.index for bucket in self._buckets if bucket.index not in self._pending]

    def agreed(self, bucket_index: int) -> list[int]:
        """Per slot of the bucket (layout order), 1 if its param got a grad on some rank; waits
        for the bucket's all-reduce.

        Raises:
            RuntimeError: the bucket's flags were not shared this iteration.
        """
        entry = self._pending.get(bucket_index)
        if entry is None:
            raise RuntimeError(
                f"ShardingStage1: the grad presence flags of bucket {bucket_index} were never shared"
            )
        shared, offset = entry
        return shared.values()[offset : offset + len(self._buckets[bucket_index].slots)]

    def params_with_grads(self, bucket_index: int) -> set[int]:
        """The param indices of the bucket's slots whose param got a grad on some rank (waits,
        as :meth:`agreed` does)."""
        slots = self._buckets[bucket_index].slots
        return {slot.param_index for slot, flag in zip(slots, self.agreed(bucket_index), strict=True) if flag}

    def discard(self) -> None:
        """Wait for every flag all-reduce still running and forget them (a new iteration)."""
        for shared, _ in self._pending.values():
            shared.values()
        self._pending = {}
