"""How bytes move between ranks: torch.distributed point-to-point, on Gloo (CPU) and NCCL (GPU) alike.

A transport takes one round's messages for this rank (tensors to send, tensors to receive into), starts them
all at once and hands back one pending handle per message, so the runtime can tell which peer a failed or
late message belongs to.

On a backend that coalesces (NCCL), a round is one NCCL group (``ncclGroupStart`` ... ``ncclGroupEnd``): the
same thing ``torch.distributed.batch_isend_irecv`` does, called on the process group directly because the
Python wrapper costs more host time per round than the GPU needs to move a few MiB (measured in
docs/results.md). Other backends (Gloo) get one request per message.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from dtrain.comm.state import group_state

__all__ = ["Pending", "Transport", "TorchP2PTransport", "transport_for"]

_TAG = 0


@dataclass
class Pending:
    """A started message: ``peer`` is the group rank on the other end."""

    peer: int
    is_send: bool
    nbytes: int
    work: object

    def wait(self, timeout: timedelta | None = None) -> None:
        """Wait for the message; with ``timeout``, at most that long (blocking the host, also on GPUs)."""
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)


class Transport(Protocol):
    """Moves one round's messages of one rank."""

    rank: int
    world_size: int

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> list[Pending]: ...

    def global_rank(self, group_rank: int) -> int: ...


class TorchP2PTransport:
    """Point-to-point over a torch.distributed process group (the world when ``group`` is None).

    Ranks given to :meth:`start` are group ranks.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if group is None or group is dist.group.WORLD:
            self._global = list(range(self.world_size))
        else:
            self._global = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self._coalesces: dict[torch.device, bool] = {}

    def global_rank(self, group_rank: int) -> int:
        return self._global[group_rank]

    def _coalescing(self, device: torch.device) -> bool:
        known = self._coalesces.get(device)
        if known is None:
            pg = self.group
            known = hasattr(pg, "_start_coalescing") and pg._get_backend(device).supports_coalescing
            self._coalesces[device] = known
        return known

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> list[Pending]:
        if not sends and not recvs:
            return []
        pg = self.group
        device = (sends or recvs)[0][1].device
        if self._coalescing(device):
            pg._start_coalescing(device)
            for peer, t in sends:
                pg.send([t], peer, _TAG)
            for peer, t in recvs:
                pg.recv([t], peer, _TAG)
            work = pg._end_coalescing(device)
            works = [work] * (len(sends) + len(recvs))
        else:
            # Receives first: Gloo sends a payload only once the receiver has announced its buffer, and an
            # announcement posted after our own sends queues behind their payload on the same connection, so
            # the two directions of a pairwise exchange would run one after the other (measured on the
            # emulated cluster: recursive doubling 2719 -> 1953 ms at 4 MiB, docs/emulation.md).
            recv_works = [pg.recv([t], peer, _TAG) for peer, t in recvs]
            works = [pg.send([t], peer, _TAG) for peer, t in sends] + recv_works
        messages = [(p, True, t) for p, t in sends] + [(p, False, t) for p, t in recvs]
        return [
            Pending(peer=p, is_send=is_send, nbytes=t.numel() * t.element_size(), work=w)
            for (p, is_send, t), w in zip(messages, works, strict=True)
        ]


def transport_for(group: dist.ProcessGroup | None) -> TorchP2PTransport:
    """One transport per process group, reused across calls (kept in the group's
    :class:`~dtrain.comm.state.GroupState`; a new default group after a re-init gets a new one)."""
    state = group_state(group)
    if state.transport is None:
        state.transport = TorchP2PTransport(group)
    return state.transport
