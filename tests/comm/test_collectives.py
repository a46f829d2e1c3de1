"""The gloo collectives over point-to-point (Note [Reduce-scatter on gloo]): values equal to the
reference average in rank order, several buckets in flight at once, uneven sizes, fp32 and bf16,
on 3 ranks and on a 2-rank subgroup whose group ranks differ from the global ones. One spawn
runs every check; each test reads its own result."""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from benchmarks.gloo_p2p import probe_rank
from sharded_opt import ShardingConfig, ShardingStage1, Strategy
from sharded_opt.comm import collectives
from tests.harness.dist_helper import run_ranks

SHARD_NUMELS = (5, 1, 37, 64)
"""Per-rank slice sizes of the buckets: uneven, one of a single element."""

DTYPES = (torch.float32, torch.bfloat16)


def _bucket(seed: int, group_rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + group_rank)
    return torch.randn(numel, generator=generator).to(dtype)


def _reference_average(seed: int, group_rank: int, world_size: int, numel: int, dtype) -> torch.Tensor:
    """Slice ``group_rank`` of every rank's bucket, summed in rank order in fp32 at least (as
    ``torch.sum`` accumulates 16-bit values), then divided in ``dtype``."""
    accumulate = torch.promote_types(dtype, torch.float32)
    total = torch.zeros(numel // world_size, dtype=accumulate)
    for rank in range(world_size):
        total = total + _bucket(seed, rank, numel, dtype).view(world_size, -1)[group_rank].to(accumulate)
    return total.to(dtype) / world_size


def _cases(world_size: int) -> list[tuple[int, int, torch.dtype]]:
    """(seed, bucket numel, dtype) per bucket, in the order every rank issues them."""
    return [
        (seed, shard * world_size, dtype)
        for seed, (shard, dtype) in enumerate((s, d) for d in DTYPES for s in SHARD_NUMELS)
    ]


def _reduce_scatter_checks(group: dist.ProcessGroup) -> dict[str, bool]:
    rank, world_size = group.rank(), group.size()
    cases = _cases(world_size)
    inputs = [_bucket(seed, rank, numel, dtype) for seed, numel, dtype in cases]
    expected = [_reference_average(seed, rank, world_size, numel, dtype) for seed, numel, dtype in cases]
    sync_out = [torch.empty(numel // world_size, dtype=dtype) for _, numel, dtype in cases]
    for output, input in zip(sync_out, inputs, strict=True):
        collectives.reduce_scatter_avg(output, input, group, async_op=False, point_to_point=True)
    in_flight = [torch.empty_like(output) for output in sync_out]
    handles = [
        collectives.reduce_scatter_avg(output, input, group, async_op=True, point_to_point=True)
        for output, input in zip(in_flight, inputs, strict=True)
    ]
    for handle in reversed(handles):
        handle.wait()
    by_all_to_all = [torch.empty_like(output) for output in sync_out]
    for output, input in zip(by_all_to_all, inputs, strict=True):
        collectives._reduce_scatter_by_all_to_all(output, input, group, async_op=False)
    inputs_kept = all(
        torch.equal(input, _bucket(seed, rank, numel, dtype))
        for input, (seed, numel, dtype) in zip(inputs, cases, strict=True)
    )
    return {
        "sync_equals_reference": all(map(torch.equal, sync_out, expected)),
        "in_flight_equals_reference": all(map(torch.equal, in_flight, expected)),
        "equals_all_to_all": all(map(torch.equal, sync_out, by_all_to_all)),
        "inputs_kept": inputs_kept,
        "widened_equals_cast": _widened_equals_cast(group, inputs),
    }


def _widened_equals_cast(group: dist.ProcessGroup, inputs: list[torch.Tensor]) -> bool:
    """bf16 buckets reduced into fp32 outputs (Note [Widening on receipt]), on both paths and in
    flight, are bitwise the reduction of their fp32 casts."""
    bf16 = [input for input in inputs if input.dtype == torch.bfloat16]
    outputs = {}
    for name, cast, point_to_point in (
        ("cast", True, False),
        ("widened", False, False),
        ("p2p", False, True),
    ):
        outputs[name] = [torch.empty(input.numel() // group.size()) for input in bf16]
        handles = [
            collectives.reduce_scatter_avg(
                output, input.float() if cast else input, group, async_op=True, point_to_point=point_to_point
            )
            for output, input in zip(outputs[name], bf16, strict=True)
        ]
        for handle in handles:
            handle.wait()
    return all(
        torch.equal(cast, widened) and torch.equal(cast, p2p)
        for cast, widened, p2p in zip(outputs["cast"], outputs["widened"], outputs["p2p"], strict=True)
    )


def _all_gather_checks(group: dist.ProcessGroup) -> dict[str, dict[str, bool]]:
    """On the point-to-point path, on the broadcasts that big buckets take (which must not use
    gloo's own all-gather: it gathers into a copy of the output), and on gloo's all-gather that
    buckets below ``BROADCAST_ALL_GATHER_MIN_BYTES`` take (Note [In-place all-gather on gloo])."""

    def refuse(*args, **kwargs):
        raise AssertionError("gloo's all-gather ran on CPU tensors")

    with (
        mock.patch.object(collectives, "_all_gather", refuse),
        mock.patch.object(collectives, "BROADCAST_ALL_GATHER_MIN_BYTES", 0),
    ):
        found = {
            "point_to_point": _all_gather_results(group, point_to_point=True),
            "broadcasts": _all_gather_results(group, point_to_point=False),
        }
    gloo_calls = []
    with mock.patch.object(collectives, "_all_gather", _counting(collectives._all_gather, gloo_calls)):
        found["small_buckets"] = _all_gather_results(group, point_to_point=False)
    found["small_buckets"]["gloo_all_gather_used"] = bool(gloo_calls)
    return found


def _counting(function, calls: list) -> Callable:
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def _all_gather_results(group: dist.ProcessGroup, point_to_point: bool) -> dict[str, bool]:
    rank, world_size = group.rank(), group.size()
    cases = _cases(world_size)
    expected = [
        torch.cat([_bucket(seed, r, numel, dtype)[: numel // world_size] for r in range(world_size)])
        for seed, numel, dtype in cases
    ]
    out_of_place = [torch.full((numel,), float("nan"), dtype=dtype) for _, numel, dtype in cases]
    in_place = [torch.full_like(output, float("nan")) for output in out_of_place]
    handles = []
    for (seed, numel, dtype), output, in_place_output in zip(cases, out_of_place, in_place, strict=True):
        own = _bucket(seed, rank, numel, dtype)[: numel // world_size]
        handles.append(
            collectives.all_gather(output, own.clone(), group, async_op=True, point_to_point=point_to_point)
        )
        slot = in_place_output.view(world_size, -1)[rank]
        slot.copy_(own)
        handles.append(
            collectives.all_gather(in_place_output, slot, group, async_op=True, point_to_point=point_to_point)
        )
    for handle in reversed(handles):
        handle.wait()
    sync_out = [torch.empty_like(output) for output in out_of_place]
    for (seed, numel, dtype), output in zip(cases, sync_out, strict=True):
        own = _bucket(seed, rank, numel, dtype)[: numel // world_size]
        collectives.all_gather(output, own, group, async_op=False, point_to_point=point_to_point)
    return {
        "out_of_place_equals_reference": all(map(torch.equal, out_of_place, expected)),
        "in_place_equals_reference": all(map(torch.equal, in_place, expected)),
        "sync_equals_reference": all(map(torch.equal, sync_out, expected)),
    }


def _without_gloo_collectives(group: dist.ProcessGroup) -> bool:
    """Both collectives still work when gloo's all-to-all and all-gather refuse to run."""

    def refuse(*args, **kwargs):
        raise AssertionError("a gloo collective ran where point-to-point was expected")

    no_all_to_all = mock.patch.object(dist, "all_to_all_single", refuse)
    with no_all_to_all, mock.patch.object(collectives, "_all_gather", refuse):
        world_size = group.size()
        output = torch.empty(2)
        collectives.reduce_scatter_avg(
            output, torch.ones(2 * world_size), group, async_op=False, point_to_point=True
        )
        gathered = torch.empty(world_size)
        collectives.all_gather(gathered, torch.ones(1), group, async_op=True, point_to_point=True).wait()
    return torch.equal(output, torch.ones(2)) and torch.equal(gathered, torch.ones(world_size))


def _without_point_to_point(group: dist.ProcessGroup) -> bool:
    """By default (no ``point_to_point``) both collectives use gloo's own, never isend/irecv."""

    def refuse(*args, **kwargs):
        raise AssertionError("a point-to-point message was posted by default")

    with mock.patch.object(dist, "isend", refuse), mock.patch.object(dist, "irecv", refuse):
        world_size = group.size()
        output = torch.empty(2)
        collectives.reduce_scatter_avg(output, torch.ones(2 * world_size), group, async_op=True).wait()
        gathered = torch.empty(world_size)
        collectives.all_gather(gathered, torch.ones(1), group, async_op=True).wait()
    return torch.equal(output, torch.ones(2)) and torch.equal(gathered, torch.ones(world_size))


def _training_with_point_to_point(group: dist.ProcessGroup) -> bool:
    """``ShardingConfig(gloo_point_to_point=True)`` trains bitwise like the default, in both
    modes (the sum runs in rank order either way)."""
    finals = []
    for point_to_point in (False, True):
        for overlap in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
            config = ShardingConfig(
                enable_overlap=overlap, bucket_size_mb=0.0005, gloo_point_to_point=point_to_point
            )
            opt = ShardingStage1(
                torch.optim.AdamW(model.parameters(), lr=0.01),
                strategy=Strategy(sharding=config),
                process_group=group,
                model=model,
            )
            torch.manual_seed(1 + group.rank())
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(4, 8)).square().sum().backward()
                opt.step()
            opt.sync_params()
            finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            opt.close()
    return all(torch.equal(finals[0], final) for final in finals[1:])


CHECKS: dict[str, Callable[[dist.ProcessGroup], object]] = {
    "reduce_scatter": _reduce_scatter_checks,
    "all_gather": _all_gather_checks,
    "point_to_point_only": _without_gloo_collectives,
    "collectives_by_default": _without_point_to_point,
    "training_with_point_to_point": _training_with_point_to_point,
}


def _all_checks() -> dict[str, dict[str, object]]:
    """Every check on the 3-rank world and on the subgroup of global ranks 1 and 2, then one
    round of the benchmark probe (a smoke run: its timings are never asserted)."""
    subgroup = dist.new_group([1, 2])
    results: dict[str, dict[str, object]] = {}
    for label, group in (("3 ranks", dist.group.WORLD), ("2 ranks", subgroup)):
        if dist.get_rank() in dist.get_process_group_ranks(group):
            results[label] = {name: check(group) for name, check in CHECKS.items()}
    results["probe"] = probe_rank("tiny", rounds=1, link=None)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, object]]]:
    return run_ranks(_all_checks, 3)


def _per_rank(results, label: str, check: str) -> list[object]:
    return [rank_results[label][check] for rank_results in results if label in rank_results]


@pytest.mark.parametrize("label", ["3 ranks", "2 ranks"])
def test_reduce_scatter_is_the_average_in_rank_order_also_with_buckets_in_flight(results, label) -> None:
    for outcome in _per_rank(results, label, "reduce_scatter"):
        assert outcome == {
            "sync_equals_reference": True,
            "in_flight_equals_reference": True,
            "equals_all_to_all": True,
            "inputs_kept": True,
            "widened_equals_cast": True,
        }


@pytest.mark.parametrize("label", ["3 ranks", "2 ranks"])
def test_all_gather_in_and_out_of_place_also_with_buckets_in_flight(results, label) -> None:
    for outcome in _per_rank(results, label, "all_gather"):
        for path in ("point_to_point", "broadcasts"):
            assert outcome[path] == {
                "out_of_place_equals_reference": True,
                "in_place_equals_reference": True,
                "sync_equals_reference": True,
            }, path
        assert outcome["small_buckets"] == {
            "out_of_place_equals_reference": True,
            "in_place_equals_reference": True,
            "sync_equals_reference": True,
            "gloo_all_gather_used": True,
        }


@pytest.mark.parametrize("label", ["3 ranks", "2 ranks"])
def test_gloo_cpu_collectives_run_over_point_to_point(results, label) -> None:
    assert _per_rank(results, label, "point_to_point_only") == [True] * (3 if label == "3 ranks" else 2)


@pytest.mark.parametrize("label", ["3 ranks", "2 ranks"])
def test_gloo_cpu_collectives_are_gloos_own_by_default(results, label) -> None:
    assert _per_rank(results, label, "collectives_by_default") == [True] * (3 if label == "3 ranks" else 2)


@pytest.mark.parametrize("label", ["3 ranks", "2 ranks"])
def test_training_with_point_to_point_is_bitwise_the_default(results, label) -> None:
    assert _per_rank(results, label, "training_with_point_to_point") == [True] * (
        3 if label == "3 ranks" else 2
    )


def test_the_benchmark_probe_times_every_variant(results) -> None:
    probe = results[0]["probe"]
    assert {name for name in probe if name.startswith(("RS ", "AG "))} == {
        "RS all-to-all + sum (library's)",
        "RS all-to-all + sum as gloo callback",
        "RS p2p, per-call buffer",
        "RS p2p, persistent buffers",
        "AG gloo all_gather (before)",
        "AG p2p",
    }
    assert all(seconds > 0 for name, seconds in probe.items() if name.startswith(("RS ", "AG ")))


def test_an_error_of_a_background_reduce_scatter_surfaces_at_wait() -> None:
    class FailingWorks:
        def wait(self) -> bool:
            raise RuntimeError("peer went away")

    future = collectives.run_after(FailingWorks(), lambda: None, "gloo:test")
    with pytest.raises(RuntimeError, match="peer went away"):
        future.wait()
