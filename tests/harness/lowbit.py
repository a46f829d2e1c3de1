"""What the low-bit (torchao) tests share: a model with every kind of param the cut rules tell
apart (Note [Cuts on quantization blocks] in ``fusion/block_layout.py``), its data, the plain
class in one process as the reference, and the comparison of two state dicts.

The model holds a weight of 32768 elements (quantized, cut on its blocks on 2 and 3 ranks),
weights of 4352 and 4096 (quantized, too small to cut: whole in one shard), a gain of 4097
(4096 or more but not whole blocks: plain state, whole in one shard) and small biases (plain
state, cut anywhere). torchao is imported only when an optimizer is built, so a test module can
skip first when it is missing.
"""

from __future__ import annotations

import importlib
import io

import torch
from torch import nn

STEPS = 10
RESUME_AT = 6
BATCH, FEATURES = 12, 32


class LowBitModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 1024)  # weight 32768: quantized, cut on blocks on 2 and 3 ranks
        self.fc2 = nn.Linear(1024, 17)  # weight 17408: quantized, may be cut
        self.fc3 = nn.Linear(17, 256, bias=False)  # 4352: quantized, too small to cut: whole
        self.fc4 = nn.Linear(256, 16)  # 4096: quantized (the threshold itself), whole
        self.head = nn.Linear(16, 2)
        self.gain = nn.Parameter(torch.ones(4097))  # 4096 or more, not whole blocks: plain, whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.head(torch.tanh(self.fc4(torch.relu(self.fc3(hidden))))) * self.gain.mean()


def make_model(seed: int = 0) -> LowBitModel:
    torch.manual_seed(seed)
    return LowBitModel()


def make_optimizer(cls: str, model: nn.Module, **kwargs) -> torch.optim.Optimizer:
    """torchao's class named ``cls`` over the model, with the tests' settings."""
    optim = importlib.import_module("torchao.optim")
    return getattr(optim, cls)(model.parameters(), lr=1e-2, weight_decay=0.05, **kwargs)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 2, generator=generator)


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(inputs), targets)


def train_plain(cls: str, slices: int = 1, start: dict | None = None) -> dict:
    """The plain class in one process; ``slices`` > 1 averages per-slice grads (sum in slice
    order, then divide), as the ranks' reduction does. Saves the model and optimizer after
    ``RESUME_AT`` steps (``"snapshot"``); ``start`` (such a snapshot) resumes from there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        opt = make_optimizer(cls, model)
        if start is not None:
            model.load_state_dict(start["model"])
            opt.load_state_dict(start["optimizer"])
        params = list(model.parameters())
        size = BATCH // slices
        snapshot = None
        for step in range(RESUME_AT if start is not None else 0, STEPS):
            if step == RESUME_AT and start is None:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
                snapshot = buffer.getvalue()
            inputs, targets = batch(step)
            grads = []
            for index in range(slices):
                model.zero_grad()
                part = slice(index * size, (index + 1) * size)
                loss_of(model, inputs[part], targets[part]).backward()
                grads.append([p.grad.clone() for p in params])
            for position, param in enumerate(params):
                total = grads[0][position]
                for other in grads[1:]:
                    total = total + other[position]
                param.grad = total / slices
            opt.step()
        return {"params": [p.detach().clone() for p in params], "optimizer": opt, "snapshot": snapshot}
    finally:
        torch.set_num_threads(threads)


def assert_same_state(got: dict, want: dict) -> None:
    """Two optimizer state dicts are equal bitwise: param groups, keys, and every plain tensor
    or quantized value's inner tensors (codes, scales, code book) and attributes."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        assert got["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            mine = got["state"][index][key]
            assert type(mine) is type(value) and mine.shape == value.shape, (index, key)
            if type(value) is torch.Tensor:
                assert torch.equal(mine, value), (index, key)
                continue
            names, attributes = value.__tensor_flatten__()
            assert mine.__tensor_flatten__()[1] == attributes, (index, key)
            for name in names:
                assert torch.equal(getattr(mine, name), getattr(value, name)), (index, key, name)
