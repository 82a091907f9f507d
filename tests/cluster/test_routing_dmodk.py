"""Destination-mod-k fabric routing (dtrain.cluster.routing.destination_routed, Topology.routing)."""

import pytest

from dtrain.cluster.builders import ClusterSpec
from dtrain.cluster.presets import H100_NODE, preset
from dtrain.cluster.topology import Topology
from dtrain.sim.flows import FlowSpec, simulate_flows


def _spine(topology: Topology, src: str, dst: str, flow: int = 0) -> str:
    return next(link.dst for link in topology.route(src, dst, flow) if "spine" in link.dst)


def test_d_mod_k_sends_every_flow_to_a_port_over_one_spine_and_port_j_over_spine_j_mod_k() -> None:
    topology = preset("h100-rail", racks=2, servers_per_rack=32)  # 16 spines, d-mod-k
    assert topology.routing == "d-mod-k"
    for j in range(32):
        dst = f"s{32 + j}/gpu3"
        spines = {_spine(topology, f"s{src}/gpu3", dst, flow) for src in (0, 5, 31) for flow in range(4)}
        assert spines == {f"spine{j % 16}"}
        assert len(topology.equal_cost_routes("s0/gpu3", dst)) == 1
    ecmp = preset("h100-rail", racks=2, servers_per_rack=32, routing="ecmp")
    assert len({_spine(ecmp, "s0/gpu3", "s40/gpu3", flow) for flow in range(32)}) > 1


def test_d_mod_k_spreads_a_shift_over_the_uplinks_where_hashing_collides() -> None:
    # every server of unit 0 sends to its counterpart in unit 1 on rail 0: a shift, which d-mod-k routes
    # congestion-free (each leaf-spine link carries its share) and a per-flow hash does not
    times = {}
    for routing in ("d-mod-k", "ecmp"):
        topology = preset("h100-rail", racks=2, servers_per_rack=16, spines=16, routing=routing)
        flows = [FlowSpec(src=f"s{s}/gpu0", dst=f"s{16 + s}/gpu0", nbytes=2**26) for s in range(16)]
        times[routing] = max(simulate_flows(topology, flows)[0])
    alone = preset("h100-rail", racks=2, servers_per_rack=16, spines=16)
    single = simulate_flows(alone, [FlowSpec(src="s0/gpu0", dst="s16/gpu0", nbytes=2**26)])[0][0]
    assert times["d-mod-k"] == pytest.approx(single, rel=1e-6)
    assert times["ecmp"] > 1.2 * single


def test_d_mod_k_in_three_tiers_picks_the_core_by_the_next_digit() -> None:
    topology = preset("dgx-a100-superpod")  # 20 servers a unit, 8 spines a pod, 2 cores a spine
    cores = {}
    for j in range(20):
        path = [link.dst for link in topology.route("s0/gpu3", f"s{40 + j}/gpu3")]
        cores[j] = next(n for n in path if n.startswith("core"))
        assert f"p0/spine{j % 8}" in path
    assert cores[0] != cores[8] and cores[0] == cores[16]


def test_routing_is_checked() -> None:
    with pytest.raises(ValueError, match="routing"):
        ClusterSpec(server=H100_NODE, routing="adaptive")
    with pytest.raises(ValueError, match="routing"):
        Topology().routing = "random"
