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
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import Work

from fusion.layout import BucketPlan
from sharded_opt.comm.hybrid_groups import ShardGroups


@dataclass(eq=False, slots=True)
class _FlagsAllReduce:
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


@dataclass(frozen=True, slots=True)
class SharedFlags:
    """One bucket's flags within an all-reduce of several buckets' (``Bucket.flags``)."""

    all_reduce: _FlagsAllReduce
    start: int
    stop: int

    def values(self) -> list[int]:
        """The agreed flags, per slot of the bucket; waits for the all-reduce."""
        return self.all_reduce.values()[self.start : self.stop]


class FlagHolder(Protocol):
    """A bucket as the flags see it (``sharded_opt.step.bucket.Bucket``): its slots, and where its
    agreed flags go."""

    plan: BucketPlan
    flags: SharedFlags | None


class GradPresence:
    """Shares each bucket's "got a grad" flags of its params and agrees on them over the group;
    each bucket holds its own agreed flags (``Bucket.flags``). See Note [Presence per bucket].

    Args:
        buckets: the wrapper's buckets, in bucket order.
        groups: the wrapper's groups; the flags are agreed over ``groups.presence``, with nobody
            on a single rank.
        device: where the flags are reduced (CPU on gloo, so reading them needs no device sync).
        per_bucket: share each bucket's flags right before its reduction; else all of them once,
            after the last launch.
    """

    def __init__(
        self, buckets: Sequence[FlagHolder], groups: ShardGroups, device: torch.device, per_bucket: bool
    ) -> None:
        self.per_bucket = per_bucket
        self._buckets = buckets
        self.group = groups.presence
        self._world_size = groups.world_size
        self._device = device

    def start(self, buckets: Sequence[FlagHolder], flags: list[int]) -> None:
        """Share ``flags``, one per slot of ``buckets`` in that order (1: the slot's param got a
        grad on this rank), in one asynchronous all-reduce; every rank must pass the same buckets
        in the same order."""
        if self._world_size == 1:
            shared = _FlagsAllReduce(None, None, flags)
        else:
            shared_flags = torch.tensor(flags, dtype=torch.uint8, device=self._device)
            work = dist.all_reduce(shared_flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            shared = _FlagsAllReduce(shared_flags, work)
        offset = 0
        for bucket in buckets:
            end = offset + len(bucket.plan.slots)
            bucket.flags = SharedFlags(shared, offset, end)
            offset = end

    def ranks_flagging(self, flag: bool) -> list[int]:
        """The global ranks whose ``flag`` is set, agreed now by every rank of the group (a
        blocking all-reduce of one byte per rank; none on a single rank)."""
        if self._world_size == 1:
            return [dist.get_rank()] if flag else []
        flags = torch.zeros(self._world_size, dtype=torch.uint8, device=self._device)
        flags[dist.get_rank(self.group)] = flag
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [dist.get_global_rank(self.group, rank) for rank, set_ in enumerate(flags.tolist()) if set_]

    def unshared(self) -> list[FlagHolder]:
        """Buckets whose flags were not shared this iteration, in bucket order."""
        return [bucket for bucket in self._buckets if bucket.flags is None]

    def discard(self) -> None:
        """Wait for every flag all-reduce still running and forget them (a new iteration)."""
        for bucket in self._buckets:
            if bucket.flags is not None:
                bucket.flags.values()
                bucket.flags = None
