"""NCCL's own collectives (``algorithm="native"``) as a model the flow simulator replays.

On one NVLink node NCCL runs an all-reduce as ONE kernel: a ring reduce-scatter followed by a ring all-gather,
``2(n-1)`` steps, over several channels (rings) at once, each channel's share cut into slices that flow
through a FIFO of buffer slots (NCCL's ``NCCL_STEPS``). Nothing goes back to the host between steps: a step
costs a flag handshake of a few microseconds, not a Python round (Jeaugey, "NCCL 2.0", GTC 2017; NCCL's
``src/device/all_reduce.h`` ``runRing`` and its tuning model, ``src/graph/tuning.cc``, whose time is
``base latency + steps x hop latency + bytes / bus bandwidth``).

The model, per rank ``r`` and connection ``r -> r+1`` of the ring (channels aggregated: they cross the same
links in lockstep, so under max-min sharing ``C`` flows capped at ``c`` each move as one flow capped at ``C c``):

- the rank's block (``nbytes / n``; broadcast: the whole buffer) is cut into ``P`` pieces of at most
  ``channels x slice_bytes`` (``P`` at most ``max_pieces``, to bound the events simulated: once a step's
  ``P`` pieces outlast one piece's trip to the next rank, the ring's time no longer depends on ``P``);
- piece ``p`` of step ``s`` may leave rank ``r`` once piece ``p`` of step ``s-1`` has arrived there plus
  ``step_latency_s`` (data dependency: what it forwards, it must have received), and the connection has
  sent its previous piece (one FIFO per connection, pieces in the order they became ready);
- each piece is a flow on the topology, sharing links max-min fairly (:mod:`dtrain.sim.flows`), capped at
  ``channels x channel_bytes_per_s`` if given;
- the kernel starts ``launch_s`` after the call and ends at the last arrival. Back-to-back calls (how
  ``dtrain bench comm`` and nccl-tests time) overlap the host's enqueue with the previous kernel, so a call
  costs ``max(host_s, kernel)``.

Collectives: all-reduce (``2(n-1)`` ring steps), all-gather and reduce-scatter (``n-1``), broadcast (a chain
from rank 0: step ``s`` is rank ``s`` to ``s+1``, pipelined), all-to-all (every pair at once, one step).
On a uniform star the replay equals :func:`ring_closed_form` (tests/test_sim_nccl.py). Not modelled: NCCL's
tree and NVLS (NVLink SHARP) algorithms, its LL/LL128 protocols for small messages, and its choice of fewer
channels for small messages; the fitted figures absorb them (docs/sim.md says where that shows).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dtrain.cluster.topology import Topology
from dtrain.sim.collective import check_placement
from dtrain.sim.flows import FlowNetwork, LinkUsage

__all__ = ["NCCL_COLLECTIVES", "NcclParams", "NcclResult", "ring_steps", "pieces", "simulate_nccl", "ring_closed_form"]

#: Collectives the model knows, and how many sequential steps each has on ``n`` ranks.
NCCL_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


@dataclass(frozen=True, kw_only=True)
class NcclParams:
    """NCCL's costs outside the links.

    ``host_s``: the host's time per call (Python, the enqueue, the launch); ``launch_s``: from the call to the
    kernel's first step on the device; ``step_latency_s``: a step's handshake after its data arrived (NCCL's
    per-hop latency, on top of the links' own); ``channels`` and ``slice_bytes``: the pipelining grain (NCCL:
    16 or more channels on NVLink, 512 KiB slots, ``NCCL_BUFFSIZE / NCCL_STEPS``); ``channel_bytes_per_s``:
    the most one channel moves (None: links only); ``max_pieces``: a bound on the simulated pieces.
    """

    host_s: float = 0.0
    launch_s: float = 0.0
    step_latency_s: float = 2e-6
    channels: int = 16
    slice_bytes: int = 512 << 10
    channel_bytes_per_s: float | None = None
    max_pieces: int = 64

    def __post_init__(self) -> None:
        for name in ("host_s", "launch_s", "step_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"NcclParams.{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if self.channels < 1 or self.slice_bytes < 1 or self.max_pieces < 1:
            raise ValueError(
                f"NcclParams needs channels, slice_bytes and max_pieces >= 1; got {self.channels}, "
                f"{self.slice_bytes}, {self.max_pieces}"
            )
        if self.channel_bytes_per_s is not None and not self.channel_bytes_per_s > 0:
            raise ValueError(f"NcclParams.channel_bytes_per_s must be > 0 or None, got {self.channel_bytes_per_s!r}")

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


def ring_steps(collective: str, n: int) -> list[list[tuple[int, int]]]:
    """The ``(src, dst)`` sends of each step, on ranks ``0..n-1``."""
    ring = [(r, (r + 1) % n) for r in range(n)]
    if collective == "all_reduce":
        return [ring] * (2 * (n - 1))
    if collective in ("all_gather", "reduce_scatter"):
        return [ring] * (n - 1)
    if collective == "broadcast":
        return [[(s, s + 1)] for s in range(n - 1)]
    if collective == "all_to_all":
        return [[(a, b) for a in range(n) for b in range(n) if a != b]]
    raise ValueError(f"NCCL model: unknown collective {collective!r}; known: {', '.join(NCCL_COLLECTIVES)}")


def _block_bytes(collective: str, nbytes: int, n: int) -> float:
    """Bytes one send carries over a whole call: a rank's block (the buffer for broadcast)."""
    return float(nbytes) if collective == "broadcast" else nbytes / n


