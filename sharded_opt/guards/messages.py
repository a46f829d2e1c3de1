"""Messages that errors of several modules share, kept in one place so that every error of a
kind names the same fix in the same words: the DDP refusals (at construction, at a forward, at
the end of backward) and the calls on a closed wrapper (its methods, the checkpoint functions).
"""

from __future__ import annotations

DROP_DDP = (
    "Drop the DistributedDataParallel wrapper: build the optimizer over the plain module, pass "
    "that module as model= and call it in the training loop (README, Coming from DDP)"
)
"""The fix for a model wrapped in DDP, also named by the errors a DDP-written grad causes."""


def closed_error(caller: str) -> str:
    """The message for a call on a closed wrapper: its hooks, and groups it created, are gone."""
    return (
        f"{caller}: this ShardingStage1 was closed (close() or the end of its `with` block); its hooks "
        "and the process groups it created are gone. Save state (state_dict(), save_checkpoint) "
        "before closing, or build a new ShardingStage1 over the same optimizer to keep training"
    )
