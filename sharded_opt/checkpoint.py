"""Sharded checkpoints through ``torch.distributed.checkpoint`` that reshard on load.

Note [Checkpoint layout]
    Every rank writes only what it owns. An element-wise state tensor of a param (``exp_avg``,
    ...) is saved as a 1-D ``ShardedTensor`` of the param's numel whose local shard is the piece
    of the param inside this rank's flat shard; its global metadata is computed from the layout
    plan, which every rank knows, so building it needs no communication. Loading on a different
    number of ranks builds the same kind of tensor for the new layout and DCP reads each new
    piece from whichever saved pieces overlap it. Scalar state (``step``), the model's
    state dict (full tensors, the same on every rank) and numeric hyperparameters (float64
    tensors) are replicated entries that DCP writes once.

    Only tensors are stored: DCP unpickles non-tensor entries with ``weights_only=False``, so a
    checkpoint of ours never needs it, and loading never asks for a non-tensor entry.

Note [Atomic checkpoints]
    ``PATH`` is a symbolic link to a folder ``PATH.ckpt-<id>`` that holds one complete
    checkpoint. A save writes into ``PATH.partial``, renames it to a fresh ``PATH.ckpt-<id>`` once
    every rank has finished and DCP's metadata file is written, and then swaps the link with one
    atomic ``os.replace``; only after that is the previous folder removed. A crash at any moment
    leaves ``PATH`` pointing at a whole checkpoint, the previous or the new one, and never at a
    half-written one; a folder without DCP metadata is refused on load.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.api import CheckpointException

from fusion.layout import ParamSlot, ShardPiece
from sharded_opt.collective_guard import check_all_ranks_enter
from sharded_opt.state_dict import expected_state_keys, local_pieces

if TYPE_CHECKING:
    from sharded_opt.optimizer import ShardingStage1

_PARTIAL_SUFFIX = ".partial"
_VERSION_MARK = ".ckpt-"
_META_NUM_PARAMS = "meta.num_params"
_META_HAS_STATE = "meta.has_state"
_META_HAS_MASTERS = "meta.has_masters"


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: ShardingStage1) -> None:
    """Save ``model`` and ``optimizer`` to the folder ``path``; every rank writes its shard.

    Collective over the optimizer's process group. Replaces an existing checkpoint at ``path``
    only once the new one is complete, see Note [Atomic checkpoints].

    Raises:
        FileExistsError: ``path`` exists and is not a checkpoint written by this function.
    """
    optimizer.sync_params()
    _check_all_ranks_enter("save_checkpoint", optimizer)
    final = Path(path)
    _check_destination(final)
    staging = final.with_name(final.name + _PARTIAL_SUFFIX)
    group = optimizer.process_group
    if optimizer.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier(group=group)
    masters = optimizer._comm.master_copies()
    state = {
        **_model_entries(model),
        **_optimizer_entries(optimizer, _live_bucket_states(optimizer), masters),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(staging), process_group=group)
    dist.barrier(group=group)
    if optimizer.rank == 0:
        _publish(staging, final)
    dist.barrier(group=group)


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: ShardingStage1) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` on any number of ranks.

    Collective. Nothing changes unless the whole checkpoint was read successfully.

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.
        ValueError: the checkpoint belongs to another model or optimizer layout, or its files
            are damaged.
    """
    folder = Path(path)
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(
            f"load_checkpoint: {folder} holds no complete checkpoint (no DCP .metadata file); a "
            "save that was interrupted leaves only a '.partial' folder"
        )
    optimizer.sync_params()
    _check_all_ranks_enter("load_checkpoint", optimizer)
    reader = dcp.FileSystemReader(folder)
    meta = {
        name: torch.zeros((), dtype=torch.int64)
        for name in (_META_NUM_PARAMS, _META_HAS_STATE, _META_HAS_MASTERS)
    }
    dcp.load(meta, storage_reader=reader, process_group=optimizer.process_group)
    num_params = len(optimizer._buffers.params)
    if int(meta[_META_NUM_PARAMS]) != num_params:
        raise ValueError(
            f"load_checkpoint: the checkpoint at {folder} holds {int(meta[_META_NUM_PARAMS])} optimizer "
            f"params but this optimizer has {num_params}; it belongs to another model"
        )
    model_entries = {key: value.detach().clone() for key, value in _model_entries(model).items()}
    bucket_states = (
        _zero_bucket_states(optimizer) if int(meta[_META_HAS_STATE]) else [{} for _ in optimizer.plan.buckets]
    )
    # Without saved master copies (saved without master_dtype), the masters are refreshed from
    # the loaded params at the next step, see Note [Mixed precision] in bucket_comm.
    masters = [
        None if master is None or not int(meta[_META_HAS_MASTERS]) else torch.zeros_like(master)
        for master in optimizer._comm.master_copies()
    ]
    state = {**model_entries, **_optimizer_entries(optimizer, bucket_states, masters)}
    try:
        dcp.load(state, storage_reader=reader, process_group=optimizer.process_group)
    except CheckpointException as error:  # a BaseException: it would slip past `except Exception`
        raise ValueError(
            f"load_checkpoint: {folder} could not be read (damaged files, or written for another model "
            f"or optimizer); nothing was changed. DCP reported: {error}"
        ) from error
    with torch.no_grad():
        for key, value in _model_entries(model).items():
            value.copy_(state[key])
    _restore_hyperparameters(optimizer, state)
    optimizer._load_bucket_states(bucket_states)
    if any(master is not None for master in masters):
        optimizer._comm.load_master_copies(masters)


