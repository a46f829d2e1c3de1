"""Start N local ranks (``spawn``) and join a process group from the environment
(``init_parallel_env``), so one training script runs the same under ``spawn`` and ``torchrun``."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import io
import os
import pickle
import secrets
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sharded_opt.launch.rank_failures import RankOutcome, exit_codes_after_first_failure, raise_root_cause

LOOPBACK_ADDR = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout: long enough for a slow first step, short enough that a dead peer turns
into an error instead of a hang."""

RENDEZVOUS_TIMEOUT_S = 600.0
"""How long joining the group waits for the other ranks to start (at least the collective
timeout).

Note [Rendezvous apart from collectives]
    ``init_process_group(timeout=t)`` makes ``t`` the collective timeout and also how long the
    ranks wait for each other to join. Starting a rank (a new interpreter importing torch, a
    fork from a busy forkserver) takes seconds on a loaded machine, so a short collective
    timeout, which is how a program (or a test) bounds a hang, failed the join instead (torch's
    "Timed out after ... seconds waiting for clients. 1/2 clients joined"). So the rendezvous
    store is made first with its own generous timeout and the group gets the collective
    timeout. A rank that dies before it joins is reported by the launcher (``spawn`` or
    torchrun) at once; the others do not have to time out for that."""

FAILURE_GRACE_S = 5.0
"""After the first rank fails, how long :func:`spawn` lets the others end on their own before it
stops them. A dead peer makes their next collective raise at once ("connection reset by peer"),
so their errors make it into the report; the collective timeout caps it."""

CPU_BACKEND = "gloo"
"""Backend for CPU tensors, on every machine.

Note [Backend per device type]
    With one backend for the whole group, an accelerator machine gets NCCL (say) for every
    collective, and CPU tensors (a CPU model, the object collectives' buffers) then fail or go
    to the wrong place. A group built from ``"cpu:gloo,cuda:nccl"`` routes each collective by
    its tensors' device, so CPU tensors use gloo on any machine. The accelerator's backend is
    created lazily by its first collective, so a rank that never uses the device (more local
    ranks than devices, a CPU model) never touches it; every rank gets the same backend string
    so the group's device types agree. Setting the current device to ``LOCAL_RANK`` only when
    that device exists keeps ``spawn(fn, nprocs=2)`` working on a one-device machine."""

START_METHODS = ("spawn", "forkserver")
"""The start methods :func:`spawn` accepts.

Note [Start methods]
    ``"spawn"`` (the default) starts every rank as a new interpreter, which imports torch and
    the caller's modules again: a few seconds per rank on a small machine, paid by every call.
    ``"forkserver"`` forks every rank from a server process that Python starts once per program
    and that imports the modules named by ``multiprocessing.set_forkserver_preload`` (say
    ``["torch", "sharded_opt"]``) before its first fork, so a program that calls :func:`spawn`
    many times (a test suite) starts ranks in a fraction of a second. Both are safe with
    accelerators, because neither copies the caller's process: the server is a fresh interpreter
    too, and its preloaded imports touch no device. Plain ``"fork"`` would copy the caller's
    threads and device state and is not offered. A forkserver rank sees the environment the
    server started with, not the caller's later changes; :func:`spawn` sets the variables the
    process group needs inside each rank, so only a caller's own variables are affected."""

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_RETURNED_KEY = "sharded_opt.spawn/returned"
_NO_TIMEOUT = datetime.timedelta(days=365)
"""A store wait that only the peers' ends end, see Note [Waiting for the other ranks to return]."""
_DEFAULT_EPHEMERAL_FLOOR = 32768  # Linux's default start of ip_local_port_range
_PORT_WINDOW = 12000  # ports below the ephemeral floor that spawn picks from


