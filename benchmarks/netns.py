"""``--emulate-link``: put each rank behind its own Linux network namespace, joined by a veth
pair shaped with ``tc ... tbf``, so communication costs network time instead of loopback memcpy.

With ``ranks_per_node`` > 1 (``--degree`` on 4 ranks) there are still two namespaces, two
emulated "nodes" of ``ranks_per_node`` ranks each: ranks of one node reach each other through
their namespace's own addresses (the kernel routes local traffic over ``lo``, unshaped), and the
nodes through the shaped veth. :func:`link_tx_bytes` reads what this node sent over it.

The parent creates the namespaces (root needed) and always deletes them, also on failure. Each
rank, already in the default process group over loopback, enters its namespace and builds a
second gloo group bound to its veth end; the benchmark's collectives all go through that group.
Only the rate can be shaped: the kernel here has no ``sch_netem``, so a latency is accepted on
the command line but not applied (``tbf``'s own ``latency`` is a queue limit, not a delay).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """A shaped point-to-point link between two ranks."""

    gbps: float
    latency_ms: float = 0.0
    prefix: str = "shopt"
    ranks_per_node: int = 1
    """Ranks in each of the two namespaces."""

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}-ns{rank}"

    def interface(self, rank: int) -> str:
        return f"{self.prefix}-v{rank}"

    def address(self, rank: int) -> str:
        return f"10.231.0.{rank + 1}"


def parse_link(text: str) -> LinkConfig:
    """``GBPS`` or ``GBPS,LATENCY_MS`` from the command line."""
    parts = [float(part) for part in text.split(",")]
    if not 1 <= len(parts) <= 2 or parts[0] <= 0 or (len(parts) == 2 and parts[1] < 0):
        raise ValueError(f"--emulate-link expects GBPS[,LATENCY_MS] with GBPS > 0 but got {text!r}")
    return LinkConfig(*parts, prefix=f"shopt{os.getpid()}")


def link_unavailable_reason(world_sizes: tuple[int, ...], ranks_per_node: int = 1) -> str | None:
    """Why the link cannot be emulated here, or None if it can."""
    if set(world_sizes) != {2 * ranks_per_node}:
        return (
            f"--emulate-link joins exactly 2 nodes of {ranks_per_node} rank(s) with one veth pair, "
            f"but world sizes are {world_sizes}"
        )
    if os.geteuid() != 0:
        return "--emulate-link needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"--emulate-link needs the {' and '.join(missing)} command(s) (iproute2)"
    return None


@contextlib.contextmanager
def shaped_link(link: LinkConfig) -> Iterator[LinkConfig]:
    """Create both namespaces, the veth pair and the tbf shapers; delete the namespaces (and with
    them the veth pair) on exit, whatever happened."""
    created: list[str] = []
    try:
        for rank in (0, 1):
            _ip("netns", "add", link.namespace(rank))
            created.append(link.namespace(rank))
        _ip("link", "add", link.interface(0), "type", "veth", "peer", "name", link.interface(1))
        for rank in (0, 1):
            _configure_end(link, rank)
        yield link
    finally:
        for namespace in created:
            subprocess.run(["ip", "netns", "delete", namespace], check=False, capture_output=True)
        # A veth end still in the root namespace (the move into its namespace failed) outlives
        # the namespaces; deleting one end deletes the pair. Absent, as after a good run: no-op.
        for rank in (0, 1):
            subprocess.run(["ip", "link", "delete", link.interface(rank)], check=False, capture_output=True)


def _configure_end(link: LinkConfig, rank: int) -> None:
    namespace, interface = link.namespace(rank), link.interface(rank)
    _ip("link", "set", interface, "netns", namespace)
    inside = ("ip", "netns", "exec", namespace)
    _run(*inside, "ip", "addr", "add", f"{link.address(rank)}/24", "dev", interface)
    _run(*inside, "ip", "link", "set", interface, "up")
    _run(*inside, "ip", "link", "set", "lo", "up")
    rate_bytes = link.gbps * 1e9 / 8
    burst = max(64 * 1024, int(rate_bytes / 1000))  # 1 ms at line rate, at least one GSO packet
    _run(*inside, "tc", "qdisc", "add", "dev", interface, "root", "tbf",
         "rate", f"{link.gbps * 1000:g}mbit", "burst", str(burst), "latency", "200ms")  # fmt: skip


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")


def link_group(link: LinkConfig) -> ProcessGroup:
    """Enter this rank's namespace and return a gloo group over the shaped veth.

    Called by every rank (``new_group`` is collective). The default group's store connection
    stays in the root namespace, which is fine: a socket keeps the namespace it was made in.
    """
    node = link.node_of(dist.get_rank())
    fd = os.open(os.path.join(NETNS_DIR, link.namespace(node)), os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {link.namespace(node)} failed")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = link.interface(node)
    return dist.new_group(backend="gloo")


def link_tx_bytes(link: LinkConfig) -> int:
    """Bytes this rank's node has sent over its veth end so far (its namespace's counter, read
    from ``/proc/self/net/dev``, which shows the calling thread's network namespace)."""
    interface = link.interface(link.node_of(dist.get_rank()))
    with open("/proc/self/net/dev") as table:
        for line in table:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                return int(counters.split()[8])  # receive has 8 columns, then transmit bytes
    raise RuntimeError(f"link_tx_bytes: no interface {interface} in this network namespace")
