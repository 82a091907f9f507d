"""Flow-level network simulation: concurrent flows share every directed link max-min fairly.

A flow moves ``nbytes`` from one node to another along its routed path (:meth:`Topology.route`, the flow's id
spreading flows over equal-cost paths). While flows are active, each gets its max-min fair rate: progressive
filling raises every unfrozen flow's rate together until a link is full (or a flow reaches its own cap), freezes
the flows on it, and repeats (Bertsekas and Gallager, *Data Networks*, 2nd ed., section 6.5.2). Rates are
recomputed whenever a flow starts or finishes, so the simulation is event-driven and exact for this model.
A flow's last byte arrives the path's latency after it leaves the first link (store-and-forward per message
is not modelled; flow-level simulators such as SimGrid's LV08 model make the same simplification).

No torch here.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dtrain.cluster.topology import Link, Topology

__all__ = [
    "FlowSpec",
    "LinkUsage",
    "FlowNetwork",
    "max_min_rates",
    "simulate_flows",
    "relayed_route",
    "relayed_routes",
    "usage_rows",
]

#: A flow whose remaining bytes fall below this fraction of its size (float rounding) is done.
_DONE = 1e-9


@dataclass(frozen=True, kw_only=True)
class FlowSpec:
    """A flow for :func:`simulate_flows`: ``nbytes`` from ``src`` to ``dst``, starting at ``start_s``."""

    src: str
    dst: str
    nbytes: float
    start_s: float = 0.0
    flow_id: int = 0
    cap_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.nbytes >= 0:
            raise ValueError(f"flow {self.src}->{self.dst}: nbytes must be >= 0, got {self.nbytes!r}")
        if not self.start_s >= 0:
            raise ValueError(f"flow {self.src}->{self.dst}: start_s must be >= 0, got {self.start_s!r}")


@dataclass(frozen=True, kw_only=True)
class LinkUsage:
    """What one link carried: ``nbytes`` in ``busy_s`` seconds of a ``total_s``-second run."""

    link: Link
    nbytes: float
    busy_s: float
    total_s: float

    @property
    def utilisation(self) -> float:
        """Busy bytes over what the link could have carried in the whole run: ``nbytes / (total_s x rate)``."""
        return self.nbytes / (self.total_s * self.link.bytes_per_s) if self.total_s > 0 else 0.0


def usage_rows(rows: Iterable[tuple[Link, float, float]], total_s: float) -> list[LinkUsage]:
    """``LinkUsage(link=link, nbytes=nbytes, busy_s=busy_s, total_s=total_s)`` of each ``(link, nbytes, busy_s)``
    row: the same frozen objects, set field by field as the dataclass's ``__init__`` sets them, without a keyword
    call each (a replay on ten thousand GPUs makes a hundred thousand rows)."""
    new, put = object.__new__, object.__setattr__
    out = []
    for link, nbytes, busy in rows:
        usage = new(LinkUsage)
        put(usage, "link", link)
        put(usage, "nbytes", nbytes)
        put(usage, "busy_s", busy)
        put(usage, "total_s", total_s)
        out.append(usage)
    return out


def max_min_rates(paths: Sequence[Sequence[Link]], caps: Sequence[float | None] | None = None) -> list[float]:
    """Max-min fair rates (bytes/s) of flows crossing ``paths``, each also held under its own cap (None: none).

    Progressive filling: every link shares what is left of it equally among its unfrozen flows; the tightest
    link (or flow cap) fixes its flows' rate, they are frozen, and the rest carry on. A flow on no link and
    with no cap is unconstrained (``inf``).
    """
    index: dict[tuple[str, str], int] = {}
    capacity: list[float] = []
    flow_links = []
    for path in paths:
        ids = []
        for link in path:
            key = (link.src, link.dst)
            if key not in index:
                index[key] = len(capacity)
                capacity.append(link.bytes_per_s)
            ids.append(index[key])
        flow_links.append(ids)
    return _fair_share(flow_links, capacity, list(caps) if caps is not None else [None] * len(paths))


def _fair_share(flow_links: list[list[int]], capacity: list[float], caps: list[float | None]) -> list[float]:
    """:func:`max_min_rates` on link indices: ``flow_links[i]`` the links of flow i, ``capacity[k]`` link k's."""
    rates = [math.inf] * len(flow_links)
    users: dict[int, list[int]] = {}
    for i, ids in enumerate(flow_links):
        for k in ids:
            users.setdefault(k, []).append(i)
    left = {k: capacity[k] for k in users}
    count = {k: len(u) for k, u in users.items()}  # unfrozen flows on each link
    live = list(users)  # links that still carry an unfrozen flow
    active = {i for i, ids in enumerate(flow_links) if ids or caps[i] is not None}
    capped = [i for i in active if caps[i] is not None]
    while active:
        live = [k for k in live if count[k]]
        shares = [left[k] / count[k] for k in live]
        share = min([*shares, *(caps[i] for i in capped if i in active)], default=math.inf)
        limit = share * (1 + 1e-12)
        frozen = {i for k, sk in zip(live, shares, strict=True) if sk <= limit for i in users[k] if i in active}
        frozen |= {i for i in capped if i in active and caps[i] <= limit}
        for i in frozen:
            rates[i] = share
            for k in flow_links[i]:
                left[k] = max(0.0, left[k] - share)
                count[k] -= 1
        active -= frozen
    return rates


