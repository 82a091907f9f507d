"""The routed leaf-spine fabric (``plan_emulation(..., fabric="routed")``): per-flow ECMP over real spines.

Pure data, like :mod:`dtrain.emulate.plan`. The bridged fabric merges the spines into one bridge, because L2
cannot have loops or multipath; it spreads traffic over the spines perfectly. Real fabrics route, and hash each
flow onto one equal-cost path, so two flows can land on one spine uplink while another idles (an ECMP
collision). This plan builds that:

- every ToR and every spine is a router: a namespace of its own (``dte-<tag>-t<i>``, ``dte-<tag>-p<k>``) with
  ``net.ipv4.ip_forward=1`` and ``net.ipv4.fib_multipath_hash_policy=1`` (hash the L4 5-tuple, so each TCP
  connection is one flow); both are per-namespace sysctls (Documentation/networking/ip-sysctl.rst; the
  policy lives in ``struct netns_ipv4``). Reverse-path filtering is off: with ECMP a flow's replies may come
  back over another spine than its data went out.
- a ToR bridges its servers' ports (``dte-br<i>``, so traffic inside a rack is switched as before) and routes
  everything else; its address on that bridge (``10.178.<i>.1``) is the servers' gateway.
- every ToR-spine link is its own veth pair (``dte-u<k>`` in ToR i, ``dte-d<i>`` in spine k) on a /31
  (``10.178.<i>.<2k+2>`` and ``<2k+3>``), shaped in each direction at that link's own scaled rate.
- a ToR reaches each server of another rack through one multipath route with one nexthop per spine the two
  ToRs share (``ip route add A/32 nexthop via S0 dev dte-u0 nexthop via S1 dev dte-u1``, ip-route(8)); a
  spine reaches each server through that server's ToR.

Servers keep their addresses (``10.177.1xx.1xx``, whose string order is the rank order c10d uses), now as /32s:
a rack's servers cannot be one prefix, because a placement such as ``interleaved`` gives a rack's servers
non-adjacent ranks and so non-adjacent addresses. Hence one /32 route per server, not one per rack: a server
reaches its rack's peers on the bridge and the rest of ``10.177.0.0/16`` through its ToR.
"""

from __future__ import annotations

import networkx as nx

from dtrain.cluster.topology import Topology
from dtrain.emulate.layout import (
    PREFIX,
    ROUTER_SYSCTLS,
    SERVER_INTERFACE,
    SERVER_NETWORK,
    EmulationPlan,
    Nexthop,
    Route,
    Router,
    RouterLink,
    server_port,
)

__all__ = [
    "Router", "RouterLink", "Nexthop", "Route", "ROUTER_SYSCTLS", "SERVER_NETWORK", "plan_routed", "plan_fabric",
    "plan_routes", "tor_bridge", "gateway_ip",
]  # fmt: skip

_MAX_TORS = 256
_MAX_SPINES = 126


def tor_bridge(index: int) -> str:
    return f"{PREFIX}br{index}"


def gateway_ip(tor_index: int) -> str:
    return f"10.178.{tor_index}.1"


def _link_ips(tor_index: int, spine_index: int) -> tuple[str, str]:
    return f"10.178.{tor_index}.{2 * spine_index + 2}", f"10.178.{tor_index}.{2 * spine_index + 3}"


def plan_routed(
    topology: Topology, graph: nx.Graph, tors: list[str], servers: list[str], attach: dict, scale: float, tag: str
) -> EmulationPlan:
    """The routed plan of ``topology`` (see :func:`dtrain.emulate.plan.plan_emulation`, which checks the
    arguments and calls this): ``servers`` in rank order, ``attach`` each server's ToR and rates."""
    routers, links = plan_fabric(topology, graph, tors, 8 * scale, tag)
    tor_router = {r.switch: r for r in routers if r.role == "tor"}
    ports = []
    for i, server in enumerate(servers):
        router = tor_router[attach[server][0]]
        ports.append(server_port(topology, server, i, attach, scale, namespace=f"{PREFIX}{tag}-s{i}",
                                 bridge=router.bridge, switch_namespace=router.namespace, address_bits=32))  # fmt: skip
    routes = plan_routes(routers, links, [(p.namespace, p.ip, attach[p.server][0]) for p in ports])
    spines = sum(r.role == "spine" for r in routers)
    note = (
        f"routed leaf-spine: {len(tor_router)} ToR and {spines} spine routers, {len(links)} ToR-spine links each "
        f"shaped on its own, per-flow ECMP (L4 hash) over the spines"
    )
    bridges = {r.bridge: r.switch for r in tor_router.values()}
    return EmulationPlan(
        topology=topology.name, tag=tag, scale=scale, fabric=None, bridges=bridges,
        servers=ports, switch_links=[], notes=[note], fabric_kind="routed", routers=routers, router_links=links,
        routes=routes,
    )  # fmt: skip


