"""NCCL's own collectives (``algorithm="native"``) as a model the flow simulator replays.

On one NVLink node NCCL runs an all-reduce as ONE kernel: a ring reduce-scatter followed by a ring all-gather,
``2(n-1)`` steps, over several channels (rings) at once, each channel's share cut into slices that flow
through a FIFO of buffer slots (NCCL's ``NCCL_STEPS``). Nothing goes back to the host between steps: a step
costs a flag handshake of a few microseconds, not a Python round (Jeaugey, "NCCL 2.0", GTC 2017; NCCL's
``src/device/all_reduce.h`` ``runRing`` and its tuning model, ``src/graph/tuning.cc``, whose time is
``base latency + steps x hop latency + bytes / bus bandwidth``).

The model, per rank ``r`` (channels aggregated: they cross the same links in lockstep, so under max-min
sharing ``C`` flows capped at ``c`` each move as one flow capped at ``C c``):

- the rank's block (``nbytes / n``; broadcast: the whole buffer) is cut into ``P`` pieces of at most
  ``channels x slice_bytes`` (``P`` at most ``max_pieces``, to bound the events simulated: once a step's
  ``P`` pieces outlast one piece's trip to the next rank, the ring's time no longer depends on ``P``);
- piece ``p`` of step ``s`` may leave rank ``r`` once piece ``p`` of step ``s-1`` has arrived there plus
  ``step_latency_s`` (data dependency: what it forwards, it must have received);
- a rank's kernel does one thing at a time, in the order things became ready: NCCL's channels each run the
  collective's steps as one sequential program (``src/device/prims_simple.h``: wait, copy, post, slice after
  slice). Its things are sends, each a flow on the topology sharing links max-min fairly and capped at
  ``channels x channel_bytes_per_s`` if given, and local copies at ``local_bytes_per_s``;
- a ring's last step ends in a local copy: the rank that receives piece ``p`` of the last step copies it
  out of its receive buffer (NCCL's final ``directRecv``; a reduction into the output for reduce-scatter)
  before its kernel moves on, so for ``P`` pieces every rank spends ``block / local_bytes_per_s`` sending
  nothing. An all-reduce pays it once per ``2(n-1)`` sends, an all-gather or reduce-scatter once per ``n-1``,
  which is why NCCL's all-gather moves fewer bus bytes per second than its all-reduce. At
  :data:`LOCAL_OVER_CONNECTION` times the connection rate the two add up as NCCL's memory accesses do
  (docs/simulator.md, "NCCL's own collectives");
- all-to-all is NCCL's grouped point-to-point (``ncclSend``/``ncclRecv`` to every peer in one group, one
  kernel whose channels are split among the peers, ``src/enqueue.cc`` ``scheduleP2pTasksToPlan``): a rank
  sends piece ``p`` to its ``n-1`` peers at once, the flows sharing its kernel's rate (each capped at
  ``channels x channel_bytes_per_s / (n-1)``), then copies piece ``p`` of the block it keeps for itself;
- the kernel starts ``launch_s`` after the call and ends at the last arrival or copy. Back-to-back calls
  (how ``dtrain bench comm`` and nccl-tests time) overlap the host's enqueue with the previous kernel, so a
  call costs ``max(host_s, kernel)``.

Collectives: all-reduce (``2(n-1)`` ring steps), all-gather and reduce-scatter (``n-1``), broadcast (a chain
from the root: step ``s`` is the ring's ``s``-th rank after the root to the next, pipelined; the last rank copies
each piece out), reduce (the same chain ending at the root, which reduces each piece into its output: NCCL's
ring reduce, ``src/device/reduce.h``), all-to-all (every pair at once, one step), and gather and scatter (what
torch runs for them on NCCL: grouped point-to-point between the root and every other rank, one step; the root
copies its own block). In a grouped step the kernel's rate is split among the peers on both sides: a flow is
capped at the connection rate over the larger of its sender's peers and its receiver's (a gather's root
receives from ``n-1`` ranks as a scatter's root sends to them). On a uniform star the replay equals
:func:`ring_closed_form` (tests/sim/test_sim_nccl.py). The LL and LL128 protocols NCCL picks for smaller calls are a
``protocol`` of :func:`simulate_nccl` (their flags cost bytes, and they start sooner), and ``chunk_depth`` cuts a
smaller call into smaller pieces. Not modelled: NCCL's tree and NVLS (NVLink SHARP) algorithms and its choice of fewer
channels below 1 MiB; the fitted figures absorb them (docs/simulator.md says where that shows).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from dtrain.cluster.topology import Topology
from dtrain.sim.collective import check_placement
from dtrain.sim.flows import FlowNetwork, LinkUsage

__all__ = [
    "NCCL_COLLECTIVES",
    "LOCAL_OVER_CONNECTION",
    "PROTOCOL_EFFICIENCY",
    "NcclParams",
    "NcclResult",
    "ring_steps",
    "pieces",
    "simulate_nccl",
    "ring_closed_form",
    "LL_BASE_US",
    "LL_HOP_US",
    "small_all_reduce_s",
]

#: Collectives the model knows, and how many sequential steps each has on ``n`` ranks.
NCCL_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
                    "scatter")  # fmt: skip
#: those NCCL (through torch) runs as grouped point-to-point: one step, every block at once
GROUPED = ("all_to_all", "gather", "scatter")

#: How much faster the kernel copies a piece within its GPU than it moves it one ring step, from the memory
#: accesses per byte of NCCL's ring programs (``src/device/all_reduce.h``, ``all_gather.h``, ``reduce_scatter.h``;
#: a send writes the next GPU's buffer, a receive reads one's own). All-reduce: send 2 (read the input, write
#: the next GPU), ``n-2`` x receive-reduce-send 3, receive-reduce-copy-send 4, ``n-2`` x receive-copy-send 3,
#: receive 2: ``6n-4``. All-gather: copy-send 3, ``n-2`` x receive-copy-send 3, receive 2: ``3n-1``.
#: Reduce-scatter: send 2, ``n-2`` x receive-reduce-send 3, receive-reduce-copy 3: ``3n-1``. A step at the
#: connection rate counted as 3 and the last step's copy at 1.5 times that rate as 2 give these sums exactly.
LOCAL_OVER_CONNECTION = 1.5


@dataclass(frozen=True, kw_only=True)
class NcclParams:
    """NCCL's costs outside the links.

    ``host_s``: the host's time per call (Python, the enqueue, the launch); ``launch_s``: from the call to the
    kernel's first step on the device; ``step_latency_s``: a step's handshake after its data arrived (NCCL's
    per-hop latency, on top of the links' own); ``channels`` and ``slice_bytes``: the pipelining grain (NCCL:
    16 or more channels on NVLink, 512 KiB slots, ``NCCL_BUFFSIZE / NCCL_STEPS``); ``channel_bytes_per_s``:
    the most one channel moves (None: links only); ``local_bytes_per_s``: what a rank's kernel (all channels)
    copies per second within its own GPU, the last step's copy out of the receive buffer and an all-to-all's
    own block (None: such copies are free); ``max_pieces``: a bound on the simulated pieces;
    ``ll_launch_s``, ``ll128_launch_s``: ``launch_s`` for calls in NCCL's LL and LL128 protocols (None: the same);
    ``chunk_depth``: smaller calls get smaller slices until each send has ``chunk_depth x n`` pieces (0: never;
    :func:`pieces`); ``self_copy_bytes_per_s``: torch's gather and scatter copy the root's own block with a
    ``copy_`` enqueued before NCCL's kernel (``torch/csrc/cuda/nccl.cpp``), at this device-to-device rate (None:
    the kernel copies it, at ``local_bytes_per_s``); ``reduce_efficiency``: the share of its link rate a reduce
    chain's send reaches (each piece counts ``1 / reduce_efficiency`` of its bytes, as a protocol's flags do;
    NCCL's ring reduce moves fewer bytes a second than its broadcast over the same chain); ``ll_efficiency``: the
    share of a line that is data in LL as measured (None: its format's 0.5; LL's 8-byte stores and the
    receiver's polling reach less); ``p2p_launch_s``: ``launch_s`` of the grouped point-to-point kernels
    (all-to-all, gather, scatter) in Simple (None: the same).
    """

    host_s: float = 0.0
    launch_s: float = 0.0
    step_latency_s: float = 2e-6
    channels: int = 16
    slice_bytes: int = 512 << 10
    channel_bytes_per_s: float | None = None
    local_bytes_per_s: float | None = None
    max_pieces: int = 64
    ll_launch_s: float | None = None
    ll128_launch_s: float | None = None
    chunk_depth: int = 0
    self_copy_bytes_per_s: float | None = None
    reduce_efficiency: float = 1.0
    ll_efficiency: float | None = None
    p2p_launch_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.reduce_efficiency <= 1:
            raise ValueError(f"NcclParams.reduce_efficiency must be in (0, 1], got {self.reduce_efficiency!r}")
        if self.ll_efficiency is not None and not 0 < self.ll_efficiency <= 1:
            raise ValueError(f"NcclParams.ll_efficiency must be in (0, 1] or None, got {self.ll_efficiency!r}")
        if self.p2p_launch_s is not None and not self.p2p_launch_s >= 0:
            raise ValueError(f"NcclParams.p2p_launch_s must be >= 0 seconds or None, got {self.p2p_launch_s!r}")
        for name in ("host_s", "launch_s", "step_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"NcclParams.{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        for name in ("ll_launch_s", "ll128_launch_s"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ValueError(f"NcclParams.{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if self.channels < 1 or self.slice_bytes < 1 or self.max_pieces < 1:
            raise ValueError(
                f"NcclParams needs channels, slice_bytes and max_pieces >= 1; got {self.channels}, "
                f"{self.slice_bytes}, {self.max_pieces}"
            )
        for name in ("channel_bytes_per_s", "local_bytes_per_s", "self_copy_bytes_per_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"NcclParams.{name} must be > 0 bytes/s or None, got {getattr(self, name)!r}")

    @property
    def connection_cap(self) -> float | None:
        """The most one ring connection (all channels together) moves."""
        return None if self.channel_bytes_per_s is None else self.channels * self.channel_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class NcclResult:
    """A simulated NCCL call: ``time_s = max(host_s, kernel_s)``, and each link's usage during the kernel."""

    time_s: float
    kernel_s: float
    pieces: int
    links: list[LinkUsage] = field(repr=False)

    @property
    def bottleneck(self) -> LinkUsage | None:
        return self.links[0] if self.links else None


def ring_steps(collective: str, n: int, root: int = 0) -> list[list[tuple[int, int]]]:
    """The ``(src, dst)`` sends of each step, on ranks ``0..n-1`` (``root``: a rooted collective's)."""
    ring = [(r, (r + 1) % n) for r in range(n)]
    if collective == "all_reduce":
        return [ring] * (2 * (n - 1))
    if collective in ("all_gather", "reduce_scatter"):
        return [ring] * (n - 1)
    if collective == "broadcast":  # root, root+1, ..., root-1
        return [[((root + s) % n, (root + s + 1) % n)] for s in range(n - 1)]
    if collective == "reduce":  # root+1, ..., root-1, root
        return [[((root + 1 + s) % n, (root + 2 + s) % n)] for s in range(n - 1)]
    if collective == "all_to_all":
        return [[(a, b) for a in range(n) for b in range(n) if a != b]]
    if collective == "scatter":
        return [[(root, b) for b in range(n) if b != root]]
    if collective == "gather":
        return [[(a, root) for a in range(n) if a != root]]
    raise ValueError(f"NCCL model: unknown collective {collective!r}; known: {', '.join(NCCL_COLLECTIVES)}")


def _block_bytes(collective: str, nbytes: int, n: int) -> float:
    """Bytes one send carries over a whole call: a rank's block (the buffer for broadcast and reduce)."""
    return float(nbytes) if collective in ("broadcast", "reduce") else nbytes / n


def pieces(collective: str, nbytes: int, n: int, params: NcclParams) -> int:
    """How many pieces each send is cut into: the block over ``channels x slice_bytes``, the slice halved (down
    to 64 KiB a channel) while that leaves fewer than ``chunk_depth x n`` pieces, as NCCL shrinks its chunk for
    smaller calls to keep its pipeline deep (``src/enqueue.cc``, the Simple protocol's chunk size)."""
    block = _block_bytes(collective, nbytes, n)
    slice_bytes = params.slice_bytes
    while block / (params.channels * slice_bytes) < params.chunk_depth * n and slice_bytes > 64 << 10:
        slice_bytes //= 2
    return max(1, min(params.max_pieces, math.ceil(block / (params.channels * slice_bytes))))


#: NCCL's protocols: the share of each line that is data (LL: 4 bytes of data and a 4-byte flag in every 8;
#: LL128: 120 of 128 bytes; Simple: all, with a flag per slice), from NCCL's ``src/include/device.h``
PROTOCOL_EFFICIENCY = {"simple": 1.0, "ll128": 120 / 128, "ll": 0.5}


def simulate_nccl(
    topology: Topology,
    collective: str,
    nbytes: int,
    placement: Sequence[str] | None = None,
    *,
    params: NcclParams | None = None,
    protocol: str = "simple",
    root: int = 0,
) -> NcclResult:
    """Simulate NCCL's ``collective`` on a ``nbytes`` work buffer (``dtrain.comm.cost``'s meaning: the output
    of an all-gather, the input of a reduce-scatter), ring order = ``placement`` order (default: every device
    of ``topology``).

    ``protocol``: the one NCCL runs the call in ("simple", "ll128" or "ll"; NCCL picks by size, and
    ``NCCL_DEBUG_SUBSYS=TUNING`` prints its pick). LL and LL128 carry flags in every line, so every send moves
    ``1 / PROTOCOL_EFFICIENCY`` times its data, and they pipeline line by line, so a block goes in
    ``max_pieces`` pieces; their kernel starts ``ll_launch_s`` / ``ll128_launch_s`` after the call. ``root``:
    the rank (an index into ``placement``) of a broadcast, reduce, gather or scatter."""
    params = params or NcclParams()
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if protocol not in PROTOCOL_EFFICIENCY:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOL_EFFICIENCY)}; got {protocol!r}")
    efficiency = PROTOCOL_EFFICIENCY[protocol]
    if protocol == "ll" and params.ll_efficiency is not None:
        efficiency = params.ll_efficiency
    if protocol != "simple":
        launch = {"ll": params.ll_launch_s, "ll128": params.ll128_launch_s}[protocol]
        params = replace(params, slice_bytes=1, launch_s=params.launch_s if launch is None else launch)
    elif collective in GROUPED and params.p2p_launch_s is not None:
        params = replace(params, launch_s=params.p2p_launch_s)
    placement = list(placement) if placement is not None else [d.name for d in topology.devices()]
    n = len(placement)
    if n < 2:
        raise ValueError(f"an NCCL collective needs at least 2 ranks, got placement {placement!r}")
    placement = check_placement(topology, placement, n)
    if not 0 <= root < n:
        raise ValueError(f"root must be a rank of the {n} placed, got {root!r}")
    steps = ring_steps(collective, n, root)
    count = pieces(collective, nbytes, n, params)
    piece = _block_bytes(collective, nbytes, n) / count / efficiency
    if collective == "reduce":
        piece /= params.reduce_efficiency
    net = FlowNetwork(topology)
    keeps = list(range(n)) if collective == "all_to_all" else [root] if collective in GROUPED else []
    start = params.launch_s
    if collective in ("gather", "scatter") and params.self_copy_bytes_per_s is not None:
        keeps, start = [], start + nbytes / n / params.self_copy_bytes_per_s  # torch's copy_, then the kernel
    _Pipeline(net, placement, steps, count, piece, params, collective in GROUPED, keeps).start(start)
    kernel = net.run()
    return NcclResult(time_s=max(params.host_s, kernel), kernel_s=kernel, pieces=count, links=net.usage(kernel))