def _check_all_ranks_enter(function: str, optimizer: ShardingStage1) -> None:
    fix = f"Call {function}(path, model, opt) on every rank; each rank reads or writes its own shard"
    check_all_ranks_enter(function, fix, optimizer.process_group, optimizer.collective_entry_timeout_s)


def _model_entries(model: nn.Module) -> dict[str, Tensor]:
    return {f"model.{name}": tensor for name, tensor in model.state_dict().items()}


BucketStates = list[dict[str, Tensor]]
"""Per bucket, the inner optimizer's tensor state of the local flat tensor."""


def _live_bucket_states(optimizer: ShardingStage1) -> BucketStates:
    return [{k: v for k, v in state.items() if isinstance(v, Tensor)} for state in optimizer._bucket_states()]


def _zero_bucket_states(optimizer: ShardingStage1) -> BucketStates:
    expected = [expected_state_keys(optimizer, g) for g in range(len(optimizer.param_groups))]
    states = []
    for bucket, local_param in zip(optimizer.plan.buckets, optimizer._comm.local_params, strict=True):
        states.append(
            {
                key: torch.zeros_like(local_param, requires_grad=False) if elementwise else torch.zeros(())
                for key, elementwise in expected[bucket.group_index].items()
            }
        )
    return states


def _optimizer_entries(
    optimizer: ShardingStage1, bucket_states: BucketStates, masters: list[Tensor | None]
) -> dict[str, Tensor | ShardedTensor]:
    """DCP entries that are views of ``bucket_states`` and ``masters``, so loading fills those
    tensors in place."""
    entries: dict[str, Tensor | ShardedTensor] = {
        _META_NUM_PARAMS: torch.tensor(len(optimizer._buffers.params)),
        _META_HAS_STATE: torch.tensor(int(any(bucket_states))),
        _META_HAS_MASTERS: torch.tensor(int(any(master is not None for master in masters))),
    }
    for group_index, group in enumerate(optimizer.param_groups):
        for key, value in _numeric_hyperparameters(group).items():
            entries[f"hyper.{group_index}.{key}"] = value
    per_param = _PerParamEntries(optimizer)
    for bucket, state, master in zip(optimizer.plan.buckets, bucket_states, masters, strict=True):
        for slot in bucket.slots:
            for key, value in state.items():
                entries[f"state.{slot.param_index}.{key}"] = per_param.entry(slot, value)
            if master is not None:
                entries[f"master.{slot.param_index}"] = per_param.entry(slot, master)
    return entries