@dataclass
class _Flow:
    """A flow in flight; its bytes left and rate live in the network's arrays, at ``slot``."""

    links: list[int]
    latency_s: float
    cap: float | None
    on_done: Callable[[float], None] | None
    on_sent: Callable[[float], None] | None
    slot: int


def relayed_route(topology: Topology, src: str, dst: str, flow_id: int = 0, via: str | None = None) -> list[Link]:
    """The links from ``src`` to ``dst``: :meth:`Topology.route`, or through ``via`` when it is another node (the
    route to it, then the route from it, each hashed by ``flow_id``), as NCCL's PXN sends a GPU's data over NVLink
    to the GPU whose NIC is on the destination's rail, which puts it on the network (NCCL 2.12 and later;
    ``NCCL_PXN_DISABLE`` in NCCL's environment variables)."""
    if via is None or via in (src, dst):
        return topology.route(src, dst, flow_id)
    return topology.route(src, via, flow_id) + topology.route(via, dst, flow_id)


def relayed_routes(topology: Topology, src: str, dst: str, via: str | None = None) -> list[list[Link]]:
    """Every equal-cost path :func:`relayed_route` may take (:meth:`Topology.equal_cost_routes` through ``via``)."""
    if via is None or via in (src, dst):
        return topology.equal_cost_routes(src, dst)
    return [a + b for a in topology.equal_cost_routes(src, via) for b in topology.equal_cost_routes(via, dst)]


