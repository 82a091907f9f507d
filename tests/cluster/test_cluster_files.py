"""Topology files: builder specs and explicit graphs round-trip; every mistake names the file, key and value."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.cluster import files
from dtrain.cluster.capacity import oversubscription
from dtrain.cluster.files import TopologyFileError
from dtrain.cluster.presets import preset
from dtrain.cluster.toml_writer import toml_value

PAIR = """
name = "pair"
[[node]]
name = "s0/gpu0"
kind = "gpu"
server = "s0"
device = "h100-sxm"
[[node]]
name = "s0/gpu1"
kind = "gpu"
server = "s0"
peak_flops = 1e12
memory_bytes = 1000
memory_bytes_per_s = 2e9
[[link]]
a = "s0/gpu0"
b = "s0/gpu1"
kind = "nvlink4"
count = 6
"""


def _snapshot(topology):
    nodes = dict(topology.graph.nodes(data=True))
    links = {(link.src, link.dst): link for link in topology.links()}
    return nodes, links, topology.devices()


def test_an_explicit_file_builds_its_nodes_and_links():
    t = files.loads(PAIR)
    assert t.name == "pair" and [d.name for d in t.devices()] == ["s0/gpu0", "s0/gpu1"]
    assert t.link("s0/gpu1", "s0/gpu0").bytes_per_s == 6 * 25e9  # duplex by default


def test_a_gpu_names_a_catalogue_device():
    assert files.loads(PAIR).device("s0/gpu0").memory_bytes_per_s == 3350e9


@pytest.mark.parametrize(("rate", "bytes_per_s"), [("gbit_per_s = 100", 12.5e9), ("gbyte_per_s = 100", 100e9),
                                                   ("bytes_per_s = 7.0", 7.0)])  # fmt: skip
def test_a_link_rate_is_given_in_bits_or_bytes_and_stored_in_bytes(rate, bytes_per_s):
    t = files.loads(PAIR.replace("count = 6", rate))
    assert t.link("s0/gpu0", "s0/gpu1").bytes_per_s == bytes_per_s


def test_a_builder_spec_builds_the_preset_with_its_parameters():
    t = files.loads('name = "two"\n[build]\npreset = "4-rack"\nracks = 2\noversubscription = 8\n')
    assert (t.name, len(t.racks()), oversubscription(t, "r1/tor")) == ("two", 2, pytest.approx(8))


def test_a_builder_spec_without_a_preset_uses_the_builder_defaults():
    t = files.loads("[build]\nracks = 2\nservers_per_rack = 2\ngpus_per_server = 2\nnics = 1\n")
    assert len(t.devices()) == 8


def test_an_explicit_topology_round_trips(tmp_path):
    original = preset("4-rack", racks=2, servers_per_rack=2, gpus_per_server=2, nics=1, spines=2)
    path = files.save(original, tmp_path / "cluster.toml")
    again = files.load(path)
    assert _snapshot(again) == _snapshot(original)
    assert again.route("s0/gpu0", "s3/gpu1", flow=5) == original.route("s0/gpu0", "s3/gpu1", flow=5)


def test_links_of_different_rates_each_way_round_trip_one_way_each(tmp_path):
    back = '[[link]]\na = "s0/gpu1"\nb = "s0/gpu0"\nkind = "nvlink4"\ncount = 2\nduplex = false\n'
    text = PAIR.replace("count = 6", "count = 6\nduplex = false") + back
    again = files.load(files.save(files.loads(text), tmp_path / "t.toml"))
    assert again.link("s0/gpu0", "s0/gpu1").bytes_per_s == 150e9
    assert again.link("s0/gpu1", "s0/gpu0").bytes_per_s == 50e9


def test_a_builder_spec_round_trips(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text(files.dumps_build("b", preset="4-rack", racks=2, oversubscription=16.0))
    assert _snapshot(files.load(path)) == _snapshot(preset("4-rack", racks=2, oversubscription=16))


BAD = [
    (PAIR.replace('kind = "nvlink4"', 'kind = "nvlink7"'), r"link\[0\]\.kind = 'nvlink7': unknown link kind"),
    (PAIR.replace('b = "s0/gpu1"', 'b = "s9/gpu1"'), r"link\[0\]\.b = 's9/gpu1': a link to an unknown node"),
    (PAIR.replace("count = 6", "gbit_per_s = -100"), r"link\[0\]\.gbit_per_s = -100: a rate must be a number > 0"),
    (PAIR.replace("count = 6", "count = 0"), r"link\[0\]\.count = 0: must be a whole number >= 1"),
    (PAIR.replace("count = 6", "latency_s = -1e-6"), r"link\[0\]\.latency_s = -1e-06: must be .* >= 0"),
    (PAIR.replace("count = 6", "gbit_per_s = 1\ngbyte_per_s = 1"), r"give one rate, not both gbit_per_s and"),
    (PAIR.replace("count = 6", "colour = 1"), r"link\[0\]\.colour = 1: unknown key"),
    (PAIR.replace('kind = "gpu"\nserver = "s0"\ndevice', 'kind = "tpu"\nserver = "s0"\ndevice'),
     r"node\[0\]\.kind = 'tpu': unknown node kind"),
    (PAIR.replace('"h100-sxm"', '"h900"'), r"node\[0\]\.device = 'h900': unknown device"),
    (PAIR.replace("memory_bytes = 1000", "memory_bytes = -1"),
     r"node\[1\]\.memory_bytes = -1: device memory must be a number of bytes >= 1"),
    (PAIR.replace("memory_bytes = 1000\n", ""), r"node\[1\]\.memory_bytes = None: a gpu needs"),
    (PAIR.replace('device = "h100-sxm"', 'device = "h100-sxm"\nmemory_bytes = 0'),
     r"node\[0\]\.memory_bytes = 0: device memory must be a number of bytes >= 1"),
    (PAIR.replace('device = "h100-sxm"', 'device = "h100-sxm"\nmemory_bytes_per_s = -1.0'),
     r"node\[0\]\.memory_bytes_per_s = -1\.0: must be a number > 0"),
    (PAIR.replace('device = "h100-sxm"', 'device = "h100-sxm"\nprecision = "fp32"\npeak_flops = 1e12'),
     r"node\[0\]\.peak_flops = .*: give precision or peak_flops, not both"),
    (PAIR.replace("peak_flops = 1e12", 'peak_flops = 1e12\nprecision = "fp32"'),
     r"node\[1\]\.precision = 'fp32': picks a catalogue device's peak; needs device"),
    (PAIR.split("[[node]]")[0] + '[[node]]\nname = "s0/cpu0"\nkind = "cpu"\nserver = "s0"\n',
     r'node: no GPU; a topology needs at least one \[\[node\]\] with kind = "gpu"'),
    ("node = []\n", r"node: no GPU"),
    (PAIR.replace('name = "s0/gpu1"', 'name = "s0/gpu0"'), r"node\[1\]\.name = 's0/gpu0': duplicate node name"),
    (PAIR + '[[link]]\na = "s0/gpu0"\nb = "s0/gpu1"\nkind = "pcie4x16"\n', r"link\[1\] = .*duplicate link"),
    (PAIR.replace('kind = "gpu"\nserver = "s0"\ndevice', 'kind = "cpu"\nserver = "s0"\ndevice'),
     r"node\[0\]\.device = 'h100-sxm': only a gpu node has a device; this node is a cpu"),
    (PAIR.replace('server = "s0"\ndevice', 'server = 0\ndevice'), r"node\[0\]\.server = 0: must be a string"),
    ("[build]\noversubscription = 0.5\n", r"build\.oversubscription = 0\.5: must be a ratio >= 1"),
    ("[build]\nracks = -2\n", r"build\.racks = -2: must be a whole number >= 1"),
    ("[build]\nracks = 0\n", r"build\.racks = 0: must be a whole number >= 1"),
    ("[build]\nnic = \"ethernet300\"\n", r"build\.nic = 'ethernet300': unknown link kind"),
    ("[build]\npreset = \"8-rack\"\n", r"build\.preset = '8-rack': unknown preset; known: dgx-a100"),
    ("[build]\nwings = 2\n", r"build\.wings = 2: unknown parameter"),
    ("[build]\ngpudirect_rdma = 1\n", r"build\.gpudirect_rdma = 1: must be true or false"),
    ("[build]\ndevice = 100\n", r"build\.device = 100: must be a string"),
    ("[build]\nintra = \"bridge\"\n", r"\[build\]: server intra 'bridge' is not one of"),
    ("[build]\nracks = 3\npods = 2\n", r"3 racks do not split into 2 equal pods"),
    ("[build]\n" + PAIR, r"either \[build\] or \[\[node\]\]/\[\[link\]\], not both"),
    ('name = "empty"\n', r"build = None: missing"),
    ("speed = 3\n", r"speed = 3: unknown key"),
    ("[build\n", r"not valid TOML"),
    (PAIR.replace('server = "s0"\npeak', 'peak'), r"node\[1\]\.server = None: a gpu needs the name of its server"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m.split(":")[0][:40] for _, m in BAD])
def test_a_bad_file_names_the_file_the_key_and_the_value(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(TopologyFileError, match=message) as caught:
        files.load(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_devices_that_cannot_reach_each_other_are_inconsistent():
    text = PAIR.replace("[[link]]", "[[nope]]").split("[[nope]]")[0]
    with pytest.raises(TopologyFileError, match="inconsistent topology: device 's0/gpu1' cannot be reached"):
        files.loads(text, source="lonely.toml")


def test_a_figure_beside_a_catalogue_device_replaces_the_catalogue_s():
    t = files.loads(PAIR.replace('device = "h100-sxm"', 'device = "h100-sxm"\nmemory_bytes = 40e9'))
    h100 = t.device("s0/gpu0")
    assert h100.memory_bytes == 40 * 10**9 and h100.memory_bytes_per_s == 3350e9  # the rest stays the catalogue's


def test_a_file_that_is_not_utf8_is_named_in_one_line(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('name = "caf\u00e9"\n[build]\npreset = "h100-node"\n'.encode("latin-1"))
    with pytest.raises(TopologyFileError) as caught:
        files.load(path)
    assert str(caught.value) == f"{path}: not UTF-8 text (byte 0xe9 on line 1); a topology file is TOML, which is UTF-8"


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(TopologyFileError, match="missing.toml: cannot read topology file"):
        files.load(tmp_path / "missing.toml")


@given(st.text(max_size=40))
def test_any_string_survives_the_hand_written_toml(text):
    assert tomllib.loads(f"x = {toml_value(text)}")["x"] == text


@given(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**63), 2**63 - 1) | st.booleans())
def test_any_number_survives_the_hand_written_toml(value):
    assert tomllib.loads(f"x = {toml_value(value)}")["x"] == value


@settings(max_examples=15, deadline=None)
@given(racks=st.integers(1, 3), servers=st.integers(1, 2), gpus=st.integers(1, 3), spines=st.integers(1, 3),
       intra=st.sampled_from(["nvswitch", "nvlink-mesh", "pcie"]), ratio=st.sampled_from([1, 2.5, 4, 16]))  # fmt: skip
def test_every_built_cluster_round_trips_through_a_file(racks, servers, gpus, spines, intra, ratio):
    original = preset("4-rack", racks=racks, servers_per_rack=servers, gpus=gpus, nics=1, spines=spines, intra=intra,
                      oversubscription=ratio)  # fmt: skip
    assert _snapshot(files.loads(files.dumps(original))) == _snapshot(original)