class _Pipeline:
    """The event-driven pieces: each rank's kernel works through a FIFO of ready things (a send of a piece to
    one or more peers, or a local copy of a piece), one at a time."""

    def __init__(self, net: FlowNetwork, placement, steps, count: int, piece: float, params: NcclParams,
                 grouped: bool, keeps: list[int]) -> None:  # fmt: skip
        self.net, self.placement, self.steps, self.count, self.piece = net, placement, steps, count, piece
        self.params, self.grouped, self.keeps = params, grouped, keeps
        # the peers each rank sends to in each step (one in a ring or chain, every other rank in an all-to-all),
        # and how many each rank receives from
        self.sends_of: list[dict[int, list[int]]] = []
        self.fan_in: list[dict[int, int]] = []
        for step in steps:
            dsts: dict[int, list[int]] = {}
            srcs: dict[int, int] = {}
            for src, dst in step:
                dsts.setdefault(src, []).append(dst)
                srcs[dst] = srcs.get(dst, 0) + 1
            self.sends_of.append(dsts)
            self.fan_in.append(srcs)
        self.queue: dict[int, deque[tuple[str, int, int]]] = {}
        self.busy: set[int] = set()

    def start(self, at_s: float) -> None:
        def first() -> None:
            for p in range(self.count):
                for rank in self.sends_of[0]:
                    self._ready(rank, ("send", 0, p))
                if self.params.local_bytes_per_s is not None:
                    for rank in self.keeps:
                        self._ready(rank, ("copy", 0, p))  # the block it keeps for itself

        self.net.at(at_s, first)

    def _ready(self, rank: int, work: tuple[str, int, int]) -> None:
        self.queue.setdefault(rank, deque()).append(work)
        self._pump(rank)

    def _pump(self, rank: int) -> None:
        if rank in self.busy or not self.queue.get(rank):
            return
        kind, step, p = self.queue[rank].popleft()
        self.busy.add(rank)

        def free(_t: float | None = None) -> None:
            self.busy.discard(rank)
            self._pump(rank)

        if kind == "copy":
            self.net.at(self.net.now + self.piece / self.params.local_bytes_per_s, free)
            return
        dsts = self.sends_of[step][rank]
        cap = self.params.connection_cap
        left = [len(dsts)]

        def sent(_t: float) -> None:
            left[0] -= 1
            if not left[0]:
                free()

        for dst in dsts:
            flow_id = hash((rank, dst)) & 0x7FFFFFFF  # one path a connection, every step and piece
            # the peers of one send share the sender's kernel, the senders into one rank its receiving kernel
            share = None if cap is None else cap / max(len(dsts), self.fan_in[step][dst])
            self.net.send(self.placement[rank], self.placement[dst], self.piece, flow_id=flow_id,
                          on_done=lambda _t, dst=dst: self._arrived(dst, step, p), on_sent=sent,
                          cap_bytes_per_s=share)  # fmt: skip

    def _arrived(self, dst: int, step: int, p: int) -> None:
        if step + 1 < len(self.steps) and dst in self.sends_of[step + 1]:
            after = self.net.now + self.params.step_latency_s
            self.net.at(after, lambda: self._ready(dst, ("send", step + 1, p)))
        elif step + 1 == len(self.steps) and not self.grouped and self.params.local_bytes_per_s is not None:
            self._ready(dst, ("copy", step, p))  # the last step's copy out of the receive buffer


