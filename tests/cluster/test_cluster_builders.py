"""Builders and presets: node counts, link capacities, oversubscription and equal-cost paths."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.cluster.builders import ClusterSpec, ServerSpec, build, build_server
from dtrain.cluster.capacity import oversubscription, switch_capacity
from dtrain.cluster.presets import PRESETS, preset, preset_spec


def _kinds(topology, kind):
    return [n for n, k in topology.graph.nodes(data="kind") if k == kind]


def test_dgx_a100_has_8_gpus_8_nics_4_pcie_switches_2_cpus_and_an_nvswitch():
    t = preset("dgx-a100")
    counts = {kind: len(_kinds(t, kind)) for kind in ("gpu", "nic", "pcie-switch", "cpu", "nvswitch")}
    assert counts == {"gpu": 8, "nic": 8, "pcie-switch": 4, "cpu": 2, "nvswitch": 1}


def test_an_a100_reaches_the_nvswitch_at_300_gbyte_per_s_each_way():
    link = preset("dgx-a100").link("s0/gpu0", "s0/nvswitch")
    assert (link.bytes_per_s, link.kind) == (300e9, "nvlink3")


def test_gpus_of_one_server_talk_over_nvlink_not_pcie():
    route = preset("dgx-a100").route("s0/gpu0", "s0/gpu1")
    assert [link.kind for link in route] == ["nvlink3", "nvlink3"]


def test_h100_node_uses_nvlink4_pcie5_and_ndr():
    t = preset("h100-node")
    assert t.link("s0/gpu3", "s0/nvswitch").bytes_per_s == 450e9
    assert t.link("s0/gpu3", "s0/pcie1").kind == "pcie5x16"
    assert t.devices()[0].memory_bytes == 80e9


def test_h200_4gpu_puts_4_gpus_on_an_nvswitch_at_450_gbyte_per_s():
    t = preset("h200-4gpu")
    assert len(t.devices()) == 4
    assert {t.link(f"s0/gpu{g}", "s0/nvswitch").bytes_per_s for g in range(4)} == {18 * 25e9}


def test_an_nvlink_mesh_splits_each_gpus_links_over_its_peers():
    t = build_server(ServerSpec(gpus=4, device="h100-sxm", intra="nvlink-mesh", nics=0))
    for a in range(4):
        for b in range(4):
            if a != b:
                assert t.link(f"s0/gpu{a}", f"s0/gpu{b}").bytes_per_s == 6 * 25e9  # 18 links / 3 peers


def test_a_pcie_server_shares_one_switch_uplink_among_its_gpus():
    t = build_server(ServerSpec(gpus=4, intra="pcie", gpus_per_pcie_switch=4, cpus=2, nics=1, nic="ethernet100"))
    assert not _kinds(t, "nvswitch")
    route = t.route("s0/gpu0", "s0/gpu3")
    assert [link.dst for link in route] == ["s0/pcie0", "s0/gpu3"]
    # the one switch's single x16 uplink to the CPU is all four GPUs share towards the host
    assert [dst for _, dst in t.graph.out_edges("s0/pcie0") if dst.startswith("s0/cpu")] == ["s0/cpu0"]


def test_gpus_under_different_cpus_cross_the_upi_link():
    t = build_server(ServerSpec(gpus=4, intra="pcie", gpus_per_pcie_switch=2, cpus=2, nics=0))
    assert "upi" in [link.kind for link in t.route("s0/gpu0", "s0/gpu3")]


def test_with_gpudirect_rdma_traffic_between_servers_skips_the_cpus():
    t = build(ClusterSpec(server=ServerSpec(gpus=2, nics=1), servers_per_rack=2))
    nodes = [link.dst for link in t.route("s0/gpu0", "s1/gpu1")]
    assert nodes == ["s0/pcie0", "s0/nic0", "r0/tor", "s1/nic0", "s1/pcie0", "s1/gpu1"]


def test_without_gpudirect_rdma_traffic_between_servers_passes_a_cpu():
    t = build(ClusterSpec(server=ServerSpec(gpus=2, nics=1, gpudirect_rdma=False), servers_per_rack=2))
    kinds = [t.graph.nodes[link.dst]["kind"] for link in t.route("s0/gpu0", "s1/gpu1")]
    assert kinds.count("cpu") == 2


def test_a_rack_puts_every_nic_under_one_tor():
    t = build(ClusterSpec(server=ServerSpec(nics=2, gpus=2), servers_per_rack=3))
    assert t.switches().count("r0/tor") == 1 and len(t.servers()) == 3
    assert len([u for u, _ in t.graph.in_edges("r0/tor")]) == 6


@pytest.mark.parametrize("ratio", [1, 2, 4, 8, 16])
def test_tor_uplink_is_downlink_over_the_oversubscription_ratio(ratio):
    t = preset("4-rack", oversubscription=ratio)
    capacity = switch_capacity(t, "r2/tor")
    assert capacity.down_bytes_per_s == 4 * 8 * 25e9  # 4 servers x 8 HDR NICs x 25 GB/s
    assert oversubscription(t, "r2/tor") == pytest.approx(ratio)


def test_at_1_to_4_a_server_gets_a_quarter_of_its_nics_across_racks():
    capacity = switch_capacity(preset("4-rack", oversubscription=4), "r1/tor")
    assert capacity.servers == 4
    assert capacity.server_share_bytes_per_s == pytest.approx(8 * 25e9 / 4)


def test_uplink_capacity_is_spread_evenly_over_the_spines():
    t = preset("4-rack", spines=4, oversubscription=4)
    rates = {t.link("r0/tor", f"spine{k}").bytes_per_s for k in range(4)}
    assert rates == {800e9 / 4 / 4}


def test_cross_rack_traffic_has_one_equal_cost_path_per_spine():
    t = preset("4-rack", spines=3)
    paths = t.equal_cost_paths("r0/tor", "r3/tor")
    assert sorted(path[1] for path in paths) == ["spine0", "spine1", "spine2"]


def test_flows_between_two_gpus_spread_over_all_spines():
    t = preset("4-rack", spines=2)
    spines = {t.route("s0/gpu0", "s15/gpu0", flow=f)[3].dst for f in range(32)}
    assert spines == {"spine0", "spine1"}


def test_multi_level_tree_has_pods_under_cores_with_their_own_ratio():
    spec = ClusterSpec(server=ServerSpec(gpus=2, nics=1), racks=4, servers_per_rack=2, spines=2, pods=2, cores=2,
                       oversubscription=2, pod_oversubscription=4)  # fmt: skip
    t = build(spec)
    assert oversubscription(t, "r0/tor") == pytest.approx(2)
    assert oversubscription(t, "p1/spine0") == pytest.approx(4)
    paths = t.equal_cost_paths("r0/tor", "r3/tor")  # tor, pod-0 spine, core, pod-1 spine, tor
    assert len(paths) == 2 * 2 * 2 and {path[2] for path in paths} == {"core0", "core1"}


@settings(max_examples=25, deadline=None)
@given(racks=st.integers(2, 5), servers=st.integers(1, 3), spines=st.integers(1, 4), ratio=st.integers(1, 16))
def test_every_built_cluster_validates_and_keeps_its_ratio(racks, servers, spines, ratio):
    spec = ClusterSpec(server=ServerSpec(gpus=2, nics=1, nic="ethernet25"), racks=racks, servers_per_rack=servers,
                       spines=spines, oversubscription=ratio)  # fmt: skip
    t = build(spec)
    t.validate()
    assert len(t.devices()) == 2 * racks * servers
    assert oversubscription(t, "r0/tor") == pytest.approx(ratio)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_validates(name):
    preset(name).validate()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"oversubscription": 0.5}, "oversubscription must be a ratio >= 1"),
        ({"racks": 0}, "cluster racks must be a whole number >= 1, got 0"),
        ({"gpus": 2.5}, "server gpus must be a whole number >= 1, got 2.5"),
        ({"racks": 3, "pods": 2}, "3 racks do not split into 2 equal pods"),
        ({"intra": "infinityfabric"}, "intra 'infinityfabric' is not one of"),
        ({"nic": "nvlink3"}, "nic 'nvlink3' is a nvlink link, expected ethernet or infiniband"),
        ({"nic": "ethernet300"}, "unknown link kind 'ethernet300'"),
        ({"uplink": "pcie4x16"}, "uplink 'pcie4x16' is a pcie link, expected ethernet or infiniband"),
        ({"pcie": "ethernet10"}, "pcie 'ethernet10' is a ethernet link, expected pcie"),
        ({"device": "tpu-v5"}, "unknown device 'tpu-v5'"),
        ({"color": "red"}, "unknown parameter 'color'"),
    ],
)
def test_bad_parameters_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        preset_spec("4-rack", **change)


def test_gpus_per_server_is_an_alias_for_gpus():
    assert preset_spec("4-rack", gpus_per_server=4).server.gpus == 4
