"""Drawing a topology: a PNG is written, servers collapse into boxes, layers stack spines over GPUs."""

from __future__ import annotations

import pytest

from dtrain.cluster.draw import collapsed_graph, draw, layered_positions
from dtrain.cluster.presets import preset
from dtrain.cluster.topology import Topology

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_drawing_a_small_cluster_writes_a_png(tmp_path):
    path = draw(preset("4-rack", racks=2, servers_per_rack=1, gpus_per_server=2, nics=1), tmp_path / "c.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_a_large_cluster_is_drawn_a_box_a_server(tmp_path):
    path = draw(preset("4-rack"), tmp_path / "big.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_collapsing_sums_a_servers_nic_links_into_one_edge():
    graph = collapsed_graph(preset("4-rack"))
    assert graph.nodes["s5"]["kind"] == "host" and graph.nodes["s5"]["devices"] == 8
    assert graph.edges["s5", "r1/tor"]["bytes_per_s"] == 8 * 25e9


def test_layers_stack_spines_over_tors_over_nics_over_gpus():
    t = preset("4-rack", racks=2, servers_per_rack=1, gpus_per_server=2, nics=1)
    graph = t.graph.to_undirected()
    y = {name: pos[1] for name, pos in layered_positions(graph).items()}
    assert y["spine0"] > y["r0/tor"] > y["s0/nic0"] > y["s0/gpu0"]


def test_a_tor_is_centred_over_its_rack():
    graph = collapsed_graph(preset("4-rack"))
    x = {name: pos[0] for name, pos in layered_positions(graph).items()}
    assert x["r1/tor"] == pytest.approx(sum(x[f"s{i}"] for i in range(4, 8)) / 4)


def test_a_topology_without_links_cannot_be_drawn(tmp_path):
    with pytest.raises(ValueError, match="has no links to draw"):
        draw(Topology("empty"), tmp_path / "e.png")
