"""Conversion between the sharded optimizer state and torch's standard optimizer state dict.

The standard format (``{"state": {index: {key: value}}, "param_groups": [...]}``, per param, in
the param's own shape) is what ``torch.optim`` optimizers save and load, so a checkpoint moves
freely between ``ShardingStage1`` on any number of ranks and a plain optimizer on one process.

Note [Element-wise and scalar state]
    The inner optimizer keeps state per piece of a param (see Note [Per-param pieces] in
    ``local_shard``): element-wise tensors of the piece's numel (``exp_avg``,
    ``momentum_buffer``...) and scalars (``step``), the same in every piece of a param. A param's
    state exists exactly when torch's would: once it has been stepped with a grad. To save, the
    rank that holds a param's first element (its *owner*) describes the param's state (keys,
    which are element-wise and their dtypes, the scalar values) and one ``all_gather_object``
    shares every description; each element-wise value is then assembled from the pieces every
    rank holds. Loading does the reverse: a rank cuts its own pieces out of each full tensor and
    copies the scalars. Which keys are element-wise cannot be read off a 0-dim param's state (its
    ``exp_avg`` is 0-dim like ``step``), so it is learned by stepping a throwaway optimizer of
    the same class and loaded configuration on a 2-element param.

``StateDictExchange`` is the wrapper's ``state_dict`` / ``consolidate_state_dict`` /
``load_state_dict`` around these conversions.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fusion.buffers import flatten_to_slot, view_slot
from fusion.layout import ParamSlot, ShardPiece
from sharded_opt.comm.collective_guard import EntryGuard
from sharded_opt.guards.param_guard import ParamWaiter
from sharded_opt.state.keyed_state import nested, per_block_slice, unnested
from sharded_opt.step.inner_optimizer import (
    ParamState,
    hyperparameters,
    indexed_groups,
    is_elementwise,
    load_param_states,
    param_states,
    probe_state,
)
from sharded_opt.step.optimizer_shards import OptimizerShards
from sharded_opt.step.quantized_state import QuantizedFormat, flat_parts, format_of, is_quantized
from sharded_opt.step.quantized_state import cut as cut_quantized


def local_pieces(shards: OptimizerShards) -> dict[int, ShardPiece]:
    """For each laid-out param, the piece of it in this rank's local tensor (if any)."""
    pieces: dict[int, ShardPiece] = {}
    for bucket in shards.plan.buckets:
        if shards.comm.sharded:
            pieces.update((piece.param_index, piece) for piece in bucket.shard_pieces(shards.comm.rank))
        else:
            pieces.update(
                (slot.param_index, ShardPiece(slot.param_index, 0, slot.offset, slot.numel))
                for slot in bucket.slots
            )
    return pieces


def describe_param_states(shards: OptimizerShards, local: dict[int, ParamState]) -> dict[int, dict[str, Any]]:
    """Per param with state (every rank gets all of them; collective when sharded): per key,
    ``("elementwise", dtype)`` or ``("scalar", value)``, from this rank's ``local`` states (as
    :func:`param_states` returns them). See Note [Element-wise and scalar state]."""
    pieces = local_pieces(shards)
    own: dict[int, dict[str, Any]] = {}
    for index, state in local.items():
        if pieces[index].param_start != 0:
            continue
        first_inner = _first_inner_param(shards, index)
        first_state = shards.inner.state[first_inner]
        own[index] = {
            key: _describe(key, value, first_state[key], first_inner, shards) for key, value in state.items()
        }
    if not shards.comm.sharded:
        return dict(sorted(own.items()))  # param order, as torch's state_dict lists them
    everyone: list[Any] = [None] * shards.groups.world_size
    dist.all_gather_object(everyone, own, group=shards.groups.world)
    merged: dict[int, dict[str, Any]] = {}
    for descriptions in everyone:
        merged.update(descriptions)
    return dict(sorted(merged.items()))


def _describe(
    key: str, value: Any, first_value: Any, first_inner: Tensor, shards: OptimizerShards
) -> tuple[str, Any]:
    """One key's description: ``("quantized", format)`` for a quantized value (its parts are
    assembled like element-wise values, see ``quantized_state``), ``("per_block", dtype)`` for
    scales kept under a key (see ``keyed_state``), ``("elementwise", dtype)`` or ``("scalar",
    value)``."""
    if is_quantized(value):
        return "quantized", format_of(value, shards.shared_state_parts)
    if shards.keyed_state is not None and key in shards.keyed_state.per_block_keys:
        return "per_block", value.dtype
    if is_elementwise(first_value, first_inner):
        return "elementwise", value.dtype
    return "scalar", value


