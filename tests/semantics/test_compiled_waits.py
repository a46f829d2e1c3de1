"""A compiled forward keeps the all-gather overlap: its graph waits for each param's all-gather
before the param's first read (Note [torch.compile] in ``sharded_opt/model_hooks/compiled_waits.py``).

One spawned 2-rank job compiles a small tied-weight language model with Inductor and
``fullgraph=True`` (a graph break would raise) in sync and overlap mode; all-gathers land only
when waited for (``_late_all_gather``), so a read before its wait would see last step's values.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.comm import collectives
from sharded_opt.model_hooks.compiled_waits import TRACED_WAITS
from tests.harness.dist_helper import run_ranks
from tests.harness.user_loops import _late_all_gather

pytestmark = pytest.mark.skipif(not TRACED_WAITS, reason="traced waits need torch >= 2.13")

VOCAB, WIDTH, STEPS = 32, 16, 4


class TiedLM(nn.Module):
    """Embedding tied to the output head (read twice in one graph: one wait only), a layer
    norm and a position table read as a bare parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.randn(8, WIDTH) * 0.1)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.positions[: tokens.shape[1]]
        return self.head(self.norm(torch.tanh(self.hidden(h))))


def _tokens(step: int) -> torch.Tensor:
    rank = dist.get_rank()
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(10 * step + rank))


def _train(overlap: bool) -> dict[str, object]:
    torch._dynamo.reset()
    model = TiedLM()
    opt = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.001, enable_overlap=overlap)),
    )
    forward = torch.compile(model, fullgraph=True)
    guard_on_after_step = []
    graphs_after_step_1 = 0
    for step in range(STEPS):
        tokens = _tokens(step)
        opt.zero_grad()
        # Step 1's forward is the first with all-gathers pending (the read guard on the stack):
        # Dynamo compiles it once more; later steps must reuse that graph. (run_and_get_code
        # itself makes Dynamo trace again, so later steps run the compiled model directly.)
        if step <= 1:
            logits, codes = torch._inductor.utils.run_and_get_code(forward, tokens[:, :-1])
        else:
            traced_before = counters["stats"]["unique_graphs"]
            logits = forward(tokens[:, :-1])
            graphs_after_step_1 += counters["stats"]["unique_graphs"] - traced_before
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        # In overlap mode the read guard stays on the stack while all-gathers are pending:
        # step() left them to the next forward.
        guard_on_after_step.append(torch._C._len_torch_function_stack())
    opt.sync_params()
    waits = [
        [
            line.strip()
            for line in code.splitlines()
            if line.strip().startswith("torch.ops.sharded_opt.wait_for_param")
        ]
        for code in codes
    ]
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "guard_on_after_step": guard_on_after_step,
        "waits": waits,
        "graphs_after_step_1": graphs_after_step_1,
    }


def _job() -> dict[str, dict[str, object]]:
    with mock.patch.object(collectives, "all_gather", _late_all_gather):
        return {"sync": _train(overlap=False), "overlap": _train(overlap=True)}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, object]]]:
    return run_ranks(_job, 2, timeout_s=300.0)


def test_compiled_overlap_equals_compiled_sync_bitwise(runs) -> None:
    for rank in runs:
        for sync, overlap in zip(rank["sync"]["params"], rank["overlap"]["params"], strict=True):
            torch.testing.assert_close(overlap, sync, rtol=0, atol=0)


def test_compiled_overlap_leaves_the_all_gathers_to_the_next_forward(runs) -> None:
    for rank in runs:
        assert rank["overlap"]["guard_on_after_step"] == [1] * STEPS
        assert rank["sync"]["guard_on_after_step"] == [0] * STEPS


def test_each_param_waited_for_once_and_in_place(runs) -> None:
    # The forward's graph waits for each of the 6 distinct params (the tied weight once) before
    # its first read, with the graph's own input as both arguments (Inductor ran the op in
    # place: no copy of the param). The root module's pre-hook, compiled as a graph of its own,
    # waits for the root's own param once more.
    for rank in runs:
        graphs = rank["overlap"]["waits"]
        assert max(len(waits) for waits in graphs) == 6, graphs
        for waits in graphs:
            assert len(set(waits)) == len(waits), waits
            for line in waits:
                param, gathered = line.split("(", 1)[1].split(",")[:2]
                assert param.strip() == gathered.strip(), line


def test_compiled_forward_is_not_traced_again_after_the_first_overlapped_step(runs) -> None:
    # Tracing per step would hide every gain of compiling: the waits must not put anything
    # into Dynamo's guards that changes from step to step (an id, a step count, a bucket state).
    for rank in runs:
        assert rank["overlap"]["graphs_after_step_1"] == 0
        assert rank["sync"]["graphs_after_step_1"] == 0
