from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tests.harness.dist_helper import PRELOADED_MODULES


def pytest_configure(config: pytest.Config) -> None:
    multiprocessing.set_forkserver_preload(PRELOADED_MODULES)


@pytest.fixture
def single_rank_group() -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo group in the pytest process, for tests that need no peers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
