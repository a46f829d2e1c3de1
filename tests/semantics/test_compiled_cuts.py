"""A forward compiled with ``compile_backend`` is cut at the wrapper's buckets, so in backward a
bucket's reduce-scatter starts before the rest of the backward ran, and nothing else changes
(Note [Graph cuts at buckets] in ``sharded_opt/compiled_cuts.py``).

One spawned 2-rank job trains the tied-weight language model of ``test_compiled_waits`` with
``fullgraph=True`` and late all-gathers (a read before its wait sees last step's values): the
tied weight is read in the first piece and again in the last, the case where pieces run in
torch's data-only order broke autograd's version check.
"""

from __future__ import annotations

import operator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, compile_backend
from sharded_opt.comm import collectives
from sharded_opt.compiled_cuts import piece_of_nodes
from sharded_opt.model_hooks.compiled_waits import TRACED_WAITS
from tests.harness.dist_helper import run_ranks
from tests.harness.user_loops import _late_all_gather
from tests.semantics.test_compiled_waits import VOCAB, WIDTH, TiedLM, _tokens

pytestmark = pytest.mark.skipif(not TRACED_WAITS, reason="traced waits and cuts need torch >= 2.13")

STEPS = 4


def _backward_pieces(loss: torch.Tensor) -> list[torch.autograd.graph.Node]:
    """The compiled pieces' backward nodes, each once, nearest the loss first."""
    found, frontier, seen = [], [loss.grad_fn], set()
    while frontier:
        node = frontier.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            found.append(node)
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return found


def _train(overlap: bool, cut: bool, **compile_kwargs: object) -> dict[str, object]:
    torch._dynamo.reset()
    model = TiedLM()
    opt = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.001, enable_overlap=overlap)),
    )
    backend = compile_backend(opt) if cut else "inductor"
    forward = torch.compile(model, fullgraph=True, backend=backend, **compile_kwargs)
    issued: list[int] = []
    reduce_scatter = collectives.reduce_scatter_avg

    def counted(*args, **kwargs):
        issued.append(1)
        return reduce_scatter(*args, **kwargs)

    issued_before_last_piece, pieces = [], []
    with mock.patch.object(collectives, "reduce_scatter_avg", counted):
        for step in range(STEPS):
            tokens = _tokens(step)
            opt.zero_grad()
            logits = forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            found = _backward_pieces(loss)
            pieces.append(len(found))
            issued.clear()
            found[-1].register_prehook(lambda grads: issued_before_last_piece.append(len(issued)))
            loss.backward()
            opt.step()
    opt.sync_params()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "pieces": pieces,
        "issued_before_last_piece": issued_before_last_piece,
    }


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class CheckpointedNet(nn.Module):
    """Every other block under ``torch.utils.checkpoint`` (a higher-order op in the graph, its
    body a subgraph that reads the block's params: cuts fall around it), a graph break after
    the second block (two graphs, each cut on its own) and the head under CPU autocast (an
    autocast region that a cut may split)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if index % 2 else block(x)
            if index == 1:
                torch._dynamo.graph_break()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(x).float()


def _train_checkpointed(overlap: bool, cut: bool) -> dict[str, object]:
    torch._dynamo.reset()
    model = CheckpointedNet()
    opt = ShardingStage1(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        strategy=Strategy(sharding=ShardingConfig(bucket_size_mb=0.002, enable_overlap=overlap)),
    )
    forward = torch.compile(model, backend=compile_backend(opt) if cut else "inductor")
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        opt.zero_grad()
        inputs, targets = torch.randn(8, WIDTH, generator=generator), torch.randn(8, 4, generator=generator)
        loss = F.mse_loss(forward(inputs), targets)
        pieces = len(_backward_pieces(loss))
        loss.backward()
        opt.step()
    opt.sync_params()
    return {"params": [p.detach().clone() for p in model.parameters()], "pieces": pieces}


def _job() -> dict[str, object]:
    with mock.patch.object(collectives, "all_gather", _late_all_gather):
        runs: dict[str, object] = {
            f"{mode}{'_cut' if cut else ''}": _train(overlap=mode == "overlap", cut=cut)
            for mode in ("sync", "overlap")
            for cut in (False, True)
        }
        # torch.compile's options reach inductor through the cut backend: with no fusion at
        # all the kernels differ, so the params may too, within float tolerance.
        runs["overlap_cut_unfused"] = _train(overlap=True, cut=True, options={"max_fusion_size": 1})
        try:
            _train(overlap=True, cut=True, options={"no_such_inductor_option": 1})
        except Exception as error:  # Dynamo wraps the backend's error
            runs["unknown_option_error"] = str(error)
        runs["checkpointed_sync"] = _train_checkpointed(overlap=False, cut=False)
        runs["checkpointed_overlap_cut"] = _train_checkpointed(overlap=True, cut=True)
        return runs


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return run_ranks(_job, 2, timeout_s=300.0)


def test_cut_forwards_end_bitwise_equal_to_the_whole_compiled_sync(runs) -> None:
    for rank in runs:
        for name in ("overlap", "sync_cut", "overlap_cut"):
            for reference, got in zip(rank["sync"]["params"], rank[name]["params"], strict=True):
                torch.testing.assert_close(got, reference, rtol=0, atol=0, msg=name)


def test_torch_compiles_mode_and_options_reach_inductor_through_the_cuts(runs) -> None:
    for rank in runs:
        for reference, got in zip(rank["sync"]["params"], rank["overlap_cut_unfused"]["params"], strict=True):
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
        assert "no_such_inductor_option" in rank["unknown_option_error"]


def test_cut_forwards_with_checkpoints_graph_breaks_and_autocast_end_bitwise_equal(runs) -> None:
    for rank in runs:
        sync, overlap = rank["checkpointed_sync"], rank["checkpointed_overlap_cut"]
        for reference, got in zip(sync["params"], overlap["params"], strict=True):
            torch.testing.assert_close(got, reference, rtol=0, atol=0)
        # Two graphs (the break), each one node whole; cut, more.
        assert sync["pieces"] == 2 < overlap["pieces"]


def test_cut_backward_starts_reduce_scatters_before_its_last_piece(runs) -> None:
    # Steps 1 on: the forward with all-gathers pending (waits traced). Whole, the backward is one
    # node and no reduce-scatter starts before it ends; cut, the later buckets' grads are reduced
    # while the first piece's backward (embedding and positions) has not run yet.
    for rank in runs:
        assert rank["overlap"]["pieces"][1:] == [1] * (STEPS - 1)
        assert rank["overlap"]["issued_before_last_piece"][1:] == [0] * (STEPS - 1)
        assert min(rank["overlap_cut"]["pieces"]) > 1
        assert min(rank["overlap_cut"]["issued_before_last_piece"][1:]) > 0


def test_sync_mode_is_cut_at_the_same_places(runs) -> None:
    # The same pieces in both modes: the same kernels, so the same bits (see the first test).
    for rank in runs:
        assert rank["sync_cut"]["pieces"][1:] == rank["overlap_cut"]["pieces"][1:]


def _graph(reads: list[str]) -> tuple[fx.GraphModule, dict[str, int]]:
    """A straight-line graph: node ``i`` computes from node ``i - 1`` and reads param ``reads[i]``
    ('' for none, 'wait:<name>' for a wait for it); returns it and each param's bucket."""
    graph = fx.Graph()
    params = {name: graph.placeholder(name) for name in ("a", "b", "c")}
    value = graph.placeholder("x")
    for read in reads:
        if read.startswith("wait:"):
            graph.call_function(torch.ops.sharded_opt.wait_for_param, (params[read[5:]],) * 2 + (value, 0, 0))
        elif read:
            value = graph.call_function(operator.mul, (value, params[read]))
        else:
            value = graph.call_function(operator.neg, (value,))
    graph.output(value)
    return fx.GraphModule(torch.nn.Module(), graph), {"a": 0, "b": 0, "c": 1}


