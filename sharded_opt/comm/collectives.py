"""Stateless wrappers over the torch.distributed collectives the wrapper uses.

Note [Reduce-scatter on gloo]
    On CPU tensors, gloo's own collectives do not reach the wire limit: its reduce-scatter is a
    full all-reduce that keeps a slice (DDP's bytes for half the result), its all-gather stays
    above the limit on a shaped link and ``all_to_all_single`` further above it (its two
    directions do not overlap there), while ``isend``/``irecv`` pairs posted together run both
    directions at once and sit at the limit (one bucket on 2 ranks:
    ``benchmarks/results/2026-12-07-figures-from-library-notes.md``, gloo table). With
    ``ShardingConfig.gloo_point_to_point`` both collectives of CPU tensors on gloo run over
    point-to-point instead, every message posted at once (the pairwise exchange: at step k a
    rank sends to rank + k and receives from rank - k, for every k at the same time):

    * reduce-scatter: rank r sends its slice p of the bucket to every peer p and receives slice
      r of every peer into a per-call buffer of the bucket's shape (its own slice copied in),
      then sums the N slices in rank order (``torch.sum`` over the stacked slices, as before, so
      results are bitwise unchanged and the same in sync and overlap mode) and divides by N.
    * all-gather: rank r sends its shard to every peer and receives every peer's shard straight
      into its slot of the output (in place when the input is already a view of that slot).

    Bytes per rank each way are (N-1)/N of the bucket for each, a true reduce-scatter's and
    all-gather's, so a step moves DDP's bytes. A direct exchange and a ring move the same bytes
    per rank; the direct one was kept because it posts everything at once, so no step waits on
    the previous one and the sum stays in rank order (a ring would sum in ring order).

    gloo's point-to-point handles have no future, so an asynchronous reduce-scatter waits for its
    receives and sums on a helper thread started per call, which fulfils the returned future (as
    the all-to-all path does, Note [No Python on gloo's threads]); it overlaps compute and runs
    with the rank's intra-op thread count (1 in the benchmarks), so it takes at most one core's share
    from compute, and only while a bucket's slices are in and not yet summed. Several buckets
    may be in flight on one group at once: point-to-point messages pair up by (peer, tag) in
    the order they were posted, and every rank posts the same collectives in the same order.

    With all of a step's buckets in flight at once, point-to-point gains far less on a shaped
    link than one bucket suggests, because gloo's collectives then already overlap each other's
    directions. On loopback the point-to-point all-gather wins, while the reduce-scatter can
    lose: the helper thread and the copy of the own slice against gloo's all-to-all, which sums
    on its own worker thread. Both together won in every run, on the link and on loopback
    (``benchmarks/results/2026-12-03-gloo-p2p-cpu-2core.md``, the interleaved probe).

    The receive buffer is allocated per call on purpose: persistent per-bucket buffers were
    within the noise of per-call ones (the sign of the difference changed from run to run, same
    file), and they would cost a permanent extra copy of every grad bucket, +4 bytes per fp32
    param on every rank (ZeRO-1's optimizer state is 12/N). A per-call buffer lives only while
    its bucket is in flight, and the communicator bounds how many are
    (Note [Bounded receive buffers] in ``comm_context``).

    Why it is not the default: gloo posts a message from the calling thread and, on loopback,
    copies it there (``gloo:send``/``gloo:recv`` spans on the training thread in a profile of
    the default GPT), where its collectives do that work on their own worker threads, so on one
    machine overlap mode's step was slower against DDP with point-to-point
    (``benchmarks/results/2026-12-03-gloo-p2p-cpu-2core.md``, the section on making it
    opt-in). Over the slow link point-to-point won only while the presence flags shared the
    reductions' group and kept a single all-to-all on the wire; with the flags on a group of
    their own (Note [Presence per bucket] in ``grad_presence``) the comm-bound preset
    (``--preset comm-bound`` against ``--gloo-p2p``) ran overlap slower with point-to-point
    (``benchmarks/results/2026-12-03-presence-group-cpu-2core.md``). So the collectives are the
    default; the option stays for links where a single in-flight collective per direction is
    the limit.

    gloo with accelerator tensors (two ranks on one GPU in benchmarks/gpu_check.py) keeps the
    all-to-all plus local sum and gloo's all-gather: gloo's send and recv hand the tensor's data
    pointer to its transport without staging through the host as its collectives do (not tried
    on a GPU). NCCL uses its own collectives.

Note [No Python on gloo's threads]
    An asynchronous collective whose result needs Python afterwards (the sum of an all-to-all's
    slices, the issue of a replica all-reduce) runs that Python on a helper thread of ours that
    waits for the collective, never as a ``Future.then`` callback on gloo's worker thread. A
    rank that raises (a refused ``step()``, any error in the training loop) can exit with
    collectives in flight; a callback that then needs the GIL while the interpreter finalizes
    ends gloo's C++ thread with a forced unwind, and the process aborts with ``terminate called
    without an active exception`` (SIGABRT, exit code -6, instead of the error's exit code 1).
    The helper threads are not daemons, so the interpreter joins them before it finalizes
    (each ends when its collective completes or fails: at most the group's timeout). The price
    is a thread start per bucket, small against the reduce-scatter itself on the default GPT's
    buckets (``python -m benchmarks.gloo_p2p``, against the callback:
    ``benchmarks/results/2026-12-07-figures-from-library-notes.md``). Accelerator tensors on
    gloo keep the callback: their future carries the streams the sum must run on.

Note [In-place all-gather on gloo]
    gloo's own all-gather of CPU tensors gathers into a flat buffer of its own, the size of the
    output, and copies it into the output afterwards: a transient copy of every bucket being
    gathered (two at a time on gloo's two worker threads: +1 byte per param of the 33.6M-param
    MLP at the end of a step, ``benchmarks/results/2026-12-05-peak-memory.md``). gloo's
    broadcast writes into the tensor it is given. So on gloo, CPU tensors are all-gathered as one
    broadcast per rank, each from its slot of the output (the local shard is already a view of
    it) into the same slot everywhere: nothing is allocated, and each rank sends and receives
    the bytes of an all-gather. On loopback, all buckets in flight, the broadcasts were faster
    than gloo's all-gather and left no transient, for big buckets and small ones alike
    (``benchmarks/results/2026-12-05-peak-memory.md``). The broadcasts run on gloo's worker
    threads like its collectives, so the training thread does not copy messages (as it does on
    the point-to-point path).

    But over a slow link the broadcasts are slower: on the emulated link of ``benchmarks.compare
    --preset comm-bound`` (2 ranks, 13 buckets of about 1 MiB) the sharded collectives alone
    took longer with them than with gloo's all-gather, enough to turn overlap from faster than
    DDP's step to slower (``benchmarks/results/2026-12-05-compile-cpu-2core.md``).
    So buckets below ``BROADCAST_ALL_GATHER_MIN_BYTES`` use gloo's own all-gather: its transient
    copy of such a bucket, two in flight at most, stays within the 16 MiB that the reductions'
    receive buffers are bounded by (Note [Bounded receive buffers] in ``comm_context``), so the
    memory promise holds and only big buckets, where the copy would cost memory, broadcast.

Note [Widening on receipt]
    bf16 grads are reduced in fp32 (Note [Mixed precision] in ``bucket``). Where the slices
    are summed here on the host (CPU tensors on gloo, both paths above), they travel in bf16 and
    are widened while summed: ``torch.sum(..., dtype=float32)`` over the N received bf16 slices
    is bitwise the sum over their fp32 casts in the same order (each bf16 value is exact in fp32,
    and torch casts the input before its reduction). So the reduction no longer needs an fp32
    cast of the whole bucket as its input (4 bytes per param of staging, two buckets at a time)
    and half the bytes cross the wire, with the same result. torch's cast before the reduction
    would itself be an fp32 copy of every received slice, so the sum runs over column chunks
    of ``WIDENING_CHUNK_NUMEL`` (each column's N values are summed alone, so chunks change no
    bit). NCCL and accelerator tensors still reduce an fp32 cast (Note [Bounded staging]).

torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to
``reduce_scatter_single``/``all_gather_single`` and warns on the old names; older releases only
have the old ones. These wrappers pick whichever exists so users see no warning on any version.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp, Work
from torch.futures import Future

WIDENING_CHUNK_NUMEL = 64 * 1024
"""Elements of the output summed per call when the received slices are widened: torch casts a
reduction's whole input to the output dtype first, and a chunk's cast stays small (1 MiB over
four fp32 slices) where the whole bucket's would be a full-bucket copy (Note [Widening on
receipt])."""

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_avg(
    output: Tensor, input: Tensor, group: ProcessGroup, async_op: bool, point_to_point: bool = False
) -> Work | Future | None:
    """Average ``input`` over the group; rank r receives the r-th equal slice in ``output``.

    With ``async_op``, returns a handle whose ``wait()`` makes ``output`` final.
    ``point_to_point`` selects the point-to-point path for CPU tensors on gloo (Note
    [Reduce-scatter on gloo]). ``output`` may have a wider dtype than ``input`` where
    :func:`widens_on_receipt` (Note [Widening on receipt]).
    """
    if backend_for_device(group, input.device.type) == "gloo":
        if point_to_point and input.device.type == "cpu":
            return _reduce_scatter_by_p2p(output, input, group, async_op)
        return _reduce_scatter_by_all_to_all(output, input, group, async_op)
    return _reduce_scatter(output, input, op=ReduceOp.AVG, group=group, async_op=async_op)


def widens_on_receipt(group: ProcessGroup, device: torch.device) -> bool:
    """Whether :func:`reduce_scatter_avg` of ``device`` tensors on ``group`` sums the received
    slices on the host, so its output may be wider than its input (CPU tensors on gloo)."""
    return device.type == "cpu" and backend_for_device(group, "cpu") == "gloo"


def backend_for_device(group: ProcessGroup, device_type: str) -> str:
    """The backend that runs ``group``'s collectives on tensors of ``device_type``: the matching
    pair of a ``"cpu:gloo,cuda:nccl"`` style group, else the group's one backend."""
    backend = str(dist.get_backend(group))
    if ":" not in backend:
        return backend
    pairs = dict(pair.split(":", 1) for pair in backend.split(","))
    return pairs.get(device_type, "")


