"""Causal flash attention that drops its probabilities by :mod:`dtrain.models.dropout`'s hash, inside the kernel.

The fused kernels of ``F.scaled_dot_product_attention`` draw their dropout from the device's generator and take
no mask, so attention whose probabilities a :class:`~dtrain.models.dropout.Dropout` drops would otherwise be
written out: ``(B, H, T, T)`` scores, a softmax, the mask, a product with the values. Here the attention runs as
FlashAttention-2 computes it (Dao 2023): a program holds a block of queries and streams the keys and values past
it in blocks, keeping each row's running maximum and sum of exponentials, so the probabilities live only in
registers. Each probability ``P[b, h, i, j]`` the hash drops is left out of the product with the values and the
rest are scaled by ``1 / (1 - p)``, while the softmax's sum counts them all: the written-out form's softmax, then
its dropout.

The mask is the :class:`~dtrain.models.dropout.Dropout` module's on a ``(B, H, T, T)`` tensor with offsets
``(0, head_offset)``, bit for bit: the hash of the step's key plus the site's salt, mixed with the row in the
global batch (the batch index plus the first row of :func:`dtrain.models.dropout.rows`), the head's index among
the model's heads, the query's position and the key's position, in that order, with the 32-bit mixer of
:mod:`dtrain.models.dropout_kernel`. A program mixes the step's key, the row and the head once, the query's
position once a query and the key's position once a probability. A value is kept where its hash is at least
``round(p 2**32)``.

Backward (Dao 2023, algorithm 2) recomputes the probabilities from each row's log-sum-exp, saved by forward, and
draws the mask again from the key and rows its forward saw (the 24-byte state, copied at forward), so nothing of
size ``T x T`` is kept. One program a block of keys and a key-value head computes its dK and dV, summing over the
query heads that share it (grouped-query attention without repeated copies or atomic adds); one a block of
queries and a query head computes dQ.

Forward and backward are one operator each (``torch.ops.dtrain``), so ``torch.compile`` calls them as they are
and a recorded CUDA graph replays them, reading each step's key from the device; the forward's name ends in
``_flash_attention``, so selective recomputation counts it as attention. Triton (Tillet et al. 2019) compiles the
kernels; inputs in float32 (products in full float32, not TF32), bfloat16 or float16, head dimensions up to 128.
"""

from __future__ import annotations

import math

import torch

from dtrain.models import dropout as dropouts

try:
    import triton
    import triton.language as tl

    from dtrain.models.dropout_kernel import _mix
except ImportError:  # a CPU build of torch: the written-out attention serves
    triton = None

__all__ = ["MAX_HEAD_DIM", "attention", "available", "supports"]