def _pieces(reads: list[str]) -> list[int]:
    module, bucket_of = _graph(reads)
    placeholders = {node: node.name for node in module.graph.find_nodes(op="placeholder")}

    def buckets_read_by(node: fx.Node) -> set[tuple[int, int]]:
        return {
            (0, bucket_of[placeholders[arg]])
            for arg in node.all_input_nodes
            if placeholders.get(arg) in bucket_of
        }

    piece_of = piece_of_nodes(module, buckets_read_by)
    return [piece_of[node] for node in module.graph.nodes if node.op == "call_function"]


def test_a_piece_starts_at_the_waits_before_a_new_buckets_first_read() -> None:
    assert _pieces(["wait:a", "a", "", "wait:b", "b", "wait:c", "c", "", "a"]) == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    # A wait stays with the node after it when that node reads nothing new (the read, later,
    # still runs after it: the pieces run in the graph's order).
    assert _pieces(["a", "wait:c", "", "c"]) == [0, 0, 0, 1]
    # A module's waits run together before its first read; a read of another bucket inside the
    # module still starts a piece (that bucket's grads are complete earlier in backward).
    assert _pieces(["wait:c", "wait:a", "c", "a", "b"]) == [0, 0, 0, 1, 1]
    # Nodes before the first read (a position table's arange) make no piece of their own.
    assert _pieces(["", "a", "", "c"]) == [0, 0, 0, 1]
    # Sync mode (no waits): the same compute nodes in the same pieces.
    assert _pieces(["a", "", "b", "", "c", "a"]) == [0, 0, 0, 0, 1, 1]


def test_compile_backend_expects_sharding_wrappers() -> None:
    with pytest.raises(TypeError, match="compile_backend expects the ShardingStage1 wrappers .* but got SGD"):
        compile_backend(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    with pytest.raises(TypeError, match="but got nothing"):
        compile_backend()
