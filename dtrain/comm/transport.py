"""How bytes move between ranks: torch.distributed point-to-point, on Gloo (CPU) and NCCL (GPU) alike.

A transport takes one round's messages for this rank (tensors to send, tensors to receive into), starts them
all at once and hands back one pending handle per message, so the runtime can tell which peer a failed or
late message belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["Pending", "Transport", "TorchP2PTransport"]


@dataclass
class Pending:
    """A started message: ``peer`` is the group rank on the other end."""

    peer: int
    is_send: bool
    nbytes: int
    work: object

    def wait(self) -> None:
        self.work.wait()


class Transport(Protocol):
    """Moves one round's messages of one rank."""

    rank: int
    world_size: int

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> list[Pending]: ...


class TorchP2PTransport:
    """torch.distributed ``batch_isend_irecv`` over a process group (the world when ``group`` is None).

    Ranks given to :meth:`start` are group ranks; they are translated to global ranks here once.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if group is None or group is dist.group.WORLD:
            self._global = list(range(self.world_size))
        else:
            self._global = [dist.get_global_rank(group, r) for r in range(self.world_size)]

    def global_rank(self, group_rank: int) -> int:
        return self._global[group_rank]

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> list[Pending]:
        ops = [dist.P2POp(dist.isend, t, self._global[p], self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global[p], self.group) for p, t in recvs]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        messages = [(p, True, t) for p, t in sends] + [(p, False, t) for p, t in recvs]
        if len(works) != len(messages):
            # NCCL coalesces a batch into one work: every message then shares it.
            works = [works[-1]] * len(messages)
        return [
            Pending(peer=p, is_send=is_send, nbytes=t.numel() * t.element_size(), work=w)
            for (p, is_send, t), w in zip(messages, works, strict=True)
        ]
