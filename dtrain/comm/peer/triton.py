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
    out0, out1, base, s0, s1, s2, n, scale,
    HAS_OUT1: tl.constexpr, HAS_BASE: tl.constexpr, NSRC: tl.constexpr, OP: tl.constexpr,
    UPCAST: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out0`` (and ``out1``) = base (op) s0 (op) s1 (op) s2 over ``n`` elements, times ``scale`` where
    ``SCALED``; half types in float32."""
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
    if SCALED:
        acc = acc * scale
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
      the barrier and writes them after);
    - 4, all-reduce (``BLOCKS`` = ``WORLD``, the two-shot form): block ``rank`` of ``out`` = the sum over the ranks
      of their block ``rank``, as form 2, also written over block ``rank`` of this rank's window (which only
      this rank reads before the second barrier); a second barrier; then every other block of ``out`` from its
      owner's window (``out`` may be ``inp``);
    - 5, broadcast (``BLOCKS`` = 1, relayed): only rank ``root`` copies in; each other rank takes its share of
      the ``n`` elements (``WORLD - 1`` nearly equal shares, one for each rank but the root, in rank order) from
      the root into its ``out`` and its window; a second barrier; then the other shares from the ranks that took
      them. The root's links carry the ``n`` elements once, where form 1's carry them ``WORLD - 1`` times;
    - 6, reduce (``BLOCKS`` = 1): rank ``root``'s ``out`` = the sum over the ranks of their ``n`` elements, as form 3;
      every other rank only copies in (its ``out`` is not written);
    - 7, gather (``BLOCKS`` = 1): rank ``root``'s ``out`` as form 0's all-gather; every other rank only copies in;
    - 8, scatter (``BLOCKS`` = ``WORLD``): only rank ``root`` copies in, and every rank's ``out`` = block ``rank`` of
      the root's window.

    Program ``p`` copies in and reads out the same chunks, ``p``, ``p + programs``, ... of every block (of every
    share), and each barrier is between program ``p`` of every rank: what a program reads from a peer is what the
    peer's program of the same number wrote."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n64 = n.to(tl.int64)
    at64 = at.to(tl.int64)
    chunks = tl.cdiv(n, BLOCK)
    offs = tl.arange(0, BLOCK)
    mine = tl.load(ptrs + rank).to(tl.pointer_type(out.dtype.element_ty))
    if FORM == 5:  # copies in by shares, its own chunks
        _relay(ptrs, pads, out, inp, mine, rank, root, at64, n64, pid, programs, offs, spins, WORLD, LANES, BLOCK)
    elif FORM != 1 and FORM != 8:  # noqa: SIM114 (Triton takes no `or` of a constant and a tensor)
        _copy_in(mine + at64, inp, n64, pid, programs, chunks, offs, BLOCKS, BLOCK)
    elif rank == root:  # the broadcast and the scatter: the root alone puts its input in
        _copy_in(mine + at64, inp, n64, pid, programs, chunks, offs, BLOCKS, BLOCK)
    if FORM != 5:
        _barrier(pads, rank, pid, spins, WORLD, LANES)
    if FORM == 4:
        _two_shot(ptrs, pads, out, mine, rank, at64, n64, pid, programs, chunks, offs, spins, WORLD, LANES, BLOCK)
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
    elif FORM == 2 or FORM == 3:
        source = at64 + (rank * n64 if FORM == 2 else 0)
        c = pid
        while c < chunks:
            i = c.to(tl.int64) * BLOCK + offs
            m = i < n64
            tl.store(out + i, _summed(ptrs, out, source + i, m, WORLD, BLOCK), mask=m)
            c += programs
    elif FORM == 6:  # noqa: SIM102 (Triton takes no `and` of a constant and a tensor)
        if rank == root:
            c = pid
            while c < chunks:
                i = c.to(tl.int64) * BLOCK + offs
                m = i < n64
                tl.store(out + i, _summed(ptrs, out, at64 + i, m, WORLD, BLOCK), mask=m)
                c += programs
    elif FORM == 7:  # noqa: SIM102 (as form 6)
        if rank == root:
            c = pid
            while c < chunks:
                i = c.to(tl.int64) * BLOCK + offs
                m = i < n64
                for r in tl.static_range(WORLD):
                    peer = tl.load(ptrs + r).to(tl.pointer_type(out.dtype.element_ty))
                    tl.store(out + r * n64 + i, tl.load(peer + at64 + i, mask=m), mask=m)
                c += programs
    elif FORM == 8:
        peer = tl.load(ptrs + root).to(tl.pointer_type(out.dtype.element_ty))
        source = at64 + rank * n64
        c = pid
        while c < chunks:
            i = c.to(tl.int64) * BLOCK + offs
            m = i < n64
            tl.store(out + i, tl.load(peer + source + i, mask=m), mask=m)
            c += programs


@triton.jit
def _summed(ptrs, out, at, m, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """The sum over the ranks' windows (addresses in ``ptrs``) of the elements at ``at`` (offsets, ``m`` their
    mask), in rank order, accumulated in float32, as ``out``'s dtype."""
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):
        peer = tl.load(ptrs + r).to(tl.pointer_type(out.dtype.element_ty))
        acc += tl.load(peer + at, mask=m, other=0).to(tl.float32)
    return acc.to(out.dtype.element_ty)


