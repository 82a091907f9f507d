"""Our schedules over MPI point-to-point: one ``MPI_Irecv`` / ``MPI_Isend`` per message, receives posted first.

A round's messages are nonblocking requests on the group's own communicator, carried as raw bytes
(``MPI_BYTE``, so every dtype moves alike; the runtime reduces what arrives with torch). Waiting polls
``MPI_Test`` up to a deadline (``DTRAIN_COMM_TIMEOUT``, else the group's timeout) and yields the core between
tests, so ranks that outnumber the cores still progress; past the deadline the round's unfinished receives are
cancelled and the runtime raises :class:`~dtrain.comm.CommTimeoutError` naming the collective, the round and
the peer. Nothing is pickled: only buffer-based (uppercase) mpi4py calls.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch

from dtrain.comm.mpi.group import MPIGroup, mpi
from dtrain.comm.p2p.transport import Pending
from dtrain.comm.state import group_state

__all__ = ["MPITransport", "transport_for", "byte_buffer", "dense"]

_TAG = 7
#: After this long without completion a wait sleeps between tests instead of only yielding the core.
_PATIENT_S = 0.05


def byte_buffer(t: torch.Tensor):
    """``t``'s memory as an mpi4py buffer of bytes (a numpy view, no copy): ``[array, MPI.BYTE]``."""
    return [dense(t).view(torch.uint8).numpy(), mpi().BYTE]


def dense(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor as a flat view with unit stride (a one-element tensor may carry another)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"MPI messages need contiguous CPU tensors, got one on {t.device}")
    return t.as_strided((t.numel(),), (1,))


class _Round:
    """The requests one :meth:`MPITransport.start` posted; a timeout cancels the receives still open."""

    def __init__(self, requests: list, receives: int) -> None:
        self.requests = requests
        self.receives = receives

    def cancel_receives(self) -> None:
        MPI = mpi()
        for req in self.requests[: self.receives]:
            try:
                if req == MPI.REQUEST_NULL or req.Test():
                    continue
            except MPI.Exception:  # a receive that failed (a message too long) is complete: nothing to cancel
                continue
            req.Cancel()
            req.Wait()  # a cancelled receive completes at once and writes nothing more


class _Request:
    """One message's request, waited on with a deadline (``Pending.work``). A receive (``expect``: the bytes this
    rank posted for it) is checked on completion: a message of another length (a peer whose tensor has another
    size: MPI truncates a longer one and leaves the rest of the buffer as it was after a shorter one) raises
    ``ValueError`` naming the peer and both lengths, after cancelling the round's open receives, so nothing is
    written into this rank's memory once the call has raised."""

    def __init__(
        self, round_: _Round, index: int, default_timeout: timedelta, peer: int = -1, expect: int | None = None
    ) -> None:
        self.round = round_
        self.index = index
        self.default_timeout = default_timeout
        self.peer = peer
        self.expect = expect
        self.done = False

    def _test(self, req) -> bool:
        if self.done:
            return True
        if self.expect is None:
            self.done = req.Test()
            return self.done
        MPI = mpi()
        status = MPI.Status()
        try:
            done = req.Test(status)
        except MPI.Exception as err:
            if err.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            self.round.cancel_receives()
            raise ValueError(
                f"rank {self.peer} sent a message longer than the {self.expect} bytes this rank expected "
                "(every rank passes tensors of the same size)"
            ) from None
        if done:
            got = status.Get_count(MPI.BYTE)
            if got != self.expect:
                self.round.cancel_receives()
                raise ValueError(
                    f"rank {self.peer} sent a message of {got} bytes where this rank expected {self.expect} "
                    "(every rank passes tensors of the same size)"
                )
            self.done = True
        return done

    def wait(self, timeout: timedelta | None = None) -> None:
        limit = (timeout or self.default_timeout).total_seconds()
        req = self.round.requests[self.index]
        if self._test(req):
            return
        start = time.perf_counter()
        while not self._test(req):
            waited = time.perf_counter() - start
            if waited > limit:
                self.round.cancel_receives()
                raise RuntimeError(f"MPI request timed out after {limit:g} s")
            if waited > _PATIENT_S:
                time.sleep(0.0002)
            else:
                os.sched_yield()


class MPITransport:
    """Point-to-point over an :class:`~dtrain.comm.mpi.MPIGroup`; ranks given to :meth:`start` are group
    ranks. Implements :class:`dtrain.comm.p2p.transport.Transport`."""

    def __init__(self, group: MPIGroup) -> None:
        self.group = group
        self.rank = group.rank
        self.world_size = group.size

    def global_rank(self, group_rank: int) -> int:
        return self.group.global_rank(group_rank)

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> list[Pending]:
        if not sends and not recvs:
            return []
        comm = self.group.comm
        # Receives first, so that a peer's message finds its buffer posted (no unexpected-message copy).
        requests = [comm.Irecv(byte_buffer(t), source=peer, tag=_TAG) for peer, t in recvs]
        requests += [comm.Isend(byte_buffer(t), dest=peer, tag=_TAG) for peer, t in sends]
        round_ = _Round(requests, len(recvs))
        messages = [(p, False, t) for p, t in recvs] + [(p, True, t) for p, t in sends]
        return [
            Pending(
                peer=p,
                is_send=is_send,
                nbytes=t.numel() * t.element_size(),
                work=_Request(round_, i, self.group.timeout, p, None if is_send else t.numel() * t.element_size()),
            )
            for i, (p, is_send, t) in enumerate(messages)
        ]


def transport_for(group: MPIGroup) -> MPITransport:
    """One transport per MPI group, kept in the group's :class:`~dtrain.comm.state.GroupState`."""
    state = group_state(group)
    if state.transport is None:
        state.transport = MPITransport(group)
    return state.transport
