"""Compile a schedule into one rank's plan: what it sends, receives and reduces, round by round.

For each round: which element ranges go to which peer and which come back from which, with neighbouring
ranges merged, every pair's messages of a round packed into one, and the scratch layout fixed. Received data
that must be reduced, or that would overwrite a range this rank still sends in the same round, lands in
scratch first; everything else is received in place. The reduces a round makes into one range (direct
reduce-scatter's W-1 incoming blocks, say) become one :class:`Apply` over the stacked pieces.

With ``lanes`` > 1 every chunk is cut into that many slices and each round runs once per slice: slice k of
every chunk only ever meets slice k of others, so the lanes are independent copies of the schedule, and the
runtime can reduce one lane while the next one is on the wire. Each lane has its own scratch region.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from dtrain.comm.ir.schedule import Schedule, chunk_bounds

__all__ = ["Outgoing", "Incoming", "Apply", "RoundPlan", "RankPlan", "compile_plan", "lane_bounds"]

Range = tuple[int, int]  # (offset, length) in elements


@dataclass(frozen=True)
class Outgoing:
    peer: int
    ranges: tuple[Range, ...]  # packed in this order
    scratch: int | None  # where the packed message sits in scratch; None: one range, sent in place


@dataclass(frozen=True)
class Incoming:
    peer: int
    length: int
    target: int | None  # in-place receive: the work offset it lands at; None: into scratch at ``scratch``
    scratch: int


@dataclass(frozen=True)
class Apply:
    """After the round: combine ``count`` equal scratch pieces at ``scratch`` (stride ``length``) into
    ``work[offset:offset+length]``, by copy (count is 1) or by the reduction."""

    offset: int
    length: int
    scratch: int
    count: int
    reduce: bool


@dataclass(frozen=True)
class RoundPlan:
    index: int  # the schedule's round number
    lane: int
    sends: tuple[Outgoing, ...]
    recvs: tuple[Incoming, ...]
    applies: tuple[Apply, ...]
    scratch: int  # elements of scratch this round needs


@dataclass(frozen=True)
class RankPlan:
    rounds: tuple[RoundPlan, ...]
    scratch: int


def _merge(ranges: list[Range]) -> tuple[Range, ...]:
    """Drop empty ranges and merge ranges that follow each other in memory, keeping order."""
    merged: list[Range] = []
    for off, n in ranges:
        if n == 0:
            continue
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    return tuple(merged)


def _overlaps(a: Range, ranges: list[Range]) -> bool:
    return any(a[0] < off + n and off < a[0] + a[1] for off, n in ranges)


def _group_applies(pieces: list[tuple[int, int, int, bool]]) -> tuple[Apply, ...]:
    """Fold reduces into one range that sit back to back in scratch into one :class:`Apply`."""
    applies: list[Apply] = []
    for off, n, at, is_reduce in pieces:
        last = applies[-1] if applies else None
        if (
            is_reduce
            and last is not None
            and last.reduce
            and (last.offset, last.length) == (off, n)
            and last.scratch + last.count * n == at
        ):
            applies[-1] = Apply(off, n, last.scratch, last.count + 1, True)
        else:
            applies.append(Apply(off, n, at, 1, is_reduce))
    return tuple(applies)


def _plan_round(index: int, lane: int, transfers, rank: int, bounds: list[Range]) -> RoundPlan:
    out: dict[int, list[Range]] = {}
    inc: dict[int, list[tuple[int, int, bool]]] = {}
    for t in transfers:  # schedule order fixes the packing order on both ends
        if t.src == rank:
            out.setdefault(t.dst, []).append(bounds[t.src_chunk])
        if t.dst == rank:
            off, n = bounds[t.dst_chunk]
            inc.setdefault(t.src, []).append((off, n, t.reduce))
    cursor = 0
    sends = []
    for peer in sorted(out):
        ranges = _merge(out[peer])
        if not ranges:
            continue
        at = None
        if len(ranges) > 1:
            at, cursor = cursor, cursor + sum(n for _, n in ranges)
        sends.append(Outgoing(peer, ranges, at))
    sent_ranges = [r for s in sends for r in s.ranges]
    recvs, staged = [], []
    # Reduces into the same range are laid out by target, so they end up back to back in scratch.
    for peer in sorted(inc, key=lambda p: (inc[p][0][:2], p)):
        pieces = [p for p in inc[peer] if p[1] > 0]
        if not pieces:
            continue
        length = sum(n for _, n, _ in pieces)
        if len(pieces) == 1 and not pieces[0][2] and not _overlaps(pieces[0][:2], sent_ranges):
            recvs.append(Incoming(peer, length, pieces[0][0], 0))
            continue
        recvs.append(Incoming(peer, length, None, cursor))
        for off, n, is_reduce in pieces:
            staged.append((off, n, cursor, is_reduce))
            cursor += n
    staged.sort(key=lambda p: (p[0], p[2]))
    return RoundPlan(index, lane, tuple(sends), tuple(recvs), _group_applies(staged), cursor)


def lane_bounds(bounds: list[Range], lanes: int, lane: int) -> list[Range]:
    """Slice ``lane`` of ``lanes`` of every chunk (lengths differ by at most one between slices)."""
    out = []
    for off, n in bounds:
        base, extra = divmod(n, lanes)
        start = off + lane * base + min(lane, extra)
        out.append((start, base + (1 if lane < extra else 0)))
    return out


def _shifted(rp: RoundPlan, base: int) -> RoundPlan:
    """``rp`` with its scratch moved up by ``base`` elements (the lane's own region)."""
    if base == 0:
        return rp
    sends = tuple(s if s.scratch is None else dataclasses.replace(s, scratch=s.scratch + base) for s in rp.sends)
    recvs = tuple(r if r.target is not None else dataclasses.replace(r, scratch=r.scratch + base) for r in rp.recvs)
    applies = tuple(dataclasses.replace(a, scratch=a.scratch + base) for a in rp.applies)
    return dataclasses.replace(rp, sends=sends, recvs=recvs, applies=applies)


@lru_cache(maxsize=1024)
def compile_plan(schedule: Schedule, rank: int, numel: int, lanes: int = 1) -> RankPlan:
    """This rank's part of ``schedule`` on a work buffer of ``numel`` elements, in ``lanes`` lanes."""
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    per_lane = [
        [_plan_round(i, k, r, rank, lane_bounds(bounds, lanes, k)) for i, r in enumerate(schedule.rounds)]
        for k in range(lanes)
    ]
    bases, total = [], 0
    for plans in per_lane:
        bases.append(total)
        total += max((p.scratch for p in plans), default=0)
    rounds = tuple(
        _shifted(per_lane[k][i], bases[k])
        for i in range(len(schedule.rounds))
        for k in range(lanes)
        if per_lane[k][i].sends or per_lane[k][i].recvs
    )
    return RankPlan(rounds=rounds, scratch=total)
