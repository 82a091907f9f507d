"""The catalogue: bits and bytes kept apart, figures as the datasheets and specifications give them, GPUDirect
paths."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtrain.cluster import units
from dtrain.cluster.catalogue import LINKS, NVLINK_TABLE, NVSWITCHES, PROTOCOLS, link_spec, protocol_spec
from dtrain.cluster.devices import DEVICES, device_spec, make_device
from dtrain.cluster.paths import DataPath, Hop, gpu_paths


def test_100_gbit_ethernet_is_12_5e9_bytes_per_s():
    assert units.gbit_per_s_to_bytes_per_s(100) == 12.5e9
    assert LINKS["ethernet100"].bytes_per_s == 12.5e9


def test_200_gbit_per_s_is_25_gbyte_per_s():
    assert units.bytes_per_s_to_gbyte_per_s(units.gbit_per_s_to_bytes_per_s(200)) == 25.0


def test_gbyte_per_s_figures_are_not_divided_by_eight():
    assert units.gbyte_per_s_to_bytes_per_s(25) == 25e9
    assert LINKS["nvlink3"].bytes_per_s == 25e9


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_bit_and_byte_conversions_invert_each_other(gbit):
    assert math.isclose(units.bytes_per_s_to_gbit_per_s(units.gbit_per_s_to_bytes_per_s(gbit)), gbit)
    assert math.isclose(units.bytes_per_s_to_gbyte_per_s(units.gbyte_per_s_to_bytes_per_s(gbit)), gbit)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "100", True])
def test_conversions_reject_non_rates(bad):
    with pytest.raises(ValueError, match="gbit_per_s"):
        units.gbit_per_s_to_bytes_per_s(bad)


@pytest.mark.parametrize("row", NVLINK_TABLE, ids=lambda r: f"nvlink{r.generation}")
def test_nvlink_table_signalling_times_lanes_is_the_per_direction_rate(row):
    # Gb/s per lane x lanes, in bits, equals the table's GB/s per direction, in bytes.
    gbit = row.signaling_gbit_per_s * row.lanes_per_link
    assert units.gbit_per_s_to_bytes_per_s(gbit) == units.gbyte_per_s_to_bytes_per_s(
        row.gbyte_per_s_per_direction_per_link
    )


@pytest.mark.parametrize("row", NVLINK_TABLE, ids=lambda r: f"nvlink{r.generation}")
def test_nvlink_per_chip_figure_is_links_times_both_directions(row):
    spec = LINKS[f"nvlink{row.generation}"]
    assert spec.bidirectional_bytes_per_s == row.gbyte_per_s_total_per_link * 1e9
    assert 2 * spec.chip_bytes_per_s == row.gbyte_per_s_per_chip * 1e9


def test_a100_nvlink_is_600_gbyte_per_s_both_ways_as_the_a100_datasheet_says():
    # 12 NVLink 3 links x 25 GB/s a direction x 2 directions
    assert 2 * LINKS["nvlink3"].chip_bytes_per_s == 600e9


def test_h100_nvlink_is_seven_times_pcie5_x16_as_the_h100_datasheet_says():
    # 900 GB/s of NVLink 4 against 128 GB/s of PCIe 5.0 x16, both counted both ways
    ratio = LINKS["nvlink4"].chip_bytes_per_s / LINKS["pcie5x16"].bytes_per_s
    assert ratio == pytest.approx(900 / 128, rel=0.02)


def test_pcie4_x16_is_about_32_gbyte_per_s_each_way_and_64_both():
    # 16 GT/s x 16 lanes x 128/130 / 8 bits = 31.5 GB/s a direction, usually rounded to 32 (64 both ways).
    assert LINKS["pcie4x16"].bytes_per_s == pytest.approx(32e9, rel=0.02)
    assert LINKS["pcie4x16"].bidirectional_bytes_per_s == pytest.approx(64e9, rel=0.02)


def test_each_pcie_generation_doubles_the_last_within_encoding_overhead():
    rates = [LINKS[f"pcie{g}x16"].bytes_per_s for g in (3, 4, 5, 6)]
    for slow, fast in zip(rates, rates[1:], strict=False):
        assert fast / slow == pytest.approx(2, rel=0.05)


def test_a100_hbm_dwarfs_its_pcie_as_the_a100_datasheet_says():
    # 1935 GB/s of HBM2e against 31.5 GB/s of PCIe 4.0 x16
    assert LINKS["hbm2e-a100"].bytes_per_s == 1935e9
    assert LINKS["hbm2e-a100"].bytes_per_s > 30 * LINKS["pcie4x16"].bytes_per_s


@pytest.mark.parametrize(("key", "gbit"), [("ib-edr", 100), ("ib-hdr", 200), ("ib-ndr", 400), ("ethernet10", 10)])
def test_network_links_are_quoted_in_gbit_per_s(key, gbit):
    assert LINKS[key].quoted == f"{gbit} Gb/s"
    assert units.bytes_per_s_to_gbit_per_s(LINKS[key].bytes_per_s) == gbit


def test_every_link_names_its_source():
    for spec in LINKS.values():
        assert spec.source and spec.quoted, spec.key


def test_unknown_link_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown link kind 'nvlink9'.*nvlink3"):
        link_spec("nvlink9")


def test_nvswitch_gives_each_gpu_its_whole_nvlink_rate():
    assert NVSWITCHES["nvswitch2"].gpu_bytes_per_s == 300e9  # A100: 12 x 25 GB/s each way
    assert NVSWITCHES["nvswitch3"].gpu_bytes_per_s == 450e9  # H100: 18 x 25 GB/s each way


def test_rdma_protocols_bypass_the_kernel_and_sockets_do_not():
    assert {k for k, p in PROTOCOLS.items() if p.kernel_bypass} == {"ib-rdma", "roce-v2", "iwarp"}
    assert not protocol_spec("ipoib").zero_copy
    assert protocol_spec("roce-v2").routable and not protocol_spec("ib-rdma").routable


def test_device_specs_carry_the_datasheet_figures():
    assert device_spec("a100-sxm").flops("bf16") == 312e12
    assert device_spec("a100-pcie").memory_bytes_per_s == 1935e9
    assert device_spec("h200-sxm").memory_bytes == 141e9
    assert all(spec.flops("bf16") > spec.flops("fp32") for spec in DEVICES.values())


def test_make_device_uses_the_training_precision():
    device = make_device("h100-sxm", name="s0/gpu0", server="s0", precision="fp32")
    assert device.peak_flops == pytest.approx(66.9e12)
    with pytest.raises(ValueError, match="FP8 linear layers are a layout's choice"):
        make_device("h100-sxm", name="s0/gpu0", server="s0", precision="fp8")
    with pytest.raises(ValueError, match="unknown precision 'int4'"):
        make_device("h100-sxm", name="s0/gpu0", server="s0", precision="int4")
    assert device_spec("h100-sxm").flops("fp8") == 1978.9e12 and not device_spec("a100-sxm").has("fp8")
    with pytest.raises(ValueError, match="has no fp8 products"):
        device_spec("a100-sxm").flops("fp8")


def test_gpudirect_paths_skip_host_memory_and_the_others_do_not():
    paths = gpu_paths()
    skip = {name for name, path in paths.items() if not path.through_host_memory}
    assert skip == {"p2p-pcie", "p2p-nvlink", "gpudirect-rdma"}


@pytest.mark.parametrize(("direct", "staged"), [("p2p-pcie", "gpudirect-shm"), ("gpudirect-shm", "staged"),
                                                ("gpudirect-rdma", "rdma"), ("rdma", "tcp")])  # fmt: skip
def test_each_copy_saved_makes_a_gigabyte_faster(direct, staged):
    paths = gpu_paths()
    assert paths[direct].transfer_s(1e9) < paths[staged].transfer_s(1e9)


def test_p2p_over_pcie_streams_at_the_pcie_rate():
    path = gpu_paths()["p2p-pcie"]
    assert path.transfer_s(1e9) == pytest.approx(path.latency_s + 1e9 / LINKS["pcie4x16"].bytes_per_s)


def test_gpudirect_rdma_is_bound_by_the_network_not_pcie():
    assert gpu_paths(network="ethernet100")["gpudirect-rdma"].bottleneck_bytes_per_s == 12.5e9


def test_a_path_that_skips_host_memory_cannot_copy_in_it():
    with pytest.raises(ValueError, match="host copies on a path that skips host memory"):
        DataPath(name="bad", segments=((Hop(kind="pcie4x16"),),), host_copies=1)


def test_the_docs_catalogue_table_has_every_link_with_its_rate():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    for spec in LINKS.values():
        assert f"| `{spec.key}` | {spec.name} | {spec.bytes_per_s / 1e9:.4g} |" in docs, spec.key
