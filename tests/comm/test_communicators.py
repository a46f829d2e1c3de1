"""Several ``ShardingStage1`` wrappers on one process group: each has its own communicator, so
their asynchronous collectives never pair up with another wrapper's (Note [One communicator per
wrapper]); a dropped wrapper's communicators go to the next one (Note [Reusing a dropped
wrapper's groups]), and close() releases them (Note [Releasing a wrapper's groups])."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sharded_opt import ShardingConfig, ShardingStage1, Strategy, save_checkpoint
from tests.harness.dist_helper import run_ranks

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
    groups = (optimizer.process_group, optimizer.grad_sync.presence.group)
    return [group._get_backend(torch.device("cpu")).options._timeout.total_seconds() for group in groups]


def test_communicators_keep_the_user_groups_timeout() -> None:
    """Both of the wrapper's groups (its communicator and the presence flags' group, Note
    [Presence per bucket]) fail a dead peer's collectives after the user's timeout."""
    assert run_ranks(_communicator_timeouts, 2, timeout_s=17.0) == [[17.0, 17.0], [17.0, 17.0]]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _build_and_close_wrappers(count: int, degree: int | None) -> list[int]:
    """Threads of this process after each of ``count`` wrappers was built, stepped and closed."""
    threads = []
    for index in range(count):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        strategy = Strategy(sharding=ShardingConfig(degree=degree))
        with ShardingStage1(
            torch.optim.AdamW(model.parameters()), overlap=index % 2 == 1, model=model, strategy=strategy
        ) as optimizer:
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
        gc.collect()  # a destroyed group's threads end when the object is freed
        threads.append(_threads())
    return threads


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize(("world_size", "degree"), [(2, None), (4, 2)])
def test_closing_wrappers_releases_their_groups_threads(world_size: int, degree: int | None) -> None:
    """Each wrapper's groups hold gloo threads (six a wrapper): a loop that builds and closes
    wrappers stays flat instead of growing by them (Note [Releasing a wrapper's groups])."""
    for rank, threads in enumerate(run_ranks(_build_and_close_wrappers, world_size, 6, degree)):
        assert threads[-1] <= threads[0], f"rank {rank}: threads grew {threads} while closing wrappers"


def _subgroup_wrappers_in_turn() -> list[int]:
    """Wrappers over the strict subgroup [0, 1] of three ranks, built and closed in turn; the
    groups of this process after each close."""
    subgroup = dist.new_group([0, 1], use_local_synchronization=True)
    if dist.get_rank() == 2:
        return []
    groups = []
    for _ in range(3):
        model = nn.Linear(4, 4)
        with ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), process_group=subgroup) as optimizer:
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        groups.append(_groups())
    return groups


def test_wrappers_over_a_subgroup_can_be_built_and_closed_in_turn() -> None:
    """A subgroup wrapper's groups are named after their ranks and the count of live groups;
    destroying them would hand the next wrapper a name whose stale rendezvous keys hang it, so
    close() gives them to the next wrapper instead, and they do not pile up either (Note
    [Releasing a wrapper's groups])."""
    zero, one, two = run_ranks(_subgroup_wrappers_in_turn, 3, timeout_s=SHORT_TIMEOUT_S)
    assert two == []
    for rank, groups in enumerate((zero, one)):
        assert groups == [groups[0]] * 3, f"rank {rank}: groups grew {groups} while closing wrappers"


def _groups() -> int:
    """The process groups this process belongs to (the world and every other live one)."""
    return len(dist.distributed_c10d._world.pg_map)