def ring_closed_form(
    collective: str, nbytes: int, n: int, *, link_bytes_per_s: float, path_latency_s: float, params: NcclParams
) -> float:
    """The model's time on a uniform star (each rank one link each way at ``link_bytes_per_s``, a rank-to-rank
    path of ``path_latency_s``), for the ring collectives, the chain broadcast and reduce, and the grouped
    all-to-all, gather and scatter.

    With ``S`` steps, ``P`` pieces of ``c`` bytes, ``t = c / rate``, ``d = t + latency + step latency`` (a
    piece's time from leaving one rank to leaving the next) and ``l = c / local_bytes_per_s`` (0 if None): a
    ring connection carries every step, so a step's P pieces take ``max(P t, d)``; a chain connection carries
    one step, so the steps overlap and cost ``d``. The last step's piece ``p`` arrives at
    ``E + (p+1) t + latency``, with ``E = launch + (S-1) cycle``, and is then copied out; a ring rank copies only
    once its sends are done (``E + P t``), and copies take turns::

        ring:  E + max(P (t + l), latency + max(P t + l, t + P l)),   cycle = max(P t, d)
        chain: E +                latency + max(P t + l, t + P l),    cycle = d

    (``l = 0``: ``E + P t + latency``). All-to-all and scatter: each sender sends a piece to its ``n-1`` peers at
    once, at ``rate / (n-1)`` each (so ``t = (n-1) c / rate``), then copies its own piece: ``launch + P (t + l) +
    max(0, latency - l)``. Gather: the ``n-1`` senders share the root's link (or its receiving kernel), so again
    ``t = (n-1) c / rate``, while the root copies its own pieces meanwhile: ``launch + max(P t + latency, P l)``.
    With ``self_copy_bytes_per_s`` the root's block is copied before the kernel instead: both are ``launch +
    block / self_copy_bytes_per_s + P t + latency``. A reduce is the chain with ``c`` over ``reduce_efficiency``.
    """
    count = pieces(collective, nbytes, n, params)
    rate = link_bytes_per_s if params.connection_cap is None else min(link_bytes_per_s, params.connection_cap)
    piece = _block_bytes(collective, nbytes, n) / count
    if collective == "reduce":
        piece /= params.reduce_efficiency
    copy = 0.0 if params.local_bytes_per_s is None else piece / params.local_bytes_per_s
    if collective in ("gather", "scatter") and params.self_copy_bytes_per_s is not None:
        t = (n - 1) * piece / rate
        before = nbytes / n / params.self_copy_bytes_per_s
        return max(params.host_s, params.launch_s + before + count * t + path_latency_s)
    if collective in ("all_to_all", "scatter"):
        t = (n - 1) * piece / rate
        return max(params.host_s, params.launch_s + count * (t + copy) + max(0.0, path_latency_s - copy))
    if collective == "gather":
        t = (n - 1) * piece / rate
        return max(params.host_s, params.launch_s + max(count * t + path_latency_s, count * copy))
    steps = len(ring_steps(collective, n))
    t = piece / rate
    d = t + path_latency_s + params.step_latency_s
    chain = collective in ("broadcast", "reduce")
    cycle = d if chain else max(count * t, d)
    copies = path_latency_s + max(count * t + copy, t + count * copy)
    if not chain:
        copies = max(count * (t + copy), copies)
    return max(params.host_s, params.launch_s + (steps - 1) * cycle + copies)


