"""The ring broadcast and reduce as chains between the callers' own tensors: no staging slots, no copy out.

The chain broadcast of :mod:`dtrain.comm.peer.chain` passes every piece through a ring of slots in the next rank's
window and copies it out from there: two copies a piece on every receiving rank, and flow control on the slots.
Here each rank instead copies the pieces straight out of its predecessor's tensor into its own (a copy engine's
``cuMemcpyDtoDAsync`` over the peer mapping), so on 2 GPUs a broadcast is one copy, at the link's rate. What it
takes is the predecessor's tensor mapped in this process: each call, every rank that passes the buffer on names
its tensor's allocation (``cuMemGetAddressRange``, ``cuIpcGetMemHandle``: the CUDA IPC handle of the allocation
and the tensor's offset in it, about 3 us) in a host mailbox its successor reads (:class:`Mailbox`, a ring of
posts in /dev/shm); the successor maps an allocation once (``cuIpcOpenMemHandle``) and keeps the mapping, by
handle, for the calls after it (:data:`MAPPED_MAX` of them). torch's caching allocator hands the same allocations
out again, so fresh tensors each call cost what the same tensor does.

Each rank's window holds two counters, each written by a peer and waited on by the rank itself (a stream polls
its own memory): ``READY``, the pieces of the predecessor's tensor there to read (the root raises its successor's
to all of them at once, after the stream's earlier work on its tensor; a rank in the middle raises its successor's
as each piece lands in its own), and ``DONE``, set by the successor once it read the last piece. A round leaves
both at 0: a rank clears its own ``READY`` before it sets its predecessor's ``DONE``, and the predecessor's stream
waits for ``DONE`` and clears it; so every round issues the same waits and writes with the same values, and a
rank's role may change from one call to the next. A rank's stream leaves the call once its successor read its
tensor, so the caller may reuse it at once, as with NCCL's broadcast.

The reduce runs the same chain the other way round: it starts at the rank after the root and ends at the root,
and where the broadcast copies a piece, a rank combines it: it reads the piece of its predecessor's partial result
and writes its own input combined with it (one elementwise kernel reading the peer's memory over the link) into
its own partial, which its successor reads in turn; the root combines into its own tensor. The first rank's
partial is its input as the caller passed it, so on 2 GPUs a reduce is one kernel on the root and nothing moves on
the other rank; a rank in the middle writes its partial into a buffer of its own (the chain's, kept and mapped
once), so no caller's tensor but the root's is written.

The plan (:func:`plan`) is pure (waits, writes and copies per rank, checked with every interleaving of the ranks'
streams in the tests); :class:`DirectChain` names, posts, maps and runs it through a memory backend,
:class:`CudaMemory` (the CUDA driver) here, host memory in /dev/shm files in the tests. The host's only wait is a
receiving rank's, for its predecessor's post (the chain's first rank never waits on the host), bounded by the
group's timeout; it takes that post before it posts its own, so a rank that cannot name or map its memory fails
the call on every rank after it and leaves no stream waiting (:meth:`DirectChain._pass`).

Limits: CUDA, ranks of one host on an x86-64 CPU (the mailbox's posts rely on its store order, as the CPU windows'
counters do), tensors from allocations CUDA IPC can export (torch's caching allocator without expandable segments:
:func:`exportable`); elsewhere the broadcast runs as the slot chain or a round at a time, the reduce a round at a
time. A rank keeps up to
:data:`MAPPED_MAX` of its predecessor's allocations mapped, and CUDA leaves undefined what happens when a process
frees memory another still has mapped (``cuIpcOpenMemHandle``): torch's caching allocator frees cached segments on
``torch.cuda.empty_cache()`` and when an allocation fails. A rank only ever reads through a mapping, and only an
allocation its predecessor posted for the call at hand (an allocation made after a free has a handle of its own), so
no tensor is written through a stale one; ``dtrain.comm.peer.window.close_windows()`` (every rank alike; the
launcher calls it before the process group goes) unmaps them all. For this, and for the start of a lone call (a host
handshake, 65-125 us on 2 H200s; and for a reduce, counters on the device that NCCL's kernels do without),
``auto`` does not take this path; ``algorithm="ring"`` does.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from dtrain.comm.peer import chain as peer_chain
from dtrain.comm.peer import channels as peer_channels
from dtrain.comm.peer import window as peer_window

__all__ = [
    "CudaMemory",
    "DirectChain",
    "DirectRefused",
    "Mailbox",
    "Op",
    "plan",
    "pieces",
    "direct_for",
    "exportable",
    "checked_post",
    "MAPPED_MAX",
]

#: counter indexes, 4 bytes each at the start of every rank's window
READY, DONE = 0, 1
COUNTER_BYTES = 256
#: mappings of peers' allocations a rank keeps (least recently used closed first)
MAPPED_MAX = 32
#: posts a mailbox holds before a rank that passes buffers on waits for its successor to take one
MAIL_SLOTS = 64
_POST = 96  # a post: sequence number, offset, bytes, the 64-byte handle (8-byte words)
_HEADER = 64  # a mailbox's header: the posts its owner's successor has taken


@dataclass(frozen=True)
class Op:
    """One step of a rank's plan on the caller's stream. ``wait``: until counter ``counter`` of rank ``rank``'s
    window reaches ``value`` (``exact``: equals it). ``write``: set that counter to ``value``. ``copy``: bytes
    ``[at, at + nbytes)`` of the predecessor's tensor into the same bytes of this rank's. ``combine``: those bytes
    of the predecessor's partial combined with the same bytes of this rank's input, into its partial."""

    kind: str
    rank: int = 0
    counter: int = 0
    value: int = 0
    exact: bool = False
    at: int = 0
    nbytes: int = 0


def pieces(nbytes: int, world: int) -> int:
    """The piece size of a broadcast of ``nbytes`` on ``world`` ranks: the whole buffer on 2 (nothing to pipeline:
    one copy at the link's rate); on more, the chain broadcast's pieces (:func:`dtrain.comm.peer.chain.pieces`), so
    that a rank passes a piece on while the next one comes."""
    return max(1, nbytes) if world <= 2 else peer_chain.pieces(nbytes, world)


def plan(rank: int, root: int, world: int, nbytes: int, piece: int, reduce: bool = False) -> list[Op]:
    """Rank ``rank``'s operations for one broadcast of ``nbytes`` from ``root`` in pieces of ``piece`` bytes, along
    the chain ``root, root + 1, ...``; with ``reduce``, for one reduce into ``root`` along the chain ``root + 1,
    root + 2, ..., root``, each ``copy`` a ``combine`` (the piece of the predecessor's partial combined with this
    rank's input into this rank's partial). Every wait is on a counter of the waiting rank's own window (a stream
    polls its own memory; the peers write into it)."""
    if world < 2 or nbytes <= 0:
        return []
    pos = (rank - root - (1 if reduce else 0)) % world
    move = "combine" if reduce else "copy"
    prev, succ = (rank - 1) % world, (rank + 1) % world
    count = -(-nbytes // piece)
    sends, receives = pos < world - 1, pos > 0
    ops: list[Op] = []
    if not receives:  # the chain's first rank: its whole tensor is there once the stream's earlier work is
        ops.append(Op("write", succ, READY, count))
    for k in range(count if receives else 0):
        at = k * piece
        ops.append(Op("wait", rank, READY, k + 1))
        ops.append(Op(move, at=at, nbytes=min(piece, nbytes - at)))
        if sends:
            ops.append(Op("write", succ, READY, k + 1))
    if receives:  # the predecessor's tensor is read: this rank's count cleared, then the predecessor told
        ops.append(Op("write", rank, READY, 0))
        ops.append(Op("write", prev, DONE, 1))
    if sends:  # this rank's tensor stays the caller's to reuse only once the successor has read it
        ops.append(Op("wait", rank, DONE, 1, exact=True))
        ops.append(Op("write", rank, DONE, 0))
    return ops


class DirectRefused(RuntimeError):
    """A rank could not name its tensor's allocation to its successor (memory CUDA IPC cannot export)."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_IPC: list = []


