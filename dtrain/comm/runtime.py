"""Run a schedule on real tensors through a transport.

The schedule is compiled once per (schedule, rank, numel) into a per-rank *plan*: for each round, which
element ranges go to which peer and which come back from which, with neighbouring ranges merged, every
pair's messages of a round packed into one, and the scratch layout fixed. Received data that must be
reduced, or that would overwrite a range this rank still sends in the same round, lands in a reused scratch
buffer first; everything else is received in place. Reductions run on the tensor's own device, and the
reduces a round makes into one range (direct reduce-scatter's W-1 incoming blocks, say) run as one
reduction over the stacked blocks rather than W-1 separate passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from dtrain.comm.schedule import Schedule, chunk_bounds
from dtrain.comm.transport import Pending, Transport

__all__ = ["CommTimeoutError", "RankPlan", "compile_plan", "run_schedule", "REDUCE_OPS"]

Range = tuple[int, int]  # (offset, length) in elements


class CommTimeoutError(TimeoutError):
    """A peer did not send or receive in time: names the collective, the round and the peer."""


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


def _plan_round(index: int, transfers, rank: int, bounds: list[Range]) -> RoundPlan:
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
    return RoundPlan(index, tuple(sends), tuple(recvs), _group_applies(staged), cursor)


@lru_cache(maxsize=1024)
def compile_plan(schedule: Schedule, rank: int, numel: int) -> RankPlan:
    """This rank's part of ``schedule`` on a work buffer of ``numel`` elements."""
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    plans = (_plan_round(i, r, rank, bounds) for i, r in enumerate(schedule.rounds))
    rounds = tuple(p for p in plans if p.sends or p.recvs)
    return RankPlan(rounds=rounds, scratch=max((r.scratch for r in rounds), default=0))


def _combine_many(stacked: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce a (count, length) stack of pieces over its first dimension."""
    if op in ("sum", "avg"):
        return stacked.sum(0, dtype=stacked.dtype)
    if op == "prod":
        return stacked.prod(0, dtype=stacked.dtype)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _sum(out: torch.Tensor, x: torch.Tensor) -> None:
    out.add_(x)


def _prod(out: torch.Tensor, x: torch.Tensor) -> None:
    out.mul_(x)


def _max(out: torch.Tensor, x: torch.Tensor) -> None:
    torch.maximum(out, x, out=out)


def _min(out: torch.Tensor, x: torch.Tensor) -> None:
    torch.minimum(out, x, out=out)


ReduceFn = Callable[[torch.Tensor, torch.Tensor], None]

#: In-place combiners, by op name; "avg" sums and is divided once at the end by the caller.
REDUCE_OPS: dict[str, ReduceFn] = {"sum": _sum, "avg": _sum, "prod": _prod, "max": _max, "min": _min}


class _Scratch(threading.local):
    """One growing flat buffer per (device, dtype) and thread, reused across calls."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self.buffers[key] = buf
        return buf


_SCRATCH = _Scratch()


def _start_round(rp: RoundPlan, work: torch.Tensor, scratch: torch.Tensor, transport: Transport):
    sends = []
    for s in rp.sends:
        if s.scratch is None:
            off, n = s.ranges[0]
            sends.append((s.peer, work[off : off + n]))
            continue
        total = sum(n for _, n in s.ranges)
        packed = scratch[s.scratch : s.scratch + total]
        torch.cat([work[off : off + n] for off, n in s.ranges], out=packed)
        sends.append((s.peer, packed))
    recvs = [
        (r.peer, work[r.target : r.target + r.length])
        if r.target is not None
        else (r.peer, scratch[r.scratch : r.scratch + r.length])
        for r in rp.recvs
    ]
    return transport.start(sends, recvs)


def _apply(rp: RoundPlan, work: torch.Tensor, scratch: torch.Tensor, op: str) -> None:
    combine = REDUCE_OPS[op]
    for a in rp.applies:
        target = work[a.offset : a.offset + a.length]
        if a.count == 1:
            piece = scratch[a.scratch : a.scratch + a.length]
            if a.reduce:
                combine(target, piece)
            else:
                target.copy_(piece)
            continue
        stacked = scratch[a.scratch : a.scratch + a.count * a.length].view(a.count, a.length)
        combine(target, _combine_many(stacked, op))


def _wait(pending: list[Pending], schedule: Schedule, index: int, transport: Transport) -> None:
    # Receives first: a missing peer shows up as the receive that never completes.
    seen: set[int] = set()
    for p in sorted(pending, key=lambda p: p.is_send):
        if id(p.work) in seen:  # a coalesced round shares one request
            continue
        seen.add(id(p.work))
        try:
            p.wait()
        except RuntimeError as err:
            text = str(err)
            if "imed out" not in text and "timeout" not in text.lower():
                raise
            raise CommTimeoutError(f"{_describe(p, schedule, index, transport)}: {err}") from err


def _describe(p: Pending, schedule: Schedule, index: int, transport: Transport) -> str:
    verb = "sending to" if p.is_send else "waiting for a message from"
    rank, peer = transport.rank, p.peer
    return (
        f"{schedule.collective.value}/{schedule.algorithm}: rank {rank} (global {transport.global_rank(rank)}) "
        f"timed out in round {index} of {schedule.num_rounds} {verb} rank {peer} "
        f"(global {transport.global_rank(peer)}), {p.nbytes} bytes"
    )


def run_schedule(schedule: Schedule, work: torch.Tensor, transport: Transport, op: str = "sum") -> torch.Tensor:
    """Execute ``schedule`` on this rank's flat contiguous ``work`` buffer, in place; return it."""
    if work.dim() != 1 or not work.is_contiguous():
        raise ValueError("the work buffer must be flat and contiguous")
    plan = compile_plan(schedule, transport.rank, work.numel())
    scratch = _SCRATCH.get(plan.scratch, work)
    for rp in plan.rounds:
        _wait(_start_round(rp, work, scratch, transport), schedule, rp.index, transport)
        _apply(rp, work, scratch, op)
    return work