def pieces(collective: str, nbytes: int, n: int, params: NcclParams) -> int:
    """How many pieces each send is cut into."""
    grain = params.channels * params.slice_bytes
    return max(1, min(params.max_pieces, math.ceil(_block_bytes(collective, nbytes, n) / grain)))


def simulate_nccl(
    topology: Topology,
    collective: str,
    nbytes: int,
    placement: Sequence[str] | None = None,
    *,
    params: NcclParams | None = None,
) -> NcclResult:
    """Simulate NCCL's ``collective`` on a ``nbytes`` work buffer (``dtrain.comm.cost``'s meaning: the output
    of an all-gather, the input of a reduce-scatter), ring order = ``placement`` order (default: every device
    of ``topology``)."""
    params = params or NcclParams()
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    placement = list(placement) if placement is not None else [d.name for d in topology.devices()]
    n = len(placement)
    if n < 2:
        raise ValueError(f"an NCCL collective needs at least 2 ranks, got placement {placement!r}")
    placement = check_placement(topology, placement, n)
    steps = ring_steps(collective, n)
    count = pieces(collective, nbytes, n, params)
    piece = _block_bytes(collective, nbytes, n) / count
    net = FlowNetwork(topology)
    _Pipeline(net, placement, steps, count, piece, params).start(params.launch_s)
    kernel = net.run()
    return NcclResult(time_s=max(params.host_s, kernel), kernel_s=kernel, pieces=count, links=net.usage(kernel))


class _Pipeline:
    """The event-driven pieces: a FIFO of ready pieces per connection, one piece in flight on each."""

    def __init__(self, net: FlowNetwork, placement, steps, count: int, piece: float, params: NcclParams) -> None:
        self.net, self.placement, self.steps, self.count, self.piece = net, placement, steps, count, piece
        self.params = params
        # the step in which each rank sends, by the step in which it received (the dependency)
        self.sends_of = [{src: (src, dst) for src, dst in step} for step in steps]
        self.queue: dict[tuple[int, int], deque[tuple[int, int]]] = {}
        self.busy: set[tuple[int, int]] = set()

    def start(self, at_s: float) -> None:
        def first() -> None:
            for p in range(self.count):
                for conn in self.steps[0]:
                    self._ready(conn, 0, p)

        self.net.at(at_s, first)

    def _ready(self, conn: tuple[int, int], step: int, p: int) -> None:
        self.queue.setdefault(conn, deque()).append((step, p))
        self._pump(conn)

    def _pump(self, conn: tuple[int, int]) -> None:
        if conn in self.busy or not self.queue.get(conn):
            return
        step, p = self.queue[conn].popleft()
        self.busy.add(conn)
        src, dst = conn

        def sent(_t: float) -> None:
            self.busy.discard(conn)
            self._pump(conn)

        def arrived(_t: float) -> None:
            if step + 1 < len(self.steps) and dst in self.sends_of[step + 1]:
                nxt = self.sends_of[step + 1][dst]
                self.net.at(self.net.now + self.params.step_latency_s, lambda: self._ready(nxt, step + 1, p))

        flow_id = hash((src, dst, step, p)) & 0x7FFFFFFF
        self.net.send(self.placement[src], self.placement[dst], self.piece, flow_id=flow_id, on_done=arrived,
                      on_sent=sent, cap_bytes_per_s=self.params.connection_cap)  # fmt: skip


def ring_closed_form(
    collective: str, nbytes: int, n: int, *, link_bytes_per_s: float, path_latency_s: float, params: NcclParams
) -> float:
    """The model's time on a uniform star (each rank one link each way at ``link_bytes_per_s``, a rank-to-rank
    path of ``path_latency_s``), for the ring collectives and the chain broadcast.

    With ``S`` steps, ``P`` pieces of ``c`` bytes, ``t = c / rate`` and ``d = t + latency + step latency`` (a
    piece's time from leaving one rank to leaving the next): a ring connection carries every step, so a step's
    P pieces take ``max(P t, d)``; a chain connection carries one step, so the steps overlap and cost ``d``::

        ring:  launch + (S-1) max(P t, d) + P t + latency
        chain: launch + (S-1) d           + P t + latency
    """
    if collective == "all_to_all":
        raise ValueError("ring_closed_form covers the ring collectives and the chain broadcast, not all_to_all")
    steps = len(ring_steps(collective, n))
    count = pieces(collective, nbytes, n, params)
    rate = link_bytes_per_s if params.connection_cap is None else min(link_bytes_per_s, params.connection_cap)
    t = _block_bytes(collective, nbytes, n) / count / rate
    d = t + path_latency_s + params.step_latency_s
    cycle = d if collective == "broadcast" else max(count * t, d)
    kernel = params.launch_s + (steps - 1) * cycle + count * t + path_latency_s
    return max(params.host_s, kernel)
