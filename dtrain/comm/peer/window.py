"""The peer-memory transport: ranks of one host read each other's buffers directly.

Every rank of a group owns a *window*, a buffer every other rank of the group has mapped: on CUDA a torch
symmetric-memory allocation (CUDA peer memory over NVLink or PCIe, with device-side barriers), on the CPU a
file in /dev/shm that each rank maps (barriers on counters in the files themselves, :meth:`PeerWindow.barrier`).
A schedule then runs as :mod:`dtrain.comm.peer.pull` compiles it: per round, the copy-in, a barrier, and one
pass per destination range that reads the peers' windows and combines them with the rank's own value (on CUDA
one fused Triton kernel, :mod:`dtrain.comm.peer.kernels`, where Triton is present; else torch operations). From
:data:`PUSH_FROM_BYTES` (``DTRAIN_COMM_PEER_MODE``) a schedule runs in the push form instead
(:mod:`dtrain.comm.peer.push`): the sender reduces and stores into the receiver's window, the faster direction
over NVLink.

Limits. On CUDA a barrier waits on the device. For a peer that never comes, the host's watchdog
(:mod:`dtrain.comm.peer.watchdog`) reports the call after ``DTRAIN_COMM_TIMEOUT`` seconds, else the process group's own
timeout (:data:`DEVICE_BARRIER_TIMEOUT` where torch does not expose it); the barrier gives up
:data:`dtrain.comm.peer.watchdog.GRACE` later, printing the peer it waited for and its channel (the k-th barrier of
a call waits on channel k), with a device-side error (the CUDA context is lost), not a
:class:`CommTimeoutError`. On the CPU the barrier names the ranks that did not arrive.
``DTRAIN_COMM_TRANSPORT=auto`` (the default) uses this transport for CUDA groups of one host
(:func:`peer_default`); a group whose window torch would hang on is refused on every rank alike
(:class:`PeerUnavailable`) and the API moves it to point-to-point.
After a timeout the window is dropped (ranks then stand at different barriers). The CPU windows are files
in /dev/shm, reserved in full before use and unlinked once every rank has mapped them; a rank killed between
the two leaves its file behind (named ``dtrain-<pid of rank 0>-...``).

Nothing crosses a network: this transport only exists for ranks of one host, and it refuses others. What it
saves against point-to-point messages is the host work of a message (an NCCL group a round, measured at
55-110 us on 4 H200s) and the separate reduction pass over received data: a round is one kernel and a barrier.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import platform
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtrain.comm.ir.schedule import Schedule
from dtrain.comm.p2p.runtime import CommTimeoutError
from dtrain.comm.peer import kernels as peer_kernels
from dtrain.comm.peer import watchdog
from dtrain.comm.peer.pull import compile_pull
from dtrain.comm.peer.push import compile_push, has_push_form, writes_own_block_only
from dtrain.comm.state import find_state, group_state, states
from dtrain.env import comm_env

__all__ = [
    "PeerWindow",
    "PeerUnavailable",
    "window_for",
    "run_pull",
    "run_push",
    "push_mode",
    "peer_available",
    "peer_default",
    "close_windows",
]

_COUNTER = itertools.count()

#: Bytes after a CPU window's data that hold its rank's barrier counter (one cache line).
FLAG_BYTES = 64

#: Whether a CPU window's barrier may be a counter in shared memory: on x86-64 a store becomes visible to other
#: cores after the stores before it, and a load is not passed by later loads (Intel SDM vol. 3, 8.2.2), so a
#: peer that sees the counter sees the data written before it. Elsewhere the barrier goes through Gloo.
SHARED_COUNTER_BARRIER = platform.machine().lower() in ("x86_64", "amd64")

#: Looks at the peers' counters before a waiting rank sleeps between looks, and how long it sleeps: ranks may
#: outnumber cores, and a rank that spins takes the core from the peer it waits for. With 4 ranks on 2 cores a
#: 1 KiB tree all-reduce took 1.4 ms sleeping and 57 ms spinning without sleep (Gloo's own: 7.8 ms).
BARRIER_SPINS = 16
BARRIER_SLEEP_S = 20e-6
_GENERATIONS = itertools.count()


def _group_key(group) -> object:
    # the group object itself, the world's too: after destroy_process_group and a new init, the new world is
    # another object and must not find the old world's windows
    return dist.group.WORLD if group is None else group


def _agree(ok: bool, problem: str, group, what: str, device: torch.device | None = None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless every rank is ``ok`` (a collective check, so one
    rank's failure cannot leave the others waiting at the next step; the flag on ``device``, default the CPU)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if not flag.item():
        mine = f": on this rank, {problem}" if problem else " (this rank was fine)"
        raise ValueError(f"peer transport set-up failed on some rank while {what}{mine}")


def _same_host(group, device: torch.device) -> bool:
    """True when every rank of ``group`` runs on this host (compares a hash of the host name)."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return all(int(t) == int(mine) for t in every)


