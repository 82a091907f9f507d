"""A cluster as a directed graph of devices, hosts, NICs and switches joined by rated links.

The contract shared by the cluster builders, the simulator and the emulator (docs/cluster.md):
every :class:`Link` is one direction with its own full rate (a duplex cable is two links), rates are bytes per
second and latencies seconds. Routing is what a data-centre fabric does: fewest hops, then lowest latency, and
among the equal-cost paths that remain (ECMP, e.g. across the spines of a leaf-spine fabric) a stable hash of the
flow picks one, so one flow always takes one path and many flows spread over all of them. An InfiniBand fabric
(``routing = "d-mod-k"``) forwards by destination instead: the subnet manager's tables send every flow to one
destination port over one path (:mod:`dtrain.cluster.routing`).

The shape it is built for: servers with NVLink/PCIe inside, racks under a top-of-rack switch, spines above
(Al-Fares et al., "A Scalable, Commodity Data Center Network Architecture", SIGCOMM 2008). No torch here.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx

from dtrain.cluster.routing import NIC_AFFINITIES, ROUTINGS, TierRouter, destination_pick, destination_routed
from dtrain.cluster.routing import natural_key as _natural_key

__all__ = ["Device", "Link", "Topology", "NODE_KINDS", "SWITCH_KINDS"]

#: What a node of the graph may be.
NODE_KINDS = frozenset({"gpu", "cpu", "nic", "switch", "nvswitch", "pcie-switch", "host"})
#: The node kinds that only forward traffic.
SWITCH_KINDS = frozenset({"switch", "nvswitch", "pcie-switch"})


@dataclass(frozen=True, kw_only=True)
class Device:
    """An accelerator a rank runs on.

    ``peak_flops`` is dense FLOP/s at the training precision; ``memory_bytes_per_s`` the HBM bandwidth.
    """

    name: str
    server: str
    rack: str | None = None
    peak_flops: float
    memory_bytes: int
    memory_bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Device.name must be a non-empty string")
        for field_name in ("peak_flops", "memory_bytes", "memory_bytes_per_s"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"device {self.name!r}: {field_name} must be > 0, got {getattr(self, field_name)!r}")


@dataclass(frozen=True, kw_only=True)
class Link:
    """One direction of a physical (or aggregated) link: ``src`` to ``dst`` at ``bytes_per_s``."""

    src: str
    dst: str
    bytes_per_s: float
    latency_s: float
    kind: str

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"link {self.src}->{self.dst}: bytes_per_s must be > 0, got {self.bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"link {self.src}->{self.dst}: latency_s must be >= 0, got {self.latency_s!r}")
        self.__dict__["name"] = f"{self.src}->{self.dst}"

    @functools.cached_property
    def name(self) -> str:
        """``"src->dst"``, how reports name the link (made with the link: reports of large clusters sort by it)."""
        return f"{self.src}->{self.dst}"


class Topology:
    """A named cluster graph.

    ``graph`` node attrs: ``kind`` (one of :data:`NODE_KINDS`), ``server``, ``rack``, ``layer`` (a switch's tier:
    "tor", "spine", "core", ...); edge attr ``link``: the :class:`Link`.
    """

    def __init__(self, name: str = "topology") -> None:
        self.name = name
        self.graph: nx.DiGraph = nx.DiGraph()
        self._devices: dict[str, Device] = {}
        self._paths: dict[tuple[str, str], list[list[str]]] = {}
        self._routes: dict[tuple[str, str], list[list[Link]]] = {}
        self._link_of: dict[tuple[str, str], Link] = {}
        self._router: TierRouter | None = None
        self._nic_affinity = "ecmp"
        self._routing = "ecmp"
        self._ports: dict[str, dict[str, int]] = {}
        self._fabric_ways: dict[tuple[str, str], list[list[str]] | None] = {}  # switch pair -> paths, in order
        self._picks: dict[tuple[str, str, int], int] = {}  # (switch pair, port index) -> the path d-mod-k takes
        self._way_links: dict[tuple[str, int], list[Link]] = {}  # (node, 0 out / 1 in) -> its way's links

    @property
    def nic_affinity(self) -> str:
        """How a GPU's traffic picks the NIC it leaves by (:data:`dtrain.cluster.routing.NIC_AFFINITIES`):
        ``"ecmp"``, any NIC on a fewest-hop path, hashed per flow; ``"rail"``, GPU ``k`` uses NIC ``k`` of a
        server with as many NICs as GPUs."""
        return self._nic_affinity

    @nic_affinity.setter
    def nic_affinity(self, value: str) -> None:
        if value not in NIC_AFFINITIES:
            raise ValueError(f"nic_affinity {value!r} is not one of {NIC_AFFINITIES}")
        self._nic_affinity = value
        self._forget_routes()

    @property
    def routing(self) -> str:
        """How the fabric's switches pick among equal-cost paths (:data:`dtrain.cluster.routing.ROUTINGS`):
        ``"ecmp"``, a stable hash of each flow (Ethernet/RoCE); ``"d-mod-k"``, by destination port alone, as an
        InfiniBand subnet manager's fat-tree routing does (:func:`dtrain.cluster.routing.destination_routed`)."""
        return self._routing

    @routing.setter
    def routing(self, value: str) -> None:
        if value not in ROUTINGS:
            raise ValueError(f"routing {value!r} is not one of {ROUTINGS}")
        self._routing = value
        self._forget_routes()

    def _forget_routes(self) -> None:
        self._fabric_ways.clear()
        self._picks.clear()
        self._way_links.clear()
        self._paths.clear()
        self._routes.clear()
        self._ports.clear()
        self._router = None

    def __repr__(self) -> str:
        return (
            f"Topology({self.name!r}: {len(self._devices)} devices, {self.graph.number_of_nodes()} nodes, "
            f"{self.graph.number_of_edges()} links)"
        )

    # -- building ---------------------------------------------------------------------------------------------

    def add_node(
        self,
        name: str,
        *,
        kind: str,
        server: str | None = None,
        rack: str | None = None,
        layer: str | None = None,
    ) -> None:
        """Add a node; ``kind`` is one of :data:`NODE_KINDS`, ``layer`` names a switch's tier ("tor", "spine")."""
        if not name:
            raise ValueError("node name must be a non-empty string")
        if name in self.graph:
            raise ValueError(f"duplicate node name {name!r} in topology {self.name!r}")
        if kind not in NODE_KINDS:
            raise ValueError(f"node {name!r}: unknown kind {kind!r}; expected one of {sorted(NODE_KINDS)}")
        self.graph.add_node(name, kind=kind, server=server, rack=rack, layer=layer)
        self._forget_routes()

    def add_device(self, device: Device) -> None:
        """Add an accelerator as a ``"gpu"`` node that ranks can be placed on."""
        self.add_node(device.name, kind="gpu", server=device.server, rack=device.rack)
        self._devices[device.name] = device

    def add_link(self, a: str, b: str, *, bytes_per_s: float, latency_s: float, kind: str, duplex: bool = True) -> None:
        """Join ``a`` to ``b``; ``duplex`` adds ``b`` to ``a`` too, each direction at the full rate."""
        pairs = [(a, b), (b, a)] if duplex else [(a, b)]
        for src, dst in pairs:
            for end in (src, dst):
                if end not in self.graph:
                    raise ValueError(f"link {src}->{dst}: unknown node {end!r}; add it before linking it")
            if src == dst:
                raise ValueError(f"link {src}->{dst}: a link must join two different nodes")
            if self.graph.has_edge(src, dst):
                raise ValueError(f"duplicate link {src}->{dst} in topology {self.name!r}")
        for src, dst in pairs:
            link = Link(src=src, dst=dst, bytes_per_s=float(bytes_per_s), latency_s=float(latency_s), kind=kind)
            self.graph.add_edge(src, dst, link=link)
            self._link_of[(src, dst)] = link
        self._forget_routes()

    def add_links(self, rows: Iterable[tuple[str, str, float, float, str]], *, duplex: bool = True) -> None:
        """:meth:`add_link` of every ``(a, b, bytes_per_s, latency_s, kind)`` row, in order, all checked before
        any is added (a bad row adds none); what a builder uses for a server's links at once."""
        rows = [(a, b, float(rate), float(latency), kind) for a, b, rate, latency, kind in rows]
        graph, pairs, has_edge = self.graph, set(), self.graph.has_edge
        for a, b, rate, latency, _ in rows:
            for end in (a, b):
                if end not in graph:
                    raise ValueError(f"link {a}->{b}: unknown node {end!r}; add it before linking it")
            if a == b:
                raise ValueError(f"link {a}->{b}: a link must join two different nodes")
            for pair in ((a, b), (b, a)) if duplex else ((a, b),):
                if pair in pairs or has_edge(*pair):
                    raise ValueError(f"duplicate link {pair[0]}->{pair[1]} in topology {self.name!r}")
                pairs.add(pair)
            if not rate > 0:
                raise ValueError(f"link {a}->{b}: bytes_per_s must be > 0, got {rate!r}")
            if not latency >= 0:
                raise ValueError(f"link {a}->{b}: latency_s must be >= 0, got {latency!r}")
        self._add_checked_links(rows, duplex)

    def _add_checked_links(self, rows: list[tuple[str, str, float, float, str]], duplex: bool = True) -> None:
        """:meth:`add_links` of rows known good: float rates > 0 and latencies >= 0 between two different nodes
        of the graph with no link yet (what :func:`dtrain.cluster.builders.add_server` adds between the parts of
        a server it has just added)."""
        graph, edges, link_of = self.graph, [], self._link_of
        for a, b, rate, latency, kind in rows:
            for src, dst in ((a, b), (b, a)) if duplex else ((a, b),):
                link = _checked_link(src, dst, rate, latency, kind)
                edges.append((src, dst, {"link": link}))
                link_of[(src, dst)] = link
        graph.add_edges_from(edges)
        self._forget_routes()

    def add_nodes(self, rows: Iterable[tuple[str, str, str | None, str | None] | Device]) -> None:
        """:meth:`add_node` of every ``(name, kind, server, rack)`` row (no ``layer``: a server's parts), and
        :meth:`add_device` of every :class:`Device` among them, in order, all checked before any is added."""
        rows = [(r.name, "gpu", r.server, r.rack, r) if isinstance(r, Device) else (*r, None) for r in rows]
        names = set()
        for name, kind, _, _, _ in rows:
            if not name:
                raise ValueError("node name must be a non-empty string")
            if name in self.graph or name in names:
                raise ValueError(f"duplicate node name {name!r} in topology {self.name!r}")
            if kind not in NODE_KINDS:
                raise ValueError(f"node {name!r}: unknown kind {kind!r}; expected one of {sorted(NODE_KINDS)}")
            names.add(name)
        self.graph.add_nodes_from(
            (name, {"kind": kind, "server": server, "rack": rack, "layer": None})
            for name, kind, server, rack, _ in rows
        )
        self._devices.update((row[0], row[4]) for row in rows if row[4] is not None)
        self._forget_routes()

    # -- reading ----------------------------------------------------------------------------------------------

    def devices(self) -> list[Device]:
        """The accelerators in placement order: server by server (in the order servers appeared), then by index."""
        order = {server: i for i, server in enumerate(self.servers())}
        return sorted(self._devices.values(), key=lambda d: (order[d.server], _natural_key(d.name)))

    def device(self, name: str) -> Device:
        """The device called ``name``."""
        try:
            return self._devices[name]
        except KeyError:
            raise ValueError(f"{name!r} is not a device of topology {self.name!r}") from None

    def servers(self) -> list[str]:
        """Server names in the order they first appeared."""
        return self._attr_values("server")

    def racks(self) -> list[str]:
        """Rack names in the order they first appeared."""
        return self._attr_values("rack")

    def switches(self) -> list[str]:
        """Nodes that only forward (switch, nvswitch, pcie-switch), in insertion order."""
        return [n for n, kind in self.graph.nodes(data="kind") if kind in SWITCH_KINDS]

    def link(self, src: str, dst: str) -> Link:
        """The link from ``src`` to ``dst``."""
        link = self._link_of.get((src, dst))
        if link is not None:
            return link
        data = self.graph.get_edge_data(src, dst)
        if data is None:
            raise ValueError(f"no link {src}->{dst} in topology {self.name!r}")
        return data["link"]

    def links(self) -> list[Link]:
        """Every directed link, in insertion order."""
        return [link for _, _, link in self.graph.edges(data="link")]

    def _attr_values(self, attr: str) -> list[str]:
        seen: dict[str, None] = {}
        for _, value in self.graph.nodes(data=attr):
            if value is not None:
                seen.setdefault(value, None)
        return list(seen)

    # -- routing ----------------------------------------------------------------------------------------------

    def route(self, src: str, dst: str, flow: int = 0) -> list[Link]:
        """The links a flow from ``src`` to ``dst`` crosses: fewest hops, then lowest latency, then the fabric's
        :attr:`routing` (ECMP: by hash of the flow; d-mod-k: by destination), the hosts' choice of NIC by hash."""
        if src == dst:
            if src not in self.graph:
                raise ValueError(f"route: unknown node {src!r} in topology {self.name!r}")
            return []
        routes = self._routes.get((src, dst))
        if routes is None:
            routes = self._routes[(src, dst)] = self._find_routes(src, dst)
        return routes[_flow_hash(f"{src}|{dst}|{flow}") % len(routes)] if len(routes) > 1 else routes[0]

    def _find_routes(self, src: str, dst: str) -> list[list[Link]]:
        """The routes of a pair: its equal-cost paths, those the switches' tables leave under d-mod-k, as links.

        A pair with one way out of its source's server and one way into its destination's
        (:meth:`TierRouter.one_way`, e.g. GPUs of rail affinity) takes them from the paths of the fabric between
        its two switches, kept per switch pair in the order the whole paths sort in (they share the ends) where
        those paths' links have equal latencies one by one (the whole paths then tie on latency), and under
        d-mod-k the one the destination port's index picks, kept per switch pair and index: what
        :meth:`equal_cost_paths` and :func:`destination_routed` give, without a search or sort a pair."""
        way = self.router.one_way(src, dst)
        fabric = self._fabric_paths(way[1], way[2]) if way is not None else None
        if fabric is None:
            paths = self.equal_cost_paths(src, dst)
            if self._routing == "d-mod-k" and len(paths) > 1:
                paths = destination_routed(paths, self.router.server, self._port_index)
            return [self._path_links(path) for path in paths]
        head, a, b, tail = way
        middles, links = fabric
        if self._routing == "d-mod-k" and len(middles) > 1:
            j = self._port_index(b, tail[0])
            pick = self._picks.get((a, b, j))
            if pick is None:
                pick = self._picks[(a, b, j)] = middles.index(destination_pick(middles, 0, j))
            links = links[pick : pick + 1]
        # a node's way out (in) is the same for every pair: its links are kept
        out = self._way_links.get((src, 0))
        if out is None:
            out = self._way_links[(src, 0)] = self._path_links([*head, a])
        into = self._way_links.get((dst, 1))
        if into is None:
            into = self._way_links[(dst, 1)] = self._path_links([b, *tail])
        return [out + middle + into for middle in links]

    def _fabric_paths(self, a: str, b: str) -> tuple[list[list[str]], list[list[Link]]] | None:
        """The fabric's fewest-hop paths from switch ``a`` to ``b`` in natural order of their nodes, and their
        links; None where two differ in a link's latency."""
        found = self._fabric_ways.get((a, b), False)
        if found is False:
            paths = self.router.middle(a, b)
            if len(paths) > 1:
                paths = sorted(paths, key=lambda p: [_natural_key(n) for n in p])
            links = [self._path_links(path) for path in paths]
            lat = [[link.latency_s for link in path] for path in links]
            found = (paths, links) if all(x == lat[0] for x in lat) else None
            self._fabric_ways[(a, b)] = found
        return found

    def _port_index(self, switch: str, node: str) -> int:
        """The position of host port ``node`` among ``switch``'s host ports (nodes of a server), in natural order."""
        ports = self._ports.get(switch)
        if ports is None:
            server = self.router.server
            hosts = sorted((v for v in self.graph.successors(switch) if server.get(v) is not None), key=_natural_key)
            ports = self._ports[switch] = {v: i for i, v in enumerate(hosts)}
        return ports.get(node, 0)

    def _path_links(self, path: list[str]) -> list[Link]:
        links = self._link_of
        try:
            return [links[(u, v)] for u, v in zip(path, path[1:], strict=False)]
        except KeyError:  # an edge put into the graph without add_link
            return [self._link_of_edge(u, v) for u, v in zip(path, path[1:], strict=False)]

    def _link_of_edge(self, u: str, v: str) -> Link:
        link = self._link_of.get((u, v))
        return link if link is not None else self.graph.edges[u, v]["link"]

    def equal_cost_routes(self, src: str, dst: str) -> list[list[Link]]:
        """The paths :meth:`route` may take, as lists of links (cached): :meth:`equal_cost_paths`, only those the
        switches' tables leave under d-mod-k :attr:`routing`; ``[[]]`` from a node to itself."""
        if src == dst:
            self.route(src, dst)
            return [[]]
        self.route(src, dst)
        return self._routes[(src, dst)]

    def equal_cost_paths(self, src: str, dst: str) -> list[list[str]]:
        """Every fewest-hop, lowest-latency node path from ``src`` to ``dst``, in a stable order (cached)."""
        key = (src, dst)
        if key not in self._paths:
            self._paths[key] = self._find_paths(src, dst)
        return self._paths[key]

    @property
    def router(self) -> TierRouter:
        """The tier-by-tier router of this topology as it is now (:mod:`dtrain.cluster.routing`)."""
        if self._router is None:
            self._router = TierRouter(self.graph, self._nic_affinity)
        return self._router

    def _find_paths(self, src: str, dst: str) -> list[list[str]]:
        for end in (src, dst):
            if end not in self.graph:
                raise ValueError(f"route {src}->{dst}: unknown node {end!r} in topology {self.name!r}")
        paths = self.router.paths(src, dst)
        if paths is None:
            try:
                paths = list(nx.all_shortest_paths(self.graph, src, dst))
            except nx.NetworkXNoPath:
                raise ValueError(f"no route from {src!r} to {dst!r} in topology {self.name!r}") from None
        if len(paths) == 1:
            return paths

        def latency(path: list[str]) -> float:
            return sum(link.latency_s for link in self._path_links(path))

        latencies = [latency(p) for p in paths]
        best = min(latencies)
        # Relative tolerance: latencies that differ only by float rounding are the same cost.
        tied = [p for p, t in zip(paths, latencies, strict=True) if t <= best * (1 + 1e-9) + 1e-15]
        return sorted(tied, key=lambda p: [_natural_key(n) for n in p])

    # -- checking ---------------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending node or link if the topology is inconsistent."""
        for u, v, link in self.graph.edges(data="link"):
            if not isinstance(link, Link):
                raise ValueError(f"link {u}->{v}: edge has no Link attribute")
            if (link.src, link.dst) != (u, v):
                raise ValueError(f"link {u}->{v}: its Link says {link.src}->{link.dst}")
            if not link.bytes_per_s > 0:
                raise ValueError(f"link {u}->{v}: bytes_per_s must be > 0, got {link.bytes_per_s!r}")
            if not link.latency_s >= 0:
                raise ValueError(f"link {u}->{v}: latency_s must be >= 0, got {link.latency_s!r}")
        for name, kind in self.graph.nodes(data="kind"):
            if kind not in NODE_KINDS:
                raise ValueError(f"node {name!r}: unknown kind {kind!r}; expected one of {sorted(NODE_KINDS)}")
        for name in self._devices:
            if self.graph.nodes.get(name, {}).get("kind") != "gpu":
                raise ValueError(f"device {name!r} is not a gpu node of the graph")
        self._check_devices_connected()

    def _check_devices_connected(self) -> None:
        names = [d.name for d in self.devices()]
        if len(names) < 2:
            return
        first = names[0]
        reachable = nx.descendants(self.graph, first)
        reaching = nx.ancestors(self.graph, first)
        for name in names[1:]:
            if name not in reachable:
                raise ValueError(f"device {name!r} cannot be reached from device {first!r}")
            if name not in reaching:
                raise ValueError(f"device {name!r} cannot reach device {first!r}")


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside: building or replaying a cluster of ten thousand GPUs makes
    millions of containers that live on, and each full collection meanwhile walks every one made so far (a third
    of the time at that scale). Reference counting still frees everything; the few cycles wait for the next
    collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                # what the pause made joins the oldest generation unscanned (gc.unfreeze), as it would after
                # surviving two young collections, each of which would walk every one of it
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _checked_link(src: str, dst: str, bytes_per_s: float, latency_s: float, kind: str) -> Link:
    """``Link(src=src, dst=dst, ...)`` of values already checked (floats, a rate > 0, a latency >= 0), without
    :class:`Link`'s checks: the same frozen object, made in a third of the time (a cluster of ten thousand GPUs has
    a hundred thousand links)."""
    link = object.__new__(Link)
    link.__dict__.update(
        src=src, dst=dst, bytes_per_s=bytes_per_s, latency_s=latency_s, kind=kind, name=f"{src}->{dst}"
    )
    return link


def _flow_hash(key: str) -> int:
    """A stable, well-mixed hash of a flow (as a switch's ECMP hash is meant to be). CRC-32, used before, is
    linear in its input: flow ids differing in a fixed pattern got correlated paths (ids 2j and 2j + 1 shared
    a spine 45% of the time instead of 50%), which the emulated routed fabric's measurements exposed."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
