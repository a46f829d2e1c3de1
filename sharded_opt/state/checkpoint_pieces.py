"""One param's state as ``torch.distributed.checkpoint`` sees it: a 1-D tensor of the param's
numel of which this rank holds one contiguous piece (or nothing).

Note [Pieces without ShardedTensor]
    A rank's shard of a bucket cuts params at arbitrary element offsets, so the pieces of a
    param held by the ranks have uneven sizes that no ``DTensor`` placement describes (``Shard``
    cuts as ``torch.chunk`` does). ``ShardedTensor`` described them and DCP resharded from its
    chunk metadata, but torch deprecates it and warns (``FutureWarning``) on every use. DCP's
    planners reach a state-dict value through three hooks, the protocol ``DTensor`` implements
    (``torch.distributed._checkpointable``): ``__create_write_items__`` (what this rank writes),
    ``__create_chunk_list__`` (what this rank reads) and, for the tensor behind an item, a
    lookup that the planners below route to :class:`ParamPiece`. The chunks it writes are
    the ones ``ShardedTensor`` wrote (offset and size of each piece in the param, the same
    tensor properties), so checkpoints written before load unchanged and DCP reshards on load
    from the chunks of every rank as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclasses.dataclass(frozen=True, slots=True)
class ParamPiece:
    """``local``: this rank's elements ``[offset, offset + local.numel())`` of a param of
    ``numel`` elements in ``dtype``; None when this rank writes or reads none of them."""

    local: Tensor | None
    offset: int
    numel: int
    dtype: torch.dtype

    def size(self) -> torch.Size:
        """The whole param's size (DCP checks it against the saved one)."""
        return torch.Size([self.numel])

    def __create_write_items__(self, fqn: str, _: object) -> list[WriteItem]:
        if self.local is None:
            return []
        chunk = self._chunk(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk, TensorProperties(dtype=self.dtype), self.size()),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [] if self.local is None else [self._chunk(self.local)]

    def tensor_at(self, index: MetadataIndex) -> Tensor:
        """The local piece, which DCP names by its offset in the param."""
        if self.local is None or index.offset != torch.Size([self.offset]):
            raise ValueError(f"checkpoint: no local piece of {index.fqn} at {index.offset}")
        return self.local

    def _chunk(self, local: Tensor) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size([self.offset]), local.size())


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also finds the tensor behind a :class:`ParamPiece`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        return value.tensor_at(index) if isinstance(value, ParamPiece) else super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that also finds the tensor behind a :class:`ParamPiece`."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        # The default set-up replaces values of types it does not know by None (its pass that
        # materializes meta tensors); put the pieces back. Entries are top-level keys, so the
        # flattened dict uses the same ones.
        pieces = {key: value for key, value in state_dict.items() if isinstance(value, ParamPiece)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        value = self.state_dict.get(index.fqn)
        return value.tensor_at(index) if isinstance(value, ParamPiece) else super().lookup_tensor(index)