def _reduce_scatter_by_all_to_all(
    output: Tensor, input: Tensor, group: ProcessGroup, async_op: bool
) -> Future | None:
    """See Note [Reduce-scatter on gloo]."""
    world_size = dist.get_world_size(group)
    received = torch.empty_like(input)  # slice r of every rank, in rank order

    def average(_: Future | None = None) -> None:
        sum_received(output, received, world_size)
        if received.device.type != "cpu":
            # A device future runs its callbacks on a stream of its choosing; without this the
            # block could be reused on the comm stream while the sum still reads it. See
            # Note [Streams and events].
            received.record_stream(torch.accelerator.current_stream(received.device))

    work = dist.all_to_all_single(received, input, group=group, async_op=True)
    if not async_op:
        work.wait()
        average()
        return None
    if input.device.type == "cpu":  # Note [No Python on gloo's threads]
        # Not a "gloo:" span: gloo's own "gloo:all_to_all" already shows the collective.
        return run_after(work, average, "sharded_opt: sum of the all-to-all's slices")
    return work.get_future().then(average)


BROADCAST_ALL_GATHER_MIN_BYTES = 8 * 2**20
"""Gathered buckets from this size up are all-gathered in place by broadcasts on CPU gloo; smaller
ones by gloo's all-gather, see Note [In-place all-gather on gloo]."""


