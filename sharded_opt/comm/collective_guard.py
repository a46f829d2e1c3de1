"""Fail fast, naming the missing ranks, when only some ranks call a collective API.

Note [Collectives entered by some ranks]
    ``state_dict()``, ``load_state_dict()``, ``save_checkpoint()`` and ``load_checkpoint()`` are
    collective. The DDP habit ``if rank == 0: sd = opt.state_dict()`` makes rank 0 wait in a
    collective the others never join: it hangs for the group's whole timeout and then fails
    with an error that blames the idle ranks' connection rather than the call. So those entry
    points first check, with a bounded wait, that every rank of the group has called the same
    entry point, and otherwise raise an error that names the API, says it is collective, names
    the ranks that did not call it (or called another one) and gives the fix.

    The check goes through the group's rendezvous store (the TCP store every process group is
    built on), not through the backend: it works the same for gloo, NCCL and
    ``"cpu:gloo,cuda:nccl"`` groups, and every waiting rank learns who is missing. gloo's own
    ``monitored_barrier`` was not enough: only rank 0's wait in it is bounded, so when rank 0
    is the rank that skipped the call the others hang for good. Each rank counts its calls in
    the store (one counter per rank), publishes which entry point its n-th call is, and waits
    for the n-th call of every other rank. A rank that skipped a call is then behind by one for
    good, which is no loss: the program is wrong and the error says so.

    The timeout defaults to the group's collective timeout, so the check never fails where the
    collective itself would have waited successfully (a rank busy with rank-only work, say an
    evaluation, before it joins). Not the store's own timeout: ``init_parallel_env`` gives the
    store a longer one for the rendezvous (Note [Rendezvous apart from collectives] in
    ``launcher``). ``ShardingConfig.collective_entry_timeout_s`` shortens it.

    The counters belong to the group, and a wrapper's groups outlive it in the pool (Note
    [Reusing a dropped wrapper's groups] in ``communicator_pool``). Once the check failed, the
    ranks' counters stay apart, and every guarded call of the next wrapper on those groups would
    pair with the wrong call of another rank. So :class:`EntryGuard`, the check a wrapper runs,
    tells the wrapper to withhold its groups from the pool when the check fails.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup, Store

from sharded_opt.comm.collectives import collective_timeout

_KEY_PREFIX = "sharded_opt.collective_entry"


def check_all_ranks_enter(api: str, fix: str, group: ProcessGroup, timeout_s: float | None) -> None:
    """Wait until every rank of ``group`` has called ``api`` as often as this rank has; raise if
    one has not in time or called another guarded API instead.

    Args:
        api: the collective entry point, e.g. ``"ShardingStage1.state_dict"``.
        fix: how to call it correctly, appended to the error.
        group: the group the collective runs on.
        timeout_s: how long to wait for the other ranks; None: the group's own timeout.

    Raises:
        RuntimeError: some rank did not call ``api`` (or failed before it) within the timeout.
            See Note [Collectives entered by some ranks].
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    rank = dist.get_rank(group)
    store = _group_store(group)
    if timeout_s is not None:
        timeout = datetime.timedelta(seconds=timeout_s)
    else:
        timeout = collective_timeout(group) or store.timeout
    call = store.add(f"{_KEY_PREFIX}/{rank}/count", 1)
    keys = [f"{_KEY_PREFIX}/{other}/{call}" for other in range(world_size)]
    store.set(keys[rank], api)
    try:
        store.wait(keys, timeout)
    except RuntimeError:  # torch's DistStoreError on timeout
        missing = [other for other, key in enumerate(keys) if not store.check([key])]
        problem = f"rank(s) {missing} did not call it within {timeout.total_seconds():g} s"
    else:
        calls = {other: store.get(key).decode() for other, key in enumerate(keys)}
        others = {other: name for other, name in calls.items() if name != api}
        if not others:
            return
        problem = "; ".join(f"rank {other} called {name} instead" for other, name in others.items())
    raise RuntimeError(
        f"{api} is collective: every rank of the process group must call it, but {problem} "
        f"(this is call {call} on rank {rank}). {fix}. If a rank is only slow to get there, "
        "raise Strategy(sharding=ShardingConfig(collective_entry_timeout_s=...))"
    )


@dataclass(frozen=True)
class EntryGuard:
    """The check of Note [Collectives entered by some ranks] for one wrapper: its group, its
    timeout, and what to do when the ranks' counters are left apart (withhold the groups)."""

    group: ProcessGroup
    timeout_s: float | None
    on_counters_apart: Callable[[], None]

    def check(self, api: str, fix: str) -> None:
        """:func:`check_all_ranks_enter` on the wrapper's group."""
        try:
            check_all_ranks_enter(api, fix, self.group, self.timeout_s)
        except RuntimeError:
            self.on_counters_apart()
            raise


def _group_store(group: ProcessGroup) -> Store:
    # torch keeps each group's store (a prefix of the rendezvous store, unique to the group)
    # without a public accessor, so this reads it through torch's private helper.
    return dist.distributed_c10d._get_process_group_store(group)
