"""Where the main job runs its comparison, and what its numbers tell a user to do.

Both parts are pure, so the tests check them without starting a rank:

- :func:`choose_setting` picks the setting of the default run: the machine's accelerators when
  there is one per rank (NCCL and real streams), else CPU ranks on an emulated link between two
  network namespaces when the machine allows it (root, ``ip``, ``tc``), else CPU ranks on
  loopback; with the reason, printed at the start of the run.
- :func:`verdict` reads one run's medians (communication alone, compute alone, sync, overlap,
  DDP) and says which mode to use on this machine and why, in a few lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from benchmarks.modes import COMM_ONLY, COMPUTE_ONLY

DEFAULT_LINK_GBPS = 0.2
"""The rate of the default run's emulated link, in Gbit/s. On the default GPT (3.3M params) the
step's reduce-scatters and all-gathers then take about 0.6 s against about 0.25 s of compute on
an idle 2-core machine: communication a network between nodes would cost, which overlap can hide
at most compute's worth of (benchmarks/results/2026-12-05-compiled-waits-cpu-2core.md)."""

NOISE_FRACTION = 0.03
"""Step time differences under 3 % of the step are read as a tie: on a shared CPU machine two
medians of the same mode differ by about that much from run to run."""

LITTLE_COMM_FRACTION = 0.15
"""Communication under 15 % of compute leaves overlap little to hide: at best that share of the
step, less than the noise of a busy machine."""

CONSISTENT_FRACTION = 0.10
"""Sync runs compute and then communication, so its step should take about compute alone plus
communication alone; 10 % off means the load on the machine changed between the modes' blocks
(on an idle machine the two agreed within 1 %, benchmarks/results/2026-12-05-compiled-waits-cpu-2core.md
and 2026-12-06-loopback-overlap-cpu-2core.md)."""

SettingKind = Literal["accelerator", "link", "loopback"]


@dataclass(frozen=True, slots=True)
class Setting:
    """Where the default run goes, and why there."""

    kind: SettingKind
    reason: str
    gbps: float | None = None
    """The emulated link's rate (``kind == "link"`` only)."""

    def where(self) -> str:
        """A few words for the verdict's heading."""
        if self.kind == "link":
            return f"CPU ranks, emulated {self.gbps * 1000:g} Mbit/s link"
        return "accelerators" if self.kind == "accelerator" else "CPU ranks, loopback"

    def describe(self) -> str:
        """The line the run starts with: where it runs and why."""
        if self.kind == "accelerator":
            where = "accelerators (one per rank, the device's own collective backend)"
        elif self.kind == "link":
            where = (
                f"CPU ranks on an emulated {self.gbps * 1000:g} Mbit/s link (two network namespaces "
                "joined by a veth pair, rate shaped with tc tbf, no added latency)"
            )
        else:
            where = "CPU ranks on loopback"
        return f"Running on {where}: {self.reason}."


def choose_setting(
    *,
    accelerator_type: str | None,
    device_count: int,
    world_size: int,
    link_unavailable: str | None,
) -> Setting:
    """The default run's setting on this machine.

    Args:
        accelerator_type: ``"cuda"``, ``"xpu"``, ... ; None on a machine without one.
        device_count: visible accelerator devices.
        world_size: ranks of the run.
        link_unavailable: why an emulated link cannot be built here
            (:func:`benchmarks.netns.link_unavailable_reason`), or None if it can.
    """
    if accelerator_type is not None and device_count >= world_size:
        return Setting("accelerator", f"{device_count} {accelerator_type} device(s) for {world_size} ranks")
    cpu_why = (
        f"{device_count} {accelerator_type} device(s) for {world_size} ranks, and two ranks cannot share "
        "one device's collectives, so the ranks run on CPU; "
        if accelerator_type is not None
        else "no accelerator; "
    )
    if link_unavailable is None:
        return Setting(
            "link",
            cpu_why + "loopback would cost communication almost nothing, a link between nodes does not",
            DEFAULT_LINK_GBPS,
        )
    return Setting(
        "loopback",
        cpu_why + f"no emulated link ({link_unavailable}), so communication costs loopback memcpy "
        "only and overlap has little to hide",
    )


