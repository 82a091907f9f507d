"""Ordered one-way channels between ranks of one host, through their peer windows: a point-to-point transport
that holds no SM while it waits.

Each :class:`Channel` carries the messages one rank sends another, in the order sent. Its receiver's window
holds a ring of ``slots`` slots of ``slot_bytes``; two counters run with it, ``ready`` in the receiver's window
(messages landed) and ``free`` in the sender's (messages the receiver has copied out). The ``n``-th message goes
to slot ``n mod slots``: the sender waits until ``free`` reaches ``n - slots + 1``, copies the payload into the
receiver's slot and raises ``ready`` to ``n + 1``; the receiver waits until ``ready`` reaches ``n + 1``, copies
the slot out and raises ``free`` to ``n + 1``. The counters are 32-bit and compared cyclically, as CUDA's
``CU_STREAM_WAIT_VALUE_GEQ`` does, so they never need resetting.

Messages may also come in rounds (a training step's, say): the sender marks a round's last message (``send(...,
last=True)``) and the receiver books it as such (``post(..., last=True)``); the next round numbers its messages
from 0 again. Having taken a round's last message, the receiver sets its ``ready`` back to 0 and then ``free`` to
:data:`ROUND_DONE`; the sender's first message of the next round waits for ``free`` to equal ``ROUND_DONE`` (every
message of the round before taken, ``ready`` reset) and sets it back to 0 before it raises ``ready``. Each round
then issues the same waits and raises with the same values, so a round recorded once in a CUDA graph replays
correctly as often as it is launched, between eager rounds too.

On CUDA every step is a stream operation: the copies are ``cuMemcpyDtoDAsync`` through the peer mapping, the waits
``cuStreamWaitValue32`` and the raises ``cuStreamWriteValue32`` (CUDA Driver API, "Stream Memory Operations"),
whose default write follows a memory fence, so a receiver that sees ``ready`` sees the payload. The sender pushes:
a send runs on a stream of its channel that first waits for the caller's stream, so the payload lands in the
receiver's slot while both go on computing. The receiver takes a message on its own stream where it uses it
(:meth:`Receive.wait`): by then it has usually landed, and the wait costs nothing. Nothing spins on the SMs, unlike
an NCCL receive posted early, whose kernel holds its CTAs until the sender comes, and the host's work per message
is a few stream operations, each one call into the driver (no torch stream switch, tensor view or event object a
message; the send's completion events are kept and reused). Every wait that can block a stream is one the caller's
order needs (the data it is about to use, or, on a sender's stream, a slot of the step before), and the GPU's
hardware queues run the streams' operations in the order the host issued them, so a schedule that cannot deadlock
with buffered sends cannot deadlock here either (a receive posted early, waiting on a stream of its own, could: an
operation issued after it on a stream sharing its hardware queue would wait behind it).
On the CPU (windows in /dev/shm) the host copies and waits itself; the ring then never waits within a step when
``slots`` covers a step's messages.

Where a send's copy runs is the channels' ``engine`` (or the send's own):

- ``"stream"`` (the default): on a stream of the channel's, after an event recorded on the caller's, through a
  copy engine, as above; the caller's stream goes on at once.
- ``"inline"``: the same copy-engine copy and raise issued on the caller's stream itself, with no event and no
  second stream between the payload's kernel and its copy.
- ``"kernel"``: an elementwise kernel on the caller's stream stores the payload into the receiver's slot over
  the peer mapping (the SMs move it, as NCCL's own kernels do), then the raise.

The last two put the slot waits on the caller's stream too, so they suit rings that hold a whole round (where a
sender only waits at a round's first message, for the round before to be taken).

A receiver whose ring holds a whole round can take its messages lent (``post(..., lend=True)``): the tensor is
the slot itself, so taking a message is the wait alone (no copy out, no counter raised back), and
:meth:`PeerChannels.release` gives the round's slots back to their senders once the caller is done with them (on
CUDA after the caller's work on its stream so far); the sender's next round waits for that.

Limits: all ranks of one host (:func:`~dtrain.comm.peer.window.peer_available`); on the CPU an x86-64 host, whose
store order makes a counter seen imply the payload before it seen (Intel SDM vol. 3, 8.2.2). A peer that never
comes leaves the CUDA stream waiting (no timeout on the device); on the CPU a wait past the group's timeout raises.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from dtrain.comm.peer import window as peer_window

__all__ = ["ENGINES", "Channel", "PeerChannels", "Receive", "channels_available"]

_ALIGN = 256  # every slot starts on a 256-byte boundary (what cudaMalloc gives)

#: What a receiver writes into its sender's ``free`` once it has taken a round's last message (an EQ wait matches
#: it; no count within a round reaches it).
ROUND_DONE = 0x7FFFFFF0
_WAIT_GEQ, _WAIT_EQ = 0x0, 0x1  # CUstreamWaitValue_flags

#: Where a send's copy runs (see the module): the channel's own stream, the caller's stream, or a kernel there.
ENGINES = ("stream", "inline", "kernel")


class Channel(NamedTuple):
    """The messages rank ``src`` sends rank ``dst`` (ranks of the group), at most ``slot_bytes`` each, up to
    ``slots`` in flight."""

    src: int
    dst: int
    slot_bytes: int
    slots: int


def channels_available(group, device: torch.device) -> bool:
    """Whether :class:`PeerChannels` can serve ``group`` on ``device`` (a collective call): every rank on this
    host and, on CUDA, symmetric memory and the driver's stream memory operations; on the CPU an x86-64 host."""
    ok = _driver() is not None if device.type == "cuda" else peer_window.SHARED_COUNTER_BARRIER
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item()) and peer_window.peer_available(group, device)


