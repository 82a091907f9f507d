"""What to build for a :class:`~dtrain.cluster.topology.Topology`: namespaces, bridges, veths and their rates.

Pure data (no root, no ``ip``): :func:`plan_emulation` reads the topology's network part and returns an
:class:`EmulationPlan` that :mod:`dtrain.emulate.build` carries out. The mapping:

- every server is a network namespace with one interface (``dte-eth``); the rates of all links from the
  server's nodes (host, NICs, GPUs) to its top-of-rack switch add up to that interface's rate, each direction
  on its own (a server with two 100 Gb/s NICs to one ToR is one 200 Gb/s interface);
- every network switch (kind ``"switch"``, no ``server``) is a Linux bridge, all in one "fabric" namespace;
- every switch-to-switch link is a veth pair between two bridges, rate-limited in each direction.

A Linux bridge mesh with a loop (every ToR joined to several spines) would flood forever, and L2 has no ECMP.
So when the switch graph is not a tree but a two-tier leaf-spine (every link joins a ToR to a non-ToR switch),
the spine tier becomes ONE bridge and each ToR's uplinks become one veth whose rate is the sum of its links to
all spines: the oversubscription (ToR downlink over uplink capacity) is exact, while ECMP's hash collisions
are not modelled (the emulated fabric sprays perfectly). Other loops (three tiers with several paths) raise.
That is the default, ``fabric="bridged"``. ``fabric="routed"`` builds a leaf-spine as routers instead, every
ToR-spine link its own shaped veth and every ToR hashing each flow onto one spine, so ECMP collisions happen
as on a real fabric (:mod:`dtrain.emulate.routed`).

Rates are scaled by ``scale`` (a 100 Gb/s link at 1e-3 is emulated at 100 Mb/s) so one small host can drive
them; latencies are not emulated (tc netem is not available), the veths add some tens of microseconds.
"""

from __future__ import annotations

import math

import networkx as nx

from dtrain.cluster.topology import Topology
from dtrain.emulate.layout import (
    FABRICS,
    MAX_BIT_PER_S,
    MAX_SERVERS,
    MIN_BIT_PER_S,
    PREFIX,
    SERVER_INTERFACE,
    SPINE_BRIDGE,
    EmulationPlan,
    ServerPort,
    SwitchLink,
    server_ip,
    server_port,
)
from dtrain.emulate.routed import plan_routed

__all__ = [
    "PREFIX", "ServerPort", "SwitchLink", "EmulationPlan", "plan_emulation", "server_ip", "MIN_BIT_PER_S",
    "MAX_BIT_PER_S", "path_bit_per_s", "FABRICS", "SERVER_INTERFACE", "server_port",
]  # fmt: skip


def _network_switches(topology: Topology) -> list[str]:
    return [n for n, a in topology.graph.nodes(data=True) if a["kind"] == "switch" and a.get("server") is None]


def _server_attachments(topology: Topology, switches: set[str]) -> dict[str, tuple[str, float, float, int]]:
    """Every server's ToR, summed up / down rates (bytes per second) and accelerator count, in one pass over the
    nodes (a pass per server would take minutes on a few thousand servers)."""
    nodes: dict[str, list[str]] = {server: [] for server in topology.servers()}
    for node, server in topology.graph.nodes(data="server"):
        if server is not None:
            nodes[server].append(node)
    devices = dict.fromkeys(nodes, 0)
    for device in topology.devices():
        devices[device.server] += 1
    return {server: (*_server_uplinks(topology, server, members, switches), devices[server])
            for server, members in nodes.items()}  # fmt: skip


def _server_uplinks(topology: Topology, server: str, nodes: list[str], switches: set[str]) -> tuple[str, float, float]:
    """The one switch ``server`` (its ``nodes``) hangs from and its summed up / down rates in bytes per second."""
    graph = topology.graph
    up: dict[str, float] = {}
    down: dict[str, float] = {}
    for node in nodes:
        for _, switch, data in graph.out_edges(node, data=True):
            if switch in switches:
                up[switch] = up.get(switch, 0.0) + data["link"].bytes_per_s
                down[switch] = down.get(switch, 0.0) + graph.edges[switch, node]["link"].bytes_per_s
    if len(up) != 1:
        found = sorted(up) or "none"
        raise ValueError(f"server {server!r} must connect to exactly one network switch to be emulated, found {found}")
    (switch,) = up
    return switch, up[switch], down[switch]


