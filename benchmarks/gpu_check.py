"""One-GPU check of the overlap path's stream discipline (run on a machine with CUDA).

    TORCH_CUDA_SANITIZER=1 python -m benchmarks.gpu_check --out out/gpu_check

1. Trains the tiny GPT for a few steps with ``ShardingStage1(overlap=True, model=...)`` and bf16
   params with fp32 master shards on world size 1 (NCCL), under CUDA's stream sanitizer, which
   raises on any unsynchronized access between streams.
2. Issues a reduce-scatter and an all-gather on the wrapper's kind of side stream (through
   ``new_comm_stream``/``wait_compute``/``wait_comm``) while matmuls run on the compute stream,
   under ``torch.profiler``, and writes a Chrome trace: the NCCL kernels appear on a
   non-default stream, alongside the compute kernels.

At world size 1 the wrapper issues no collectives (there is nothing to exchange), which is why
part 2 drives the same primitives directly. CI never runs this; the CPU tests are the proof.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.models import GPT, PRESETS
from sharded_opt import ShardingConfig, ShardingStage1, Strategy, collectives, spawn, wait_comm, wait_compute
from sharded_opt.streams import new_comm_stream, on_stream


def check(out: str) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).to(device=device, dtype=torch.bfloat16)
    strategy = Strategy(sharding=ShardingConfig(master_dtype=torch.float32, bucket_size_mb=0.25))
    optimizer = ShardingStage1(
        torch.optim.AdamW(model.parameters()), overlap=True, model=model, strategy=strategy
    )
    config = PRESETS["tiny"]
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_len + 1), device=device)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    optimizer.sync_params()

    stream = new_comm_stream(device)
    grads = torch.randn(64 * 2**20, device=device)
    shard = torch.empty(grads.numel() // dist.get_world_size(), device=device)
    weights = torch.randn(4096, 4096, device=device)
    trace = Path(out) / "gpu_overlap_trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(3):
            wait_compute(stream)
            with on_stream(stream):
                works = [collectives.reduce_scatter_avg(shard, grads, dist.group.WORLD, async_op=True)]
                works.append(collectives.all_gather(grads, shard, dist.group.WORLD, async_op=True))
            product = weights @ weights  # compute that the collectives can overlap
            wait_comm(works)
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(trace))
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    streams = {getattr(e, "stream", None) for e in kernels if "nccl" in e.name.lower()}
    return {"losses": losses, "nccl_streams": sorted(map(str, streams)), "checksum": float(product.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/gpu_check")
    args = parser.parse_args()
    (result,) = spawn(check, args=(args.out,), devices="0", backend="nccl")
    print(result)


if __name__ == "__main__":
    main()
