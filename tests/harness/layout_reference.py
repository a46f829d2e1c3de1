"""The layout rules of ``fusion.layout`` restated for the layout property tests
(``tests/fusion/test_layout.py``, ``tests/fusion/test_layout_whole_params.py``): hypothesis
strategies of param lists, where a param starts after a bucket's used part, and a reference
model of bucket membership.

Expected values are worked out from the layout rules (reverse registration order, aligned
offsets for params of at least ``align_elems`` elements and dense packing of smaller ones, each
param starting where every view its byte size allows, up to 16-byte dtypes, is possible, greedy
bucket closing), not from the planner.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from fusion.layout import ParamSpec

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}
# Planning never touches memory, so devices that do not exist on this machine are fine as keys.
DEVICES = [CPU, torch.device("cuda", 0), torch.device("meta")]


def spec(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device = CPU, group: int = 0):
    return ParamSpec(tuple(shape), dtype, device, group)


def elems_per_align(dtype: torch.dtype, align_bytes: int) -> int:
    return max(1, align_bytes // ITEMSIZE[dtype])


def ceil_to(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def view_alignment(numel: int, itemsize: int) -> int:
    """Elements a param's start must be a multiple of so that it can be viewed as any dtype of
    up to 16 bytes that divides its size (``torch.view_as_complex``, ``param.view(dtype)``)."""
    alignment_bytes = 1
    while alignment_bytes < 16 and numel * itemsize % (2 * alignment_bytes) == 0 and numel > 0:
        alignment_bytes *= 2
    return max(1, alignment_bytes // itemsize)


def start_after(end: int, numel: int, align: int, itemsize: int) -> int:
    """Where a param starts after the bucket's used part: aligned if it fills an aligned block,
    else at the first offset from ``end`` where its wider views are possible."""
    block = align if numel >= align else 1
    return ceil_to(end, max(block, view_alignment(numel, itemsize)))


# --------------------------------------------------------------------------------------------
# Strategies


shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    st.integers(1, 400).map(lambda n: (n,)),
    # Zero-size params are legal tensors; they must not break the layout.
    st.lists(st.integers(0, 3), min_size=1, max_size=2).map(tuple),
)

keys = st.tuples(st.sampled_from(DTYPES), st.sampled_from(DEVICES), st.integers(0, 2))


@st.composite
def param_lists(draw):
    """Params drawn from a few (dtype, device, group) keys so that buckets fill and split."""
    palette = draw(st.lists(keys, min_size=1, max_size=4))
    entries = draw(st.lists(st.tuples(st.sampled_from(palette), shapes, st.integers(0, 3)), max_size=24))
    # About one entry in four is frozen.
    return [None if frozen == 0 else ParamSpec(shape, *key) for key, shape, frozen in entries]


world_sizes = st.integers(1, 8)
align_bytes_st = st.sampled_from([2**k for k in range(11)])
bucket_sizes = st.one_of(st.integers(1, 64), st.integers(64, 8192), st.integers(8192, 1 << 20))


# --------------------------------------------------------------------------------------------
# Reference model of the rules


def reference_buckets(
    params: list[ParamSpec | None],
    align_bytes: int,
    bucket_size_bytes: int,
    first_bucket_bytes: int | None = None,
) -> list[tuple[int, ...]]:
    """Bucket membership per the stated rules, as tuples of param indices in layout order. The
    first bucket of each key is bounded by ``first_bucket_bytes`` (default: the same size)."""
    first_keys: set[tuple] = set()
    open_groups: dict[tuple, list[int]] = {}
    open_end: dict[tuple, int] = {}
    done: list[list[int]] = []
    for index in range(len(params) - 1, -1, -1):
        p = params[index]
        if p is None:
            continue
        key = (p.dtype, p.device, p.group_index)
        align = elems_per_align(p.dtype, align_bytes)
        members = open_groups.get(key)
        if members is not None:
            numel = math.prod(p.shape)
            end_if_added = start_after(open_end[key], numel, align, ITEMSIZE[p.dtype]) + numel
            limit = bucket_size_bytes
            if key not in first_keys and first_bucket_bytes is not None:
                limit = first_bucket_bytes
            if end_if_added * ITEMSIZE[p.dtype] > limit:
                first_keys.add(key)
                done.append(members)
                members = None
        if members is None:
            members = open_groups[key] = []
            open_end[key] = 0
        members.append(index)
        numel = math.prod(p.shape)
        open_end[key] = start_after(open_end[key], numel, align, ITEMSIZE[p.dtype]) + numel
    done.extend(open_groups.values())
    # Layout position grows as the registration index shrinks.
    done.sort(key=lambda members: -members[0])
    return [tuple(members) for members in done]
