"""The Triton kernel of :mod:`dtrain.comm.peer.kernels` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["pull_kernel"]


@triton.jit
def _combine(a, b, OP: tl.constexpr):
    if OP == 0:
        return a + b
    elif OP == 1:
        return a * b
    elif OP == 2:
        return tl.maximum(a, b)
    else:
        return tl.minimum(a, b)


@triton.jit
def pull_kernel(
    out0, out1, base, s0, s1, s2, n,
    HAS_OUT1: tl.constexpr, HAS_BASE: tl.constexpr, NSRC: tl.constexpr, OP: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out0`` (and ``out1``) = base (op) s0 (op) s1 (op) s2 over ``n`` elements; half types in float32."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    acc = tl.load(s0 + i, mask=m)
    if UPCAST:
        acc = acc.to(tl.float32)
    if NSRC > 1:
        v = tl.load(s1 + i, mask=m)
        if UPCAST:
            v = v.to(tl.float32)
        acc = _combine(acc, v, OP)
    if NSRC > 2:
        v = tl.load(s2 + i, mask=m)
        if UPCAST:
            v = v.to(tl.float32)
        acc = _combine(acc, v, OP)
    if HAS_BASE:
        v = tl.load(base + i, mask=m)
        if UPCAST:
            v = v.to(tl.float32)
        acc = _combine(v, acc, OP)
    acc = acc.to(out0.dtype.element_ty)
    tl.store(out0 + i, acc, mask=m)
    if HAS_OUT1:
        tl.store(out1 + i, acc, mask=m)


@triton.jit(do_not_specialize=["offset", "n", "root"])
def gather_kernel(ptrs, out, offset, n, root, ONE_SOURCE: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``r`` of ``out`` (``n`` elements) = ``n`` elements at ``offset`` of rank ``r``'s window (of rank
    ``root``'s for every block, with ``ONE_SOURCE``), the windows' addresses read from ``ptrs`` on the device."""
    r = tl.program_id(1)
    source = root if ONE_SOURCE else r
    base = tl.load(ptrs + source).to(tl.pointer_type(out.dtype.element_ty))
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + r.to(tl.int64) * n + i, tl.load(base + offset + i, mask=m), mask=m)
