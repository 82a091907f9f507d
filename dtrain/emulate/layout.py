"""The data of an emulation plan: names, addresses, a server's port, bridge and router links, routes.

:mod:`dtrain.emulate.plan` (bridged fabrics, and the entry point) and :mod:`dtrain.emulate.routed` (the routed
leaf-spine) both build an :class:`EmulationPlan` out of these; :mod:`dtrain.emulate.build` carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.cluster.topology import Topology

__all__ = [
    "PREFIX", "MIN_BIT_PER_S", "MAX_BIT_PER_S", "MAX_SERVERS", "SPINE_BRIDGE", "SERVER_INTERFACE", "FABRICS",
    "ROUTER_SYSCTLS", "SERVER_NETWORK", "server_ip", "server_port", "ServerPort", "SwitchLink", "Router", "RouterLink",
    "Nexthop", "Route", "EmulationPlan",
]  # fmt: skip

#: Every namespace and interface the emulator creates starts with this; ``dtrain emulate down`` removes them.
PREFIX = "dte-"
#: The lowest rate tc can hold steadily with the burst sizes used here (bits per second).
MIN_BIT_PER_S = 100_000.0
#: The highest: tbf's bucket (4 ms of traffic) and queue are 32-bit byte counts; past about 2.4 Tbit/s tc sets a
#: queue other than the one asked for, past 8.6 Tbit/s it refuses the bucket.
MAX_BIT_PER_S = 1e12
#: Servers that get an address (:func:`server_ip`).
MAX_SERVERS = 15_600
SPINE_BRIDGE = "spines"
#: The interface every server namespace talks through (GLOO_SOCKET_IFNAME).
SERVER_INTERFACE = f"{PREFIX}eth"
#: How switches are emulated: ``bridged`` (the default; spines merged into one bridge) or ``routed`` (routers
#: with per-flow ECMP over every spine).
FABRICS = ("bridged", "routed")


def server_ip(index: int) -> str:
    """The address of the ``index``-th server (in rank order). Every octet has three digits, so the string
    order of the addresses is the rank order: torch's c10d rendezvous numbers the nodes by sorting their
    addresses as strings (``dynamic_rendezvous._assign_ranks``), and this keeps its numbering ours."""
    if not 0 <= index < MAX_SERVERS:
        raise ValueError(f"server index must be in [0, {MAX_SERVERS}), got {index}")
    return f"10.177.{100 + index // 100}.{100 + index % 100}"


@dataclass(frozen=True, kw_only=True)
class ServerPort:
    """One server: its namespace, its interface's address, the bridge it plugs into and its rates (bit/s)."""

    server: str
    namespace: str
    ip: str
    bridge: str
    switch_namespace: str  # the namespace holding ``bridge`` and ``port``: the fabric, or the server's ToR
    address_bits: int = 16  # prefix length of ``ip``: one subnet when bridged, a /32 behind its ToR when routed
    up_bit_per_s: float  # server -> switch
    down_bit_per_s: float  # switch -> server
    port: str  # the fabric-side veth end
    devices: int  # accelerators the topology gives this server


@dataclass(frozen=True, kw_only=True)
class SwitchLink:
    """A veth pair between bridges ``a`` and ``b``; ``a_to_b_bit_per_s`` limits the ``a`` end's egress."""

    a: str
    b: str
    a_end: str
    b_end: str
    a_to_b_bit_per_s: float
    b_to_a_bit_per_s: float