def all_reduce_avg(tensor: Tensor, group: ProcessGroup, async_op: bool) -> Work | None:
    """Average ``tensor`` in place over the group."""
    return dist.all_reduce(tensor, op=ReduceOp.AVG, group=group, async_op=async_op)


def all_gather(
    output: Tensor, input: Tensor, group: ProcessGroup, async_op: bool, point_to_point: bool = False
) -> Work | Future | None:
    """Concatenate every rank's ``input`` into ``output``; ``input`` may be a view of ``output``
    at this rank's slice (an in-place all-gather, as FSDP2 uses).

    With ``async_op``, returns a handle whose ``wait()`` makes ``output`` final.
    ``point_to_point`` as for :func:`reduce_scatter_avg`.
    """
    if input.device.type == "cpu" and backend_for_device(group, "cpu") == "gloo":
        if point_to_point:
            works = _all_gather_by_p2p(output, input, group)
            if async_op:
                return run_after(works, _nothing, "gloo:all_gather (point-to-point)")
        elif output.numel() * output.element_size() < BROADCAST_ALL_GATHER_MIN_BYTES:
            return _all_gather(output, input, group=group, async_op=async_op)
        else:
            works = _all_gather_by_broadcasts(output, input, group)
            if async_op:
                return works
        works.wait()
        return None
    return _all_gather(output, input, group=group, async_op=async_op)


