"""Tests for the comparison benchmark's methods (``benchmarks.compare``/``report``/``session``):
steady-state timing beside block timing, the compute-only pseudo-mode and the ratios built on it,
the comm-bound preset, ``auto`` bucket sizes, ``--profile`` and the compressed wire's modes
beside the exact ones. Nothing here looks at a time's value beyond arithmetic on made-up
numbers."""

from __future__ import annotations

import argparse
import json
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import compare, netns, plots, report, session, setting
from benchmarks.modes import COMM_ONLY, COMPUTE_ONLY, Compression, label

MS = 1e-3


def _ranks(block: dict[str, list[float]], steady: dict[str, list[float]]) -> list[dict]:
    """Two ranks' raw results: rank 1 is 1 ms slower on every block."""
    names = list(block)
    real = [name for name in names if name not in (COMM_ONLY, COMPUTE_ONLY)]
    return [
        {
            "world_size": 2,
            "times": {name: [t + rank * MS for t in values] for name, values in block.items()},
            "steady_times": {name: [t + rank * MS for t in values] for name, values in steady.items()},
            "comm_bytes": {name: {"payload": 0.0, "wire_per_rank": 0.0} for name in names},
            "state_bytes": dict.fromkeys(real, 8),
            "losses": {name: [1.0, 0.5] for name in real},
            "agreement": {name: 0.0 for name in real if name != "ddp"},
            "buckets": [64, 64],
            "num_params": 100,
        }
        for rank in range(2)
    ]


def _run() -> dict:
    block = {"ddp": 0.200, "sync": 0.220, "overlap": 0.210, COMM_ONLY: 0.040, COMPUTE_ONLY: 0.180}
    steady = {"ddp": 0.200, "sync": 0.220, "overlap": 0.190, COMM_ONLY: 0.040, COMPUTE_ONLY: 0.180}
    spread_ = [-2 * MS, 0.0, 2 * MS]
    return report.summarize_run(
        _ranks(
            {k: [v + d for d in spread_] for k, v in block.items()},
            {k: [v + d for d in spread_] for k, v in steady.items()},
        ),
        {},
        1024,
    )


def test_steady_state_medians_beside_block_medians():
    run = _run()
    overlap = run["modes"]["overlap"]
    # The slowest rank (rank 1, +1 ms) sets each block's time.
    assert overlap["median_s"] == pytest.approx(0.211)
    assert overlap["steady_median_s"] == pytest.approx(0.191)
    assert set(run["methods"]) == {"block", "steady"}


def test_hidden_share_and_distance_to_the_bound_for_every_method():
    steady = _run()["methods"]["steady"]
    # (T_sync - T_overlap) / T_comm and T_overlap / max(T_compute, T_comm), slowest rank's times.
    assert steady["hidden_fraction"] == pytest.approx((0.221 - 0.191) / 0.041)
    assert steady["bound_s"] == pytest.approx(0.181)
    assert steady["overlap_vs_bound"] == pytest.approx(0.191 / 0.181)
    assert steady["overlap_vs_ddp"] == pytest.approx(0.191 / 0.201)
    lines = report.analysis_lines(_run())
    assert len(lines) == 2 and all("overlap / max(compute, comm)" in line for line in lines)


@pytest.mark.parametrize(
    ("t_sync", "t_overlap", "t_comm", "share", "raw", "said"),
    [
        # The main job's summary once printed "hidden 812% of comm" (block) and "-24%" (steady).
        (0.4306, 0.2276, 0.025, 1.0, 8.12, "clamped from 812%: overlap saved more than comm alone"),
        (0.5479, 0.5537, 0.0234, 0.0, -0.248, "clamped from -25%: overlap was slower than sync"),
        (0.221, 0.191, 0.041, 0.030 / 0.041, 0.030 / 0.041, None),
    ],
)
def test_hidden_share_is_between_0_and_1_and_shows_its_inputs(t_sync, t_overlap, t_comm, share, raw, said):
    found = report.hidden_comm(t_sync, t_overlap, t_comm)
    assert found["hidden_fraction"] == pytest.approx(share)
    assert found["hidden_fraction_raw"] == pytest.approx(raw, abs=1e-3)
    assert found["clamped"] == (said is not None)
    text = report.hidden_comm_text(found)
    assert f"sync - overlap {(t_sync - t_overlap) * 1e3:+.1f} ms, comm alone {t_comm * 1e3:.1f} ms" in text
    assert (said in text) if said else "clamped" not in text


