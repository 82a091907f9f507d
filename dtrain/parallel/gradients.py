"""Gradients of a model split over data, pipeline and tensor parallel ranks: averaging, the whole model's norm,
clipping.

The norm of the whole model's gradient is a sum over every rank of the squares of the gradient elements it
holds, each weighted by one over the number of ranks holding the same element: a parameter replicated over the
tensor-parallel group is held ``tp`` times, a plain data-parallel gradient ``dp`` times, a tied embedding's copy
on the last pipeline stage duplicates the first stage's (Megatron-LM counts replicated parameters once in its
``clip_grad_norm``; Shoeybi et al. 2019, Narayanan et al. 2021). One all-reduce of the weighted scalar over
the grid and a square root give the norm that ``torch.nn.utils.clip_grad_norm_`` computes on one device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dtrain import comm

__all__ = ["average_flat", "grad_square_sum", "scale_grads", "sum_over_groups"]


def grad_square_sum(params: Sequence[nn.Parameter], weight_of: Callable[[nn.Parameter], float]) -> torch.Tensor:
    """The 0-d float32 sum over ``params`` of ``weight_of(p) * (p.grad ** 2).sum()`` (a missing gradient adds 0).

    Parameters of equal weight are taken together by one multi-tensor norm (``torch._foreach_norm``, what
    ``clip_grad_norm_`` uses), so the sum costs a few kernels however many parameters there are; nothing
    leaves the device."""
    total = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    by_weight: dict[float, list[torch.Tensor]] = {}
    for p in params:
        weight = weight_of(p)
        if p.grad is not None and weight:
            by_weight.setdefault(weight, []).append(p.grad.detach())
    for weight, grads in by_weight.items():
        norms = torch._foreach_norm(grads, 2.0)
        total += weight * torch.stack([n.float() for n in norms]).square().sum()
    return total


def sum_over_groups(value: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """``value`` summed in place over each group in turn (groups of one rank skipped): over the whole grid when
    the groups are its dp, pp and tp groups."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            comm.all_reduce(value, op="sum", group=group)
    return value


def scale_grads(params: Sequence[nn.Parameter], coef: float | torch.Tensor) -> None:
    """Multiply every existing ``p.grad`` by ``coef`` (a number, or a 0-d tensor on the gradients' device, so
    that nothing waits for the device) in place."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or (not isinstance(coef, torch.Tensor) and coef == 1.0):
        return
    torch._foreach_mul_(grads, coef.to(grads[0].dtype) if isinstance(coef, torch.Tensor) else coef)


def average_flat(
    params: Sequence[nn.Parameter], group, *, algorithm: str = "auto", reduce_dtype: torch.dtype | None = None
) -> None:
    """One all-reduce of ``params``' flattened gradients (a missing one counts as zero) averaged over ``group``,
    in ``reduce_dtype`` where given (else the gradients' dtype); each ``p.grad`` becomes its slice of the result.
    A parameter that has no gradient on any rank of the group keeps none, as on one process: the message ends in
    one flag a parameter (1 where this rank has its gradient), read back only by a rank that missed one."""
    missing = [i for i, p in enumerate(params) if p.grad is None]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flags = torch.ones(len(grads), dtype=grads[0].dtype, device=grads[0].device)
    if missing:
        flags[missing] = 0.0
    flat = torch.cat([*(g.reshape(-1) for g in grads), flags])
    wire = flat.to(reduce_dtype) if reduce_dtype is not None and reduce_dtype != flat.dtype else flat
    comm.all_reduce(wire, op="avg", group=group, algorithm=algorithm)
    if wire is not flat:
        flat.copy_(wire)
    unused = set()
    if missing and not (flat.is_cuda and torch.cuda.is_current_stream_capturing()):
        seen = flat[flat.numel() - len(grads) :][missing].tolist()
        unused = {i for i, flag in zip(missing, seen, strict=True) if flag == 0}
    offset = 0
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        p.grad = None if i in unused else flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