class _PerParamEntries:
    """Turns a bucket-level local tensor into one param's checkpoint entry, see Note
    [Checkpoint layout]."""

    def __init__(self, optimizer: ShardingStage1) -> None:
        self._optimizer = optimizer
        self._pieces = local_pieces(optimizer)
        self._every_rank = _pieces_of_every_rank(optimizer) if optimizer._comm.sharded else {}

    def entry(self, slot: ParamSlot, value: Tensor) -> Tensor | ShardedTensor:
        if value.dim() == 0:
            return value
        if not self._optimizer._comm.sharded:
            return value[slot.offset : slot.offset + slot.numel]
        return _sharded_view(
            self._optimizer,
            value,
            slot.numel,
            self._pieces.get(slot.param_index),
            self._every_rank[slot.param_index],
        )


def _pieces_of_every_rank(optimizer: ShardingStage1) -> dict[int, list[tuple[int, ShardPiece]]]:
    result: dict[int, list[tuple[int, ShardPiece]]] = {}
    for bucket in optimizer.plan.buckets:
        for rank in range(optimizer.world_size):
            for piece in bucket.shard_pieces(rank):
                result.setdefault(piece.param_index, []).append((rank, piece))
    return result


def _sharded_view(
    optimizer: ShardingStage1,
    local_value: Tensor,
    numel: int,
    local_piece: ShardPiece | None,
    every_rank: list[tuple[int, ShardPiece]],
) -> ShardedTensor:
    """A 1-D ShardedTensor over the whole param whose local shard views ``local_value``."""

    def metadata_of(rank: int, piece: ShardPiece) -> ShardMetadata:
        global_rank = dist.get_global_rank(optimizer.process_group, rank)
        return ShardMetadata([piece.param_start], [piece.numel], f"rank:{global_rank}/{local_value.device}")

    local_shards = []
    if local_piece is not None:
        view = local_value[local_piece.shard_start : local_piece.shard_start + local_piece.numel]
        local_shards.append(Shard(view, metadata_of(optimizer.rank, local_piece)))
    metadata = ShardedTensorMetadata(
        [metadata_of(rank, piece) for rank, piece in every_rank],
        torch.Size([numel]),
        TensorProperties(dtype=local_value.dtype),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata, process_group=optimizer.process_group
    )


def _numeric_hyperparameters(group: dict[str, Any]) -> dict[str, Tensor]:
    """Numbers and tuples of numbers (lr, betas, ...) as float64 tensors; flags stay as built."""
    values = {}
    for key, value in group.items():
        if isinstance(value, bool) or key == "params":
            continue
        if isinstance(value, (int, float)):
            values[key] = torch.tensor(float(value), dtype=torch.float64)
        elif isinstance(value, tuple) and value and all(isinstance(v, (int, float)) for v in value):
            values[key] = torch.tensor([float(v) for v in value], dtype=torch.float64)
    return values


def _restore_hyperparameters(optimizer: ShardingStage1, entries: dict[str, Any]) -> None:
    for group_index, group in enumerate(optimizer.param_groups):
        for key, current in list(group.items()):
            loaded = entries.get(f"hyper.{group_index}.{key}")
            if loaded is None:
                continue
            if isinstance(current, tuple):
                group[key] = tuple(type(c)(v) for c, v in zip(current, loaded.tolist(), strict=True))
            else:
                group[key] = type(current)(loaded.item())
    optimizer._sync_hyperparameters()


def _publish(staging: Path, final: Path) -> None:
    """Make the complete checkpoint in ``staging`` the one ``final`` points at, atomically."""
    version = final.with_name(f"{final.name}{_VERSION_MARK}{uuid.uuid4().hex[:12]}")
    staging.rename(version)
    _point_link(final, version)
    for stale in final.parent.glob(f"{final.name}{_VERSION_MARK}*"):
        if stale != version and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _point_link(final: Path, version: Path) -> None:
    link = final.with_name(final.name + ".link")
    link.unlink(missing_ok=True)
    link.symlink_to(version.name)
    os.replace(link, final)  # atomic: readers see the old or the new checkpoint, never neither


def _check_destination(final: Path) -> None:
    if final.exists() and not final.is_symlink():
        raise FileExistsError(
            f"save_checkpoint: {final} exists and is not a checkpoint written by save_checkpoint "
            "(those are links to a PATH.ckpt-<id> folder); choose another path or remove it"
        )
