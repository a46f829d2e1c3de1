"""``StepPipeline``: one ``step()`` from the local grads to the all-gathers, each bucket's shard
stepped as its reduction lands.

Note [Step pipeline]
    Buckets' reductions land in bucket order (bucket 0 holds the last layers, whose grads
    backward produces first; gloo completes a group's collectives in issue order). ``step()``
    therefore takes the buckets in that order: it waits for bucket 0's reduction alone, steps
    bucket 0's shard, then waits for bucket 1, and so on, so the optimizer works while later
    reductions are still on the wire, instead of waiting for all of them first (Megatron's
    ``overlap_param_gather_with_optimizer_step`` idea). The presence flags travel just before
    each bucket's reduction, or on gloo on a group of their own right after the last one (Note
    [Presence per bucket] in ``grad_presence``), so nothing else has to land first.

    A bucket's step is one call of the wrapped optimizer's ``step`` over that bucket's pieces
    only (its param groups temporarily hold just them; pieces of params without a grad are left
    out as before). torch's element-wise optimizers keep every piece of state per param
    (``step`` included), so N calls over disjoint pieces compute bitwise what one call over all
    of them does. A class that is not one of torch's own (``assume_elementwise=True``) may keep
    state per call, so it is stepped once, over every bucket, after every reduction; so is any
    optimizer on one rank, where there is nothing to wait for.

    ``clip_grad_norm_`` and ``ShardedGradScaler`` need every shard's grads before any step (a
    global norm, a global inf flag): they finish every reduction themselves, and the pipeline
    then only steps.

    All-gathers: each bucket's all-gather starts behind the last optimizer op of its own step
    (``start_param_sync`` makes the comm stream wait for it). They are issued after the whole
    step, in forward order (reverse bucket index), not one after each bucket's step: the
    latter queues them in backward order, and gloo runs a group's collectives in issue order,
    so the next forward's first module (last bucket) would wait for every all-gather; see
    ``benchmarks/results/2026-12-03-pipeline-cpu-2core.md`` for both measured.

Note [A step that raises on some ranks]
    The wrapped class's ``step`` can raise on some ranks only: each rank steps other params (a
    whole param lives on one rank for Muon and Adafactor, and a small one inside one shard for
    every class), and torch's classes raise on some params (Adafactor divides by a zero-element
    param's size; fused SGD refuses a param's first step after others had theirs). A rank that
    raised would skip its all-gathers while the others wait in them until the collective
    timeout. So after the local step every rank all-reduces one flag per rank on the presence
    group (``GradPresence.ranks_flagging``, CPU gloo where the reductions run on gloo), decided by what
    happened on that rank, and then issues the all-gathers on every rank or on none: a rank that
    raised raises its own error, the others a ``RuntimeError`` naming those ranks. As when a
    torch optimizer raises, the step is then partly applied (this rank's shard may have
    changed). The cost is one all-reduce of ``world_size`` bytes per step, waited for before
    the all-gathers start.
"""

from __future__ import annotations

from typing import Any

import torch

from sharded_opt.step.bucket import Bucket
from sharded_opt.step.grad_sync import GradSync
from sharded_opt.step.inner_optimizer import copy_group_updates, hyperparameters, step_without_hooks
from sharded_opt.step.optimizer_shards import OptimizerShards
from sharded_opt.step.param_sync import ParamSync


