"""The process groups of hybrid sharding: shard within groups of ``k`` ranks, replicate across them.

Note [Hybrid sharding]
    The ranks form a grid of ``r`` rows of ``k`` ranks (``r * k`` = the world). Each row is a
    *shard group*: its ``k`` ranks split every bucket into ``k`` shards, as full sharding does
    over the whole world. Each column is a *replicate group*: its ``r`` ranks hold the same shard
    of every bucket. Per bucket, grads are reduce-scattered (averaged) within the shard group, the
    shard is then averaged across the replicate group (only 1/k of the bucket crosses that link),
    every rank steps its shard, and the updated shards are all-gathered within the shard group.
    The grad average is the world's: the mean of the ``r`` row means of ``k`` ranks each.

    With ``degree=k``, rows are ``k`` consecutive ranks (a node's ranks under torchrun). With a
    2-D ``DeviceMesh`` of dims (replicate, shard), as FSDP2's HSDP takes it, rows are the mesh's
    rows. Every subgroup is created once, when the wrapper is built, by every rank of the world
    in the same order (rows first, then columns), as ``torch.distributed.new_group`` requires;
    when the grid covers only part of the world (a ``process_group`` or mesh over some ranks),
    each rank creates only its own row and column, by their members alone (each member then
    belongs to equally many groups, which torch's naming of such groups needs). Like the
    wrapper's own communicator (Note [One communicator per wrapper] in ``communicator_pool``)
    they are groups of the wrapper's own, so its collectives never pair with anyone else's;
    they are created together with it and reused with it by a later wrapper of the same grid
    (Note [Reusing a dropped wrapper's groups] in ``communicator_pool``).

    ``k == world`` is full sharding (one row, no replicate group) and ``k == 1`` is plain data
    parallelism over the world (every rank holds everything; grads are all-reduced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from sharded_opt.comm.collectives import backend_for_device, collective_timeout
from sharded_opt.comm.communicator_pool import CommunicatorLease, lease_groups, new_communicator


@dataclass(frozen=True, slots=True)
class ShardGroups:
    """This rank's view of the grid, see Note [Hybrid sharding].

    Attributes:
        world: the wrapper's communicator over every rank of the grid.
        shard: the communicator of this rank's row; ``world`` itself for full sharding.
        shard_rank: this rank's index in ``shard``.
        shard_size: ``k``, the number of shards of every bucket.
        replicate: the communicator of this rank's column; None when ``r`` is 1.
        replica_rank: this rank's row (its index in ``replicate``), 0 without replicas.
        num_replicas: ``r``.
        grid: the global ranks of every row.
        presence: the group the grad presence flags are agreed on (Note [Presence per bucket]
            in ``grad_presence``): ``world``, or one of its own over the same ranks on gloo.
        world_rank: this rank's index in ``world``.
        world_size: the number of ranks of the wrapper, ``r * k``.
    """

    world: ProcessGroup
    shard: ProcessGroup
    shard_rank: int
    shard_size: int
    replicate: ProcessGroup | None
    replica_rank: int
    num_replicas: int
    grid: tuple[tuple[int, ...], ...]
    presence: ProcessGroup
    world_rank: int
    world_size: int

    def owned(self) -> list[ProcessGroup]:
        """Every group of the wrapper's own, each once, in the same order on every rank."""
        groups = dict.fromkeys([self.world, self.shard, self.replicate, self.presence])
        return [group for group in groups if group is not None]


def presence_group(world: ProcessGroup, shard: ProcessGroup) -> ProcessGroup:
    """The group the presence flags are all-reduced on, for a wrapper communicating on ``world``
    and reducing its buckets on ``shard``: every rank of the wrapper, as a group of its own when
    the bucket reductions run on the same ranks over gloo (collective when it creates one; see
    Note [Presence per bucket] in ``grad_presence``)."""
    on_gloo = backend_for_device(world, "cpu") == "gloo"
    if not on_gloo or shard is not world or dist.get_world_size(world) == 1:
        return world
    ranks = dist.get_process_group_ranks(world)
    return new_communicator(ranks, world, local=len(ranks) != dist.get_world_size())


