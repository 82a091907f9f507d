"""The routed leaf-spine plan (``fabric="routed"``): which routers, links, rates and routes it builds, and the
network the simulator is given for it; pure data, no root needed."""

from __future__ import annotations

import pytest

from dtrain.cluster.presets import preset
from dtrain.emulate.model import emulated_topology
from dtrain.emulate.placement import placement_order, ranks_per_rack
from dtrain.emulate.plan import path_bit_per_s, plan_emulation
from dtrain.emulate.routed import Nexthop, Route
from dtrain.sim.flows import max_min_rates
from tests.emulate.test_emulate_plan import _tree


def _leaf_spine(oversubscription: float = 4, spines: int = 2):
    # 2 racks x 2 servers, 100 Gb/s NICs: each ToR has 200 / oversubscription Gb/s up, split over the spines.
    return preset("4-rack", racks=2, servers_per_rack=2, gpus=1, nics=1, nic="ethernet100",
                  oversubscription=oversubscription, spines=spines)  # fmt: skip


def _routed(oversubscription: float = 4, **kwargs):
    return plan_emulation(_leaf_spine(oversubscription), scale=1e-3, tag="t", fabric="routed", **kwargs)


def _routes(plan, namespace: str) -> dict[str, tuple[Nexthop, ...]]:
    return {r.prefix: r.nexthops for r in plan.routes if r.namespace == namespace}


def test_every_tor_and_spine_is_a_router_namespace_and_there_is_no_fabric():
    plan = _routed()
    assert plan.fabric is None and plan.fabric_kind == "routed" and not plan.spines_merged
    assert [(r.namespace, r.switch, r.role) for r in plan.routers] == [
        ("dte-t-t0", "r0/tor", "tor"), ("dte-t-t1", "r1/tor", "tor"),
        ("dte-t-p0", "spine0", "spine"), ("dte-t-p1", "spine1", "spine"),
    ]  # fmt: skip
    assert plan.namespaces == ["dte-t-t0", "dte-t-t1", "dte-t-p0", "dte-t-p1", *(f"dte-t-s{i}" for i in range(4))]


def test_routers_forward_and_hash_each_tcp_connection_as_one_flow():
    for router in _routed().routers:
        assert router.sysctls["net.ipv4.ip_forward"] == "1"
        assert router.sysctls["net.ipv4.fib_multipath_hash_policy"] == "1"
        assert router.sysctls["net.ipv4.conf.all.rp_filter"] == "0"  # replies may come back over another spine


def test_every_tor_spine_link_is_its_own_veth_at_its_own_scaled_rate():
    # 1:4: each ToR has 50 Mb/s up in all (at 1e-3), 25 Mb/s to each of its 2 spines, not one summed 50 Mb/s veth.
    plan = _routed(oversubscription=4)
    assert [(x.tor, x.spine) for x in plan.router_links] == [
        ("r0/tor", "spine0"), ("r0/tor", "spine1"), ("r1/tor", "spine0"), ("r1/tor", "spine1")
    ]  # fmt: skip
    for link in plan.router_links:  # element-wise: pytest.approx takes flat sequences only
        assert link.up_bit_per_s == pytest.approx(25e6) and link.down_bit_per_s == pytest.approx(25e6)
    assert [(x.tor_end, x.spine_end) for x in plan.router_links] == [
        ("dte-u0", "dte-d0"), ("dte-u1", "dte-d0"), ("dte-u0", "dte-d1"), ("dte-u1", "dte-d1")
    ]  # fmt: skip


def test_servers_sit_behind_their_tor_on_its_bridge_with_their_rank_ordered_addresses():
    plan = _routed()
    assert [(s.namespace, s.switch_namespace, s.bridge) for s in plan.servers] == [
        ("dte-t-s0", "dte-t-t0", "dte-br0"), ("dte-t-s1", "dte-t-t0", "dte-br0"),
        ("dte-t-s2", "dte-t-t1", "dte-br1"), ("dte-t-s3", "dte-t-t1", "dte-br1"),
    ]  # fmt: skip
    assert [s.address_bits for s in plan.servers] == [32] * 4
    assert [s.up_bit_per_s for s in plan.servers] == pytest.approx([100e6] * 4)
    assert sorted(s.ip for s in plan.servers) == [s.ip for s in plan.servers]


def test_a_tor_has_one_ecmp_route_per_remote_server_with_a_nexthop_per_spine():
    plan = _routed()
    tor0 = _routes(plan, "dte-t-t0")
    assert tor0["10.177.100.102/32"] == (Nexthop("dte-u0", "10.178.0.3"), Nexthop("dte-u1", "10.178.0.5"))
    assert tor0["10.177.100.103/32"] == tor0["10.177.100.102/32"]
    assert tor0["10.177.100.100/32"] == (Nexthop("dte-br0"),)  # its own rack: on the bridge


def test_a_spine_routes_each_server_to_its_tor():
    spine1 = _routes(_routed(), "dte-t-p1")
    assert spine1["10.177.100.100/32"] == (Nexthop("dte-d0", "10.178.0.4"),)
    assert spine1["10.177.100.103/32"] == (Nexthop("dte-d1", "10.178.1.4"),)


def test_a_server_reaches_its_rack_on_the_bridge_and_the_rest_through_its_tor():
    server0 = _routes(_routed(), "dte-t-s0")
    assert server0 == {
        "10.178.0.1/32": (Nexthop("dte-eth"),),
        "10.177.100.101/32": (Nexthop("dte-eth"),),
        "10.177.0.0/16": (Nexthop("dte-eth", "10.178.0.1"),),
    }


