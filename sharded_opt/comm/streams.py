"""The communication stream and the two dependencies between it and compute.

Note [Streams and events]
    Three kinds of stream take part on an accelerator: the compute stream (current when the
    user runs forward, backward and ``step()``), the wrapper's comm stream (``new_comm_stream``)
    and the process group's own internal stream. Facts the code relies on (torch 2.13):

    * A collective with ``async_op=True`` does not run on the stream current at the call. NCCL
      enqueues it on the process group's internal stream, which first waits for the stream that
      was current at the call. So the comm stream only runs what the wrapper itself enqueues
      there (the casts of grads to ``reduce_dtype`` and copies into the reduction buffer); the
      collective starts after those and after whatever the comm stream already waited for.
      Gloo with device tensors behaves alike: it copies through the host on a stream of its
      own that waits for the current one.
    * ``Work.wait()`` makes the *current* stream (not the host, on NCCL-like backends) wait for
      the collective's end. It orders only that stream: another stream that later touches the
      collective's buffers must wait too, or wait for an event recorded after this wait.
    * The process group keeps the tensors of an async collective alive (it stashes them) and
      lets them go at ``wait()``; ``record_stream`` is no longer how their memory is protected.
      When a temporary is then freed, the caching allocator returns its block to the stream it
      was allocated on (the comm stream, for the casts) with no record of the internal stream's
      use. A temporary freed after a compute-side wait and refilled by a new allocation on the
      comm stream is therefore a race unless the comm stream waited too. Every block of
      comm-stream work here begins with ``wait_compute`` (an event recorded on the compute
      stream *after* its waits), so the comm stream is always ordered after every collective
      the compute stream already waited for; keep it that way when adding comm-stream work.
      A temporary used by a future's callback (which runs on a stream the future picks) is
      marked with ``record_stream`` by whoever allocated it, see ``collectives``.

    The two dependencies, mirroring Paddle's ``c_wait_compute`` / ``c_wait_comm`` ops:

    * ``wait_compute``: before a collective reads a buffer, the comm stream waits for an event
      recorded on the compute stream after the last kernel that wrote it (the last grad
      accumulation of a bucket, or the last optimizer op on a shard).
    * ``wait_comm``: before compute reads a buffer a collective wrote, the compute stream waits
      for that collective.

    Grads of one bucket can be accumulated on several streams. The autograd engine runs each
    leaf's accumulation (and its post-accumulate-grad hooks) on the stream of the op that used
    the leaf in forward, so a bucket whose params were used on a side stream (a side-stream
    block, MoE experts) is written by several streams, and the one current in the bucket's last
    hook is only one of them. So in overlap mode each hook notes its current stream for its
    bucket (``note_current_stream``: one comparison, as a bucket's grads nearly always come from
    one stream; on CPU no hook notes anything), and the bucket's reduction makes the comm stream
    wait on an event recorded on each noted stream, besides the current one (``wait_compute``'s
    ``producers``). Recording at launch time is enough: every noted accumulation was already
    enqueued when its hook ran. Streams noted inside ``no_sync()`` are kept until the bucket's
    next reduction. Sync mode needs none of this: at the end of backward the engine makes the
    stream that called ``backward()`` wait for every leaf's stream, and ``step()`` runs after it.

    An all-gather's completion must reach every stream that reads the params, not once: the
    first wait for a bucket (a forward pre-hook, ``sync_params``, ``step``) turns the handle into
    an event (``record_completion``: the comm stream waits on the handle, which does not block
    the host on NCCL, and an event is recorded there), kept until the bucket's next all-gather.
    Every stream that waits for the bucket later waits on that event once
    (``wait_event_once``): a forward run on another stream, a second consumer, or, before a
    CUDA graph replay, ``ShardingStage1.wait_for_params(stream)``. A replay runs captured
    kernels without running the hooks, and the event of the step before it is a new one, so a
    replay must be preceded by that call on the replaying stream every time. Turning the handle
    into an event at the first wait rather than right after the all-gather is issued keeps
    ``step()`` from blocking the host on backends whose ``wait()`` does (gloo with device
    tensors). On CPU the first wait blocks the host and host order covers every later reader.

    The casts of grads to ``reduce_dtype`` reuse two staging buffers (Note [Bounded staging] in
    ``comm_context``): before the comm stream overwrites one, it waits on the handle of the
    reduction that last read it (``Work.wait()`` with the comm stream current), so the host is
    not blocked and the cast is ordered after that collective.

    The comm stream has high priority (``priority=-1``, as FSDP2 gives its all-gather and
    reduce-scatter streams): its casts are short and sit on the critical path of a collective,
    so they should not queue behind long compute kernels.

    On CPU there is no stream: host code is already ordered after every compute op it issued, so
    ``wait_compute`` has nothing to do, and an async gloo collective's ``Work`` handle plays the
    event's role: ``wait_comm`` blocks the host until the collective is done.

    The buffers that collectives read or write persistently (flat buffers, reduced shards) are
    allocated once and live as long as the wrapper, so the allocator never hands their memory
    to another tensor while a collective still uses it.

    Bitwise equality of sync and overlap mode holds because both issue the same collectives on
    the same buffers in the same order; it assumes the backend reduces deterministically. NCCL's
    NVLS (NVSwitch multicast) and SHARP/CollNet reductions on NVSwitch or InfiniBand-switch
    nodes reduce inside the switch, and their summation order is not guaranteed to be the same
    from one call to the next. On such nodes two runs (or sync and overlap) agree only up to
    reduction-order rounding (about one ulp of the reduce dtype per element per step, which
    training can amplify), unless NVLS is disabled (``NCCL_NVLS_ENABLE=0``) and the algorithm
    is pinned (``NCCL_ALGO=Ring`` or ``Tree``, same on every run), which restores bitwise
    reproducibility at some bandwidth cost.

Everything here is device-generic (``torch.Stream``, ``torch.Event``, ``torch.accelerator``):
CUDA, ROCm and XPU take the same path and nothing branches on a device name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.distributed import Work
from torch.futures import Future

COMM_STREAM_PRIORITY = -1
"""Higher than compute's default 0 (lower is higher), see Note [Streams and events]."""


