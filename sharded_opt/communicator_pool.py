"""The process groups of dropped wrappers, reused by the next wrapper over the same ranks.

Note [Reusing a dropped wrapper's groups]
    Every wrapper communicates on groups of its own (Note [One communicator per wrapper] in
    ``validation``), and each group holds threads and sockets (gloo: about six threads a
    wrapper) and, on NCCL, device memory, until it is destroyed. Nobody calls ``close()`` on a
    torch optimizer, so a process that builds a wrapper per phase or per trial and drops it
    would pile up groups without end (measured before this pool: 100 wrappers dropped in a loop
    on 2 gloo ranks left 605 threads and 201 groups per rank). Here a dropped wrapper's groups
    go back to a pool when the wrapper is collected, and the next wrapper with the same *key*
    (its ranks, backend, timeout, hybrid grid and torch's debug level: everything its groups
    are made from) takes them instead of creating new ones. The groups then number as many as
    the most wrappers of a key alive at once. A construction that finds no entry free pays one
    full garbage collection (its cost grows with the process's live objects), and ``close()``
    avoids that: it destroys the groups or gives them back at once.

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
    wrapper's collectives on it were issued alike on every rank (its last all-gathers, a
    reduction started by a backward that no ``step()`` followed): the new wrapper's collectives
    queue behind them and pair with their counterparts. Two wrappers alive at once never hold
    the same entry. A wrapper closed by an exception (the end of a ``with`` block) may have
    left collectives that some rank never issued, so its entry is withheld: never given back.
    ``close()`` destroys the groups where that is safe and takes the entry out of the pool
    (Note [Releasing a wrapper's groups] in ``validation``); for a wrapper over a strict subgroup,
    whose groups cannot be destroyed safely, ``close()`` gives them back to the pool instead.

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