class StepPipeline:
    """Runs ``step()`` once the wrapper has checked its params and groups: reduces the grads,
    skips or unscales as a ``ShardedGradScaler`` says, steps the inner optimizer over the shards
    bucket by bucket as their reductions finish, and starts the all-gathers of the buckets it
    changed; see Note [Step pipeline].

    Args:
        shards: the per-bucket shards and the inner optimizer.
        grad_sync: reduces the grads, finishes each bucket's reduction and knows which params got
            a grad.
        param_sync: waits for the last step's all-gathers and starts this step's.
        state_per_param: the class keeps all its state per param (torch's own classes do), so
            stepping it bucket by bucket is exact; otherwise, or on one rank, it steps once
            after every reduction.
    """

    def __init__(
        self,
        shards: OptimizerShards,
        grad_sync: GradSync,
        param_sync: ParamSync,
        state_per_param: bool,
    ) -> None:
        self._shards = shards
        self._inner = shards.inner
        self._grad_sync = grad_sync
        self._param_sync = param_sync
        self.step_per_bucket = shards.groups.world_size > 1 and state_per_param
        """One inner step per bucket as its reduction lands, see Note [Step pipeline]."""

    def run(
        self, kwargs: dict[str, Any], found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None
    ) -> bool:
        """One ``step()`` with the wrapped class's ``kwargs``, given the scaler's arguments (see
        :func:`amp_scaling_arguments`); returns whether it stepped (not when the scaler found an
        inf, on every rank alike)."""
        self._param_sync.finish_param_sync()
        if found_inf is None:
            self._grad_sync.start_grad_sync()
        else:
            self._grad_sync.reduce_grads()  # the scaler reduced them already, to check the averaged grads
        if found_inf is not None and float(found_inf) > 0:
            self._grad_sync.start_iteration()  # the scaler saw an inf on some rank: every rank skips
            return False
        if grad_scale is not None:
            inverse = grad_scale.double().reciprocal().float()
            torch._foreach_mul_(self._shards.local_grads(), inverse)
        self.step(kwargs)
        self._param_sync.hand_over()
        self._grad_sync.start_iteration()
        self._grad_sync.record_step()
        return True

    def step(self, kwargs: dict[str, Any]) -> None:
        """Step every bucket's shard and start the all-gathers of those that changed; see Note
        [Step pipeline]."""
        self._sync_hyperparameters()
        order = [bucket for bucket in self._shards.buckets if bucket.shard is not None]  # landing order
        batches = [[bucket] for bucket in order] if self.step_per_bucket else [order]
        stepped: list[Bucket] = []
        error: Exception | None = None
        for batch in batches:
            self._grad_sync.finish_grad_sync(batch)  # every reduction finishes, even after an error
            if error is None or not self.step_per_bucket:
                try:
                    stepped += self._step_buckets(batch, kwargs)
                except Exception as raised:  # noqa: BLE001 - agreed on, then raised below
                    error = raised
        self._agree_on_errors(error)
        self._param_sync.start_param_sync(stepped)
        self._mark_params_updated(stepped)

    def _agree_on_errors(self, error: Exception | None) -> None:
        """Raise on every rank when the wrapped step raised on any; see Note [A step that raises
        on some ranks]."""
        failed = self._grad_sync.presence.ranks_flagging(error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"ShardingStage1.step: the wrapped optimizer's step raised on rank(s) {failed} (their "
                "error is raised there), so no rank shares its updated params. As when a torch "
                "optimizer's step raises, this step is partly applied: restore from a checkpoint, "
                "or fix the cause and keep training"
            )

    def _mark_params_updated(self, buckets: list[Bucket]) -> None:
        """Bump the version counter of every param the step changed, as torch's in-place
        optimizer update does: a graph built before ``step()`` that saved a param for its
        backward (``loss1.backward(retain_graph=True); opt.step(); loss2.backward()``) then
        raises torch's "modified by an inplace operation" error instead of silently
        differentiating through the new weights. The update itself went through the flat
        buffers, whose views count versions apart from the params (Note [Writes while params
        are gathered] in ``param_hooks``), so the params' own counters need the bump; it comes
        before ``gathers_started`` records them."""
        params = self._shards.buffers.params
        updated = [params[index] for bucket in buckets for index in bucket.params_with_grads()]
        if updated:
            torch.autograd.graph.increment_version(updated)

    def _step_buckets(self, buckets: list[Bucket], kwargs: dict[str, Any]) -> list[Bucket]:
        """One inner step over the pieces of ``buckets`` whose params got a grad on some rank;
        returns the buckets it changed. Pieces of other params (and other buckets) are left out
        of the step, so, as in torch, they and their state stay untouched."""
        groups: list[list[torch.Tensor]] = [[] for _ in self._inner.param_groups]
        stepped = []
        for bucket in buckets:
            shard = bucket.shard
            present = bucket.agreed_presence()
            if shard is None or not any(present):
                continue
            stepped.append(bucket)
            shard.refresh_master()
            owners = None if all(present) else bucket.params_with_grads()
            self._shards.start_pieces(shard, owners)
            group = groups[shard.bucket.group_index]
            if owners is None:
                group += shard.inner_params
            else:
                pieces = zip(shard.inner_params, shard.inner_owners, strict=True)
                group += [piece for piece, owner in pieces if owner in owners]
        if any(groups) or not self.step_per_bucket:
            self._inner_step(groups, kwargs)
            self._shards.share_code_books(piece for group in groups for piece in group)
        return stepped

    def _inner_step(self, params_per_group: list[list[torch.Tensor]], kwargs: dict[str, Any]) -> None:
        """The wrapped class's ``step`` over ``params_per_group`` only, the groups' full lists
        restored afterwards."""
        inner_groups = self._inner.param_groups
        full = [group["params"] for group in inner_groups]
        try:
            for group, params in zip(inner_groups, params_per_group, strict=True):
                group["params"] = params
            step_without_hooks(self._inner, kwargs)
            copy_group_updates(self._inner.param_groups, self._shards.param_groups)
        finally:
            for group, params in zip(inner_groups, full, strict=True):
                group["params"] = params

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self._shards.param_groups, self._inner.param_groups, strict=True):
            inner.update(hyperparameters(outer))


def amp_scaling_arguments(
    optimizer: torch.optim.Optimizer,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``found_inf`` and ``grad_scale`` that a ``GradScaler`` driving this step set on
    ``optimizer`` (torch's ``_step_supports_amp_scaling`` protocol), see Note [Loss scaling with
    sharded grads] in ``grad_scaler``; a stock scaler checked only this rank's grads and is
    refused."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return None, None
    if not isinstance(found_inf, torch.Tensor):
        # GradScaler.step sums the flags that unscale_ recorded; with none at all (no param had
        # a grad on any rank: the flags are agreed, the same everywhere) the sum is the int 0.
        # torch asserts on this optimizer's flags for a plain optimizer; so does this, on every
        # rank, and the attributes GradScaler.step would remove after step() go now.
        del optimizer.found_inf, optimizer.grad_scale
        raise AssertionError("No inf checks were recorded for this optimizer.")
    if not getattr(optimizer, "_scaled_by_sharded_scaler", False):
        raise RuntimeError(
            "ShardingStage1.step: driven by a stock torch.amp.GradScaler, which checks this rank's "
            "local, unreduced grads for infs, so ranks would skip different steps and their "
            "scales drift apart. Use sharded_opt.ShardedGradScaler (same API) instead; call "
            "opt.zero_grad() to discard these grads"
        )
    return found_inf, getattr(optimizer, "grad_scale", None)
