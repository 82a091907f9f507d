"""Which server gets which node rank, and how many ranks share a rack, for an emulated run.

Placement is what the issue's comparison turns on: ``packed`` keeps each rack's servers next to each other
in rank order (so a ring crosses the spine once per rack, and a rack-level hierarchical all-reduce keeps the
heavy traffic under the ToRs); ``interleaved`` deals servers out rack by rack, as a scheduler that ignores
the topology would, so every hop of a ring crosses the oversubscribed spine.
"""

from __future__ import annotations

from dtrain.cluster.topology import Topology
from dtrain.emulate.plan import EmulationPlan

__all__ = ["placement_order", "server_rack", "ranks_per_rack"]


def placement_order(topology: Topology, how: str) -> list[str]:
    """Servers in node-rank order: ``"packed"`` (rack by rack, the topology's order), ``"interleaved"`` (one
    server of each rack in turn: a topology-oblivious order whose ring crosses the spine at every hop) or an
    explicit comma-separated list of server names."""
    servers = topology.servers()
    if how == "packed":
        return servers
    if how == "interleaved":
        rack_of: dict[str, str | None] = {}
        for _, attrs in topology.graph.nodes(data=True):  # one pass, not one per server
            if attrs.get("server") is not None:
                rack_of.setdefault(attrs["server"], attrs.get("rack"))
        racks: dict[str | None, list[str]] = {}
        for server in servers:
            racks.setdefault(rack_of[server], []).append(server)
        columns = list(racks.values())
        return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]
    listed = [s.strip() for s in how.split(",") if s.strip()]
    if sorted(listed) != sorted(servers):
        raise ValueError(f"placement must be packed, interleaved or every server once ({servers}), got {how!r}")
    return listed


def server_rack(topology: Topology, server: str) -> str | None:
    """The rack of ``server`` (from any of its nodes)."""
    return next((a.get("rack") for _, a in topology.graph.nodes(data=True) if a.get("server") == server), None)


def ranks_per_rack(plan: EmulationPlan, procs_per_server: int) -> int:
    """Ranks under one ToR when the placement keeps each rack's servers together (hierarchy level "rack")."""
    bridges = [s.bridge for s in plan.servers]
    blocks = [bridges[0]]
    for bridge in bridges[1:]:
        if bridge != blocks[-1]:
            blocks.append(bridge)
    sizes = {bridges.count(b) for b in blocks}
    if len(blocks) != len(set(blocks)) or len(sizes) != 1:
        raise ValueError(
            f"a rack-level hierarchy needs each rack's servers next to each other and racks of equal size; the "
            f"placement gives ToRs {bridges} (use --placement packed)"
        )
    return sizes.pop() * procs_per_server
