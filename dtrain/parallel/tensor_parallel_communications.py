"""Where tensor parallelism talks to the network: Megatron-LM's conjugate operators as autograd Functions.

Megatron-LM (Shoeybi et al. 2019, section 3, figure 3) makes a transformer layer tensor-parallel with two
operators placed around each parallel block:

- ``f`` (:func:`copy_to_tensor_parallel_region`): identity in the forward pass, all-reduce of the gradient in
  the backward pass; it enters a block whose input is replicated but whose ranks each use part of the weights;
- ``g`` (:func:`reduce_from_tensor_parallel_region`): all-reduce in the forward pass, identity in the backward
  pass; it leaves a block whose ranks each hold a partial sum of the output.

Two more move activations split along the last dimension: :func:`gather_from_tensor_parallel_region`
(all-gather forward, split backward) and :func:`scatter_to_tensor_parallel_region` (split forward, all-gather
backward). Every collective goes through :mod:`dtrain.comm`, with the caller's ``algorithm``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain import comm

__all__ = [
    "all_reduce",
    "all_gather_last_dim",
    "split_last_dim",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
]


def all_reduce(x: torch.Tensor, group, algorithm: str = "auto", op: str = "sum") -> torch.Tensor:
    """A new tensor: ``x`` reduced over ``group`` (``x`` itself is left untouched; no autograd)."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    if dist.get_world_size(group) > 1:
        comm.all_reduce(out, op=op, group=group, algorithm=algorithm)
    return out


def all_gather_last_dim(x: torch.Tensor, group, algorithm: str = "auto") -> torch.Tensor:
    """Every rank's ``x`` of shape (..., k) concatenated rank-major along the last dim: (..., world * k)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x.detach().clone()
    inp = x.detach().contiguous()
    flat = torch.empty(world * inp.numel(), dtype=inp.dtype, device=inp.device)
    comm.all_gather(flat, inp, group=group, algorithm=algorithm)  # (world * prod(...) * k,) rank-major
    blocks = flat.view(world, *inp.shape)  # (world, ..., k): block r is rank r's x
    return blocks.movedim(0, -2).reshape(*inp.shape[:-1], world * inp.shape[-1])  # (..., world * k)


def split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of ``x`` (..., world * k) along the last dim, as a contiguous (..., k) tensor."""
    world = dist.get_world_size(group)
    if x.shape[-1] % world:
        raise ValueError(f"last dim {x.shape[-1]} does not divide evenly by the group size {world}")
    k = x.shape[-1] // world
    rank = dist.get_rank(group)
    return x[..., rank * k : (rank + 1) * k].contiguous()


class _CopyToParallelRegion(torch.autograd.Function):
    """Megatron's ``f``: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.group, ctx.algorithm), None, None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """Megatron's ``g``: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, algorithm: str) -> torch.Tensor:
        return all_reduce(x, group, algorithm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _GatherFromParallelRegion(torch.autograd.Function):
    """Forward all-gather along the last dim, backward keep this rank's block of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, algorithm: str) -> torch.Tensor:
        ctx.group = group
        return all_gather_last_dim(x, group, algorithm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split_last_dim(grad, ctx.group), None, None


class _ScatterToParallelRegion(torch.autograd.Function):
    """Forward keep this rank's block along the last dim, backward all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_last_dim(grad, ctx.group, ctx.algorithm), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group, algorithm: str = "auto") -> torch.Tensor:
    """Megatron's ``f``: ``x`` unchanged; its gradient is summed over ``group`` on the way back."""
    return _CopyToParallelRegion.apply(x, group, algorithm)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group, algorithm: str = "auto") -> torch.Tensor:
    """Megatron's ``g``: ``x`` summed over ``group``; the gradient passes back unchanged."""
    return _ReduceFromParallelRegion.apply(x, group, algorithm)


def gather_from_tensor_parallel_region(x: torch.Tensor, group, algorithm: str = "auto") -> torch.Tensor:
    """(..., k) on each rank -> (..., world * k), rank-major; the gradient is split back to (..., k)."""
    return _GatherFromParallelRegion.apply(x, group, algorithm)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group, algorithm: str = "auto") -> torch.Tensor:
    """(..., world * k) replicated -> this rank's (..., k); the gradient is all-gathered back."""
    return _ScatterToParallelRegion.apply(x, group, algorithm)
