"""The simulator at cluster scale: the fast path (lock-step rounds, copies replayed once) against the exact replay,
tier-by-tier routing against a search of the whole graph, the fat-tree builder's shapes, and the CLI flags."""

from __future__ import annotations

import gc
import itertools
import json

import networkx as nx
import pytest

from dtrain.cli.cluster import PRESET_NAMES
from dtrain.cli.main import main
from dtrain.cluster.builders import ClusterSpec, ServerSpec, build, fat_tree
from dtrain.cluster.files import loads
from dtrain.cluster.presets import PRESETS, preset
from dtrain.cluster.routing import TierRouter, destination_routed
from dtrain.cluster.topology import Link, collector_paused
from dtrain.comm.ir.algorithms import build as build_schedule
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.api_passes import api_passes
from dtrain.sim.classes import replay_jobs
from dtrain.sim.collective import Job, SoftwareCost, replay_concurrent
from dtrain.sim.flows import LinkUsage, usage_rows
from dtrain.sim.model import MODELS, Layout
from dtrain.sim.placement import place
from dtrain.sim.step import StepConfig, simulate_step
from dtrain.sim.traffic import simulate_traffic

SMALL = MODELS["llama-7b"]
#: How far the fast path's step time may be from the exact replay's (docs/simulator-scale.md): a pair keeps its
#: connection's path every round, so a ring's repeated rounds collide alike and lock step matches the replay here.
STEP_TOLERANCE = 1e-9


@pytest.mark.parametrize(
    ("topology", "layout"),
    [
        (preset("h100-rail", racks=2, servers_per_rack=16), Layout(dp=16, tp=8, pp=2, global_batch=32)),
        (preset("dgx-a100-superpod", racks=2, servers_per_rack=8, spines=4, cores=8),
         Layout(dp=8, tp=8, pp=2, global_batch=16)),
        (preset("fat-tree-k8"), Layout(dp=32, pp=4, global_batch=128)),
    ],
)  # fmt: skip
def test_fast_path_is_within_tolerance_of_the_exact_replay(topology, layout):
    placement = place(topology, layout)
    exact = simulate_step(SMALL, layout, topology, placement, StepConfig(flow_limit=None, split_pipeline=True))
    fast = simulate_step(SMALL, layout, topology, placement, StepConfig(flow_limit=100, split_pipeline=True))
    assert fast.step_s == pytest.approx(exact.step_s, rel=STEP_TOLERANCE)
    assert fast.dp_s == pytest.approx(exact.dp_s, rel=STEP_TOLERANCE)
    # the tensor-parallel all-reduces and pipeline sends have a single path each: copies, replayed once, exactly
    assert fast.tp_s == pytest.approx(exact.tp_s, rel=1e-9)
    assert fast.pp_s == pytest.approx(exact.pp_s, rel=1e-9)
    # every byte is counted on the same links, the spines and cores the same hashes picked included
    exact_bytes = {u.link.name: u.nbytes for u in exact.links}
    fast_bytes = {u.link.name: u.nbytes for u in fast.links}
    assert fast_bytes.keys() == exact_bytes.keys()
    assert all(fast_bytes[k] == pytest.approx(exact_bytes[k], rel=1e-9) for k in exact_bytes)