def new_comm_stream(device: torch.device) -> torch.Stream | None:
    """A fresh high-priority side stream on ``device``'s accelerator, or None on CPU."""
    if device.type == "cpu":
        return None
    return torch.Stream(device=device, priority=COMM_STREAM_PRIORITY)


@contextlib.contextmanager
def on_stream(stream: torch.Stream | None) -> Iterator[None]:
    """Make ``stream`` current for the block (nothing to do on CPU)."""
    if stream is None:
        yield
        return
    with stream:
        yield


def wait_compute(
    comm_stream: torch.Stream | None, producers: Iterable[torch.Stream] = ()
) -> torch.Event | None:
    """Make ``comm_stream`` wait for all work queued so far on the current compute stream and
    on each of ``producers`` (other streams that wrote part of the input, e.g. grads accumulated
    by backward ops on side streams).

    Records an event on each of those streams and makes the comm stream wait on it; the host is
    not blocked. Returns the current stream's event (None on CPU, where host order already
    implies the dependency). See Note [Streams and events].
    """
    if comm_stream is None:
        return None
    compute_stream = torch.accelerator.current_stream(comm_stream.device)
    event = _recorded_event(compute_stream)
    comm_stream.wait_event(event)
    for stream in producers:
        if stream != compute_stream and stream != comm_stream:
            comm_stream.wait_event(_recorded_event(stream))
    return event


def note_current_stream(seen: list[torch.Stream], device: torch.device) -> None:
    """Add ``device``'s current stream to ``seen`` unless it is there already.

    Called once per grad in backward hooks: ``seen`` usually holds one stream, so this is one
    comparison. See Note [Streams and events].
    """
    stream = torch.accelerator.current_stream(device)
    if stream not in seen:
        seen.append(stream)


def record_completion(work: Work | Future, comm_stream: torch.Stream | None) -> torch.Event | None:
    """Turn a collective's handle into an event that any stream can wait on, any number of times.

    ``Work.wait()`` orders only the stream current at the call, once; so the comm stream waits
    for the collective and an event is recorded there after that wait. The host is not blocked
    on backends whose ``wait()`` only orders streams (NCCL). On CPU the host waits for the
    collective and None is returned: host order then covers every later reader. See Note
    [Streams and events].
    """
    if comm_stream is None:
        work.wait()
        return None
    with comm_stream:
        work.wait()
    return _recorded_event(comm_stream)


def wait_event_once(event: torch.Event | None, waited: list[torch.Stream]) -> None:
    """Make the current stream wait on ``event`` unless it is in ``waited`` (streams that
    already waited on this very event); then it is. Nothing to do for None (CPU)."""
    if event is None:
        return
    stream = torch.accelerator.current_stream(event.device)
    if stream not in waited:
        stream.wait_event(event)
        waited.append(stream)


def _recorded_event(stream: torch.Stream) -> torch.Event:
    event = torch.Event(device=stream.device)
    event.record(stream)
    return event


def wait_comm(works: Iterable[Work | Future | None]) -> None:
    """Make the current compute stream (on CPU: the host) wait for the given collectives.

    Raises whatever a failed collective raised, in the caller's thread, so an error in
    background communication surfaces in the training loop. See Note [Streams and events].
    """
    for work in works:
        if work is not None:
            work.wait()