def init_parallel_env(
    backend: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dist.ProcessGroup:
    """Initialize the default process group from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` (set by :func:`spawn` and by ``torchrun``) and return it.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ... ; by default gloo for CPU
            tensors plus, on a machine with an accelerator, the backend torch pairs with it for
            that device's tensors (``"cpu:gloo,cuda:nccl"``), see :func:`plan_parallel_env`.
        timeout_s: how long a collective may wait for its peers before it raises, so that a dead
            rank makes the others fail instead of hang. Joining the group waits for the other
            ranks at least :data:`RENDEZVOUS_TIMEOUT_S`, see Note [Rendezvous apart from
            collectives].

    The rank's device is set to ``LOCAL_RANK`` only when that device exists, so more local ranks
    than devices (``spawn(fn, nprocs=2)`` on a one-GPU machine, CPU models) work. Calling it
    again when the group already exists returns that group.

    Raises:
        RuntimeError: a required environment variable is missing.
    """
    if dist.is_initialized():
        return dist.group.WORLD
    missing = [name for name in _ENV_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_parallel_env needs the environment variables {', '.join(missing)}; start the "
            "script with sharded_opt.spawn(...) or torchrun --nproc-per-node=N script.py"
        )
    available = torch.accelerator.is_available()
    accelerator = torch.accelerator.current_accelerator() if available else None
    local_rank = os.environ.get("LOCAL_RANK")
    plan = plan_parallel_env(
        accelerator.type if accelerator is not None else None,
        torch.accelerator.device_count() if available else 0,
        int(local_rank) if local_rank is not None else None,
        backend,
    )
    if plan.device_index is not None:
        torch.accelerator.set_device_index(plan.device_index)
    # Note [Rendezvous apart from collectives]
    rendezvous_timeout = datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))
    store, rank, world_size = next(dist.rendezvous("env://", timeout=rendezvous_timeout))
    dist.init_process_group(
        plan.backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelEnvPlan:
    """What :func:`init_parallel_env` does on one rank."""

    backend: str
    """The backend string for ``init_process_group``."""
    device_index: int | None
    """Accelerator device to make current, or None to leave the device alone."""


def plan_parallel_env(
    accelerator_type: str | None, device_count: int, local_rank: int | None, backend: str | None
) -> ParallelEnvPlan:
    """Choose the process group backend and this rank's device (pure; see Note [Backend per
    device type]).

    Args:
        accelerator_type: ``"cuda"``, ``"xpu"``, ... ; None on a machine without one.
        device_count: visible accelerator devices.
        local_rank: the rank's index on this machine (``LOCAL_RANK``); None when the launcher
            chose the device already or does not say.
        backend: the backend the caller asked for, kept as given; None picks one.
    """
    has_device = accelerator_type is not None and local_rank is not None and 0 <= local_rank < device_count
    if backend is None:
        backend = CPU_BACKEND
        if accelerator_type is not None:
            device_backend = dist.get_default_backend_for_device(accelerator_type)
            if device_backend != CPU_BACKEND:
                backend = f"cpu:{CPU_BACKEND},{accelerator_type}:{device_backend}"
    return ParallelEnvPlan(backend, local_rank if has_device else None)


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int | None = None,
    devices: str | Sequence[int] | None = None,
    backend: str | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks, each in a fresh process, and return the
    per-rank return values in rank order.

    Each child gets ``MASTER_ADDR`` (loopback), a free ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``
    and ``WORLD_SIZE``, selects its device and joins the default process group (through
    :func:`init_parallel_env`) before ``fn`` runs; the group is destroyed after ``fn`` returns.

    Args:
        fn: a picklable (module-level) function.
        args: positional arguments for ``fn``; sent to the children by pickling.
        nprocs: number of ranks; ``None`` or ``-1`` means one per selected (or visible)
            accelerator device.
        devices: accelerator device indices, ``"4,5"`` or ``[4, 5]``: rank i uses devices[i].
        backend: process group backend, see :func:`init_parallel_env`.
        timeout_s: collective timeout of the process group.
        start_method: how the rank processes start, see Note [Start methods].

    Returns:
        ``fn``'s return value of every rank, sent back as bytes via ``torch.save`` (so tensors are
        private copies, not shared memory).

    Raises:
        ValueError / TypeError: bad ``nprocs`` or ``devices``, or an unpicklable ``fn``.
        torch.multiprocessing.ProcessRaisedException: a rank raised; the message carries the
            traceback of the first rank's own error, names every rank that raised the same one
            and lists the others' (Note [Attribute only what is known] in ``rank_failures``);
            the other ranks are ended. This
            includes spawn's own steps after ``fn`` returned: a return value that cannot be
            pickled ("cannot pickle the lock returned by fn on rank 1"), a group that a failed
            collective left unusable ("the closing barrier with the other ranks failed").
        torch.multiprocessing.ProcessExitedException: a rank died without raising (killed by a
            signal, ``os._exit``); the message names it and how it died ("rank 1 was killed by
            SIGKILL (exit code -9)"), then what the other ranks failed with. Whichever rank torch
            notices first, the dead rank is the one reported.

    After the first failure the other ranks get :data:`FAILURE_GRACE_S` (at most ``timeout_s``)
    to fail on their own, then the ones still running are ended.
    """
    if start_method not in START_METHODS:
        raise ValueError(
            f"spawn expects start_method to be one of {START_METHODS} but got {start_method!r}; "
            '"fork" is not offered: a forked rank inherits the parent\'s threads and accelerator state'
        )
    device_ids = _parse_devices(devices)
    nprocs = _check_nprocs(nprocs, device_ids)
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(
            f"spawn expects a picklable function defined at module level but got {fn!r}: {error}"
        ) from error
    port = _free_loopback_port()
    with tempfile.TemporaryDirectory(prefix="sharded_opt_spawn_") as result_dir:
        context = mp.start_processes(
            _run_rank,
            args=(fn, tuple(args), nprocs, port, device_ids, backend, timeout_s, result_dir),
            nprocs=nprocs,
            join=False,
            start_method=start_method,
        )
        grace_s = min(timeout_s, FAILURE_GRACE_S)
        try:
            exit_codes = exit_codes_after_first_failure(context.processes, grace_s)
            while not context.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            raise_root_cause(error, RankOutcome(Path(result_dir), context.pids(), exit_codes, grace_s))
            raise
        return [_load_result(Path(result_dir) / f"rank{rank}.pt") for rank in range(nprocs)]


def _run_rank(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    port: int,
    device_ids: list[int] | None,
    backend: str | None,
    timeout_s: float,
    result_dir: str,
) -> None:
    """One rank: join the group, run ``fn``, send its result back, leave the group.

    Any failure, also in this function's own steps after ``fn`` returned (an unpicklable
    result, a broken group at the closing barrier), is written to the rank's error file first,
    so :func:`~sharded_opt.launch.rank_failures.raise_root_cause` reports it as the rank's error
    instead of a bare exit code.
    """
    try:
        _join_group(rank, world_size, port, device_ids, backend, timeout_s)
        payload = _serialize_result(fn(*args), rank)
        _leave_group(rank, world_size)
    except BaseException:
        failure = Path(result_dir) / f"rank{rank}.error"
        failure.write_text(f"{time.time()!r}\n{traceback.format_exc()}")
        # No destroy_process_group here: a failed rank may still have asynchronous collectives in
        # flight, and tearing the group down under them aborts the process (SIGABRT), which
        # would hide the exception. The process is about to exit anyway.
        raise
    path = Path(result_dir) / f"rank{rank}.pt"
    partial = path.with_suffix(".partial")
    partial.write_bytes(payload)
    partial.replace(path)


def _join_group(
    rank: int,
    world_size: int,
    port: int,
    device_ids: list[int] | None,
    backend: str | None,
    timeout_s: float,
) -> None:
    os.environ.update(
        MASTER_ADDR=LOOPBACK_ADDR,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    if device_ids is not None:
        torch.accelerator.set_device_index(device_ids[rank])
        os.environ.pop("LOCAL_RANK")  # the device is chosen already; keep init from overriding it
    init_parallel_env(backend, timeout_s=timeout_s)


def _serialize_result(result: Any, rank: int) -> bytes:
    """``result`` as ``torch.save`` bytes, serialized before the group is left so that a
    result that cannot be sent back fails this rank with the reason, not its peers."""
    buffer = io.BytesIO()
    try:
        torch.save(result, buffer)
    except Exception as error:  # pickling raises TypeError, AttributeError or PicklingError
        raise TypeError(
            f"spawn: cannot pickle the {type(result).__name__} returned by fn on rank {rank} "
            f"({error}); return tensors, numbers, strings or containers of them"
        ) from error
    return buffer.getvalue()


def _leave_group(rank: int, world_size: int) -> None:
    # Objects kept alive by reference cycles (hooks whose closures hold the optimizer, which holds
    # the group) would otherwise outlive destroy_process_group and be destroyed during interpreter
    # shutdown, where the gloo group's threads make the process abort (SIGABRT) after it already
    # succeeded. Collect them while the group is still whole, then tear it down together.
    gc.collect()
    _wait_until_every_rank_returned(rank, world_size)
    try:
        dist.barrier()
    except Exception as error:
        raise RuntimeError(
            f"spawn: fn returned on rank {rank}, but the closing barrier with the other ranks "
            f"failed ({error}). Either another rank failed (see its error), or a collective in fn "
            "failed or timed out and left the process group unusable, even if fn caught that error"
        ) from error
    dist.destroy_process_group()


def _wait_until_every_rank_returned(rank: int, world_size: int) -> None:
    """Wait, without a timeout, until ``fn`` returned on every rank.

    Note [Waiting for the other ranks to return]
        A rank whose ``fn`` returned waits for the others before the closing barrier. That wait
        is not a collective of ``fn``'s and gets no collective timeout: a peer may legitimately
        run longer than that on its own (rank 0's final evaluation, saving a file), and a
        barrier that timed out would fail this rank, have the busy peer ended after the grace
        and blame this rank. It goes through the rendezvous store instead, which has no such
        timeout here. It still ends: a peer that fails exits (spawn then ends the waiting ranks
        after the grace, or the store's host is gone and the wait raises), and a peer stuck in a
        collective that this rank left fails there after the collective timeout. Only a peer
        that never ends on its own (an endless loop in plain Python) keeps the others waiting,
        as it would keep a single process running.
    """
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{_RETURNED_KEY}/{rank}", "1")
    store.wait([f"{_RETURNED_KEY}/{other}" for other in range(world_size)], _NO_TIMEOUT)


def _load_result(path: Path) -> Any:
    # Written a moment ago by our own child into a private temporary folder, so full unpickling
    # is safe here; checkpoints from elsewhere are always loaded with weights_only=True.
    return torch.load(path, weights_only=False)


def _parse_devices(devices: str | Sequence[int] | None) -> list[int] | None:
    if devices is None:
        return None
    if isinstance(devices, str):
        try:
            ids = [int(part) for part in devices.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f'spawn expects devices like "0,1" but got {devices!r}') from None
    else:
        ids = [int(device) for device in devices]
    if not ids:
        raise ValueError(f"spawn expects at least one device but got {devices!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"spawn expects distinct devices but got {devices!r}")
    visible = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    invisible = [index for index in ids if not 0 <= index < visible]
    if invisible:
        raise ValueError(
            f"spawn was given devices {ids} but only {visible} accelerator device(s) are visible "
            f"(indices 0..{visible - 1}); devices {invisible} do not exist. Check "
            "CUDA_VISIBLE_DEVICES or leave devices=None to run on CPU."
        )
    return ids


def _check_nprocs(nprocs: int | None, device_ids: list[int] | None) -> int:
    if nprocs is None or nprocs == -1:
        if device_ids is not None:
            return len(device_ids)
        visible = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
        if visible == 0:
            raise ValueError(
                "spawn expects nprocs >= 1 on a machine without accelerators "
                "(nprocs=None/-1 means one rank per visible device, and there are none)"
            )
        return visible
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn expects nprocs >= 1 (or -1 for all devices) but got {nprocs!r}")
    if device_ids is not None and len(device_ids) != nprocs:
        raise ValueError(
            f"spawn was given nprocs={nprocs} but {len(device_ids)} devices {device_ids}; "
            "give one device per rank or leave nprocs=None"
        )
    return nprocs


def _free_loopback_port() -> int:
    """A free loopback port for rank 0's rendezvous store, chosen *below* the ephemeral range.

    A port handed out by binding to port 0 lies inside the kernel's ephemeral range, the range it
    also draws source ports from for outgoing connections. A rank that connects before rank 0
    listens can then get that very port as its source port and connect to itself (a TCP
    self-connect), after which the store handshake aborts the process. Seen here about once in
    six runs; a port outside the ephemeral range can never be such a source port.
    """
    floor = _ephemeral_port_floor()
    candidates = secrets.SystemRandom().sample(range(max(1024, floor - _PORT_WINDOW), floor), 64)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK_ADDR, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"spawn found no free loopback port in [{floor - _PORT_WINDOW}, {floor})")


def _ephemeral_port_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_FLOOR