#: How long a CUDA device barrier waits for a missing peer when neither ``DTRAIN_COMM_TIMEOUT`` nor the process
#: group's own timeout can be read: NCCL's watchdog default. Past it the barrier kernel stops with a device-side
#: error (the CUDA context is lost and the process fails at its next CUDA call) instead of spinning forever. The
#: error cannot name the round: the barrier runs on the device, so the host learns of it only at a later sync.
DEVICE_BARRIER_TIMEOUT = timedelta(minutes=10)


def _group_timeout(group, device: torch.device) -> timedelta:
    """The process group's own timeout (``init_process_group(timeout=...)`` / ``new_group(timeout=...)``), which
    NCCL's watchdog also keeps; :data:`DEVICE_BARRIER_TIMEOUT` where this torch does not expose it."""
    try:  # private in torch: any failure to read it falls back to the default
        value = group._get_backend(device).options._timeout
    except Exception:
        return DEVICE_BARRIER_TIMEOUT
    return value if isinstance(value, timedelta) and value.total_seconds() > 0 else DEVICE_BARRIER_TIMEOUT


# symmetric-memory rendezvous this process has made for its windows: process-wide, as torch counts them per
# process, not per group (see _same_rendezvous_count)
_RENDEZVOUS = [0]

#: The size of torch's symmetric-memory signal pad where torch does not tell it (torch 2.11's default); a barrier
#: channel takes ``4 * world_size`` bytes of it.
SIGNAL_PAD_BYTES = 2048


class PeerUnavailable(ValueError):
    """This group cannot have a peer window now; raised on every rank of the group alike, so that all of them
    may fall back to the point-to-point transport together."""


