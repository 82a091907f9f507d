"""Sharded data parallelism: ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC20).

Every rank holds the whole model, as in plain data parallel, but the optimizer state is cut in N pieces:

- all parameters live in one flat buffer padded to a multiple of the group size N (the module's parameters
  become views into it); rank r owns elements ``[r * S, (r + 1) * S)`` with ``S = padded / N``, and builds its
  optimizer over that shard only, so it holds 1/N of the optimizer state (stage 1, "P_os", section 5.1);
- stage 1 averages the whole flat gradient with an all-reduce and each rank reads its shard of it; stage 2
  ("P_os+g", section 5.2) reduce-scatters it instead, so each rank keeps only its 1/N gradient shard (the
  full per-parameter gradients are released at the step);
- each rank steps its shard, then an all-gather brings every updated shard back into every rank's buffer.

Equal to plain data parallel, hence to one process on the global batch, for any optimizer that updates each
element from that element's own gradient and state (SGD, momentum, Adam, AdamW, ...); optimizers that look
across elements (LAMB, LARS, gradient-norm clipping inside the step) would see only the shard.

Limits of this version: one dtype and device for all parameters, one parameter group; the full gradient is
still produced by autograd during backward and flattened at the step (ZeRO-2's bucketed reduce-scatter during
backward, which keeps the peak down as well, is not done here); stage 3 (partitioned parameters) is not built.
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
    """ZeRO stage 1 or 2 over ``group``: ``optimizer_cls(shard, **optimizer_kwargs)`` on this rank's 1/N shard.

    ``params`` must be the same parameters, in the same order, on every rank; they are overwritten with group
    rank 0's values at construction. Use it like an optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``
    with each rank on its shard of the global batch (no gradient averaging wrapper around the model).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        optimizer_cls: type[torch.optim.Optimizer],
        group,
        *,
        stage: int = 1,
        algorithm: str = "auto",
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
        self.shard_numel = -(-self.numel // self.world_size)
        like = self.params[0]
        self.flat = torch.zeros(self.shard_numel * self.world_size, dtype=like.dtype, device=like.device)
        self._offsets = self._adopt_params()
        comm.broadcast(self.flat, 0, group=group, algorithm=algorithm)
        begin = self.rank * self.shard_numel
        self.shard = nn.Parameter(self.flat[begin : begin + self.shard_numel])  # a view: steps land in self.flat
        self.optimizer = optimizer_cls([self.shard], **optimizer_kwargs)
        # Stage 1 keeps the averaged gradient of every element, stage 2 only its shard's.
        kept = self.flat.numel() if stage == 1 else self.shard_numel
        self._grad = torch.zeros(kept, dtype=like.dtype, device=like.device)

    def _adopt_params(self) -> list[int]:
        """Copy the parameters into the flat buffer and make each one a view of its slice."""
        offsets, start = [], 0
        with torch.no_grad():
            for p in self.params:
                piece = self.flat[start : start + p.numel()]
                piece.copy_(p.reshape(-1))
                p.data = piece.view_as(p)
                offsets.append(start)
                start += p.numel()
        return offsets

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _flat_grad(self) -> torch.Tensor:
        """This rank's gradients laid out like ``self.flat`` (a missing gradient counts as zero)."""
        flat_grad = self._grad if self.stage == 1 else torch.zeros_like(self.flat)
        flat_grad.zero_()
        for p, start in zip(self.params, self._offsets, strict=True):
            if p.grad is not None:
                flat_grad[start : start + p.numel()].copy_(p.grad.reshape(-1))
        return flat_grad

    @torch.no_grad()
    def step(self) -> None:
        """Average gradients (all-reduce or reduce-scatter), step this rank's shard, all-gather the parameters."""
        flat_grad = self._flat_grad()  # (padded,)
        begin = self.rank * self.shard_numel
        if self.stage == 1:
            comm.all_reduce(flat_grad, op="avg", group=self.group, algorithm=self.algorithm)
            self.shard.grad = flat_grad[begin : begin + self.shard_numel]
        else:
            comm.reduce_scatter(self._grad, flat_grad, op="avg", group=self.group, algorithm=self.algorithm)
            self.shard.grad = self._grad
            for p in self.params:  # stage 2 keeps only the gradient shard
                p.grad = None
        self.optimizer.step()
        # The shard is a view of self.flat, so all_gather gets a copy of it as input.
        comm.all_gather(self.flat, self.shard.detach().clone(), group=self.group, algorithm=self.algorithm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def memory_report(self) -> ZeroMemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds, against plain data parallel.

        Optimizer state is what the wrapped optimizer holds now (Adam builds it at the first step); plain data
        parallel would hold the same per-element state for every element instead of one shard. Gradient bytes
        count the buffer kept between steps (stage 1: every element; stage 2: the shard), as in the paper's
        accounting (section 5).
        """
        element = self.flat.element_size()
        state_nbytes, dp_state_nbytes = 0, 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if not isinstance(value, torch.Tensor):
                    continue
                nbytes = value.numel() * value.element_size()
                state_nbytes += nbytes
                per_element = value.numel() == self.shard_numel
                dp_state_nbytes += self.numel * value.element_size() if per_element else nbytes
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
