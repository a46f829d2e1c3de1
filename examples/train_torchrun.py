"""A complete training script for torchrun, with sharded checkpoints and resume.

One machine, 2 processes:

    torchrun --nnodes 1 --nproc-per-node 2 examples/train_torchrun.py --ckpt-dir ckpt

Two machines of 8 GPUs each (run on both; NODE_RANK 0 and 1, HOST the first machine):

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank NODE_RANK --master-addr HOST \
        --master-port 29500 examples/train_torchrun.py --ckpt-dir /shared/ckpt

Run it again with the same ``--ckpt-dir`` (any number of ranks) and it resumes from the newest
complete checkpoint. ``--ckpt-dir`` must be one folder every rank sees (a shared file system
across machines).
"""

import argparse
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_opt import ShardingStage1, init_parallel_env, load_checkpoint, save_checkpoint

CHECKPOINT_NAME = re.compile(r"step-(\d+)")
"""Checkpoints are ``CKPT_DIR/step-N``: a link that ``save_checkpoint`` publishes only once the
checkpoint is complete, to the folder ``step-N.ckpt-<id>/`` that holds it."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100, help="train until this step")
    parser.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    parser.add_argument("--batch", type=int, default=32, help="global batch, split over the ranks")
    return parser.parse_args()


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))


def batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step``: the same data whenever the step runs,
    so a resumed run sees what an uninterrupted one would have."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(global_batch, 32, generator=generator)
    targets = inputs[:, :4].sum(dim=1, keepdim=True)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return inputs[rank::world_size], targets[rank::world_size]


def saved_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the complete checkpoints in ``ckpt_dir``, oldest first."""
    found = (CHECKPOINT_NAME.fullmatch(path.name) for path in ckpt_dir.glob("step-*"))
    return sorted(int(match.group(1)) for match in found if match)


def remove_old(ckpt_dir: Path, keep: int) -> None:
    """Rank 0 deletes all but the newest ``keep`` checkpoints (each link and its folder)."""
    for step in saved_steps(ckpt_dir)[:-keep]:
        link = ckpt_dir / f"step-{step}"
        folder = link.resolve()
        link.unlink()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    args = parse_args()
    if args.batch % int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"--batch {args.batch} must divide by the {os.environ['WORLD_SIZE']} ranks")
    init_parallel_env()  # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by torchrun
    rank = dist.get_rank()
    model = build_model()  # on an accelerator: .to(device) here, before the optimizer
    opt = ShardingStage1(torch.optim.AdamW(model.parameters(), lr=1e-2), overlap=True, model=model)

    start = 0
    done = saved_steps(args.ckpt_dir) if args.ckpt_dir.is_dir() else []
    if done:
        start = done[-1]
        load_checkpoint(args.ckpt_dir / f"step-{start}", model, opt)  # every rank, collective
        if rank == 0:
            print(f"resumed from step {start}")
    elif rank == 0:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)

    loss = torch.zeros(())
    for step in range(start, args.steps):
        inputs, targets = batch(step, args.batch)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_checkpoint(args.ckpt_dir / f"step-{step + 1}", model, opt)  # every rank
            if rank == 0:
                remove_old(args.ckpt_dir, args.keep)

    opt.sync_params()  # overlap leaves the last all-gathers in flight
    checksum = sum(p.double().sum().item() for p in model.parameters())
    if rank == 0:
        print(f"step {args.steps}: loss {loss.item():.6f}, param checksum {checksum!r}")
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