def _ipc():
    """The CUDA driver's IPC and address-range functions, or None where it has none."""
    if not _IPC:
        found = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            rng = lib.cuMemGetAddressRange_v2
            rng.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
            get = lib.cuIpcGetMemHandle
            get.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
            opened = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
            opened.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
            close = lib.cuIpcCloseMemHandle
            close.argtypes = [ctypes.c_uint64]
            for fn in (rng, get, opened, close):
                fn.restype = ctypes.c_int
            found = (rng, get, opened, close)
        except (OSError, AttributeError):
            found = None
        _IPC.append(found)
    return _IPC[0]


#: ``cuIpcOpenMemHandle``'s flag that enables peer access to the exporting device where it is not yet
_LAZY_PEER_ACCESS = 1


def _expandable_segments() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def exportable(device: torch.device) -> bool:
    """Whether this process's tensors on ``device`` can be named to a peer: CUDA, a driver with IPC, stream memory
    operations and asynchronous copies, an x86-64 host (:data:`dtrain.comm.peer.window.SHARED_COUNTER_BARRIER`),
    and torch's caching allocator without expandable segments (their memory is not CUDA IPC's to export). Every
    rank of a launch answers alike, as they share the environment."""
    if device.type != "cuda" or not peer_window.SHARED_COUNTER_BARRIER or _expandable_segments():
        return False
    driver = peer_channels._driver()
    return _ipc() is not None and driver is not None and driver.copy is not None


