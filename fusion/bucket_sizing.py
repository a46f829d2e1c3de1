"""Bucket sizes derived from the model when the user sets none.

Note [Bucket sizes from the model]
    One fixed size cannot serve every model: DDP's 25 MiB makes a model under ~6M fp32 params
    one bucket, whose reduction can only start once backward has ended, so overlap hides
    nothing; a small fixed size makes a billion-param model thousands of collectives, each with
    its fixed launch cost. The default therefore follows the model's trainable bytes T:

    - the first bucket (the one backward fills first) is T / ``TARGET_NUM_BUCKETS`` but at most
      ``FIRST_BUCKET_BYTES``, as in DDP, so communication starts early in backward (see Note
      [First bucket] in fusion/layout.py);
    - the other buckets share the rest evenly so that the model gets ``TARGET_NUM_BUCKETS``
      buckets: each is ceil((T - first) / (TARGET_NUM_BUCKETS - 1)) bytes;
    - no bucket bound is above ``MAX_BUCKET_BYTES`` (DDP's cap: large models get more buckets,
      each still amortizing its launch) or below ``MIN_BUCKET_BYTES`` (tiny models get fewer
      buckets, since there a collective's fixed cost outweighs its bytes).

    A param larger than its bucket's bound still gets a bucket of its own, so models made of
    few large params get fewer buckets than the target.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusion.layout import ParamSpec

MIB = 2**20

FIRST_BUCKET_BYTES = 1 * MIB
"""DDP's first-bucket size: small enough to be ready after the last layer's backward."""

MAX_BUCKET_BYTES = 25 * MIB
"""DDP's default bucket cap; beyond it a bucket adds latency without amortizing more."""

MIN_BUCKET_BYTES = 64 * 2**10
"""Below this a collective's fixed cost (tens of microseconds on gloo, a kernel launch and a
handshake on NCCL) outweighs the time its bytes take."""

TARGET_NUM_BUCKETS = 8
"""Enough buckets that all but the last one's reduction can run behind the rest of backward."""


@dataclass(frozen=True, slots=True)
class BucketSizes:
    """The two bounds :func:`fusion.layout.plan_layout` takes, in bytes."""

    first_bucket_bytes: int
    bucket_bytes: int


def trainable_bytes(params: list[ParamSpec | None]) -> int:
    """Bytes of the params that take part in communication (laid out and requiring grad)."""
    return sum(spec.numel * spec.dtype.itemsize for spec in params if spec is not None and spec.requires_grad)


def default_bucket_sizes(total_bytes: int) -> BucketSizes:
    """Bucket bounds for a model of ``total_bytes`` trainable bytes; see Note [Bucket sizes from
    the model].

    Raises:
        ValueError: ``total_bytes`` is negative.
    """
    if total_bytes < 0:
        raise ValueError(f"default_bucket_sizes expects total_bytes >= 0 but got {total_bytes}")
    first_bytes = min(FIRST_BUCKET_BYTES, max(MIN_BUCKET_BYTES, _ceil_div(total_bytes, TARGET_NUM_BUCKETS)))
    even_share = _ceil_div(max(0, total_bytes - first_bytes), TARGET_NUM_BUCKETS - 1)
    bucket_bytes = min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, even_share))
    return BucketSizes(first_bytes, bucket_bytes)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)
