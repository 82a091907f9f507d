"""dtrain.cluster.topology: building, reading, routing (fewest hops, latency, ECMP) and validation."""

from __future__ import annotations

import pytest

from dtrain.cluster.topology import Device, Link, Topology

GB = 1e9


def gpu(name: str, server: str, rack: str | None = None) -> Device:
    return Device(name=name, server=server, rack=rack, peak_flops=1e15, memory_bytes=80 << 30, memory_bytes_per_s=3e12)


def leaf_spine(spines: int = 2) -> Topology:
    """Two servers of one GPU, each under its own leaf, leaves joined by ``spines`` spines."""
    topo = Topology("leaf-spine")
    for s in range(2):
        topo.add_device(gpu(f"s{s}/gpu0", f"s{s}", f"r{s}"))
        topo.add_node(f"leaf{s}", kind="switch", rack=f"r{s}", layer="tor")
        topo.add_link(f"s{s}/gpu0", f"leaf{s}", bytes_per_s=25 * GB, latency_s=1e-6, kind="ethernet200")
    for p in range(spines):
        topo.add_node(f"spine{p}", kind="switch", layer="spine")
        for s in range(2):
            topo.add_link(f"leaf{s}", f"spine{p}", bytes_per_s=50 * GB, latency_s=1e-6, kind="ethernet400")
    return topo


def test_duplex_link_adds_both_directions_at_full_rate() -> None:
    topo = Topology()
    topo.add_device(gpu("a", "s0"))
    topo.add_device(gpu("b", "s0"))
    topo.add_link("a", "b", bytes_per_s=10 * GB, latency_s=2e-6, kind="nvlink4")
    assert topo.link("a", "b").bytes_per_s == topo.link("b", "a").bytes_per_s == 10 * GB
    assert {link.name for link in topo.links()} == {"a->b", "b->a"}


def test_simplex_link_goes_one_way_only() -> None:
    topo = Topology()
    topo.add_node("a", kind="host")
    topo.add_node("b", kind="host")
    topo.add_link("a", "b", bytes_per_s=GB, latency_s=0, kind="pcie4x16", duplex=False)
    with pytest.raises(ValueError, match="no link b->a"):
        topo.link("b", "a")


def test_devices_are_in_placement_order_server_by_server_then_index() -> None:
    topo = Topology()
    for name, server in [("s1/gpu10", "s1"), ("s0/gpu1", "s0"), ("s1/gpu2", "s1"), ("s0/gpu0", "s0")]:
        topo.add_device(gpu(name, server))
    assert [d.name for d in topo.devices()] == ["s1/gpu2", "s1/gpu10", "s0/gpu0", "s0/gpu1"]
    assert topo.servers() == ["s1", "s0"]


def test_racks_and_switches_are_listed() -> None:
    topo = leaf_spine()
    assert topo.racks() == ["r0", "r1"]
    assert topo.switches() == ["leaf0", "leaf1", "spine0", "spine1"]


def test_route_to_self_is_empty() -> None:
    assert leaf_spine().route("s0/gpu0", "s0/gpu0") == []


def test_route_takes_fewest_hops() -> None:
    topo = Topology()
    for n in "abc":
        topo.add_node(n, kind="switch")
    topo.add_link("a", "b", bytes_per_s=GB, latency_s=1e-6, kind="x")
    topo.add_link("b", "c", bytes_per_s=GB, latency_s=1e-6, kind="x")
    topo.add_link("a", "c", bytes_per_s=GB, latency_s=1.0, kind="x")  # slow but one hop
    assert [link.name for link in topo.route("a", "c")] == ["a->c"]


def test_route_breaks_hop_ties_by_latency() -> None:
    topo = Topology()
    for n in ["a", "fast", "slow", "z"]:
        topo.add_node(n, kind="switch")
    topo.add_link("a", "slow", bytes_per_s=GB, latency_s=5e-6, kind="x")
    topo.add_link("slow", "z", bytes_per_s=GB, latency_s=5e-6, kind="x")
    topo.add_link("a", "fast", bytes_per_s=GB, latency_s=1e-6, kind="x")
    topo.add_link("fast", "z", bytes_per_s=GB, latency_s=1e-6, kind="x")
    for flow in range(20):
        assert [link.dst for link in topo.route("a", "z", flow)] == ["fast", "z"]


def test_route_is_deterministic_per_flow() -> None:
    topo = leaf_spine(spines=4)
    assert all(topo.route("s0/gpu0", "s1/gpu0", f) == topo.route("s0/gpu0", "s1/gpu0", f) for f in range(50))