@triton.jit
def _two_shot(
    ptrs, pads, out, mine, rank, at64, n64, pid, programs, chunks, offs, spins,
    WORLD: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Form 4 of :func:`exchange_kernel` after its first barrier: this rank's block summed over the ranks into
    ``out`` and over its own block of the window, a second barrier, every other block read from its owner."""
    own = at64 + rank * n64
    c = pid
    while c < chunks:
        i = c.to(tl.int64) * BLOCK + offs
        m = i < n64
        total = _summed(ptrs, out, own + i, m, WORLD, BLOCK)
        tl.store(out + rank * n64 + i, total, mask=m)
        tl.store(mine + own + i, total, mask=m)
        c += programs
    _barrier(pads, rank, pid, spins, WORLD, LANES)
    c = pid
    while c < chunks:
        i = c.to(tl.int64) * BLOCK + offs
        m = i < n64
        for r in tl.static_range(WORLD):
            peer = tl.load(ptrs + r).to(tl.pointer_type(out.dtype.element_ty))
            theirs = m & (offs * 0 + rank != r)  # a block of the scalar test: Triton's interpreter masks by blocks
            tl.store(out + r * n64 + i, tl.load(peer + at64 + r * n64 + i, mask=theirs), mask=theirs)
        c += programs


@triton.jit
def _relay(
    ptrs, pads, out, inp, mine, rank, root, at64, n64, pid, programs, offs, spins,
    WORLD: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Form 5 of :func:`exchange_kernel`, whole: share ``j`` of the ``n64`` elements (``WORLD - 1`` shares of
    ``share`` elements, the last shorter) belongs to the ``j``-th rank other than the root. The root copies
    ``inp`` into its window, chunk ``c`` of every share by program ``c mod programs`` (the program of every rank
    that reads that chunk, as the barrier needs); a barrier; each other rank copies its share from the root into
    ``out`` and its window; a second barrier; then every rank but the root reads the other shares from their
    ranks' windows."""
    share = (n64 + WORLD - 2) // (WORLD - 1)
    chunks = tl.cdiv(share, BLOCK)
    if rank == root:
        c = pid
        while c < chunks:
            j = c.to(tl.int64) * BLOCK + offs
            for s in tl.static_range(WORLD - 1):
                i = s * share + j
                m = (j < share) & (i < n64)
                tl.store(mine + at64 + i, tl.load(inp + i, mask=m), mask=m)
            c += programs
    _barrier(pads, rank, pid, spins, WORLD, LANES)
    held = rank - (rank > root).to(tl.int32)  # this rank's share; the root's is never read
    source = tl.load(ptrs + root).to(tl.pointer_type(out.dtype.element_ty))
    c = pid
    while c < chunks:
        j = c.to(tl.int64) * BLOCK + offs
        i = held.to(tl.int64) * share + j
        m = (j < share) & (i < n64) & (offs * 0 + rank != root)  # as in _two_shot: a block, not a scalar
        v = tl.load(source + at64 + i, mask=m)
        tl.store(out + i, v, mask=m)
        tl.store(mine + at64 + i, v, mask=m)
        c += programs
    _barrier(pads, rank, pid, spins, WORLD, LANES)
    c = pid
    while c < chunks:
        j = c.to(tl.int64) * BLOCK + offs
        for s in tl.static_range(WORLD - 1):
            owner = s + (s >= root).to(tl.int32)
            peer = tl.load(ptrs + owner).to(tl.pointer_type(out.dtype.element_ty))
            i = s * share + j
            m = (j < share) & (i < n64) & (offs * 0 + rank != root) & (offs * 0 + owner != rank)
            tl.store(out + i, tl.load(peer + at64 + i, mask=m), mask=m)
        c += programs
