"""Conversion between the sharded optimizer state and torch's standard optimizer state dict.

The standard format (``{"state": {index: {key: value}}, "param_groups": [...]}``, per param, in
the param's own shape) is what ``torch.optim`` optimizers save and load, so a checkpoint moves
freely between ``ShardingStage1`` on any number of ranks and a plain optimizer on one process.

Note [Element-wise and scalar state]
    The inner optimizer keeps, per bucket, state tensors of two kinds: element-wise ones of the
    local shard's numel (``exp_avg``, ``momentum_buffer``...) and 0-dim scalars shared by the
    whole bucket (``step``). An element-wise value of a param is assembled from the pieces every
    rank holds; a scalar is copied to every param of the bucket. Loading does the reverse: a rank
    cuts its own pieces out of each full tensor and takes a bucket's scalar from any of its params
    that has state (a param that never had a grad under the plain optimizer has none; its
    element-wise state starts at zero, as it would here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from fusion.buffers import flatten_to_slot, view_slot
from fusion.layout import BucketPlan, ShardPiece
from sharded_opt.inner_optimizer import constructor_kwargs, indexed_groups, is_elementwise

if TYPE_CHECKING:
    from sharded_opt.optimizer import ShardingStage1


def local_pieces(optimizer: ShardingStage1) -> dict[int, ShardPiece]:
    """For each laid-out param, the piece of it in this rank's local tensor (if any).

    Without sharding, the local tensor is the whole bucket, so the piece is the whole param at
    its offset.
    """
    pieces: dict[int, ShardPiece] = {}
    for bucket in optimizer.plan.buckets:
        if optimizer._comm.sharded:
            pieces.update((piece.param_index, piece) for piece in bucket.shard_pieces(optimizer.rank))
        else:
            pieces.update(
                (slot.param_index, ShardPiece(slot.param_index, 0, slot.offset, slot.numel))
                for slot in bucket.slots
            )
    return pieces


def gather_state_dict(optimizer: ShardingStage1, to_rank: int | None) -> dict[str, Any] | None:
    """The standard state dict (collective). See Note [Element-wise and scalar state].

    With ``to_rank``, full tensors are reduced to that rank only and the others return None.
    At most one param's full state tensor exists at a time beyond the local shards.
    """
    pieces = local_pieces(optimizer)
    communicate = optimizer._comm.sharded
    state: dict[int, dict[str, Any]] = {}
    for bucket, bucket_state in zip(optimizer.plan.buckets, optimizer._bucket_states(), strict=True):
        local_param = optimizer._comm.local_params[bucket.index]
        for slot in bucket.slots if bucket_state else ():
            entry = {}
            for key, value in bucket_state.items():
                if is_elementwise(value, local_param.numel()):
                    full = _assemble(value, slot.numel, pieces.get(slot.param_index))
                    if communicate:
                        _sum_over_group(full, optimizer, to_rank)
                    entry[key] = view_slot(full, slot)
                else:
                    entry[key] = value.clone() if isinstance(value, Tensor) else value
            state[slot.param_index] = entry
    if to_rank is not None and optimizer.rank != to_rank:
        return None
    return {"state": state, "param_groups": indexed_groups(optimizer.param_groups)}


def _assemble(local_value: Tensor, numel: int, piece: ShardPiece | None) -> Tensor:
    full = torch.zeros(numel, dtype=local_value.dtype, device=local_value.device)
    if piece is not None:
        full[piece.param_start : piece.param_start + piece.numel] = local_value[
            piece.shard_start : piece.shard_start + piece.numel
        ]
    return full


def _sum_over_group(tensor: Tensor, optimizer: ShardingStage1, to_rank: int | None) -> None:
    # Pieces are disjoint and zero elsewhere, so the sum is the exact concatenation.
    if to_rank is None:
        dist.all_reduce(tensor, group=optimizer.process_group)
    else:
        dist.reduce(
            tensor, dst=dist.get_global_rank(optimizer.process_group, to_rank), group=optimizer.process_group
        )


def expected_state_keys(optimizer: ShardingStage1, group_index: int) -> dict[str, bool]:
    """State keys the inner optimizer keeps for a param of this group, each mapped to whether
    it is element-wise, found by stepping a throwaway copy on a 2-element param."""
    inner = optimizer._inner
    hyper = {k: v for k, v in inner.param_groups[group_index].items() if k != "params"}
    probe = torch.zeros(2, dtype=optimizer.plan.buckets[0].dtype, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    throwaway = type(inner)([{**hyper, "params": [probe]}], **constructor_kwargs(inner))
    throwaway.step()
    return {key: is_elementwise(value, 2) for key, value in throwaway.state[probe].items()}


def load_state_dict(optimizer: ShardingStage1, state_dict: dict[str, Any]) -> None:
    """Validate a standard state dict completely, then install this rank's shard of it."""
    params = optimizer._buffers.params
    _check_structure(optimizer, state_dict)
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    by_position = {saved_id: position for position, saved_id in enumerate(saved_ids)}
    saved_state = {by_position[k]: v for k, v in state_dict["state"].items() if k in by_position}
    unknown = [k for k in state_dict["state"] if k not in by_position]
    if unknown:
        raise ValueError(
            f"ShardingStage1.load_state_dict: state for param ids {unknown[:8]} that no param group lists"
        )
    expected = [expected_state_keys(optimizer, g) for g in range(len(optimizer.param_groups))]
    for position, entry in saved_state.items():
        _check_param_state(optimizer, position, params[position], entry, expected)
    bucket_states = _shard_state(optimizer, saved_state, expected)
    for ours, saved in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
        ours.update({k: v for k, v in saved.items() if k != "params"})
    optimizer._sync_hyperparameters()
    optimizer._load_bucket_states(bucket_states)