#: NCCL's tuning model for a call of a few bytes, which latency alone prices (``src/graph/tuning.cc`` at
#: v2.17.1-1, microseconds; NCCL picks the algorithm and protocol its model prices fastest, the LL protocol at
#: this size): the base latency of the tree and the ring with LL (``baseLat``), and a hop's latency over NVLink
#: within a server and over the network between servers (``hwLat``), which NCCL multiplies by 1.8 for an NVLink
#: hop when the group spans servers.
LL_BASE_US = {"tree": 4.4, "ring": 3.6}
LL_HOP_US = {("tree", "nvlink"): 0.52, ("ring", "nvlink"): 0.47, ("tree", "net"): 5.0, ("ring", "net"): 2.7}


def small_all_reduce_s(ranks: int, nodes: int) -> float:
    """Seconds of an all-reduce of a few bytes over ``ranks`` GPUs on ``nodes`` servers (as many on each, linked
    by NVLink within a server) as NCCL's tuning model prices it: the faster of the tree, ``base + 2 ((ranks /
    nodes - 1) intra + floor(log2 nodes) inter)``, and the ring, ``base + (2 (ranks - 1) - inter_steps) intra +
    inter_steps inter`` with ``2 nodes`` steps between servers (none on one server). Its bytes cost nothing at
    this size: what such a call takes is its steps' latency (an FP8 amax reduction, a loss's or a norm's
    all-reduce)."""
    if ranks < 1 or not 1 <= nodes <= ranks:
        raise ValueError(f"an all-reduce needs ranks >= 1 on 1 to ranks nodes, got {ranks} ranks on {nodes}")
    if ranks == 1:
        return 0.0
    spans = nodes > 1
    times = []
    for algorithm in ("tree", "ring"):
        intra = LL_HOP_US[algorithm, "nvlink"] * (1.8 if spans else 1.0)
        inter = LL_HOP_US[algorithm, "net"] if spans else intra
        if algorithm == "tree":
            hops = (ranks // nodes - 1) * intra + int(math.log2(nodes)) * inter
            times.append(LL_BASE_US[algorithm] + 2 * hops)
        else:
            steps, inter_steps = 2 * (ranks - 1), 2 * nodes if spans else 0
            times.append(LL_BASE_US[algorithm] + (steps - inter_steps) * intra + inter_steps * inter)
    return min(times) * 1e-6