MAX_HEAD_DIM = 128
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether the kernels can run here (Triton importable)."""
    return triton is not None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`attention` takes these ``(B, H, T, D)`` queries and ``(B, H_kv, T, D)`` keys and values:
    on a CUDA device with Triton, one dtype among float32, bfloat16 and float16, ``D`` at most
    :data:`MAX_HEAD_DIM`, ``H`` a multiple of ``H_kv``, as many keys as queries."""
    return (
        triton is not None
        and q.is_cuda
        and q.dim() == k.dim() == v.dim() == 4
        and q.dtype in _DTYPES
        and q.dtype == k.dtype == v.dtype
        and q.shape[0] == k.shape[0] == v.shape[0]
        and q.shape[2] == k.shape[2] == v.shape[2]
        and q.shape[3] == k.shape[3] == v.shape[3] <= MAX_HEAD_DIM
        and k.shape[1] == v.shape[1]
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, salt: torch.Tensor, head_offset: int = 0
) -> torch.Tensor:
    """Causal attention ``(B, H, T, D)`` of queries ``q`` over keys and values ``k``, ``v`` ``(B, H_kv, T, D)``
    (each key-value head serving ``H / H_kv`` consecutive query heads), softmax scale ``1 / sqrt(D)``, its
    probabilities dropped at probability ``p`` (in ``[0, 1)``) as ``Dropout(p)`` with salt ``salt`` (the site's
    int64 buffer) drops a ``(B, H, T, T)`` tensor at offsets ``(0, head_offset)`` under the current step's key
    and rows (:mod:`dtrain.models.dropout`). :func:`supports` says which inputs it takes."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attention dropout: expected p in [0, 1), got {p!r}")
    seen = dropouts.state(q.device).clone()  # this forward's key and rows: backward draws the mask from them
    cut = dropouts.threshold(p)
    out, _ = torch.ops.dtrain.hash_dropout_flash_attention(q, k, v, seen, salt, cut, 1.0 / (1.0 - p), head_offset)
    return out


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _head_hash(state_ptr, salt_ptr, b, head):
        """The hash of the key, the salt, batch row ``b`` (plus the first row) and the model's head ``head``."""
        key = tl.load(state_ptr).to(tl.uint32)
        first = (tl.load(state_ptr + 1) + tl.load(state_ptr + 2)).to(tl.uint32)
        salt = tl.load(salt_ptr).to(tl.uint32)
        x = _mix(key + salt)
        x = _mix(x + (b.to(tl.uint32) + first))
        return _mix(x + head.to(tl.uint32))

    @triton.jit
    def _forward_blocks(
        acc,
        l_i,
        m_i,
        q,
        rows_hash,
        k_ptrs,
        v_ptrs,
        offs_m,
        lo,
        hi,
        T,
        D,
        skt,
        svt,
        qk_scale,
        cut,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DIAGONAL: tl.constexpr,
        DROP: tl.constexpr,
        EVEN_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        offs_d = tl.arange(0, BLOCK_D)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kt_mask = offs_n[None, :] < T
            v_mask = offs_n[:, None] < T
            if not EVEN_D:
                kt_mask = kt_mask & (offs_d[:, None] < D)
                v_mask = v_mask & (offs_d[None, :] < D)
            kt = tl.load(k_ptrs + start * skt, mask=kt_mask, other=0.0)  # (BLOCK_D, BLOCK_N)
            s = _dot(q, kt, tl.zeros((q.shape[0], BLOCK_N), dtype=tl.float32), IEEE) * qk_scale
            if DIAGONAL:  # the block that crosses the diagonal, or the last one: the future and the end masked
                s = tl.where((offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < T), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            prob = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(prob, 1)
            acc = acc * alpha[:, None]
            if DROP:
                kept = _mix(rows_hash[:, None] + offs_n[None, :].to(tl.uint32)) >= cut
                prob = tl.where(kept, prob, 0.0)
            v = tl.load(v_ptrs + start * svt, mask=v_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
            acc = _dot(prob.to(v.dtype), v, acc, IEEE)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit(do_not_specialize=["cut", "head_offset"])
    def _forward(
        Q,
        K,
        V,
        Out,
        LSE,
        STATE,
        SALT,
        sqb,
        sqh,
        sqt,
        skb,
        skh,
        skt,
        svb,
        svh,
        svt,
        sob,
        soh,
        sot,
        H,
        GROUP,
        T,
        D,
        head_offset,
        cut,
        qk_scale,
        out_scale,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DROP: tl.constexpr,
        EVEN_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest rows first
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        hk = h // GROUP
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_mask = offs_m[:, None] < T
        if not EVEN_D:
            q_mask = q_mask & (offs_d[None, :] < D)
        q = tl.load(
            Q + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=q_mask, other=0.0
        )
        k_ptrs = K + b.to(tl.int64) * skb + hk * skh + offs_n[None, :] * skt + offs_d[:, None]
        v_ptrs = V + b.to(tl.int64) * svb + hk * svh + offs_n[:, None] * svt + offs_d[None, :]
        rows_hash = offs_m.to(tl.uint32)
        cut_u = cut.to(tl.uint32)
        if DROP:
            rows_hash = _mix(_head_hash(STATE, SALT, b, h + head_offset) + offs_m.to(tl.uint32))
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        # the key blocks wholly before the query block: no mask; then the blocks that cross the diagonal
        acc, l_i, m_i = _forward_blocks(
            acc, l_i, m_i, q, rows_hash, k_ptrs, v_ptrs, offs_m, 0, start_m, T, D, skt, svt, qk_scale, cut_u,
            BLOCK_N, BLOCK_D, False, DROP, EVEN_D, IEEE,
        )  # fmt: skip
        acc, l_i, m_i = _forward_blocks(
            acc, l_i, m_i, q, rows_hash, k_ptrs, v_ptrs, offs_m, start_m, tl.minimum(start_m + BLOCK_M, T), T, D,
            skt, svt, qk_scale, cut_u, BLOCK_N, BLOCK_D, True, DROP, EVEN_D, IEEE,
        )  # fmt: skip
        out = acc * (out_scale / l_i)[:, None]
        tl.store(
            Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=q_mask,
        )
        tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)

    @triton.jit
    def _delta(Out, DO, DELTA, sob, soh, sot, sdb, sdh, sdt, H, T, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """Each row's sum of dO * O, the softmax backward's correction (dropout included: O is the dropped one)."""
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_m[:, None] < T) & (offs_d[None, :] < D)
        o = tl.load(
            Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], mask=mask, other=0.0
        )
        do = tl.load(
            DO + b.to(tl.int64) * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=mask, other=0.0
        )
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)

    @triton.jit
    def _key_blocks(
        dk,
        dv,
        k,
        v,
        q_ptrs,
        do_ptrs,
        lse_ptr,
        delta_ptr,
        head_hash,
        offs_n,
        lo,
        hi,
        T,
        D,
        sqt,
        sdt,
        qk_scale,
        out_scale,
        cut,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DIAGONAL: tl.constexpr,
        DROP: tl.constexpr,
        EVEN_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        offs_d = tl.arange(0, BLOCK_D)
        for start in range(lo, hi, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            qt_mask = offs_m[None, :] < T
            do_mask = offs_m[:, None] < T
            if not EVEN_D:
                qt_mask = qt_mask & (offs_d[:, None] < D)
                do_mask = do_mask & (offs_d[None, :] < D)
            qt = tl.load(q_ptrs + start * sqt, mask=qt_mask, other=0.0)  # (BLOCK_D, BLOCK_M)
            lse = tl.load(lse_ptr + offs_m, mask=offs_m < T, other=float("inf"))  # rows past the end: P = 0
            st = _dot(k, qt, tl.zeros((k.shape[0], BLOCK_M), dtype=tl.float32), IEEE) * qk_scale  # (N, M)
            pt = tl.math.exp2(st - lse[None, :])
            if DIAGONAL:
                pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
            do = tl.load(do_ptrs + start * sdt, mask=do_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
            dpt = _dot(v, tl.trans(do), tl.zeros((k.shape[0], BLOCK_M), dtype=tl.float32), IEEE)
            if DROP:
                rows_hash = _mix(head_hash + offs_m.to(tl.uint32))
                kept = _mix(rows_hash[None, :] + offs_n[:, None].to(tl.uint32)) >= cut
                dv = _dot(tl.where(kept, pt * out_scale, 0.0).to(do.dtype), do, dv, IEEE)
                dpt = tl.where(kept, dpt * out_scale, 0.0)
            else:
                dv = _dot(pt.to(do.dtype), do, dv, IEEE)
            delta = tl.load(delta_ptr + offs_m, mask=offs_m < T, other=0.0)
            dst = pt * (dpt - delta[None, :])
            dk = _dot(dst.to(qt.dtype), tl.trans(qt), dk, IEEE)
        return dk, dv

    @triton.jit(do_not_specialize=["cut", "head_offset"])
    def _backward_kv(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DK,
        DV,
        STATE,
        SALT,
        sqb,
        sqh,
        sqt,
        skb,
        skh,
        skt,
        svb,
        svh,
        svt,
        sdb,
        sdh,
        sdt,
        sdkb,
        sdkh,
        sdkt,
        sdvb,
        sdvh,
        sdvt,
        H,
        GROUP,
        T,
        D,
        head_offset,
        cut,
        qk_scale,
        sm_scale,
        out_scale,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DROP: tl.constexpr,
        EVEN_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        start_n = tl.program_id(0) * BLOCK_N
        bhk = tl.program_id(1)
        h_kv = H // GROUP
        b = bhk // h_kv
        hk = bhk % h_kv
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        kv_mask = offs_n[:, None] < T
        if not EVEN_D:
            kv_mask = kv_mask & (offs_d[None, :] < D)
        k = tl.load(
            K + b.to(tl.int64) * skb + hk * skh + offs_n[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0
        )
        v = tl.load(
            V + b.to(tl.int64) * svb + hk * svh + offs_n[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0
        )
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        cut_u = cut.to(tl.uint32)
        for g in range(GROUP):  # the query heads this key-value head serves
            h = hk * GROUP + g
            head_hash = h.to(tl.uint32)
            if DROP:
                head_hash = _head_hash(STATE, SALT, b, h + head_offset)
            q_ptrs = Q + b.to(tl.int64) * sqb + h * sqh + offs_m[None, :] * sqt + offs_d[:, None]
            do_ptrs = DO + b.to(tl.int64) * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :]
            lse_ptr = LSE + (b * H + h).to(tl.int64) * T
            delta_ptr = DELTA + (b * H + h).to(tl.int64) * T
            # the query blocks that cross the diagonal (masked), then those wholly after it
            dk, dv = _key_blocks(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, head_hash, offs_n, start_n,
                tl.minimum(start_n + BLOCK_N, T), T, D, sqt, sdt, qk_scale, out_scale, cut_u, BLOCK_M, BLOCK_D,
                True, DROP, EVEN_D, IEEE,
            )  # fmt: skip
            dk, dv = _key_blocks(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, head_hash, offs_n, start_n + BLOCK_N, T, T, D,
                sqt, sdt, qk_scale, out_scale, cut_u, BLOCK_M, BLOCK_D, False, DROP, EVEN_D, IEEE,
            )  # fmt: skip
        dk = dk * sm_scale
        tl.store(
            DK + b.to(tl.int64) * sdkb + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
            dk.to(DK.dtype.element_ty),
            mask=kv_mask,
        )
        tl.store(
            DV + b.to(tl.int64) * sdvb + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
            dv.to(DV.dtype.element_ty),
            mask=kv_mask,
        )

    @triton.jit
    def _query_blocks(
        dq,
        q,
        do,
        lse,
        delta,
        rows_hash,
        kt_ptrs,
        vt_ptrs,
        offs_m,
        lo,
        hi,
        T,
        D,
        skt,
        svt,
        qk_scale,
        out_scale,
        cut,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DIAGONAL: tl.constexpr,
        DROP: tl.constexpr,
        EVEN_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        offs_d = tl.arange(0, BLOCK_D)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask = offs_n[None, :] < T
            if not EVEN_D:
                mask = mask & (offs_d[:, None] < D)
            kt = tl.load(kt_ptrs + start * skt, mask=mask, other=0.0)  # (BLOCK_D, BLOCK_N)
            vt = tl.load(vt_ptrs + start * svt, mask=mask, other=0.0)
            s = _dot(q, kt, tl.zeros((q.shape[0], BLOCK_N), dtype=tl.float32), IEEE) * qk_scale
            prob = tl.math.exp2(s - lse[:, None])
            if DIAGONAL:
                prob = tl.where((offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < T), prob, 0.0)
            dp = _dot(do, vt, tl.zeros((q.shape[0], BLOCK_N), dtype=tl.float32), IEEE)
            if DROP:
                kept = _mix(rows_hash[:, None] + offs_n[None, :].to(tl.uint32)) >= cut
                dp = tl.where(kept, dp * out_scale, 0.0)
            ds = prob * (dp - delta[:, None])
            dq = _dot(ds.to(kt.dtype), tl.trans(kt), dq, IEEE)
        return dq

    @triton.jit(do_not_specialize=["cut", "head_offset"])
    def _backward_q(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        STATE,
        SALT,
        sqb,
        sqh,
        sqt,
        skb,
        skh,
        skt,
        svb,
        svh,
        svt,
        sdb,
        sdh,
        sdt,
        sdqb,
        sdqh,
        sdqt,
        H,
        GROUP,
        T,
        D,
        head_offset,
        cut,
        qk_scale,
        sm_scale,
        out_scale,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DROP: tl.constexpr,
        EVEN_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        hk = h // GROUP
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask = offs_m[:, None] < T
        if not EVEN_D:
            mask = mask & (offs_d[None, :] < D)
        q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=mask, other=0.0)
        do = tl.load(
            DO + b.to(tl.int64) * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=mask, other=0.0
        )
        lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=float("inf"))
        delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
        kt_ptrs = K + b.to(tl.int64) * skb + hk * skh + offs_n[None, :] * skt + offs_d[:, None]
        vt_ptrs = V + b.to(tl.int64) * svb + hk * svh + offs_n[None, :] * svt + offs_d[:, None]
        rows_hash = offs_m.to(tl.uint32)
        cut_u = cut.to(tl.uint32)
        if DROP:
            rows_hash = _mix(_head_hash(STATE, SALT, b, h + head_offset) + offs_m.to(tl.uint32))
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        dq = _query_blocks(
            dq, q, do, lse, delta, rows_hash, kt_ptrs, vt_ptrs, offs_m, 0, start_m, T, D, skt, svt, qk_scale,
            out_scale, cut_u, BLOCK_N, BLOCK_D, False, DROP, EVEN_D, IEEE,
        )  # fmt: skip
        dq = _query_blocks(
            dq, q, do, lse, delta, rows_hash, kt_ptrs, vt_ptrs, offs_m, start_m, tl.minimum(start_m + BLOCK_M, T),
            T, D, skt, svt, qk_scale, out_scale, cut_u, BLOCK_N, BLOCK_D, True, DROP, EVEN_D, IEEE,
        )  # fmt: skip
        dq = dq * sm_scale
        tl.store(
            DQ + b.to(tl.int64) * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
            dq.to(DQ.dtype.element_ty),
            mask=mask,
        )


# Block shapes (queries, keys, warps, pipeline stages) by kernel, element size and head dimension. For 16 bits, the
# fastest on an H200 of the sweep of benchmarks/gpu/attention_kernel_configs.py (blocks of 16 to 128, 4 or 8 warps,
# 2 or 3 stages; GPT-2 small's attention at D = 64, 8 x 12 heads x 1,024 tokens, and a Llama's at D = 128,
# 2 x 32 heads x 2,048 tokens; benchmarks/results/attention_kernel_configs-{gpt2,llama}-h200x1.jsonl), where it
# beat the shape kept by more than the runs' spread. The forward's and dQ's query blocks are multiples of their key
# blocks, dK/dV's key blocks of their query blocks, so that the blocks before (after) the diagonal need no mask.
_CONFIGS = {
    ("forward", 2, 64): (64, 64, 4, 3),
    ("forward", 2, 128): (64, 64, 4, 3),
    ("forward", 4, 64): (64, 32, 4, 2),
    ("forward", 4, 128): (64, 32, 4, 2),
    ("kv", 2, 64): (32, 64, 4, 2),
    ("kv", 2, 128): (32, 64, 4, 2),
    ("kv", 4, 64): (32, 64, 4, 2),
    ("kv", 4, 128): (16, 32, 4, 2),
    ("q", 2, 64): (64, 64, 4, 3),
    ("q", 2, 128): (64, 32, 4, 3),
    ("q", 4, 64): (64, 32, 4, 2),
    ("q", 4, 128): (32, 32, 4, 2),
}


def _config(kind: str, dtype: torch.dtype, block_d: int) -> tuple[int, int, int, int]:
    return _CONFIGS[(kind, 4 if dtype == torch.float32 else 2, max(block_d, 64))]


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _gradient_like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor for ``x``'s gradient: ``x``'s layout where its last dimension is dense, else contiguous."""
    return torch.empty_like(x) if x.stride(-1) == 1 else x.new_empty(x.shape)


@torch.library.custom_op("dtrain::hash_dropout_flash_attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    salt: torch.Tensor,
    cut: int,
    scale: float,
    head_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, the log2-sum-exp2 of each row's scaled scores) of :func:`attention`; ``seen`` the int64 key and
    rows, ``cut`` the threshold, ``scale`` ``1 / (1 - p)``."""
    q, k, v = _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v)
    b, h, t, d = q.shape
    out = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)  # (B, H, T, D) over (B, T, H, D)
    lse = torch.empty((b, h, t), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    block_d = _block_d(d)
    block_m, block_n, warps, stages = _config("forward", q.dtype, block_d)
    sm_scale = 1.0 / math.sqrt(d)
    _forward[(triton.cdiv(t, block_m), b * h)](
        q, k, v, out, lse, seen, salt,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        h, h // k.shape[1], t, d, head_offset, cut, sm_scale * math.log2(math.e), scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DROP=cut > 0, EVEN_D=block_d == d,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse


@_attention_op.register_fake
def _(q, k, v, seen, salt, cut, scale, head_offset):  # noqa: ANN001, ANN202
    b, h, t, d = q.shape
    out = q.new_empty((b, t, h, d)).transpose(1, 2)
    return out, q.new_empty((b, h, t), dtype=torch.float32)


@torch.library.custom_op("dtrain::hash_dropout_flash_attention_backward", mutates_args=())
def _attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seen: torch.Tensor,
    salt: torch.Tensor,
    cut: int,
    scale: float,
    head_offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`attention`'s output ``out`` with respect to ``q``, ``k`` and ``v``, given the
    output's gradient ``grad``."""
    dq, dk, dv = _gradient_like(q), _gradient_like(k), _gradient_like(v)
    grad, q, k, v, out = (_last_dim_dense(x) for x in (grad, q, k, v, out))
    b, h, t, d = q.shape
    if q.numel() == 0:
        return dq, dk, dv
    group = h // k.shape[1]
    block_d = _block_d(d)
    ieee, drop, even_d = q.dtype == torch.float32, cut > 0, block_d == d
    sm_scale = 1.0 / math.sqrt(d)
    qk_scale = sm_scale * math.log2(math.e)
    delta = torch.empty((b, h, t), dtype=torch.float32, device=q.device)
    _delta[(triton.cdiv(t, 64), b * h)](
        out, grad, delta, out.stride(0), out.stride(1), out.stride(2), grad.stride(0), grad.stride(1),
        grad.stride(2), h, t, d, BLOCK_M=64, BLOCK_D=block_d,
    )  # fmt: skip
    block_m, block_n, warps, stages = _config("kv", q.dtype, block_d)
    _backward_kv[(triton.cdiv(t, block_n), b * k.shape[1])](
        q, k, v, grad, lse, delta, dk, dv, seen, salt,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), grad.stride(0), grad.stride(1), grad.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        h, group, t, d, head_offset, cut, qk_scale, sm_scale, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DROP=drop, EVEN_D=even_d, IEEE=ieee,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    block_m, block_n, warps, stages = _config("q", q.dtype, block_d)
    _backward_q[(triton.cdiv(t, block_m), b * h)](
        q, k, v, grad, lse, delta, dq, seen, salt,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), grad.stride(0), grad.stride(1), grad.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        h, group, t, d, head_offset, cut, qk_scale, sm_scale, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DROP=drop, EVEN_D=even_d, IEEE=ieee,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv


@_attention_backward_op.register_fake
def _(grad, q, k, v, out, lse, seen, salt, cut, scale, head_offset):  # noqa: ANN001, ANN202
    return _gradient_like(q), _gradient_like(k), _gradient_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, seen, salt, cut, scale, head_offset = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seen, salt)
    ctx.cut, ctx.scale, ctx.head_offset = cut, scale, head_offset


def _backward(ctx, grad, _grad_lse):  # noqa: ANN001, ANN202
    q, k, v, out, lse, seen, salt = ctx.saved_tensors
    dq, dk, dv = torch.ops.dtrain.hash_dropout_flash_attention_backward(
        grad, q, k, v, out, lse, seen, salt, ctx.cut, ctx.scale, ctx.head_offset
    )
    return dq, dk, dv, None, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)