def _drop_wrappers(count: int, alive: int, degree: int | None, collecting_rank: int | None) -> dict:
    """``count`` times: build ``alive`` wrappers at once, step them and drop them without
    close(); global rank ``collecting_rank`` runs the garbage collector before each build, the
    others leave it to the wrappers. Returns (threads, groups) after each time, whether two
    wrappers alive at once shared a group, and the last params."""
    gc.freeze()  # the preloaded torch out of the collector: the agreed collections take no time
    counts, shared = [], False
    for index in range(count):
        if dist.get_rank() == collecting_rank:
            gc.collect()
        models = [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)) for _ in range(alive)]
        strategy = Strategy(sharding=ShardingConfig(degree=degree))
        optimizers = [
            ShardingStage1(
                torch.optim.AdamW(m.parameters()), overlap=index % 2 == 1, model=m, strategy=strategy
            )
            for m in models
        ]
        owned = [{id(group) for group in optimizer.shard_groups.owned()} for optimizer in optimizers]
        shared |= len(set().union(*owned)) < sum(len(groups) for groups in owned)
        for model, optimizer in zip(models, optimizers, strict=True):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()  # in overlap mode its all-gathers are still in flight when dropped
        if index == count - 1:
            optimizers[-1].sync_params()
        del optimizers, optimizer
        counts.append((_threads(), _groups()))
    return {
        "counts": counts,
        "shared": shared,
        "params": [p.detach().clone() for p in models[-1].parameters()],
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize(
    ("world_size", "alive", "degree", "collecting_rank"),
    [(2, 1, None, 0), (2, 2, None, None), (4, 1, 2, 1)],
    ids=["one-alive-rank0-collects", "two-alive", "hybrid-degree-2"],
)
def test_dropped_wrappers_reuse_their_groups(
    world_size: int, alive: int, degree: int | None, collecting_rank: int | None
) -> None:
    """Wrappers dropped without close(), as a loop that builds one per trial does: threads and
    groups stay those of the first wrappers (the most alive at once) instead of growing by six
    threads a wrapper, also when the ranks collect garbage at different times; wrappers alive at
    once never share a group (Note [Reusing a dropped wrapper's groups])."""
    count = 32 if world_size == 2 else 12
    results = run_ranks(
        _drop_wrappers, world_size, count, alive, degree, collecting_rank, timeout_s=SHORT_TIMEOUT_S
    )
    for rank, result in enumerate(results):
        counts = result["counts"]
        assert max(threads for threads, _ in counts) <= counts[0][0], f"rank {rank}: threads grew {counts}"
        assert max(groups for _, groups in counts) == counts[0][1], f"rank {rank}: groups grew {counts}"
        assert not result["shared"], f"rank {rank}: two wrappers alive at once shared a group"
        for a, b in zip(results[0]["params"], result["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: params differ from rank 0's"


def _drop_wrappers_on_a_mesh_of_some_ranks(count: int) -> tuple[list[int], list[torch.Tensor]] | None:
    """Wrappers over a 2x2 mesh of ranks 0-3 of five, dropped in turn (rank 0 collects garbage
    before each build): the pick is agreed over the mesh's rows, then its columns."""
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    if dist.get_rank() == 4:
        return None
    groups = []
    for index in range(count):
        if dist.get_rank() == 0:
            gc.collect()
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        optimizer = ShardingStage1(
            torch.optim.SGD(model.parameters(), lr=0.1), device_mesh=mesh, overlap=index % 2 == 1, model=model
        )
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        del optimizer
        groups.append(_groups())
    return groups, [p.detach().clone() for p in model.parameters()]


def test_dropped_wrappers_on_a_mesh_of_some_ranks_reuse_their_groups() -> None:
    *members, outside = run_ranks(_drop_wrappers_on_a_mesh_of_some_ranks, 5, 3, timeout_s=SHORT_TIMEOUT_S)
    assert outside is None
    for rank, (groups, params) in enumerate(members):
        assert groups == [groups[0]] * 3, f"rank {rank}: groups grew {groups}"
        for a, b in zip(members[0][1], params, strict=True):
            assert torch.equal(a, b), f"rank {rank}: params differ from rank 0's"


def _wrapper_after_an_exception() -> bool:
    """Whether a wrapper built after one closed by an exception got groups of its own."""
    model = nn.Linear(4, 4)
    with (
        contextlib.suppress(ValueError),
        ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1)) as first,
    ):
        raise ValueError("the loop failed")
    withheld = first.shard_groups.owned()
    del first
    gc.collect()
    second = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1))
    return not {id(group) for group in withheld} & {id(group) for group in second.shard_groups.owned()}


def test_groups_of_a_wrapper_closed_by_an_exception_are_not_reused() -> None:
    """The exception may have left collectives on them that the other ranks never issued."""
    assert run_ranks(_wrapper_after_an_exception, 2, timeout_s=SHORT_TIMEOUT_S) == [True, True]


def _init_one_rank_world() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def test_a_new_world_starts_with_no_groups_of_the_old_one(single_rank_group) -> None:
    """Tests and sweeps destroy the world and make a new one in one process: a wrapper dropped
    in the old world leaves nothing for a wrapper of the new one to reuse."""
    model = nn.Linear(4, 4)
    old = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1)).shard_groups.owned()
    gc.collect()  # the dropped wrapper gives its groups back
    dist.destroy_process_group()
    _init_one_rank_world()
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not {id(group) for group in old} & {id(group) for group in optimizer.shard_groups.owned()}
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def _close_on_rank_zero_only() -> str:
    # The wrapper's communicator takes the user group's timeout: rank 0 gives up waiting at
    # close() after it, not after the suite's minute (the tiny construction has ample slack).
    group = dist.new_group(timeout=datetime.timedelta(seconds=10))
    model = nn.Linear(4, 4)
    optimizer = ShardingStage1(torch.optim.SGD(model.parameters(), lr=0.1), process_group=group)
    dist.barrier()
    if dist.get_rank() != 0:
        return "skipped"
    with pytest.raises(RuntimeError, match=r"close\(\) is collective") as error:
        optimizer.close()
    return str(error.value)


def test_close_on_one_rank_only_names_the_mistake() -> None:
    message = run_ranks(_close_on_rank_zero_only, 2)[0]
    assert "call it on every rank" in message


def _calls_after_close(tmp_path: str) -> list[str]:
    """Every entry point that would communicate, called after a collective close()."""
    model = nn.Linear(4, 4)
    optimizer = ShardingStage1(torch.optim.AdamW(model.parameters()), model=model)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    optimizer.close()
    calls = {
        "ShardingStage1.step": optimizer.step,
        "ShardingStage1.state_dict": optimizer.state_dict,
        "ShardingStage1.consolidate_state_dict": optimizer.consolidate_state_dict,
        "ShardingStage1.load_state_dict": lambda: optimizer.load_state_dict(saved),
        "save_checkpoint": lambda: save_checkpoint(tmp_path, model, optimizer),
    }
    messages = []
    for caller, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"^{caller}: this ShardingStage1 was closed") as error:
            call()
        messages.append(str(error.value))
    return messages


def test_calls_after_close_say_it_was_closed_not_that_a_group_is_invalid(tmp_path) -> None:
    """close() destroyed the wrapper's groups: later calls name the close, not torch's
    "Invalid process group" from the first collective."""
    for messages in run_ranks(_calls_after_close, 2, str(tmp_path / "ckpt")):
        assert all("save state (state_dict(), save_checkpoint) before closing" in m.lower() for m in messages)
