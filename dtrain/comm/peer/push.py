"""Compile a schedule into push steps for the peer-memory transport: every rank writes into its peers' windows.

The pull form (:mod:`dtrain.comm.peer.pull`) has the destination read the source's chunk and reduce it into its
own. Reading over NVLink is the slower direction: on 4 H200s a pass that reads a peer and adds runs at
310-335 GB/s, one that reads two local buffers, adds and stores into a peer at 333-365 GB/s
(``benchmarks/collectives/probe.py pull-kernel``). The push form moves the reduction to the *sender*:

- Every rank's window holds two *banks*, each as long as the buffer. A transfer in round ``k`` stores the
  sender's value of its chunk into the receiver's bank ``k % 2`` at the receiving chunk's offset.
- The receiver does not reduce on arrival. Its value of a chunk is kept *lazily*: ``x`` (the caller's tensor)
  combined with the banks that hold contributions not yet folded in (for a copy, one bank alone). When it
  sends the chunk on, the same pass that stores into the peer combines ``x`` and those banks and also writes
  the result back into ``x`` (one local store more), so a ring's reduce-scatter round is one pass that reads
  two local buffers and stores once remotely and once locally.
- Round ``k`` writes only bank ``k % 2``; what a rank reads in round ``k`` (contributions that arrived in
  earlier rounds) sits in the other bank or was folded into ``x``. Where a chunk would receive into a bank
  still holding an unfolded contribution, the rank folds it into ``x`` the round before (a local pass).
- One barrier before every round (so a round's stores land after the receiver has finished reading what they
  overwrite, and its reads see the stores of the rounds before), one after the last round, then every rank
  folds what arrived last into ``x``. No copy-in: a round-0 sender reads ``x`` itself.

A schedule has a push form when no chunk receives from two ranks in one round (each incoming store needs its
own place); direct and star reductions do not, and run in the pull form. :func:`races` checks a plan: within
each phase between two barriers nothing a rank reads from its window is written by a peer, and no two ranks
store into the same window bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dtrain.comm.ir.schedule import Schedule, ScheduleError, chunk_bounds

__all__ = ["PushOp", "PushRound", "PushPlan", "compile_push", "has_push_form", "races", "writes_own_block_only"]


@dataclass(frozen=True)
class PushOp:
    """``value = x[offset:offset+length] (if base_x) (op) bank[b][offset:...] for b in banks`` (one operand:
    a copy); stored into rank ``dst``'s bank ``dst_bank`` at ``dst_offset`` (unless ``dst`` is None: a local
    fold) and into ``x`` when ``to_x``."""

    offset: int
    length: int
    base_x: bool
    banks: tuple[int, ...]
    dst: int | None
    dst_offset: int
    dst_bank: int
    to_x: bool


@dataclass(frozen=True)
class PushRound:
    index: int
    ops: tuple[PushOp, ...]  # after the round's barrier: the sends (peer r+1 first), then local folds


@dataclass(frozen=True)
class PushPlan:
    rounds: tuple[PushRound, ...]
    final: tuple[PushOp, ...]  # after the last barrier: fold what arrived into x


def has_push_form(schedule: Schedule) -> bool:
    """Whether no chunk of any rank receives from two ranks in one round (and no rank sends to itself)."""
    for rnd in schedule.rounds:
        seen = set()
        for t in rnd:
            if t.src == t.dst or (t.dst, t.dst_chunk) in seen:
                return False
            seen.add((t.dst, t.dst_chunk))
    return True


@lru_cache(maxsize=256)
def compile_push(schedule: Schedule, rank: int, numel: int, own_block_only: bool = False) -> PushPlan:
    """Rank ``rank``'s push plan for ``schedule`` on ``numel`` elements (every rank calls it alike).

    ``own_block_only``: only block ``rank`` of the buffer must end with its value (a reduce-scatter's result),
    so a chunk of another block is stored into ``x`` only where the rank sends it again later. Where that
    leaves ``x`` written in the rank's own block alone (:func:`writes_own_block_only`), the runtime can read
    the caller's input and write the result straight into the output, with no copy of the input."""
    return _compile_all(schedule, numel, own_block_only)[rank]


def writes_own_block_only(schedule: Schedule, numel: int) -> bool:
    """Whether every rank's ``own_block_only`` plan stores into ``x`` only inside its own block."""
    if not has_push_form(schedule) or schedule.nblocks != schedule.world_size or numel % schedule.nblocks:
        return False
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    per_block = schedule.chunks_per_block
    for r, plan in enumerate(_compile_all(schedule, numel, True)):
        lo = bounds[r * per_block][0]
        hi = bounds[(r + 1) * per_block - 1][0] + bounds[(r + 1) * per_block - 1][1]
        for op in [op for rnd in plan.rounds for op in rnd.ops] + list(plan.final):
            if op.to_x and op.length and not (lo <= op.offset and op.offset + op.length <= hi):
                return False
    return True


@lru_cache(maxsize=64)
def _compile_all(schedule: Schedule, numel: int, own_block_only: bool = False) -> tuple[PushPlan, ...]:
    if not has_push_form(schedule):
        raise ScheduleError(
            f"{schedule.collective.value}/{schedule.algorithm}: a chunk receives from two ranks in one round "
            "(or a rank sends to itself); it has no push form"
        )
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    world = schedule.world_size
    rounds_of = schedule.rounds
    # lazy value of (rank, chunk): (x is an operand, banks holding unfolded contributions)
    state: dict[tuple[int, int], tuple[bool, tuple[int, ...]]] = {}
    incoming_rounds: dict[tuple[int, int], list[int]] = {}
    for k, rnd in enumerate(rounds_of):
        for t in rnd:
            if bounds[t.src_chunk][1] != bounds[t.dst_chunk][1]:
                raise ScheduleError(
                    f"{schedule.algorithm}: {t} moves a chunk of {bounds[t.src_chunk][1]} elements into one "
                    f"of {bounds[t.dst_chunk][1]}; the peer transport needs equal lengths"
                )
            incoming_rounds.setdefault((t.dst, t.dst_chunk), []).append(k)
    sends_at: dict[tuple[int, int], list[int]] = {}  # (rank, chunk) -> rounds in which the rank sends it
    for k, rnd in enumerate(rounds_of):
        for t in rnd:
            sends_at.setdefault((t.src, t.src_chunk), []).append(k)

    def needed(rank: int, chunk: int, after: int) -> bool:
        """Whether the rank's value of the chunk is used after round ``after``: sent again, or its own result."""
        if not own_block_only or chunk // schedule.chunks_per_block == rank:
            return True
        return any(k > after for k in sends_at.get((rank, chunk), ()))

    rounds: list[list[PushRound]] = [[] for _ in range(world)]
    for k, rnd in enumerate(rounds_of):
        bank = k % 2
        ops: list[list[PushOp]] = [[] for _ in range(world)]
        # sends, each rank's in the order of their peers counted from it (r + 1 first)
        for t in sorted(rnd, key=lambda t: ((t.dst - t.src) % world, t.src_chunk)):
            base_x, banks = state.get((t.src, t.src_chunk), (True, ()))
            off, n = bounds[t.src_chunk]
            materialize = bool(banks)  # fold while sending: later sends of this chunk read x alone
            keep = materialize and needed(t.src, t.src_chunk, k)
            if n:
                ops[t.src].append(PushOp(off, n, base_x, banks, t.dst, bounds[t.dst_chunk][0], bank, to_x=keep))
            if materialize:  # folded, or (not kept) never read again
                state[(t.src, t.src_chunk)] = (True, ())
        # folds: a chunk receiving next round into a bank that still holds a contribution folds it now
        incoming_now = {(t.dst, t.dst_chunk): t.reduce for t in rnd}
        if k + 1 < len(rounds_of):
            for t in rounds_of[k + 1]:
                key = (t.dst, t.dst_chunk)
                base_x, banks = state.get(key, (True, ()))
                if 1 - bank not in banks or incoming_now.get(key) is False:
                    continue  # nothing to fold, or a copy this round replaces the value anyway
                off, n = bounds[t.dst_chunk]
                if n and needed(t.dst, t.dst_chunk, k):
                    ops[t.dst].append(PushOp(off, n, base_x, banks, None, 0, 0, to_x=True))
                state[key] = (True, ())  # folded, or (not needed) dropped
        # arrivals of this round, in bank k % 2
        for t in rnd:
            key = (t.dst, t.dst_chunk)
            base_x, banks = state.get(key, (True, ()))
            if bank in banks:  # cannot happen after the folds above: a guard for the compiler itself
                raise ScheduleError(f"{schedule.algorithm}: round {k} would overwrite an unfolded contribution")
            state[key] = (base_x, (*banks, bank)) if t.reduce else (False, (bank,))
        for r in range(world):
            rounds[r].append(PushRound(index=k, ops=tuple(ops[r])))
    plans = []
    for r in range(world):
        final = []
        for (q, c), (base_x, banks) in sorted(state.items()):
            off, n = bounds[c]
            if q == r and banks and n and needed(q, c, len(rounds_of)):
                final.append(PushOp(off, n, base_x, banks, None, 0, 0, to_x=True))
        plans.append(PushPlan(rounds=tuple(rounds[r]), final=tuple(final)))
    return tuple(plans)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[1] > 0 and b[1] > 0


def races(plans: tuple[PushPlan, ...] | list[PushPlan]) -> list[str]:
    """Every conflict of a compiled push plan: within one phase (the ops of a round, between its barrier and
    the next), a store into bytes of a rank's window that the rank reads, or two stores into the same bytes;
    and any read of a bank range that no earlier round of the same call stored into (it would read what a
    previous call left). The final folds run after the last barrier, when nobody stores. Empty for a plan free
    of these; whether the plan computes its schedule (no contribution overwritten before it is folded) is the
    compiler's own guard and the tests' element-by-element simulation, not this check."""
    found: list[str] = []
    nrounds = len(plans[0].rounds) if plans else 0
    stored: set[tuple[int, int, int, int]] = set()  # (rank, bank, offset, length) stored by an earlier round
    for k in range(nrounds):
        stores: dict[tuple[int, int], list[tuple[int, tuple[int, int]]]] = {}  # (rank, bank) -> (writer, range)
        for r, plan in enumerate(plans):
            for op in plan.rounds[k].ops:
                if op.dst is not None:
                    stores.setdefault((op.dst, op.dst_bank), []).append((r, (op.dst_offset, op.length)))
        for (q, b), items in stores.items():
            for i, (w1, a) in enumerate(items):
                for w2, c in items[i + 1 :]:
                    if _overlap(a, c):
                        found.append(f"round {k}: ranks {w1} and {w2} both store into rank {q}'s bank {b}")
        for r, plan in enumerate(plans):
            for op in plan.rounds[k].ops:
                for b in op.banks:
                    if (r, b, op.offset, op.length) not in stored:
                        found.append(f"round {k}: rank {r} reads its bank {b} where no earlier round stored")
                    for w, rng in stores.get((r, b), []):
                        if _overlap((op.offset, op.length), rng):
                            found.append(f"round {k}: rank {w} stores into rank {r}'s bank {b} while it reads it")
        stored |= {(q, b, off, n) for (q, b), items in stores.items() for _, (off, n) in items}
    for r, plan in enumerate(plans):
        for op in plan.final:
            for b in op.banks:
                if (r, b, op.offset, op.length) not in stored:
                    found.append(f"final: rank {r} folds its bank {b} where no round stored")
    return found
