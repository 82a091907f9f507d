"""``dtrain calc`` against figures worked by hand (data-parallel gradient traffic, transfers, oversubscription),
and the CLI's JSON."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtrain.cli.cluster import parse_count, parse_quantity
from dtrain.cli.main import main
from dtrain.cluster.calc import (
    all_reduce_times,
    averaging,
    gradient_bytes,
    oversubscription_ratio,
    rate,
    transfer_seconds,
)

GPT3 = 175e9  # GPT-3's 175 billion parameters (Brown et al. 2020)


def test_a_175b_model_in_fp32_makes_700_gb_of_gradients_per_replica():
    # one 4-byte gradient per parameter: 175e9 x 4 = 7e11 bytes
    assert gradient_bytes(GPT3, 4) == 700e9


def test_averaging_3_replicas_gathers_1_4_tb_into_one_and_broadcasts_1_4_tb_back():
    naive = averaging(700e9, 3, rate("ethernet200"))[0]
    assert naive.method == "gather-broadcast"
    assert naive.busiest_replica_bytes == pytest.approx(1.4e12)  # 700 GB x (3 - 1)
    assert naive.total_bytes == pytest.approx(2 * 1.4e12)


def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_gradients_per_replica():
    ring = averaging(700e9, 3, rate(gbit_per_s=200))[1]
    assert ring.busiest_replica_bytes == pytest.approx(2 * 2 / 3 * 700e9)
    assert ring.seconds == pytest.approx(2 * 2 / 3 * 700e9 / 25e9)


def test_one_terabyte_over_200_gbit_per_s_takes_40_seconds():
    # 200 Gb/s carries 200e9 / 8 = 25e9 bytes a second, so 1e12 bytes take 1e12 / 25e9 = 40 s
    assert transfer_seconds(1e12, rate(gbit_per_s=200)) == 40.0
    assert transfer_seconds(1e12, rate("ib-hdr")) == pytest.approx(40.0, abs=1e-5)


def test_the_same_terabyte_over_200_gbyte_per_s_takes_5_seconds():
    assert transfer_seconds(1e12, rate(gbyte_per_s=200)) == 5.0


def test_two_10_gbit_servers_into_one_10_gbit_uplink_is_1_to_2():
    ten = rate(gbit_per_s=10).bytes_per_s
    assert oversubscription_ratio(2, ten, ten) == 2.0


def test_a_rate_comes_from_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of a link kind, gbit_per_s or gbyte_per_s"):
        rate("ethernet100", gbit_per_s=100)


def test_twelve_nvlink3_links_are_an_a100s_300_gbyte_per_s():
    assert rate("nvlink3", count=12).bytes_per_s == 300e9


def test_all_reduce_times_use_the_closed_forms_with_the_links_alpha_and_beta():
    link = rate(gbit_per_s=200, latency_s=1e-5)
    times = {t.algorithm: t.seconds for t in all_reduce_times(1e9, 4, link)}
    assert times["ring"] == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * 1e9 / 25e9)
    assert times["tree"] == pytest.approx(2 * 2 * (1e-5 + 1e9 / 25e9))
    assert "hierarchical" not in times


def test_hierarchical_all_reduce_is_priced_with_the_node_structure():
    inter, intra = rate("ib-hdr", latency_s=0.0), rate("nvlink3", count=12, latency_s=0.0)
    times = all_reduce_times(8e9, 16, inter, local_size=8, intra=intra)
    by_name = {t.algorithm: t.seconds for t in times}
    # ring reduce-scatter (7 steps of n/8) and all-gather inside nodes, ring of n/16 across 2 nodes
    expected = 2 * 7 * 1e9 / 300e9 + 2 * 1 * 0.5e9 / 25e9
    assert by_name["hierarchical"] == pytest.approx(expected)
    assert times[0].algorithm == "hierarchical"


def _json(capsys, *argv):
    assert main(["calc", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_gradients_reports_700_gb_a_replica_and_1_4_tb_into_the_gatherer(capsys):
    data = _json(capsys, "gradients", "--params", "175e9", "--bytes-per-param", "4", "--replicas", "3",
                 "--link", "ethernet200")  # fmt: skip
    assert data["gradient_bytes"] == 700e9
    assert data["averaging"][0]["busiest_replica_bytes"] == pytest.approx(1.4e12)
    assert data["link"]["gbit_per_s"] == 200


def test_cli_transfer_reads_sizes_with_decimal_prefixes(capsys):
    assert _json(capsys, "transfer", "--bytes", "1TB", "--gbit-per-s", "200")["seconds"] == 40.0


def test_cli_oversubscription_of_the_4_rack_preset_is_1_to_4(capsys):
    data = _json(capsys, "oversubscription", "--topology", "4-rack")
    assert [round(s["ratio"], 9) for s in data["switches"]] == [4.0] * 4


def test_cli_oversubscription_from_rates(capsys):
    data = _json(capsys, "oversubscription", "--servers", "16", "--link", "ethernet25", "--uplinks", "4",
                 "--uplink-link", "ethernet25")  # fmt: skip
    assert data["switches"][0]["ratio"] == 4.0
    # at 1:4, each 25 Gb/s server gets a quarter of its rate across racks when all send at once
    assert data["switches"][0]["server_share_bytes_per_s"] == pytest.approx(25e9 / 8 / 4)


def test_cli_allreduce_lists_every_algorithm_fastest_first(capsys):
    data = _json(capsys, "allreduce", "--bytes", "700GB", "--ranks", "3", "--link", "ethernet200")
    seconds = [row["seconds"] for row in data["algorithms"]]
    assert seconds == sorted(seconds) and {"ring", "tree", "halving_doubling"} <= {
        row["algorithm"] for row in data["algorithms"]
    }


def test_cli_prints_a_table_without_json(capsys):
    assert main(["calc", "transfer", "--bytes", "1TB", "--link", "ethernet200"]) == 0
    assert "40 s" in capsys.readouterr().out


def test_cli_without_a_link_is_an_error_naming_the_flags(capsys):
    assert main(["calc", "transfer", "--bytes", "1TB"]) == 2
    assert "give --link KIND, --gbit-per-s or --gbyte-per-s" in capsys.readouterr().err


def test_cli_unknown_link_kind_is_an_error(capsys):
    assert main(["calc", "transfer", "--bytes", "1TB", "--link", "ethernet300"]) == 2
    assert "unknown link kind 'ethernet300'" in capsys.readouterr().err


def test_cli_links_lists_the_catalogue(capsys):
    keys = [row["key"] for row in _json(capsys, "links")["links"]]
    assert {"nvlink5", "pcie6x16", "ib-ndr", "ethernet400", "hbm2e-a100"} <= set(keys)


def test_cli_topology_saves_a_file_that_loads_again(capsys, tmp_path):
    path = tmp_path / "two.toml"
    assert main(["topology", "4-rack", "--set", "racks=2", "--save", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["racks"], summary["devices"]) == (2, 64)
    assert main(["topology", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["links"] == summary["links"]


def test_cli_paths_shows_gpudirect_skipping_host_memory(capsys):
    rows = {row["path"]: row for row in _json(capsys, "paths", "--bytes", "1GB", "--network", "ethernet100")["paths"]}
    assert not rows["gpudirect-rdma"]["through_host_memory"] and rows["tcp"]["host_copies"] == 2
    assert rows["gpudirect-rdma"]["seconds"] < rows["rdma"]["seconds"] < rows["tcp"]["seconds"]
    assert rows["tcp"]["protocol"] == "tcp-ip"


def test_cli_topology_draws_a_png(capsys, tmp_path):
    path = tmp_path / "rack.png"
    assert main(["topology", "dgx-a100", "--set", "gpus=2", "--set", "nics=1", "--draw", str(path), "--json"]) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("text", "value"), [("175e9", 175e9), ("700GB", 700e9), ("1TB", 1e12), ("1.5T", 1.5e12),
                                             ("64KiB", 65536), ("1GiB", 2**30), ("4096", 4096)])  # fmt: skip
def test_quantities_use_decimal_prefixes_and_binary_ones_when_asked(text, value):
    assert parse_quantity(text) == value


def test_a_parameter_count_ending_in_b_is_refused_as_ambiguous():
    assert parse_count("175G") == 175e9
    with pytest.raises(argparse.ArgumentTypeError, match="ambiguous"):
        parse_count("175B")


@given(replicas=st.integers(2, 4096), gradient=st.floats(1.0, 1e13))
def test_the_ring_never_loads_one_replica_more_than_gathering_does(replicas, gradient):
    gather, ring = averaging(gradient, replicas, rate(gbit_per_s=100))
    assert ring.busiest_replica_bytes <= gather.busiest_replica_bytes * (1 + 1e-12)
    assert ring.total_bytes == pytest.approx(gather.total_bytes)  # the same bytes, spread out


def test_cli_topology_route_lists_one_path_per_spine(capsys):
    assert main(["topology", "4-rack", "--set", "spines=3", "--route", "r0/tor", "r2/tor", "--json"]) == 0
    paths = json.loads(capsys.readouterr().out)["route"]["paths"]
    assert [p["nodes"][1] for p in paths] == ["spine0", "spine1", "spine2"]
    assert {p["bottleneck_bytes_per_s"] for p in paths} == {800e9 / 4 / 3}


def test_cli_topology_set_reads_booleans(capsys):
    assert main(["topology", "4-rack", "--set", "gpudirect_rdma=false", "--route", "s0/gpu0", "s4/gpu0",
                 "--json"]) == 0  # fmt: skip
    nodes = json.loads(capsys.readouterr().out)["route"]["paths"][0]["nodes"]
    assert "s0/cpu0" in nodes or "s0/cpu1" in nodes


@pytest.mark.parametrize("text", ["x", "1.2.3", "700GB", "175B", "1e"])
def test_every_suggestion_of_a_bad_params_value_is_itself_accepted(text, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["calc", "gradients", "--params", text, "--gbit-per-s", "200"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "--params" in last
    suggested = re.findall(r"\b\d[\w.]*", last.replace(repr(text), ""))  # the examples the message gives
    assert suggested, last
    for example in suggested:
        assert parse_count(example) > 0, (example, err)


@pytest.mark.parametrize("text", ["x", "1.2.3", "12 parsecs"])
def test_every_suggestion_of_a_bad_bytes_value_is_itself_accepted(text):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse_quantity(text)
    message = str(error.value)
    for example in re.findall(r"\b\d[\w.]*", message.replace(repr(text), "")):
        assert parse_quantity(example) > 0, (example, str(error.value))
