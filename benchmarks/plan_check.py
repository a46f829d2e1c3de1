"""``python -m benchmarks.plan_check --compare RESULTS.json``: the planner's predictions against a
``benchmarks.compare`` run.

Calibrates on two spawned ranks as ``python -m sharded_opt.plan --calibrate`` does (with
``--emulate-link GBPS`` the link is measured between the ranks' network namespaces, as the run
had it), predicts each mode's steady block time for the run's model, AdamW settings, bucket
sizes and ``--steady-steps``, and prints predicted against measured, twice: with the compute
measured by the calibration, and with the compute the run measured itself (its ``compute only``
pseudo-mode, split into forward, backward and step in the calibration's proportions), which
takes the machine's load changes between calibration and run out of the comparison. Memory:
the planner's optimizer state bytes against those the run reported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from pathlib import Path

import torch.distributed as dist

from benchmarks.netns import LinkConfig, link_group, parse_link, shaped_link
from sharded_opt import spawn
from sharded_opt.plan import Cluster, ComputeTimes, TrainingPlan, plan_training
from sharded_opt.plan.calibrate import Calibration, CalibrationInputs, calibrate_rank

MODES = ("ddp", "sync", "overlap")


def _rank(inputs: CalibrationInputs, link: LinkConfig | None) -> Calibration:
    group = link_group(link) if link is not None else dist.group.WORLD
    return calibrate_rank(inputs, group)


def _plan(
    run: dict, config: dict, calibration: Calibration, compute: ComputeTimes, emulated: bool
) -> TrainingPlan:
    world_size = run["world_size"]
    link = calibration.link
    cluster = Cluster(
        world_size=world_size,
        ranks_per_node=1 if emulated else world_size,
        node_link=link,
        link=link if emulated else None,
    )
    return plan_training(
        config["model"],
        "AdamW",
        cluster=cluster,
        compute=compute,
        optimizer_kwargs=config["adamw"],
        steps_per_sync=config["steady_steps"],
    )


def _from_run(calibrated: ComputeTimes, measured_s: float) -> ComputeTimes:
    """The run's own compute-only time (forward, backward, plain step), split as calibrated."""
    scale = measured_s / (calibrated.forward_s + calibrated.backward_s + calibrated.step_s)
    return ComputeTimes(
        forward_s=calibrated.forward_s * scale,
        backward_s=calibrated.backward_s * scale,
        step_s=calibrated.step_s * scale,
        sharded_step_s=calibrated.wrapper_step_s * scale,
    )


def _predicted(plan: TrainingPlan) -> dict[str, float]:
    """Each mode at the run's bucket sizes (the wrapper's defaults, DDP's)."""
    by_mode = {m.mode: m.step_s for m in plan.modes if m.mode in ("ddp", "sync")}
    by_mode["overlap"] = next(m.step_s for m in plan.bucket_sweep if m.bucket_size_mb is None)
    by_mode["comm"] = next(m.comm_s for m in plan.modes if m.mode == "sync")
    return by_mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_check", description=__doc__)
    parser.add_argument("--compare", type=Path, required=True, help="a benchmarks.compare results.json")
    parser.add_argument("--emulate-link", type=parse_link, default=None, metavar="GBPS")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    results = json.loads(args.compare.read_text())
    config, run = results["config"], results["runs"][0]
    if config["bucket_mb"] is not None:
        parser.error("plan_check compares runs at the libraries' default bucket sizes (--bucket-mb auto)")
    inputs = CalibrationInputs(
        config["model"], None, config["micro_batch"], "AdamW", config["adamw"], config["threads"]
    )
    with contextlib.ExitStack() as stack:
        link = stack.enter_context(shaped_link(args.emulate_link)) if args.emulate_link else None
        calibration = spawn(_rank, (inputs, link), nprocs=run["world_size"])[0]
    load = os.getloadavg()  # the machine is shared: how busy it was while calibrating
    measured = {mode: run["modes"][mode]["steady_median_s"] for mode in (*MODES, "comm", "compute")}
    emulated = link is not None
    own = _predicted(_plan(run, config, calibration, calibration.compute, emulated))
    from_run = _predicted(
        _plan(run, config, calibration, _from_run(calibration.compute, measured["compute"]), emulated)
    )
    plan = _plan(run, config, calibration, calibration.compute, emulated)
    compute = calibration.compute
    rows = [
        {
            "mode": mode,
            "measured_ms": measured[mode] * 1e3,
            "predicted_ms": own[mode] * 1e3,
            "error": own[mode] / measured[mode] - 1,
            "predicted_run_compute_ms": from_run[mode] * 1e3,
            "error_run_compute": from_run[mode] / measured[mode] - 1,
        }
        for mode in (*MODES, "comm")
    ]
    rows.append(
        {
            "mode": "compute",
            "measured_ms": measured["compute"] * 1e3,
            "predicted_ms": (compute.forward_s + compute.backward_s + compute.step_s) * 1e3,
            "error": (compute.forward_s + compute.backward_s + compute.step_s) / measured["compute"] - 1,
        }
    )
    state = {m.mode: m.memory.optimizer_state for m in plan.modes if m.mode in ("ddp", "sync")}
    reported = {mode: run["modes"][mode]["state_bytes_per_rank"] for mode in ("ddp", "sync")}
    print(f"calibration (load average {load[0]:.1f}): {compute}\n             {calibration.link}")
    print(
        f"{'mode':8} {'measured ms':>11} {'predicted':>9} {'error':>7} {'with run compute':>16} {'error':>7}"
    )
    for row in rows:
        tail = (
            f" {row['predicted_run_compute_ms']:16.1f} {row['error_run_compute']:+7.1%}"
            if "error_run_compute" in row
            else ""
        )
        head = f"{row['mode']:8} {row['measured_ms']:11.1f} {row['predicted_ms']:9.1f} {row['error']:+7.1%}"
        print(head + tail)
    print(f"optimizer state bytes per rank, planned {state} / reported by the run {reported}")
    if args.out is not None:
        payload = {
            "compare": str(args.compare),
            "link": dataclasses.asdict(args.emulate_link) if args.emulate_link else None,
            "calibration": {
                "compute": dataclasses.asdict(compute),
                "link": dataclasses.asdict(calibration.link),
                "load_average_1min": load[0],
            },
            "rows": rows,
            "optimizer_state_bytes": {"planned": state, "reported": reported},
        }
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
