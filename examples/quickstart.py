"""Train a small model on 2 CPU ranks with sharded AdamW and check the ranks agree."""

import torch
import torch.distributed as dist

from sharded_opt import ShardingStage1, spawn


def train() -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = ShardingStage1(torch.optim.AdamW(model.parameters(), lr=1e-2), overlap=True, model=model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    target = data.sum(dim=1, keepdim=True)
    for _ in range(50):
        x, y = data[rank::world_size], target[rank::world_size]  # this rank's slice of the batch
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    opt.sync_params()
    print(f"rank {rank}: loss {loss.item():.4f}, optimizer state {opt.optimizer_state_bytes()} bytes")
    return loss.item()


if __name__ == "__main__":
    losses = spawn(train, nprocs=2)
    print("final losses per rank:", losses)
