"""``python -m benchmarks.gloo_p2p``: the gloo reduce-scatters and all-gathers of one
ShardingStage1 step, each way of running them side by side (Note [Reduce-scatter on gloo]).

On the default GPT's real buckets, every bucket in flight at once as in a step, interleaved
round by round, medians of the slowest rank:

* reduce-scatter: all-to-all + local sum on a helper thread (the default) and as a callback on
  gloo's thread (before Note [No Python on gloo's threads]), point-to-point with a per-call
  receive buffer (the library's), point-to-point with persistent per-bucket receive buffers;
* all-gather: gloo's all_gather (before), point-to-point (the library's).

``--emulate-link GBPS`` runs it between two network namespaces joined by a shaped veth (root;
wrap in ``flock /tmp/shopt-netns.lock``), as ``benchmarks.compare`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.models import MODEL_NAMES, build_model
from benchmarks.netns import LinkConfig, link_group, link_unavailable_reason, parse_link, shaped_link
from sharded_opt import ShardingStage1, spawn
from sharded_opt.comm import collectives


def _variants(opt: ShardingStage1) -> dict[str, Callable[[], None]]:
    """Each variant issues its collective for every bucket, then waits for all of them."""
    group = opt.process_group
    shards = opt.shards
    grads = [g for g in shards.buffers.grad_buffers if g is not None]
    outputs = [shard.reduced_grad for shard in shards.live_shards()]
    params = [shards.buffers.param_buffers[shard.bucket.index] for shard in shards.live_shards()]
    own = [shard.param_view for shard in shards.live_shards()]
    persistent = [torch.empty_like(grad) for grad in grads]

    def run(issue: Callable[[int], object]) -> Callable[[], None]:
        def all_buckets() -> None:
            for handle in [issue(index) for index in range(len(grads))]:
                handle.wait()

        return all_buckets

    def persistent_p2p(index: int) -> object:
        works = collectives.start_reduce_scatter_by_p2p(persistent[index], grads[index], group)
        return collectives.run_after(
            works,
            lambda: collectives.sum_received(outputs[index], persistent[index], group.size()),
            "gloo:reduce_scatter (point-to-point)",
        )

    def all_to_all_sum_as_callback(index: int) -> object:
        received = torch.empty_like(grads[index])
        work = dist.all_to_all_single(received, grads[index], group=group, async_op=True)
        sum_received = collectives.sum_received
        return work.get_future().then(lambda _: sum_received(outputs[index], received, group.size()))

    return {
        "RS all-to-all + sum (library's)": run(
            lambda i: collectives._reduce_scatter_by_all_to_all(outputs[i], grads[i], group, True)
        ),
        "RS all-to-all + sum as gloo callback": run(all_to_all_sum_as_callback),
        "RS p2p, per-call buffer": run(
            lambda i: collectives.reduce_scatter_avg(outputs[i], grads[i], group, True)
        ),
        "RS p2p, persistent buffers": run(persistent_p2p),
        "AG gloo all_gather (before)": run(
            lambda i: collectives._all_gather(params[i], own[i], group=group, async_op=True)
        ),
        "AG p2p": run(lambda i: collectives.all_gather(params[i], own[i], group, True)),
    }


def probe_rank(model: str, rounds: int, link: LinkConfig | None) -> dict[str, float]:
    """Median seconds per variant (slowest rank per round); every rank returns the same."""
    torch.set_num_threads(1)
    group = link_group(link) if link else dist.group.WORLD
    net = build_model(model, seed=0)
    opt = ShardingStage1(torch.optim.AdamW(net.parameters()), process_group=group)
    variants = _variants(opt)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds + 1):
        for name, variant in variants.items():
            dist.barrier(group)
            start = time.perf_counter()
            variant()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if round_index:  # the first round warms up
                times[name].append(elapsed.item())
    result = {name: statistics.median(values) for name, values in times.items()}
    result["buckets"] = len(opt.plan.buckets)
    result["bucket_bytes"] = sum(b.padded_numel * b.dtype.itemsize for b in opt.plan.buckets)
    opt.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODEL_NAMES, default="default")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--emulate-link", type=parse_link, metavar="GBPS")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.emulate_link:
            reason = link_unavailable_reason((args.world_size,))
            if reason:
                parser.error(reason)
            stack.enter_context(shaped_link(args.emulate_link))
        result = spawn(probe_rank, (args.model, args.rounds, args.emulate_link), nprocs=args.world_size)[0]
    where = f"link {args.emulate_link.gbps:g} Gbit/s" if args.emulate_link else "loopback"
    print(
        f"{args.model}: {result.pop('buckets')} buckets, {result.pop('bucket_bytes') / 2**20:.2f} MiB, "
        f"{args.world_size} ranks, {where}, {args.rounds} interleaved rounds, medians of the slowest rank:"
    )
    for name, seconds in result.items():
        print(f"  {name:32s} {seconds * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