@given(
    t_sync=st.floats(0.01, 10.0),
    t_overlap=st.floats(0.01, 10.0),
    t_comm=st.floats(1e-4, 10.0),
)
def test_hidden_share_is_always_a_share(t_sync, t_overlap, t_comm):
    found = report.hidden_comm(t_sync, t_overlap, t_comm)
    assert 0.0 <= found["hidden_fraction"] <= 1.0
    assert found["clamped"] == (found["hidden_fraction"] != found["hidden_fraction_raw"])


def test_summary_and_sweep_clamp_the_hidden_share():
    """Overlap 100 ms faster than sync with 40 ms of comm alone: a raw share of 250%."""
    block = {"ddp": 0.200, "sync": 0.300, "overlap": 0.200, COMM_ONLY: 0.040, COMPUTE_ONLY: 0.180}
    run = report.summarize_run(_ranks({k: [v] * 3 for k, v in block.items()}, {}), {}, 1024)
    assert run["hidden_fraction"] == 1.0
    assert run["methods"]["block"]["hidden_fraction"] == 1.0
    assert run["methods"]["block"]["hidden_fraction_raw"] == pytest.approx(0.100 / 0.041)
    assert "clamped from 244%" in report.analysis_lines(run)[0]
    run["bucket_mb"] = None
    for stats in run["modes"].values():
        stats["steady_median_s"] = stats["median_s"]
    rows = report.sweep_table([run]).splitlines()
    assert rows[1].split()[5] == "100%*" and rows[-1].startswith("hidden: ")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("c10d::alltoall_base_", "reduce_scatter"),  # gloo's reduce-scatter of CPU tensors
        ("gloo:all_to_all", "reduce_scatter"),
        ("gloo:reduce_scatter (point-to-point)", "reduce_scatter"),
        ("c10d::_reduce_scatter_base_", "reduce_scatter"),
        ("c10d::_allgather_base_", "all_gather"),
        ("gloo:all_gather", "all_gather"),
        ("gloo:all_gather (point-to-point)", "all_gather"),
        ("c10d::allreduce_", "other"),  # the presence flags, the step's error agreement
        ("c10d::broadcast_", "all_gather"),  # one per rank: the all-gather of CPU tensors on gloo
    ],
)
def test_timeline_colours_each_collective_by_its_kind(name, kind):
    assert plots.collective_kind(name) == kind
    assert set(plots.COLLECTIVE_COLOURS) == set(plots.COLLECTIVE_LABELS)


def test_progress_bar_labels_the_losses():
    losses = {"ddp": [3.5, 2.25], "overlap": [3.5, 2.5], COMM_ONLY: [0.0], COMPUTE_ONLY: [1.0]}
    assert session._loss_postfix(losses) == "last loss: ddp 2.250, overlap 2.500"


def test_targets_use_steady_state_and_follow_the_link():
    run = _run()
    default = {t.name: t for t in report.targets(run, None, emulated_link=False)}
    assert compare.parse_args(["--targets"], LOOPBACK_ONLY).targets
    assert default["overlap / ddp step time (steady)"].limit == 1.00
    assert default["overlap / sync step time (steady)"].limit == 0.93
    linked = {t.name: t for t in report.targets(run, None, emulated_link=True)}
    assert linked["overlap / ddp step time (steady)"].limit == 0.90
    bound = linked["overlap / max(compute, comm) (steady)"]
    assert (bound.limit, bound.measured) == (1.15, pytest.approx(0.191 / 0.181))


