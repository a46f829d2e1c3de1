"""What the planner is told about the machine: compute times, links, and how ranks sit on nodes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Collective = Literal["all_reduce", "reduce_scatter", "all_gather"]

BITS_PER_BYTE = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class AlphaBeta:
    """The cost of one collective: ``alpha_s`` per round of messages plus ``beta_s_per_byte`` per
    byte one rank sends (for a link shared by a node's ranks: per byte the node sends)."""

    alpha_s: float
    """Fixed cost of one round: latency plus the launch and handshake of a message."""
    beta_s_per_byte: float
    """Seconds per byte sent: 1 / bandwidth at the wire limit; more where the collective does
    not reach it (gloo's all-to-all on a link: the gloo table of
    ``benchmarks/results/2026-12-07-figures-from-library-notes.md``)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"AlphaBeta expects alpha_s >= 0 (finite) but got {self.alpha_s!r}")
        if not (math.isfinite(self.beta_s_per_byte) and self.beta_s_per_byte >= 0):
            raise ValueError(
                f"AlphaBeta expects beta_s_per_byte >= 0 (finite) but got {self.beta_s_per_byte!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCosts:
    """The cost of each collective the modes use (see ``cost.collective_s`` for the rounds and
    bytes each one has)."""

    all_reduce: AlphaBeta
    reduce_scatter: AlphaBeta
    """The wrapper's reduce-scatter: on gloo an all-to-all plus a local sum (Note
    [Reduce-scatter on gloo] in ``sharded_opt/comm/collectives.py``)."""
    all_gather: AlphaBeta

    def cost(self, kind: Collective) -> AlphaBeta:
        return getattr(self, kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkModel:
    """One link's collective costs, alone and with others in flight.

    gloo runs collectives issued together at once, and together they use a link better than one
    alone: a single all-to-all sends one direction after the other, several overlap each other's
    directions (Note [Reduce-scatter on gloo]). So a collective issued while the
    link is idle (overlap's reduce-scatters, issued one by one in backward) costs ``alone``, one
    issued behind others (sync's, every all-gather batch) costs ``in_flight``.
    """

    alone: CollectiveCosts
    in_flight: CollectiveCosts

    @classmethod
    def stated(cls, gbps: float, latency_us: float = 0.0) -> LinkModel:
        """A link of ``gbps`` Gbit/s each way and ``latency_us`` per message, every collective at
        its wire limit. gloo's collectives do not reach it on a real link (its all-to-all least
        of all; the gloo table of ``benchmarks/results/2026-12-07-figures-from-library-notes.md``);
        ``--calibrate`` measures what they do.

        Raises:
            ValueError: ``gbps`` not > 0 or ``latency_us`` < 0.
        """
        if not (math.isfinite(gbps) and gbps > 0):
            raise ValueError(f"LinkModel.stated expects gbps > 0 (finite) but got {gbps!r}")
        if not (math.isfinite(latency_us) and latency_us >= 0):
            raise ValueError(f"LinkModel.stated expects latency_us >= 0 but got {latency_us!r}")
        each = AlphaBeta(alpha_s=latency_us * 1e-6, beta_s_per_byte=BITS_PER_BYTE / (gbps * 1e9))
        costs = CollectiveCosts(all_reduce=each, reduce_scatter=each, all_gather=each)
        return cls(alone=costs, in_flight=costs)


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeTimes:
    """Seconds of one rank's compute per training step, without communication."""

    forward_s: float
    backward_s: float
    step_s: float
    """The plain optimizer's step over every param (what DDP runs)."""
    sharded_step_s: float | None = None
    """The wrapper's inner step over every param, cut into its per-param pieces and CPU chunks
    (Note [Per-param pieces]); a rank steps ``shard / total`` of it. None: ``step_s``."""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "step_s", "sharded_step_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"ComputeTimes expects {name} >= 0 (finite) but got {value!r}")

    @property
    def wrapper_step_s(self) -> float:
        return self.step_s if self.sharded_step_s is None else self.sharded_step_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """How many ranks, how they sit on nodes, and the links between them."""

    world_size: int
    ranks_per_node: int
    node_link: LinkModel
    """Between ranks of one node (loopback here, NVLink on a GPU node)."""
    link: LinkModel | None = None
    """Between nodes; needed only when ``ranks_per_node < world_size``."""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"plan expects world_size to be an int >= 1 but got {self.world_size!r}")
        if (
            isinstance(self.ranks_per_node, bool)
            or not isinstance(self.ranks_per_node, int)
            or self.ranks_per_node < 1
            or self.world_size % self.ranks_per_node
        ):
            raise ValueError(
                f"plan expects ranks_per_node to be an int >= 1 that divides world_size {self.world_size} "
                f"but got {self.ranks_per_node!r}"
            )
        if self.ranks_per_node < self.world_size and self.link is None:
            raise ValueError(
                f"plan expects a link between nodes for {self.world_size} ranks on nodes of "
                f"{self.ranks_per_node}, but got none; state it (--link GBPS[,LATENCY_US])"
            )
