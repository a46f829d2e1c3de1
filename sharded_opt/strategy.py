"""Public configuration: ``Strategy().sharding`` selects what the wrapper does."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from fusion.bucket_sizing import BucketSizes, default_bucket_sizes
from fusion.layout import DEFAULT_ALIGN_BYTES


@dataclass(kw_only=True, slots=True)
class ShardingConfig:
    """How optimizer state and communication are laid out.

    Every field is checked whenever it is set, so ``strategy.sharding.enable_overlap = 1`` fails
    at that line rather than deep inside a training step.
    """

    enable: bool = True
    """Shard optimizer state across the process group (ZeRO stage 1). False keeps full
    optimizer state on every rank and all-reduces grads: plain data parallel through the same
    wrapper, useful as a baseline."""

    degree: int | None = None
    """Ranks per shard group (hybrid sharding): each bucket is split over ``degree`` consecutive
    ranks and replicated across the ``world_size / degree`` groups, so all-gathers and
    reduce-scatters stay within a group (a node) and only an all-reduce of each rank's 1/degree
    shard crosses between groups. Optimizer state per rank is S/degree instead of S/world_size.
    None shards over the whole process group. Must divide the world size (checked when the
    wrapper is built). See Note [Hybrid sharding] in ``sharded_opt/comm/hybrid_groups.py``."""

    enable_overlap: bool = False
    """Reduce each bucket's grads as soon as backward has produced them, and all-gather updated
    params while the next forward runs. False communicates inside ``step()`` only."""

    bucket_size_mb: float | None = None
    """Upper bound of one flat bucket in MiB (a larger param gets a bucket of its own), the same
    for every bucket. None sizes buckets from the model: a first bucket of at most 1 MiB so
    communication starts early in backward, the rest sized so the model gets about 8 buckets,
    each between 64 KiB and 25 MiB (see Note [Bucket sizes from the model] in
    fusion/bucket_sizing.py). Smaller buckets start communicating earlier and hide more of it;
    each costs a collective's fixed latency."""

    align_bytes: int = DEFAULT_ALIGN_BYTES
    """Start alignment of each shard, and of each param of at least this many bytes (smaller ones
    are packed densely), in bytes; a power of two."""

    reduce_dtype: torch.dtype | None = None
    """Dtype grads are averaged in. None: fp32 for 16-bit params (bf16 sums lose precision
    quickly), the params' own dtype otherwise. Complex params always use their own dtype."""

    master_dtype: torch.dtype | None = None
    """Dtype of the copy of the local shard that the optimizer steps, e.g. ``torch.float32``
    for bf16 params. None: step the params' own dtype, no copy. Complex params get no copy."""

    gloo_point_to_point: bool = False
    """On gloo with CPU tensors, run each bucket's reduce-scatter and all-gather as point-to-point
    messages posted at once instead of gloo's all-to-all and all-gather. On an emulated slow
    link each collective alone gained little and still did not reach the wire limit, since with
    many buckets in flight gloo's collectives already overlap each other's directions, and a
    full training step on that link (``--preset comm-bound``) was slower with it. On one
    machine it costs the training thread time (gloo posts and copies the messages there). So it
    is off; it may help only where a single collective in flight per direction limits the link
    (not measured). See Note [Reduce-scatter on gloo] in ``sharded_opt/comm/collectives.py``; the
    numbers are in ``benchmarks/results/2026-12-03-gloo-p2p-cpu-2core.md`` and
    ``benchmarks/results/2026-12-03-presence-group-cpu-2core.md``."""

    grad_compression: str | None = None
    """What each bucket's grads are sent as in the reduce-scatter: None (the default) sends them
    as they are, exact; ``"bf16"`` rounds each element to bf16 (half of fp32's bytes);
    ``"int8"`` sends block-wise absmax int8 codes with one fp32 scale per block (about a quarter
    of fp32's bytes). Each element is quantized once, by its sender, and the owner dequantizes
    the received slices and sums them in fp32 in rank order, so the result is the same on every
    run and in sync and overlap mode. See Note [Compressed wire] in
    ``sharded_opt/comm/compression.py`` and ``docs/compression.md``."""

    param_compression: str | None = None
    """What the all-gather of updated params sends: None (the default) sends the params as they
    are; ``"int8"`` sends block-wise int8 deltas against the params every rank holds. The owner
    keeps an exact master of its shard, and every rank, the owner included, adds the same
    dequantized delta, so all ranks hold bitwise the same params and trail the master by at most
    one step's quantization error (the next delta carries it). Costs a master copy and a copy of
    the last sent params of the local shard. See Note [Compressed wire]."""

    grad_error_feedback: bool = False
    """With ``grad_compression``: carry each step's rounding error of the grads a rank sends
    into its next reduction (error feedback). Each rank keeps an fp32 residual of the elements
    it sends to its peers, (N-1)/N of every compressed bucket (4 bytes per param at large N,
    ``memory_bytes()["grad_residual"]``), adds it to those grads before encoding them and keeps
    what the codes missed. Not saved in checkpoints; refused with hybrid sharding (``degree``).
    See Note [Error feedback] in ``sharded_opt/comm/compression.py``."""

    broadcast_buffers: bool = True
    """DDP's option of the same name: with a model attached, copy every buffer (BatchNorm's
    running statistics, ...) from the group's first rank before each forward with grad enabled,
    so all ranks normalize alike. Costs one synchronous broadcast per forward of all buffers
    (one per dtype); a model without buffers issues none. False leaves each rank its own."""
    collective_entry_timeout_s: float | None = None
    """How long ``state_dict``, ``load_state_dict``, ``save_checkpoint`` and ``load_checkpoint``
    wait for every rank to call them before they raise an error naming the ranks that did not
    (on gloo groups). None: the process group's own timeout. See Note [Collectives entered by
    some ranks] in ``collective_guard``."""

    def __setattr__(self, name: str, value: Any) -> None:
        _check_field(name, value)
        object.__setattr__(self, name, value)

    def bucket_sizes(self, trainable_bytes: int) -> BucketSizes:
        """Byte bounds of the first and the other buckets for a model of ``trainable_bytes``."""
        if self.bucket_size_mb is None:
            return default_bucket_sizes(trainable_bytes)
        size_bytes = max(1, int(self.bucket_size_mb * 2**20))
        return BucketSizes(size_bytes, size_bytes)


