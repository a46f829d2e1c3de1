"""Tests for ``fusion.buffers.FlatBuffers``: params and grads become views into flat buckets."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusion.buffers import FlatBuffers, flatten_to_slot, view_slot
from fusion.layout import LayoutPlan, ParamSpec, plan_layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def make_param(*shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # Values away from zero, so "padding is zero" cannot pass by accident of the data.
    values = torch.rand(shape, generator=gen, dtype=torch.float64) + 1.0
    return torch.nn.Parameter(values.to(dtype), requires_grad=requires_grad)


def plan_for(
    params, world_size: int, *, groups=None, align_bytes: int = 256, bucket_size_bytes: int = 1 << 20
):
    groups = groups or [0] * len(params)
    specs = [ParamSpec.of(p, g) if p.requires_grad else None for p, g in zip(params, groups, strict=True)]
    return plan_layout(specs, world_size, align_bytes=align_bytes, bucket_size_bytes=bucket_size_bytes)


def wrap(params, world_size: int = 2, **kwargs) -> tuple[LayoutPlan, FlatBuffers]:
    plan = plan_for(params, world_size, **kwargs)
    return plan, FlatBuffers(plan, params)


def buffer_region(buffers: list[torch.Tensor], plan: LayoutPlan, index: int) -> torch.Tensor:
    slot = plan.slot(index)
    return buffers[slot.bucket_index][slot.offset : slot.offset + slot.numel]


def is_view_at(tensor: torch.Tensor, buffer: torch.Tensor, offset: int) -> bool:
    return (
        tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and tensor.data_ptr() == buffer.data_ptr() + offset * buffer.element_size()
    )


def mixed_params():
    return [
        make_param(3, 5, seed=1),
        make_param(seed=2),  # scalar
        make_param(7, dtype=torch.bfloat16, seed=3),
        make_param(2, 2, requires_grad=False, seed=4),  # frozen
        make_param(1, dtype=torch.float16, seed=5),
        make_param(4, 3, 2, dtype=torch.float64, seed=6),
        make_param(11, seed=7),
    ]


# --------------------------------------------------------------------------------------------
# Construction


def test_values_shapes_and_views_after_wrapping():
    params = mixed_params()
    before = [p.detach().clone() for p in params]
    plan, flat = wrap(params, world_size=3)
    for index, p in enumerate(params):
        assert torch.equal(p.detach(), before[index])
        assert p.dtype == before[index].dtype
        assert p.shape == before[index].shape
        if plan.slots[index] is None:
            continue
        slot = plan.slot(index)
        assert p.is_contiguous()
        assert is_view_at(p.data, flat.param_buffers[slot.bucket_index], slot.offset)
        assert is_view_at(p.grad, flat.grad_buffers[slot.bucket_index], slot.offset)
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype and p.grad.is_contiguous()
        assert flat.param_views[index] is not None and flat.param_views[index].data_ptr() == p.data_ptr()
        assert flat.grad_views[index] is p.grad
        assert torch.equal(buffer_region(flat.param_buffers, plan, index), before[index].reshape(-1))
        assert not p.grad.any()


def test_buffers_match_plan():
    params = mixed_params()
    plan, flat = wrap(params, world_size=4, bucket_size_bytes=64)
    assert len(flat.param_buffers) == len(flat.grad_buffers) == len(plan.buckets)
    for bucket, pbuf, gbuf in zip(plan.buckets, flat.param_buffers, flat.grad_buffers, strict=True):
        for buf in (pbuf, gbuf):
            assert buf.dim() == 1
            assert buf.numel() == bucket.padded_numel
            assert buf.dtype == bucket.dtype
            assert buf.device == bucket.device
            assert buf.is_contiguous()
        assert pbuf.data_ptr() != gbuf.data_ptr()
    assert flat.laid_out_indices == [s.param_index for b in plan.buckets for s in b.slots]


def test_padding_is_zero():
    params = mixed_params()
    for p in params:
        if p.requires_grad:
            p.grad = torch.full_like(p, 3.0)
    plan, flat = wrap(params, world_size=3)
    for bucket, pbuf, gbuf in zip(plan.buckets, flat.param_buffers, flat.grad_buffers, strict=True):
        padding = torch.ones(bucket.padded_numel, dtype=torch.bool)
        for slot in bucket.slots:
            padding[slot.offset : slot.offset + slot.numel] = False
        assert padding.any()
        assert not pbuf[padding].any()
        assert not gbuf[padding].any()


def test_existing_grad_is_copied_in():
    params = mixed_params()
    grads = {}
    for index, p in enumerate(params):
        if p.requires_grad and index % 2 == 0:
            grads[index] = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape).to(p.dtype) + 1
            p.grad = grads[index].clone()
    plan, flat = wrap(params)
    for index, p in enumerate(params):
        if plan.slots[index] is None:
            continue
        assert p.grad is flat.grad_views[index]
        if index in grads:
            assert torch.equal(p.grad, grads[index])
            assert torch.equal(buffer_region(flat.grad_buffers, plan, index), grads[index].reshape(-1))
        else:
            assert not p.grad.any()


def test_dense_non_contiguous_params_keep_their_strides():
    """channels_last and transposed params keep their memory format: their slot holds them in
    memory order, and param and grad are strided views of it."""
    conv = torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    transposed = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4).t())
    params = [conv, transposed]
    expected = [p.detach().clone() for p in params]
    memory_order = [p.detach().as_strided((p.numel(),), (1,)).clone() for p in params]
    strides = [p.stride() for p in params]
    plan, flat = wrap(params, world_size=2)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    for index, p in enumerate(params):
        slot = plan.slot(index)
        assert p.stride() == strides[index] and p.grad.stride() == strides[index]
        assert torch.equal(p.detach(), expected[index])
        assert is_view_at(p.data, flat.param_buffers[slot.bucket_index], slot.offset)
        assert is_view_at(p.grad, flat.grad_buffers[slot.bucket_index], slot.offset)
        assert torch.equal(buffer_region(flat.param_buffers, plan, index), memory_order[index])
        assert torch.equal(flatten_to_slot(expected[index], slot), memory_order[index])
        assert torch.equal(view_slot(memory_order[index], slot), expected[index])
        assert view_slot(memory_order[index], slot).stride() == strides[index]


def test_a_grad_of_another_shape_than_the_param_is_not_copied_in():
    """``param.data = t`` of another shape (``resize_token_embeddings``) leaves a grad of the
    old shape behind; a new layout of the param must not try to copy it in."""
    param = torch.nn.Parameter(torch.ones(4, 3))
    param.grad = torch.full((4, 3), 2.0)
    param.data = torch.ones(6, 3)
    _, flat = wrap([param])
    assert param.grad is flat.grad_views[0]
    assert param.grad.shape == (6, 3) and not param.grad.any()


def test_a_newer_layout_of_the_same_params_owns_them():
    """A wrapper built over params an older, still alive wrapper laid out takes them over; a
    copy of a param is laid out nowhere, and a saved param still loads with weights_only."""
    param = torch.nn.Parameter(torch.ones(4, 3))
    _, older = wrap([param])
    _, newer = wrap([param])
    assert newer.owns(0) and not older.owns(0)
    buffer = io.BytesIO()
    torch.save(param, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True), param)


def test_backward_into_a_channels_last_grad_keeps_it_in_place():
    weight = torch.nn.Parameter(torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last))
    reference = weight.detach().clone().requires_grad_(True)
    plan, flat = wrap([weight], world_size=2)
    inputs = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    for _ in range(2):
        torch.nn.functional.conv2d(inputs, weight).square().sum().backward()
        torch.nn.functional.conv2d(inputs, reference).square().sum().backward()
    assert weight.grad is flat.grad_views[0]
    torch.testing.assert_close(weight.grad, reference.grad)
    torch.testing.assert_close(
        buffer_region(flat.grad_buffers, plan, 0), flatten_to_slot(reference.grad, plan.slot(0))
    )


def test_non_dense_param_is_copied_as_contiguous_values():
    p = torch.nn.Parameter(torch.arange(24.0).reshape(4, 6)[:, ::2])
    expected = p.detach().clone()
    assert not p.is_contiguous()
    _, flat = wrap([p], world_size=1)
    assert p.is_contiguous()
    assert p.shape == (4, 3)
    assert torch.equal(p.detach(), expected)
    assert torch.equal(flat.param_buffers[0][:12], expected.reshape(-1))


def test_frozen_params_are_untouched():
    params = mixed_params()
    frozen = params[3]
    ptr, storage_ptr, value = frozen.data_ptr(), frozen.untyped_storage().data_ptr(), frozen.detach().clone()
    plan, flat = wrap(params)
    assert plan.slots[3] is None
    assert frozen.data_ptr() == ptr
    assert frozen.untyped_storage().data_ptr() == storage_ptr
    assert torch.equal(frozen.detach(), value)
    assert frozen.grad is None
    assert flat.param_views[3] is None and flat.grad_views[3] is None
    assert 3 not in flat.laid_out_indices
    for buf in flat.param_buffers:
        assert buf.untyped_storage().data_ptr() != storage_ptr
    flat.zero_grad()
    assert frozen.grad is None
    frozen.data = torch.zeros_like(frozen)
    assert 3 not in flat.detached_params()


def test_param_count_must_match_plan():
    params = mixed_params()
    plan = plan_for(params, 2)
    with pytest.raises(ValueError, match=r"FlatBuffers expects 7 params \(one per planned slot\) but got 6"):
        FlatBuffers(plan, params[:-1])


# --------------------------------------------------------------------------------------------
# Shards


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_shards_are_slices_of_the_buffers(world_size):
    params = mixed_params()
    for p in params:
        if p.requires_grad:
            p.grad = -p.detach().clone()
    plan, flat = wrap(params, world_size=world_size, align_bytes=8, bucket_size_bytes=48)
    for b, bucket in enumerate(plan.buckets):
        size = bucket.padded_numel // world_size
        for rank in range(world_size):
            pshard = flat.param_shard(b, rank)
            gshard = flat.grad_shard(b, rank)
            for shard, buf in ((pshard, flat.param_buffers[b]), (gshard, flat.grad_buffers[b])):
                assert shard.shape == (size,)
                assert is_view_at(shard, buf, rank * size)
                assert torch.equal(shard, buf[rank * size : (rank + 1) * size])
            # The plan's pieces name exactly the param elements found in the shard.
            for piece in bucket.shard_pieces(rank):
                p = params[piece.param_index]
                got = pshard[piece.shard_start : piece.shard_start + piece.numel]
                want = p.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel]
                assert torch.equal(got, want)
                got = gshard[piece.shard_start : piece.shard_start + piece.numel]
                assert torch.equal(got, -want)


def test_writes_through_a_shard_reach_the_params():
    params = [make_param(64, seed=1), make_param(3, seed=2)]
    plan, flat = wrap(params, world_size=3)
    # 64-element alignment: param 1 at [0, 3), param 0 at [64, 128); shards of 64.
    flat.param_shard(0, 1).fill_(7.0)
    flat.grad_shard(0, 0).fill_(5.0)
    assert torch.equal(params[0].detach(), torch.full((64,), 7.0))
    assert torch.equal(params[1].grad, torch.full((3,), 5.0))
    assert not params[0].grad.any()


# --------------------------------------------------------------------------------------------
# Grad bookkeeping


def test_zero_grad_is_in_place_and_reattaches():
    params = mixed_params()
    plan, flat = wrap(params)
    for p in params:
        if p.requires_grad:
            p.grad.fill_(2.0)
    buffer_ptrs = [g.data_ptr() for g in flat.grad_buffers]
    buffer_ids = [id(g) for g in flat.grad_buffers]
    params[0].grad = None  # what model.zero_grad() does
    params[2].grad = torch.ones_like(params[2])  # a foreign grad
    flat.zero_grad()
    assert [g.data_ptr() for g in flat.grad_buffers] == buffer_ptrs
    assert [id(g) for g in flat.grad_buffers] == buffer_ids
    for g in flat.grad_buffers:
        assert not g.any()
    for index in flat.laid_out_indices:
        assert params[index].grad is flat.grad_views[index]
    # Params are not touched by zero_grad.
    assert all(p.detach().abs().min() >= 1 for p in params)


def test_adopt_grad_none_zeroes_the_view():
    params = mixed_params()
    _, flat = wrap(params)
    view = flat.grad_views[0]
    view.fill_(4.0)
    params[0].grad = None
    assert flat.adopt_grad(0) is True
    assert params[0].grad is view
    assert not view.any()


def test_adopt_grad_copies_a_foreign_tensor():
    params = mixed_params()
    plan, flat = wrap(params)
    view = flat.grad_views[5]
    foreign = torch.randn(params[5].shape, dtype=params[5].dtype)
    params[5].grad = foreign
    assert flat.adopt_grad(5) is True
    assert params[5].grad is view
    assert torch.equal(view, foreign)
    assert torch.equal(buffer_region(flat.grad_buffers, plan, 5), foreign.reshape(-1))
    # The buffer holds a copy: later changes to the foreign tensor do not leak in.
    foreign.add_(1.0)
    assert not torch.equal(view, foreign)


def test_adopt_grad_leaves_the_view_alone():
    params = mixed_params()
    _, flat = wrap(params)
    view = flat.grad_views[6]
    view.copy_(torch.arange(11.0))
    assert flat.adopt_grad(6) is False
    assert params[6].grad is view
    assert torch.equal(view, torch.arange(11.0))


def test_detached_params():
    params = mixed_params()
    _, flat = wrap(params)
    assert flat.detached_params() == []
    params[4].data = torch.zeros_like(params[4])
    params[0].data = torch.zeros_like(params[0])
    assert sorted(flat.detached_params()) == [0, 4]
    # In-place updates keep the param in the buffer.
    with torch.no_grad():
        params[5].mul_(2.0)
        params[6].copy_(torch.zeros(11))
    assert sorted(flat.detached_params()) == [0, 4]


def test_adopt_param_copies_the_replacement_into_the_slot():
    """``param.data = t`` (WGAN's ``p.data = p.data.clamp(...)``, cuDNN's re-flattening): the
    values of ``t`` go into the slot and ``.data`` is the slot's view again."""
    params = mixed_params()
    _, flat = wrap(params)
    replacement = torch.randn(params[0].shape).t().contiguous().t()  # other strides than the slot
    params[0].data = replacement
    flat.adopt_param(0)
    assert flat.detached_params() == []
    assert params[0].data_ptr() == flat.param_views[0].data_ptr()
    assert torch.equal(params[0], replacement)


