"""Several ``ShardingStage1`` wrappers on one process group: each has its own communicator, so
their asynchronous collectives never pair up with another wrapper's (see
``resolve_process_group``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from tests.dist_helper import run_ranks

# A mismatch between wrappers shows as wrong numbers, a collective error or a hang; a short
# collective timeout turns the hang into a failure quickly.
SHORT_TIMEOUT_S = 20.0


def _generator_and_discriminator() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 8))
    discriminator = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))
    return generator, discriminator


def _train_gan(overlap: bool, steps: int = 4) -> list[torch.Tensor]:
    """Two wrappers of different sizes on the default group; the ranks run the two backwards in
    opposite orders, so in overlap mode their reductions are issued in opposite orders too."""
    rank = dist.get_rank()
    generator, discriminator = _generator_and_discriminator()
    strategy = Strategy(sharding=ShardingConfig(bucket_size_mb=0.001))
    optimizers = [
        ShardingStage1(torch.optim.AdamW(m.parameters()), overlap=overlap, model=m, strategy=strategy)
        for m in (generator, discriminator)
    ]
    data = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        fake = generator(data)
        losses = [fake.pow(2).mean(), discriminator(data).sigmoid().mean()]
        for loss in losses if rank == 0 else reversed(losses):
            loss.backward()
        for optimizer in optimizers:
            optimizer.step()
    for optimizer in optimizers:
        optimizer.sync_params()
    return [p.detach().clone() for m in (generator, discriminator) for p in m.parameters()]


def _sync_and_overlap_gan() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return _train_gan(overlap=False), _train_gan(overlap=True)


def test_two_wrappers_on_one_group_with_opposite_backward_orders_match_sync() -> None:
    (sync0, overlap0), (sync1, overlap1) = run_ranks(_sync_and_overlap_gan, 2, timeout_s=SHORT_TIMEOUT_S)
    for index, (a, b, c, d) in enumerate(zip(sync0, overlap0, sync1, overlap1, strict=True)):
        assert torch.equal(a, b), f"rank 0 param {index}: overlap differs from sync"
        assert torch.equal(c, d), f"rank 1 param {index}: overlap differs from sync"
        assert torch.equal(b, d), f"param {index} differs between ranks"


def _wrap_on_subgroup() -> dict | None:
    """Ranks 1 and 2 shard over a subgroup; rank 0 takes no part after creating it."""
    subgroup = dist.new_group(ranks=[1, 2])
    if dist.get_rank() == 0:
        return None
    generator, _ = _generator_and_discriminator()
    optimizer = ShardingStage1(
        torch.optim.SGD(generator.parameters(), lr=0.1), overlap=True, process_group=subgroup
    )
    generator(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return {
        "own_group": optimizer.process_group is not subgroup,
        "ranks": dist.get_process_group_ranks(optimizer.process_group),
        "first_global_rank": dist.get_global_rank(optimizer.process_group, 0),
        "world_size": optimizer.world_size,
        "params": [p.detach().clone() for p in generator.parameters()],
    }


def test_wrapper_splits_its_communicator_from_a_subgroup() -> None:
    _, one, two = run_ranks(_wrap_on_subgroup, 3)
    for seen in (one, two):
        assert seen["own_group"]
        assert seen["ranks"] == [1, 2]
        assert seen["first_global_rank"] == 1
        assert seen["world_size"] == 2
    for a, b in zip(one["params"], two["params"], strict=True):
        assert torch.equal(a, b)


def _communicator_timeouts() -> list[float]:
    """The collective timeouts of the wrapper's communicator and of its presence-flag group."""
    generator, _ = _generator_and_discriminator()
    optimizer = ShardingStage1(torch.optim.SGD(generator.parameters(), lr=0.1))
    groups = (optimizer.process_group, optimizer._grad_sync.presence._group)
    return [group._get_backend(torch.device("cpu")).options._timeout.total_seconds() for group in groups]


def test_communicators_keep_the_user_groups_timeout() -> None:
    """Both of the wrapper's groups (its communicator and the presence flags' group, Note
    [Presence per bucket]) fail a dead peer's collectives after the user's timeout."""
    assert run_ranks(_communicator_timeouts, 2, timeout_s=17.0) == [[17.0, 17.0], [17.0, 17.0]]