def _same_rendezvous_count(group, device: torch.device) -> None:
    """Refuse, on every rank of ``group`` alike, a window that torch's rendezvous would hang on.

    torch's CUDA symmetric memory names the store keys of a rendezvous by how many rendezvous the *process*
    has made, not the group (pytorch/pytorch#196082, fixed by #196350; torch 2.11 has it). After a window
    for a subgroup that not every rank of ``group`` belongs to, the members of ``group`` count differently
    and the next rendezvous on ``group`` waits forever on keys nobody writes. Groups that partition the world
    (the data-parallel groups of a grid) always count alike. Only this module's rendezvous are counted."""
    mine = torch.tensor([_RENDEZVOUS[0]], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    counts = [int(t) for t in every]
    if len(set(counts)) > 1:
        raise PeerUnavailable(
            "peer transport: the ranks of this group have made different numbers of symmetric-memory windows "
            f"({counts}, by group rank), because an earlier window belonged to a group that not all of them "
            "are in; torch's rendezvous would hang on that (pytorch/pytorch#196082). Make windows for groups "
            "that partition the world, make this group's window first (call a collective on it before the "
            "subgroup's), or use DTRAIN_COMM_TRANSPORT=p2p for this job"
        )


def _same_shape(group, nbytes: int, layout: str, via: torch.device) -> None:
    """Refuse, on every rank of ``group`` alike, windows that the ranks would lay out apart: every rank must make
    one of the same size and, where the caller names a ``layout`` (what lies where in it: a channel list, bucket
    sizes), the same layout, or one rank's stores land in what its peer keeps elsewhere (or past its window). One
    all-gather of the size and a digest of the layout, before anything is mapped."""
    digest = int.from_bytes(hashlib.sha256(layout.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([nbytes, digest], dtype=torch.int64, device=via)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    sizes = [int(t[0]) for t in every]
    if len(set(sizes)) > 1:
        raise ValueError(
            f"peer transport: the ranks of this group make windows of different sizes ({sizes} bytes, by group "
            "rank); every rank makes its window alike (the same collective on tensors of the same size)"
        )
    differ = [r for r, t in enumerate(every) if int(t[1]) != int(every[0][1])]
    if differ:
        raise ValueError(
            f"peer transport: group ranks {differ} lay out their windows otherwise than rank 0 (on this rank: "
            f"{layout[:200]}); every rank makes its window with the same layout"
        )


class PeerWindow:
    """This rank's window and its peers', ``nbytes`` each, for one process group and device. ``via``: the device
    the group's own collectives take tensors on, where that is not ``device`` (a host window of a CUDA group).
    ``layout``: what lies where in the window, in words, where the caller lays it out from arguments every rank
    must pass alike (checked with the size on every rank before anything is mapped: :func:`_same_shape`)."""

    def __init__(
        self, group, device: torch.device, nbytes: int, via: torch.device | None = None, layout: str = ""
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.device = device
        self._via = via if via is not None else device
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.nbytes = max(int(nbytes), 64)
        self.generation = next(_GENERATIONS)  # prepared plans hold slices of one window: key them by it
        # barrier channels in torch's signal pad (2048 bytes of uint32 slots, world_size a channel)
        self.channels = max(1, SIGNAL_PAD_BYTES // (4 * self.world_size))
        self._handle = None
        self.pointers: torch.Tensor | None = None  # every rank's window address on the device (CUDA windows)
        self.pads: torch.Tensor | None = None  # every rank's signal-pad address on the device (CUDA windows)
        self.calls = 0  # collective calls made through this window (the watchdog's reports number them)
        self.group_name = self.group.group_name
        self.global_rank = dist.get_global_rank(self.group, self.rank)
        self._local: dict = {}  # (dtype, numel) -> this rank's window as that many elements (local)
        # one-pass calls (dtrain.comm.peer.fused.one_pass): the half the next one uses, and whether peers may
        # still be reading the last one's (a call of another kind first passes a barrier: fused.settle)
        self.bank = 0
        self.pending = False
        _same_shape(self.group, self.nbytes, layout, self._via)
        with torch.inference_mode(False):  # a window made under inference mode serves the calls outside it too
            self.buffers = self._map_cuda() if device.type == "cuda" else self._map_shared_files()

    def _map_cuda(self) -> list[torch.Tensor]:
        import torch.distributed._symmetric_memory as symm_mem

        _same_rendezvous_count(self.group, self.device)
        name = self.group.group_name
        if not symm_mem.is_symm_mem_enabled_for_group(name):
            symm_mem.enable_symm_mem_for_group(name)
        mine = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._handle = symm_mem.rendezvous(mine, name)
        _RENDEZVOUS[0] += 1
        self._device_timeout = _group_timeout(self.group, self.device)
        pad = getattr(symm_mem, "get_signal_pad_size", None)  # torch's own size where it tells it
        if pad is not None:
            self.channels = max(1, int(pad()) // (4 * self.world_size))
        self._mine = mine
        self.pointers = torch.tensor(list(self._handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        signal_pads = getattr(self._handle, "signal_pad_ptrs", None)
        if signal_pads is not None:
            self.pads = torch.tensor(list(signal_pads), dtype=torch.int64, device=self.device)
        return [self._handle.get_buffer(p, (self.nbytes,), torch.uint8) for p in range(self.world_size)]

    def _map_shared_files(self) -> list[torch.Tensor]:
        # rank 0 names the files; the name travels as bytes in a tensor (nothing is unpickled)
        tag = torch.zeros(64, dtype=torch.uint8)
        if self.rank == 0:
            text = f"dtrain-{os.getpid()}-{next(_COUNTER)}-{os.urandom(6).hex()}".encode()
            tag[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        tag = tag.to(self._via)
        dist.broadcast(tag, dist.get_global_rank(self.group, 0), group=self.group)
        stem = window_stem(bytes(tag.cpu().tolist()))  # every rank checks the same bytes: all raise, or none
        path = f"/dev/shm/{stem}-{{}}"
        own = path.format(self.rank)
        problem = ""
        try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS at the first write
            fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, self._flag_at() + FLAG_BYTES)
            finally:
                os.close(fd)
        except OSError as err:
            problem = f"cannot make a {self.nbytes}-byte window in /dev/shm ({err}; see `df /dev/shm`)"
        try:
            _agree(not problem, problem, self.group, "making windows", self._via)
            total = self._flag_at() + FLAG_BYTES
            mine = torch.from_file(own, shared=True, size=total, dtype=torch.uint8)
            # a peer's file must already exist with its size: if it does not, this rank does not share the
            # peers' /dev/shm (containers with one host name but private IPC), and from_file would make an
            # empty file of its own and read zeros
            missing = [p for p in range(self.world_size) if not _has_size(path.format(p), total)]
            problem = f"the windows of ranks {missing} are not in this rank's /dev/shm" if missing else ""
            _agree(not missing, problem, self.group, "mapping the peers' windows", self._via)
            buffers = [
                mine if p == self.rank else torch.from_file(path.format(p), True, total, dtype=torch.uint8)
                for p in range(self.world_size)
            ]
            dist.barrier(group=self.group)  # every rank has mapped every file: the names can go
        finally:
            if os.path.exists(own):
                os.unlink(own)
        # each rank's barrier counter, after its data: written by its rank only, read by every peer
        at = self._flag_at()
        self._counters = [b[at : at + 8].view(torch.int64).numpy() for b in buffers]
        self._epoch = 0
        return [b[: self.nbytes] for b in buffers]

    def _flag_at(self) -> int:
        """Where a CPU window's barrier counter starts: after the data, on a cache line of its own."""
        return -(-self.nbytes // FLAG_BYTES) * FLAG_BYTES

    def local(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """This rank's window as ``numel`` elements of ``dtype``, as the allocation itself (on CUDA, the tensor
        torch's symmetric-memory kernels know by its address)."""
        key = (dtype, numel)
        view = self._local.get(key)
        if view is None:
            if len(self._local) >= 64:
                self._local.clear()
            mine = self._mine if self._handle is not None else self.buffers[self.rank]
            with torch.inference_mode(False):  # kept: under inference mode it would refuse later calls' writes
                view = self._local[key] = mine[: numel * dtype.itemsize].view(dtype)
        return view

    def view(self, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Rank ``rank``'s window as ``numel`` elements of ``dtype`` (never an inference tensor: what is made of it
        is kept for later calls, in inference mode or not)."""
        with torch.inference_mode(False):
            return self.buffers[rank][: numel * dtype.itemsize].view(dtype)

    def stall_limit(self, timeout: timedelta | None) -> timedelta:
        """How long a CUDA call may run before the watchdog reports it: ``timeout`` or the group's own."""
        return timeout if timeout is not None else self._device_timeout

    def barrier(self, timeout: timedelta | None = None, channel: int = 0) -> None:
        """Every rank of the group has reached this point, and its earlier writes are visible to all.

        On CUDA, ``channel`` picks the barrier's slots in the window's signal pad (every rank must pass the same
        sequence of channels, as every rank runs the same plan); a barrier that gives up prints
        ``[FATAL] CUDASymmetricMemory::barrier: rank R failed to receive signal from rank P on channel C`` from
        the device, so the channel tells which barrier of the call stalled."""
        if self._handle is not None:
            # the host's watchdog reports a stalled call at the limit, then the device barrier gives up
            limit = self.stall_limit(timeout) + watchdog.GRACE
            ms = max(1, int(limit.total_seconds() * 1000))  # at least 1 ms: 0 would mean no limit at all
            self._handle.barrier(channel=channel % self.channels, timeout_ms=ms)
        elif SHARED_COUNTER_BARRIER:
            self._counter_barrier(timeout)
        else:  # Gloo's monitored barrier names the ranks that did not arrive
            dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)

    def _counter_barrier(self, timeout: timedelta | None) -> None:
        """The CPU barrier: this rank raises its counter in its own window file, then waits until every peer's
        has reached it (each rank passes the same barriers in the same order, so the k-th barrier waits for k).
        A wait yields the core between looks (ranks may outnumber cores); ``RuntimeError`` naming the ranks that
        did not arrive once ``timeout`` (else the group's own) passes."""
        self._epoch += 1
        epoch = self._epoch
        self._counters[self.rank][0] = epoch
        waiting = [p for p in range(self.world_size) if p != self.rank]

        def arrived() -> bool:
            waiting[:] = [p for p in waiting if self._counters[p][0] < epoch]
            return not waiting

        def limit() -> timedelta:  # read only once a wait lasts (a barrier mostly passes at the first looks)
            return timeout if timeout is not None else _group_timeout(self.group, self.device)

        spin_until(arrived, limit, lambda: f"ranks {waiting} did not reach the barrier")


def spin_until(done: Callable[[], bool], limit: Callable[[], timedelta], failure: Callable[[], str]) -> None:
    """Look at ``done()`` until it holds: :data:`BARRIER_SPINS` looks, then a sleep of :data:`BARRIER_SLEEP_S`
    between looks (ranks may outnumber cores, and a rank that spins takes the core from the peer it waits for);
    ``RuntimeError(failure())`` once ``limit()`` (asked after 64 looks) has passed."""
    deadline = None
    looks = 0
    while not done():
        looks += 1
        if looks > BARRIER_SPINS:
            time.sleep(BARRIER_SLEEP_S)
        if looks % 64 == 0:
            now = time.monotonic()
            if deadline is None:
                deadline = now + limit().total_seconds()
            elif now > deadline:
                raise RuntimeError(failure())


def _setting_up(step, group, what: str):
    """Run a collective set-up step; a peer that never joins becomes a CommTimeoutError saying so."""
    try:
        return step()
    except RuntimeError as err:
        rank = dist.get_rank(group)
        raise CommTimeoutError(
            f"peer transport set-up: rank {rank} (global {dist.get_global_rank(_world(group), rank)}) timed out "
            f"{what} with its group of {dist.get_world_size(group)}: {err}"
        ) from err


def _world(group):
    return group if group is not None else dist.group.WORLD


def _presize() -> int:
    """``DTRAIN_COMM_PEER_WINDOW_BYTES``: the least size a window is made with (bytes, or with K, M, G), so that
    a run whose buffers grow (a size sweep) maps its windows once instead of at every new size."""
    return comm_env().peer_window_bytes


#: The name rank 0 gives a group's window files (``dtrain-<pid>-<count>-<12 hex digits>``), each rank's file that
#: name and ``-<rank>`` in /dev/shm.
_STEM = re.compile(r"dtrain-[0-9]{1,10}-[0-9]{1,19}-[0-9a-f]{12}")


def window_stem(tag: bytes) -> str:
    """The stem of the window files' names in ``tag`` (rank 0's 64 bytes: the name, then zeros), checked: a name
    rank 0 makes and nothing else, so that no path outside /dev/shm or into another file is ever opened;
    ``ValueError`` naming what arrived otherwise."""
    stem, _, rest = tag.partition(b"\0")
    if len(tag) != 64 or rest.strip(b"\0") or _STEM.fullmatch(stem.decode("ascii", "replace")) is None:
        raise ValueError(
            f"peer transport: rank 0 named the window files {tag.rstrip(bytes(1))!r}; a name is "
            "dtrain-<pid>-<count>-<12 hex digits> padded with zeros to 64 bytes"
        )
    return stem.decode("ascii")


def _has_size(path: str, nbytes: int) -> bool:
    try:
        return os.stat(path).st_size == nbytes
    except FileNotFoundError:
        return False


def peer_available(group, device: torch.device) -> bool:
    """Whether the peer transport can serve ``group`` on ``device``: every rank on this host, and on CUDA
    symmetric memory in this torch. A collective call (every rank of the group must make it); the answer
    is kept per group."""
    available = group_state(_group_key(group)).available
    known = available.get(device)
    if known is None:
        known = _setting_up(lambda: _same_host(group, device), group, "exchanging host names")
        if known and device.type == "cuda":
            try:
                import torch.distributed._symmetric_memory  # noqa: F401
            except ImportError:
                known = False
        available[device] = known
    return known


#: The oldest torch whose CUDA symmetric memory this transport was run and measured on (4 H200s, torch 2.11);
#: ``DTRAIN_COMM_TRANSPORT=auto`` uses the peer transport from this version on, ``peer`` on any.
PEER_DEFAULT_FROM = (2, 11)


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def peer_default(group, device: torch.device) -> bool:
    """Whether ``DTRAIN_COMM_TRANSPORT=auto`` picks this transport for ``group`` on ``device``: a CUDA device, a
    torch from :data:`PEER_DEFAULT_FROM` on, and :func:`peer_available` (a collective call, answered once)."""
    if device.type != "cuda" or _torch_version() < PEER_DEFAULT_FROM:
        return False
    return peer_available(group, device)


def window_for(group, device: torch.device, nbytes: int) -> PeerWindow:
    """The group's window on ``device``, grown to at least ``nbytes`` (growing is collective: every rank
    calls with the same size, as every collective here does)."""
    state = group_state(_group_key(group))
    window = state.windows.get(device)
    if window is None or window.nbytes < nbytes:
        nbytes = max(nbytes, _presize())
        if not peer_available(group, device):
            raise ValueError(
                "the peer transport needs every rank of the group on one host; use DTRAIN_COMM_TRANSPORT=p2p"
            )
        size = nbytes if window is None else max(nbytes, 2 * window.nbytes)
        if window is not None and window.pending:  # peers may still read the old window: wait for them first
            window.pending = False
            window.barrier()
        state.release_derived()  # prepared steps, graphs and kept buffers hold the old window: let it go
        window = state.windows[device] = _setting_up(lambda: PeerWindow(group, device, size), group, "mapping windows")
    return window


def _forget(window: PeerWindow) -> None:
    state = group_state(window.group)
    for device, held in list(state.windows.items()):
        if held is window:
            del state.windows[device]
    state.release_derived()


def close_windows(*groups) -> None:
    """Forget the windows of ``groups`` (None: the default group), or of every group when none is named (before
    the process group is destroyed). Every rank of a group must do it alike: a rank that still holds the
    group's window (or its answer to :func:`peer_available`) would skip the collective set-up its peers make."""
    named = (find_state(_group_key(g)) for g in groups)
    held = [state for state in named if state is not None] if groups else states()
    for state in held:
        state.release_derived()
        state.drop_windows()
        state.available.clear()


@dataclass(frozen=True)
class _Step:
    """One prepared step of a pull plan: window slices made once, the caller's tensor sliced per call."""

    kind: str  # "copy_in" (also a deferred copy) | "barrier" | "op" | "copy_out"
    offset: int = 0  # for a barrier: its channel
    length: int = 0
    mine: torch.Tensor | None = None  # this rank's window slice (written by copy_in/op, read by copy_out)
    sources: tuple[torch.Tensor, ...] = ()
    base: str | None = None
    to_x: bool = False
    to_w: bool = False
    where: str = ""


def _prepare(plan, window: PeerWindow, dtype: torch.dtype, numel: int) -> tuple[_Step, ...]:
    mine = window.view(window.rank, dtype, numel)
    peers = [window.view(p, dtype, numel) for p in range(window.world_size)]
    steps: list[_Step] = []
    channel = itertools.count()  # the k-th barrier of a call waits on channel k (see PeerWindow.barrier)
    for rnd in plan.rounds:
        steps += [_Step(kind="copy_in", offset=o, length=n, mine=mine[o : o + n]) for o, n in rnd.copy_in]
        steps.append(_Step(kind="barrier", offset=next(channel), where=f"before round {rnd.index}"))
        for op in rnd.ops:
            end = op.offset + op.length
            steps.append(
                _Step(
                    kind="op",
                    offset=op.offset,
                    length=op.length,
                    mine=mine[op.offset : end],
                    sources=tuple(peers[p][o : o + op.length] for p, o in op.reads),
                    base=op.base,
                    to_x=op.to_x,
                    to_w=op.to_w,
                )
            )
        if rnd.second_barrier:
            steps.append(_Step(kind="barrier", offset=next(channel), where=f"after round {rnd.index}"))
            steps += [_Step(kind="copy_in", offset=o, length=n, mine=mine[o : o + n]) for o, n in rnd.deferred]
    steps += [_Step(kind="copy_out", offset=o, length=n, mine=mine[o : o + n]) for o, n in plan.copy_out]
    steps.append(_Step(kind="barrier", offset=next(channel), where="after the last round"))
    return tuple(steps)


def _barrier(window: PeerWindow, timeout: timedelta | None, schedule: Schedule, where: str, channel: int) -> None:
    """A round's barrier; one that times out becomes a CommTimeoutError naming the collective and the barrier."""
    try:
        window.barrier(timeout, channel)
    except RuntimeError as err:
        _forget(window)  # ranks now stand at different barriers: this window cannot be trusted again
        raise CommTimeoutError(
            f"{schedule.collective.value}/{schedule.algorithm}: rank {window.rank} (global "
            f"{dist.get_global_rank(window.group, window.rank)}) timed out at the peer transport's "
            f"barrier {where} of {schedule.num_rounds}: {err}"
        ) from err


def run_pull(
    schedule: Schedule, work: torch.Tensor, window: PeerWindow, op: str, timeout: timedelta | None = None
) -> torch.Tensor:
    """Execute ``schedule`` on this rank's flat contiguous ``work`` through ``window``, in place; return it.

    Every rank of the group calls it with the same schedule and buffer size. The plan's window slices are
    prepared once per (schedule, size, dtype, window) and kept: a call then costs little more host time than
    its kernel launches and barriers.
    """
    numel = work.numel()
    key = (schedule, window.rank, numel, work.dtype, window.generation)
    prepared = group_state(window.group).prepared
    steps = prepared.get(key)
    if steps is None:
        if len(prepared) >= 256:
            prepared.clear()
        steps = prepared[key] = _prepare(compile_pull(schedule, window.rank, numel), window, work.dtype, numel)
    combine = peer_kernels.combine
    for step in steps:
        kind = step.kind
        if kind == "op":
            x = work[step.offset : step.offset + step.length]
            outs = [x, step.mine] if step.to_x and step.to_w else [x] if step.to_x else [step.mine]
            base = None if step.base is None else x if step.base == "x" else step.mine
            combine(outs, base, step.sources, op)
        elif kind == "barrier":
            _barrier(window, timeout, schedule, step.where, step.offset)
        elif kind == "copy_in":
            step.mine.copy_(work[step.offset : step.offset + step.length])
        else:
            work[step.offset : step.offset + step.length].copy_(step.mine)
    return work


# ------------------------------------------------------------------------------------------------- push


#: From this many bytes ``DTRAIN_COMM_PEER_MODE=auto`` pushes. On 4 H200s the push form's all-reduce is faster
#: from 64 MiB, eager or replayed (ring 0.97x NCCL at 256 MiB against the pull's 0.93x); below, an eager push
#: round's fused kernel costs more host time than the pull's torch operation and loses (docs/results.md).
PUSH_FROM_BYTES = 64 << 20


def push_mode(schedule: Schedule, nbytes: int, device_type: str = "cuda") -> bool:
    """Whether ``schedule`` on a buffer of ``nbytes`` runs in the push form (:mod:`dtrain.comm.peer.push`):
    ``DTRAIN_COMM_PEER_MODE`` is "push", or "auto" (the default), a CUDA buffer of at least
    :data:`PUSH_FROM_BYTES`, and the schedule has a push form; else the pull form. Every rank answers alike.
    On the CPU "auto" pulls: with 4 ranks on 2 cores a 64 MiB all-reduce in /dev/shm pushed ran at half the
    pull form's speed (direct: 144 ms against 70 ms), a store into another process's pages costing more than a
    read of them.
    (Pushing an out-of-place reduce-scatter from 16 MiB was tried on 4 H100s and not kept: 0.79-0.81x NCCL
    against the pull form's 0.65-0.74x at 16-32 MiB in one launch, 0.49-0.77x in the next.)"""
    mode = comm_env().peer_mode
    wanted = mode == "push" or (mode == "auto" and device_type == "cuda" and nbytes >= PUSH_FROM_BYTES)
    return wanted and has_push_form(schedule)


@dataclass(frozen=True)
class _PushStep:
    kind: str  # "barrier" | "op"
    offset: int = 0  # for a barrier: its channel
    length: int = 0
    base_x: bool = False
    banks: tuple[torch.Tensor, ...] = ()  # this rank's bank slices it reads
    remote: torch.Tensor | None = None  # the peer's bank slice it stores into
    to_x: bool = False
    where: str = ""


def _prepare_push(plan, window: PeerWindow, dtype: torch.dtype, numel: int) -> tuple[_PushStep, ...]:
    banks = [window.view(p, dtype, 2 * numel) for p in range(window.world_size)]
    mine = banks[window.rank]

    def op_step(op) -> _PushStep:
        remote = None
        if op.dst is not None:
            start = op.dst_bank * numel + op.dst_offset
            remote = banks[op.dst][start : start + op.length]
        reads = tuple(mine[b * numel + op.offset : b * numel + op.offset + op.length] for b in op.banks)
        return _PushStep("op", op.offset, op.length, op.base_x, reads, remote, op.to_x)

    steps: list[_PushStep] = []
    for k, rnd in enumerate(plan.rounds):
        steps.append(_PushStep("barrier", k, where=f"before round {rnd.index}"))
        steps += [op_step(op) for op in rnd.ops]
    steps.append(_PushStep("barrier", len(plan.rounds), where="after the last round"))
    steps += [op_step(op) for op in plan.final]
    return tuple(steps)


def run_push(
    schedule: Schedule,
    work: torch.Tensor,
    window: PeerWindow,
    op: str,
    timeout: timedelta | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Execute ``schedule`` on this rank's flat contiguous ``work`` in the push form, in place; return it. The
    window must hold two banks of ``work``'s size (``window_for(..., 2 * nbytes)``).

    ``out`` (a reduce-scatter whose plan :func:`dtrain.comm.peer.push.writes_own_block_only`): ``work`` is only
    read, and this rank's block of the result is written into ``out`` (flat, one block long) instead."""
    numel = work.numel()
    own = out is not None
    key = ("push", schedule, window.rank, numel, work.dtype, window.generation, own)
    prepared = group_state(window.group).prepared
    steps = prepared.get(key)
    if steps is None:
        if window.nbytes < 2 * numel * work.element_size():
            raise ValueError(
                f"run_push needs a window of two banks of {numel * work.element_size()} bytes, got {window.nbytes} "
                "(window_for(group, device, 2 * nbytes))"
            )
        if own and (not writes_own_block_only(schedule, numel) or out.numel() * schedule.nblocks != numel):
            raise ValueError(
                f"run_push(out=...): {schedule.collective.value}/{schedule.algorithm} on {numel} elements does not "
                f"write its own block alone, or out has {out.numel()} elements, not one block"
            )
        if len(prepared) >= 256:
            prepared.clear()
        plan = compile_push(schedule, window.rank, numel, own)
        steps = prepared[key] = _prepare_push(plan, window, work.dtype, numel)
    start = window.rank * (numel // schedule.nblocks) if own else 0  # where out's block starts in work
    combine = peer_kernels.combine
    for step in steps:
        if step.kind == "barrier":
            _barrier(window, timeout, schedule, step.where, step.offset)
            continue
        x = work[step.offset : step.offset + step.length]
        dst = x if not (own and step.to_x) else out[step.offset - start : step.offset - start + step.length]
        # the local store first: where torch does the pass it computes into x and copies x to the peer
        outs = [dst] if step.remote is None else [dst, step.remote] if step.to_x else [step.remote]
        operands = ((x,) if step.base_x else ()) + step.banks
        base, sources = (None, operands) if len(operands) == 1 else (operands[0], operands[1:])
        combine(outs, base, sources, op, remote=step.remote is not None)
    return work
