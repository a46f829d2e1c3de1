"""``StateDictMethods``: the state-dict methods of ``ShardingStage1``'s ``torch.optim`` surface.

torch's ``state_dict`` / ``load_state_dict`` and ``ZeroRedundancyOptimizer``'s
``consolidate_state_dict``: what trainers and checkpoint code call on the optimizer itself
(``docs/trainers.md``), each a collective of the wrapper's group, refused once the wrapper is
closed. The conversions and the collectives are ``StateDictExchange``'s (``state_dict``). The
methods and their contracts live in this base class because torch's protocol needs them on the
optimizer object itself, and ``optimizer`` keeps to the training loop and the wrapper's life.
"""

from __future__ import annotations

from typing import Any

import torch

from sharded_opt.state.state_dict import StateDictExchange
from sharded_opt.wrapper_lifetime import WrapperLifetime


class StateDictMethods(torch.optim.Optimizer):
    """Base class of ``ShardingStage1`` for its state-dict methods; the subclass sets
    ``_state_dicts`` and ``_lifetime`` when it is built."""

    _state_dicts: StateDictExchange
    """Does the work of every method here."""
    _lifetime: WrapperLifetime
    """Refuses the methods once the wrapper is closed."""

    def state_dict(self, *, to_rank: int | None = None) -> dict[str, Any] | None:  # type: ignore[override]
        """The wrapped optimizer's state in the standard ``torch.optim`` format (collective).

        Per original param (same indices as the user's optimizer) with state tensors of the
        param's own shape: it loads into a plain optimizer of the same class, or into a
        ``ShardingStage1`` on any number of ranks (``docs/checkpoints.md``). State-dict hooks
        run as in torch; post-hooks only on the ranks that get the state dict. After
        :meth:`consolidate_state_dict`, ``state_dict()`` without ``to_rank`` is not collective
        until the next ``step()`` or ``load_state_dict()``.

        Args:
            to_rank: materialize the full state on this rank of the group only; the other ranks
                return None. Default: every rank gets it.

        Raises:
            ValueError: ``to_rank`` is not a rank of the group.
            RuntimeError: only some ranks called it (Note [Collectives entered by some ranks]),
                or on another rank than the one :meth:`consolidate_state_dict` gathered to.
        """
        self._lifetime.check_open("state_dict")
        return self._state_dicts.state_dict(self, to_rank)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state on rank ``to`` of the group, for a later ``state_dict()`` there
        (collective; torch ``ZeroRedundancyOptimizer``'s protocol).

        Frameworks that save on one rank (Lightning, code written for torch's ZeRO) call this on
        every rank, then ``state_dict()`` on rank ``to`` alone, which until the next ``step()``
        or ``load_state_dict()`` returns the gathered state without communicating (with the
        current param groups) and raises on the other ranks (``docs/trainers.md``). Only rank
        ``to`` holds the gathered state meanwhile.

        Raises:
            ValueError: ``to`` is not a rank of the group.
            RuntimeError: only some ranks called it (see Note [Collectives entered by some ranks]).
        """
        self._lifetime.check_open("consolidate_state_dict")
        self._state_dicts.consolidate(to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a standard ``torch.optim`` state dict (from a plain optimizer or from
        :meth:`state_dict`, saved on any number of ranks).

        Everything is validated before anything changes: on error the optimizer is exactly as
        it was. Load-state-dict hooks run around it, as in torch.

        Raises:
            ValueError: wrong structure, number of groups or params, state keys of another
                optimizer class or configuration, or state shapes that do not match the params.
        """
        self._lifetime.check_open("load_state_dict")
        self._state_dicts.load_state_dict(self, state_dict)
