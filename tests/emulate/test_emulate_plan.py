"""The emulation plan: what a topology becomes (namespaces, bridges, rates), placements, and the network the
simulator is given for it; no root needed."""

from __future__ import annotations

import pytest

from dtrain.cluster.files import resolve
from dtrain.cluster.presets import preset
from dtrain.cluster.topology import Device, Topology
from dtrain.comm.ir.schedule import Collective, Transfer, make_schedule
from dtrain.emulate.model import emulated_topology
from dtrain.emulate.placement import placement_order, ranks_per_rack
from dtrain.emulate.plan import path_bit_per_s, plan_emulation, server_ip
from dtrain.sim.collective import replay


def _tree(server_gbit: float = 100.0, uplink_gbit: float = 50.0) -> Topology:
    """Two racks of one server each under one spine: a tree, each bridge one switch."""
    t = Topology("tree")
    t.add_node("spine", kind="switch", layer="spine")
    for r in range(2):
        t.add_node(f"r{r}/tor", kind="switch", rack=f"r{r}", layer="tor")
        t.add_node(f"s{r}/nic0", kind="nic", server=f"s{r}", rack=f"r{r}")
        t.add_device(Device(name=f"s{r}/gpu0", server=f"s{r}", rack=f"r{r}", peak_flops=1e12, memory_bytes=1 << 30,
                            memory_bytes_per_s=1e11))  # fmt: skip
        t.add_link(f"s{r}/gpu0", f"s{r}/nic0", bytes_per_s=32e9, latency_s=1e-6, kind="pcie4x16")
        t.add_link(f"s{r}/nic0", f"r{r}/tor", bytes_per_s=server_gbit * 1e9 / 8, latency_s=1e-6, kind="ethernet100")
        t.add_link(f"r{r}/tor", "spine", bytes_per_s=uplink_gbit * 1e9 / 8, latency_s=1e-6, kind="ethernet100")
    return t


def test_every_server_gets_a_namespace_and_scaled_nic_rate():
    plan = plan_emulation(_tree(), scale=1e-3, tag="t")
    assert [s.namespace for s in plan.servers] == ["dte-t-s0", "dte-t-s1"]
    assert [s.up_bit_per_s for s in plan.servers] == pytest.approx([100e6, 100e6])
    assert [s.down_bit_per_s for s in plan.servers] == pytest.approx([100e6, 100e6])


def test_a_tree_keeps_one_bridge_per_switch_and_one_veth_per_link():
    plan = plan_emulation(_tree(), scale=1e-3, tag="t")
    assert sorted(plan.bridges.values()) == ["r0/tor", "r1/tor", "spine"]
    assert not plan.spines_merged
    assert len(plan.switch_links) == 2
    for link in plan.switch_links:  # element-wise: pytest.approx takes flat sequences only
        assert link.a_to_b_bit_per_s == pytest.approx(50e6) and link.b_to_a_bit_per_s == pytest.approx(50e6)


def test_leaf_spine_merges_spines_and_sums_each_tors_uplinks():
    # 2 racks x 2 servers, 100 Gb/s NICs, 1:4: each ToR has 200/4 = 50 Gb/s up, split over 2 spines.
    topology = preset("4-rack", racks=2, servers_per_rack=2, gpus=1, nics=1, nic="ethernet100", oversubscription=4)
    plan = plan_emulation(topology, scale=1e-3, tag="t")
    assert plan.spines_merged and len(plan.bridges) == 3
    assert [x.a_to_b_bit_per_s for x in plan.switch_links] == pytest.approx([50e6, 50e6])
    assert [s.bridge for s in plan.servers] == ["dte-br0", "dte-br0", "dte-br1", "dte-br1"]


def test_several_nics_to_one_tor_add_up():
    topology = preset("4-rack", racks=2, servers_per_rack=1, gpus=2, nics=2, nic="ethernet100")
    plan = plan_emulation(topology, scale=1e-3, tag="t")
    assert [s.up_bit_per_s for s in plan.servers] == pytest.approx([200e6, 200e6])
    assert [s.devices for s in plan.servers] == [2, 2]