def test_ecmp_spreads_flows_over_every_spine() -> None:
    topo = leaf_spine(spines=4)
    used = {topo.route("s0/gpu0", "s1/gpu0", flow)[1].dst for flow in range(64)}
    assert used == {"spine0", "spine1", "spine2", "spine3"}
    assert len(topo.equal_cost_paths("s0/gpu0", "s1/gpu0")) == 4


def test_route_links_chain_from_src_to_dst() -> None:
    path = leaf_spine().route("s0/gpu0", "s1/gpu0", flow=3)
    assert path[0].src == "s0/gpu0" and path[-1].dst == "s1/gpu0"
    assert all(a.dst == b.src for a, b in zip(path, path[1:], strict=False))
    assert all(isinstance(link, Link) for link in path)


def test_unreachable_route_names_both_nodes() -> None:
    topo = Topology()
    topo.add_node("a", kind="host")
    topo.add_node("b", kind="host")
    with pytest.raises(ValueError, match="'a'.*'b'"):
        topo.route("a", "b")


def test_route_cache_is_dropped_when_a_link_is_added() -> None:
    topo = Topology()
    for n in "abc":
        topo.add_node(n, kind="switch")
    topo.add_link("a", "b", bytes_per_s=GB, latency_s=0, kind="x")
    topo.add_link("b", "c", bytes_per_s=GB, latency_s=0, kind="x")
    assert len(topo.route("a", "c")) == 2
    topo.add_link("a", "c", bytes_per_s=GB, latency_s=0, kind="x")
    assert len(topo.route("a", "c")) == 1


def test_duplicate_node_name_is_rejected() -> None:
    topo = Topology()
    topo.add_device(gpu("s0/gpu0", "s0"))
    with pytest.raises(ValueError, match="duplicate node name 's0/gpu0'"):
        topo.add_node("s0/gpu0", kind="nic")


def test_unknown_node_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown kind 'router'"):
        Topology().add_node("x", kind="router")


def test_link_to_unknown_endpoint_is_rejected() -> None:
    topo = Topology()
    topo.add_node("a", kind="host")
    with pytest.raises(ValueError, match="unknown node 'ghost'"):
        topo.add_link("a", "ghost", bytes_per_s=GB, latency_s=0, kind="x")


def test_duplicate_link_is_rejected() -> None:
    topo = Topology()
    topo.add_node("a", kind="host")
    topo.add_node("b", kind="host")
    topo.add_link("a", "b", bytes_per_s=GB, latency_s=0, kind="x")
    with pytest.raises(ValueError, match="duplicate link a->b"):
        topo.add_link("a", "b", bytes_per_s=GB, latency_s=0, kind="x")


@pytest.mark.parametrize(
    ("rate", "latency", "message"), [(0, 0, "bytes_per_s"), (-1, 0, "bytes_per_s"), (1, -1, "latency_s")]
)
def test_bad_link_figures_are_rejected(rate: float, latency: float, message: str) -> None:
    topo = Topology()
    topo.add_node("a", kind="host")
    topo.add_node("b", kind="host")
    with pytest.raises(ValueError, match=message):
        topo.add_link("a", "b", bytes_per_s=rate, latency_s=latency, kind="x")


def test_bad_device_figures_are_rejected() -> None:
    with pytest.raises(ValueError, match="peak_flops"):
        Device(name="g", server="s", peak_flops=0, memory_bytes=1, memory_bytes_per_s=1)


def test_validate_accepts_a_connected_topology() -> None:
    leaf_spine().validate()


def test_validate_names_a_disconnected_device() -> None:
    topo = leaf_spine()
    topo.add_device(gpu("s9/gpu0", "s9"))
    with pytest.raises(ValueError, match="s9/gpu0"):
        topo.validate()


def test_validate_names_a_one_way_device() -> None:
    topo = leaf_spine()
    topo.add_device(gpu("s9/gpu0", "s9"))
    topo.add_link("s9/gpu0", "leaf0", bytes_per_s=GB, latency_s=0, kind="x", duplex=False)
    with pytest.raises(ValueError, match="s9/gpu0"):
        topo.validate()


def test_validate_names_a_link_edited_behind_its_back() -> None:
    topo = leaf_spine()
    topo.graph.add_edge("leaf0", "ghost")
    with pytest.raises(ValueError, match="leaf0->ghost"):
        topo.validate()
