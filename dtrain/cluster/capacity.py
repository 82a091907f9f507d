"""Capacities read back from a built topology: a switch's downlink and uplink, and their ratio.

Oversubscription (Al-Fares et al., "A Scalable, Commodity Data Center Network Architecture", SIGCOMM 2008): two
servers each sending at 10 Gb/s through one ToR whose single uplink carries 10 Gb/s need twice what the uplink
gives (1:2); the paper reports typical designs at 2.5:1 to 8:1. Reading the ratio off
the graph (rather than the builder's arguments) checks the builders and works for hand-written topology files.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.cluster.topology import Topology

__all__ = ["LAYERS", "SwitchCapacity", "switch_capacity", "oversubscription"]

#: Switch tiers from the bottom up; a neighbour on a higher tier is an uplink.
LAYERS = ("tor", "leaf", "spine", "aggregation", "core")


@dataclass(frozen=True, kw_only=True)
class SwitchCapacity:
    """One direction of all of a switch's links down (to servers or lower tiers) and up."""

    switch: str
    down_bytes_per_s: float
    up_bytes_per_s: float
    servers: int = 0  # distinct servers directly below

    @property
    def server_share_bytes_per_s(self) -> float:
        """What each server below can send up at once when all of them do (equal servers, fair sharing):
        its own rate, or its share of the uplinks when they are oversubscribed."""
        if not self.servers:
            raise ValueError(f"switch {self.switch!r} has no servers directly below it")
        return min(self.down_bytes_per_s, self.up_bytes_per_s) / self.servers

    @property
    def oversubscription(self) -> float:
        """Downlink over uplink capacity (4.0 is 1:4); infinite for a switch with no uplink."""
        return self.down_bytes_per_s / self.up_bytes_per_s if self.up_bytes_per_s else float("inf")


def _tier(topology: Topology, node: str) -> int:
    layer = topology.graph.nodes[node].get("layer")
    return LAYERS.index(layer) if layer in LAYERS else -1


def switch_capacity(topology: Topology, switch: str) -> SwitchCapacity:
    """Sum the rates of ``switch``'s outgoing links, split by whether they go up a tier or down."""
    if switch not in topology.graph or topology.graph.nodes[switch].get("layer") not in LAYERS:
        raise ValueError(f"{switch!r} is not a switch with a layer in {LAYERS} in topology {topology.name!r}")
    tier = _tier(topology, switch)
    down = up = 0.0
    servers = set()
    for _, neighbour, link in topology.graph.out_edges(switch, data="link"):
        if _tier(topology, neighbour) > tier:
            up += link.bytes_per_s
        else:
            down += link.bytes_per_s
            servers.add(topology.graph.nodes[neighbour].get("server"))
    servers.discard(None)
    return SwitchCapacity(switch=switch, down_bytes_per_s=down, up_bytes_per_s=up, servers=len(servers))


def oversubscription(topology: Topology, switch: str) -> float:
    """``switch``'s downlink:uplink ratio as one number (4.0 for 1:4)."""
    return switch_capacity(topology, switch).oversubscription