def _first_inner_param(shards: OptimizerShards, index: int) -> Tensor:
    shard = shards.shard_of(index)
    return shard.inner_params[shard.inner_owners.index(index)]


GATHER_BATCH_BYTES = 16 * 2**20
"""The most bytes of full state tensors one collective of :func:`gather_state_dict` assembles:
a model's element-wise state travels in a few large collectives instead of one per param and
key (each a round trip), while the transient memory beyond the local shards stays bounded."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Flat:
    """One flat tensor of a param's state to assemble: an element-wise value (``part`` None) or
    one per-element part of a quantized value, ``ratio`` entries per element of the param (per
    block: the last block's entry counts whole, see ``keyed_state``)."""

    index: int
    key: str
    dtype: torch.dtype
    part: str | None = None
    ratio: Fraction = Fraction(1)
    per_block: bool = False

    def numel(self, params: list[Tensor]) -> int:
        return math.ceil(params[self.index].numel() * self.ratio)

    def local(self, state: ParamState, fmt: QuantizedFormat | None) -> Tensor:
        value = state[self.key]
        return value if fmt is None else flat_parts(value, fmt)[self.part]


def gather_state_dict(shards: OptimizerShards, to_rank: int | None) -> dict[str, Any] | None:
    """The standard state dict (collective). See Note [Element-wise and scalar state].

    With ``to_rank``, full tensors are reduced to that rank only and the others return None.
    Full state tensors are assembled ``GATHER_BATCH_BYTES`` at a time beyond the local shards.
    """
    local = param_states(shards.inner, shards.live_shards())
    descriptions = describe_param_states(shards, local)
    state: dict[int, dict[str, Any]] = {}
    flats: list[_Flat] = []
    formats: dict[tuple[int, str], QuantizedFormat] = {}
    for index, description in descriptions.items():
        entry: dict[str, Any] = {}
        for key, (kind, value) in description.items():
            entry[key] = None  # assembled below, in this key order
            if kind == "scalar":
                entry[key] = value.clone() if isinstance(value, Tensor) else value
            elif kind == "quantized":
                formats[index, key] = value
                flats.extend(
                    _Flat(index, key, dtype, part, ratio) for part, (ratio, dtype) in value.ratios.items()
                )
            elif kind == "per_block":
                flats.append(
                    _Flat(index, key, value, ratio=Fraction(1, block_size_of(shards, index)), per_block=True)
                )
            else:
                flats.append(_Flat(index, key, value))
        state[index] = entry
    pieces = local_pieces(shards)
    parts: dict[tuple[int, str], dict[str, Tensor]] = {}
    for batch in _gather_batches(shards, flats):
        for flat, full in _assemble(shards, batch, local, pieces, to_rank, formats):
            if flat.per_block:
                state[flat.index][flat.key] = full
            elif flat.part is None:
                state[flat.index][flat.key] = view_slot(full, shards.plan.slot(flat.index))
            else:
                parts.setdefault((flat.index, flat.key), {})[flat.part] = full
    for (index, key), fmt in formats.items():
        if (index, key) in parts:
            state[index][key] = fmt.build(parts[index, key], shards.plan.slot(index).shape)
    if to_rank is not None and shards.groups.world_rank != to_rank:
        return None
    if shards.keyed_state is not None:
        state = {index: nested(entry, shards.keyed_state) for index, entry in state.items()}
    return {"state": state, "param_groups": indexed_groups(shards.param_groups)}


def block_size_of(shards: OptimizerShards, index: int) -> int:
    """The block size of param ``index``'s quantized state (its bucket's grid)."""
    grid = shards.plan.buckets[shards.plan.slot(index).bucket_index].block_grid
    if grid is None:
        raise RuntimeError(f"param {index} has per-block state but its bucket has no block grid")
    return grid.block_size


def _gather_batches(shards: OptimizerShards, flats: list[_Flat]) -> list[list[_Flat]]:
    """``flats`` in order, cut into runs of one dtype and device of at most
    ``GATHER_BATCH_BYTES`` (a larger tensor alone)."""
    params = shards.buffers.params
    batches: list[list[_Flat]] = []
    batch_bytes = 0
    for flat in flats:
        nbytes = flat.numel(params) * flat.dtype.itemsize
        last = batches[-1][-1] if batches else None
        alike = last is not None and (last.dtype, params[last.index].device) == (
            flat.dtype,
            params[flat.index].device,
        )
        if not alike or batch_bytes + nbytes > GATHER_BATCH_BYTES:
            batches.append([])
            batch_bytes = 0
        batches[-1].append(flat)
        batch_bytes += nbytes
    return batches


def _assemble(
    shards: OptimizerShards,
    batch: list[_Flat],
    local: dict[int, ParamState],
    pieces: dict[int, ShardPiece],
    to_rank: int | None,
    formats: dict[tuple[int, str], QuantizedFormat],
) -> list[tuple[_Flat, Tensor]]:
    """The full flat tensors of one batch, each param's own: this rank's pieces written into a
    zeroed flat buffer, summed over the group in one collective, then cut apart. One-byte
    dtypes (fp8 codes) travel as bytes: gloo sums no fp8, and a sum of disjoint bytes and zeros
    is exact."""
    params = shards.buffers.params
    dtype = batch[0].dtype
    wire = torch.uint8 if dtype.itemsize == 1 else dtype
    sizes = [flat.numel(params) for flat in batch]
    buffer = torch.zeros(sum(sizes), dtype=wire, device=params[batch[0].index].device)
    spans = []
    offset = 0
    for flat, size in zip(batch, sizes, strict=True):
        if flat.index in local and _contributes(shards):
            piece = pieces[flat.index]
            start = offset + int(piece.param_start * flat.ratio)
            value = flat.local(local[flat.index], formats.get((flat.index, flat.key)))
            buffer[start : start + value.numel()] = value.view(wire) if wire != dtype else value
        spans.append((flat, offset, size))
        offset += size
    if shards.comm.sharded:
        _sum_over_group(buffer, shards, to_rank)
    if to_rank is not None and shards.groups.world_rank != to_rank:
        return []  # the sum went to another rank
    return [(flat, buffer[start : start + size].clone().view(dtype)) for flat, start, size in spans]


def _contributes(shards: OptimizerShards) -> bool:
    """Whether this rank's pieces go into the sum: with hybrid sharding every replica holds the
    same pieces, so only the first replica's count (see Note [Hybrid sharding])."""
    return not shards.comm.sharded or shards.groups.replica_rank == 0


def _sum_over_group(tensor: Tensor, shards: OptimizerShards, to_rank: int | None) -> None:
    # Pieces are disjoint and zero elsewhere, so the sum is the exact concatenation.
    if to_rank is None:
        dist.all_reduce(tensor, group=shards.groups.world)
    else:
        dist.reduce(tensor, dst=dist.get_global_rank(shards.groups.world, to_rank), group=shards.groups.world)


def expected_state_keys(
    shards: OptimizerShards, hyper: dict[str, Any], probe_shape: tuple[int, ...] = (2,)
) -> dict[str, bool]:
    """State keys the optimizer class keeps for a param of a group configured by ``hyper``, each
    mapped to whether it is element-wise, found by stepping a throwaway copy on a param of
    ``probe_shape``: 2 elements, or for a class that steps whole params, 2 along each of the
    param's dims (Adafactor keeps other keys for matrices than for vectors, Muon takes only
    matrices)."""
    probe = torch.zeros(probe_shape, dtype=shards.plan.buckets[0].dtype, requires_grad=True)
    state = probe_state(shards.inner, hyper, probe)
    return {key: is_elementwise(value, probe) for key, value in state.items()}


def load_state_dict(shards: OptimizerShards, state_dict: dict[str, Any]) -> None:
    """Validate a standard state dict completely, then install this rank's shard of it."""
    params = shards.buffers.params
    _check_structure(shards, state_dict)
    saved_groups = state_dict["param_groups"]
    saved_ids = [i for group in saved_groups for i in group["params"]]
    by_position = {saved_id: position for position, saved_id in enumerate(saved_ids)}
    unknown = [k for k in state_dict["state"] if k not in by_position]
    if unknown:
        raise ValueError(
            f"ShardingStage1.load_state_dict: state for param ids {unknown[:8]} that no param group lists"
        )
    saved_state = {by_position[k]: v for k, v in state_dict["state"].items()}
    if shards.keyed_state is not None:
        saved_state = {k: unnested(v, shards.keyed_state) for k, v in saved_state.items()}
    group_of = [g for g, group in enumerate(saved_groups) for _ in group["params"]]
    expected = _ExpectedKeys(shards, saved_groups, group_of)
    for position, entry in saved_state.items():
        _check_param_state(shards, position, params[position], entry, expected.of(position))
    for position in saved_state:
        shards.materialize(shards.bucket_of(position))
    local_states = _local_states(shards, saved_state, expected)
    for ours, saved in zip(shards.param_groups, saved_groups, strict=True):
        ours.update(hyperparameters(saved))
    load_param_states(shards.inner, shards.live_shards(), local_states, shards.param_groups)


def _check_structure(shards: OptimizerShards, state_dict: Any) -> None:
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError(
            "ShardingStage1.load_state_dict expects a torch optimizer state dict with 'state' and "
            f"'param_groups' but got {type(state_dict).__name__}"
            + (f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else "")
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(shards.param_groups):
        raise ValueError(
            f"ShardingStage1.load_state_dict expects {len(shards.param_groups)} param groups but the "
            f"state dict has {len(saved_groups)}; it was saved from a differently built optimizer"
        )
    for index, (ours, saved) in enumerate(zip(shards.param_groups, saved_groups, strict=True)):
        if len(ours["params"]) != len(saved["params"]):
            raise ValueError(
                f"ShardingStage1.load_state_dict expects {len(ours['params'])} params in group {index} "
                f"but the state dict has {len(saved['params'])}"
            )


def _check_param_state(
    shards: OptimizerShards, position: int, param: Tensor, entry: Any, expected: dict[str, bool]
) -> None:
    if not isinstance(entry, dict):
        raise ValueError(
            f"ShardingStage1.load_state_dict: the state of param {position} is a "
            f"{type(entry).__name__}, not a dict of state values"
        )
    if set(entry) != set(expected):
        raise ValueError(
            f"ShardingStage1.load_state_dict: param {position} has state keys {sorted(entry)} but "
            f"{type(shards.inner).__name__} configured as the saved param group keeps "
            f"{sorted(expected)}; the state dict was saved from another optimizer class or configuration"
        )
    for key, elementwise in expected.items():
        value = entry[key]
        if elementwise and (not isinstance(value, Tensor) or value.shape != param.shape):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"ShardingStage1.load_state_dict: state {key!r} of param {position} has shape {shape} "
                f"but the param has shape {tuple(param.shape)}"
            )


class _ExpectedKeys:
    """:func:`expected_state_keys` per param position: one probe per saved group, and for a
    class that steps whole params per group and number of dims."""

    def __init__(
        self, shards: OptimizerShards, saved_groups: list[dict[str, Any]], group_of: list[int]
    ) -> None:
        self._shards = shards
        self._saved_groups = saved_groups
        self._group_of = group_of
        self._probed: dict[tuple[int, tuple[int, ...]], dict[str, bool]] = {}

    def of(self, position: int) -> dict[str, bool]:
        group = self._group_of[position]
        plan = self._shards.plan
        bucket = plan.buckets[plan.slot(position).bucket_index]
        shape = (2,) * len(self._shards.buffers.params[position].shape) if bucket.whole_params else (2,)
        numel = self._shards.buffers.params[position].numel()
        grid = bucket.block_grid
        if self._shards.keyed_state is not None and grid is not None and grid.quantizes(numel):
            # Such a class keeps other keys for the tensors it quantizes (scales, code books).
            shape = (grid.first_quantized_numel,)
        key = (group, shape)
        if key not in self._probed:
            hyper = hyperparameters(self._saved_groups[group])
            self._probed[key] = expected_state_keys(self._shards, hyper, shape)
        return self._probed[key]


def _local_states(
    shards: OptimizerShards, saved_state: dict[int, dict], expected: _ExpectedKeys
) -> dict[int, ParamState]:
    """Per param with saved state and a piece on this rank, its local state."""
    pieces = local_pieces(shards)
    states: dict[int, ParamState] = {}
    for position, entry in saved_state.items():
        piece = pieces.get(position)
        if piece is None:
            continue
        elementwise = expected.of(position)
        keyed = shards.keyed_state
        states[position] = {
            key: _cut(value, piece, shards.plan.slot(position), shards.shared_state_parts)
            if elementwise[key]
            else per_block_slice(value, piece.param_start, piece.numel, block_size_of(shards, position))
            if keyed is not None and key in keyed.per_block_keys
            else value
            for key, value in entry.items()
        }
    return states


def _cut(value: Tensor, piece: ShardPiece, slot: ParamSlot, shared: tuple[str, ...]) -> Tensor:
    """This rank's piece of a full state tensor, in the slot's memory order. A copy: the
    optimizer updates its state in place and must not write into the caller's dict."""
    if is_quantized(value):
        return cut_quantized(value, piece.param_start, piece.numel, shared)
    flat = flatten_to_slot(value, slot)
    return flat[piece.param_start : piece.param_start + piece.numel].clone()


class StateDictExchange:
    """The state-dict calls of ``ShardingStage1`` around the conversions above: each first checks
    that every rank called it (Note [Collectives entered by some ranks] in ``collective_guard``)
    and waits for the all-gathers in flight, torch's state-dict hooks of the wrapper run around
    the conversion, and what ``consolidate_state_dict`` gathered is kept until the next
    ``step()`` or ``load_state_dict()`` changes the state.

    Args:
        shards: the layout, shards and inner optimizer the conversions read.
        params_ready: waits for the all-gathers still writing the params.
        entry_timeout_s: how long to wait for every rank to call; None: the group's own timeout.
    """

    def __init__(self, shards: OptimizerShards, params_ready: ParamWaiter, entry_guard: EntryGuard) -> None:
        self._shards = shards
        self._params_ready = params_ready
        self._entry_guard = entry_guard
        self._consolidated: _Consolidated | None = None

    def discard_consolidated(self) -> None:
        """The state is about to change (``step()``): what was consolidated is stale."""
        self._consolidated = None

    def state_dict(self, wrapper: torch.optim.Optimizer, to_rank: int | None) -> dict[str, Any] | None:
        """See ``ShardingStage1.state_dict``; ``wrapper``'s hooks run around it."""
        world_size = self._shards.groups.world_size
        if to_rank is not None and not 0 <= to_rank < world_size:
            raise ValueError(
                f"ShardingStage1.state_dict expects to_rank in [0, {world_size}) but got {to_rank}"
            )
        consolidated = self._consolidated if to_rank is None else None
        if consolidated is None:
            self._params_ready.finish_param_sync()
            self._check_all_ranks_enter(
                "state_dict", "Call opt.state_dict(to_rank=0) on every rank (the others get None)"
            )
        for pre_hook in wrapper._optimizer_state_dict_pre_hooks.values():
            pre_hook(wrapper)
        if consolidated is None:
            state = gather_state_dict(self._shards, to_rank)
        else:
            state = self._consolidated_state_dict(consolidated)
        if state is not None:
            for post_hook in wrapper._optimizer_state_dict_post_hooks.values():
                state = _replaced_by(post_hook(wrapper, state), state)
        return state

    def consolidate(self, to: int) -> None:
        """See ``ShardingStage1.consolidate_state_dict``."""
        world_size = self._shards.groups.world_size
        if not 0 <= to < world_size:
            raise ValueError(
                f"ShardingStage1.consolidate_state_dict expects to in [0, {world_size}) but got {to}"
            )
        self._consolidated = None
        self._params_ready.finish_param_sync()
        self._check_all_ranks_enter(
            "consolidate_state_dict", f"Call opt.consolidate_state_dict(to={to}) on every rank"
        )
        gathered = gather_state_dict(self._shards, to)
        self._consolidated = _Consolidated(to, None if gathered is None else gathered["state"])

    def load_state_dict(self, wrapper: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """See ``ShardingStage1.load_state_dict``; ``wrapper``'s hooks run around it."""
        self._consolidated = None
        self._params_ready.finish_param_sync()
        self._check_all_ranks_enter("load_state_dict", "Call opt.load_state_dict(sd) on every rank")
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for pre_hook in wrapper._optimizer_load_state_dict_pre_hooks.values():
            state_dict = _replaced_by(pre_hook(wrapper, state_dict), state_dict)
        load_state_dict(self._shards, state_dict)
        for post_hook in wrapper._optimizer_load_state_dict_post_hooks.values():
            post_hook(wrapper)

    def _consolidated_state_dict(self, consolidated: _Consolidated) -> dict[str, Any]:
        if consolidated.state is None:
            raise RuntimeError(
                f"ShardingStage1.state_dict: consolidate_state_dict(to={consolidated.rank}) gathered the "
                f"state on rank {consolidated.rank}, so until the next step() only that rank's "
                f"state_dict() returns it (this is rank {self._shards.groups.world_rank}). Call "
                f"opt.state_dict() on rank {consolidated.rank} alone, or opt.state_dict() / "
                "opt.state_dict(to_rank=...) on every rank"
            )
        # The param groups are read now: a scheduler may have changed them since consolidating.
        return {"state": consolidated.state, "param_groups": indexed_groups(self._shards.param_groups)}

    def _check_all_ranks_enter(self, method: str, fix: str) -> None:
        self._entry_guard.check(f"ShardingStage1.{method}", fix)


@dataclasses.dataclass(frozen=True)
class _Consolidated:
    """What ``consolidate_state_dict`` gathered: the rank it went to, and there the ``"state"``
    part of the state dict (None on the other ranks)."""

    rank: int
    state: dict[int, dict[str, Any]] | None


def _replaced_by(hook_result: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """torch's hook protocol: a state-dict hook returns a new dict, or None to keep the old one."""
    return state_dict if hook_result is None else hook_result
