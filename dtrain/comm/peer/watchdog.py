"""A host watchdog for collectives that run on the GPU without the host waiting for them.

On CUDA the peer transport's rounds wait on each other with device barriers: the host enqueues a call and
returns, so a peer that never comes stalls the GPU, not the host, and no Python exception can say which call
it was. This is NCCL's problem too, and ours is solved as torch's ProcessGroupNCCL solves it: after every
call the host records a CUDA event, and a daemon thread checks the oldest unfinished one. When a call has
not finished ``limit`` after it was enqueued, the thread writes one report to stderr naming the collective,
the algorithm, the size, the group's rank and the call's number, and how its barriers map to the device's
own message. The device barrier gives up :data:`GRACE` later and prints
``[FATAL] CUDASymmetricMemory::barrier: rank R failed to receive signal from rank P on channel C``: the peer
``P`` it waited on, and the barrier ``C`` of the call (channel k is the call's k-th barrier; torch's message
says microseconds but prints milliseconds). The process then fails at its next CUDA call (the context is
lost), as it does after NCCL's watchdog fires.

The bookkeeping is plain Python over anything with ``query()``, so the CPU tests drive it with fake events.

On the host, :class:`Heartbeat` says which peer is gone when a collective fails because a process died (Gloo
raises on the closed connection; NCCL's own watchdog times the call out): each rank writes ``host:pid`` into
the job's c10d store once and bumps a counter there every :data:`HEARTBEAT_S`, from a daemon thread. The
store is torch's rendezvous store, which the elastic agent keeps when a worker dies. A rank whose collective
failed asks :meth:`Heartbeat.gone`: a peer of this host whose process no longer runs, or any peer whose counter
stopped, is named (``rank 1 (host:pid)``); and each rank's thread watches the next rank in a ring, so a peer
that dies while the others wait in a collective that never fails (NCCL until its timeout) is named within
:data:`STALE_S` too. The same idea as torch's own NCCL heartbeat monitor (``TORCH_NCCL_ENABLE_MONITORING``),
kept in the store so every backend gets it.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

__all__ = [
    "GRACE",
    "HEARTBEAT_S",
    "MAX_PENDING",
    "RESERVE",
    "STALE_S",
    "Heartbeat",
    "Peer",
    "Watchdog",
    "capturing",
    "process_ended",
    "watch",
]

#: How much longer the device barrier waits than the watchdog, so the host's report comes first.
GRACE = timedelta(seconds=5)
#: Calls watched at once; later calls go unwatched until older ones finish (the oldest is the one that stalls).
MAX_PENDING = 1024
#: Spare events kept made: a call takes one (recording costs a few microseconds, making one ~10 us).
RESERVE = 256


class Watchdog:
    """Watches calls in the order they were enqueued; :meth:`check` reports the oldest one past its limit."""

    def __init__(
        self,
        make_event: Callable[[], object],
        report: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reserve: int = RESERVE,
    ) -> None:
        self.reserve = reserve
        self._make_event = make_event
        self._report = report or _to_stderr
        self._clock = clock
        self._pending: deque = deque()  # (event, label, limit in s, enqueued at)
        self._free: list = []  # spare events (made ahead by top_up, and finished ones back)
        self._lock = threading.Lock()  # both threads take finished calls off the front
        self._reported: set[int] = set()
        self.reports = 0
        self.skipped = 0  # calls since the last watched one that went unwatched

    def watch(self, label: str | Callable[[], str], limit_s: float, record: Callable[[object], None]) -> bool:
        """Record a new event with ``record(event)`` after a call described by ``label`` (a string, or a function
        called only for a report); False if too many are pending (the call goes unwatched: an older one is
        still running, and that is the one a stall would hold)."""
        pending = self._pending
        if len(pending) >= MAX_PENDING:
            self.skipped += 1
            return False
        try:
            event = self._free.pop()
        except IndexError:  # none spare: the thread makes more (making a CUDA event costs ~10 us)
            self.skipped += 1
            return False
        record(event)
        if self.skipped:  # a stall in an unwatched call holds every later one: say which were not watched
            label = _after_skips(label, self.skipped)
            self.skipped = 0
        pending.append((event, label, limit_s, self._clock()))
        return True

    def top_up(self) -> None:
        """Make spare events up to the reserve (the thread calls it, off the caller's path)."""
        while len(self._free) < self.reserve:
            self._free.append(self._make_event())

    def check(self) -> str | None:
        """Drop finished calls; report the oldest unfinished one once it is older than its limit (once). Does
        nothing while a CUDA graph is being captured in this process (:func:`capturing`): querying an event
        then would invalidate a capture made in CUDA's global mode, as torch's own NCCL watchdog found."""
        if _CAPTURES[0]:
            return None
        with self._lock:
            while self._pending and self._pending[0][0].query():
                self._free.append(self._pending.popleft()[0])
        self.top_up()
        with self._lock:
            if not self._pending:
                self._reported.clear()
                return None
            event, label, limit_s, since = self._pending[0]
        waited = self._clock() - since
        key = id(event) ^ hash(since)
        if waited < limit_s or key in self._reported:
            return None
        self._reported.add(key)
        self.reports += 1
        label = label if isinstance(label, str) else label()
        message = (
            f"dtrain.comm watchdog: {label} has not finished on the GPU {waited:.0f} s after it was enqueued "
            f"(limit {limit_s:.0f} s). A peer never reached one of its barriers: the device's "
            "'[FATAL] CUDASymmetricMemory::barrier: rank R failed to receive signal from rank P on channel C' "
            "line names the rank P waited on and the barrier (channel k is the call's k-th barrier). The "
            f"device barrier gives up {GRACE.total_seconds():.0f} s after this; the process then fails at its "
            "next CUDA call."
        )
        self._report(message)
        return message

    def pending(self) -> int:
        return len(self._pending)


def _after_skips(label: str | Callable[[], str], skipped: int) -> Callable[[], str]:
    def text() -> str:
        first = label if isinstance(label, str) else label()
        return f"{first} (or one of the {skipped} calls enqueued just before it, which were not watched)"

    return text


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_CAPTURES = [0]  # CUDA-graph captures in progress in this process (dtrain's own; see capturing())


class capturing:  # noqa: N801  (used as a context manager, like torch.cuda.graph)
    """Around a CUDA-graph capture: the watchdog's thread queries no event meanwhile. dtrain's own captures use
    it; a capture of your own in CUDA's global mode while dtrain's collectives are watched should too (or use
    ``capture_error_mode="thread_local"``)."""

    def __enter__(self) -> capturing:
        with _LOCK:
            _CAPTURES[0] += 1
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _CAPTURES[0] -= 1


# device -> its watchdog and event recorder. Process-wide, not per group: one polling thread per device watches
# the calls of every group on it (events of one stream complete in order, whatever group made the call).
_DOGS: dict[object, tuple[Watchdog, Callable[[object], None]]] = {}
_LOCK = threading.Lock()
POLL_S = 0.5


def _poll(dog: Watchdog, device) -> None:
    import torch

    torch.cuda.set_device(device)
    failures = 0
    while True:
        time.sleep(POLL_S)
        try:
            dog.check()
            failures = 0
        except Exception as err:  # a query that failed once is retried; the CUDA context may be gone
            failures += 1
            if failures >= 3:
                _to_stderr(f"dtrain.comm watchdog on {device} stops: {err}")
                with _LOCK:  # a later call starts a new one; nothing is kept alive meanwhile
                    if _DOGS.get(device, (None,))[0] is dog:
                        del _DOGS[device]
                    dog._pending.clear()
                    dog._free.clear()
                return


def _event_maker(device):
    """Events made ready to record: torch makes a CUDA event at its first record (~5-10 us), so each is
    recorded once on a stream of its own when made, which the watchdog's thread does ahead of need."""
    import torch

    side = torch.cuda.Stream(device)

    def make():
        event = torch.cuda.Event()
        event.record(side)
        return event

    return make


def _recorder(device):
    """Record an event on ``device``'s current stream. ``torch.cuda.current_stream()`` makes a new Python object
    each time (~4 us on an H100 host) and ``Event.record`` looks it up again; keeping one stream object per raw
    stream and recording through the base class costs under 1 us (benchmarks/collectives/probe.py watchdog)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    base_record = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None)
    if raw_stream is None or base_record is None:  # another torch: the plain way
        return lambda event: event.record(torch.cuda.current_stream(device))
    streams: dict[int, object] = {}

    def record(event) -> None:
        raw = raw_stream(index)
        stream = streams.get(raw)
        if stream is None:
            stream = streams[raw] = torch.cuda.current_stream(device)
        base_record(event, stream)

    return record


def watch(device, limit: timedelta, label: Callable[[], str]) -> None:
    """After a CUDA collective call on ``device``'s current stream: watch it (one daemon thread per device).
    ``label`` is called only for a report, to keep the common path cheap."""
    entry = _DOGS.get(device)
    if entry is None:
        with _LOCK:
            entry = _DOGS.get(device)
            if entry is None:
                dog = Watchdog(_event_maker(device))
                dog.top_up()
                entry = _DOGS[device] = (dog, _recorder(device))
                threading.Thread(target=_poll, args=(dog, device), name="dtrain-comm-watchdog", daemon=True).start()
    dog, record = entry
    dog.watch(label, limit.total_seconds(), record)


# ----------------------------------------------------------------------------------------- host heartbeats

#: Seconds between a rank's heartbeats in the store.
HEARTBEAT_S = 0.5
#: A peer whose counter has not moved for this long is gone (a live process beats from a daemon thread, even
#: while its main thread waits in a collective).
STALE_S = 5.0
_PREFIX = "dtrain/heartbeat/"


@dataclass(frozen=True)
class Peer:
    """A rank of the job and where it ran: ``rank 1 (host:pid)``."""

    rank: int
    host: str = ""
    pid: int = 0

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.host}:{self.pid})" if self.host else f"rank {self.rank}"


def process_ended(pid: int) -> bool:
    """True when process ``pid`` of this host no longer runs: gone, or dead and not yet reaped (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]  # the field after the command's name
        return state in ("Z", "X", "x")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc here: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


#: What a rank registers in the store as who it is: ``host:pid``, a host name of printable ASCII without spaces and
#: a process id Linux can give (at most 2**22).
_WHO = re.compile(rb"([\x21-\x7e]{1,255}):([1-9][0-9]{0,6})")
PID_MAX = 1 << 22


def parse_who(value: bytes) -> tuple[str, int] | None:
    """``(host, pid)`` from a peer's ``host:pid`` entry in the store, or None where it is not one (a pid that is
    not a positive whole number up to :data:`PID_MAX`, a host with spaces, control or non-ASCII characters), so
    that no process of this host is looked up, nor anything printed, on another's word beyond that."""
    found = _WHO.fullmatch(value) if isinstance(value, bytes) else None
    if found is None or int(found[2]) > PID_MAX:
        return None
    return found[1].decode("ascii"), int(found[2])


class Heartbeat:
    """This rank's sign of life in ``store`` (a c10d store: ``set``, ``get``, ``add``, ``check``), and which
    peers stopped theirs. ``start()`` registers ``host:pid`` and starts the beating thread; ``stop()`` ends it.
    ``report`` gets the line naming a peer the ring watch found gone (default: stderr)."""

    def __init__(
        self,
        store,
        rank: int,
        world: int,
        *,
        interval: float = HEARTBEAT_S,
        stale: float = STALE_S,
        report: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.interval, self.stale = interval, stale
        self.me = Peer(rank, socket.gethostname(), os.getpid())
        self._report = report or _to_stderr
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, Peer] = {}
        self.reported: list[Peer] = []

    def start(self) -> Heartbeat:
        self.store.set(f"{_PREFIX}who/{self.rank}", f"{self.me.host}:{self.me.pid}")
        self.beat()
        self._thread = threading.Thread(target=self._run, name="dtrain-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None

    def beat(self) -> None:
        self.store.add(f"{_PREFIX}beat/{self.rank}", 1)

    def count(self, rank: int) -> int:
        """``rank``'s heartbeats so far (0 before its first; ``add(key, 0)`` reads without waiting)."""
        return int(self.store.add(f"{_PREFIX}beat/{rank}", 0))

    def peer(self, rank: int) -> Peer:
        """Who ``rank`` is (its host and pid where it registered)."""
        known = self._peers.get(rank)
        if known is not None:
            return known
        key = f"{_PREFIX}who/{rank}"
        try:
            if not self.store.check([key]):
                return Peer(rank)
            who = parse_who(self.store.get(key))
        except Exception:  # the store itself may be gone with its host: the rank alone still says something
            return Peer(rank)
        if who is None:  # not what a rank registers: the rank alone, never a pid looked up or a host printed
            return Peer(rank)
        known = self._peers[rank] = Peer(rank, *who)
        return known

    def gone(self, wait: float | None = None) -> list[Peer]:
        """The peers that stopped: a process of this host that ended is named at once; otherwise every peer
        whose counter does not move over ``wait`` seconds (default three heartbeats)."""
        peers = [self.peer(r) for r in range(self.world) if r != self.rank]
        here = [p for p in peers if p.host == self.me.host and p.pid and process_ended(p.pid)]
        if here:
            return here
        try:
            before = {p.rank: self.count(p.rank) for p in peers}
            time.sleep(3 * self.interval if wait is None else wait)
            return [p for p in peers if self.count(p.rank) == before[p.rank]]
        except Exception:  # no store to ask
            return []

    def describe_failure(self, err: BaseException, wait: float | None = None) -> str | None:
        """The line naming the peers gone when ``err`` stopped a collective on this rank; None if every peer
        still beats (the failure is something else)."""
        gone = self.gone(wait)
        if not gone:
            return None
        names = ", ".join(map(str, gone))
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        verb = "is" if len(gone) == 1 else "are"
        return (
            f"dtrain.comm: a collective on {self.me} failed because {names} {verb} gone (the process ended or "
            f"stopped its heartbeat): {type(err).__name__}: {first[:300]}"
        )

    def _learn_peers(self) -> None:
        """Read who each peer is ahead of any failure, so that naming a dead one then needs no store round trip:
        a launcher that sees a worker die stops the others within a fraction of a second, and the report must
        come out first."""
        if len(self._peers) < self.world - 1:
            for r in range(self.world):
                if r != self.rank:
                    self.peer(r)

    def _run(self) -> None:
        watched = (self.rank + 1) % self.world  # each rank watches the next one: every rank is watched once
        last, since = -1, self._clock()
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                self._learn_peers()
                if watched == self.rank or self.reported:
                    continue
                now, count = self._clock(), self.count(watched)
                if count != last:
                    last, since = count, now
                elif now - since >= self.stale:
                    peer = self.peer(watched)
                    self.reported.append(peer)
                    self._report(
                        f"dtrain.comm heartbeat: {peer} has not beaten for {now - since:.0f} s (seen by {self.me}); "
                        "a collective with it cannot finish"
                    )
            except Exception:  # the store went away (its host ended): nothing more to say from here
                return
