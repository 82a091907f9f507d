"""Sharded data parallelism: ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC20).

Every rank holds the whole model, as in plain data parallel, but the optimizer state is cut in N pieces:

- all parameters live in one flat buffer, cut into buckets each padded to a multiple of the group size N (the
  module's parameters become views into it; :mod:`dtrain.parallel.zero_communications` has the layout); rank r
  owns chunk r of every bucket and builds its optimizer over those chunks only, so it holds 1/N of the
  optimizer state (stage 1, "P_os", section 5.1);
- stage 1 averages the whole flat gradient with one all-reduce at the step and each rank reads its chunks;
  stage 2 ("P_os+g", section 5.2) reduce-scatters each bucket from gradient hooks *during backward*, as soon as
  its gradients are ready, keeps only its chunk and releases the full per-parameter gradients at once, so no
  full-size gradient buffer is ever allocated and the full gradients of only one bucket are alive at a time;
- each rank steps its chunks, then one all-gather a bucket brings every updated chunk back into every buffer.

Equal to plain data parallel, hence to one process on the global batch, for any optimizer that updates each
element from that element's own gradient and state (SGD, momentum, Adam, AdamW, ...); optimizers that look
across elements (LAMB, LARS, gradient-norm clipping inside the step) would see only the shard.

Limits of this version: one dtype and device for all parameters, one parameter group; stage 2's buckets keep
reverse registration order (they are not rebuilt from the observed order as DataParallel's are, since the
optimizer's shards are cut along them); stage 3 (partitioned parameters) is not built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain import comm
from dtrain.parallel.data_parallel_communications import group_size
from dtrain.parallel.zero_communications import (
    ShardedBucket,
    ShardedGradientReducer,
    all_gather_buckets,
    layout_buckets,
)

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # as DataParallel's (DDP's bucket_cap_mb=25)

__all__ = ["MemoryReport", "ZeroMemoryReport", "ZeroOptimizer"]


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Bytes one rank holds for the model's training state."""

    parameter_nbytes: int
    gradient_nbytes: int
    optimizer_state_nbytes: int

    @property
    def total_nbytes(self) -> int:
        return self.parameter_nbytes + self.gradient_nbytes + self.optimizer_state_nbytes


@dataclass(frozen=True, kw_only=True)
class ZeroMemoryReport:
    """Per-rank bytes under ZeRO (``zero``) against plain data parallel with the same optimizer (``data_parallel``)."""

    stage: int
    world_size: int
    zero: MemoryReport
    data_parallel: MemoryReport


