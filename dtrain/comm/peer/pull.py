"""Compile a schedule into pull steps for a peer-memory transport: every rank reads its peers' buffers.

On one host every rank can map its peers' memory (CUDA peer memory over NVLink or PCIe, or shared memory on
the CPU). Then a transfer needs no message: its destination rank *reads* the source chunk straight from the
source's buffer and combines it with its own, in one pass. What must still be ordered is who may read what
when, and a barrier between rounds does it. This module works out, for every rank at once, where each chunk's
current value lives and which copies, reads and barriers keep every read race-free:

- Each rank has its own tensor ``x`` (only it touches it) and a *window* ``w`` that peers read. A chunk's
  value lives in ``x``, in ``w``, or in both. A value goes into ``w`` only when a peer will read it before it
  changes, and into ``x`` when it is the chunk's final value (or nobody reads it), so the result lands in the
  caller's tensor with no copy at the end; chunks read by a peer before this rank ever writes them are copied
  into ``w`` first (the *copy-in*, before the round's barrier).
- Round ``k``: copy-in, barrier, then every rank computes ``dst = base + sum(peer windows)`` (or copies) into
  ``x`` and/or ``w``. The round semantics of :mod:`dtrain.comm.ir.schedule` say reads see the start of the round.
  A rank writing a chunk that a peer reads in the same round therefore writes ``x`` only; when that value
  must also reach ``w`` for a later round, a second barrier after the round lets it copy ``x`` into ``w``
  once every peer has finished reading (a *deferred* window write; recursive doubling needs it every round).
- One more barrier at the end keeps the next call's copy-in off windows a slow peer may still be reading.
- Within a round, rank ``r`` takes its passes in the order of their peers counted from ``r`` (``r + 1``
  first): in a direct round every rank would otherwise read the same peer first, and that peer's links would
  serve all of them while the others idle.

:func:`races` checks a compiled plan: within every phase between two barriers, no rank writes window bytes
that another rank reads. After NCCL's P2P transport and Wang et al., "Blink" (MLSys 2020), which read peers'
memory for the same reason: a read is one pass, a message is two.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dtrain.comm.ir.schedule import Schedule, ScheduleError, chunk_bounds

__all__ = ["PullOp", "PullRound", "PullPlan", "compile_pull", "races", "wants_kernel", "FUSE_BYTES"]

#: From this many bytes a pass with two stores (or a reducing push) goes to the fused kernel (see wants_kernel).
FUSE_BYTES = 1 << 20


def wants_kernel(nouts: int, nsources: int, nbytes: int, *, has_base: bool, remote: bool = False) -> bool:
    """Whether a pass goes to the fused kernel (:mod:`dtrain.comm.peer.kernels`, where Triton is there): it saves
    a pass over the data (several sources; two stores of at least :data:`FUSE_BYTES`) or is a reducing push of at
    least that size. The kernel saves passes, torch saves host time (a Triton launch costs ~18 us of Python
    against ~6 us for a torch operation on 4 H200s), so only where a pass is worth more than that. Here, with no
    torch, so that :mod:`dtrain.sim.peer_model` prices the runtime's own rule."""
    big = nbytes >= FUSE_BYTES
    return nsources > 1 or (nouts > 1 and big) or (remote and big and has_base)


Range = tuple[int, int]  # (offset, length) in elements


@dataclass(frozen=True)
class PullOp:
    """``x`` and/or ``w`` at ``[offset, offset+length)`` <- ``base`` (this rank's own value, for a reduce,
    read from ``"x"`` or ``"w"``; None for a copy) combined with every ``(peer, offset)`` window read."""

    offset: int
    length: int
    base: str | None
    reads: tuple[tuple[int, int], ...]
    to_x: bool
    to_w: bool


@dataclass(frozen=True)
class PullRound:
    index: int
    copy_in: tuple[Range, ...]  # x -> w before the barrier
    ops: tuple[PullOp, ...]
    deferred: tuple[Range, ...]  # x -> w after the second barrier
    second_barrier: bool  # any rank defers: every rank must take it


@dataclass(frozen=True)
class PullPlan:
    rounds: tuple[PullRound, ...]
    copy_out: tuple[Range, ...]  # w -> x at the end (chunks whose final value is only in w)


def _accesses(schedule: Schedule):
    """Per (rank, chunk): the rounds it is written in, and the rounds a peer reads it in."""
    writes: dict[tuple[int, int], list[int]] = {}
    reads: dict[tuple[int, int], list[int]] = {}
    for k, rnd in enumerate(schedule.rounds):
        for t in rnd:
            if t.src == t.dst:
                raise ScheduleError(f"{schedule.algorithm}: a transfer from a rank to itself ({t}) has no pull form")
            writes.setdefault((t.dst, t.dst_chunk), []).append(k)
            reads.setdefault((t.src, t.src_chunk), []).append(k)
    return writes, reads


def _next(rounds: list[int], after: int) -> int | None:
    return next((k for k in rounds if k > after), None)


def _merge(ranges: list[Range]) -> tuple[Range, ...]:
    merged: list[Range] = []
    for off, n in sorted(r for r in ranges if r[1]):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    return tuple(merged)