class P2PWorks:
    """The operations one collective is made of (point-to-point messages, or one broadcast per
    rank); ``wait()`` returns once all completed (what ``Work.wait()`` promises for a
    collective), raising the first error."""

    def __init__(self, works: list[Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True


def exchange(sends: list[Tensor], receives: list[Tensor], group: ProcessGroup) -> P2PWorks:
    """Post every message at once: ``sends[p]`` to group rank p and ``receives[p]`` from it, for
    every peer p. See Note [Reduce-scatter on gloo]."""
    rank, world_size = group.rank(), group.size()
    works = []
    for step in range(1, world_size):
        to_peer, from_peer = (rank + step) % world_size, (rank - step) % world_size
        works.append(dist.isend(sends[to_peer], dist.get_global_rank(group, to_peer), group=group))
        works.append(dist.irecv(receives[from_peer], dist.get_global_rank(group, from_peer), group=group))
    return P2PWorks(works)


def _all_gather_by_p2p(output: Tensor, input: Tensor, group: ProcessGroup) -> P2PWorks:
    """See Note [Reduce-scatter on gloo]."""
    slots = list(output.view(group.size(), -1).unbind())
    own = slots[group.rank()]
    if input.data_ptr() != own.data_ptr():
        own.copy_(input.reshape(-1))
    return exchange([own] * group.size(), slots, group)


def _all_gather_by_broadcasts(output: Tensor, input: Tensor, group: ProcessGroup) -> P2PWorks:
    """See Note [In-place all-gather on gloo]."""
    slots = list(output.view(group.size(), -1).unbind())
    own = slots[group.rank()]
    if input.data_ptr() != own.data_ptr():
        own.copy_(input.reshape(-1))
    return P2PWorks(
        [
            dist.broadcast(slot, dist.get_global_rank(group, peer), group=group, async_op=True)
            for peer, slot in enumerate(slots)
        ]
    )


def _reduce_scatter_by_p2p(
    output: Tensor, input: Tensor, group: ProcessGroup, async_op: bool
) -> Future | None:
    """See Note [Reduce-scatter on gloo]."""
    received = torch.empty_like(input)  # slice r of every rank, in rank order
    works = start_reduce_scatter_by_p2p(received, input, group)
    average = functools.partial(sum_received, output, received, group.size())
    if async_op:
        return run_after(works, average, "gloo:reduce_scatter (point-to-point)")
    works.wait()
    average()
    return None


def start_reduce_scatter_by_p2p(received: Tensor, input: Tensor, group: ProcessGroup) -> P2PWorks:
    """Post the messages of a point-to-point reduce-scatter of ``input`` into ``received``
    (``input``'s shape): once they complete, row r of ``received`` viewed as N rows is group
    rank r's slice for this rank. Split from the allocation so a benchmark can pass a
    persistent buffer."""
    world_size, rank = group.size(), group.rank()
    slices = list(input.view(world_size, -1).unbind())
    rows = list(received.view(world_size, -1).unbind())
    rows[rank].copy_(slices[rank])
    return exchange(slices, rows, group)


def sum_received(output: Tensor, received: Tensor, world_size: int) -> None:
    """Average the ``world_size`` slices of ``received`` into ``output``, summed in rank order;
    ``output`` may be wider than ``received`` (Note [Widening on receipt])."""
    slices = received.view(world_size, -1)
    if output.dtype == received.dtype:
        torch.sum(slices, dim=0, out=output)
    else:
        for start in range(0, output.numel(), WIDENING_CHUNK_NUMEL):
            end = start + WIDENING_CHUNK_NUMEL
            torch.sum(slices[:, start:end], dim=0, dtype=output.dtype, out=output[start:end])
    output.div_(world_size)


class Waitable(Protocol):
    """A ``Work``, a ``Future`` or :class:`P2PWorks`: ``wait()`` returns once it completed and
    raises its error."""

    def wait(self) -> Any: ...


def run_after(works: Waitable, then: Callable[[], Any], name: str) -> Future:
    """A future fulfilled with ``then()``'s result once ``works`` completed and ``then()`` ran
    on a helper thread; it carries their error if any. See Note [No Python on gloo's threads].

    The thread's wait and ``then()`` are one profiler span named ``name``. For collectives
    made of point-to-point messages it is ``gloo:...``, the prefix gloo's own collectives use,
    so a trace shows the collective in flight on a lane of its own, as it shows gloo's
    collectives on gloo's worker threads (``benchmarks/trace_analysis.py`` counts it as
    communication); after one of gloo's collectives, which shows itself, it is another name.
    """
    future: Future = Future()

    def run() -> None:
        try:
            with torch.profiler.record_function(name):
                works.wait()
                result = then()
        except Exception as error:  # handed to whoever waits on the future
            future.set_exception(error)
            return
        future.set_result(result)

    threading.Thread(target=run, name=f"sharded_opt {name}").start()
    return future


def _nothing() -> None:
    """What an all-gather does once its messages arrived: they landed in place."""


def collective_timeout(group: ProcessGroup) -> datetime.timedelta | None:
    """The group's collective timeout, or None (torch's default) where the backend does not
    expose it."""
    options = getattr(group._get_backend(group._device_types[0]), "options", None)
    return getattr(options, "_timeout", None)


def broadcast_coalesced(tensors: list[Tensor], group: ProcessGroup, src: int) -> None:
    """Copy ``tensors`` from global rank ``src`` to every rank of the group in place, with one
    broadcast per dtype and device (a model's buffers are many small tensors)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for same_kind in by_kind.values():
            flat = torch.cat([tensor.detach().reshape(-1) for tensor in same_kind])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for tensor in same_kind:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