class ZeroOptimizer:
    """ZeRO stage 1 or 2 over ``group``: ``optimizer_cls(shards, **optimizer_kwargs)`` on this rank's 1/N shard.

    ``params`` must be the same parameters, in the same order, on every rank; they are overwritten with group
    rank 0's values at construction. Use it like an optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``
    with each rank on its shard of the global batch (no gradient averaging wrapper around the model). Several
    backward passes before a step accumulate (sum) as with plain gradients. Under stage 2 ``param.grad`` is None
    after backward: the averaged gradient exists only as this rank's shard. ``bucket_bytes`` sets the size of
    the buckets (and of stage 2's reduce-scatters).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        optimizer_cls: type[torch.optim.Optimizer],
        group,
        *,
        stage: int = 1,
        algorithm: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **optimizer_kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"ZeRO stage must be 1 (optimizer state sharded) or 2 (and gradients); got {stage!r} "
                "(stage 3, partitioned parameters, is not implemented)"
            )
        self.params = _check_params(params)
        self.group = group
        self.stage = stage
        self.algorithm = algorithm
        self.world_size = group_size(group)
        self.rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.buckets = layout_buckets(self.params, self.world_size, bucket_bytes)
        self.shard_numel = sum(b.chunk for b in self.buckets)
        like = self.params[0]
        self.flat = torch.zeros(sum(b.numel for b in self.buckets), dtype=like.dtype, device=like.device)
        self._adopt_params()
        comm.broadcast(self.flat, 0, group=group, algorithm=algorithm)
        # One optimizer parameter a bucket: this rank's chunk, a view, so steps land in self.flat.
        self.shards = [nn.Parameter(self._mine(self.flat, b)) for b in self.buckets]
        self.optimizer = optimizer_cls(self.shards, **optimizer_kwargs)
        # Stage 1 keeps the averaged gradient of every element (laid out like self.flat), stage 2 only its chunks.
        kept = self.flat.numel() if stage == 1 else self.shard_numel
        self._grad = torch.zeros(kept, dtype=like.dtype, device=like.device)
        if stage == 1:
            self._grad_shards = [self._mine(self._grad, b) for b in self.buckets]
        else:
            self._grad_shards = list(self._grad.split([b.chunk for b in self.buckets]))
            self.reducer = ShardedGradientReducer(self.buckets, self._grad_shards, group, algorithm=algorithm)

    def _mine(self, laid_out: torch.Tensor, bucket: ShardedBucket) -> torch.Tensor:
        begin = bucket.start + self.rank * bucket.chunk
        return laid_out[begin : begin + bucket.chunk]

    def _adopt_params(self) -> None:
        """Copy the parameters into the flat buffer and make each one a view of its slice."""
        with torch.no_grad():
            for bucket in self.buckets:
                for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                    piece = self.flat[bucket.start + offset : bucket.start + offset + p.numel()]
                    piece.copy_(p.reshape(-1))
                    p.data = piece.view_as(p)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _all_reduce_gradients(self) -> None:
        """Stage 1: this rank's gradients laid out like ``self.flat`` (a missing one counts as zero), averaged."""
        self._grad.zero_()
        views, grads = [], []
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                if p.grad is not None:
                    views.append(self._grad[bucket.start + offset : bucket.start + offset + p.numel()].view_as(p))
                    grads.append(p.grad)
        if grads:
            torch._foreach_copy_(views, grads)
        comm.all_reduce(self._grad, op="avg", group=self.group, algorithm=self.algorithm)

    @torch.no_grad()
    def step(self) -> None:
        """Average gradients (stage 1 here; stage 2 did it during backward), step the shards, all-gather them."""
        if self.stage == 1:
            self._all_reduce_gradients()
        for shard, grad in zip(self.shards, self._grad_shards, strict=True):
            shard.grad = grad
        self.optimizer.step()
        all_gather_buckets(self.flat, self.shards, self.buckets, self.group, algorithm=self.algorithm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if self.stage == 2:
            self.reducer.zero()

    def memory_report(self) -> ZeroMemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds, against plain data parallel.

        Optimizer state is what the wrapped optimizer holds now (Adam builds it at the first step); plain data
        parallel would hold the same per-element state for every element instead of one shard. Gradient bytes
        count the buffer kept between steps (stage 1: every element; stage 2: the shard), as in the paper's
        accounting (section 5).
        """
        element = self.flat.element_size()
        per_element_nbytes, other_nbytes = 0, 0
        for shard in self.shards:
            for value in self.optimizer.state.get(shard, {}).values():
                if not isinstance(value, torch.Tensor):
                    continue
                nbytes = value.numel() * value.element_size()
                if value.dim() > 0 and value.numel() == shard.numel():
                    per_element_nbytes += nbytes
                else:
                    other_nbytes += nbytes  # a step count and the like: the same under plain data parallel
        state_nbytes = per_element_nbytes + other_nbytes
        dp_state_nbytes = per_element_nbytes * self.numel // self.shard_numel + other_nbytes
        zero = MemoryReport(
            parameter_nbytes=self.flat.numel() * element,
            gradient_nbytes=self._grad.numel() * element,
            optimizer_state_nbytes=state_nbytes,
        )
        data_parallel = MemoryReport(
            parameter_nbytes=self.numel * element,
            gradient_nbytes=self.numel * element,
            optimizer_state_nbytes=dp_state_nbytes,
        )
        return ZeroMemoryReport(stage=self.stage, world_size=self.world_size, zero=zero, data_parallel=data_parallel)


def _check_params(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    chosen = [p for p in dict.fromkeys(params) if p.requires_grad]
    if not chosen:
        raise ValueError("ZeroOptimizer: no parameter that requires a gradient was given")
    kinds = {(p.dtype, p.device) for p in chosen}
    if len(kinds) != 1:
        raise ValueError(f"ZeroOptimizer: parameters must share one dtype and device, got {sorted(map(str, kinds))}")
    dtype = chosen[0].dtype
    if not dtype.is_floating_point:
        raise ValueError(f"ZeroOptimizer: parameters must be floating point, got {dtype}")
    return chosen
