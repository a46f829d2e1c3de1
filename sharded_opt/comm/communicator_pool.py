"""The wrapper's own process groups from creation to destruction: each wrapper communicates on
groups of its own (Note [One communicator per wrapper]), a dropped wrapper's groups are reused
by the next wrapper over the same ranks (the pool), and ``close()`` destroys them (Note
[Releasing a wrapper's groups]).

Note [Reusing a dropped wrapper's groups]
    Every wrapper communicates on groups of its own (Note [One communicator per wrapper]), and each
    group holds threads and sockets (gloo: about six threads a wrapper) and, on NCCL, device
    memory, until it is destroyed. Nobody calls ``close()`` on a torch optimizer, so a process that
    builds a wrapper per phase or per trial and drops it would pile up groups without end (measured
    before this pool: 100 wrappers dropped in a loop on 2 gloo ranks left 605 threads and 201
    groups per rank). Here a dropped wrapper's groups go back to a pool when the wrapper is
    collected, and the next wrapper with the same *key* (its ranks, backend, timeout, hybrid grid
    and torch's debug level: everything its groups are made from) takes them instead of creating
    new ones. The groups then number as many as the most wrappers of a key alive at once. A
    construction that finds no entry free pays one full garbage collection (its cost grows with the
    process's live objects), and ``close()`` avoids that: it destroys the groups or gives them back
    at once.

    Whether an entry is free is a fact of each rank: the wrapper lives in reference cycles and
    is collected by the garbage collector, which runs at different times on each rank. So the
    pick is agreed at construction: each rank gathers every rank's set of free entries over the
    user's group (construction is collective and ordered alike on every rank among the user's
    own collectives on it) and every rank takes the lowest entry free everywhere. When none is,
    every rank (the agreed answer is the same on each) runs ``gc.collect()``, which gives back
    the groups of wrappers dropped but not yet collected, and agrees again; only then is a new
    entry created, by every rank together. Entries are created and removed only collectively,
    so every rank of a key holds as many, in the same order.

    Collectives pair up in issue order, so reusing a group is safe exactly when the dropped
    wrapper's collectives on it were issued alike on every rank (its last all-gathers, a reduction
    started by a backward that no ``step()`` followed): the new wrapper's collectives queue behind
    them and pair with their counterparts. Two wrappers alive at once never hold the same entry. A
    wrapper closed by an exception (the end of a ``with`` block) may have left collectives that
    some rank never issued, so its entry is withheld: never given back. ``close()`` destroys the
    groups where that is safe and takes the entry out of the pool (Note [Releasing a wrapper's
    groups]); for a wrapper over a strict subgroup, whose groups cannot be destroyed safely,
    ``close()`` gives them back to the pool instead.

    The pool is process-wide state, which the library otherwise avoids, because what it stands
    for is: torch's own registry of groups is process-wide. It is kept per default process group,
    weakly, so that it dies with the world: ``destroy_process_group()`` followed by a new
    ``init_process_group`` (tests do that many times in one process) starts with an empty pool,
    and the dead world's groups are freed with it.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from sharded_opt.comm.collectives import collective_timeout

GroupsT = TypeVar("GroupsT")


@dataclass(eq=False, slots=True)
class _Entry(Generic[GroupsT]):
    """One set of groups that one wrapper at a time communicates on."""

    groups: GroupsT
    leased: bool = True


_POOLS: weakref.WeakKeyDictionary[ProcessGroup, dict[Hashable, list[_Entry]]] = weakref.WeakKeyDictionary()
"""Per default process group, per key, its entries in creation order (Note [Reusing a dropped
wrapper's groups])."""


class CommunicatorLease(Generic[GroupsT]):
    """A wrapper's hold on one entry of the pool: the entry goes back to the pool when this
    object is collected or :meth:`give_back` is called, unless :meth:`withhold` came first."""

    def __init__(self, entries: list[_Entry[GroupsT]], entry: _Entry[GroupsT]) -> None:
        self.groups = entry.groups
        self._entries = entries
        self._entry = entry
        self._give_back = weakref.finalize(self, _mark_free, entry)

    def give_back(self) -> None:
        """Let the next wrapper of the same key take the groups (once; later calls do nothing)."""
        self._give_back()

    def withhold(self) -> None:
        """Never give the groups back: this rank may have left collectives on them that the
        other ranks never issued, or they are about to be destroyed."""
        self._give_back.detach()

    def remove(self) -> None:
        """Take the entry out of the pool, its groups destroyed (collective: every rank removes
        the same entry, so every rank keeps as many entries)."""
        self.withhold()
        self._entries.remove(self._entry)


def _mark_free(entry: _Entry) -> None:
    entry.leased = False


def lease_groups(
    key: Hashable, agree_over: Sequence[ProcessGroup], create: Callable[[], GroupsT]
) -> CommunicatorLease[GroupsT]:
    """Groups for a new wrapper: an entry of ``key`` free on every rank, else new ones from
    ``create()`` (collective over ``agree_over``, whose groups together span every rank of the
    key, each called in the same order on its members; see Note [Reusing a dropped wrapper's
    groups])."""
    entries = _POOLS.setdefault(dist.group.WORLD, {}).setdefault(key, [])
    index = _free_everywhere(entries, agree_over)
    if index is None and entries:
        gc.collect()  # wrappers dropped but not yet collected give their groups back now
        index = _free_everywhere(entries, agree_over)
    if index is None:
        entries.append(_Entry(create()))
        index = len(entries) - 1
    entry = entries[index]
    entry.leased = True
    return CommunicatorLease(entries, entry)


def _free_everywhere(entries: list[_Entry], agree_over: Sequence[ProcessGroup]) -> int | None:
    """The lowest index of an entry free on every rank, or None; no collective without
    entries (every rank has as many)."""
    if not entries:
        return None
    free = {index for index, entry in enumerate(entries) if not entry.leased}
    for group in agree_over:
        everyone: list[set[int] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, free, group=group)
        free = set.intersection(*(theirs or set() for theirs in everyone))
    return min(free, default=None)


def new_communicator(ranks: list[int], like: ProcessGroup, local: bool) -> ProcessGroup:
    """A new group of the global ``ranks`` with ``like``'s backend and timeout; ``local``: created
    by its members only.

    Note [One communicator per wrapper]
        Collectives on one process group pair up across ranks in issue order, whoever issued them.
        Two wrappers on the same group (a GAN's generator and discriminator, say) issue their
        overlap-mode reductions from backward hooks, and ranks that run the two backwards in
        different orders would pair one wrapper's collective with the other's: silently wrong
        numbers for equal sizes, an abort for different ones. So each wrapper communicates on a
        group of its own with the same ranks, backend and timeout as the user's group; every
        collective of the wrapper (bucket reductions and all-gathers, clipping norms, the scaler's
        inf flag, state dicts, checkpoints, the initial broadcast) then runs on it and is ordered
        only against its own kind. The one exception is the agreement at construction on which of
        the pool's groups to take (Note [Reusing a dropped wrapper's groups]): it runs on the
        user's group, where construction, being collective, has the same place among the user's
        collectives on every rank. Two wrappers alive at once never share a group; a wrapper built
        after another was dropped may take over its groups.

        Over the whole world, a new group is created by every rank together (every rank builds
        the wrapper), and torch names it by a counter of groups created so far, the same on
        every rank. Over a subgroup, ``use_local_synchronization=True`` lets only the members
        take part; torch then names the group after its ranks and the number of groups this
        process belongs to, so members must belong to equally many groups (a group a rank is
        not in does not count: ``new_group([0])`` on two ranks would make the names differ);
        otherwise the creation waits and fails after the group's timeout. One group per
        wrapper, none per step (on gloo a second one carries the presence flags, Note
        [Presence per bucket] in ``grad_presence``); a dropped wrapper gives them back for the
        next one and ``close()`` destroys them, see Note [Releasing a wrapper's groups].
    """
    return dist.new_group(
        ranks=ranks,
        timeout=collective_timeout(like),
        backend=dist.get_backend(like),
        use_local_synchronization=local,
    )


def groups_can_be_destroyed(world: ProcessGroup) -> bool:
    """Whether ``close()`` destroys the wrapper's groups: those over the whole world, while the
    default group lives (Note [Releasing a wrapper's groups])."""
    return dist.is_initialized() and dist.get_world_size(world) == dist.get_world_size()


def release_communicators(groups: list[ProcessGroup]) -> None:
    """Destroy the wrapper's own ``groups`` (in the same order on every rank), once every rank
    has finished with them (collective).

    Note [Releasing a wrapper's groups]
        Each group holds threads and sockets (gloo: about six threads a group, twice that under
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) until it is destroyed. A dropped wrapper's groups go
        back to a pool and the next wrapper over the same ranks takes them (Note [Reusing a dropped
        wrapper's groups]), so a loop that builds wrappers without closing them stays bounded by
        the most wrappers alive at once. ``close()`` goes further and destroys them now, after a
        barrier on each: a rank may destroy a group only when no peer still waits on it, and the
        barrier also completes every collective issued before it on that group (the last
        all-gathers, a reduction started by a backward that no ``step()`` followed). Hence
        ``close()`` is collective, like ``destroy_process_group``.

        Only groups over the whole world are destroyed. torch names those by a counter that
        never repeats; a group created by its members only (a wrapper over a strict subgroup)
        is named after its ranks and the number of live groups, so destroying it would let
        the next such group take the same name, and that group's rendezvous reads the stale
        keys the old one left in the store and hangs (measured: the second of two [0, 1]
        groups created and destroyed in turn on three ranks never connects). ``close()`` gives
        those back to the pool instead: the next wrapper over the same ranks reuses them, so
        they do not pile up either, and they go when the default group is destroyed.
    """
    for group in groups:
        try:
            dist.barrier(group=group)
        except RuntimeError as error:
            raise RuntimeError(
                "ShardingStage1.close() is collective: call it on every rank of the wrapper. "
                f"This rank waited for the others at close() and gave up ({error})"
            ) from error
        dist.destroy_process_group(group)