def test_a_multipath_route_is_written_in_ip_routes_nexthop_syntax():
    route = Route(namespace="n", prefix="10.177.100.102/32",
                  nexthops=(Nexthop("dte-u0", "10.178.0.3"), Nexthop("dte-u1", "10.178.0.5")))  # fmt: skip
    assert " ".join(route.ip_args()) == (
        "10.177.100.102/32 nexthop via 10.178.0.3 dev dte-u0 nexthop via 10.178.0.5 dev dte-u1"
    )
    assert Route(namespace="n", prefix="a/32", nexthops=(Nexthop("dte-br0"),)).ip_args() == ["a/32", "dev", "dte-br0"]


def test_every_name_is_the_emulators_and_fits_an_interface_name():
    plan = _routed()
    interfaces = [r.bridge for r in plan.routers if r.bridge] + [s.port for s in plan.servers]
    interfaces += [end for x in plan.router_links for end in (x.tor_end, x.spine_end)]
    assert all(name.startswith("dte-") and len(name) <= 15 for name in interfaces + plan.namespaces)


def test_an_interleaved_placement_gives_each_server_its_own_route():
    # A rack's servers get ranks 0 and 2: no prefix holds both addresses without the other rack's, hence /32s.
    topology = _leaf_spine()
    plan = plan_emulation(topology, scale=1e-3, tag="t", fabric="routed",
                          placement=placement_order(topology, "interleaved"))  # fmt: skip
    assert [s.bridge for s in plan.servers] == ["dte-br0", "dte-br1", "dte-br0", "dte-br1"]
    tor0 = _routes(plan, "dte-t-t0")
    assert [len(tor0[f"{s.ip}/32"]) for s in plan.servers] == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="rack-level hierarchy"):
        ranks_per_rack(plan, procs_per_server=1)


def test_a_packed_routed_plan_keeps_racks_for_the_hierarchy():
    assert ranks_per_rack(_routed(), procs_per_server=2) == 4


def test_one_flow_across_the_racks_is_held_to_one_spines_link():
    # Bridged, the 1:4 ToR uplinks are one 50 Mb/s veth; routed, one flow crosses one 25 Mb/s spine link.
    assert path_bit_per_s(_routed(oversubscription=4), 0, 3) == pytest.approx(25e6)
    assert path_bit_per_s(plan_emulation(_leaf_spine(4), scale=1e-3, tag="t"), 0, 3) == pytest.approx(50e6)
    assert path_bit_per_s(_routed(oversubscription=4), 0, 1) == pytest.approx(100e6)  # same rack: NIC to NIC


def test_the_simulator_sees_every_spine_of_a_routed_plan_and_its_collisions():
    # Two flows from rack 0 to rack 1 on the 1:1 cluster: on one spine they share its 100 Mb/s link, on two
    # spines each runs at its NIC's 100 Mb/s; the simulator's hash puts some flow pairs on one spine.
    topology = _leaf_spine(oversubscription=1)
    network = emulated_topology(topology, _routed(oversubscription=1))
    assert {"spine0", "spine1"} <= set(network.graph) and "spines" not in network.graph
    payload = 100e6 / 8 * 1448 / 1514
    shares = set()
    for pair in range(16):
        paths = [network.route("s0/gpu0", "s2/gpu0", 2 * pair), network.route("s1/gpu0", "s3/gpu0", 2 * pair + 1)]
        shares.add(tuple(round(r / payload, 3) for r in max_min_rates(paths)))
    assert shares == {(0.5, 0.5), (1.0, 1.0)}


def test_a_bridged_plan_is_unchanged_by_the_routed_option():
    plan = plan_emulation(_leaf_spine(), scale=1e-3, tag="t")
    assert plan.fabric_kind == "bridged" and plan.spines_merged and plan.routers == [] and plan.routes == []
    assert plan.namespaces == ["dte-t-fab", *(f"dte-t-s{i}" for i in range(4))]
    assert [s.address_bits for s in plan.servers] == [16] * 4


def test_describe_records_the_fabric_its_links_and_routes():
    record = _routed().describe()
    assert record["fabric"] == "routed"
    assert record["router_links"][0] == {"tor": "r0/tor", "spine": "spine0", "up_mbit_per_s": pytest.approx(25.0),
                                         "down_mbit_per_s": pytest.approx(25.0)}  # fmt: skip
    assert ("dte-t-t0: 10.177.100.102/32 nexthop via 10.178.0.3 dev dte-u0 nexthop via 10.178.0.5 dev dte-u1"
            in record["routes"])  # fmt: skip
    assert "routes" not in plan_emulation(_leaf_spine(), scale=1e-3, tag="t").describe()


def test_an_unknown_fabric_is_refused():
    with pytest.raises(ValueError, match="fabric must be one of"):
        plan_emulation(_tree(), scale=1e-3, tag="t", fabric="ecmp")


def test_the_routed_fabric_refuses_switch_loops_that_are_not_leaf_spine():
    t = _tree()
    t.add_link("r0/tor", "r1/tor", bytes_per_s=1e9, latency_s=1e-6, kind="ethernet100")
    with pytest.raises(ValueError, match="needs a two-tier leaf-spine"):
        plan_emulation(t, scale=1e-3, tag="t", fabric="routed")


def test_a_tree_with_one_spine_routes_over_that_spine():
    plan = plan_emulation(_tree(), scale=1e-3, tag="t", fabric="routed")
    assert [r.role for r in plan.routers] == ["tor", "tor", "spine"]
    assert _routes(plan, "dte-t-t0")["10.177.100.101/32"] == (Nexthop("dte-u0", "10.178.0.3"),)


def test_routed_rates_below_what_tc_holds_are_refused():
    with pytest.raises(ValueError, match="r0/tor-spine0: scaled rate"):
        plan_emulation(_leaf_spine(), scale=1e-6, tag="t", fabric="routed")
