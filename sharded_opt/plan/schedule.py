"""A step's timeline in each mode, simulated from per-bucket compute shares and collective costs.

The schedule is the one the library runs (docs/design.md, "One step, module by module"):

- overlap: forward runs module by module in registration order (buckets in reverse), each module
  waiting for the all-gather of its bucket from the previous step; backward fills buckets in
  plan order, each bucket's reduce-scatter (then, with replicas, its all-reduce across them)
  starts as its last grad lands (a bucket that stages its grads: by ``step()``, Note [Staged
  grads] in ``fusion.layout``); at the end of backward the presence flags go out on a group of
  their own; ``step()`` steps each bucket's shard as its reduction lands, then starts every
  all-gather in forward order and returns;
- sync: the same collectives, all started by ``step()`` after backward, which also waits for the
  all-gathers before it returns;
- ddp: DDP's buckets (its own sizes) all-reduced during backward as each fills; the optimizer
  steps every param once all reductions are done.

Each link is one queue: a collective starts when its inputs are ready and the collectives issued
before it on that link are done; it costs its ``alone`` time if it found the link idle and its
``in_flight`` time if it was queued behind others (``LinkModel``). Compute is not slowed by
communication; on one machine it is (loopback copies run on the cores compute uses), which
this model leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

from sharded_opt.plan.config import ComputeTimes


@dataclass(frozen=True, slots=True)
class Transfer:
    """One collective: the link it uses and its seconds alone and with others in flight."""

    link: str
    alone_s: float
    in_flight_s: float


NO_TRANSFER = Transfer("", 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class BucketCosts:
    """One bucket (in plan order, the order backward fills them) as the simulation sees it."""

    compute_share: float
    """Its share of forward and backward compute: its params' numel over the model's."""
    step_share: float
    """Its share of the optimizer step this rank runs: the elements it steps over the model's."""
    reduce: Transfer
    """Its grad reduction: reduce-scatter (sharded) or all-reduce (DDP)."""
    replica: Transfer = NO_TRANSFER
    """The all-reduce of its shard across replicas (hybrid sharding), after ``reduce``."""
    gather: Transfer = NO_TRANSFER
    """The all-gather of its updated shard."""
    at_step: bool = False
    """Reduced by ``step()`` in both modes: its grads are staged (Note [Staged grads] in
    ``fusion.layout``)."""


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Everything the simulation needs for one mode."""

    buckets: tuple[BucketCosts, ...]
    compute: ComputeTimes
    step_s: float
    """This mode's whole optimizer step over every param (``step_share`` of it per bucket)."""
    flags_s: float = 0.0
    """The presence flags' all-reduce at the end of backward (its own group, so no queue)."""


class _Links:
    """One FIFO queue per link: a collective starts once it is issued and the link is free."""

    def __init__(self) -> None:
        self._free_at: dict[str, float] = {}

    def run(self, transfer: Transfer, issued_s: float) -> float:
        """When ``transfer``, issued at ``issued_s``, is done."""
        free_at = self._free_at.get(transfer.link, 0.0)
        duration = transfer.alone_s if issued_s >= free_at else transfer.in_flight_s
        done = max(issued_s, free_at) + duration
        self._free_at[transfer.link] = done
        return done


@dataclass(frozen=True, slots=True)
class Timeline:
    """When each simulated ``step()`` returned, and when all its work was done."""

    step_ends_s: tuple[float, ...]
    settled_s: float

    def block_step_s(self) -> float:
        """Seconds per step of a block that ends by waiting for all work (``sync_params()``), as
        ``benchmarks.compare`` times it."""
        return self.settled_s / len(self.step_ends_s)

    def steady_step_s(self) -> float:
        """Seconds between the last two steps: a long run's step time."""
        if len(self.step_ends_s) < 2:
            return self.settled_s
        return self.step_ends_s[-1] - self.step_ends_s[-2]


def simulate(costs: StepCosts, mode: str, steps: int) -> Timeline:
    """``steps`` steps of ``mode`` (``"overlap"``, ``"sync"`` or ``"ddp"``) from idle."""
    if steps < 1:
        raise ValueError(f"simulate expects steps >= 1 but got {steps}")
    if mode == "ddp":
        return _simulate_ddp(costs, steps)
    if mode in ("overlap", "sync"):
        return _simulate_sharded(costs, steps, overlap=mode == "overlap")
    raise ValueError(f"simulate expects mode 'overlap', 'sync' or 'ddp' but got {mode!r}")


def _simulate_sharded(costs: StepCosts, steps: int, overlap: bool) -> Timeline:
    links = _Links()
    buckets = costs.buckets
    gathered = [0.0] * len(buckets)
    now, ends = 0.0, []
    for _ in range(steps):
        for index in reversed(range(len(buckets))):  # forward: registration order
            now = max(now, gathered[index]) + costs.compute.forward_s * buckets[index].compute_share
        during_backward: list[float | None] = []
        for bucket in buckets:
            now += costs.compute.backward_s * bucket.compute_share
            launches = overlap and not bucket.at_step
            during_backward.append(_reduce(links, bucket, now) if launches else None)
        flags_done = now + costs.flags_s
        reduced = [
            _reduce(links, bucket, now) if landed is None else landed
            for bucket, landed in zip(buckets, during_backward, strict=True)
        ]
        now = flags_done
        for bucket, landed in zip(buckets, reduced, strict=True):  # Note [Step pipeline]
            now = max(now, landed) + costs.step_s * bucket.step_share
        for index in reversed(range(len(buckets))):  # all-gathers in forward order
            gathered[index] = links.run(buckets[index].gather, now)
        if not overlap:
            now = max([now, *gathered])
        ends.append(now)
    return Timeline(tuple(ends), max([now, *gathered]))


def _reduce(links: _Links, bucket: BucketCosts, ready_s: float) -> float:
    done = links.run(bucket.reduce, ready_s)
    if bucket.replica is not NO_TRANSFER:
        done = links.run(bucket.replica, done)
    return done


def comm_only_s(buckets: tuple[BucketCosts, ...]) -> float:
    """Every reduction issued at once, then every all-gather: a sharded step's communication
    with nothing hidden (``benchmarks.compare``'s ``comm only`` pseudo-mode)."""
    links = _Links()
    reduced = max([_reduce(links, bucket, 0.0) for bucket in buckets], default=0.0)
    return max([reduced, *(links.run(bucket.gather, reduced) for bucket in reversed(buckets))])


def _simulate_ddp(costs: StepCosts, steps: int) -> Timeline:
    links = _Links()
    now, ends = 0.0, []
    for _ in range(steps):
        now += costs.compute.forward_s
        reduced = now
        for bucket in costs.buckets:
            now += costs.compute.backward_s * bucket.compute_share
            reduced = links.run(bucket.reduce, now)
        now = max(now, reduced) + costs.step_s
        ends.append(now)
    return Timeline(tuple(ends), now)