def checked_post(offset: int, nbytes: int, extent: int, align: int, prev: int, what: str) -> int:
    """``offset``, checked: a predecessor's post names bytes ``[offset, offset + nbytes)`` of its allocation, which
    this process has mapped as ``extent`` bytes; they must lie inside it, from a multiple of ``align`` (the
    tensors' element size: a kernel reads the peer's memory as elements). ``ValueError`` naming rank ``prev``'s
    post otherwise: a copy or a kernel would read past the mapping (a fault, or another allocation's bytes)."""
    if offset % align:
        raise ValueError(
            f"{what}: rank {prev} posted an offset of {offset} bytes into its allocation, not a multiple of the "
            f"element size {align}"
        )
    if offset > extent or nbytes > extent - offset:
        raise ValueError(
            f"{what}: rank {prev} posted bytes [{offset}, {offset + nbytes}) of an allocation of {extent} bytes; "
            "a post names bytes inside the allocation it maps"
        )
    return offset


def extent_of(address: int) -> int:
    """The bytes from device address ``address`` to the end of the allocation holding it, as this process's
    driver knows it (a peer's allocation mapped here: its size as mapped, whatever the peer posts)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    result = _ipc()[0](ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if result != 0:
        raise DirectRefused(f"the CUDA driver knows no allocation at {address:#x} (driver error {result})")
    return base.value + size.value - address


def name_of(address: int) -> tuple[bytes, int]:
    """The CUDA IPC handle of the allocation holding device address ``address``, and the offset in it."""
    rng, get, _, _ = _ipc()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if rng(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)) != 0:
        raise DirectRefused(f"the CUDA driver knows no allocation at {address:#x}")
    handle = _Handle()
    result = get(ctypes.byref(handle), base.value)
    if result != 0:
        raise DirectRefused(f"CUDA IPC cannot export the allocation at {base.value:#x} (driver error {result})")
    return ctypes.string_at(ctypes.addressof(handle), 64), address - base.value


class Mailbox:
    """Each rank's ring of :data:`MAIL_SLOTS` posts in a /dev/shm file every rank of the group maps (a CPU
    :class:`~dtrain.comm.peer.window.PeerWindow`): a post is a 64-byte handle, an offset and a byte count under a
    sequence number, written last. A rank posts into its own ring and takes its predecessor's posts in order; it
    writes how many it took into its predecessor's header, so a poster waits only once its successor is a full ring
    behind."""

    def __init__(self, group, via: torch.device) -> None:
        size = _HEADER + MAIL_SLOTS * _POST
        self.window = peer_window.PeerWindow(group, torch.device("cpu"), size, via=via)
        self.rank, self.world = self.window.rank, self.window.world_size
        self._words = [b.numpy().view(np.uint64) for b in self.window.buffers]
        self._bytes = [b.numpy() for b in self.window.buffers]
        self._words[self.rank][:] = 0
        self.posted = 0  # posts this rank made
        self.taken = 0  # posts this rank took from its predecessor
        self.window.barrier()

    def _slot(self, seq: int) -> int:
        return _HEADER + (seq % MAIL_SLOTS) * _POST

    def post(self, handle: bytes, offset: int, nbytes: int, timeout: timedelta) -> None:
        seq = self.posted + 1
        words = self._words[self.rank]
        succ = (self.rank + 1) % self.world
        _spin(
            lambda: seq - int(words[0]) <= MAIL_SLOTS,
            timeout,
            lambda: f"rank {succ} to take rank {self.rank}'s post {seq - MAIL_SLOTS}",
        )
        at = self._slot(seq)
        words[at // 8 + 1] = offset
        words[at // 8 + 2] = nbytes
        self._bytes[self.rank][at + 24 : at + 88] = np.frombuffer(handle, dtype=np.uint8)
        words[at // 8] = seq  # last: a peer that sees it sees the rest (x86-64's store order)
        self.posted = seq

    def take(self, timeout: timedelta) -> tuple[bytes, int, int]:
        """The predecessor's next post: (handle, offset, bytes)."""
        prev = (self.rank - 1) % self.world
        seq = self.taken + 1
        words = self._words[prev]
        at = self._slot(seq)
        _spin(lambda: int(words[at // 8]) == seq, timeout, lambda: f"rank {prev} to post its tensor (post {seq})")
        offset, nbytes = int(words[at // 8 + 1]), int(words[at // 8 + 2])
        handle = self._bytes[prev][at + 24 : at + 88].tobytes()
        words[0] = seq  # taken, in the predecessor's header
        self.taken = seq
        return handle, offset, nbytes


#: looks a host wait spins before it sleeps between looks: a post mostly comes within microseconds, and the
#: ranks of a GPU host do not outnumber its cores
_SPINS = 20_000
_SLEEP_S = 20e-6


def _spin(done, timeout: timedelta, what) -> None:
    looks = 0
    deadline = None
    while not done():
        looks += 1
        if looks > _SPINS:
            time.sleep(_SLEEP_S)
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout.total_seconds()
            elif now > deadline:
                raise peer_chain.ChainStalled(f"waited past its timeout ({timeout}) for {what()}")


@dataclass(frozen=True)
class Combine:
    """What a plan's ``combine`` operations compute: ``out = own (op) peer`` piece by piece, ``out`` and ``own``
    this rank's flat tensors of one dtype (the same tensor on the root), ``peer`` the predecessor's partial."""

    op: str
    out: torch.Tensor
    own: torch.Tensor


def combine_into(out: torch.Tensor, own: torch.Tensor, peer: torch.Tensor, op: str) -> None:
    """``out = own (op) peer``, elementwise (``avg`` sums: the caller divides once at the end)."""
    if op in ("sum", "avg"):
        torch.add(own, peer, out=out)
    elif op == "prod":
        torch.mul(own, peer, out=out)
    elif op == "max":
        torch.maximum(own, peer, out=out)
    elif op == "min":
        torch.minimum(own, peer, out=out)
    else:
        raise ValueError(f"reduce: unknown op {op!r}")


def piece_of(t: torch.Tensor, at: int, nbytes: int) -> torch.Tensor:
    """Bytes ``[at, at + nbytes)`` of the flat ``t``, in its dtype (pieces are whole elements)."""
    size = t.element_size()
    return t[at // size : (at + nbytes) // size]


class _Raw:
    """A device address as an array (``__cuda_array_interface__``, version 3, no stream to wait on), for
    ``torch.as_tensor``: how a peer's mapped memory becomes a tensor the combining kernel reads."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


class CudaMemory:
    """How :class:`DirectChain` reaches memory on a CUDA device: the driver's IPC to name and map allocations,
    and a plan's operations as driver calls on the caller's current stream (the copies by a copy engine, the waits
    and writes as stream memory operations, the combining as one elementwise kernel reading the peer's memory).
    Another backend (the tests' host memory in /dev/shm files) provides the same methods."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._driver = peer_channels._driver()
        self._views: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def counters(self, window: peer_window.PeerWindow) -> list[int]:
        """Every rank's window address, where its counters are."""
        window.local(torch.int32, COUNTER_BYTES // 4).zero_()
        torch.cuda.synchronize(self.device)
        return [int(p) for p in window._handle.buffer_ptrs]

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A flat byte buffer of this process's that a peer can map (a partial result in a reduce's chain)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def name(self, address: int) -> tuple[bytes, int]:
        return name_of(address)

    def open(self, handle: bytes) -> int:
        raw = _Handle()
        ctypes.memmove(ctypes.addressof(raw), handle, 64)
        address = ctypes.c_uint64()
        result = _ipc()[2](ctypes.byref(address), raw, _LAZY_PEER_ACCESS)
        if result != 0:
            raise DirectRefused(f"cuIpcOpenMemHandle failed with CUDA driver error {result}")
        return address.value

    def extent(self, address: int) -> int:
        """The bytes of the mapping at ``address`` (:meth:`open`'s), from the driver."""
        return extent_of(address)

    def close(self, address: int) -> None:
        """Unmap ``address`` once the copies queued out of it are done."""
        torch.cuda.synchronize(self.device)
        self._views.clear()
        _ipc()[3](ctypes.c_uint64(address))

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def view(self, address: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """``nbytes`` of device memory at ``address`` (a peer's, mapped) as a flat tensor of ``dtype`` on this
        device; :class:`DirectRefused` where torch will not alias it there (a torch that places memory by the
        pointer's own device, or copies it)."""
        key = (address, nbytes, dtype)
        t = self._views.get(key)
        if t is None:
            try:
                t = torch.as_tensor(_Raw(address, nbytes), device=self.device).view(dtype)
            except (RuntimeError, TypeError, ValueError) as err:
                raise DirectRefused(f"torch cannot take the peer's memory at {address:#x} as a tensor: {err}") from err
            if t.data_ptr() != address or t.device != self.device:
                raise DirectRefused(
                    f"torch took the peer's memory at {address:#x} as {t.device} at {t.data_ptr():#x}, not in place on "
                    f"{self.device}"
                )
            if len(self._views) >= 4 * MAPPED_MAX:
                self._views.popitem(last=False)
            self._views[key] = t
        else:
            self._views.move_to_end(key)
        return t

    def run(self, ops: list[Op], address: int, source: int, base: list[int], timeout: timedelta, combine=None) -> None:
        """Issue ``ops`` on the current stream: copies from ``source`` into ``address``, counters at ``base``;
        ``combine`` (a :class:`Combine`) what a ``combine`` operation computes, ``source`` the peer's partial."""
        del timeout  # the device waits without limit; the watchdog reports a stalled call
        d = self._driver
        stream = torch.cuda.current_stream(self.device).cuda_stream
        peer = None
        for op in ops:
            if op.kind == "copy":
                peer_channels._check(d.copy(address + op.at, source + op.at, op.nbytes, stream), "cuMemcpyDtoDAsync")
            elif op.kind == "combine":
                if peer is None:
                    total = combine.out.numel() * combine.out.element_size()
                    peer = self.view(source, total, combine.out.dtype)
                combine_into(
                    piece_of(combine.out, op.at, op.nbytes),
                    piece_of(combine.own, op.at, op.nbytes),
                    piece_of(peer, op.at, op.nbytes),
                    combine.op,
                )
            elif op.kind == "wait":
                flag = peer_channels._WAIT_EQ if op.exact else peer_channels._WAIT_GEQ
                peer_channels._check(
                    d.wait(stream, base[op.rank] + 4 * op.counter, op.value & 0xFFFFFFFF, flag), "cuStreamWaitValue32"
                )
            else:
                peer_channels._check(
                    d.write(stream, base[op.rank] + 4 * op.counter, op.value & 0xFFFFFFFF, 0), "cuStreamWriteValue32"
                )


class DirectChain:
    """The direct chain broadcast and reduce of a group on one device (a collective to make: every rank of the
    group): a window of counters, a host mailbox, the mappings of the predecessor's allocations, and for a reduce
    the buffer a rank in the middle of the chain writes its partial result into. ``memory``: how the device's
    memory is named, mapped and moved (default :class:`CudaMemory`, which needs :func:`exportable`)."""

    def __init__(self, group, device: torch.device, memory=None) -> None:
        if memory is None:
            if not exportable(device):
                raise ValueError("the direct chain needs CUDA IPC, the driver's stream memory operations and x86-64")
            memory = CudaMemory(device)
        self.memory = memory
        self.window = peer_window.PeerWindow(group, device, COUNTER_BYTES)
        self.rank, self.world = self.window.rank, self.window.world_size
        self.device = device
        self._base = memory.counters(self.window)
        self.mailbox = Mailbox(self.window.group, device)
        self._timeout = peer_window._group_timeout(self.window.group, device)
        self._mapped: OrderedDict[bytes, int] = OrderedDict()
        self._extents: dict[bytes, int] = {}  # the bytes of each mapping, as this process mapped them
        self._pinned: set[bytes] = set()
        self._plans: dict = {}
        self._partials: list[torch.Tensor] = []  # every partial buffer made, the newest last: a peer may map any
        self.window.barrier()  # every counter is clear before any call

    def _map(self, handle: bytes) -> int:
        """The address of the predecessor's allocation ``handle`` in this process: mapped at its first call and
        kept (the :data:`MAPPED_MAX` most recently used); a mapping a CUDA graph recorded a copy from is kept for
        good (its replays read it)."""
        at = self._mapped.get(handle)
        if self.memory.capturing():
            self._pinned.add(handle)
        if at is not None:
            self._mapped.move_to_end(handle)
            return at
        unpinned = [h for h in self._mapped if h not in self._pinned]
        if len(unpinned) >= MAPPED_MAX:
            self._extents.pop(unpinned[0], None)
            self.memory.close(self._mapped.pop(unpinned[0]))
        at = self.memory.open(handle)
        try:
            self._extents[handle] = self.memory.extent(at)
        except Exception:
            self.memory.close(at)
            raise
        self._mapped[handle] = at
        return at

    @property
    def mapped(self) -> int:
        """How many of the predecessors' allocations this rank holds mapped."""
        return len(self._mapped)

    def close(self) -> None:
        """Unmap every peer allocation this rank mapped (the partial buffers go once every rank closed)."""
        while self._mapped:
            self.memory.close(self._mapped.popitem()[1])
        self._extents.clear()
        self._pinned.clear()

    def _partial(self, nbytes: int) -> torch.Tensor:
        """This rank's buffer for a partial result of ``nbytes``: the newest if it is large enough, else a new one
        of the next power of two (the old ones stay: the successor may hold them mapped, and a CUDA graph may have
        recorded a write into one)."""
        if not self._partials or self._partials[-1].numel() < nbytes:
            self._partials.append(self.memory.buffer(max(1 << 20, 1 << (nbytes - 1).bit_length())))
        return self._partials[-1]

    def _plan(self, root: int, nbytes: int, reduce: bool) -> list[Op]:
        key = (root, nbytes, reduce)
        ops = self._plans.get(key)
        if ops is None:
            if len(self._plans) >= 256:
                self._plans.clear()
            ops = self._plans[key] = plan(self.rank, root, self.world, nbytes, pieces(nbytes, self.world), reduce)
        return ops

    def _pass(
        self, exposed: int | None, nbytes: int, what: str | None, timeout: timedelta, align: int, check=None
    ) -> int:
        """The host's part of a call. Where ``what`` names the call of a rank that reads its predecessor's memory:
        take the predecessor's post, map it, check that the ``nbytes`` it names lie inside the mapping from a
        multiple of ``align`` (:func:`checked_post`) and ``check(address)`` it. Then, where ``exposed`` is an
        address (what this rank's successor reads; None: nothing), name it and post it. Returns the predecessor's
        address mapped here, or 0.

        A failure anywhere fails every rank after this one along the chain and leaves no stream waiting: a rank
        that cannot use a good post, or cannot name its own memory after taking one, drains its predecessor's
        round on the device (:meth:`_drain`) before it raises, and a rank that raises posts a refusal, which the
        next rank passes on. Taking before posting is what lets a refusal travel the whole chain."""
        source = 0
        if what is not None:
            handle, offset, sent = self.mailbox.take(timeout)
            prev = (self.rank - 1) % self.world
            if sent == 0:
                self._refuse(exposed, timeout)
                raise DirectRefused(f"rank {prev} could not name its tensor's allocation to this rank")
            try:
                if sent != nbytes:
                    raise ValueError(
                        f"{what}: rank {self.rank} passed {nbytes} bytes and rank {prev} {sent}: every rank passes "
                        "a tensor of the same size"
                    )
                at = self._map(handle)
                source = at + checked_post(offset, nbytes, self._extents[handle], align, prev, what)
                if check is not None:
                    check(source)
            except Exception:
                try:
                    self._drain(sent, timeout)
                finally:  # the next rank hears of it whatever the drain did
                    self._refuse(exposed, timeout)
                raise
        if exposed is not None:
            try:
                handle, offset = self.memory.name(exposed)
            except DirectRefused:
                try:
                    if what is not None:
                        self._drain(nbytes, timeout)
                finally:
                    self._refuse(exposed, timeout)
                raise
            self.mailbox.post(handle, offset, nbytes, timeout)
        return source

    def _refuse(self, exposed: int | None, timeout: timedelta) -> None:
        """Post a refusal where this rank's successor expects a post: it raises too, naming this rank."""
        if exposed is not None:
            self.mailbox.post(b"\0" * 64, 0, 0, timeout)

    def _drain(self, sent: int, timeout: timedelta) -> None:
        """Close the predecessor's round of ``sent`` bytes without reading it, on this rank's stream: wait for its
        last piece, clear this rank's count and tell the predecessor its memory was read, so that its stream
        goes on and every counter is back at 0 for the next call."""
        count = -(-sent // pieces(sent, self.world))
        prev = (self.rank - 1) % self.world
        ops = [Op("wait", self.rank, READY, count), Op("write", self.rank, READY, 0), Op("write", prev, DONE, 1)]
        self.memory.run(ops, 0, 0, self._base, timeout)

    def broadcast(self, flat: torch.Tensor, root: int, timeout: timedelta | None = None) -> None:
        """Broadcast the contiguous ``flat`` of rank ``root`` into ``flat`` of every rank. ``timeout``: the host's
        wait for the predecessor's post (default the group's)."""
        nbytes = flat.numel() * flat.element_size()
        if nbytes == 0:
            return
        timeout = timeout or self._timeout
        pos = (self.rank - root) % self.world
        address = flat.data_ptr()
        exposed = address if pos < self.world - 1 else None
        what = "broadcast" if pos > 0 else None
        source = self._pass(exposed, nbytes, what, timeout, flat.element_size())
        self.window.calls += 1
        self.memory.run(self._plan(root, nbytes, False), address, source, self._base, timeout)

    def reduce(self, flat: torch.Tensor, root: int, op: str = "sum", timeout: timedelta | None = None) -> None:
        """Reduce the contiguous ``flat`` of every rank into ``flat`` of rank ``root`` (``avg`` sums: the caller
        divides); the other ranks' tensors are read, not written. ``timeout`` as :meth:`broadcast`'s."""
        nbytes = flat.numel() * flat.element_size()
        if nbytes == 0:
            return
        timeout = timeout or self._timeout
        pos = (self.rank - root - 1) % self.world  # the chain starts after the root and ends at it
        first, last = pos == 0, pos == self.world - 1
        out = flat if last or first else piece_of(self._partial(nbytes), 0, nbytes).view(flat.dtype)
        exposed = None if last else out.data_ptr()

        def readable(address: int) -> None:  # the predecessor's partial as a tensor this rank's kernel reads
            self.memory.view(address, nbytes, flat.dtype)

        source = self._pass(exposed, nbytes, None if first else "reduce", timeout, flat.element_size(), readable)
        self.window.calls += 1
        combine = None if first else Combine(op, out, flat)
        self.memory.run(self._plan(root, nbytes, True), out.data_ptr(), source, self._base, timeout, combine)


def direct_for(group, device: torch.device) -> DirectChain:
    """The group's direct chain on CUDA ``device`` (made by every rank alike at its first call)."""
    from dtrain.comm.state import group_state

    state = group_state(peer_window._group_key(group))
    key = ("direct", device)
    made = state.windows.get(key)
    if made is None:
        made = state.windows[key] = peer_window._setting_up(
            lambda: DirectChain(group, device), group, "mapping the direct chain's windows"
        )
    return made
