"""``WrapperLifetime``: what a ``ShardingStage1`` must give back when it is closed or dropped.

A wrapper holds things that outlive it unless given back: the lease on its process groups
(Note [Reusing a dropped wrapper's groups] in ``communicator_pool``), hooks on the user's params,
model and torch optimizer (Note [Hook lifetimes and copies] in ``weak_hooks``), and the wrapped
optimizer's refusals. Nobody calls ``close()`` on a torch optimizer, so each is given back twice
over: at once by ``close()`` (or the end of a ``with`` block), and by a finalizer on the wrapper
when a dropped one is collected. The finalizer's arguments must not refer to the wrapper (they
would keep it alive forever): they are this object's handle lists and the wrapper's ``ParamSync``.
"""

from __future__ import annotations

import weakref

from torch.utils.hooks import RemovableHandle

from sharded_opt.comm.communicator_pool import (
    CommunicatorLease,
    groups_can_be_destroyed,
    release_communicators,
)
from sharded_opt.comm.hybrid_groups import ShardGroups
from sharded_opt.guards.messages import closed_error
from sharded_opt.guards.wrapped_guard import WrappedOptimizerGuard
from sharded_opt.model_hooks.weak_hooks import remove_handles
from sharded_opt.step.param_sync import ParamSync


class WrapperLifetime:
    """The wrapper's groups and hooks, from construction until :meth:`close` or collection.

    Args:
        wrapper: the ``ShardingStage1`` whose collection removes the hooks; not kept.
        lease: the wrapper's hold on its process groups; the pool takes them back when the lease
            is collected with the wrapper, unless :meth:`close` destroyed or withheld them first.
        param_sync: its all-gathers are finished before the hooks go (a new wrapper over the same
            params may copy them next).
        tracker_handles: the grad hooks' handles, the tracker's own list (not a copy): it grows
            when params are unfrozen later.
    """

    def __init__(
        self,
        wrapper: object,
        lease: CommunicatorLease[ShardGroups],
        param_sync: ParamSync,
        tracker_handles: list[RemovableHandle],
    ) -> None:
        self._lease = lease
        self._hook_handles: list[RemovableHandle] = []
        """Hooks to remove besides the grad hooks: the attached model's, the wrapper's own."""
        self._closed = False
        self._wrapped_guard: WrappedOptimizerGuard | None = None
        self._release = weakref.finalize(
            wrapper, _release_hooks, param_sync, self._hook_handles, tracker_handles
        )
        # At interpreter exit the process group may be gone; there is nothing to wait for then.
        self._release.atexit = False

    def keep_hooks(self, handles: list[RemovableHandle]) -> None:
        """Remove ``handles`` with the others (an attached model's hooks)."""
        self._hook_handles += handles

    def keep_wrapped_guard(self, wrapped_guard: WrappedOptimizerGuard) -> None:
        """Release ``wrapped_guard`` at :meth:`close` and remove its hooks with the others; a
        dropped wrapper's torch optimizer keeps refusing ``step()`` (ranks would diverge)."""
        self._wrapped_guard = wrapped_guard
        self.keep_hooks(wrapped_guard.wrapper_handles)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def check_open(self, method: str) -> None:
        """Refuse ``ShardingStage1.<method>`` after :meth:`close`: its hooks or groups are gone."""
        if self._closed:
            raise RuntimeError(closed_error(f"ShardingStage1.{method}"))

    def close(self, release_groups: bool) -> None:
        """Finish the all-gathers, remove every hook, let the torch optimizer work on its own again
        and, with ``release_groups`` (collective), destroy the groups or give them back to the pool
        (Note [Releasing a wrapper's groups]). Without it (an exception ended a ``with`` block, the
        other ranks may never get here) the groups are withheld. Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        groups = self._lease.groups
        destroy = release_groups and groups_can_be_destroyed(groups.world)
        if destroy or not release_groups:
            # Destroyed below, or an exception may have left this rank's collectives on them
            # unmatched: never reused (Note [Reusing a dropped wrapper's groups]).
            self._lease.withhold()
        self._release()
        if self._wrapped_guard is not None:
            self._wrapped_guard.release()
        if destroy:
            release_communicators(groups.owned())
            self._lease.remove()
        elif release_groups:
            self._lease.give_back()


def _release_hooks(param_sync: ParamSync, *handle_lists: list[RemovableHandle]) -> None:
    """Finish the all-gathers still writing the params (a new wrapper may copy them next), then
    remove every hook."""
    param_sync.finish_gathers()
    for handles in handle_lists:
        remove_handles(handles)
