"""A step's timeline in each mode, simulated from per-bucket compute shares and collective costs.

The schedule is the one the library runs (docs/design.md, "One step, module by module"):

- overlap: forward runs module by module in registration order (buckets in reverse), each module
  waiting for the all-gather of its bucket from the previous step; backward fills buckets in
  plan order, each bucket's reduce-scatter (then, with replicas, its all-reduce across them)
  starts as its last grad lands; at the end of backward the presence flags go out on a group of
  their own; ``step()`` steps each bucket's shard as its reduction lands, then starts every
  all-gather in forward order and returns;
- sync: the same collectives, all started by ``step()`` after backward, which also waits for the
  all-gathers before it returns;
- ddp: DDP's buckets (its own sizes) all-reduced during backward as each fills; the optimizer
  steps every param once all reductions are done.

Each link is one queue: a collective starts when its inputs are ready and the collectives issued
before it on that link are done (the costs were fitted with several collectives in flight, as
the modes run them). Compute is not slowed by communication; on one machine it is (loopback
copies run on the cores compute uses), which this model leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

from sharded_opt.plan.config import ComputeTimes


@dataclass(frozen=True, slots=True)
class BucketCosts:
    """One bucket (in plan order, the order backward fills them) as the simulation sees it."""

    compute_share: float
    """Its share of forward and backward compute: its params' numel over the model's."""
    step_share: float
    """Its share of the optimizer step this rank runs: the elements it steps over the model's."""
    reduce_s: float
    """Its grad reduction: reduce-scatter (sharded) or all-reduce (DDP)."""
    reduce_link: str
    replica_s: float = 0.0
    """The all-reduce of its shard across replicas (hybrid sharding), after ``reduce_s``."""
    replica_link: str = ""
    gather_s: float = 0.0
    """The all-gather of its updated shard."""
    gather_link: str = ""


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

    def run(self, link: str, issued_s: float, duration_s: float) -> float:
        start = max(issued_s, self._free_at.get(link, 0.0))
        self._free_at[link] = start + duration_s
        return start + duration_s


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
        reduced = []
        for bucket in buckets:
            now += costs.compute.backward_s * bucket.compute_share
            if overlap:
                reduced.append(_reduce(links, bucket, now))
        flags_done = now + costs.flags_s
        if not overlap:
            reduced = [_reduce(links, bucket, now) for bucket in buckets]
        now = flags_done
        for bucket, landed in zip(buckets, reduced, strict=True):  # Note [Step pipeline]
            now = max(now, landed) + costs.step_s * bucket.step_share
        for index in reversed(range(len(buckets))):  # all-gathers in forward order
            gathered[index] = links.run(buckets[index].gather_link, now, buckets[index].gather_s)
        if not overlap:
            now = max([now, *gathered])
        ends.append(now)
    return Timeline(tuple(ends), max([now, *gathered]))


def _reduce(links: _Links, bucket: BucketCosts, ready_s: float) -> float:
    done = links.run(bucket.reduce_link, ready_s, bucket.reduce_s)
    if bucket.replica_s:
        done = links.run(bucket.replica_link, done, bucket.replica_s)
    return done


def _simulate_ddp(costs: StepCosts, steps: int) -> Timeline:
    links = _Links()
    now, ends = 0.0, []
    for _ in range(steps):
        now += costs.compute.forward_s
        reduced = now
        for bucket in costs.buckets:
            now += costs.compute.backward_s * bucket.compute_share
            reduced = links.run(bucket.reduce_link, now, bucket.reduce_s)
        now = max(now, reduced) + costs.step_s
        ends.append(now)
    return Timeline(tuple(ends), now)