def _switch_graph(topology: Topology, switches: list[str]) -> nx.Graph:
    graph = nx.Graph()
    graph.add_nodes_from(switches)
    for a, b in topology.graph.edges():
        if a in graph and b in graph:
            graph.add_edge(a, b)
    return graph


def _rate(topology: Topology, a: str, b: str) -> float:
    return topology.link(a, b).bytes_per_s


def plan_emulation(
    topology: Topology, *, scale: float, tag: str, placement: list[str] | None = None, fabric: str = "bridged"
) -> EmulationPlan:
    """The plan for ``topology`` at ``scale`` (emulated bit/s = topology bytes/s x 8 x scale).

    ``placement`` orders the servers (server i gets node rank i); the default is ``topology.servers()``.
    ``tag`` (a few letters or digits) names this emulation's namespaces, so two can coexist. ``fabric`` is
    ``"bridged"`` (switches as bridges, a leaf-spine's spines merged) or ``"routed"`` (a leaf-spine as routers
    with per-flow ECMP; see :mod:`dtrain.emulate.routed`).
    """
    if not 0 < scale < math.inf:
        raise ValueError(f"scale must be > 0 and finite (e.g. 1e-3 turns 100 Gb/s into 100 Mb/s), got {scale!r}")
    if not tag or not tag.isalnum() or len(tag) > 8:
        raise ValueError(f"tag must be 1-8 letters or digits, got {tag!r}")
    if fabric not in FABRICS:
        raise ValueError(f"fabric must be one of {FABRICS}, got {fabric!r}")
    servers = _ordered_servers(topology, placement)
    if len(servers) > MAX_SERVERS:
        raise ValueError(f"topology {topology.name!r}: {len(servers)} servers, more than the {MAX_SERVERS} emulated")
    switches = _network_switches(topology)
    if not switches:
        raise ValueError(f"topology {topology.name!r} has no network switch (kind 'switch'); nothing to emulate")
    # every server's ToR, placed or not: a ToR is a ToR even when this run leaves its rack empty
    attach = _server_attachments(topology, set(switches))
    order = {switch: i for i, switch in enumerate(switches)}
    tors = sorted({switch for switch, *_ in attach.values()}, key=order.__getitem__)
    graph = _switch_graph(topology, switches)
    if fabric == "routed":
        plan = plan_routed(topology, graph, tors, servers, attach, scale, tag)
    else:
        plan = _bridged_plan(topology, graph, tors, servers, attach, scale, tag)
    _check_rates(plan)
    return plan


def _bridged_plan(topology, graph, tors, servers, attach, scale, tag) -> EmulationPlan:
    fabric = f"{PREFIX}{tag}-fab"
    bridge_of, links, merged, notes = _switch_plan(topology, graph, tors, 8 * scale)
    ports = [server_port(topology, server, i, attach, scale, namespace=f"{PREFIX}{tag}-s{i}",
                   bridge=bridge_of[attach[server][0]], switch_namespace=fabric)
             for i, server in enumerate(servers)]  # fmt: skip
    bridges: dict[str, str] = {}
    for switch, bridge in bridge_of.items():
        bridges[bridge] = f"{bridges[bridge]},{switch}" if bridge in bridges else switch
    return EmulationPlan(
        topology=topology.name, tag=tag, scale=scale, fabric=fabric, bridges=bridges,
        servers=ports, switch_links=links, spines_merged=merged, notes=notes,
    )  # fmt: skip


def _ordered_servers(topology: Topology, placement: list[str] | None) -> list[str]:
    known = topology.servers()
    if placement is None:
        return known
    names = set(known)
    unknown = [s for s in placement if s not in names]
    if unknown or len(set(placement)) != len(placement):
        raise ValueError(f"placement must list distinct servers of {known}, got {placement}")
    return list(placement)