def user_group(process_group: ProcessGroup | None) -> ProcessGroup:
    """The user's group (default: the whole world), checked: the wrapper's own communicators are
    made over the same ranks (Note [One communicator per wrapper] in ``communicator_pool``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ShardingStage1 needs an initialized torch.distributed process group; call "
            "sharded_opt.init_parallel_env() first (under sharded_opt.spawn or torchrun), or "
            "torch.distributed.init_process_group(...)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError("ShardingStage1 was given a process_group that this rank is not a member of")
    return group


def lease_shard_groups(
    process_group: ProcessGroup | None, degree: int | None, device_mesh: DeviceMesh | None, sharded: bool
) -> CommunicatorLease[ShardGroups]:
    """The wrapper's groups from its arguments, a dropped wrapper's where one of the same key is
    free on every rank (collective; Note [Reusing a dropped wrapper's groups]);
    ``sharded=False`` (plain data parallel) uses no subgroups.

    Raises:
        ValueError: both ``device_mesh`` and ``process_group`` or ``degree``; a ``degree`` that
            does not divide the world size; a mesh that is not 2-D or lacks this rank.
        TypeError: ``device_mesh`` is not a ``DeviceMesh``.
        RuntimeError: no initialized process group.
    """
    if device_mesh is None:
        like = user_group(process_group)
        ranks = dist.get_process_group_ranks(like)
        grid = grid_of_degree(ranks, degree) if sharded else None
        agree_over = [like]
    else:
        if process_group is not None or degree is not None:
            raise ValueError(
                "ShardingStage1 expects either device_mesh or process_group / Strategy().sharding.degree "
                "but got both; the mesh's rows already are the shard groups, so pass only device_mesh"
            )
        mesh_grid = grid_of_mesh(device_mesh)
        grid = mesh_grid if sharded else None
        ranks = sorted(rank for row in mesh_grid for rank in row)
        if len(ranks) == dist.get_world_size():
            like = user_group(None)
            agree_over = [like]
        else:  # the mesh's rows, then its columns: every rank of the grid between them
            like = device_mesh.get_group(0)
            agree_over = [device_mesh.get_group(1), like]
    # Groups made under another debug level check collectives differently (DETAIL wraps them).
    debug = dist.get_debug_level()
    key = (tuple(ranks), str(dist.get_backend(like)), collective_timeout(like), _frozen(grid), debug)
    return lease_groups(key, agree_over, lambda: build_shard_groups(ranks, like, grid))


def build_shard_groups(ranks: list[int], like: ProcessGroup, grid: list[list[int]] | None) -> ShardGroups:
    """Create the wrapper's communicator over the global ``ranks`` with ``like``'s backend and
    timeout, the row and column groups of ``grid`` (global ranks, rows of equal length; None:
    one row of every rank) and the presence flags' group, on every rank of the world in the
    same order, or on the members alone when ``ranks`` are not the whole world (collective)."""
    everyone = len(ranks) == dist.get_world_size()
    world = new_communicator(ranks, like, local=not everyone)
    identity = (dist.get_rank(world), len(ranks))
    if grid is None or len(grid) == 1:
        rows = (tuple(ranks),)
        presence = presence_group(world, world)
        return ShardGroups(
            world, world, dist.get_rank(world), len(ranks), None, 0, 1, rows, presence, *identity
        )
    rows = tuple(tuple(row) for row in grid)
    if len(grid[0]) == 1:  # no sharding: every rank holds everything, grads all-reduced over world
        me = dist.get_rank(world)
        return ShardGroups(
            world, world, me, 1, None, me, len(grid), rows, presence_group(world, world), *identity
        )
    me = dist.get_rank()
    shard = replicate = None
    for row in grid:
        created = _subgroup(row, world, me, everyone)
        shard = created if me in row else shard
    columns = [list(column) for column in zip(*grid, strict=True)]
    for column in columns:
        created = _subgroup(column, world, me, everyone)
        replicate = created if me in column else replicate
    if shard is None or replicate is None:
        raise RuntimeError(f"ShardingStage1: global rank {me} is not in the sharding grid {grid}")
    row_index = next(i for i, row in enumerate(grid) if me in row)
    shard_rank = grid[row_index].index(me)
    # The flags share ``world`` with no bucket reduction here (those run on the rows).
    return ShardGroups(
        world, shard, shard_rank, len(grid[0]), replicate, row_index, len(grid), rows, world, *identity
    )


def _frozen(grid: list[list[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    return None if grid is None else tuple(tuple(row) for row in grid)


def _subgroup(ranks: list[int], like: ProcessGroup, me: int, everyone: bool) -> ProcessGroup | None:
    """A new group of ``ranks``; created by every rank of the world when the grid covers it,
    else only by its members (torch's local synchronization)."""
    if not everyone and me not in ranks:
        return None
    return new_communicator(ranks, like, local=not everyone)


def grid_of_degree(ranks: list[int], degree: int | None) -> list[list[int]] | None:
    """Rows of ``degree`` consecutive ranks of ``ranks``; None for full sharding.

    Raises:
        ValueError: ``degree`` does not divide the world size.
    """
    if degree is None or degree == len(ranks):
        return None
    if len(ranks) % degree:
        raise ValueError(
            f"ShardingStage1 expects Strategy().sharding.degree to divide the world size {len(ranks)} "
            f"but got degree={degree}; use one of {_divisors(len(ranks))} (ranks per shard group), "
            "or None to shard over every rank"
        )
    return [ranks[start : start + degree] for start in range(0, len(ranks), degree)]


def grid_of_mesh(mesh: object) -> list[list[int]]:
    """The global ranks of a 2-D (replicate, shard) ``DeviceMesh``, one list per row.

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``.
        ValueError: ``mesh`` is not 2-D, or this rank is not in it.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "ShardingStage1 expects device_mesh to be a torch.distributed.device_mesh.DeviceMesh "
            f"but got {type(mesh).__name__}; build one with init_device_mesh('cpu', (replicas, k))"
        )
    if mesh.ndim != 2:
        raise ValueError(
            f"ShardingStage1 expects a 2-D device_mesh with dims (replicate, shard) but got "
            f"{mesh.ndim} dims of sizes {tuple(mesh.shape)}; for full sharding pass no mesh (or "
            "process_group=mesh.get_group())"
        )
    grid = torch.as_tensor(mesh.mesh).tolist()
    if dist.get_rank() not in {rank for row in grid for rank in row}:
        raise ValueError("ShardingStage1 was given a device_mesh that this rank is not a member of")
    return grid


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