@pytest.mark.parametrize(
    "topology",
    [preset("fat-tree-k8"), preset("dgx-a100-superpod", racks=2, servers_per_rack=2, spines=2, cores=4),
     preset("4-rack", racks=2, servers_per_rack=2, nic_affinity="ecmp")],
)  # fmt: skip
def test_tier_routing_gives_the_whole_graph_s_fewest_hop_paths(topology):
    router = TierRouter(topology.graph)  # no NIC affinity: the fewest-hop paths, all of them
    assert router.exact
    nodes = [n for n, server in router.server.items() if server is not None]
    nodes = nodes[:: max(1, len(nodes) // 40)]
    checked = 0
    for src, dst in itertools.islice(itertools.permutations(nodes, 2), 0, None, 23):
        got = router.paths(src, dst)
        if got is not None:  # None: the router hands the pair to the whole-graph search
            assert sorted(got) == sorted(nx.all_shortest_paths(topology.graph, src, dst)), (src, dst)
            checked += 1
    assert checked >= 40


def _layers(topology) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, layer in topology.graph.nodes(data="layer"):
        if layer:
            out.setdefault(layer, []).append(name)
    return out


def test_k_ary_fat_tree_has_al_fares_shape_and_paths():
    k = 4
    topology = build(fat_tree(k))
    layers = _layers(topology)
    assert len(topology.servers()) == k**3 // 4
    assert (len(layers["tor"]), len(layers["spine"]), len(layers["core"])) == (k * k // 2, k * k // 2, k * k // 4)
    # every switch has k ports: k/2 down, k/2 up (cores: k down)
    for switch in layers["tor"] + layers["spine"]:
        assert topology.graph.out_degree(switch) == k
    for core in layers["core"]:
        assert topology.graph.out_degree(core) == k
    # hosts under one edge switch: one path through it; same pod: k/2 paths; other pods: (k/2)^2 paths
    for dst, paths, switches in (("s1/gpu0", 1, 1), ("s2/gpu0", k // 2, 3), ("s15/gpu0", (k // 2) ** 2, 5)):
        found = topology.equal_cost_paths("s0/gpu0", dst)
        assert len(found) == paths
        assert all(sum(topology.graph.nodes[n]["layer"] is not None for n in path) == switches for path in found)
    with pytest.raises(ValueError, match="even"):
        fat_tree(5)


def test_fat_tree_oversubscription_at_each_tier():
    server = ServerSpec(gpus=2, gpus_per_pcie_switch=1, nics=2)
    spec = ClusterSpec(server=server, fabric="fat-tree", racks=4, servers_per_rack=3, pods=2, spines=2, cores=4,
                       oversubscription=3, pod_oversubscription=2)  # fmt: skip
    topology = build(spec)
    layers = _layers(topology)
    rate = lambda a, b: topology.link(a, b).bytes_per_s  # noqa: E731
    for tor in layers["tor"]:
        down = sum(rate(n, tor) for n in topology.graph.predecessors(tor) if "/nic" in n)
        up = sum(rate(tor, s) for s in topology.graph.successors(tor) if "spine" in s)
        assert down == pytest.approx(3 * 2 * 25e9) and up == pytest.approx(down / 3)
    for spine in layers["spine"]:
        down = sum(rate(t, spine) for t in topology.graph.predecessors(spine) if t.endswith("tor"))
        up = sum(rate(spine, c) for c in topology.graph.successors(spine) if c.startswith("core"))
        assert up == pytest.approx(down / 2)
        assert len([c for c in topology.graph.successors(spine) if c.startswith("core")]) == 2  # cores / spines


def test_superpod_preset_puts_nic_k_on_rail_k_of_its_unit_and_gpu_k_on_nic_k():
    topology = preset("dgx-a100-superpod")
    layers = _layers(topology)
    assert len(topology.devices()) == 640
    assert (len(layers["tor"]), len(layers["spine"]), len(layers["core"])) == (32, 16, 16)
    assert topology.link("s21/nic5", "r1/rail5").bytes_per_s == pytest.approx(25e9)  # HDR, 200 Gb/s
    for path in topology.equal_cost_paths("s0/gpu3", "s79/gpu3"):
        assert "s0/nic3" in path and "r0/rail3" in path and "r3/rail3" in path
    assert len(topology.equal_cost_paths("s0/gpu3", "s79/gpu3")) == 16  # 8 spines x 2 cores of each spine's group


def test_fat_tree_spec_and_file_errors_name_the_key():
    with pytest.raises(ValueError, match="cores .* multiple of spines"):
        ClusterSpec(fabric="fat-tree", racks=4, servers_per_rack=2, pods=2, spines=3, cores=4)
    with pytest.raises(ValueError, match="rails"):
        ClusterSpec(fabric="leaf-spine", rails=True)
    topology = loads('[build]\nfabric = "fat-tree"\nracks = 4\nservers_per_rack = 2\npods = 2\nspines = 2\ncores = 2\n')
    assert {layer for _, layer in topology.graph.nodes(data="layer") if layer} == {"tor", "spine", "core"}


def test_the_cli_lists_every_preset():
    assert tuple(PRESETS) == PRESET_NAMES


def test_simulate_train_flags(capsys: pytest.CaptureFixture[str]):
    common = ["simulate", "train", "--topology", "h100-rail", "--tp", "8", "--pp", "2", "--dp", "2",
              "--global-batch", "8", "--json"]  # fmt: skip
    assert main([*common, "--split-pipeline", "--flow-limit", "none"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert main(common) == 0
    whole = json.loads(capsys.readouterr().out)
    assert split["split_pipeline"] and split["flow_limit"] is None and whole["flow_limit"] == 50_000
    assert split["pp_message_s"] != whole["pp_message_s"]
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit) as exit_info:
            main([*common, "--flow-limit", bad])
        assert exit_info.value.code == 2
        assert "--flow-limit takes a whole number >= 1 or 'none'" in capsys.readouterr().err


def test_copies_of_a_server_with_api_operations_equal_the_full_replay():
    topology = preset("h100-rail", racks=1, servers_per_rack=4)
    schedule = build_schedule(Collective.ALL_REDUCE, "ring", 4)
    nbytes = 2**20
    api = api_passes(schedule, nbytes, op="avg")
    cost = SoftwareCost(call_s=2e-6, launch_s=5e-6)
    jobs = [Job(schedule, nbytes, tuple(f"s{s}/gpu{g + h}" for g in range(4)), api) for s in range(4) for h in (0, 4)]
    fast = replay_jobs(jobs, topology, cost=cost, itemsize=2, flow_limit=None)
    full = replay_concurrent(jobs, topology, cost=cost, itemsize=2)
    assert fast.time_s == pytest.approx(full.time_s, rel=1e-9)
    assert fast.rank_finish_s == pytest.approx(full.rank_finish_s, rel=1e-9)
    assert {u.link.name: u.nbytes for u in fast.links} == pytest.approx({u.link.name: u.nbytes for u in full.links})


@pytest.mark.parametrize(
    "topology",
    [preset("h100-rail", racks=3, servers_per_rack=4), preset("h100-rail", racks=2, servers_per_rack=3, routing="ecmp"),
     preset("dgx-a100-superpod", racks=2, servers_per_rack=3, spines=4, cores=8),
     preset("4-rack", racks=2, servers_per_rack=2), preset("4-rack", racks=2, servers_per_rack=2, nic_affinity="ecmp")],
)  # fmt: skip
def test_routes_of_one_way_pairs_equal_the_searched_and_sorted_paths(topology):
    """A pair with one way out and one way in takes the fabric's paths between its switches, sorted and picked once
    per switch pair: the routes the search, the latency filter, the sort and d-mod-k's tables give."""
    devices = [d.name for d in topology.devices()]
    shortened = 0
    for src, dst in itertools.islice(itertools.permutations(devices, 2), 0, None, 7):
        got = topology.equal_cost_routes(src, dst)
        paths = topology.equal_cost_paths(src, dst)
        if topology.routing == "d-mod-k" and len(paths) > 1:
            paths = destination_routed(paths, topology.router.server, topology._port_index)
        assert got == [topology._path_links(p) for p in paths], (src, dst)
        shortened += topology.router.one_way(src, dst) is not None
    assert shortened >= (0 if topology.nic_affinity == "ecmp" else 100)


def test_links_and_nodes_added_at_once_check_every_row_first():
    topology = build(ClusterSpec(server=ServerSpec(gpus=2, gpus_per_pcie_switch=1, nics=2), racks=1,
                                 servers_per_rack=2))  # fmt: skip
    edges = topology.graph.number_of_edges()
    cases = [([("s0/gpu0", "s1/gpu0", 1e9, 0.0, "x"), ("s0/gpu0", "nowhere", 1e9, 0.0, "x")], "unknown node"),
             ([("s0/gpu0", "s0/gpu0", 1e9, 0.0, "nvlink4")], "two different nodes"),
             ([("s0/gpu0", "s0/pcie0", 1e9, 0.0, "pcie4x16")], "duplicate link s0/gpu0->s0/pcie0"),
             ([("s0/gpu0", "s1/gpu0", 1e9, 0.0, "x"), ("s1/gpu0", "s0/gpu0", 1e9, 0.0, "x")], "duplicate link"),
             ([("s0/gpu0", "s1/gpu0", 0.0, 0.0, "x")], "bytes_per_s must be > 0"),
             ([("s0/gpu0", "s1/gpu0", 1e9, -1.0, "x")], "latency_s must be >= 0")]  # fmt: skip
    for rows, message in cases:
        with pytest.raises(ValueError, match=message):
            topology.add_links(rows)
        assert topology.graph.number_of_edges() == edges
    nodes = topology.graph.number_of_nodes()
    for rows, message in (([("x0", "cpu", None, None), ("x0", "cpu", None, None)], "duplicate node"),
                          ([("x1", "cpu", None, None), ("x2", "router", None, None)], "unknown kind")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            topology.add_nodes(rows)
        assert topology.graph.number_of_nodes() == nodes
    topology.add_nodes([("x3", "switch", None, None)])
    topology.add_links([("s0/nic0", "x3", 5e9, 1e-6, "ib-ndr")])
    assert topology.link("x3", "s0/nic0") == Link(
        src="x3", dst="s0/nic0", bytes_per_s=5e9, latency_s=1e-6, kind="ib-ndr"
    )
    assert topology.link("x3", "s0/nic0").name == "x3->s0/nic0"


def test_a_replay_s_link_rows_are_busiest_first_then_by_name():
    topology = preset("h100-rail", racks=2, servers_per_rack=4)
    layout = Layout(dp=4, tp=8, pp=2, global_batch=8)
    traffic = simulate_traffic(SMALL, layout, topology, place(topology, layout), split_pipeline=True)
    for result in (traffic.tp, traffic.pp, traffic.pp_gather, *traffic.dp):
        assert result.links == sorted(result.links, key=lambda u: (-u.utilisation, u.link.name))
    link = topology.link("s0/nic0", "r0/rail0")
    made = usage_rows([(link, 3.0, 1.0)], 4.0)
    assert made == [LinkUsage(link=link, nbytes=3.0, busy_s=1.0, total_s=4.0)]
    assert hash(made[0]) == hash(LinkUsage(link=link, nbytes=3.0, busy_s=1.0, total_s=4.0))


def test_the_collector_is_back_as_it_was_after_a_pause():
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            with collector_paused():
                assert not gc.isenabled()
            assert gc.isenabled() == enabled and gc.get_freeze_count() == 0
    finally:
        (gc.enable if was else gc.disable)()