def _switch_plan(topology: Topology, graph: nx.Graph, tors: list[str], bits: float):
    """Bridges and bridge-to-bridge links (``bits``: bit/s per topology byte/s): the switch graph itself if it
    is a forest, else a merged spine."""
    if nx.is_forest(graph):
        bridge_of = {s: f"{PREFIX}br{i}" for i, s in enumerate(graph.nodes)}
        links = [_link(k, bridge_of[a], bridge_of[b], bits * _rate(topology, a, b), bits * _rate(topology, b, a))
                 for k, (a, b) in enumerate(graph.edges)]  # fmt: skip
        return bridge_of, links, False, []
    upper = [s for s in graph.nodes if s not in tors]
    if any(not ((a in tors) ^ (b in tors)) for a, b in graph.edges):
        raise ValueError(
            f"topology {topology.name!r}: its switches form loops that are not a two-tier leaf-spine (some link "
            f"joins two ToRs or two upper switches); only trees and leaf-spine fabrics can be emulated on bridges"
        )
    bridge_of = {s: f"{PREFIX}br{i}" for i, s in enumerate(tors)} | {s: f"{PREFIX}{SPINE_BRIDGE}" for s in upper}
    links = []
    for k, tor in enumerate(tors):
        spines = list(graph.neighbors(tor))
        up = sum(_rate(topology, tor, s) for s in spines)
        down = sum(_rate(topology, s, tor) for s in spines)
        links.append(_link(k, bridge_of[tor], f"{PREFIX}{SPINE_BRIDGE}", bits * up, bits * down))
    note = (
        f"{len(upper)} spine switches merged into one bridge; each ToR's uplinks summed into one veth "
        f"(capacity and oversubscription exact, ECMP hash collisions not modelled)"
    )
    return bridge_of, links, True, [note]


def _link(k: int, a: str, b: str, a_to_b: float, b_to_a: float) -> SwitchLink:
    return SwitchLink(
        a=a, b=b, a_end=f"{PREFIX}l{k}a", b_end=f"{PREFIX}l{k}b", a_to_b_bit_per_s=a_to_b, b_to_a_bit_per_s=b_to_a
    )


def _check_rates(plan: EmulationPlan) -> None:
    """Refuse rates tc cannot hold steadily."""
    rates = [(s.server, r) for s in plan.servers for r in (s.up_bit_per_s, s.down_bit_per_s)]
    rates += [(f"{x.a}-{x.b}", r) for x in plan.switch_links for r in (x.a_to_b_bit_per_s, x.b_to_a_bit_per_s)]
    rates += [(f"{x.tor}-{x.spine}", r) for x in plan.router_links for r in (x.up_bit_per_s, x.down_bit_per_s)]
    for where, rate in rates:
        if rate < MIN_BIT_PER_S:
            raise ValueError(
                f"{where}: scaled rate {rate:.0f} bit/s is below {MIN_BIT_PER_S:.0f} bit/s; raise --scale "
                f"(now {plan.scale})"
            )
        if rate > MAX_BIT_PER_S:
            raise ValueError(
                f"{where}: scaled rate {rate:.4g} bit/s is above {MAX_BIT_PER_S:.0e} bit/s, more than tc's token "
                f"bucket holds; lower --scale (now {plan.scale})"
            )


def path_bit_per_s(plan: EmulationPlan, src: int, dst: int) -> float:
    """The configured bottleneck rate from server ``src`` to server ``dst`` (indices into ``plan.servers``):
    the smallest shaped rate along the one bridge path between them or, routed, along the slowest of the
    equal-cost paths (one per shared spine; one flow takes one of them, all equal in the cluster builders')."""
    a, b = plan.servers[src], plan.servers[dst]
    rates = [a.up_bit_per_s, b.down_bit_per_s]
    if a.bridge == b.bridge:
        return min(rates)
    if plan.fabric_kind == "routed":
        tor_a, tor_b = plan.bridges[a.bridge], plan.bridges[b.bridge]
        up = {x.spine: x.up_bit_per_s for x in plan.router_links if x.tor == tor_a}
        down = {x.spine: x.down_bit_per_s for x in plan.router_links if x.tor == tor_b}
        return min(rates + [min(min(up[s], down[s]) for s in up.keys() & down.keys())])
    bridges = nx.DiGraph()
    for x in plan.switch_links:
        bridges.add_edge(x.a, x.b, rate=x.a_to_b_bit_per_s)
        bridges.add_edge(x.b, x.a, rate=x.b_to_a_bit_per_s)
    hops = nx.shortest_path(bridges, a.bridge, b.bridge)
    rates += [bridges.edges[u, v]["rate"] for u, v in zip(hops, hops[1:], strict=False)]
    return min(rates)