def _check_structure(optimizer: ShardingStage1, state_dict: Any) -> None:
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError(
            "ShardingStage1.load_state_dict expects a torch optimizer state dict with 'state' and "
            f"'param_groups' but got {type(state_dict).__name__}"
            + (f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else "")
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"ShardingStage1.load_state_dict expects {len(optimizer.param_groups)} param groups but the "
            f"state dict has {len(saved_groups)}; it was saved from a differently built optimizer"
        )
    for index, (ours, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        if len(ours["params"]) != len(saved["params"]):
            raise ValueError(
                f"ShardingStage1.load_state_dict expects {len(ours['params'])} params in group {index} "
                f"but the state dict has {len(saved['params'])}"
            )


def _check_param_state(
    optimizer: ShardingStage1, position: int, param: Tensor, entry: dict, expected_per_group: list[dict]
) -> None:
    slot = optimizer.plan.slots[position]
    if slot is None:
        return  # a frozen param's state is not ours to keep; the plain optimizer has none either
    expected = expected_per_group[optimizer.plan.buckets[slot.bucket_index].group_index]
    if set(entry) != set(expected):
        raise ValueError(
            f"ShardingStage1.load_state_dict: param {position} has state keys {sorted(entry)} but "
            f"{type(optimizer._inner).__name__} with these settings keeps {sorted(expected)}; the "
            "state dict was saved from another optimizer class or configuration"
        )
    for key, elementwise in expected.items():
        value = entry[key]
        if elementwise and (not isinstance(value, Tensor) or value.shape != param.shape):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"ShardingStage1.load_state_dict: state {key!r} of param {position} has shape {shape} "
                f"but the param has shape {tuple(param.shape)}"
            )


def _shard_state(
    optimizer: ShardingStage1, saved_state: dict[int, dict], expected: list[dict[str, bool]]
) -> list[dict[str, Any]]:
    """Per bucket, this rank's local state cut from the full per-param state."""
    pieces = local_pieces(optimizer)
    states: list[dict[str, Any]] = []
    for bucket in optimizer.plan.buckets:
        with_state = [slot for slot in bucket.slots if slot.param_index in saved_state]
        if not with_state:
            states.append({})
            continue
        local_param = optimizer._comm.local_params[bucket.index]
        states.append(
            _bucket_state(
                bucket,
                local_param,
                saved_state,
                with_state[0].param_index,
                pieces,
                expected[bucket.group_index],
            )
        )
    return states


def _bucket_state(
    bucket: BucketPlan,
    local_param: Tensor,
    saved_state: dict[int, dict],
    first: int,
    pieces: dict[int, ShardPiece],
    elementwise: dict[str, bool],
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key, value in saved_state[first].items():
        if not elementwise[key]:
            state[key] = value.clone() if isinstance(value, Tensor) else value
            continue
        local = torch.zeros(local_param.numel(), dtype=value.dtype, device=local_param.device)
        for slot in bucket.slots:
            piece = pieces.get(slot.param_index)
            entry = saved_state.get(slot.param_index)
            if piece is None or entry is None:
                continue
            flat = flatten_to_slot(entry[key], slot)
            local[piece.shard_start : piece.shard_start + piece.numel] = flat[
                piece.param_start : piece.param_start + piece.numel
            ]
        state[key] = local
    return state
