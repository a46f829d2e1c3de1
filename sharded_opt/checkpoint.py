"""Sharded checkpoints through ``torch.distributed.checkpoint`` that reshard on load.

Note [Checkpoint layout]
    Every rank writes only what it owns. An element-wise state tensor of a param (``exp_avg``,
    ...) is saved as a 1-D tensor of the param's numel of which this rank writes the piece of
    the param inside its flat shard (a ``ParamPiece``, Note [Pieces without ShardedTensor] in
    ``checkpoint_pieces``). Loading on a different number of ranks asks for the pieces of the
    new layout and DCP reads each from whichever saved pieces overlap it. Only params that have
    state (have been stepped) get entries, as in torch's format; which ones, with which keys and
    dtypes, is read back from the checkpoint's metadata. Each param's
    scalar state (its own ``step``: a 0-dim tensor as it is, a Python int as an int64 tensor
    named ``state_int.<i>.<key>`` so that it comes back an int), the state of an optimizer that
    steps whole params which is not of the param's shape (Adafactor's row and column factors:
    ``state_whole.<i>.<key>``, see Note [Whole params per owner] in ``fusion/layout.py``), the
    model's state dict (full tensors, the same on every rank)
    and hyperparameters (tensors whose entry name records the Python type: int stays int, a
    Tensor lr stays a Tensor) are replicated entries that DCP writes once. Quantized state
    (torchao's values, bitsandbytes' keys) is saved by its codes and scales, each a 1-D tensor
    of entries that a rank writes the piece of as above, see Note [Quantized state in
    checkpoints] in ``quantized_checkpoint``.

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

import math
import os
import shutil
import uuid
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from sharded_opt.guards.messages import closed_error
from sharded_opt.state.checkpoint_pieces import ParamPiece, PieceLoadPlanner, PieceSavePlanner
from sharded_opt.state.quantized_checkpoint import (
    PER_BLOCK,
    QuantizedLoad,
    check_quantizer,
    quantized_save_entries,
    quantizer_entries,
    saved_quantizer_entries,
)
from sharded_opt.state.state_dict import block_size_of, describe_param_states, local_pieces
from sharded_opt.step.bucket import republish_exactly
from sharded_opt.step.inner_optimizer import load_param_states, param_states

if TYPE_CHECKING:
    from sharded_opt.optimizer import ShardingStage1

_PARTIAL_SUFFIX = ".partial"
_VERSION_MARK = ".ckpt-"
_META_NUM_PARAMS = "meta.num_params"
_WHOLE_STATE = "state_whole"
"""Entries of a param's state tensors that are neither element-wise nor 0-dim (Adafactor's row
and column factors): replicated, read whole by the param's owner, see Note [Checkpoint layout]."""
_INT_STATE = "state_int"
"""Entries of a param's Python int state (bitsandbytes' ``step``), restored as ints."""
_HYPER_FLOAT = "hyper"
_HYPER_INT = "hyper_int"
_HYPER_TENSOR = "hyper_tensor"
_HYPER_TUPLE = "hyper_tuple"
_HYPER_PREFIXES = (_HYPER_FLOAT + ".", _HYPER_INT + ".", _HYPER_TENSOR + ".", _HYPER_TUPLE + ".")


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: ShardingStage1) -> None:
    """Save ``model`` and ``optimizer`` to the folder ``path``; every rank writes its shard.

    Collective over the optimizer's process group. Replaces an existing checkpoint at ``path``
    only once the new one is complete, see Note [Atomic checkpoints].

    Raises:
        FileExistsError: ``path`` exists and is not a checkpoint written by this function.
    """
    _check_all_ranks_enter("save_checkpoint", optimizer)
    optimizer.sync_params()
    final = Path(path)
    _check_destination(final)
    staging = final.with_name(final.name + _PARTIAL_SUFFIX)
    group = optimizer.process_group
    if optimizer.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier(group=group)
    state = {**_model_entries(model), **_save_entries(optimizer)}
    dcp.save(
        state, storage_writer=dcp.FileSystemWriter(staging), planner=PieceSavePlanner(), process_group=group
    )
    dist.barrier(group=group)
    if optimizer.rank == 0:
        _publish(staging, final)
    dist.barrier(group=group)


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: ShardingStage1) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` on any number of ranks.

    Collective. Nothing changes unless the whole checkpoint was read successfully.

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.
        ValueError: the checkpoint belongs to another model or optimizer layout, its state
            was quantized by another optimizer class or block size (or this one quantizes and
            it was not), or its files are damaged.
    """
    folder = Path(path)
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(
            f"load_checkpoint: {folder} holds no complete checkpoint (no DCP .metadata file); a "
            "save that was interrupted leaves only a '.partial' folder"
        )
    _check_all_ranks_enter("load_checkpoint", optimizer)
    optimizer.sync_params()
    reader = dcp.FileSystemReader(folder)
    meta = {_META_NUM_PARAMS: torch.zeros((), dtype=torch.int64)}
    try:
        _load(meta, reader, optimizer)
        saved = reader.read_metadata().state_dict_metadata
        quantizer = saved_quantizer_entries(saved)
        if quantizer:
            _load(quantizer, reader, optimizer)
    except CheckpointException as error:
        raise ValueError(
            f"load_checkpoint: {folder} could not be read (damaged files, or not written by "
            f"save_checkpoint); nothing was changed. DCP reported: {error}"
        ) from error
    num_params = len(optimizer.shards.buffers.params)
    if int(meta[_META_NUM_PARAMS]) != num_params:
        raise ValueError(
            f"load_checkpoint: the checkpoint at {folder} holds {int(meta[_META_NUM_PARAMS])} optimizer "
            f"params but this optimizer has {num_params}; it belongs to another model"
        )
    check_quantizer(folder, quantizer, optimizer.shards)
    plan = _LoadPlan(optimizer, saved)
    model_entries = {key: value.detach().clone() for key, value in _model_entries(model).items()}
    state = {**model_entries, **plan.entries}
    try:
        _load(state, reader, optimizer)
    except CheckpointException as error:  # a BaseException: it would slip past `except Exception`
        raise ValueError(
            f"load_checkpoint: {folder} could not be read (damaged files, or written for another model "
            f"or optimizer); nothing was changed. DCP reported: {error}"
        ) from error
    with torch.no_grad():
        for key, value in _model_entries(model).items():
            value.copy_(state[key])
    plan.install(state)


def _load(state: dict[str, Any], reader: dcp.FileSystemReader, optimizer: ShardingStage1) -> None:
    dcp.load(state, storage_reader=reader, planner=PieceLoadPlanner(), process_group=optimizer.process_group)


def _check_all_ranks_enter(function: str, optimizer: ShardingStage1) -> None:
    if optimizer.closed:
        raise RuntimeError(closed_error(function))
    fix = f"Call {function}(path, model, opt) on every rank; each rank reads or writes its own shard"
    optimizer.entry_guard.check(function, fix)


def _model_entries(model: nn.Module) -> dict[str, Tensor]:
    return {f"model.{name}": tensor for name, tensor in model.state_dict().items()}


def _save_entries(optimizer: ShardingStage1) -> dict[str, Tensor | ParamPiece]:
    """DCP entries for the optimizer, see Note [Checkpoint layout]."""
    entries: dict[str, Tensor | ParamPiece] = {
        _META_NUM_PARAMS: torch.tensor(len(optimizer.shards.buffers.params), dtype=torch.int64),
        **quantizer_entries(optimizer.shards),
    }
    for group_index, group in enumerate(optimizer.param_groups):
        entries.update(_hyperparameter_entries(group_index, group))
    local = param_states(optimizer.shards.inner, optimizer.shards.live_shards())
    descriptions = describe_param_states(optimizer.shards, local)
    per_param = _PerParamEntries(optimizer, writing=True)
    for index, description in descriptions.items():
        for key, (kind, value) in description.items():
            name = f"state.{index}.{key}"
            local_value = local.get(index, {}).get(key)
            if kind == "quantized":
                entries.update(quantized_save_entries(index, key, value, local_value, per_param.entry))
            elif kind == "scalar":
                entries.update(_scalar_entries(index, key, value))
            elif kind == "per_block":
                ratio = Fraction(1, block_size_of(optimizer.shards, index))
                entries[f"{PER_BLOCK}.{index}.{key}"] = per_param.entry(index, local_value, value, ratio)
            else:
                entries[name] = per_param.entry(index, local_value, value)
    for shard in optimizer.shards.live_shards():
        master = shard.master
        if master is None:
            continue
        for piece in shard.pieces:
            local_master = master[piece.shard_start : piece.shard_start + piece.numel]
            entries[f"master.{piece.param_index}"] = per_param.entry(
                piece.param_index, local_master, master.dtype
            )
    return entries


def _scalar_entries(index: int, key: str, value: Any) -> dict[str, Tensor]:
    """The replicated entry of a param's state value that is not per element, if it is one a
    checkpoint holds (a tensor, or a Python int), see Note [Checkpoint layout]."""
    if isinstance(value, Tensor):
        return {f"{_WHOLE_STATE if value.dim() > 0 else 'state'}.{index}.{key}": value}
    if type(value) is int:
        return {f"{_INT_STATE}.{index}.{key}": torch.tensor(value, dtype=torch.int64)}
    return {}


class _LoadPlan:
    """The DCP entries to read into for this rank's layout, and how to install them."""

    def __init__(self, optimizer: ShardingStage1, saved: dict[str, Any]) -> None:
        self._optimizer = optimizer
        self._saved = saved
        per_param = _PerParamEntries(optimizer, writing=False)
        device = optimizer.plan.buckets[0].device
        self.entries: dict[str, Tensor | ParamPiece] = {}
        self._local: dict[str, tuple[str, int, str | None, Tensor]] = {}
        for name, meta in saved.items():
            parsed = _parse_state_name(name)
            if parsed is None or not hasattr(meta, "properties"):
                continue
            prefix, index, key = parsed
            if not 0 <= index < len(optimizer.shards.buffers.params):
                raise ValueError(f"load_checkpoint: the checkpoint holds state for unknown param {index}")
            if key is None and not optimizer.shards.bucket_of(index).precision.has_master:
                continue  # saved with a master copy, loaded without one: the params are the truth
            dtype = meta.properties.dtype
            if len(meta.size) == 0 or prefix == _WHOLE_STATE:
                value = torch.zeros(tuple(meta.size), dtype=dtype)
                self.entries[name] = value
            else:
                ratio = Fraction(1)
                if prefix == PER_BLOCK:
                    ratio = Fraction(1, block_size_of(optimizer.shards, index))
                value = torch.zeros(per_param.local_numel(index, ratio), dtype=dtype, device=device)
                self.entries[name] = per_param.entry(index, value, dtype, ratio)
            self._local[name] = (prefix, index, key, value)
        for name, meta in saved.items():
            if name.startswith(_HYPER_PREFIXES) and hasattr(meta, "properties"):
                self.entries[name] = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
        self._quantized = QuantizedLoad(optimizer.shards, saved, per_param.pieces, per_param.entry)
        self.entries.update(self._quantized.entries)

    def install(self, loaded: dict[str, Any]) -> None:
        optimizer = self._optimizer
        states: dict[int, dict[str, Any]] = {}
        masters: dict[int, Tensor] = {}
        for prefix, index, key, value in self._local.values():
            if key is None:
                masters[index] = value
            else:
                states.setdefault(index, {})[key] = int(value) if prefix == _INT_STATE else value
        for index, values in self._quantized.values().items():
            states.setdefault(index, {}).update(values)
        for index in states:
            optimizer.shards.materialize(optimizer.shards.bucket_of(index))
        pieces = local_pieces(optimizer.shards)
        local_states = {index: state for index, state in states.items() if index in pieces}
        for group_index, group in enumerate(optimizer.param_groups):
            _restore_hyperparameters(group_index, group, loaded)
        shards = optimizer.shards
        load_param_states(shards.inner, shards.live_shards(), local_states, optimizer.param_groups)
        with torch.no_grad():
            for shard in optimizer.shards.live_shards():
                if shard.master is None:
                    continue
                if shard.published is not None:
                    shard.master.copy_(shard.param_view)  # the loaded params, where no master was saved
                for piece in shard.pieces:
                    master = masters.get(piece.param_index)
                    if master is not None:
                        shard.master[piece.shard_start : piece.shard_start + piece.numel] = master
                if shard.published is None:
                    shard.refresh_master()
        # Params shared as deltas trail their masters: rebuild them exactly from the loaded ones.
        republish_exactly(shards.buckets)


def _parse_state_name(name: str) -> tuple[str, int, str | None] | None:
    """``(prefix, param, key)`` of a param's state entry (key None: its master), or None."""
    parts = name.split(".", 2)
    if parts[0] in ("state", _WHOLE_STATE, _INT_STATE, PER_BLOCK) and len(parts) == 3 and parts[1].isdigit():
        return parts[0], int(parts[1]), parts[2]
    if parts[0] == "master" and len(parts) == 2 and parts[1].isdigit():
        return parts[0], int(parts[1]), None
    return None


class _PerParamEntries:
    """Turns this rank's piece of a param into the param's checkpoint entry, see Note
    [Checkpoint layout]. With hybrid sharding only the first replica of each shard writes (so
    each piece is written once); every replica reads its own pieces."""

    def __init__(self, optimizer: ShardingStage1, writing: bool) -> None:
        self._optimizer = optimizer
        self.pieces = local_pieces(optimizer.shards)
        groups = optimizer.shard_groups
        self._writes = not writing or groups.replica_rank == 0 or not optimizer.shards.comm.sharded

    def entry(
        self, index: int, local: Tensor | None, dtype: torch.dtype, ratio: Fraction = Fraction(1)
    ) -> Tensor | ParamPiece:
        """``local`` holds this rank's entries of param ``index``'s state (None: this rank has
        none), ``ratio`` entries per element of the param (a quantized value's codes or scales,
        Note [Quantized state in checkpoints] in ``quantized_checkpoint``)."""
        _, numel = self._span(index, 0, self._param_numel(index), ratio)
        if not self._optimizer.shards.comm.sharded:
            if local is None:
                raise RuntimeError(f"checkpoint: unsharded state of param {index} is missing")
            return local
        piece = self.pieces.get(index) if self._writes else None
        if piece is None:
            return ParamPiece(None, 0, numel, dtype)
        offset, count = self._span(index, piece.param_start, piece.numel, ratio)
        if local is None or local.numel() != count:
            raise RuntimeError("checkpoint: a local state piece does not match the layout")
        return ParamPiece(local, offset, numel, dtype)

    def local_numel(self, index: int, ratio: Fraction) -> int:
        """Entries of this rank's piece of param ``index`` at ``ratio`` per element (0: none)."""
        piece = self.pieces.get(index)
        return 0 if piece is None else self._span(index, piece.param_start, piece.numel, ratio)[1]

    def _span(self, index: int, start: int, numel: int, ratio: Fraction) -> tuple[int, int]:
        """The first entry and the number of entries of elements ``[start, start + numel)`` of
        param ``index``. An entry begun counts whole at the param's end only (a scale of
        bitsandbytes' partial last block); elsewhere pieces lie on blocks, so hold whole entries."""
        end = start + numel
        first, last = start * ratio, end * ratio
        if first.denominator != 1 or (last.denominator != 1 and end != self._param_numel(index)):
            raise RuntimeError(f"checkpoint: a piece of param {index} holds part of an entry of its state")
        return int(first), math.ceil(last) - int(first)

    def _param_numel(self, index: int) -> int:
        return self._optimizer.shards.buffers.params[index].numel()


def _hyperparameter_entries(group_index: int, group: dict[str, Any]) -> dict[str, Tensor]:
    """Hyperparameters as tensors whose key says the Python type to restore: floats as float64,
    ints as int64, tensors as themselves, tuples of numbers as float64 vectors. Flags (bools)
    and anything else stay as the optimizer was built."""
    entries = {}
    for key, value in group.items():
        if isinstance(value, bool) or key == "params":
            continue
        if isinstance(value, Tensor):
            entries[f"{_HYPER_TENSOR}.{group_index}.{key}"] = value.detach().clone()
        elif isinstance(value, int):
            entries[f"{_HYPER_INT}.{group_index}.{key}"] = torch.tensor(value, dtype=torch.int64)
        elif isinstance(value, float):
            entries[f"{_HYPER_FLOAT}.{group_index}.{key}"] = torch.tensor(value, dtype=torch.float64)
        elif (
            isinstance(value, tuple)
            and value
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        ):
            entries[f"{_HYPER_TUPLE}.{group_index}.{key}"] = torch.tensor(
                [float(v) for v in value], dtype=torch.float64
            )
    return entries


def _restore_hyperparameters(group_index: int, group: dict[str, Any], loaded: dict[str, Any]) -> None:
    for prefix in (_HYPER_FLOAT, _HYPER_INT, _HYPER_TENSOR, _HYPER_TUPLE):
        marker = f"{prefix}.{group_index}."
        for name, value in loaded.items():
            if not name.startswith(marker):
                continue
            key = name[len(marker) :]
            if prefix == _HYPER_TENSOR:
                current = group.get(key)
                device = current.device if isinstance(current, Tensor) else value.device
                group[key] = value.clone().to(device)
            elif prefix == _HYPER_INT:
                group[key] = int(value.item())
            elif prefix == _HYPER_FLOAT:
                group[key] = float(value.item())
            else:
                current = group.get(key)
                kinds = [type(c) for c in current] if isinstance(current, tuple) else []
                group[key] = tuple(
                    int(v) if i < len(kinds) and kinds[i] is int and float(v).is_integer() else float(v)
                    for i, v in enumerate(value.tolist())
                )


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
