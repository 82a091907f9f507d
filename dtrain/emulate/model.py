"""The network an emulation really builds, as a :class:`~dtrain.cluster.topology.Topology` for the simulator.

Comparing the simulator with an emulated run is only fair on the same network, so this returns the topology
the plan built rather than the one asked for:

- every link that touches a network switch runs at ``scale`` times its rate, times the share of a shaped
  byte that is payload: tc counts whole Ethernet frames, and a full 1514-byte frame carries 1448 bytes of
  TCP payload (20 IP + 32 TCP with timestamps + 14 Ethernet bytes of headers), measured here as 47.8 Mb/s
  of goodput through a 50 Mb/s shaper, 1448/1514 of it;
- with its spines merged (:mod:`dtrain.emulate.plan`), one switch ``spines`` whose link to each ToR has the
  sum of that ToR's spine links, so the simulator sprays cross-rack flows as the emulated bridge does;
- on a routed fabric (:mod:`dtrain.emulate.routed`), every spine and ToR-spine link as it is, so the simulator
  hashes each flow onto one spine (``Topology.route``) as the emulated ToRs do;
- links inside a server are kept: inside a namespace ranks meet over loopback, far faster than the shaped
  links, as NVLink and PCIe are faster than the NICs.
"""

from __future__ import annotations

from dtrain.cluster.topology import Topology
from dtrain.emulate.plan import SPINE_BRIDGE, EmulationPlan

__all__ = ["PAYLOAD_FRACTION", "emulated_topology"]

#: TCP payload bytes per shaped (Ethernet frame) byte on a 1500-byte MTU with TCP timestamps.
PAYLOAD_FRACTION = 1448 / 1514


def emulated_topology(topology: Topology, plan: EmulationPlan) -> Topology:
    """``topology`` as ``plan`` emulates it (see the module docstring); devices and names unchanged."""
    graph = topology.graph
    network = {n for n, a in graph.nodes(data=True) if a["kind"] == "switch" and a.get("server") is None}
    merged = _merged_spines(topology, network) if plan.spines_merged else set()
    out = Topology(f"{topology.name}@emulated-x{plan.scale:g}")
    devices = {d.name: d for d in topology.devices()}
    for name, attrs in graph.nodes(data=True):
        if name in merged:
            continue
        if name in devices:
            out.add_device(devices[name])
        else:
            out.add_node(name, kind=attrs["kind"], server=attrs.get("server"), rack=attrs.get("rack"),
                         layer=attrs.get("layer"))  # fmt: skip
    if merged:
        out.add_node(SPINE_BRIDGE, kind="switch", layer="spine")
    factor = plan.scale * PAYLOAD_FRACTION
    summed: dict[tuple[str, str], float] = {}
    for link in topology.links():
        src, dst = (SPINE_BRIDGE if n in merged else n for n in (link.src, link.dst))
        rate = link.bytes_per_s * (factor if {link.src, link.dst} & network else 1.0)
        if {link.src, link.dst} & merged:
            summed[src, dst] = summed.get((src, dst), 0.0) + rate
            continue
        out.add_link(src, dst, bytes_per_s=rate, latency_s=link.latency_s, kind=link.kind, duplex=False)
    for (src, dst), rate in summed.items():
        out.add_link(src, dst, bytes_per_s=rate, latency_s=0.0, kind="emulated-spine", duplex=False)
    out.validate()
    return out


def _merged_spines(topology: Topology, network: set[str]) -> set[str]:
    """The switches the plan folded into one bridge: network switches with no server below them."""
    graph = topology.graph
    tors = {v for u, v in graph.edges() if v in network and graph.nodes[u].get("server") is not None}
    return network - tors