@dataclass(kw_only=True, slots=True)
class Strategy:
    """Top-level distributed strategy; today it has one section, ``sharding``."""

    sharding: ShardingConfig = field(default_factory=ShardingConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.sharding, ShardingConfig):
            raise TypeError(
                f"Strategy expects sharding to be a ShardingConfig but got {type(self.sharding).__name__}"
            )


COMPRESSION_CHOICES: dict[str, tuple[str | None, ...]] = {
    "grad_compression": (None, "bf16", "int8"),
    "param_compression": (None, "int8"),
}


_BOOL_FIELDS = ("enable", "enable_overlap", "broadcast_buffers", "gloo_point_to_point", "grad_error_feedback")


def _check_field(name: str, value: Any) -> None:
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ValueError(
                f"Strategy.sharding.{name} expects a bool but got {value!r} ({type(value).__name__})"
            )
    elif name == "bucket_size_mb":
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not value > 0
            or not math.isfinite(value)
        ):
            raise ValueError(
                "Strategy.sharding.bucket_size_mb expects a number > 0 (finite), or None to size "
                f"buckets from the model, but got {value!r}"
            )
    elif name == "degree":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                "Strategy.sharding.degree expects None (shard over every rank) or an int >= 1 "
                f"(ranks per shard group, e.g. the GPUs of one node) but got {value!r}"
            )
    elif name == "align_bytes":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"Strategy.sharding.align_bytes expects a power of two >= 1 but got {value!r}")
    elif name == "collective_entry_timeout_s":
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
        ):
            raise ValueError(
                f"Strategy.sharding.collective_entry_timeout_s expects None or a finite number of "
                f"seconds > 0 but got {value!r}"
            )
    elif name in COMPRESSION_CHOICES:
        if value not in COMPRESSION_CHOICES[name]:
            accepted = ", ".join(repr(choice) for choice in COMPRESSION_CHOICES[name])
            raise ValueError(f"Strategy.sharding.{name} expects one of {accepted} but got {value!r}")
    elif name in ("reduce_dtype", "master_dtype"):
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise ValueError(
                f"Strategy.sharding.{name} expects None or a floating torch.dtype but got {value!r}"
            )
    elif name not in {f.name for f in fields(ShardingConfig)}:
        raise AttributeError(f"Strategy.sharding has no setting {name!r}")
