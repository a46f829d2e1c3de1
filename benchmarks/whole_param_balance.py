"""How evenly the whole-param layout spreads Muon's and Adafactor's work and state over ranks,
and what it pads (pure planning: no process, no tensor).

    python -m benchmarks.whole_param_balance [--world-sizes 2 3 4 8]

For each model and world size it plans the layout ``ShardingStage1`` plans by default (bucket
sizes from the model, 256-byte alignment) and prints, per rank: the optimizer's work (Muon:
Newton-Schulz multiply-adds ``m * n * min(m, n)``, Adafactor: numel) and the elements of params
it owns (its state is proportional to them), as max/mean over ranks (1.00 is perfect balance),
and the padding as a share of the params' elements. Models: the benchmark's default GPT
(``benchmarks.models``, Muon over its block matrices, as Muon users split them: embeddings,
norms, biases and the head go to AdamW) and a Llama-shaped toy (d=512, 8 layers, grouped-query
attention with 2 of 8 heads for keys and values, SwiGLU MLP of 1376, untied head).
See Note [Whole params per owner] in ``fusion/layout.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.models import build_model, hidden_matrix_names
from fusion.bucket_sizing import default_bucket_sizes, trainable_bytes
from fusion.layout import DEFAULT_ALIGN_BYTES, LayoutPlan, ParamSpec, plan_layout
from sharded_opt.guards.optimizer_needs import ADAFACTOR, MUON, OptimizerNeeds

CPU = torch.device("cpu")


def gpt_shapes() -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(Muon's shapes, every shape) of the default benchmark GPT, in registration order."""
    model = build_model("default", seed=0)
    shapes = [tuple(p.shape) for p in model.parameters()]
    hidden = hidden_matrix_names(model)
    matrices = [tuple(p.shape) for name, p in model.named_parameters() if name in hidden]
    return matrices, shapes


def llama_shapes(
    d_model: int = 512,
    layers: int = 8,
    heads: int = 8,
    kv_heads: int = 2,
    hidden: int = 1376,
    vocab: int = 32000,
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    head_dim = d_model // heads
    block = [
        (d_model, d_model),  # q
        (kv_heads * head_dim, d_model),  # k
        (kv_heads * head_dim, d_model),  # v
        (d_model, d_model),  # o
        (hidden, d_model),  # gate
        (hidden, d_model),  # up
        (d_model, hidden),  # down
    ]
    matrices = block * layers
    norms = [(d_model,), (d_model,)]
    shapes = [(vocab, d_model)] + (block + norms) * layers + [(d_model,), (vocab, d_model)]
    return matrices, shapes


def plan_for(shapes: list[tuple[int, ...]], world_size: int, needs: OptimizerNeeds) -> LayoutPlan:
    specs: list[ParamSpec | None] = [ParamSpec(shape, torch.float32, CPU, 0) for shape in shapes]
    sizes = default_bucket_sizes(trainable_bytes(specs))
    return plan_layout(
        specs,
        world_size,
        align_bytes=DEFAULT_ALIGN_BYTES,
        bucket_size_bytes=sizes.bucket_bytes,
        first_bucket_bytes=sizes.first_bucket_bytes,
        whole_param_cost=needs.param_cost,
    )


def balance(shapes: list[tuple[int, ...]], world_size: int, needs: OptimizerNeeds) -> dict[str, float]:
    plan = plan_for(shapes, world_size, needs)
    work, numel = [0] * world_size, [0] * world_size
    for index, shape in enumerate(shapes):
        owner = plan.owner(index)
        work[owner] += needs.param_cost(shape)
        numel[owner] += plan.slot(index).numel
    total = sum(numel)
    return {
        "buckets": len(plan.buckets),
        "work_max_over_mean": max(work) / (sum(work) / world_size),
        "state_max_over_mean": max(numel) / (total / world_size),
        "padding_share": plan.padding_numel / total,
    }


def report(world_sizes: list[int]) -> str:
    gpt_matrices, gpt_all = gpt_shapes()
    llama_matrices, llama_all = llama_shapes()
    cases: list[tuple[str, list[tuple[int, ...]], OptimizerNeeds]] = [
        ("GPT default, Muon (block matrices)", gpt_matrices, MUON),
        ("GPT default, Adafactor (all params)", gpt_all, ADAFACTOR),
        ("Llama toy, Muon (block matrices)", llama_matrices, MUON),
        ("Llama toy, Adafactor (all params)", llama_all, ADAFACTOR),
    ]
    lines = [
        "| model, optimizer | params | world size | buckets | work max/mean | state max/mean | padding |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, shapes, needs in cases:
        for world_size in world_sizes:
            row = balance(shapes, world_size, needs)
            lines.append(
                f"| {name} | {len(shapes)} | {world_size} | {row['buckets']} "
                f"| {row['work_max_over_mean']:.3f} | {row['state_max_over_mean']:.3f} "
                f"| {row['padding_share']:.1%} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4, 8])
    out(report(parser.parse_args(argv).world_sizes))


if __name__ == "__main__":
    main()