@dataclass(frozen=True, slots=True)
class StepTimes:
    """One timing method's medians of one run, in seconds (None: the mode did not run)."""

    sync: float
    overlap: float
    comm: float
    compute: float
    ddp: float | None = None


def step_times(run: dict, key: str) -> StepTimes | None:
    """The medians under ``key`` (``median_s``, ``steady_median_s``) of a run, or None when one
    of sync, overlap and the two pseudo-modes did not run."""
    modes = run["modes"]
    needed = ("sync", "overlap", COMM_ONLY, COMPUTE_ONLY)
    if any(name not in modes or key not in modes[name] for name in needed):
        return None
    ddp = modes.get("ddp", {}).get(key)
    return StepTimes(
        modes["sync"][key], modes["overlap"][key], modes[COMM_ONLY][key], modes[COMPUTE_ONLY][key], ddp
    )


def verdict(times: StepTimes, setting: SettingKind, block: StepTimes | None = None) -> list[str]:
    """What to use here, from the measured step times: a few lines a user can act on.

    ``times`` decides (the steady medians); ``block``, the short blocks' medians of the same
    run, only adds a caution where it points the other way."""
    comm_share = times.comm / times.compute
    saved = times.sync - times.overlap
    ratio = f"overlap/sync {times.overlap / times.sync:.2f}"
    compute_ms, comm_ms = times.compute * 1e3, times.comm * 1e3
    lines = [
        f"Measured per step: compute {compute_ms:.0f} ms, communication alone {comm_ms:.0f} ms "
        f"({comm_share:.0%} of compute); sync {times.sync * 1e3:.0f} ms, "
        f"overlap {times.overlap * 1e3:.0f} ms."
    ]
    if saved > NOISE_FRACTION * times.sync:
        lines.append(
            f"Use overlap=True, model=model here: it hid {saved * 1e3:.0f} ms of communication per step "
            f"({ratio})."
        )
    elif comm_share < LITTLE_COMM_FRACTION:
        lines.append(
            "Either mode: communication is too small a part of the step for overlap to matter "
            f"({ratio}). Sync is the simpler one (no model= to pass)."
        )
    elif saved < -NOISE_FRACTION * times.sync:
        lines.append(
            f"Use sync (the default) here: overlap was slower ({ratio})"
            + ("; gloo's reductions ran on the backward's cores." if setting == "loopback" else ".")
        )
    else:
        lines.append(f"Either mode: overlap hid no more than the noise ({ratio}); sync is the simpler one.")
    if times.ddp is not None:
        faster = "faster" if times.overlap < times.ddp else "slower"
        lines.append(
            f"Against DDP: overlap/DDP {times.overlap / times.ddp:.2f} ({faster}), with 1/N of the "
            "optimizer state per rank (column state MiB)."
        )
    caution = _caution(times, block)
    if caution:
        lines.append(caution)
    if setting == "loopback":
        lines.append(
            "Loopback understates communication: between nodes it costs network time. To see that "
            "here, run as root with --emulate-link GBPS (your link's rate)."
        )
    return lines


def _pick(times: StepTimes) -> int:
    """-1 overlap faster, 0 a tie, 1 sync faster (beyond the noise)."""
    saved = times.sync - times.overlap
    return -1 if saved > NOISE_FRACTION * times.sync else 1 if saved < -NOISE_FRACTION * times.sync else 0


def _caution(times: StepTimes, block: StepTimes | None) -> str | None:
    """Why the measurement may not hold: overlap saved more than communication alone costs (so
    compute differed between modes: a busy machine), or the short blocks disagree."""
    reasons = []
    expected = times.compute + times.comm
    if abs(times.sync - expected) > CONSISTENT_FRACTION * times.sync:
        reasons.append(
            f"sync took {times.sync * 1e3:.0f} ms against {expected * 1e3:.0f} ms of compute plus "
            "communication alone, so the load on the machine changed during the run"
        )
    elif times.sync - times.overlap > (1 + NOISE_FRACTION) * times.comm:
        reasons.append("overlap saved more than communication alone takes, so the load on the machine moved")
    if block is not None and _pick(block) * _pick(times) < 0:
        reasons.append(f"the short blocks say the opposite (overlap/sync {block.overlap / block.sync:.2f})")
    if not reasons:
        return None
    return "Caution: " + "; ".join(reasons) + ". Rerun on a quieter machine to confirm."
