"""The GPU kernel of :mod:`dtrain.models.dropout`: one pass that hashes each value's coordinates, keeps it or
zeroes it, and scales it, forward and backward.

The tensor form of the hash (:func:`dtrain.models.dropout.mix32` over int64 tensors) runs each of its dozen
shifts, products and masks as a pass over the whole tensor; here each value's hash is computed in registers, in
32-bit unsigned arithmetic, whose wrapping products and sums are the tensor form's ``& 0xFFFFFFFF``: the same
bits (``tests/models/test_dropout.py`` compares them on a GPU).
Backward draws the mask again from the key and rows its forward saw (saved, 24 bytes), so no mask is kept for
it. Tensors of up to 4 dimensions, made contiguous; Triton (Tillet et al. 2019) compiles the kernel."""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch: the tensor form serves
    triton = None

__all__ = ["HashDropout", "available", "launch"]

_BLOCK = 1024


def available() -> bool:
    """Whether the kernel can run here (Triton importable)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _mix(x):
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x68E31DA5
        x ^= x >> 16
        x *= 0x1B873593
        return x ^ (x >> 15)

    @triton.jit
    def _hash_dropout(
        x_ptr,
        out_ptr,
        state_ptr,
        salt_ptr,
        n,
        s1,
        s2,
        s3,
        o1,
        o2,
        o3,
        cut,
        scale,
        RANK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        key = tl.load(state_ptr).to(tl.uint32)
        first = (tl.load(state_ptr + 1) + tl.load(state_ptr + 2)).to(tl.uint32)
        salt = tl.load(salt_ptr).to(tl.uint32)
        h = _mix(key + salt)
        # the linear index's coordinates, last dimension fastest; dimension 0 is the batch's rows
        rest = i
        i3 = rest % s3
        rest = rest // s3
        i2 = rest % s2
        rest = rest // s2
        i1 = rest % s1
        i0 = rest // s1
        if RANK == 1:
            i0 = i3
        elif RANK == 2:
            i0 = i2
            i1 = i3
        elif RANK == 3:
            i0 = i1
            i1 = i2
            i2 = i3
        h = _mix(h + (i0.to(tl.uint32) + first))
        if RANK >= 2:
            h = _mix(h + (i1 + o1).to(tl.uint32))
        if RANK >= 3:
            h = _mix(h + (i2 + o2).to(tl.uint32))
        if RANK >= 4:
            h = _mix(h + (i3 + o3).to(tl.uint32))
        x = tl.load(x_ptr + i, mask=inside)
        y = tl.where(h >= cut, x.to(tl.float32) * scale, 0.0)
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=inside)


def launch(
    x: torch.Tensor, st: torch.Tensor, salt: torch.Tensor, cut: int, scale: float, offsets: Sequence[int]
) -> torch.Tensor:
    """``x`` with each value whose hash of key and rows ``st`` (int64 ``[key, outer, inner]``), ``salt`` and
    ``offsets`` is below ``cut`` zeroed and the rest times ``scale``; a new tensor."""
    if x.dtype == torch.float64:
        raise TypeError("the dropout kernel computes in float32; float64 takes the tensor form")
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    rank = x.dim()
    sizes = [1] * (4 - rank) + list(x.shape)  # padded in front: the kernel reads the last `rank`
    offs = [0, *(int(offsets[d]) if d < len(offsets) else 0 for d in range(1, rank))]
    offs = [0] * (4 - rank) + offs
    # under RANK < 4 the kernel shifts its coordinates down, so the offsets go with the dimensions they name
    o = offs[4 - rank + 1 :] + [0] * (4 - rank)
    grid = (triton.cdiv(n, _BLOCK),)
    _hash_dropout[grid](
        x,
        out,
        st,
        salt,
        n,
        sizes[1],
        sizes[2],
        sizes[3],
        o[0],
        o[1],
        o[2],
        cut,
        scale,
        RANK=rank,
        BLOCK=_BLOCK,
    )
    return out


class HashDropout(torch.autograd.Function):
    """Forward and backward by :func:`launch`; backward redraws the mask from the key and rows saved at forward."""

    @staticmethod
    def forward(ctx, x, st, salt, cut, scale, offsets):  # noqa: ANN001, ANN205
        seen = st.clone()  # the key and rows of this forward: a recomputation or a later rows() changes st
        ctx.save_for_backward(seen, salt)
        ctx.cut, ctx.scale, ctx.offsets = cut, scale, offsets
        return launch(x, seen, salt, cut, scale, offsets)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        seen, salt = ctx.saved_tensors
        return launch(grad, seen, salt, ctx.cut, ctx.scale, ctx.offsets), None, None, None, None, None