def test_placement_orders_servers_and_addresses_sort_in_rank_order():
    plan = plan_emulation(_tree(), scale=1e-3, tag="t", placement=["s1", "s0"])
    assert [s.server for s in plan.servers] == ["s1", "s0"]
    addresses = [server_ip(i) for i in range(250)]
    assert sorted(addresses) == addresses


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scale": 0}, "scale must be > 0"),
        ({"scale": 1e-3, "tag": "a-b"}, "tag must be"),
        ({"scale": 1e-9}, "below"),
        ({"scale": float("inf")}, "scale must be > 0 and finite"),
        ({"scale": 1e3}, "above 1e\\+12 bit/s.*lower --scale"),
        ({"scale": 1e-3, "placement": ["s0", "s0"]}, "distinct servers"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_emulation(_tree(), **{"tag": "t", **kwargs})


def test_planning_reads_the_devices_once_not_once_per_server(monkeypatch):
    calls = []
    real = Topology.devices
    monkeypatch.setattr(Topology, "devices", lambda self: calls.append(self) or real(self))
    topology = preset("4-rack", racks=2, servers_per_rack=4, gpus=1, nics=1)
    plan_emulation(topology, scale=1e-3, tag="t", placement=placement_order(topology, "interleaved"))
    assert len(calls) == 1


def test_a_server_on_two_switches_is_refused():
    t = _tree()
    t.add_link("s0/nic0", "r1/tor", bytes_per_s=1e9, latency_s=1e-6, kind="ethernet100")
    with pytest.raises(ValueError, match="s0.*exactly one network switch"):
        plan_emulation(t, scale=1e-3, tag="t")


def test_loops_that_are_not_leaf_spine_are_refused():
    t = _tree()
    t.add_link("r0/tor", "r1/tor", bytes_per_s=1e9, latency_s=1e-6, kind="ethernet100")
    with pytest.raises(ValueError, match="not a two-tier leaf-spine"):
        plan_emulation(t, scale=1e-3, tag="t")


def _leaf_spine(oversubscription: float = 4):
    return preset("4-rack", racks=2, servers_per_rack=2, gpus=1, nics=1, nic="ethernet100",
                  oversubscription=oversubscription)  # fmt: skip


def test_a_topology_file_plans_like_its_preset(tmp_path):
    path = tmp_path / "two-racks.toml"
    path.write_text('name = "two-racks"\n[build]\npreset = "4-rack"\nracks = 2\nservers_per_rack = 2\ngpus = 1\n'
                    'nics = 1\nnic = "ethernet100"\noversubscription = 4\n')  # fmt: skip
    from_file = plan_emulation(resolve(str(path)), scale=1e-3, tag="t")
    from_preset = plan_emulation(_leaf_spine(), scale=1e-3, tag="t")
    assert from_file.describe() | {"topology": ""} == from_preset.describe() | {"topology": ""}


def test_the_configured_path_rate_is_the_smallest_shaped_rate_on_it():
    plan = plan_emulation(_leaf_spine(), scale=1e-3, tag="t")
    assert path_bit_per_s(plan, 0, 1) == pytest.approx(100e6)  # same rack: NIC to NIC
    assert path_bit_per_s(plan, 0, 3) == pytest.approx(50e6)  # across: the ToR's 1:4 uplink


def test_interleaved_placement_deals_racks_in_turn():
    assert placement_order(_leaf_spine(), "interleaved") == ["s0", "s2", "s1", "s3"]
    assert placement_order(_leaf_spine(), "packed") == ["s0", "s1", "s2", "s3"]


def test_a_rack_holds_its_servers_ranks_when_packed():
    topology = _leaf_spine()
    plan = plan_emulation(topology, scale=1e-3, tag="t", placement=placement_order(topology, "packed"))
    assert ranks_per_rack(plan, procs_per_server=3) == 6


def test_the_simulators_network_is_the_shaped_one():
    # One message across the racks of the 1:4 cluster: the simulator must move it at the ToR uplink's payload
    # rate, 50 Mb/s x 1448/1514, as the emulation delivers it.
    topology = _leaf_spine()
    plan = plan_emulation(topology, scale=1e-3, tag="t")
    network = emulated_topology(topology, plan)
    nbytes = 1 << 20
    result = replay(make_schedule(Collective.BROADCAST, "p2p", 2, [[Transfer(0, 1, 0, 0)]], root=0), nbytes,
                    network, ["s0/gpu0", "s3/gpu0"])  # fmt: skip
    expected = nbytes / (50e6 / 8 * 1448 / 1514)
    assert result.time_s == pytest.approx(expected, rel=1e-3)
    assert "spines" in network.graph and "spine0" not in network.graph


def test_a_subset_of_servers_keeps_every_tor_a_tor():
    plan = plan_emulation(_leaf_spine(), scale=1e-3, tag="t", placement=["s0", "s1"])
    assert [s.server for s in plan.servers] == ["s0", "s1"]
    assert sorted(plan.bridges.values()) == ["r0/tor", "r1/tor", "spine0,spine1"]


def test_a_ping_whose_peer_closes_ends_with_an_error_naming_it(monkeypatch):
    """The probe's ping client against a server on loopback that takes the first echo and closes: one clear error,
    not a loop on an empty read."""
    import socket
    import threading

    from dtrain.emulate import probe
    from dtrain.emulate.netns import EmulationError

    listener = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(probe, "_PORT", listener.getsockname()[1])

    def serve_and_close():
        conn, _ = listener.accept()
        with conn:
            got = b""
            while len(got) < 1 + 64:  # the mode byte and the first echo, all of it: then a clean close
                got += conn.recv(1 + 64 - len(got))

    server = threading.Thread(target=serve_and_close, daemon=True)
    server.start()
    try:
        with pytest.raises(EmulationError, match="127.0.0.1 closed the connection during ping 1 of 3"):
            probe._ping_client("127.0.0.1", 3, timeout_s=5.0)
    finally:
        listener.close()
        server.join(timeout=5)