def test_bucket_list_accepts_auto_and_rejects_bad_sizes():
    assert compare._bucket_list("auto, 1,4") == (None, 1.0, 4.0)
    for text in ("0", "-1", "big", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected 'auto' or sizes"):
            compare._bucket_list(text)


LOOPBACK_ONLY = compare.Machine(None, 0, lambda world_sizes: "--emulate-link needs root")
LINK_OK = compare.Machine(None, 0, lambda world_sizes: None)


def test_default_run_uses_library_default_buckets():
    plan = compare.parse_args([], LOOPBACK_ONLY)
    assert plan.bucket_mbs == (None,) and plan.link is None and plan.memory
    assert (plan.base.steady_rounds, plan.base.steady_steps) == (4, 10)
    assert plan.setting.kind == "loopback" and not plan.targets


def test_default_run_takes_the_emulated_link_where_the_machine_allows_it():
    """auto = the comm-bound preset where a link can be built, loopback otherwise."""
    plan = compare.parse_args([], LINK_OK)
    assert plan.setting.kind == "link" and plan.link.gbps == setting.DEFAULT_LINK_GBPS
    assert plan.base.cpu_ranks and not plan.memory and plan.base.rounds == 4
    # The user's own flags still win over what auto chose.
    assert compare.parse_args(["--rounds", "6", "--memory"], LINK_OK).base.rounds == 6
    assert compare.parse_args(["--preset", "loopback"], LINK_OK).link is None
    named = compare.parse_args(["--emulate-link", "1"], LOOPBACK_ONLY)
    assert named.setting.kind == "link" and named.link.gbps == 1.0


def test_default_run_uses_accelerators_only_with_one_per_rank():
    two = compare.Machine("cuda", 2, lambda world_sizes: None)
    plan = compare.parse_args([], two)
    assert plan.setting.kind == "accelerator" and plan.link is None and not plan.base.cpu_ranks
    one = compare.Machine("cuda", 1, lambda world_sizes: None)
    plan = compare.parse_args([], one)
    assert plan.setting.kind == "link" and plan.base.cpu_ranks
    assert "1 cuda device(s) for 2 ranks" in plan.setting.reason


@pytest.mark.parametrize(
    ("accelerator", "devices", "link_unavailable", "kind", "said"),
    [
        ("cuda", 8, None, "accelerator", "8 cuda device(s) for 2 ranks"),
        ("cuda", 1, None, "link", "two ranks cannot share one device's collectives"),
        (None, 0, None, "link", "loopback would cost communication almost nothing"),
        (None, 0, "--emulate-link needs root", "loopback", "no emulated link (--emulate-link needs root)"),
    ],
)
def test_choose_setting(accelerator, devices, link_unavailable, kind, said):
    found = setting.choose_setting(
        accelerator_type=accelerator, device_count=devices, world_size=2, link_unavailable=link_unavailable
    )
    assert found.kind == kind and said in found.reason
    assert found.describe().startswith("Running on ") and found.where()
    assert (found.gbps is not None) == (kind == "link")


@pytest.mark.parametrize(
    ("times", "where", "said"),
    [
        # The comm-bound preset, eager (2026-12-05): overlap hid 133 ms.
        (setting.StepTimes(0.8525, 0.7197, 0.6226, 0.2394, 0.7989), "link", "Use overlap=True, model=model"),
        # Loopback, quiet 2-core machine (2026-12-06): overlap 6 % slower, comm 14 % of compute.
        (setting.StepTimes(0.2876, 0.3061, 0.036, 0.250, 0.2644), "loopback", "Either mode"),
        # Comm a fifth of compute and overlap clearly slower: sync.
        (setting.StepTimes(0.300, 0.330, 0.060, 0.240), "loopback", "Use sync (the default)"),
        # Comm a fifth of compute, overlap within the noise: either.
        (setting.StepTimes(0.300, 0.295, 0.060, 0.240), "accelerator", "hid no more than the noise"),
    ],
)
def test_verdict_names_one_choice_from_the_measured_times(times, where, said):
    lines = setting.verdict(times, where)
    assert lines[0].startswith("Measured per step: compute")
    assert said in lines[1]
    assert any(line.startswith("Against DDP") for line in lines) == (times.ddp is not None)
    assert any("--emulate-link" in line for line in lines) == (where == "loopback")


def test_verdict_cautions_when_the_machine_was_too_busy_to_tell():
    """The main job under a load average of 30-41 (2026-12-07): steady overlap saved 109 % of
    comm alone while the short blocks had overlap 1 % slower; a quiet run has no caution."""
    steady = setting.StepTimes(4.9098, 3.8203, 0.9991, 3.6599, 6.0092)
    block = setting.StepTimes(4.8470, 4.8977, 1.1187, 3.9566, 4.0228)
    caution = setting.verdict(steady, "link", block)[-1]
    assert caution.startswith("Caution: overlap saved more than communication alone takes")
    assert "short blocks say the opposite" not in caution  # 1 % slower is a tie, not the opposite
    opposite = setting.StepTimes(4.8470, 5.2, 1.1187, 3.9566)
    assert (
        "the short blocks say the opposite (overlap/sync 1.07)"
        in setting.verdict(steady, "link", opposite)[-1]
    )
    # The second default run (load average 9-18): sync 2105 ms against 1798 + 717 ms of its parts.
    moved = setting.StepTimes(2.1054, 2.8177, 0.7169, 1.7976, 2.1345)
    lines = setting.verdict(moved, "link", setting.StepTimes(2.5264, 2.5381, 0.7372, 1.4236))
    assert lines[1].startswith("Use sync (the default) here: overlap was slower (overlap/sync 1.34).")
    assert lines[-1].startswith("Caution: sync took 2105 ms against 2514 ms of compute plus communication")
    quiet = setting.StepTimes(0.8525, 0.7197, 0.6226, 0.2394, 0.7989)
    assert not any(line.startswith("Caution") for line in setting.verdict(quiet, "link", quiet))


def test_verdict_reads_steady_medians_and_needs_both_pseudo_modes():
    run = _run()
    times = setting.step_times(run, "steady_median_s")
    assert (times.sync, times.overlap, times.comm) == pytest.approx((0.221, 0.191, 0.041))
    lines = compare.verdict_lines(run, setting.Setting("link", "test", 0.2))
    assert "hid 30 ms of communication" in lines[1]
    del run["modes"][COMM_ONLY]
    assert compare.verdict_lines(run, setting.Setting("loopback", "test"))[0].startswith("(no verdict")


def test_compile_flag_names_a_backend_and_defaults_to_inductor():
    assert compare.parse_args([]).base.compile_backend is None
    assert compare.parse_args(["--compile"]).base.compile_backend == "inductor"
    assert compare.parse_args(["--compile", "aot_eager"]).base.compile_backend == "aot_eager"


def test_comm_bound_preset_and_explicit_flags_win():
    plan = compare.parse_args(["--preset", "comm-bound"], LOOPBACK_ONLY)
    assert plan.link is not None and plan.link.gbps == 0.2
    assert not plan.memory and plan.base.rounds == 4 and plan.base.steady_rounds == 2
    argv = ["--preset", "comm-bound", "--emulate-link", "1", "--rounds", "6", "--memory"]
    plan = compare.parse_args(argv, LOOPBACK_ONLY)
    assert plan.link.gbps == 1.0 and plan.base.rounds == 6 and plan.memory


def test_rejects_a_single_steady_round(capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(["--steady-rounds", "1"])
    assert "--steady-rounds must be at least 2" in capsys.readouterr().err


def test_point_to_point_and_profile_steps_reach_the_run_config(capsys):
    default = compare.parse_args([]).base
    assert not default.gloo_point_to_point and default.profile_steps == 1
    plan = compare.parse_args(["--gloo-p2p", "--profile", "--profile-steps", "3"])
    assert plan.base.gloo_point_to_point and plan.base.profile_steps == 3
    with pytest.raises(SystemExit):
        compare.parse_args(["--profile-steps", "0"])
    assert "--profile-steps must be at least 1" in capsys.readouterr().err


def test_degree_adds_the_hybrid_mode_and_two_emulated_nodes():
    plan = compare.parse_args(["--world-sizes", "4", "--degree", "2", "--emulate-link", "0.5"])
    assert plan.base.modes[-1] == "hybrid" and plan.base.degree == 2
    assert plan.link.ranks_per_node == 2 and [plan.link.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert "hybrid" not in compare.parse_args([]).base.modes
    reason = netns.link_unavailable_reason((4,), ranks_per_node=1)
    assert reason.startswith("--emulate-link joins exactly 2 nodes of 1 rank(s)")


def test_degree_must_divide_every_world_size(capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(["--world-sizes", "4", "--degree", "3"])
    assert "--degree must be >= 1 and divide every world size (4,)" in capsys.readouterr().err


def test_muon_runs_ddp_sync_and_overlap(capsys):
    """AdamW keeps every mode; Muon runs DDP, sync and overlap (hybrid with --degree), not zero."""
    assert compare.parse_args([]).base.modes == ("ddp", "zero", "sync", "overlap")
    muon = compare.parse_args(["--optimizer", "muon"]).base
    assert muon.optimizer == "muon" and muon.modes == ("ddp", "sync", "overlap")
    assert compare.parse_args(["--optimizer", "muon", "--degree", "1"]).base.modes[-1] == "hybrid"
    with pytest.raises(SystemExit):
        compare.parse_args(["--optimizer", "muon", "--modes", "ddp,zero"])
    assert "--optimizer muon runs the modes ddp,sync,overlap,hybrid only" in capsys.readouterr().err


def _split(comm: float, newton_schulz: float, calls: int, work: int) -> dict[str, list[float]]:
    """One mode's per-block split on one rank (two blocks alike)."""
    row = {"comm_s": comm, "newton_schulz_s": newton_schulz, "newton_schulz_calls": calls}
    return {key: [value, value] for key, value in {**row, "newton_schulz_work": work}.items()}


def test_step_split_per_rank_means_and_balance():
    """rest = step - comm - Newton-Schulz on each rank (its own medians); the means add up; max/mean
    of Newton-Schulz time and work over ranks."""
    ranks = [
        {"times": {"sync": [0.100, 0.100]}, "splits": {"sync": _split(0.030, 0.020, 3, 300)}},
        {"times": {"sync": [0.102, 0.102]}, "splits": {"sync": _split(0.012, 0.040, 5, 500)}},
    ]
    sync = report.step_split(ranks, "times", "splits")["sync"]
    assert [row["rest_s"] for row in sync["by_rank"]] == pytest.approx([0.050, 0.050])
    mean = sync["mean"]
    assert mean["step_s"] == pytest.approx(0.101) and mean["newton_schulz_s"] == pytest.approx(0.030)
    assert mean["rest_s"] == pytest.approx(mean["step_s"] - mean["comm_s"] - mean["newton_schulz_s"])
    assert sync["newton_schulz_max_s"] == pytest.approx(0.040)
    assert sync["newton_schulz_max_over_mean"] == pytest.approx(0.040 / 0.030)
    assert sync["work_max_over_mean"] == pytest.approx(500 / 400)
    table = report.split_table({"split": {"block": {"sync": sync}}, "optimizer": "muon"})
    assert "ShardingStage1 sync" in table and "3/5" in table


def test_tiny_run_profiles_every_mode(tmp_path):
    """End to end on the tiny GPT: both methods and both pseudo-modes are measured, and
    ``--profile`` leaves one Chrome trace per mode."""
    argv = ["--model", "tiny", "--preset", "loopback", "--modes", "sync,overlap", "--warmup", "1",
            "--rounds", "2", "--steps-per-round", "1", "--steady-rounds", "2", "--steady-steps", "2",
            "--no-memory", "--profile", "--out", str(tmp_path)]  # fmt: skip
    assert compare.main(argv) == 0
    run = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    assert set(run["modes"]) == {"sync", "overlap", COMM_ONLY, COMPUTE_ONLY}
    assert run["bucket_mb"] is None
    assert {"block", "steady"} == set(run["methods"])
    assert "overlap_vs_bound" in run["methods"]["steady"]
    assert all(0.0 <= found["hidden_fraction"] <= 1.0 for found in run["methods"].values())
    # The timeline's launch ticks include both kinds (once, every tick was drawn as all-gather).
    launches = {plots.collective_kind(e["name"]) for e in run["timeline"] if e["name"].startswith("c10d::")}
    assert {"reduce_scatter", "all_gather"} <= launches
    assert (tmp_path / "timeline_overlap.png").stat().st_size > 0
    traces = sorted(path.name for path in (tmp_path / "profile_bauto").iterdir())
    assert traces == [f"trace_{name}_ws2.json" for name in sorted(["sync", "overlap", "comm", "compute"])]


def test_emulated_link_is_torn_down_when_building_it_fails(monkeypatch):
    """A failure after the namespaces exist (here: moving the veth end into its namespace) still
    deletes both namespaces and the veth pair left in the root namespace; nothing runs for real."""
    made, cleanup = [], []

    def fake_ip(*args: str) -> None:
        made.append(args)
        if args[:2] == ("link", "set"):
            raise RuntimeError("ip link set failed: no permission")

    monkeypatch.setattr(netns, "_ip", fake_ip)
    monkeypatch.setattr(netns.subprocess, "run", lambda command, **kwargs: cleanup.append(command))
    link = netns.LinkConfig(0.2, prefix="shopttest")
    with pytest.raises(RuntimeError, match="no permission"), netns.shaped_link(link):
        pass
    assert ("netns", "add", "shopttest-ns0") in made and ("netns", "add", "shopttest-ns1") in made
    assert ["ip", "netns", "delete", "shopttest-ns0"] in cleanup
    assert ["ip", "netns", "delete", "shopttest-ns1"] in cleanup
    assert ["ip", "link", "delete", "shopttest-v0"] in cleanup


def test_sigterm_handler_lasts_only_as_long_as_the_run():
    before = signal.getsignal(signal.SIGTERM)
    with compare._stop_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


INT8 = "int8g+int8p"


def test_compression_flags_add_compressed_sync_and_overlap_beside_the_exact_modes(capsys):
    plan = compare.parse_args(["--grad-compression", "int8", "--param-compression", "int8"], LOOPBACK_ONLY)
    assert plan.base.modes == ("ddp", "zero", "sync", "overlap", f"sync+{INT8}", f"overlap+{INT8}")
    assert plan.base.compression == Compression("int8", "int8")
    bf16 = compare.parse_args(["--grad-compression", "bf16", "--modes", "ddp,overlap"], LOOPBACK_ONLY)
    assert bf16.base.modes == ("ddp", "overlap", "overlap+bf16g")
    assert (
        compare.parse_args(["--param-compression", "int8"], LOOPBACK_ONLY).base.modes[-1] == "overlap+int8p"
    )
    assert compare.parse_args([], LOOPBACK_ONLY).base.compression.exact
    assert label(f"overlap+{INT8}") == f"ShardingStage1 overlap +{INT8}"
    for argv, said in [
        (["--grad-compression", "int8", "--modes", "ddp"], "compress the modes sync,overlap: run one"),
        (["--param-compression", "bf16"], "invalid choice: 'bf16'"),
    ]:
        with pytest.raises(SystemExit):
            compare.parse_args(argv, LOOPBACK_ONLY)
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.parse_args(
            ["--grad-compression", "bf16"], compare.Machine("cuda", 2, lambda world_sizes: None)
        )
    assert "runs on CPU ranks (gloo) only" in capsys.readouterr().err


def _compressed_ranks() -> list[dict]:
    """Two ranks' raw results with the int8 wire beside the exact modes: exact sync and overlap
    send 100 bytes a step, compressed 25; DDP's bytes are its ring estimate, 100."""
    block = {"ddp": 0.400, "sync": 0.500, "overlap": 0.420, f"sync+{INT8}": 0.300, f"overlap+{INT8}": 0.150}
    ranks = _ranks({k: [v] * 3 for k, v in block.items()}, {k: [v] * 3 for k, v in block.items()})
    for r in ranks:
        r["comm_bytes"] = {name: {"payload": 100.0, "wire_per_rank": 100.0} for name in block}
        r["wire_bytes_per_step"] = {
            name: {"grads": sent / 2, "params": sent / 2, "replicas": 0.0, "total": sent}
            for name, sent in (
                ("sync", 100.0),
                ("overlap", 100.0),
                (f"sync+{INT8}", 25.0),
                (f"overlap+{INT8}", 25.0),
            )
        }
        r["agreement"].update({f"sync+{INT8}": 0.01, f"overlap+{INT8}": 0.01})
        r["compressed_pair_diff"] = 0.0
    return ranks


def test_compressed_modes_report_bytes_and_ratios_and_are_not_held_to_ddp_params():
    run = report.summarize_run(_compressed_ranks(), {}, 1024)
    modes = run["modes"]
    assert modes[f"overlap+{INT8}"]["sent_measured"] and not modes["ddp"]["sent_measured"]
    assert modes[f"overlap+{INT8}"]["sent_bytes_per_step"] == 25.0
    ratios = report.compressed_ratios(run)[f"overlap+{INT8}"]
    assert ratios["bytes_vs_exact"] == pytest.approx(0.25) and ratios["bytes_vs_ddp"] == pytest.approx(0.25)
    # The slowest rank's (rank 1, +1 ms) medians.
    assert ratios["steady_vs_ddp"] == pytest.approx(0.151 / 0.401)
    assert ratios["steady_vs_exact"] == pytest.approx(0.151 / 0.421)
    # 0.01 from DDP's params: reported for the compressed modes, not a disagreement.
    assert run["agreement"]["agree"] and run["agreement"]["compressed_sync_vs_overlap"] == 0.0
    lines = compare.agreement_lines(run["agreement"])
    assert "modes ddp/sync/overlap agree" in lines[0] and "reported, not checked" in lines[1]
    assert lines[2].endswith("bitwise equal")
    table = report.mode_table(run)
    assert f"ShardingStage1 overlap +{INT8}" in table and "0.00*" in table  # DDP's bytes: computed
    text = report.compressed_lines(run)
    assert text[1].startswith(f"overlap+{INT8}: sent 0.00 MiB/step/rank = 0.250x overlap, 0.250x DDP's")
    targets = {t.name: t for t in report.targets(run, None, emulated_link=True)}
    assert targets[f"overlap+{INT8} / overlap bytes sent per step"].limit == 0.30
    assert targets[f"overlap+{INT8} / ddp step time (steady)"].limit == 0.40
    assert f"sync+{INT8} / ddp step time (steady)" not in targets  # overlap's target only
    loopback = {t.name: t for t in report.targets(run, None, emulated_link=False)}
    assert loopback[f"sync+{INT8} / sync step time (steady)"].limit == 1.10
    assert f"overlap+{INT8} / ddp step time (steady)" not in loopback
    # A compressed sync that left the compressed overlap is a disagreement.
    ranks = _compressed_ranks()
    ranks[1]["compressed_pair_diff"] = 1e-3
    assert not report.summarize_run(ranks, {}, 1024)["agreement"]["agree"]


def test_tiny_run_measures_the_compressed_wire_beside_the_exact_one(tmp_path, capsys):
    """End to end on the tiny GPT, 2 ranks on loopback: the int8 wire's modes run beside the
    exact ones, their bytes are counted from the payloads (a quarter of the exact wire's and
    its int8 scales), and the run still agrees."""
    argv = ["--model", "tiny", "--preset", "loopback", "--modes", "ddp,sync", "--warmup", "1",
            "--rounds", "2", "--steps-per-round", "1", "--steady-rounds", "2", "--steady-steps", "1",
            "--no-memory", "--grad-compression", "int8", "--param-compression", "int8",
            "--out", str(tmp_path)]  # fmt: skip
    assert compare.main(argv) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    run = payload["runs"][0]
    assert set(run["modes"]) == {"ddp", "sync", f"sync+{INT8}", COMM_ONLY, COMPUTE_ONLY}
    sync, compressed = run["modes"]["sync"], run["modes"][f"sync+{INT8}"]
    assert sync["sent_measured"] and compressed["sent_measured"] and not run["modes"]["ddp"]["sent_measured"]
    assert sync["sent_by_kind"]["grads"] == sync["sent_by_kind"]["params"] > 0
    ratio = run["compressed_ratios"][f"sync+{INT8}"]["bytes_vs_exact"]
    assert 0.25 < ratio <= 0.30
    assert run["agreement"]["agree"] and run["agreement"]["param_max_abs_diff"][f"sync+{INT8}"] > 0
    assert payload["compressed"][0].startswith(f"sync+{INT8}: sent")
    out = capsys.readouterr().out
    assert f"ShardingStage1 sync +{INT8}" in out and "Compressed wire (grads int8, params int8)" in out
