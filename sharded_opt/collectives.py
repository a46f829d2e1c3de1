"""Stateless wrappers over the torch.distributed collectives the wrapper uses.

Note [Reduce-scatter on gloo]
    Gloo has no native reduce-scatter: torch runs it as a full all-reduce and keeps a slice, so
    it moves as many bytes as DDP's all-reduce, and ZeRO's all-gather then comes on top (1.5x
    DDP's bytes). On gloo the reduce-scatter is therefore one ``all_to_all_single`` (rank r
    receives every rank's r-th slice: (N-1)/N of the bucket, the bytes of a true reduce-scatter)
    followed by a local sum over the N slices in rank order and a division by N. Measured here
    with 2 ranks on a 16 MiB bucket: 26.4 ms as gloo's reduce-scatter, 15.8 ms as an all-reduce,
    11.1 ms as all-to-all plus the sum. The sum runs as a callback of the all-to-all's future,
    on gloo's thread, so it overlaps compute too; its order is fixed, so results are
    deterministic and the same in sync and overlap mode. That thread runs the sum on one core
    (``torch.get_num_threads()`` is 1 inside the callback when the rank set 1), so it takes
    no more than one core's share from compute.

    The receive buffer is allocated per call on purpose. Persistent per-bucket buffers saved
    2-5% of the reduce-scatter time, under 1% of a training step (measured on 2 CPU cores, see
    benchmarks/results/2026-12-03-cpu-2core.md), for a permanent extra copy of every grad
    bucket: +4 bytes per fp32 param on every rank, against ZeRO-1's 12/N for the optimizer
    state. A per-call buffer lives only while its bucket is in flight.

torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to
``reduce_scatter_single``/``all_gather_single`` and warns on the old names; older releases only
have the old ones. These wrappers pick whichever exists so users see no warning on any version.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp, Work
from torch.futures import Future

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_avg(
    output: Tensor, input: Tensor, group: ProcessGroup, async_op: bool
) -> Work | Future | None:
    """Average ``input`` over the group; rank r receives the r-th equal slice in ``output``.

    With ``async_op``, returns a handle whose ``wait()`` makes ``output`` final.
    """
    if backend_for_device(group, input.device.type) == "gloo":
        return _reduce_scatter_by_all_to_all(output, input, group, async_op)
    return _reduce_scatter(output, input, op=ReduceOp.AVG, group=group, async_op=async_op)


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
        torch.sum(received.view(world_size, -1), dim=0, out=output)
        output.div_(world_size)
        if received.device.type != "cpu":
            # A device future runs its callbacks on a stream of its choosing; without this the
            # block could be reused on the comm stream while the sum still reads it. See
            # Note [Streams and events].
            received.record_stream(torch.accelerator.current_stream(received.device))

    work = dist.all_to_all_single(received, input, group=group, async_op=True)
    if async_op:
        return work.get_future().then(average)
    work.wait()
    average()
    return None


def all_reduce_avg(tensor: Tensor, group: ProcessGroup, async_op: bool) -> Work | None:
    """Average ``tensor`` in place over the group."""
    return dist.all_reduce(tensor, op=ReduceOp.AVG, group=group, async_op=async_op)


def all_gather(output: Tensor, input: Tensor, group: ProcessGroup, async_op: bool) -> Work | None:
    """Concatenate every rank's ``input`` into ``output``; ``input`` may be a view of ``output``
    at this rank's slice (an in-place all-gather, as FSDP2 uses)."""
    return _all_gather(output, input, group=group, async_op=async_op)


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
