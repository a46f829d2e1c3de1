"""``python -m sharded_opt.plan``: see ``--help`` and docs/performance.md ("Which mode to pick")."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from sharded_opt.plan.calibrate import CalibrationInputs, calibrate
from sharded_opt.plan.config import Cluster, ComputeTimes, LinkModel
from sharded_opt.plan.model import LOW_BIT_OPTIMIZERS, load_factory, resolve_optimizer
from sharded_opt.plan.planner import format_plan, plan_training
from sharded_opt.strategy import COMPRESSION_CHOICES, ShardingConfig

BACKWARD_PER_FORWARD = 2.0
"""How ``--compute-ms`` splits into forward and backward: backward computes two matmuls (grads of
the input and of the weight) for each one of forward."""


def _link(text: str) -> LinkModel:
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected GBPS[,LATENCY_US] but got {text!r}") from error
    if len(values) > 2:
        raise argparse.ArgumentTypeError(f"expected GBPS[,LATENCY_US] but got {text!r}")
    try:
        return LinkModel.stated(*values)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _compressions(setting: str) -> list[str]:
    """The values of a ``ShardingConfig`` compression setting that compress."""
    return [choice for choice in COMPRESSION_CHOICES[setting] if choice is not None]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sharded_opt.plan", description=__doc__)
    parser.add_argument("--model", default="default",
                        help="module:callable (a factory, no arguments) or a built-in model")  # fmt: skip
    parser.add_argument("--optimizer", default="AdamW",
                        help="a torch.optim class name, or one of the low-bit classes of torchao "
                             f"or bitsandbytes (bnb.) ({', '.join(LOW_BIT_OPTIMIZERS)}; torchao's "
                             "block_size through --optimizer-kwargs)")  # fmt: skip
    parser.add_argument("--optimizer-kwargs", type=json.loads, default={}, help="JSON, e.g. '{\"lr\": 1e-3}'")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=None, help="default: all ranks on one node")
    parser.add_argument("--master-dtype", choices=("float32", "float64"), default=None,
                        help="ShardingConfig.master_dtype (fp32 masters of 16-bit params)")  # fmt: skip
    parser.add_argument("--grad-compression", choices=_compressions("grad_compression"), default=None,
                        help="ShardingConfig.grad_compression: also plan the sharded modes with their "
                             "grads sent compressed, beside exact")  # fmt: skip
    parser.add_argument("--param-compression", choices=_compressions("param_compression"), default=None,
                        help="ShardingConfig.param_compression: also plan the sharded modes with their "
                             "updated params sent as compressed deltas, beside exact")  # fmt: skip
    parser.add_argument("--grad-error-feedback", action="store_true",
                        help="ShardingConfig.grad_error_feedback (with --grad-compression): count the "
                             "fp32 residual of the grads sent")  # fmt: skip
    parser.add_argument("--calibrate", action="store_true",
                        help="measure compute and the link between two local ranks (seconds)")  # fmt: skip
    parser.add_argument("--compute-ms", type=float, default=None, help="forward + backward of one rank")
    parser.add_argument("--step-ms", type=float, default=0.0, help="the optimizer step over every param")
    parser.add_argument("--node-link", type=_link, default=None, metavar="GBPS[,LATENCY_US]",
                        help="between ranks of a node (default with --calibrate: measured)")  # fmt: skip
    parser.add_argument("--link", type=_link, default=None, metavar="GBPS[,LATENCY_US]",
                        help="between nodes, per node")  # fmt: skip
    parser.add_argument("--batch", default=None, help="module:callable, forward's arguments (--calibrate)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank (built-in models)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (--calibrate)")
    args = parser.parse_args(argv)
    if not args.calibrate and args.compute_ms is None:
        parser.error("state --compute-ms (and --step-ms), or pass --calibrate to measure them")
    if args.node_link is None and not args.calibrate:
        parser.error("state --node-link GBPS[,LATENCY_US], or pass --calibrate to measure it")
    return args


def _stated_compute(args: argparse.Namespace) -> ComputeTimes:
    forward = args.compute_ms / (1 + BACKWARD_PER_FORWARD) * 1e-3
    backward = forward * BACKWARD_PER_FORWARD
    return ComputeTimes(forward_s=forward, backward_s=backward, step_s=args.step_ms * 1e-3)


def _calibrate(args: argparse.Namespace) -> tuple[ComputeTimes, LinkModel]:
    """Measured compute and node link, each replaced by the stated one where given."""
    inputs = CalibrationInputs(
        args.model, args.batch, args.micro_batch, args.optimizer, args.optimizer_kwargs, args.threads
    )
    measured = calibrate(inputs)
    compute = measured.compute if args.compute_ms is None else _stated_compute(args)
    print(f"measured: {measured.compute}\n          node link {measured.link}")
    return compute, args.node_link or measured.link


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.calibrate:
            load_factory(args.model)  # a bad path is answered before ranks start
            resolve_optimizer(args.optimizer)
            compute, node_link = _calibrate(args)
        else:
            compute, node_link = _stated_compute(args), args.node_link
        cluster = Cluster(
            world_size=args.world_size,
            ranks_per_node=args.world_size if args.ranks_per_node is None else args.ranks_per_node,
            node_link=node_link,
            link=args.link,
        )
        master = None if args.master_dtype is None else getattr(torch, args.master_dtype)
        plan = plan_training(
            args.model,
            args.optimizer,
            cluster=cluster,
            compute=compute,
            optimizer_kwargs=args.optimizer_kwargs,
            sharding=ShardingConfig(
                master_dtype=master,
                grad_compression=args.grad_compression,
                param_compression=args.param_compression,
                grad_error_feedback=args.grad_error_feedback,
            ),
        )
    except ValueError as error:
        print(f"python -m sharded_opt.plan: error: {error}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
