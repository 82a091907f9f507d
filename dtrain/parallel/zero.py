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

Limits: one dtype and device for all parameters; stage 2's buckets keep
reverse registration order (they are not rebuilt from the observed order as DataParallel's are, since the
optimizer's shards are cut along them). Stage 3, the parameters sharded too, is
:class:`dtrain.parallel.fsdp.FullyShardedDataParallel`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain import comm
from dtrain.parallel.data_parallel_communications import group_size, reduce_in
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
    """ZeRO stage 1 or 2 over ``group``: ``optimizer_cls`` over this rank's 1/N shard of the parameters.

    ``params`` is an iterable of parameters or torch's list of param-group dicts (``[{"params": [...],
    "weight_decay": 0.0}, ...]``: each group's hyper-parameters apply to its parameters' elements in every
    shard); ``optimizer_kwargs`` are the defaults. The parameters must be the same, in the same order, on every
    rank; they are overwritten with group rank 0's values at construction. Use it like an optimizer:
    ``loss.backward(); opt.step(); opt.zero_grad()`` with each rank on its shard of the global batch (no
    gradient averaging wrapper around the model). Several backward passes before a step accumulate (sum) as
    with plain gradients. Under stage 2 ``param.grad`` is None after backward: the averaged gradient exists only
    as this rank's shard. ``bucket_bytes`` sets the size of the buckets (and of stage 2's reduce-scatters);
    ``reduce_dtype`` averages the gradients in another dtype (e.g. bf16 for float32 parameters).

    The optimizer sees one parameter per piece of a model parameter that falls in this rank's chunk of a bucket
    (a view into the flat buffer), in that parameter's group. Between backward and :meth:`step`,
    :meth:`grad_square_sum` and :meth:`scale_grads` read and scale this rank's averaged gradient pieces (for a
    gradient norm over all ranks and clipping, or unscaling a loss-scaled gradient).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        group,
        *,
        stage: int = 1,
        algorithm: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reduce_dtype: torch.dtype | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"ZeRO stage must be 1 (optimizer state sharded) or 2 (and gradients); got {stage!r} "
                "(stage 3, the parameters too, is dtrain.parallel.fsdp.FullyShardedDataParallel)"
            )
        groups = _param_groups(params)
        self.params = _check_params([p for g in groups for p in g["params"]])
        chosen = {id(p) for p in self.params}
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"] if id(p) in chosen}
        self.group = group
        self.stage = stage
        self.algorithm = algorithm
        self.reduce_dtype = reduce_dtype
        self.world_size = group_size(group)
        self.rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.buckets = layout_buckets(self.params, self.world_size, bucket_bytes)
        self.shard_numel = sum(b.chunk for b in self.buckets)
        like = self.params[0]
        self.flat = torch.zeros(sum(b.numel for b in self.buckets), dtype=like.dtype, device=like.device)
        self._adopt_params()
        comm.broadcast(self.flat, 0, group=group, algorithm=algorithm)
        # This rank's chunk of each bucket (a view of self.flat): the steps land there, the all-gather sends it.
        self.shards = [self._mine(self.flat, b) for b in self.buckets]
        # Stage 1 keeps the averaged gradient of every element (laid out like self.flat) and one flag a parameter
        # after them (1 where this rank has its gradient, averaged with the gradients); stage 2 only its chunks.
        kept = self.flat.numel() + len(self.params) if stage == 1 else self.shard_numel
        self._grad = torch.zeros(kept, dtype=like.dtype, device=like.device)
        if stage == 1:
            self._grad_shards = [self._mine(self._grad, b) for b in self.buckets]
        else:
            self._grad_shards = list(self._grad.split([b.chunk for b in self.buckets]))
            self.reducer = ShardedGradientReducer(
                self.buckets, self._grad_shards, group, algorithm=algorithm, reduce_dtype=reduce_dtype
            )
        # One optimizer parameter per (model parameter, this rank's chunk) overlap, in the parameter's group.
        self.pieces: list[tuple[nn.Parameter, nn.Parameter, torch.Tensor]] = []  # (model param, piece, its grad)
        per_group: list[list[nn.Parameter]] = [[] for _ in groups]
        for bucket, shard, grad in zip(self.buckets, self.shards, self._grad_shards, strict=True):
            begin = self.rank * bucket.chunk  # this rank's chunk, in bucket coordinates
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                lo, hi = max(begin, offset), min(begin + bucket.chunk, offset + p.numel())
                if lo >= hi:
                    continue
                piece = nn.Parameter(shard[lo - begin : hi - begin])
                self.pieces.append((p, piece, grad[lo - begin : hi - begin]))
                per_group[group_of[id(p)]].append(piece)
        torch_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": pieces}
            for g, pieces in zip(groups, per_group, strict=True)
        ]
        self.optimizer = optimizer_cls(torch_groups, **optimizer_kwargs)
        self._reduced = False
        self._unused: set[int] = set()  # id() of the parameters no rank had a gradient for since zero_grad

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

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def _all_reduce_gradients(self) -> None:
        """Stage 1: this rank's gradients laid out like ``self.flat`` (a missing one counts as zero), averaged, with
        a flag a parameter (1 where this rank has its gradient) after them."""
        self._grad.zero_()
        views, grads = [], []
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                if p.grad is not None:
                    views.append(self._grad[bucket.start + offset : bucket.start + offset + p.numel()].view_as(p))
                    grads.append(p.grad)
        if grads:
            torch._foreach_copy_(views, grads)
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        flags = self._grad[self.flat.numel() :]
        flags.fill_(1.0)
        if missing:
            flags[missing] = 0.0
        reduce_in(self._grad, self.reduce_dtype, group=self.group, algorithm=self.algorithm)
        self._unused = self._globally_unused(missing, flags)

    def _globally_unused(self, missing: list[int], flags: torch.Tensor) -> set[int]:
        """Of the parameters this rank had no gradient for (``missing``, indices), those no rank had one for (their
        reduced ``flags`` are 0): read back only where this rank missed one, the other ranks having them all."""
        if not missing or (flags.is_cuda and torch.cuda.is_current_stream_capturing()):
            return set()
        seen = flags[missing].tolist()
        return {id(self.params[i]) for i, flag in zip(missing, seen, strict=True) if flag == 0}

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients of the passes since :meth:`zero_grad` (stage 1; stage 2 did it during
        backward). Called by :meth:`step`, :meth:`grad_square_sum` and :meth:`scale_grads`; once a step."""
        if self.stage == 1 and not self._reduced:
            self._all_reduce_gradients()
        elif self.stage == 2 and not self._reduced:  # one flag a parameter: 1 where it had a gradient in a pass
            used = self.reducer.used
            missing = [i for i, p in enumerate(self.params) if id(p) not in used]
            flags = torch.ones(len(self.params), dtype=torch.float32, device=self.flat.device)
            if missing:
                flags[missing] = 0.0
            comm.all_reduce(flags, op="max", group=self.group, algorithm=self.algorithm)
            self._unused = self._globally_unused(missing, flags)
        self._reduced = True

    @torch.no_grad()
    def grad_square_sum(self, weight_of: Callable[[nn.Parameter], float] | None = None) -> torch.Tensor:
        """Sum over this rank's averaged gradient pieces of ``weight_of(param) * g**2`` (0-d float32), each
        element weighted by the model parameter it belongs to (default weight 1). Summed over the group, with
        weights 1, it is the squared norm of the whole averaged gradient."""
        self.reduce_gradients()
        total = torch.zeros((), dtype=torch.float32, device=self.flat.device)
        for p, _, grad in self.pieces:
            weight = 1.0 if weight_of is None else weight_of(p)
            if weight:
                total += weight * grad.float().square().sum()
        return total

    @torch.no_grad()
    def scale_grads(self, coef: float | torch.Tensor) -> None:
        """Multiply this rank's averaged gradient chunks by ``coef`` (clipping, or undoing a loss scale)."""
        self.reduce_gradients()
        if isinstance(coef, torch.Tensor):
            self._grad.mul_(coef.to(self._grad.dtype))
        else:
            self._grad.mul_(coef)

    @torch.no_grad()
    def step(self) -> None:
        """Average gradients (stage 1 here; stage 2 did it during backward), step the shards, all-gather them."""
        self.reduce_gradients()
        for p, piece, grad in self.pieces:  # a parameter no rank had a gradient for is left alone, as on one process
            piece.grad = None if id(p) in self._unused else grad
        self.optimizer.step()
        all_gather_buckets(self.flat, self.shards, self.buckets, self.group, algorithm=self.algorithm)
        self._reduced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if self.stage == 2:
            self.reducer.zero()
        self._reduced = False

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (a checkpoint of the same layout loads it back)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def memory_report(self) -> ZeroMemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds, against plain data parallel.

        Optimizer state is what the wrapped optimizer holds now (Adam builds it at the first step); plain data
        parallel would hold the same per-element state for every element instead of one shard. Gradient bytes
        count the buffer kept between steps (stage 1: every element; stage 2: the shard), as in the paper's
        accounting (section 5).
        """
        element = self.flat.element_size()
        per_element_nbytes, other_nbytes = 0, 0
        for _, piece, _ in self.pieces:
            scalars = 0
            for value in self.optimizer.state.get(piece, {}).values():
                if not isinstance(value, torch.Tensor):
                    continue
                nbytes = value.numel() * value.element_size()
                if value.dim() > 0 and value.numel() == piece.numel():
                    per_element_nbytes += nbytes
                else:
                    scalars += nbytes
            # a step count and the like: the optimizer's, however many pieces it is cut into (one under plain
            # data parallel too)
            other_nbytes = max(other_nbytes, scalars)
        held = sum(piece.numel() for _, piece, _ in self.pieces) or 1
        state_nbytes = per_element_nbytes + other_nbytes
        dp_state_nbytes = per_element_nbytes * self.numel // held + other_nbytes
        zero = MemoryReport(
            parameter_nbytes=self.flat.numel() * element,
            gradient_nbytes=(self.flat.numel() if self.stage == 1 else self.shard_numel) * element,  # no flags
            optimizer_state_nbytes=state_nbytes,
        )
        data_parallel = MemoryReport(
            parameter_nbytes=self.numel * element,
            gradient_nbytes=self.numel * element,
            optimizer_state_nbytes=dp_state_nbytes,
        )
        return ZeroMemoryReport(stage=self.stage, world_size=self.world_size, zero=zero, data_parallel=data_parallel)


def _param_groups(params: Iterable[nn.Parameter] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``params`` as torch's list of group dicts, each with a list under ``"params"``."""
    given = list(params)
    if given and all(isinstance(g, dict) for g in given):
        groups = []
        for i, g in enumerate(given):
            if "params" not in g:
                raise ValueError(f"ZeroOptimizer: param group {i} has no 'params'")
            members = g["params"]
            groups.append({**g, "params": [members] if isinstance(members, torch.Tensor) else list(members)})
        return groups
    if any(isinstance(g, dict) for g in given):
        raise ValueError("ZeroOptimizer: give parameters or param-group dicts, not a mix")
    return [{"params": given}]


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