class FlowNetwork:
    """An event-driven network on a topology: start flows and timers, then :meth:`run` to completion.

    ``flow_cap_bytes_per_s`` caps every flow's rate (one connection's limit, e.g. the NCCL channels of one
    peer-to-peer transfer); ``None`` leaves flows limited by links only.
    """

    def __init__(self, topology: Topology, *, flow_cap_bytes_per_s: float | None = None) -> None:
        if flow_cap_bytes_per_s is not None and not flow_cap_bytes_per_s > 0:
            raise ValueError(f"flow_cap_bytes_per_s must be > 0 or None, got {flow_cap_bytes_per_s!r}")
        self.topology = topology
        self.flow_cap_bytes_per_s = flow_cap_bytes_per_s
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._flows: dict[int, _Flow] = {}
        self._ids = itertools.count()
        # the flows in flight by slot (0 .. len(self._flows) - 1): bytes left, rate, size, id; each event's
        # arithmetic on them is elementwise, the same floats flow by flow as a loop over the flows would give
        self._left = np.zeros(64)
        self._rate = np.zeros(64)
        self._size = np.zeros(64)
        self._slot_id: list[int] = []
        # links by index, as they are first used: the link, its rate, bytes carried, busy time, flows on it
        self._index: dict[tuple[str, str], int] = {}
        self._links: list[Link] = []
        self._capacity: list[float] = []
        self._bytes: list[float] = []
        self._busy_s: list[float] = []
        self._users: dict[int, set[int]] = {}  # the flows on each link now
        self._busy_since: dict[int, float] = {}  # when each link that carries a flow now became busy
        # links whose flows changed since the last allocation: rates are recomputed once per instant, and only
        # for the flows that share links with these, directly or through others (max-min fair shares of flows
        # that share no link, even indirectly, are independent)
        self._touched: set[int] = set()

    def at(self, time_s: float, callback: Callable[[], None]) -> None:
        """Call ``callback()`` at ``time_s`` (not before now)."""
        heapq.heappush(self._events, (max(time_s, self.now), next(self._order), callback))

    def send(
        self,
        src: str,
        dst: str,
        nbytes: float,
        *,
        flow_id: int = 0,
        on_done: Callable[[float], None] | None = None,
        cap_bytes_per_s: float | None = None,
        on_sent: Callable[[float], None] | None = None,
        via: str | None = None,
    ) -> None:
        """Start a flow now; ``on_done(t)`` is called when its last byte has arrived at ``dst``, ``on_sent(t)``
        when it has left ``src`` (the path's latency earlier: the sender may start its next message then). The
        flow's rate is capped at ``cap_bytes_per_s`` if given, else at the network's ``flow_cap_bytes_per_s``.
        ``via``: a node the flow passes through, its path the route to it followed by the route from it
        (:func:`relayed_route`)."""
        if cap_bytes_per_s is not None and not cap_bytes_per_s > 0:
            raise ValueError(f"a flow's rate cap must be > 0 bytes/s, got {cap_bytes_per_s!r} ({src} -> {dst})")
        path = relayed_route(self.topology, src, dst, flow_id, via)
        latency = sum(link.latency_s for link in path)
        if nbytes <= 0 or not path:
            # nothing to move, or a copy within a node: only the latency
            if on_sent is not None:
                self.at(self.now, lambda: on_sent(self.now))
            self.at(self.now + latency, lambda: on_done and on_done(self.now))
            return
        links = [self._link_id(link) for link in path]
        cap = cap_bytes_per_s if cap_bytes_per_s is not None else self.flow_cap_bytes_per_s
        flow_id = next(self._ids)
        slot = len(self._slot_id)
        if slot == len(self._left):
            self._left, self._rate, self._size = (
                np.concatenate([a, np.zeros(slot)]) for a in (self._left, self._rate, self._size)
            )
        self._left[slot] = self._size[slot] = float(nbytes)
        self._rate[slot] = 0.0
        self._slot_id.append(flow_id)
        self._flows[flow_id] = _Flow(links, latency, cap, on_done, on_sent, slot)
        for k in links:
            self._bytes[k] += nbytes
            users = self._users.setdefault(k, set())
            if not users:
                self._busy_since[k] = self.now
            users.add(flow_id)
        self._touched.update(links)

    def _link_id(self, link: Link) -> int:
        key = (link.src, link.dst)
        k = self._index.get(key)
        if k is None:
            k = self._index[key] = len(self._links)
            self._links.append(link)
            self._capacity.append(link.bytes_per_s)
            self._bytes.append(0.0)
            self._busy_s.append(0.0)
        return k

    def run(self) -> float:
        """Advance until no flow or event is left; return the time of the last event."""
        while self._events or self._flows:
            if self._touched:
                self._reallocate()
            next_event = self._events[0][0] if self._events else math.inf
            n = len(self._slot_id)
            next_drain = float((self.now + self._left[:n] / self._rate[:n]).min()) if n else math.inf
            step_to = min(next_event, next_drain)
            self._advance(step_to)
            if next_drain <= next_event:
                self._finish_drained()
            while self._events and self._events[0][0] <= self.now:
                _, _, callback = heapq.heappop(self._events)
                callback()
        return self.now

    def usage(self, total_s: float | None = None) -> list[LinkUsage]:
        """Every link that carried bytes, busiest (by utilisation) first."""
        total = self.now if total_s is None else total_s
        rows = [
            LinkUsage(link=link, nbytes=self._bytes[k], busy_s=self._busy_s[k], total_s=total)
            for k, link in enumerate(self._links)
        ]
        return sorted(rows, key=lambda u: (-u.utilisation, u.link.name))

    def _advance(self, time_s: float) -> None:
        dt = time_s - self.now
        if dt > 0 and self._flows:
            n = len(self._slot_id)
            self._left[:n] -= self._rate[:n] * dt
        self.now = time_s

    def _finish_drained(self) -> None:
        # done: drained to rounding, or so close that the clock cannot advance by its remaining time
        n = len(self._slot_id)
        left, now = self._left[:n], self.now
        drained = np.flatnonzero((left <= _DONE * self._size[:n]) | (now + left / self._rate[:n] <= now))
        done = sorted(self._slot_id[s] for s in drained.tolist())  # ids rise with the start: the start order
        for i in done:
            flow = self._flows.pop(i)
            self._free(flow.slot)
            for k in flow.links:
                self._users[k].discard(i)
                if not self._users[k]:
                    self._busy_s[k] += self.now - self._busy_since.pop(k)
            self._touched.update(flow.links)
            if flow.on_sent is not None:
                sent = flow.on_sent
                self.at(self.now, lambda cb=sent: cb(self.now))
            if flow.on_done is not None:
                callback = flow.on_done
                self.at(self.now + flow.latency_s, lambda cb=callback: cb(self.now))
        self._reallocate()

    def _reallocate(self) -> None:
        ids = self._affected()
        flows = [self._flows[i] for i in ids]
        rates = _fair_share([f.links for f in flows], self._capacity, [f.cap for f in flows])
        for flow, rate in zip(flows, rates, strict=True):
            self._rate[flow.slot] = rate

    def _free(self, slot: int) -> None:
        """Move the last slot's flow into ``slot``, left free by a finished flow."""
        last = len(self._slot_id) - 1
        if slot != last:
            moved = self._slot_id[last]
            self._slot_id[slot] = moved
            self._flows[moved].slot = slot
            for a in (self._left, self._rate, self._size):
                a[slot] = a[last]
        self._slot_id.pop()

    def _affected(self) -> list[int]:
        """The flows connected to the touched links through shared links (breadth-first); clears the touched."""
        seen_links, seen_flows = set(self._touched), set()
        frontier = list(self._touched)
        self._touched.clear()
        while frontier:
            k = frontier.pop()
            for i in self._users.get(k, ()):
                if i not in seen_flows:
                    seen_flows.add(i)
                    for other in self._flows[i].links:
                        if other not in seen_links:
                            seen_links.add(other)
                            frontier.append(other)
        return sorted(seen_flows)


def simulate_flows(
    topology: Topology, flows: Sequence[FlowSpec], *, flow_cap_bytes_per_s: float | None = None
) -> tuple[list[float], list[LinkUsage]]:
    """Run a fixed set of flows; return each flow's finish time (in the given order) and the links' usage."""
    net = FlowNetwork(topology, flow_cap_bytes_per_s=flow_cap_bytes_per_s)
    finish = [math.nan] * len(flows)

    def starter(i: int, spec: FlowSpec) -> Callable[[], None]:
        def record(t: float) -> None:
            finish[i] = t

        return lambda: net.send(spec.src, spec.dst, spec.nbytes, flow_id=spec.flow_id, on_done=record)

    for i, spec in enumerate(flows):
        net.at(spec.start_s, starter(i, spec))
    end = net.run()
    return finish, net.usage(end)
