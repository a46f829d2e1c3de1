"""Fake streams, events and collectives that log every record and wait in order, so the
accelerator path of ``sharded_opt`` runs on CPU: install them with ``monkeypatch`` over
``torch.Event``, ``torch.accelerator.current_stream``, ``comm_context.new_comm_stream`` and, for
collectives that only log, ``collectives.reduce_scatter_avg`` / ``collectives.all_gather``."""

from __future__ import annotations

import torch


class FakeStream(torch.Stream):
    """A stream that logs what it waits for; ``with stream:`` makes it current. Compares by
    identity (every fake has torch's CPU stream id)."""

    def __new__(cls, accelerator: FakeAccelerator, name: str) -> FakeStream:
        return super().__new__(cls, device="cpu")

    def __init__(self, accelerator: FakeAccelerator, name: str) -> None:
        self.accelerator = accelerator
        self.name = name
        self.events = 0

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    __hash__ = object.__hash__

    def wait_event(self, event: FakeEvent) -> None:
        self.accelerator.log.append(f"{self.name} waits {event.name}")

    def __enter__(self) -> FakeStream:
        self.accelerator.previous.append(self.accelerator.current)
        self.accelerator.current = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.accelerator.current = self.accelerator.previous.pop()


class FakeEvent:
    """Named after the stream it was recorded on and that stream's count: ``comm#2``."""

    def __init__(self, accelerator: FakeAccelerator, device: torch.device) -> None:
        self.accelerator = accelerator
        self.device = device
        self.name = "unrecorded"

    def record(self, stream: FakeStream) -> None:
        stream.events += 1
        self.name = f"{stream.name}#{stream.events}"
        self.accelerator.log.append(f"record {self.name}")


class FakeWork:
    """A collective's handle: ``wait()`` logs which stream waited for it."""

    def __init__(self, accelerator: FakeAccelerator, name: str) -> None:
        self.accelerator = accelerator
        self.name = name

    def wait(self) -> None:
        self.accelerator.log.append(f"{self.accelerator.current.name} waits {self.name}")


class FakeAccelerator:
    """The log, the current stream (``compute`` at first), the ``comm`` stream, and fake
    collectives (``collective(kind)``) that log and keep their inputs."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.previous: list[FakeStream] = []
        self.compute = FakeStream(self, "compute")
        self.comm = FakeStream(self, "comm")
        self.current = self.compute
        self.issued = 0
        self.inputs: list[torch.Tensor] = []

    def current_stream(self, device: object = None) -> FakeStream:
        return self.current

    def collective(self, kind: str):
        def issue(
            output: torch.Tensor,
            input: torch.Tensor,
            group: object,
            async_op: bool,
            point_to_point: bool = False,
        ) -> FakeWork:
            self.issued += 1
            name = f"{kind}{self.issued}"
            self.log.append(f"{name} on {self.current.name}")
            self.inputs.append(input)
            return FakeWork(self, name)

        return issue