class _Driver(NamedTuple):
    """The driver's functions the channels call: the stream memory operations, and (None where the driver lacks
    one) the asynchronous copy and the events that order a channel's stream after the caller's."""

    wait: object
    write: object
    copy: object = None
    record: object = None
    wait_event: object = None
    create_event: object = None
    query: object = None
    destroy_event: object = None

    @property
    def direct(self) -> bool:
        return None not in (self.copy, self.record, self.wait_event, self.create_event, self.query, self.destroy_event)


_DRIVER: list[_Driver | None] = []

#: ``cuEventCreate``'s flag for an event that records no time, and ``cuEventQuery``'s answer for work not done.
_EVENT_DISABLE_TIMING = 0x2
_NOT_READY = 600

#: The driver's functions besides the stream memory operations: name, argument types.
_DIRECT = (
    ("cuMemcpyDtoDAsync_v2", [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]),
    ("cuEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
    ("cuStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
    ("cuEventCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
    ("cuEventQuery", [ctypes.c_void_p]),
    ("cuEventDestroy_v2", [ctypes.c_void_p]),
)


def _driver() -> _Driver | None:
    """``cuStreamWaitValue32`` and ``cuStreamWriteValue32`` from the CUDA driver, or None where it has none."""
    if not _DRIVER:
        found = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            pair = []
            for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
                fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                fn.restype = ctypes.c_int
                pair.append(fn)
            direct = []
            for name, argtypes in _DIRECT:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.argtypes = argtypes
                    fn.restype = ctypes.c_int
                direct.append(fn)
            found = _Driver(*pair, *direct)
        except (OSError, AttributeError):
            found = None
        _DRIVER.append(found)
    return _DRIVER[0]


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"peer channels: {what} failed with CUDA driver error {result}")


def _reached(value: int, target: int) -> bool:
    """``value >= target`` as 32-bit counters compared cyclically."""
    return ((value - target) & 0xFFFFFFFF) < 0x80000000


class Receive:
    """A message posted for receipt: :meth:`wait` takes it (and any posted before it on its channel) out of the
    ring and returns it."""

    __slots__ = ("_channels", "_index", "_number", "_seq", "_last", "_done", "_lent", "tensor")

    def __init__(
        self,
        channels: PeerChannels,
        index: int,
        number: int,
        tensor: torch.Tensor,
        last: bool = False,
        seq: int = 0,
        lent: bool = False,
    ) -> None:
        # ``number`` within the round (the slot and the counters' values), ``seq`` on the channel (the order taken);
        # ``lent``: ``tensor`` is the slot itself (PeerChannels.post)
        self._channels, self._index, self._number, self._last, self._seq = channels, index, number, last, seq
        self.tensor, self._lent = tensor, lent
        self._done = False

    def wait(self) -> torch.Tensor:
        """On CUDA the caller's stream waits for the message and copies it out (the host does not wait); on the
        CPU the host does both."""
        if not self._done:
            self._channels._drain(self._index, self._seq)
        return self.tensor

    def is_completed(self) -> bool:
        return self._done


class _Sent:
    """A send's completion: on CUDA an event on the channel's stream (torch's, or the driver's own, returned to
    ``channels``' pool when this is dropped); on the CPU the send is done on return."""

    __slots__ = ("event", "_raw", "_channels")

    def __init__(self, event=None, raw: int | None = None, channels: PeerChannels | None = None) -> None:
        self.event, self._raw, self._channels = event, raw, channels

    def wait(self) -> None:
        if self._raw is not None:
            channels = self._channels
            _check(channels._driver.wait_event(channels._current(), self._raw, 0), "cuStreamWaitEvent")
        elif self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def is_completed(self) -> bool:
        if self._raw is not None:
            result = self._channels._driver.query(self._raw)
            if result not in (0, _NOT_READY):
                _check(result, "cuEventQuery")
            return result == 0
        return self.event is None or self.event.query()

    def __del__(self) -> None:
        if self._raw is not None:
            self._channels._events.append(self._raw)


class PeerChannels:
    """The channels of ``channels`` this rank sends or receives on, over a window of its own (a collective:
    every rank of ``group`` makes it with the same list, in the same order)."""

    #: where sends copy unless a send names its own (:data:`ENGINES`; only CUDA tells them apart)
    engine = "stream"

    def __init__(self, group, device: torch.device, channels: Sequence[Channel], *, engine: str = "stream") -> None:
        if engine not in ENGINES:
            raise ValueError(f"peer channels: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.device = device
        self.engine = engine
        self.rank = dist.get_rank(self.group)
        self.channels = [Channel(*c) for c in channels]
        for c in self.channels:
            if c.src == c.dst or c.slots < 1 or c.slot_bytes < 1:
                raise ValueError(f"peer channels: bad channel {c} (two ranks, at least one slot of one byte)")
        n = len(self.channels)
        # each rank's window: its `ready` counters (as receiver), its `free` counters (as sender), then the rings
        # of the channels it receives on
        self._ready_at = [4 * i for i in range(n)]
        self._free_at = [4 * (n + i) for i in range(n)]
        at = -(-8 * n // _ALIGN) * _ALIGN
        self._ring_at: list[int] = []
        ends: dict[int, int] = {}
        for c in self.channels:
            start = ends.get(c.dst, at)
            self._ring_at.append(start)
            ends[c.dst] = start + c.slots * _round(c.slot_bytes)
        nbytes = max(ends.values(), default=at)
        layout = f"peer channels {[tuple(c) for c in self.channels]} (the same channels in the same order)"
        self.window = peer_window.PeerWindow(self.group, device, nbytes, layout=layout)
        self._sent = [0] * n
        self._posted = [0] * n
        self._booked = [0] * n  # receives posted on each channel, all rounds
        self._rounds = [False] * n  # per channel: whether a round has ended (the next one waits for ROUND_DONE)
        self._waiting: list[list[Receive]] = [[] for _ in range(n)]  # CPU: posted, not yet copied out
        self._lent: dict[int, int] = {}  # channel -> what its sender's free counter gets at release()
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._driver = _driver()
            self._base = [int(p) for p in self.window._handle.buffer_ptrs]
            self._streams = {i: torch.cuda.Stream(device) for i, c in enumerate(self.channels) if c.src == self.rank}
            self._raw_streams = {i: s.cuda_stream for i, s in self._streams.items()}
            #: driver calls for every step (False: torch's copies, stream switches and events)
            self.direct = self._driver.direct
            self._index = device.index if device.index is not None else torch.cuda.current_device()
            self._raw_current = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self._events: list[int] = []  # the driver's events no send holds
            self._order = {i: self._new_event() for i in self._streams} if self.direct else {}
            mine = self.window.local(torch.uint8, nbytes)
            mine.zero_()
            torch.cuda.synchronize(device)
        else:
            self._counters = [buf[: 8 * n].view(torch.int32).numpy() if n else None for buf in self.window.buffers]
            self._counters[self.rank][:] = 0
            self._timeout = peer_window._group_timeout(self.group, device)
        dist.barrier(group=self.group)  # every counter is zero before any message

    # -- sending

    def send(self, index: int, tensor: torch.Tensor, *, last: bool = False, engine: str | None = None) -> _Sent:
        """Send ``tensor`` (contiguous, at most the channel's ``slot_bytes``) as the channel's next message;
        ``last`` ends its round; ``engine`` (default the channels') where the copy runs (see the module)."""
        engine = self.engine if engine is None else engine
        if engine not in ENGINES:
            raise ValueError(f"peer channels: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        c = self.channels[index]
        payload = _as_bytes(tensor)
        if c.src != self.rank or payload.numel() > c.slot_bytes:
            raise ValueError(
                f"peer channels: rank {self.rank} cannot send {payload.numel()} bytes on channel {index} {c}"
            )
        n = self._sent[index]
        self._sent[index] = 0 if last else n + 1
        # the first message of a round after another: wait for every message of that round to be taken
        new_round = n == 0 and self._rounds[index]
        self._rounds[index] = self._rounds[index] or last
        slot = self._ring_at[index] + (n % c.slots) * _round(c.slot_bytes)
        free_at = self._base[self.rank] + self._free_at[index] if self._cuda else 0
        if self._cuda and self.direct and engine != "stream":
            # on the caller's stream: the slot waits, the copy (a copy engine's, or a kernel's stores), the raise
            stream = self._current()
            self._slot_waits(stream, free_at, new_round, n, c.slots)
            nbytes = payload.numel()
            if engine == "inline" and nbytes:
                copied = self._driver.copy(self._base[c.dst] + slot, payload.data_ptr(), nbytes, stream)
                _check(copied, "cuMemcpyDtoDAsync")
            elif nbytes:
                store(self.window.buffers[c.dst][slot : slot + nbytes], payload)
            self._write_value(stream, self._base[c.dst] + self._ready_at[index], n + 1)
            return _Sent()  # done in the caller's stream order: its memory is reused only after it
        if self._cuda and self.direct:
            d, stream = self._driver, self._raw_streams[index]
            # the channel's stream after the caller's (the payload is made there), then the copy and the raise
            order = self._order[index]
            _check(d.record(order, self._current()), "cuEventRecord")
            _check(d.wait_event(stream, order, 0), "cuStreamWaitEvent")
            self._slot_waits(stream, free_at, new_round, n, c.slots)
            nbytes = payload.numel()
            if nbytes:
                _check(d.copy(self._base[c.dst] + slot, payload.data_ptr(), nbytes, stream), "cuMemcpyDtoDAsync")
            self._write_value(stream, self._base[c.dst] + self._ready_at[index], n + 1)
            self._hold(tensor, index)
            done = self._events.pop() if self._events else self._new_event()
            _check(d.record(done, stream), "cuEventRecord")
            return _Sent(raw=done, channels=self)
        if self._cuda:
            stream = self._streams[index]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                raw = stream.cuda_stream
                self._slot_waits(raw, free_at, new_round, n, c.slots)
                self.window.buffers[c.dst][slot : slot + payload.numel()].copy_(payload)
                self._write_value(raw, self._base[c.dst] + self._ready_at[index], n + 1)
                tensor.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
            return _Sent(event)
        if new_round:
            self._spin(self.rank, self._free_at[index], ROUND_DONE, f"rank {c.dst} to take the last round", exact=True)
            self._counters[self.rank][self._free_at[index] // 4] = 0
        if n >= c.slots:
            self._spin(self.rank, self._free_at[index], n - c.slots + 1, f"rank {c.dst} to free a slot")
        self.window.buffers[c.dst][slot : slot + payload.numel()].copy_(payload)
        self._counters[c.dst][self._ready_at[index] // 4] = np.int32(_wrap(n + 1))
        return _Sent()

    # -- receiving

    def post(
        self, index: int, shape: Sequence[int], dtype: torch.dtype, *, last: bool = False, lend: bool = False
    ) -> Receive:
        """Book the channel's next message as a ``shape`` tensor of ``dtype`` (allocated now, on the caller's
        stream); it is taken out of its slot by :meth:`Receive.wait`, or by the wait of a message after it.
        ``last``: the message ends its round (as its sender marked it).

        ``lend``: the tensor is the message's slot itself, not a copy: the wait only waits for the message, and
        the slot stays the caller's until :meth:`release`, which tells the sender (its next round waits for that).
        A round of a lending channel must fit its slots (ValueError otherwise)."""
        c = self.channels[index]
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * dtype.itemsize
        if c.dst != self.rank or nbytes > c.slot_bytes:
            raise ValueError(f"peer channels: rank {self.rank} cannot receive {nbytes} bytes on channel {index} {c}")
        n = self._posted[index]
        if lend:
            if n >= c.slots:
                raise ValueError(
                    f"peer channels: channel {index} lends its slots within a round of at most {c.slots} messages; "
                    f"this is its message {n + 1}"
                )
            slot = self._ring_at[index] + n * _round(c.slot_bytes)
            out = self.window.local(torch.uint8, self.window.nbytes)[slot : slot + nbytes].view(dtype)
            out = out.view(tuple(shape)).detach()
        else:
            out = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self._posted[index] = 0 if last else n + 1
        seq = self._booked[index]
        self._booked[index] = seq + 1
        received = Receive(self, index, n, out, last, seq, lend)
        self._waiting[index].append(received)
        return received

    def _drain(self, index: int, seq: int) -> None:
        """Take the channel's posted messages up to the ``seq``-th posted out of their slots, in order: on CUDA as
        operations on the caller's stream (wait for ``ready``, copy out, raise the sender's ``free``), on the
        CPU by the host."""
        c = self.channels[index]
        waiting = self._waiting[index]
        while waiting and waiting[0]._seq <= seq:
            received = waiting.pop(0)
            n = received._number
            slot = self._ring_at[index] + (n % c.slots) * _round(c.slot_bytes)
            out = _as_bytes(received.tensor)
            if received._lent:  # the slot is the tensor: wait for it, and tell the sender at release()
                self._take_lent(index, n, received._last)
            elif self._cuda:
                stream = self._current()
                self._wait_value(stream, self._base[self.rank] + self._ready_at[index], n + 1)
                if self.direct:
                    source = self._base[self.rank] + slot
                    _check(self._driver.copy(out.data_ptr(), source, out.numel(), stream), "cuMemcpyDtoDAsync")
                else:
                    out.copy_(self.window.buffers[self.rank][slot : slot + out.numel()])
                if received._last:  # the round's end: ready back to 0, then tell the sender
                    self._write_value(stream, self._base[self.rank] + self._ready_at[index], 0)
                self._write_value(
                    stream, self._base[c.src] + self._free_at[index], ROUND_DONE if received._last else n + 1
                )
            else:
                self._spin(self.rank, self._ready_at[index], n + 1, f"rank {c.src}'s message {n}")
                out.copy_(self.window.buffers[self.rank][slot : slot + out.numel()])
                if received._last:
                    self._counters[self.rank][self._ready_at[index] // 4] = 0
                self._counters[c.src][self._free_at[index] // 4] = np.int32(
                    ROUND_DONE if received._last else _wrap(n + 1)
                )
            received._done = True

    # -- the waits and raises

    def _take_lent(self, index: int, n: int, last: bool) -> None:
        """Wait for a lent message (on CUDA the caller's stream waits; on the CPU the host does); what the sender
        is told waits for :meth:`release`."""
        c = self.channels[index]
        if self._cuda:
            stream = self._current()
            self._wait_value(stream, self._base[self.rank] + self._ready_at[index], n + 1)
            if last:
                self._write_value(stream, self._base[self.rank] + self._ready_at[index], 0)
        else:
            self._spin(self.rank, self._ready_at[index], n + 1, f"rank {c.src}'s message {n}")
            if last:
                self._counters[self.rank][self._ready_at[index] // 4] = 0
        self._lent[index] = ROUND_DONE if last else n + 1

    def release(self) -> None:
        """Give the slots of the messages taken lent back to their senders (on CUDA as stream operations after the
        caller's work so far, which may read them until then)."""
        for index, value in self._lent.items():
            c = self.channels[index]
            if self._cuda:
                self._write_value(self._current(), self._base[c.src] + self._free_at[index], value)
            else:
                self._counters[c.src][self._free_at[index] // 4] = np.int32(
                    value if value == ROUND_DONE else _wrap(value)
                )
        self._lent.clear()

    def _slot_waits(self, stream: int, free_at: int, new_round: bool, n: int, slots: int) -> None:
        """``stream`` waits, before message ``n`` of a round goes into its slot, for the round before to have been
        taken (its first message; then the counter is cleared) and for the slot to be free (a full ring)."""
        if new_round:
            self._wait_value(stream, free_at, ROUND_DONE, _WAIT_EQ)
            self._write_value(stream, free_at, 0)
        if n >= slots:
            self._wait_value(stream, free_at, n - slots + 1)

    def _wait_value(self, stream: int, address: int, value: int, flags: int = _WAIT_GEQ) -> None:
        """``stream`` (a raw handle) waits until the counter at ``address`` reaches ``value`` (cyclically), or
        with ``_WAIT_EQ`` equals it."""
        _check(self._driver.wait(stream, address, value & 0xFFFFFFFF, flags), "cuStreamWaitValue32")

    def _write_value(self, stream: int, address: int, value: int) -> None:
        _check(self._driver.write(stream, address, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")

    def _hold(self, tensor: torch.Tensor, index: int) -> None:
        """Keep ``tensor``'s memory from the allocator until channel ``index``'s stream has copied it."""
        tensor.record_stream(self._streams[index])

    def _current(self) -> int:
        """The caller's current stream on this device, as the driver's handle."""
        if self._raw_current is not None:
            return self._raw_current(self._index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def _new_event(self) -> int:
        handle = ctypes.c_void_p()
        _check(self._driver.create_event(ctypes.byref(handle), _EVENT_DISABLE_TIMING), "cuEventCreate")
        return handle.value

    def __del__(self) -> None:
        """The driver's events go with the channels (a send still held keeps its channels, and so its event)."""
        events = [*self.__dict__.get("_events", ()), *self.__dict__.get("_order", {}).values()]
        self.__dict__.get("_events", []).clear()
        self.__dict__.get("_order", {}).clear()
        for event in events:
            self._driver.destroy_event(event)  # at exit the context may be gone: nothing to report then

    def _spin(self, rank: int, at: int, target: int, what: str, exact: bool = False) -> None:
        counters = self._counters[rank]
        if exact:
            reached = lambda: int(counters[at // 4]) & 0xFFFFFFFF == target  # noqa: E731
        else:
            reached = lambda: _reached(int(counters[at // 4]) & 0xFFFFFFFF, target & 0xFFFFFFFF)  # noqa: E731
        peer_window.spin_until(
            reached,
            lambda: self._timeout,
            lambda: f"peer channels: rank {self.rank} waited past the group's timeout for {what}",
        )


def _round(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _wrap(value: int) -> int:
    """``value`` as a signed 32-bit number (what a counter holds)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def store(out: torch.Tensor, payload: torch.Tensor) -> None:
    """``out[:] = payload`` (byte tensors of one length) by an elementwise kernel, never a copy engine's memcpy
    (which ``copy_`` between two contiguous tensors of one dtype is): the bytes taken as the widest integers their
    length and both addresses allow, stored as ``payload | 0``, bit for bit."""
    n = payload.numel()
    aligned = (w for w in (8, 4, 2) if n % w == 0 and out.data_ptr() % w == 0 and payload.data_ptr() % w == 0)
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[next(aligned, 1)]
    torch.bitwise_or(payload.view(dtype), 0, out=out.view(dtype))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("peer channels: tensors must be contiguous")
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