def test_adopt_param_refuses_another_shape():
    params = mixed_params()
    _, flat = wrap(params)
    params[4].data = torch.zeros(params[4].numel() + 1)
    with pytest.raises(RuntimeError, match="no longer fits its slot"):
        flat.adopt_param(4)


# --------------------------------------------------------------------------------------------
# Autograd


def test_backward_accumulates_into_the_grad_buffer():
    w = make_param(4, 3, seed=1)
    b = make_param(3, seed=2)
    h = make_param(3, dtype=torch.float64, seed=3)
    params = [w, b, h]
    plan, flat = wrap(params, world_size=2)
    x1 = torch.arange(8.0).reshape(2, 4)
    x2 = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)

    def loss(x):
        return ((x @ w + b).double() * h).square().sum()

    # The same grads computed on untouched copies.
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    expected = [torch.zeros_like(p) for p in params]
    for x in (x1, x2):
        out = ((x @ ref[0] + ref[1]).double() * ref[2]).square().sum()
        for acc, g in zip(expected, torch.autograd.grad(out, ref), strict=True):
            acc += g

    grad_ptrs = [p.grad.data_ptr() for p in params]
    loss(x1).backward()
    loss(x2).backward()
    for index, p in enumerate(params):
        assert p.grad is flat.grad_views[index]
        assert p.grad.data_ptr() == grad_ptrs[index]
        torch.testing.assert_close(buffer_region(flat.grad_buffers, plan, index), expected[index].reshape(-1))
    assert expected[0].abs().sum() > 0

    # After zero_grad, a fresh backward starts from zero, still in the buffer.
    flat.zero_grad()
    loss(x1).backward()
    single = torch.autograd.grad(((x1 @ ref[0] + ref[1]).double() * ref[2]).square().sum(), ref)
    for index in range(3):
        torch.testing.assert_close(buffer_region(flat.grad_buffers, plan, index), single[index].reshape(-1))


