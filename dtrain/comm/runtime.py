"""Run a schedule on real tensors through a transport.

The schedule is compiled once per (schedule, rank, numel) into a per-rank *plan*: for each round, which
element ranges go to which peer and which come back from which, with neighbouring ranges merged and every
pair's messages of a round packed into one. Received data that must be reduced, or that would overwrite a
range this rank is still sending in the same round, lands in a reused scratch buffer first; everything else
is received in place. Reductions run on the tensor's own device.
"""

from __future__ import annotations

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
class Incoming:
    peer: int
    length: int
    pieces: tuple[tuple[int, int, bool], ...]  # (offset, length, reduce) in the work buffer, in message order
    in_place: bool  # one copied range that nothing else touches this round: receive straight into it


@dataclass(frozen=True)
class RoundPlan:
    sends: tuple[tuple[int, tuple[Range, ...]], ...]  # (peer, ranges packed in order)
    recvs: tuple[Incoming, ...]
    scratch: int  # elements of scratch this round needs (packed sends and staged receives)


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


def _plan_round(transfers, rank: int, bounds: list[Range]) -> RoundPlan:
    out: dict[int, list[Range]] = {}
    inc: dict[int, list[tuple[int, int, bool]]] = {}
    for t in transfers:  # schedule order fixes the packing order on both ends
        if t.src == rank:
            out.setdefault(t.dst, []).append(bounds[t.src_chunk])
        if t.dst == rank:
            off, n = bounds[t.dst_chunk]
            inc.setdefault(t.src, []).append((off, n, t.reduce))
    sends = tuple((peer, merged) for peer in sorted(out) if (merged := _merge(out[peer])))
    sent_ranges = [r for _, rs in sends for r in rs]
    scratch = sum(n for _, rs in sends if len(rs) > 1 for _, n in rs)
    recvs = []
    for peer in sorted(inc):
        pieces = tuple(p for p in inc[peer] if p[1] > 0)
        if not pieces:
            continue
        length = sum(n for _, n, _ in pieces)
        single_copy = len(pieces) == 1 and not pieces[0][2]
        in_place = single_copy and not _overlaps(pieces[0][:2], sent_ranges)
        if not in_place:
            scratch += length
        recvs.append(Incoming(peer=peer, length=length, pieces=pieces, in_place=in_place))
    return RoundPlan(sends=sends, recvs=tuple(recvs), scratch=scratch)


@lru_cache(maxsize=1024)
def compile_plan(schedule: Schedule, rank: int, numel: int) -> RankPlan:
    """This rank's part of ``schedule`` on a work buffer of ``numel`` elements."""
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    rounds = tuple(_plan_round(r, rank, bounds) for r in schedule.rounds)
    return RankPlan(rounds=rounds, scratch=max((r.scratch for r in rounds), default=0))


def _prod(out: torch.Tensor, x: torch.Tensor) -> None:
    out.mul_(x)


def _max(out: torch.Tensor, x: torch.Tensor) -> None:
    torch.maximum(out, x, out=out)


def _min(out: torch.Tensor, x: torch.Tensor) -> None:
    torch.minimum(out, x, out=out)


def _sum(out: torch.Tensor, x: torch.Tensor) -> None:
    out.add_(x)


ReduceFn = Callable[[torch.Tensor, torch.Tensor], None]

#: In-place combiners, by op name; "avg" sums and is divided once at the end by the caller.
REDUCE_OPS: dict[str, ReduceFn] = {"sum": _sum, "avg": _sum, "prod": _prod, "max": _max, "min": _min}


class _Scratch:
    """One growing flat buffer per (device, dtype), reused across calls."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf


_SCRATCH = _Scratch()


def _start_round(rp: RoundPlan, work: torch.Tensor, scratch: torch.Tensor, transport: Transport):
    cursor = 0
    sends = []
    for peer, ranges in rp.sends:
        if len(ranges) == 1:
            off, n = ranges[0]
            sends.append((peer, work[off : off + n]))
            continue
        total = sum(n for _, n in ranges)
        packed = scratch[cursor : cursor + total]
        torch.cat([work[off : off + n] for off, n in ranges], out=packed)
        cursor += total
        sends.append((peer, packed))
    recvs, staged = [], []
    for inc in rp.recvs:
        if inc.in_place:
            off, n, _ = inc.pieces[0]
            recvs.append((inc.peer, work[off : off + n]))
            continue
        buf = scratch[cursor : cursor + inc.length]
        cursor += inc.length
        recvs.append((inc.peer, buf))
        staged.append((inc, buf))
    return transport.start(sends, recvs), staged


def _wait(pending: list[Pending], describe: Callable[[Pending], str]) -> None:
    # Receives first: a missing peer shows up as the receive that never completes.
    for p in sorted(pending, key=lambda p: p.is_send):
        try:
            p.wait()
        except RuntimeError as err:
            if "imed out" not in str(err) and "timeout" not in str(err).lower():
                raise
            raise CommTimeoutError(f"{describe(p)}: {err}") from err


def run_schedule(
    schedule: Schedule,
    work: torch.Tensor,
    transport: Transport,
    op: str = "sum",
    *,
    global_rank: Callable[[int], int] | None = None,
) -> torch.Tensor:
    """Execute ``schedule`` on this rank's flat contiguous ``work`` buffer, in place; return it."""
    if work.dim() != 1 or not work.is_contiguous():
        raise ValueError("the work buffer must be flat and contiguous")
    rank = transport.rank
    plan = compile_plan(schedule, rank, work.numel())
    combine = REDUCE_OPS[op]
    scratch = _SCRATCH.get(plan.scratch, work)
    name = f"{schedule.collective.value}/{schedule.algorithm}"
    to_global = global_rank or (lambda r: r)
    for index, rp in enumerate(plan.rounds):
        if not rp.sends and not rp.recvs:
            continue

        def describe(p: Pending, index: int = index) -> str:
            verb = "sending to" if p.is_send else "waiting for a message from"
            return (
                f"{name}: rank {rank} (global {to_global(rank)}) timed out in round {index} of "
                f"{schedule.num_rounds} {verb} rank {p.peer} (global {to_global(p.peer)}), {p.nbytes} bytes"
            )

        pending, staged = _start_round(rp, work, scratch, transport)
        _wait(pending, describe)
        for inc, buf in staged:
            cursor = 0
            for off, n, is_reduce in inc.pieces:
                piece = buf[cursor : cursor + n]
                cursor += n
                if is_reduce:
                    combine(work[off : off + n], piece)
                else:
                    work[off : off + n].copy_(piece)
    return work
