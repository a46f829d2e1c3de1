"""The alpha-beta cost of one collective in a group of ranks placed on the cluster's nodes.

Rounds and bytes are those of the algorithms the modes run: the wrapper's reduce-scatter is a
direct exchange (an all-to-all plus a local sum on gloo, Note [Reduce-scatter on gloo] in
``sharded_opt/comm/collectives.py``) and its all-gather one too, each with ``g - 1`` rounds and
``(g - 1) / g`` of the bucket sent per rank; an all-reduce (DDP's, hybrid sharding's across
replicas) is a ring, ``2 (g - 1)`` rounds and twice those bytes. A group inside one node runs on
the node's link. A group across nodes sends the part of its bytes addressed to other nodes over
the node's one link, which all ranks of the node use at once (every collective here is issued
by every rank), so the node's link carries ``ranks_per_node`` ranks' share of it. A compressed
collective (Note [Compressed wire] in ``sharded_opt/comm/compression.py``) takes the rounds of the
one it replaces or of an all-gather and sends its codec's rows (``wire``, :func:`sent_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sharded_opt.plan.config import Cluster, Collective, CollectiveCosts, LinkModel


@dataclass(frozen=True, slots=True)
class GroupPlacement:
    """A process group's size and how many of its ranks share a node."""

    size: int
    members_per_node: int

    @classmethod
    def consecutive(cls, size: int, cluster: Cluster) -> GroupPlacement:
        """A group of ``size`` consecutive ranks (the world, a shard group of hybrid sharding)."""
        return cls(size, min(size, cluster.ranks_per_node))

    @classmethod
    def strided(cls, size: int, stride: int, cluster: Cluster) -> GroupPlacement:
        """A group of ``size`` ranks ``stride`` apart (a replicate group of hybrid sharding)."""
        return cls(size, max(1, min(size, cluster.ranks_per_node // stride)))


def rounds(kind: Collective, group_size: int) -> int:
    """Message rounds one collective takes in a group of ``group_size`` ranks."""
    return 2 * (group_size - 1) if kind == "all_reduce" else group_size - 1


def wire_bytes(kind: Collective, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective over an ``nbytes`` tensor (the whole bucket), rounded
    down as ``ShardingStage1.wire_bytes()`` counts them."""
    share = nbytes * (group_size - 1) // group_size
    return 2 * share if kind == "all_reduce" else share


def collective_s(
    kind: Collective, nbytes: int, group: GroupPlacement, cluster: Cluster, *, alone: bool
) -> float:
    """Seconds one collective over ``nbytes`` takes on its link, ``alone`` or with others in
    flight (see ``LinkModel``)."""
    return sent_s(kind, wire_bytes(kind, nbytes, group.size), group, cluster, alone=alone)


def sent_s(kind: Collective, sent: int, group: GroupPlacement, cluster: Cluster, *, alone: bool) -> float:
    """Seconds one collective takes in which each rank sends ``sent`` bytes (a compressed one
    sends its codec's rows, ``sharded_opt/plan/wire.py``); see :func:`collective_s`."""
    if group.size == 1:
        return 0.0
    if group.members_per_node == group.size or cluster.link is None:
        cost = _costs(cluster.node_link, alone).cost(kind)
        return cost.alpha_s * rounds(kind, group.size) + cost.beta_s_per_byte * sent
    off_node = (group.size - group.members_per_node) / (group.size - 1)
    node_sent = cluster.ranks_per_node * off_node * sent
    cost = _costs(cluster.link, alone).cost(kind)
    return cost.alpha_s * rounds(kind, group.size) + cost.beta_s_per_byte * node_sent


def _costs(link: LinkModel, alone: bool) -> CollectiveCosts:
    return link.alone if alone else link.in_flight


def crosses_nodes(group: GroupPlacement, cluster: Cluster) -> bool:
    """Whether the group's collectives use the link between nodes (else the node's link)."""
    return group.members_per_node < group.size and cluster.link is not None
