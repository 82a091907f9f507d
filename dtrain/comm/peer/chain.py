"""The ring broadcast as a pipelined chain through copy engines: no SM spins, no barrier, a handful of driver
calls a piece.

The ring broadcast's schedule passes the root's buffer down the chain ``root, root + 1, ...`` in pieces, each
rank forwarding a piece while the next one comes. Run a round at a time on the peer transport (a barrier, then a
pull pass) every piece costs a device barrier on every rank, and the chain lost to NCCL's broadcast (0.4-0.6x on
4 H100s, ``probe-chain-h100x4.txt``). Here the same chain runs on counters instead (the flags of
:mod:`dtrain.comm.peer.channels`): each rank's window holds a ring of ``slots`` slots of ``slot_bytes`` for the
pieces its predecessor pushes, and 32-bit counters:

- ``READY[l]``: pieces landed in this rank's ring on lane ``l`` (raised by the predecessor after each push);
- ``FREE``: pieces the successor has taken out of its ring (raised by the successor), so that piece ``k`` waits
  for ``FREE >= k - slots + 1`` before it reuses a slot;
- ``FORWARDED[l]``: pieces of lane ``l`` this rank has pushed on from its own ring (it frees a slot only once
  both its copy out and its push are done).

A pushing rank deals its pieces round-robin over :data:`LANES` streams of its own (lanes), each with its own
``READY`` and ``FORWARDED`` counters: on one stream the next copy waits for the raise after the last. On 2 H200s
the pushes still lost 5-7 us a piece against one bare copy of the whole buffer
(``probe-chain-diagnose-h200x2.txt``); the second lane shortened that at 8-16 MiB pieces, not at 32 MiB
(``probe-chain-copy-engines-h200x2.txt``).

A call is a *round*: every rank's ``FREE`` holds :data:`ROUND_DONE` between rounds (set at start-up, and by the
successor when it takes a round's last piece, after resetting its own ``READY``), and a round's first push waits
for it and clears it. So every round issues the same waits and raises with the same values, and a rank's role
(root, middle, last) may change from one call to the next.

The plan (:func:`plan`) is pure: a list of operations (wait, write, copy, and the lanes' fork from and join to the
caller's stream) per rank: on the caller's stream the round's start, the copies out into the caller's tensor and
the slot releases; on the lanes the pushes (the root's from its tensor, a middle rank's from its own ring, so
that forwarding and copying out run side by side). :class:`ChainBroadcast` runs it: on CUDA every operation is
one driver call (the copies ``cuMemcpyDtoDAsync`` through the peer mapping, a copy engine's; the waits and raises
the stream memory operations), on the CPU (windows in /dev/shm) the host does each in the plan's order, which
interleaves the streams piece by piece and so cannot deadlock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch

from dtrain.comm.peer import channels as peer_channels
from dtrain.comm.peer import window as peer_window

__all__ = [
    "ChainBroadcast",
    "ChainStalled",
    "Op",
    "plan",
    "pieces",
    "chain_for",
    "CHAIN_FROM_BYTES",
    "LANES",
    "SLOTS",
    "MAX_SLOT_BYTES",
    "MIN_PIECE_BYTES",
]

ROUND_DONE = peer_channels.ROUND_DONE
#: streams a pushing rank deals its pieces over, round-robin (on one a piece's copy starts only once the raise
#: after the one before has run)
LANES = 2
#: counter indexes, 4 bytes each at the start of every window: ``READY`` and ``FORWARDED`` one a lane
READY, FREE, FORWARDED = 0, LANES, LANES + 1
RING_AT = 256  # the ring starts on a 256-byte boundary
SLOTS = 4
#: the largest piece (a slot); a broadcast of more than ``SLOTS`` of them reuses slots
MAX_SLOT_BYTES = 32 << 20
#: the smallest piece: a piece costs each rank a few driver calls and its streams a few microseconds between
#: copies, and a copy engine moves 8 MiB in about 21 us (smaller pieces ran slower at every size on 2 H200s)
MIN_PIECE_BYTES = 8 << 20
#: pieces a call aims for: the last piece's copy out (and on p ranks, p - 2 pieces of fill) is what the chain
#: adds to one push of the whole buffer, the gaps between pieces what more pieces add
TARGET_PIECES = 4

#: the size from which ``comm.broadcast(algorithm="ring")`` on the peer transport runs as this chain rather than
#: a round at a time, where the direct chain of :mod:`dtrain.comm.peer.direct` cannot run (CPU windows, CUDA
#: memory that CUDA IPC cannot export): on 2 H200s the chain ran at 0.92-0.96x NCCL's broadcast at 256 MiB and
#: 0.97-0.99x at 1 GiB, the rounds at 0.88x and 0.81-0.88x; at 64 MiB the rounds were ahead, 0.87-0.88x against
#: 0.83x, and at 16 MiB 0.55x against 0.36x (``probe-chain-copy-engines{,-fresh}-h200x2.txt``). A band starts at
#: the geometric midpoint.
CHAIN_FROM_BYTES = 128 << 20

#: how a rank copies a piece out of its ring into the caller's tensor: a copy engine's memcpy, or an elementwise
#: kernel on the SMs (leaving the copy engines to the pushes)
COPY_OUT = ("engine", "kernel")

CALLER = 0  # the caller's stream; 1 + l: lane l's


@dataclass(frozen=True)
class Op:
    """One step of a rank's plan, on ``stream`` (:data:`CALLER`, or ``1 + l`` for lane ``l``).

    ``wait``: until counter ``counter`` of rank ``rank``'s window reaches ``value`` (cyclically; ``exact``: equals
    it). ``write``: set that counter to ``value``. ``copy``: ``nbytes`` from ``src`` to ``dst``, each ``("slot",
    rank, byte offset in its window)`` or ``("tensor", byte offset)`` (the caller's buffer). ``fork``: the lanes'
    streams wait for the caller's work so far; ``join``: the caller's stream waits for the lanes'."""

    kind: str
    stream: int = CALLER
    rank: int = 0
    counter: int = 0
    value: int = 0
    exact: bool = False
    dst: tuple = ()
    src: tuple = ()
    nbytes: int = 0


def pieces(nbytes: int, world: int) -> int:
    """The piece size for a broadcast of ``nbytes`` on ``world`` ranks: :data:`TARGET_PIECES` pieces, each
    between :data:`MIN_PIECE_BYTES` and :data:`MAX_SLOT_BYTES`, 256-byte aligned."""
    del world  # the same pieces on any chain (measured on 2 ranks only)
    size = max(MIN_PIECE_BYTES, min(MAX_SLOT_BYTES, math.ceil(nbytes / TARGET_PIECES)))
    return -(-size // RING_AT) * RING_AT


def plan(rank: int, root: int, world: int, nbytes: int, piece: int, slots: int = SLOTS, lanes: int = LANES) -> list[Op]:
    """Rank ``rank``'s operations for one broadcast of ``nbytes`` from ``root`` in pieces of ``piece`` bytes
    through rings of ``slots`` slots, a pushing rank's pieces dealt over ``lanes`` streams, in the order the host
    issues them: the round's start, then piece by piece the lane's operations before the caller's, then the join.

    Piece ``k`` goes on lane ``l = k mod lanes`` as that lane's ``c = k // lanes``-th: its push raises the
    successor's ``READY[l]`` to ``c + 1`` (a lane's raises come in order, the lanes' do not), and on a rank in the
    middle its forwarding raises the rank's own ``FORWARDED[l]`` to ``c + 1``."""
    if world < 2 or nbytes <= 0:
        return []
    lanes = max(1, min(lanes, LANES))
    pos = (rank - root) % world
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    count = -(-nbytes // piece)
    sends, receives = pos < world - 1, pos > 0
    ops: list[Op] = []
    if sends:  # the round's first push waits for the successor to have taken the round before
        ops.append(Op("wait", CALLER, rank, FREE, ROUND_DONE, exact=True))
        ops.append(Op("write", CALLER, rank, FREE, 0))
        ops.append(Op("fork"))
    for k in range(count):
        at, size, slot = k * piece, min(piece, nbytes - k * piece), RING_AT + (k % slots) * piece
        lane, c = k % lanes, k // lanes
        last = k == count - 1
        if sends:
            on = 1 + lane
            if receives:
                ops.append(Op("wait", on, rank, READY + lane, c + 1))
            if k >= slots:
                ops.append(Op("wait", on, rank, FREE, k - slots + 1))
            source = ("slot", rank, slot) if receives else ("tensor", at)
            ops.append(Op("copy", on, dst=("slot", nxt, slot), src=source, nbytes=size))
            ops.append(Op("write", on, nxt, READY + lane, c + 1))
            if receives:
                ops.append(Op("write", on, rank, FORWARDED + lane, c + 1))
        if receives:
            ops.append(Op("wait", CALLER, rank, READY + lane, c + 1))
            ops.append(Op("copy", CALLER, dst=("tensor", at), src=("slot", rank, slot), nbytes=size))
            if sends:  # the slot is free once it is pushed on too
                ops.append(Op("wait", CALLER, rank, FORWARDED + lane, c + 1))
            if last:  # the round's end: this rank's counters back to 0, then the predecessor told
                for used in range(min(lanes, count)):
                    ops.append(Op("write", CALLER, rank, READY + used, 0))
                    if sends:
                        ops.append(Op("write", CALLER, rank, FORWARDED + used, 0))
            ops.append(Op("write", CALLER, prev, FREE, ROUND_DONE if last else k + 1))
    if sends:
        ops.append(Op("join"))
    return ops


class ChainStalled(RuntimeError):
    """A CPU chain's wait outlasted its timeout: a peer did not push, or did not take, a piece."""


class ChainBroadcast:
    """The pipelined chain broadcast of a group on one device, over a window of its own with rings of
    ``slots`` slots of ``slot_bytes``, a pushing rank's pieces dealt over ``lanes`` streams (a collective to make:
    every rank of the group, the same sizes); ``copy_out`` (:data:`COPY_OUT`) how pieces leave the ring on CUDA."""

    def __init__(
        self,
        group,
        device: torch.device,
        slot_bytes: int,
        slots: int = SLOTS,
        lanes: int = LANES,
        copy_out: str = "engine",
    ) -> None:
        if copy_out not in COPY_OUT:
            raise ValueError(f"chain broadcast: copy_out must be one of {', '.join(COPY_OUT)}, got {copy_out!r}")
        self.copy_out = copy_out
        if device.type == "cuda" and peer_channels._driver() is None:
            raise ValueError("the chain broadcast needs the CUDA driver's stream memory operations")
        self.slot_bytes = -(-int(slot_bytes) // RING_AT) * RING_AT
        self.slots, self.lanes = slots, max(1, min(lanes, LANES))
        self.window = peer_window.PeerWindow(group, device, RING_AT + slots * self.slot_bytes)
        self.rank, self.world = self.window.rank, self.window.world_size
        self.device = device
        self._plans: dict = {}
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._driver = peer_channels._driver()
            self._base = [int(p) for p in self.window._handle.buffer_ptrs]
            self._lanes = [torch.cuda.Stream(device) for _ in range(LANES)]
            counters = self.window.local(torch.int32, RING_AT // 4)
            counters.zero_()
            counters[FREE] = ROUND_DONE
            torch.cuda.synchronize(device)
        else:
            self._counters = [b[:RING_AT].view(torch.int32).numpy() for b in self.window.buffers]
            self._counters[self.rank][:] = 0
            self._counters[self.rank][FREE] = ROUND_DONE
            self._timeout = peer_window._group_timeout(self.window.group, device)
        self.window.barrier()  # every counter is set before any push

    def fits(self, piece: int) -> bool:
        return piece <= self.slot_bytes

    def __call__(self, flat: torch.Tensor, root: int, piece: int, timeout: timedelta | None = None) -> None:
        """Broadcast the contiguous ``flat`` of rank ``root`` into ``flat`` of every rank, in pieces of
        ``piece`` bytes (at most :attr:`slot_bytes`). ``timeout`` (the CPU's waits; default the group's)."""
        flat = flat.reshape(-1)
        if flat.numel() == 1:  # one element counts as contiguous whatever its stride
            flat = flat.as_strided((1,), (1,))
        data = flat.view(torch.uint8)
        nbytes = data.numel()
        key = (root, nbytes, piece)
        ops = self._plans.get(key)
        if ops is None:
            if len(self._plans) >= 256:
                self._plans.clear()
            ops = self._plans[key] = plan(self.rank, root, self.world, nbytes, piece, self.slots, self.lanes)
        self.window.calls += 1
        if self._cuda:
            self._run_cuda(ops, data)
        else:
            self._run_host(ops, data, timeout or self._timeout)

    def _run_cuda(self, ops: list[Op], data: torch.Tensor) -> None:
        d, base, tensor_at = self._driver, self._base, data.data_ptr()
        caller = torch.cuda.current_stream(self.device)
        streams = (caller.cuda_stream, *(lane.cuda_stream for lane in self._lanes))
        kernel, mine = self.copy_out == "kernel", self.window.buffers[self.rank]

        def address(where: tuple) -> int:
            return tensor_at + where[1] if where[0] == "tensor" else base[where[1]] + where[2]

        for op in ops:
            kind = op.kind
            if kind == "copy":
                if kernel and op.dst[0] == "tensor":  # on the caller's stream, torch's current one
                    at, slot = op.dst[1], op.src[2]
                    peer_channels.store(data[at : at + op.nbytes], mine[slot : slot + op.nbytes])
                    continue
                copied = d.copy(address(op.dst), address(op.src), op.nbytes, streams[op.stream])
                peer_channels._check(copied, "cuMemcpyDtoDAsync")
            elif kind == "wait":
                flag = peer_channels._WAIT_EQ if op.exact else peer_channels._WAIT_GEQ
                at = base[op.rank] + 4 * op.counter
                waited = d.wait(streams[op.stream], at, op.value & 0xFFFFFFFF, flag)
                peer_channels._check(waited, "cuStreamWaitValue32")
            elif kind == "write":
                at = base[op.rank] + 4 * op.counter
                written = d.write(streams[op.stream], at, op.value & 0xFFFFFFFF, 0)
                peer_channels._check(written, "cuStreamWriteValue32")
            elif kind == "fork":
                for lane in self._lanes:
                    lane.wait_stream(caller)
            else:  # join
                for lane in self._lanes:
                    caller.wait_stream(lane)

    def _run_host(self, ops: list[Op], data: torch.Tensor, timeout: timedelta) -> None:
        buffers, counters = self.window.buffers, self._counters

        def place(where: tuple, nbytes: int) -> torch.Tensor:
            if where[0] == "tensor":
                return data[where[1] : where[1] + nbytes]
            return buffers[where[1]][where[2] : where[2] + nbytes]

        for op in ops:
            if op.kind == "copy":
                place(op.dst, op.nbytes).copy_(place(op.src, op.nbytes))
            elif op.kind in ("fork", "join"):
                continue  # the host runs the plan in order
            elif op.kind == "wait":
                cell, target = counters[op.rank], op.value & 0xFFFFFFFF
                if op.exact:
                    done = lambda c=cell, i=op.counter, t=target: int(c[i]) & 0xFFFFFFFF == t  # noqa: E731
                else:
                    done = lambda c=cell, i=op.counter, t=target: peer_channels._reached(  # noqa: E731
                        int(c[i]) & 0xFFFFFFFF, t
                    )
                if op.counter == FREE:  # raised by the successor as it takes this rank's pieces
                    what = f"rank {(self.rank + 1) % self.world} to take its pieces (free {op.value:#x})"
                else:  # raised by the predecessor as it pushes
                    what = f"rank {(self.rank - 1) % self.world} to push a piece (ready {op.value})"
                try:
                    peer_window.spin_until(
                        done,
                        lambda: timeout,
                        lambda w=what: f"chain broadcast: rank {self.rank} waited past its timeout for {w}",
                    )
                except RuntimeError as err:
                    raise ChainStalled(str(err)) from err
            else:
                counters[op.rank][op.counter] = peer_channels._wrap(op.value)


def chain_for(group, device: torch.device, piece: int) -> ChainBroadcast:
    """The group's chain broadcast on ``device``, with slots of at least ``piece`` bytes (made, or grown, by every
    rank alike, as every rank computes the same piece for the same call)."""
    from dtrain.comm.state import group_state

    state = group_state(peer_window._group_key(group))
    key = ("chain", device)
    chain = state.windows.get(key)
    if chain is None or not chain.fits(piece):
        slot = piece if chain is None else max(piece, chain.slot_bytes)
        if chain is not None and device.type == "cuda":  # its copies may still be queued: let them finish first
            torch.cuda.synchronize(device)
        chain = state.windows[key] = peer_window._setting_up(
            lambda: ChainBroadcast(group, device, slot), group, "mapping the chain broadcast's windows"
        )
    return chain
