"""Stream set-up that is checkable without an accelerator (the stream logic itself runs in
``python -m benchmarks.gpu_check``)."""

from __future__ import annotations

import pytest
import torch

from sharded_opt import streams


class _RecordedStream:
    def __init__(self, device: torch.device, *, priority: int = 0) -> None:
        self.device = device
        self.priority = priority


def test_comm_stream_has_high_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "Stream", _RecordedStream)
    stream = streams.new_comm_stream(torch.device("cuda", 0))
    assert stream.priority == -1
    assert stream.device == torch.device("cuda", 0)


def test_no_comm_stream_on_cpu() -> None:
    assert streams.new_comm_stream(torch.device("cpu")) is None