@dataclass(frozen=True, kw_only=True)
class EmulationPlan:
    """Everything :func:`dtrain.emulate.build.build` creates, named, with the scale that produced it."""

    topology: str
    tag: str
    scale: float
    fabric: str | None  # the namespace holding every bridge (None when routed: each ToR holds its own)
    bridges: dict[str, str]  # bridge interface name -> the switch(es) it emulates
    servers: list[ServerPort]
    switch_links: list[SwitchLink]
    spines_merged: bool = False
    notes: list[str] = field(default_factory=list)
    fabric_kind: str = "bridged"  # one of FABRICS
    routers: list[Router] = field(default_factory=list)  # routed only: ToRs and spines
    router_links: list[RouterLink] = field(default_factory=list)  # routed only: every ToR-spine link
    routes: list[Route] = field(default_factory=list)  # routed only: every route, servers' and routers'

    @property
    def namespaces(self) -> list[str]:
        """Routers (or the fabric) first, servers last: the teardown goes in reverse."""
        switches = [self.fabric] if self.fabric else [r.namespace for r in self.routers]
        return [*switches, *(s.namespace for s in self.servers)]

    def describe(self) -> dict:
        """A JSON-ready summary (rates in Mbit/s), written beside every emulated run."""
        return {
            "topology": self.topology,
            "tag": self.tag,
            "scale": self.scale,
            "fabric": self.fabric_kind,
            "spines_merged": self.spines_merged,
            "servers": [
                {"server": s.server, "namespace": s.namespace, "ip": s.ip, "bridge": s.bridge,
                 "up_mbit_per_s": s.up_bit_per_s / 1e6, "down_mbit_per_s": s.down_bit_per_s / 1e6}
                for s in self.servers
            ],
            "switch_links": [
                {"a": link.a, "b": link.b, "a_to_b_mbit_per_s": link.a_to_b_bit_per_s / 1e6,
                 "b_to_a_mbit_per_s": link.b_to_a_bit_per_s / 1e6}
                for link in self.switch_links
            ],
            **(_describe_routers(self) if self.fabric_kind == "routed" else {}),
            "notes": self.notes,
        }  # fmt: skip


def _describe_routers(plan: EmulationPlan) -> dict:
    return {
        "routers": {r.namespace: r.switch for r in plan.routers},
        "router_links": [
            {"tor": x.tor, "spine": x.spine, "up_mbit_per_s": x.up_bit_per_s / 1e6,
             "down_mbit_per_s": x.down_bit_per_s / 1e6}
            for x in plan.router_links
        ],
        "routes": [f"{r.namespace}: {' '.join(r.ip_args())}" for r in plan.routes],
    }  # fmt: skip


#: Every router namespace gets these (:mod:`dtrain.emulate.routed` says why each).
ROUTER_SYSCTLS = {
    "net.ipv4.ip_forward": "1",
    "net.ipv4.fib_multipath_hash_policy": "1",
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
}
#: Every server address (:func:`server_ip`) is inside this.
SERVER_NETWORK = "10.177.0.0/16"


@dataclass(frozen=True, kw_only=True)
class Router:
    """A ToR or spine switch as a router namespace; a ToR also has the bridge its servers plug into."""

    switch: str
    namespace: str
    role: str  # "tor" or "spine"
    bridge: str | None = None
    gateway: str | None = None  # the ToR's address on its bridge

    @property
    def sysctls(self) -> dict[str, str]:
        return dict(ROUTER_SYSCTLS)


@dataclass(frozen=True, kw_only=True)
class RouterLink:
    """One ToR-spine cable: a veth pair on a /31, each end shaped at its own direction's rate."""

    tor: str
    spine: str
    tor_namespace: str
    spine_namespace: str
    tor_end: str
    spine_end: str
    tor_ip: str
    spine_ip: str
    up_bit_per_s: float  # ToR -> spine
    down_bit_per_s: float  # spine -> ToR


@dataclass(frozen=True)
class Nexthop:
    """Where a route sends: out of ``dev``, to the router ``via`` (None: the destination is on that link)."""

    dev: str
    via: str | None = None


@dataclass(frozen=True, kw_only=True)
class Route:
    """``ip route add`` of ``prefix`` in ``namespace``; several nexthops make it an ECMP route."""

    namespace: str
    prefix: str
    nexthops: tuple[Nexthop, ...]

    def ip_args(self) -> list[str]:
        """The words after ``ip route add`` (ip-route(8): ``nexthop via A dev X`` once per path)."""
        if len(self.nexthops) == 1:
            (hop,) = self.nexthops
            return [self.prefix, *(["via", hop.via] if hop.via else []), "dev", hop.dev]
        words = [self.prefix]
        for hop in self.nexthops:
            words += ["nexthop", *(["via", hop.via] if hop.via else []), "dev", hop.dev]
        return words


def server_port(topology: Topology, server: str, i: int, attach: dict, scale: float, **where) -> ServerPort:
    """The ``i``-th server's port: its address, scaled rates and devices (``attach``: server -> (ToR, up, down
    bytes/s, devices)); ``where`` names its namespace, bridge and the namespace that holds that bridge."""
    _, up, down, devices = attach[server]
    return ServerPort(
        server=server, ip=server_ip(i), up_bit_per_s=up * 8 * scale, down_bit_per_s=down * 8 * scale,
        port=f"{PREFIX}h{i}", devices=devices, **where,
    )  # fmt: skip
