"""The Triton kernel of :mod:`dtrain.comm.peer.kernels` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["exchange_kernel", "gather_kernel", "pull_kernel"]


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


@triton.jit
def _barrier(pads, rank, slot, spins, WORLD: tl.constexpr, LANES: tl.constexpr):
    """Every rank's program ``slot`` has reached this point, and the writes this program made before it are
    visible to theirs: torch's signal-pad protocol (rank ``r`` of program ``s`` signals slot ``s * WORLD + r`` of
    every peer's pad by a compare-and-swap 0 -> 1 with release semantics, then takes each peer's signal from its
    own pad by 1 -> 0 with acquire semantics, at system scope), the peers' signals sent and taken by as many
    threads at once. A signal a peer has not yet taken is retried; after ``spins`` rounds (the host's watchdog has
    reported the stall by then) the program faults, as torch's device barrier traps: the process fails at its next
    CUDA call rather than go on with the pads out of step."""
    lane = tl.arange(0, LANES)
    live = lane < WORLD
    peer = tl.where(live, lane, 0)
    slots = slot.to(tl.int64) * WORLD
    send = tl.load(pads + peer).to(tl.pointer_type(tl.int32)) + slots + rank
    own = tl.load(pads + rank).to(tl.pointer_type(tl.int32)) + slots + peer
    zero = tl.zeros([LANES], tl.int32)
    one = zero + 1
    never = zero - 1  # no slot holds -1: a compare-and-swap with it on both sides reads and writes nothing
    tl.debug_barrier()  # every thread's writes before the signal that releases them
    old = tl.atomic_cas(send, tl.where(live, zero, never), tl.where(live, one, never), "release", "sys")
    pending = live & (old != 0)
    t = 0
    while (tl.max(pending.to(tl.int32), 0) > 0) & (t < spins):
        old = tl.atomic_cas(send, tl.where(pending, zero, never), tl.where(pending, one, never), "release", "sys")
        pending = pending & (old != 0)
        t += 1
    old = tl.atomic_cas(own, tl.where(live, one, never), tl.where(live, zero, never), "acquire", "sys")
    waiting = live & (old != 1)
    t = 0
    while (tl.max(waiting.to(tl.int32), 0) > 0) & (t < spins):
        old = tl.atomic_cas(own, tl.where(waiting, one, never), tl.where(waiting, zero, never), "acquire", "sys")
        waiting = waiting & (old != 1)
        t += 1
    if tl.max((pending | waiting).to(tl.int32), 0) > 0:  # a peer never came: read far outside any mapping
        tl.store(pads + rank, tl.load(pads + (1 << 40)))
    tl.debug_barrier()  # every thread reads after the signals that were taken


@triton.jit
def _copy_in(window, inp, n64, pid, programs, chunks, offs, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's chunks of the ``BLOCKS`` blocks of ``n64`` elements of ``inp`` into ``window``."""
    c = pid
    while c < chunks:  # a while loop: Triton's interpreter takes no range with tensor bounds
        i = c.to(tl.int64) * BLOCK + offs
        m = i < n64
        for k in tl.static_range(BLOCKS):
            tl.store(window + k * n64 + i, tl.load(inp + k * n64 + i, mask=m), mask=m)
        c += programs


@triton.jit(do_not_specialize=["rank", "at", "n", "spins", "root"])
def exchange_kernel(
    ptrs, pads, out, inp, rank, at, n, spins, root,
    WORLD: tl.constexpr, LANES: tl.constexpr, BLOCKS: tl.constexpr, FORM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """A one-pass collective in one kernel, through every rank's window (addresses in ``ptrs``) and signal pad
    (``pads``): ``inp`` (``BLOCKS`` blocks of ``n`` elements) into this rank's window at element ``at``; one
    barrier; then by ``FORM``:

    - 0, all-gather (``BLOCKS`` = 1) or all-to-all (``BLOCKS`` = ``WORLD``): block ``r`` of ``out`` = the ``n``
      elements of rank ``r``'s window at ``at``, or at its block ``rank``;
    - 1, broadcast (``BLOCKS`` = 1): only rank ``root`` copies in, and every other rank's ``out`` = the root's
      ``n`` elements;
    - 2, reduce-scatter (``BLOCKS`` = ``WORLD``): ``out`` = the sum over the ranks of block ``rank`` of their
      windows, in rank order, accumulated in float32;
    - 3, all-reduce (``BLOCKS`` = 1, the one-shot form): ``out`` = the sum over the ranks of their ``n`` elements,
      in rank order, accumulated in float32 (``out`` may be ``inp``: a program reads its chunks of ``inp`` before
      the barrier and writes them after).

    Program ``p`` copies in and reads out the same chunks, ``p``, ``p + programs``, ... of every block, and the
    barrier is between program ``p`` of every rank: what a program reads from a peer is what the peer's program of
    the same number wrote."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n64 = n.to(tl.int64)
    at64 = at.to(tl.int64)
    chunks = tl.cdiv(n, BLOCK)
    offs = tl.arange(0, BLOCK)
    mine = tl.load(ptrs + rank).to(tl.pointer_type(out.dtype.element_ty))
    if FORM != 1:  # noqa: SIM114 (Triton takes no `or` of a constant and a tensor)
        _copy_in(mine + at64, inp, n64, pid, programs, chunks, offs, BLOCKS, BLOCK)
    elif rank == root:
        _copy_in(mine + at64, inp, n64, pid, programs, chunks, offs, BLOCKS, BLOCK)
    _barrier(pads, rank, pid, spins, WORLD, LANES)
    if FORM == 0:
        source = at64 + (rank * n64 if BLOCKS > 1 else 0)
        c = pid
        while c < chunks:
            i = c.to(tl.int64) * BLOCK + offs
            m = i < n64
            for r in tl.static_range(WORLD):
                peer = tl.load(ptrs + r).to(tl.pointer_type(out.dtype.element_ty))
                tl.store(out + r * n64 + i, tl.load(peer + source + i, mask=m), mask=m)
            c += programs
    elif FORM == 1:
        if rank != root:
            peer = tl.load(ptrs + root).to(tl.pointer_type(out.dtype.element_ty))
            c = pid
            while c < chunks:
                i = c.to(tl.int64) * BLOCK + offs
                m = i < n64
                tl.store(out + i, tl.load(peer + at64 + i, mask=m), mask=m)
                c += programs
    else:
        source = at64 + (rank * n64 if FORM == 2 else 0)
        c = pid
        while c < chunks:
            i = c.to(tl.int64) * BLOCK + offs
            m = i < n64
            acc = tl.zeros([BLOCK], tl.float32)
            for r in tl.static_range(WORLD):
                peer = tl.load(ptrs + r).to(tl.pointer_type(out.dtype.element_ty))
                acc += tl.load(peer + source + i, mask=m, other=0).to(tl.float32)
            tl.store(out + i, acc.to(out.dtype.element_ty), mask=m)
            c += programs