def plan_fabric(
    topology: Topology, graph: nx.Graph, tors: list[str], bits: float, tag: str
) -> tuple[list[Router], list[RouterLink]]:
    """The routers and ToR-spine links of ``topology``'s leaf-spine switch ``graph`` (``bits``: bit/s per
    topology byte/s). Raises ``ValueError`` if the switches are not two tiers (ToRs below, spines above)."""
    if any(not ((a in tors) ^ (b in tors)) for a, b in graph.edges):
        raise ValueError(
            f"topology {topology.name!r}: the routed fabric needs a two-tier leaf-spine (every switch link "
            f"joins a ToR to a spine); some link joins two ToRs or two upper switches"
        )
    spines = [s for s in graph.nodes if s not in tors]
    if len(tors) > _MAX_TORS or len(spines) > _MAX_SPINES:
        raise ValueError(
            f"the routed fabric addresses at most {_MAX_TORS} ToRs and {_MAX_SPINES} spines, got {len(tors)} "
            f"and {len(spines)}"
        )
    routers = [
        Router(switch=tor, namespace=f"{PREFIX}{tag}-t{i}", role="tor", bridge=tor_bridge(i), gateway=gateway_ip(i))
        for i, tor in enumerate(tors)
    ]
    routers += [Router(switch=s, namespace=f"{PREFIX}{tag}-p{k}", role="spine") for k, s in enumerate(spines)]
    links = []
    for i, tor in enumerate(tors):
        for k, spine in enumerate(spines):
            if not graph.has_edge(tor, spine):
                continue
            tor_ip, spine_ip = _link_ips(i, k)
            links.append(
                RouterLink(
                    tor=tor, spine=spine, tor_namespace=routers[i].namespace,
                    spine_namespace=routers[len(tors) + k].namespace, tor_end=f"{PREFIX}u{k}",
                    spine_end=f"{PREFIX}d{i}", tor_ip=tor_ip, spine_ip=spine_ip,
                    up_bit_per_s=bits * topology.link(tor, spine).bytes_per_s,
                    down_bit_per_s=bits * topology.link(spine, tor).bytes_per_s,
                )
            )  # fmt: skip
    return routers, links


def plan_routes(routers: list[Router], links: list[RouterLink], servers: list[tuple[str, str, str]]) -> list[Route]:
    """Every route of the fabric. ``servers``: (namespace, address, ToR switch) per placed server, in rank order.
    Raises ``ValueError`` naming two ToRs that share no spine (a server of one could not reach the other)."""
    tor_of = {r.switch: r for r in routers if r.role == "tor"}
    spine_of = {r.switch: r for r in routers if r.role == "spine"}
    by_pair = {(x.tor, x.spine): x for x in links}
    routes = []
    for namespace, address, tor in servers:
        gateway = tor_of[tor].gateway
        routes.append(Route(namespace=namespace, prefix=f"{gateway}/32", nexthops=(Nexthop(SERVER_INTERFACE),)))
        routes += [Route(namespace=namespace, prefix=f"{peer}/32", nexthops=(Nexthop(SERVER_INTERFACE),))
                   for _, peer, peer_tor in servers if peer_tor == tor and peer != address]  # fmt: skip
        routes.append(Route(namespace=namespace, prefix=SERVER_NETWORK, nexthops=(Nexthop(SERVER_INTERFACE, gateway),)))
    for router in tor_of.values():
        for _, address, tor in servers:
            if tor == router.switch:
                hops: tuple[Nexthop, ...] = (Nexthop(router.bridge),)
            else:
                shared = [s for s in spine_of if (router.switch, s) in by_pair and (tor, s) in by_pair]
                if not shared:
                    raise ValueError(f"ToRs {router.switch!r} and {tor!r} share no spine: no two-hop route between")
                hops = tuple(Nexthop(by_pair[router.switch, s].tor_end, by_pair[router.switch, s].spine_ip)
                             for s in shared)  # fmt: skip
            routes.append(Route(namespace=router.namespace, prefix=f"{address}/32", nexthops=hops))
    for router in spine_of.values():
        for _, address, tor in servers:
            link = by_pair.get((tor, router.switch))
            if link is not None:
                routes.append(Route(namespace=router.namespace, prefix=f"{address}/32",
                                    nexthops=(Nexthop(link.spine_end, link.tor_ip),)))  # fmt: skip
    return routes
