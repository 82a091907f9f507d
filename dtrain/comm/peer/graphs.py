"""CUDA graphs of collective calls: captured on request (:func:`capture`) or implicitly (:func:`run`).

Captured collectives: record a collective call once as a CUDA graph, then replay it for a few microseconds.

A schedule of R rounds costs R trips through torch.distributed's NCCL process group on the host, each tens
of microseconds (docs/results.md); below a few MiB that host time, not the GPUs, sets the
pace. Replaying a CUDA graph of the whole call launches every round's NCCL kernels and reductions at once.
This is MPI-4's persistent collective (``MPI_Allreduce_init`` then ``MPI_Start``) on CUDA graphs.

Rules, as for any CUDA graph: the call is replayed on the same tensors (write new data into them, do not
rebind them), every rank of the group captures the same call in the same order, and the capture happens
once the process group has run at least one collective. On CPU tensors there is nothing to capture and
:func:`capture` raises ``ValueError``. Release captured collectives (:meth:`CapturedCollective.release`, or
drop every reference) before ``destroy_process_group``: a live graph that holds NCCL kernels can keep
``ncclCommDestroy`` waiting (pytorch/pytorch#115388).

Persistent collectives: a call repeated on the same CUDA buffer is recorded once as a graph, then replayed.

A peer-memory round is a barrier and a kernel or two on the device, but ~15 us of Python and launches on the
host (docs/results.md), so below some MiB the host, not the GPUs, sets the pace. Training calls the same
collectives on the same buffers every step (gradient buckets, sharded optimizer state). The second time a
call is seen with the same schedule, buffer address, size, dtype, op and window, it is captured as a CUDA graph
of all its rounds (capturing runs nothing), and that call and every later one replays the graph. This is
MPI-4's persistent collective (``MPI_Allreduce_init`` then ``MPI_Start``), made implicit. On by default
(``DTRAIN_COMM_PERSISTENT=auto``; ``0`` turns it off): only the peer transport's CUDA calls come here.

Why it is safe across ranks: a replay launches exactly the kernels and barriers the eager call would, so a
rank that replays and a rank that runs eagerly still meet at every barrier; ranks need not capture together.
A graph is dropped when the window it reads is replaced (it would read freed memory), when more than
:data:`MAX_GRAPHS` are held by one group (least recently used first), and by :func:`release_all`. Each
process group keeps its own graphs (:class:`GraphCache`). Nothing is captured while a per-round timeout is
set (a graph cannot report which barrier stalled) or inside another capture.

A graph belongs to the *storage* it was captured on, not to an address: the caller passes the tensor as
``owner`` and a graph is replayed only for that same storage, alive (the key holds a weak reference to it).
Keyed by address alone, a buffer freed and another of the same size made at the same address would replay
the old graph over memory it no longer owns: on 4 H200s that faults on the device ("unspecified launch
failure") and then crashes the host in ``CUDAGraph.replay`` (``bench comm``'s sweep makes fresh buffers for
every case; keeping every buffer alive, or never replaying, runs clean).
A graph whose storage has died is released at the next capture, or within :data:`SWEEP_EVERY` calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch.multiprocessing.reductions import StorageWeakRef  # torch's weak handle on a storage

from dtrain.comm.peer import watchdog
from dtrain.comm.state import GroupState, group_state, states
from dtrain.env import comm_env

__all__ = [
    "MAX_GRAPHS",
    "CapturedCollective",
    "GraphCache",
    "capture",
    "cache_for",
    "run",
    "release_all",
    "enabled",
    "held",
]


class CapturedCollective:
    """A collective call recorded as a CUDA graph; call the object to run it again."""

    def __init__(self, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
        self._graph = graph
        self._stream = stream

    def release(self) -> None:
        """Free the graph and its memory; the object cannot be replayed afterwards."""
        if self._graph is not None:
            torch.cuda.synchronize()
            self._graph.reset()
            self._graph = None

    def __call__(self) -> None:
        """Replay on the current stream (it waits for earlier work and later work waits for it). A graph runs on
        whichever stream launches it, whatever stream it was captured on: no stream switch, no events."""
        if self._graph is None:
            raise ValueError("this captured collective was released")
        self._graph.replay()


def capture(call: Callable[[], object], device: torch.device | int | None = None, warmup: int = 1):
    """Run ``call`` ``warmup`` times eagerly, then record it as a graph; returns a :class:`CapturedCollective`.

    ``call`` is a closure over the tensors, e.g. ``lambda: comm.all_reduce(x, algorithm="ring")``.
    """
    if not torch.cuda.is_available():
        raise ValueError("capture needs CUDA tensors and a CUDA device; none is available here")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (plans and scratch buffers are made on the first call), got {warmup}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    # thread-local: other threads (the autograd engine's, dtrain's watchdog) may touch CUDA meanwhile
    with watchdog.capturing(), torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        call()
    torch.cuda.synchronize(device)
    return CapturedCollective(graph, stream)


#: The most graphs a group keeps at once; the least recently replayed goes first.
MAX_GRAPHS = 64
#: Every this many calls, graphs and sightings of freed storages are released (also at every capture).
SWEEP_EVERY = 256


def enabled() -> bool:
    """Whether calls may be captured: ``DTRAIN_COMM_PERSISTENT`` "1" or "auto" (the default; only the peer
    transport's CUDA calls come here), not "0"."""
    return comm_env().persistent != "0"


def _capture(call: Callable[[], object], device: torch.device):
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    # thread-local: a training step's other threads (the autograd engine's) may touch CUDA meanwhile
    with watchdog.capturing(), torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        call()
    return CapturedCollective(graph, stream)


class GraphCache:
    """One group's persistent collectives: the calls seen, their graphs (at most :data:`MAX_GRAPHS`, least
    recently replayed dropped first) and the storages they belong to. Held by the group's
    :class:`~dtrain.comm.state.GroupState` (:func:`cache_for`)."""

    def __init__(self) -> None:
        self.seen: OrderedDict[Hashable, int] = OrderedDict()
        self.graphs: OrderedDict[Hashable, object] = OrderedDict()
        self.owners: dict[Hashable, tuple[StorageWeakRef, ...]] = {}  # key -> its storages (keys of seen, graphs)
        self.calls = 0

    def held(self) -> int:
        """How many graphs are held now."""
        return len(self.graphs)

    def run(
        self,
        key: Hashable,
        call: Callable[[], object],
        device: torch.device,
        *,
        owner: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        capture=_capture,
    ) -> None:
        """Run ``call`` (a collective on CUDA tensors): eagerly the first time ``key`` is seen, from then on as
        a graph captured on the second sighting. ``owner``: the tensor (or tensors) the call works on; its graph
        is replayed only for those same storages, all alive (see the module notes). ``capture`` is the recorder
        (tests pass a fake one)."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            call()  # inside someone else's capture (comm.capture): record the plain call, never a nested replay
            return
        owners = () if owner is None else (owner,) if isinstance(owner, torch.Tensor) else tuple(owner)
        if owners:
            # a weak reference held in owners keeps this storage's identity from being reused by another one, so
            # an equal identity here means the very storage the graph was captured on, and it is alive
            key = (key, tuple(t.untyped_storage()._cdata for t in owners))
        self.calls += 1
        if self.calls % SWEEP_EVERY == 0:  # a loop that only replays captures nothing new: free dead graphs anyway
            self._drop_dead()
        graph = self.graphs.get(key)
        if graph is not None and enabled():
            self.graphs.move_to_end(key)
            graph()
            return
        if not enabled():
            call()
            return
        seen = self.seen.pop(key, 0) + 1
        self.seen[key] = seen
        if owners and key not in self.owners:
            self.owners[key] = tuple(StorageWeakRef(t.untyped_storage()) for t in owners)
        while len(self.seen) > 4 * MAX_GRAPHS:
            self._drop(self.seen.popitem(last=False)[0], graph=False)
        if seen < 2:
            call()
            return
        self._drop_dead()
        graph = capture(call, device)
        self.graphs[key] = graph
        while len(self.graphs) > MAX_GRAPHS:
            old, held_graph = self.graphs.popitem(last=False)
            held_graph.release()
            if old not in self.seen:
                self.owners.pop(old, None)
        graph()

    def _drop(self, key: Hashable, graph: bool = True) -> None:
        """Forget ``key``'s sighting (and its graph, if ``graph``); its storage reference goes with the last."""
        if graph:
            self.seen.pop(key, None)
            held_graph = self.graphs.pop(key, None)
            if held_graph is not None:
                held_graph.release()
        if key not in self.graphs and key not in self.seen:
            self.owners.pop(key, None)

    def _drop_dead(self) -> None:
        """Release the graphs and sightings of storages that have been freed (they can never be replayed)."""
        for key in [k for k, refs in self.owners.items() if any(ref.expired() for ref in refs)]:
            self._drop(key)

    def release_all(self) -> None:
        """Drop every graph and every sighting (the windows they read are going away)."""
        for graph in self.graphs.values():
            graph.release()
        self.graphs.clear()
        self.seen.clear()
        self.owners.clear()


def cache_for(state: GroupState) -> GraphCache:
    """The graph cache of a group's state, made on first use."""
    if state.graphs is None:
        state.graphs = GraphCache()
    return state.graphs


def run(group, key: Hashable, call: Callable[[], object], device: torch.device, **kwargs) -> None:
    """:meth:`GraphCache.run` in ``group``'s cache (None: the default group)."""
    cache_for(group_state(group)).run(key, call, device, **kwargs)


def held() -> int:
    """How many graphs every group holds together."""
    return sum(s.graphs.held() for s in states() if s.graphs is not None)


def release_all() -> None:
    """Drop every group's graphs, sightings and kept work buffers."""
    for state in states():
        state.release_derived()
