"""The communication stream and the two dependencies between it and compute.

Note [Streams and events]
    On an accelerator, collectives are issued on a dedicated side stream so they can run while
    the default (compute) stream runs backward or forward kernels. Two dependencies keep this
    correct, mirroring Paddle's ``c_wait_compute`` / ``c_wait_comm`` ops:

    * ``wait_compute``: before a collective reads a buffer, the comm stream waits for an event
      recorded on the compute stream after the last kernel that wrote it (the last grad
      accumulation of a bucket, or the last optimizer op on a shard).
    * ``wait_comm``: before compute reads a buffer a collective wrote, the compute stream waits
      for that collective (``Work.wait()`` makes the *current* stream wait, without blocking the
      host, on NCCL-like backends).

    On CPU there is no stream: host code is already ordered after every compute op it issued, so
    ``wait_compute`` has nothing to do, and an async gloo collective's ``Work`` handle plays the
    event's role: ``wait_comm`` blocks the host until the collective is done.

    The buffers that collectives read or write are allocated once and live as long as the
    wrapper, so the caching allocator can never hand their memory to another tensor while a
    collective on the side stream still uses it.

Everything here is device-generic (``torch.Stream``, ``torch.Event``, ``torch.accelerator``):
CUDA, ROCm and XPU take the same path and nothing branches on a device name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.distributed import Work
from torch.futures import Future


def new_comm_stream(device: torch.device) -> torch.Stream | None:
    """A fresh side stream on ``device``'s accelerator, or None on CPU."""
    if device.type == "cpu":
        return None
    return torch.Stream(device=device)


@contextlib.contextmanager
def on_stream(stream: torch.Stream | None) -> Iterator[None]:
    """Make ``stream`` current for the block (nothing to do on CPU)."""
    if stream is None:
        yield
        return
    with stream:
        yield


def wait_compute(comm_stream: torch.Stream | None) -> torch.Event | None:
    """Make ``comm_stream`` wait for all work queued so far on the current compute stream.

    Records an event on the compute stream and makes the comm stream wait on it; the host is not
    blocked. Returns the event (None on CPU, where host order already implies the dependency).
    See Note [Streams and events].
    """
    if comm_stream is None:
        return None
    compute_stream = torch.accelerator.current_stream(comm_stream.device)
    event = torch.Event(device=comm_stream.device)
    event.record(compute_stream)
    comm_stream.wait_event(event)
    return event


def wait_comm(works: Iterable[Work | Future | None]) -> None:
    """Make the current compute stream (on CPU: the host) wait for the given collectives.

    Raises whatever a failed collective raised, in the caller's thread, so an error in
    background communication surfaces in the training loop. See Note [Streams and events].
    """
    for work in works:
        if work is not None:
            work.wait()
