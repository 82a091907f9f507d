"""Run a schedule on real tensors through a transport.

The schedule is compiled once per (schedule, rank, numel, lanes) into this rank's plan
(:mod:`dtrain.comm.ir.plan`); each round starts its messages through the transport, waits for them and applies
what arrived (copies, reductions) on the tensor's own device, in a scratch buffer reused across calls.

On CUDA with several lanes, a round's reductions run on a side stream: lane k's reduction overlaps lane
k+1's transfer, and a lane's next round waits only for its own reduction (an event), never for the others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch

from dtrain.comm.ir.plan import RoundPlan, compile_plan
from dtrain.comm.ir.schedule import Schedule
from dtrain.comm.p2p.transport import Pending, Transport
from dtrain.env import comm_env

__all__ = ["CommTimeoutError", "compile_plan", "run_schedule", "REDUCE_OPS"]


class CommTimeoutError(TimeoutError):
    """A peer did not send or receive in time: names the collective, the round and the peer."""


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
    """One growing flat buffer per (device, dtype) and thread, reused across calls (made outside inference mode
    whatever the call's: a buffer made under ``torch.inference_mode()`` would refuse the writes of later calls
    outside it)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):
                buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self.buffers[key] = buf
        return buf


# Process-wide, not per group: a thread's calls run one at a time, whatever their group, so one buffer per
# thread, device and dtype serves them all.
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


def round_timeout() -> timedelta | None:
    """``DTRAIN_COMM_TIMEOUT`` seconds, the most any round may wait, or None (the group's own timeout).

    Gloo already raises within the group's timeout; on NCCL waiting is asynchronous and a missing peer is
    only caught by NCCL's watchdog, which does not know our rounds. Setting it makes every round wait on the
    host for its messages, so a stall is reported with the collective, the round and the peer: a debugging
    aid on GPUs (each round then costs a host-device synchronisation).
    """
    seconds = comm_env().timeout_s
    return timedelta(seconds=seconds) if seconds is not None else None


def _wait(pending: list[Pending], schedule: Schedule, index: int, transport: Transport) -> None:
    # Receives first: a missing peer shows up as the receive that never completes.
    timeout = round_timeout()
    seen: set[int] = set()
    for p in sorted(pending, key=lambda p: p.is_send):
        if id(p.work) in seen:  # a coalesced round shares one request
            continue
        seen.add(id(p.work))
        try:
            p.wait(timeout)
        except ValueError as err:  # a message that does not fit what this rank posted (the transport says how)
            raise ValueError(f"{_describe(p, schedule, index, transport, 'received a bad message')}: {err}") from None
        except RuntimeError as err:
            text = str(err)
            if "imed out" not in text and "timeout" not in text.lower():
                raise
            raise CommTimeoutError(f"{_describe(p, schedule, index, transport)}: {err}") from err


def _describe(p: Pending, schedule: Schedule, index: int, transport: Transport, what: str = "timed out") -> str:
    verb = "sending to" if p.is_send else "waiting for a message from"
    rank, peer = transport.rank, p.peer
    return (
        f"{schedule.collective.value}/{schedule.algorithm}: rank {rank} (global {transport.global_rank(rank)}) "
        f"{what} in round {index} of {schedule.num_rounds} {verb} rank {peer} "
        f"(global {transport.global_rank(peer)}), {p.nbytes} bytes"
    )


def run_schedule(
    schedule: Schedule, work: torch.Tensor, transport: Transport, op: str = "sum", lanes: int = 1
) -> torch.Tensor:
    """Execute ``schedule`` on this rank's flat contiguous ``work`` buffer, in place; return it.

    ``lanes`` > 1 cuts every chunk into that many slices run as independent copies of the schedule, so on
    CUDA one lane's reductions overlap another's transfers; every rank must pass the same ``lanes``.
    """
    if work.dim() != 1 or not work.is_contiguous():
        raise ValueError("the work buffer must be flat and contiguous")
    plan = compile_plan(schedule, transport.rank, work.numel(), lanes)
    scratch = _SCRATCH.get(plan.scratch, work)
    if lanes > 1 and work.is_cuda:
        _run_lanes(plan.rounds, schedule, work, scratch, transport, op, lanes)
        return work
    for rp in plan.rounds:
        _wait(_start_round(rp, work, scratch, transport), schedule, rp.index, transport)
        _apply(rp, work, scratch, op)
    return work


# device -> the stream lanes reduce on. Process-wide, not per group: a stream belongs to a device, and calls
# on it are ordered against the current stream, whatever their group.
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def _run_lanes(rounds, schedule: Schedule, work, scratch, transport: Transport, op: str, lanes: int) -> None:
    current = torch.cuda.current_stream(work.device)
    side = _side_stream(work.device)
    done: list[torch.cuda.Event | None] = [None] * lanes  # each lane's last reduction
    for rp in rounds:
        if done[rp.lane] is not None:  # this lane's data (and scratch) are only ready once it is reduced
            current.wait_event(done[rp.lane])
            done[rp.lane] = None
        pending = _start_round(rp, work, scratch, transport)
        if not rp.applies:
            _wait(pending, schedule, rp.index, transport)
            continue
        side.wait_stream(current)  # the packing and earlier copies this round's reduction reads
        with torch.cuda.stream(side):
            _wait(pending, schedule, rp.index, transport)
            _apply(rp, work, scratch, op)
            event = torch.cuda.Event()
            event.record(side)
        done[rp.lane] = event
    for event in done:
        if event is not None:
            current.wait_event(event)