def test_backward_after_grad_set_to_none_needs_adopt():
    """Autograd puts a fresh tensor in ``.grad`` once it is None; adopt_grad brings it home."""
    p = make_param(5)
    plan, flat = wrap([p], world_size=1)
    p.grad = None
    (p * torch.arange(5.0)).sum().backward()
    assert p.grad is not flat.grad_views[0]
    assert flat.adopt_grad(0) is True
    assert torch.equal(buffer_region(flat.grad_buffers, plan, 0), torch.arange(5.0))


def test_optimizer_step_updates_the_buffer():
    params = [make_param(6, seed=1), make_param(2, 2, seed=2)]
    plan, flat = wrap(params, world_size=2)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad.fill_(1.0)
    torch.optim.SGD(params, lr=0.5).step()
    assert flat.detached_params() == []
    for index in range(len(params)):
        assert torch.equal(buffer_region(flat.param_buffers, plan, index), (before[index] - 0.5).reshape(-1))


# --------------------------------------------------------------------------------------------
# Property test


shapes = st.one_of(st.just(()), st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=st.lists(
        st.tuples(shapes, st.sampled_from(DTYPES), st.integers(0, 1), st.booleans(), st.booleans()),
        min_size=1,
        max_size=10,
    ),
    world_size=st.integers(1, 8),
    align_bytes=st.sampled_from([2**k for k in range(11)]),
    bucket_size_bytes=st.integers(1, 2048),
)
def test_wrapping_properties(entries, world_size, align_bytes, bucket_size_bytes):
    params, groups = [], []
    for seed, (shape, dtype, group, frozen, has_grad) in enumerate(entries):
        p = make_param(*shape, dtype=dtype, requires_grad=not frozen, seed=seed)
        if has_grad and not frozen:
            p.grad = torch.full_like(p, -1.0 - seed)
        params.append(p)
        groups.append(group)
    before = [p.detach().clone() for p in params]
    grads_before = [None if p.grad is None else p.grad.clone() for p in params]
    ptrs = [p.data_ptr() for p in params]
    plan, flat = wrap(
        params, world_size, groups=groups, align_bytes=align_bytes, bucket_size_bytes=bucket_size_bytes
    )

    for index, p in enumerate(params):
        assert torch.equal(p.detach(), before[index])
        if plan.slots[index] is None:
            assert p.data_ptr() == ptrs[index]
            assert p.grad is None
            continue
        slot = plan.slot(index)
        assert is_view_at(p.data, flat.param_buffers[slot.bucket_index], slot.offset)
        assert is_view_at(p.grad, flat.grad_buffers[slot.bucket_index], slot.offset)
        want = torch.zeros_like(p) if grads_before[index] is None else grads_before[index]
        assert torch.equal(p.grad, want)

    # Reassemble every bucket from the shards' pieces and compare to the flat buffers: this
    # covers both the plan's pieces and the padding being zero.
    for b, bucket in enumerate(plan.buckets):
        rebuilt = torch.zeros(bucket.padded_numel, dtype=bucket.dtype)
        for rank in range(world_size):
            start = rank * bucket.shard_numel
            for piece in bucket.shard_pieces(rank):
                src = params[piece.param_index].detach().reshape(-1)
                lo = start + piece.shard_start
                rebuilt[lo : lo + piece.numel] = src[piece.param_start : piece.param_start + piece.numel]
            assert torch.equal(flat.param_shard(b, rank), rebuilt[start : start + bucket.shard_numel])
        assert torch.equal(flat.param_buffers[b], rebuilt)
    assert flat.detached_params() == []
