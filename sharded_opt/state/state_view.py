"""``ShardingStage1.state``: no per-param state here, and a clear error for code that looks for it.

Note [No per-param state]
    A torch optimizer keeps ``optimizer.state[param]``, a dict of full-size tensors per param.
    The wrapper keeps the wrapped class's state for the pieces of its local shard only, keyed by
    those pieces, so there is nothing to hand out per param without gathering it over every
    rank. Code that only iterates ``optimizer.state`` (moving state to a device after loading a
    checkpoint, counting it) finds it empty and does nothing, which is right: the shards are
    already where the params are. Code that looks up or writes one param's state would, with the
    empty ``defaultdict`` torch's base class leaves, read ``{}`` or write into nothing and go on
    silently, so a lookup raises ``KeyError`` and a write ``TypeError``, both naming
    ``state_dict()`` / ``load_state_dict()``, which move the full state of every param.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

_HOW = (
    "ShardingStage1 keeps optimizer state only for this rank's shard of the flat buffers, not per "
    "param. Read the full state of every param with opt.state_dict() (on every rank; "
    "state_dict(to_rank=0) gathers it on one), change it and put it back with opt.load_state_dict()"
)


class ShardedStateView(Mapping):
    """Empty to iterate; a lookup or write of one param's state raises, naming the calls that work."""

    def __getitem__(self, param: Any) -> NoReturn:
        raise KeyError(f"opt.state[param]: {_HOW}")

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __setitem__(self, param: Any, value: Any) -> NoReturn:
        raise TypeError(f"opt.state[param] = ...: {_HOW}")

    def __delitem__(self, param: Any) -> NoReturn:
        raise TypeError(f"del opt.state[param]: {_HOW}")

    def __repr__(self) -> str:
        return "ShardedStateView(per-param state lives in shards; see opt.state_dict())"