@lru_cache(maxsize=256)
def compile_pull(schedule: Schedule, rank: int, numel: int) -> PullPlan:
    """Rank ``rank``'s pull plan for ``schedule`` on a buffer of ``numel`` elements (every rank calls it with
    the same schedule and size and takes the same barriers)."""
    return _compile_all(schedule, numel)[rank]


@lru_cache(maxsize=64)
def _compile_all(schedule: Schedule, numel: int) -> tuple[PullPlan, ...]:
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    writes, reads = _accesses(schedule)
    world = schedule.world_size
    # where each (rank, chunk)'s current value lives
    where: dict[tuple[int, int], set[str]] = {}
    rounds: list[list[PullRound]] = [[] for _ in range(world)]
    for k, rnd in enumerate(schedule.rounds):
        read_now = {(t.src, t.src_chunk) for t in rnd}
        copy_in: list[list[Range]] = [[] for _ in range(world)]
        for r, c in sorted(read_now):
            held = where.setdefault((r, c), {"x"})
            if "w" not in held:  # never in the window yet: nobody can be reading it, copy before the barrier
                copy_in[r].append(bounds[c])
                held.add("w")
        incoming: dict[tuple[int, int], list] = {}
        for t in rnd:
            incoming.setdefault((t.dst, t.dst_chunk), []).append(t)
        ops: list[list[PullOp]] = [[] for _ in range(world)]
        deferred: list[list[Range]] = [[] for _ in range(world)]
        updates: dict[tuple[int, int], set[str]] = {}
        for (r, d), ts in sorted(incoming.items()):
            for t in ts:  # a pass reads the destination's length at the source's offset
                if bounds[t.src_chunk][1] != bounds[t.dst_chunk][1]:
                    raise ScheduleError(
                        f"{schedule.algorithm}: {t} moves a chunk of {bounds[t.src_chunk][1]} elements into one "
                        f"of {bounds[t.dst_chunk][1]}; the peer transport needs equal lengths"
                    )
            reduce = ts[0].reduce
            held = where.setdefault((r, d), {"x"})
            nxt_write = _next(writes[(r, d)], k)
            nxt_read = _next(reads.get((r, d), []), k)
            read_later = nxt_read is not None and (nxt_write is None or nxt_read <= nxt_write)
            hazard = (r, d) in read_now
            to_w = read_later and not hazard
            to_x = nxt_write is None or not read_later or hazard
            if read_later and hazard:
                deferred[r].append(bounds[d])
            off, n = bounds[d]
            base = ("w" if "w" in held and "x" not in held else "x") if reduce else None
            peers = tuple(sorted((t.src, bounds[t.src_chunk][0]) for t in ts))
            if n:
                ops[r].append(PullOp(offset=off, length=n, base=base, reads=peers, to_x=to_x, to_w=to_w))
            # after the round (and its deferred copies): x if written there, w if written or copied there
            updates[(r, d)] = ({"x"} if to_x else set()) | ({"w"} if read_later else set())
        where.update(updates)
        for r in range(world):  # rank r reads peer r+1 first, then r+2, ...: no peer serves every rank at once
            ops[r].sort(key=lambda op, r=r: (min((p - r) % world for p, _ in op.reads), op.offset))
        second = any(deferred)
        for r in range(world):
            rounds[r].append(
                PullRound(
                    index=k,
                    copy_in=_merge(copy_in[r]),
                    ops=tuple(ops[r]),
                    deferred=_merge(deferred[r]),
                    second_barrier=second,
                )
            )
    plans = []
    for r in range(world):
        out = [bounds[c] for (q, c), held in where.items() if q == r and "x" not in held]
        plans.append(PullPlan(rounds=tuple(rounds[r]), copy_out=_merge(out)))
    return tuple(plans)


def _overlap(a: Range, b: Range) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[1] > 0 and b[1] > 0


def races(plans: tuple[PullPlan, ...] | list[PullPlan]) -> list[str]:
    """Every window conflict of a compiled plan: bytes one rank writes in its window while another rank
    may read them, i.e. in the same phase between two barriers. Empty for a correct plan.

    Phases: [copy-in of round 0] barrier [ops of round 0 (+ copy-in of round 1)] barrier ...; a round with a
    second barrier ends its ops there, and its deferred copies share the next phase with the copy-in of the
    following round (a phase with no reads). The copy-out reads only the rank's own window, before the last
    barrier. So the phases with reads are the ops of each round, with the next copy-in when no second barrier
    comes between.
    """
    found: list[str] = []
    nrounds = len(plans[0].rounds) if plans else 0
    for k in range(nrounds):
        rounds = [p.rounds[k] for p in plans]
        # phase A: ops of round k, and the copy-in of round k+1 when round k has no second barrier
        for r, rnd in enumerate(rounds):
            writes = [(op.offset, op.length) for op in rnd.ops if op.to_w]
            if not rnd.second_barrier and k + 1 < nrounds:
                writes += list(plans[r].rounds[k + 1].copy_in)
            for q, other in enumerate(rounds):
                for op in other.ops:
                    for peer, off in op.reads:
                        if peer == r and any(_overlap((off, op.length), w) for w in writes):
                            found.append(f"round {k}: rank {r} writes its window where rank {q} reads it")
    return found
