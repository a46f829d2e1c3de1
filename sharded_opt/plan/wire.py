"""Bytes one rank sends per collective of a bucket, as ``ShardingStage1.wire_bytes()`` counts them.

The exact collectives send ``(g - 1) / g`` of what they cover in the dtype that travels
(``cost.wire_bytes``): the reduce-scatter the grad buffer in the params' dtype (on CPU gloo,
which the planner models, 16-bit grads travel as they are and are widened on receipt, Note
[Widening on receipt] in ``sharded_opt/comm/collectives.py``), the all-gather the params, and
hybrid sharding's ring all-reduce of the shard across replicas twice that, in the reduce dtype.
A compressed collective sends one row of its codec to each of the ``g - 1`` peers
(``compression.payload_bytes``, Note [Compressed wire] in ``sharded_opt/comm/compression.py``):
the grads' exchange and the param deltas' all-gather over the shard group, and with hybrid
sharding the replicas' average, an all-gather of codes, over the replicate group. The codecs
are the wrapper's own (``bucket_wire.grad_codec``, ``compression.make_codec``), so the rows are
theirs. Encoding and decoding is compute the planner does not model: a collective costs its
rounds and the bytes it sends (``cost``), and the step's compute is stated or calibrated without
it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fusion.layout import BucketPlan
from sharded_opt.comm import compression
from sharded_opt.comm.bucket_wire import grad_codec
from sharded_opt.plan.config import Collective
from sharded_opt.plan.cost import wire_bytes
from sharded_opt.step.local_shard import BucketPrecision


@dataclass(frozen=True, slots=True)
class Payload:
    """One collective as the cost model sees it: which one it is costed as, and what one rank
    sends in it."""

    kind: Collective
    sent: int


NO_PAYLOAD = Payload("all_gather", 0)


@dataclass(frozen=True, slots=True)
class BucketPayloads:
    """A bucket's collectives in one step."""

    grads: Payload
    """Its grad reduction: a reduce-scatter over the shard group (compressed: an exchange of
    codes, costed as the reduce-scatter's all-to-all it replaces)."""
    replicas: Payload
    """The average of its shard across the replicate group (hybrid sharding), else nothing."""
    params: Payload
    """The all-gather of its updated shard (compressed: of int8 deltas)."""


@dataclass(frozen=True, slots=True)
class StepWire:
    """Bytes one rank sends in one step, by the keys of ``ShardingStage1.wire_bytes()``."""

    grads: int = 0
    params: int = 0
    replicas: int = 0

    @property
    def total(self) -> int:
        return self.grads + self.params + self.replicas

    def as_report(self) -> dict[str, int]:
        """In the form of ``ShardingStage1.wire_bytes()`` (its difference over one step)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}

    @classmethod
    def of(cls, buckets: list[BucketPayloads]) -> StepWire:
        """One step of ``buckets`` (every bucket that takes part)."""
        return cls(
            grads=sum(b.grads.sent for b in buckets),
            params=sum(b.params.sent for b in buckets),
            replicas=sum(b.replicas.sent for b in buckets),
        )


def bucket_wire(
    bucket: BucketPlan,
    precision: BucketPrecision,
    shard_size: int,
    replicate_size: int,
    grad_compression: str | None,
    param_compression: str | None,
) -> BucketPayloads:
    """What one rank sends for ``bucket`` in one step, in a shard group of ``shard_size`` ranks
    and a replicate group of ``replicate_size`` (1: no hybrid sharding). The compression settings
    are ``ShardingConfig``'s; they take effect on a sharded group only, as in the wrapper."""
    if shard_size == 1:
        grad_compression = param_compression = None
    shard_numel = bucket.shard_numel
    codec = grad_codec(grad_compression, shard_numel, bucket.dtype)
    if codec is None:
        grads = Payload("reduce_scatter", wire_bytes("reduce_scatter", _nbytes(bucket), shard_size))
    else:
        grads = Payload("reduce_scatter", compression.payload_bytes(codec, shard_size))
    replicas = NO_PAYLOAD
    if replicate_size > 1 and grad_compression is not None:
        codec = compression.make_codec(grad_compression, shard_numel)
        replicas = Payload("all_gather", compression.payload_bytes(codec, replicate_size))
    elif replicate_size > 1:
        shard_bytes = shard_numel * precision.reduce_dtype.itemsize
        replicas = Payload("all_reduce", wire_bytes("all_reduce", shard_bytes, replicate_size))
    if param_compression is None:
        params = Payload("all_gather", wire_bytes("all_gather", _nbytes(bucket), shard_size))
    else:
        codec = compression.make_codec(param_compression, shard_numel)
        params = Payload("all_gather", compression.payload_bytes(codec, shard_size))
    return BucketPayloads(grads, replicas, params)


def _nbytes(bucket: BucketPlan) -> int:
    return bucket.padded_numel * bucket.dtype.itemsize
