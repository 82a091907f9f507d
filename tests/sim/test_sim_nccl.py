"""The NCCL model (dtrain.sim.nccl) against hand-worked pipelines, and the transport topologies against what
their data paths and the 4 x H200 measurements say."""

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.cluster.topology import Device, Topology
from dtrain.sim.flows import FlowNetwork
from dtrain.sim.nccl import LOCAL_OVER_CONNECTION, NcclParams, ring_closed_form, simulate_nccl
from dtrain.sim.nccl_fit import NcclPoint, coordinate_fit, fit_nccl
from dtrain.sim.transports import Transport

MB = 10**6
DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def star(n: int, bytes_per_s: float, hop_latency_s: float = 0.0) -> Topology:
    """``n`` GPUs, each one duplex link to a switch: every rank-to-rank path is two hops."""
    topo = Topology("star")
    topo.add_node("sw", kind="nvswitch", server="s")
    for i in range(n):
        topo.add_device(Device(name=f"g{i}", server="s", peak_flops=1e12, memory_bytes=10**9, memory_bytes_per_s=1e12))
        topo.add_link(f"g{i}", "sw", bytes_per_s=bytes_per_s, latency_s=hop_latency_s, kind="nvlink4")
    return topo


def test_a_message_has_left_its_sender_one_path_latency_before_it_arrives():
    # 1 MB over two 1 GB/s hops of 0.5 ms: the last byte leaves at 1 ms and lands at 2 ms
    net, seen = FlowNetwork(star(2, 1e9, hop_latency_s=0.5e-3)), {}
    net.send("g0", "g1", MB, on_sent=lambda t: seen.setdefault("sent", t), on_done=lambda t: seen.setdefault("done", t))
    net.run()
    assert seen == pytest.approx({"sent": 1e-3, "done": 2e-3})


def one_channel(**kw) -> NcclParams:
    return NcclParams(channels=1, slice_bytes=MB, **kw)


def test_two_pieces_on_two_ranks_keep_the_link_busy():
    # 2 ranks, 4 MB: a 2 MB block in 2 pieces of 1 MB, 1 ms each at 1 GB/s; two steps (reduce-scatter, all-gather)
    # on the same connection: 4 pieces back to back, 4 ms
    result = simulate_nccl(star(2, 1e9), "all_reduce", 4 * MB, params=one_channel(step_latency_s=0.0))
    assert result.pieces == 2
    assert result.time_s == pytest.approx(4e-3, rel=1e-9)


def test_a_step_latency_longer_than_a_step_stalls_the_ring():
    # as above with a 3 ms handshake: piece 0 of step 1 is ready at 1 + 3 = 4 ms, piece 1 at 5 ms: done at 6 ms
    result = simulate_nccl(star(2, 1e9), "all_reduce", 4 * MB, params=one_channel(step_latency_s=3e-3))
    assert result.time_s == pytest.approx(6e-3, rel=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("nbytes", [64 << 10, 4 << 20, 256 << 20])
@pytest.mark.parametrize("step_latency_s", [0.0, 5e-6])
def test_ring_all_reduce_on_a_uniform_star_is_the_pipelined_ring_closed_form(n, nbytes, step_latency_s):
    params = NcclParams(launch_s=3e-6, step_latency_s=step_latency_s, channels=4, slice_bytes=256 << 10)
    rate, hop = 100e9, 0.5e-6
    steps = 2 * (n - 1)
    pieces = max(1, min(params.max_pieces, math.ceil(nbytes / n / (4 * (256 << 10)))))
    t = nbytes / n / pieces / rate
    expected = 3e-6 + (steps - 1) * max(pieces * t, t + 2 * hop + step_latency_s) + pieces * t + 2 * hop
    simulated = simulate_nccl(star(n, rate, hop), "all_reduce", nbytes, params=params).time_s
    assert simulated == pytest.approx(expected, rel=1e-9)
    assert ring_closed_form("all_reduce", nbytes, n, link_bytes_per_s=rate, path_latency_s=2 * hop,
                            params=params) == pytest.approx(expected, rel=1e-9)  # fmt: skip


def test_large_all_reduce_moves_the_ring_bytes_at_the_link_rate():
    # 2 (n-1)/n x 1 GiB over 100 GB/s links: the bandwidth term alone, once the pipeline is full
    result = simulate_nccl(star(4, 100e9), "all_reduce", 1 << 30, params=NcclParams(step_latency_s=0.0))
    assert result.time_s == pytest.approx(1.5 * (1 << 30) / 100e9, rel=1e-9)


def test_chain_broadcast_overlaps_its_hops():
    # 4 ranks, 2 pieces of 1 MB, 1 ms each, 1 ms handshake: piece 1 leaves the root at 1 ms, each hop adds
    # 1 + 1 ms, so it arrives at rank 3 at 1 + 2 x 2 + 1 = 6 ms
    params = one_channel(step_latency_s=1e-3)
    assert simulate_nccl(star(4, 1e9), "broadcast", 2 * MB, params=params).time_s == pytest.approx(6e-3, rel=1e-9)


def test_all_to_all_shares_each_rank_uplink_among_its_peers():
    # each rank sends 3 blocks of 1 MB over its one 1 GB/s uplink: 3 ms
    result = simulate_nccl(star(4, 1e9), "all_to_all", 4 * MB, params=one_channel())
    assert result.time_s == pytest.approx(3e-3, rel=1e-9)
    assert result.bottleneck.utilisation == pytest.approx(1.0)


def test_connection_cap_is_channels_times_one_channel():
    params = NcclParams(channels=8, channel_bytes_per_s=5e9, step_latency_s=0.0)
    assert params.connection_cap == 40e9
    result = simulate_nccl(star(4, 100e9), "all_reduce", 1 << 30, params=params)
    assert result.time_s == pytest.approx(1.5 * (1 << 30) / 40e9, rel=1e-9)


def test_a_host_slower_than_the_kernel_sets_the_time():
    params = NcclParams(host_s=1e-3)
    result = simulate_nccl(star(4, 100e9), "all_reduce", 1 << 20, params=params)
    assert result.time_s == 1e-3 and result.kernel_s < 1e-4


# ------------------------------------------------------------------ the kernel's local copies, all-to-all


def test_a_ranks_last_received_piece_is_copied_out_before_the_call_ends():
    # 2 ranks, all-gather of 2 MB: each sends its 1 MB block in 1 ms, then copies the block it received out of
    # its receive buffer at 0.5 GB/s, 2 ms: 3 ms
    params = one_channel(step_latency_s=0.0, local_bytes_per_s=0.5e9)
    assert simulate_nccl(star(2, 1e9), "all_gather", 2 * MB, params=params).time_s == pytest.approx(3e-3, rel=1e-9)


def test_copies_wait_for_the_ranks_sends():
    # 2 ranks, all-reduce of 4 MB in 2 pieces of 1 MB (1 ms each at 1 GB/s): the connection sends step 0's pieces
    # at 0-1 and 1-2 ms, step 1's at 2-3 and 3-4 ms. Piece 0 of step 1 lands at 3 ms but the rank's kernel is
    # sending until 4 ms; then two copies of 0.5 ms at 2 GB/s: 5 ms
    params = one_channel(step_latency_s=0.0, local_bytes_per_s=2e9)
    assert simulate_nccl(star(2, 1e9), "all_reduce", 4 * MB, params=params).time_s == pytest.approx(5e-3, rel=1e-9)


def test_chain_broadcast_copies_at_the_last_rank_only():
    # as test_chain_broadcast_overlaps_its_hops: pieces reach rank 3 at 5 and 6 ms; each is then copied in 1 ms
    params = one_channel(step_latency_s=1e-3, local_bytes_per_s=1e9)
    assert simulate_nccl(star(4, 1e9), "broadcast", 2 * MB, params=params).time_s == pytest.approx(7e-3, rel=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_steps_and_copy_cost_what_nccls_memory_accesses_add_up_to(n):
    # a step counted as 3 accesses a byte, the copy (1.5 times as fast) as 2: one piece, no latency, the
    # all-reduce costs 6n-4 and the all-gather and reduce-scatter 3n-1 (n = 4: 20 and 11)
    params = NcclParams(step_latency_s=0.0, channels=1, slice_bytes=1 << 30, channel_bytes_per_s=1e9,
                        local_bytes_per_s=LOCAL_OVER_CONNECTION * 1e9)  # fmt: skip
    topo, nbytes = star(n, 100e9), n * MB
    per_access = MB / 1e9 / 3
    assert simulate_nccl(topo, "all_reduce", nbytes, params=params).time_s == pytest.approx((6 * n - 4) * per_access)
    for collective in ("all_gather", "reduce_scatter"):
        assert simulate_nccl(topo, collective, nbytes, params=params).time_s == pytest.approx((3 * n - 1) * per_access)


def test_all_to_all_peers_share_the_ranks_connection_then_it_copies_its_own_block():
    # 4 ranks, 4 MB: each rank's 3 blocks of 1 MB leave at once, 1 GB/s each under its 3 GB/s connection (the
    # 100 GB/s links do not bind): 1 ms; then its own 1 MB block copied at 1 GB/s: 2 ms
    params = NcclParams(step_latency_s=0.0, channels=1, slice_bytes=MB, channel_bytes_per_s=3e9, local_bytes_per_s=1e9)
    assert simulate_nccl(star(4, 100e9), "all_to_all", 4 * MB, params=params).time_s == pytest.approx(2e-3, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    collective=st.sampled_from(
        ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter"]
    ),
    n=st.integers(2, 8),
    nbytes=st.integers(1 << 10, 64 << 20),
    local_bytes_per_s=st.sampled_from([None, 20e9, 150e9, 2e12]),
    connection_bytes_per_s=st.sampled_from([None, 60e9]),
    step_latency_s=st.sampled_from([0.0, 0.2e-6]),
    self_copy_bytes_per_s=st.sampled_from([None, 500e9]),
    reduce_efficiency=st.sampled_from([1.0, 0.8]),
)
def test_replay_on_a_uniform_star_is_the_closed_form(
    collective,
    n,
    nbytes,
    local_bytes_per_s,
    connection_bytes_per_s,
    step_latency_s,
    self_copy_bytes_per_s,
    reduce_efficiency,
):
    # the closed form holds where a piece outlasts the step latency or is alone: here P >= 2 pieces are at least
    # 0.5 MiB (5 us at 100 GB/s), against a 0.2 us step
    channel = None if connection_bytes_per_s is None else connection_bytes_per_s / 4
    params = NcclParams(launch_s=3e-6, step_latency_s=step_latency_s, channels=4, slice_bytes=256 << 10,
                        channel_bytes_per_s=channel, local_bytes_per_s=local_bytes_per_s,
                        self_copy_bytes_per_s=self_copy_bytes_per_s, reduce_efficiency=reduce_efficiency)  # fmt: skip
    rate, hop = 100e9, 0.5e-6
    simulated = simulate_nccl(star(n, rate, hop), collective, nbytes, params=params).time_s
    expected = ring_closed_form(collective, nbytes, n, link_bytes_per_s=rate, path_latency_s=2 * hop, params=params)
    assert simulated == pytest.approx(expected, rel=1e-9)


def test_fit_ties_the_local_copy_to_the_connection_rate():
    truth = NcclParams(host_s=40e-6, launch_s=20e-6, step_latency_s=1e-6, channel_bytes_per_s=380e9 / 16,
                       local_bytes_per_s=LOCAL_OVER_CONNECTION * 380e9)  # fmt: skip
    topo = Transport(name="nvlink").topology(4)
    points = [NcclPoint(collective=c, nbytes=n, seconds=simulate_nccl(topo, c, n, params=truth).time_s)
              for c in ("all_reduce", "all_gather") for n in (1 << 20, 16 << 20, 64 << 20)]  # fmt: skip
    fitted = fit_nccl(points, topo, local_per_connection=LOCAL_OVER_CONNECTION)
    assert fitted.connection_cap == pytest.approx(380e9, rel=0.02)
    assert fitted.local_bytes_per_s == pytest.approx(LOCAL_OVER_CONNECTION * fitted.connection_cap)
    assert fitted.launch_s == pytest.approx(20e-6, rel=0.1)
    with pytest.raises(ValueError, match="local_per_connection must be > 0"):
        fit_nccl(points, topo, local_per_connection=0.0)


@pytest.mark.parametrize(
    "bad", [{"channels": 0}, {"step_latency_s": -1.0}, {"channel_bytes_per_s": 0.0}, {"local_bytes_per_s": -1.0}]
)
def test_bad_parameters_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        NcclParams(**bad)


def test_unknown_collective_and_lone_rank_are_refused():
    with pytest.raises(ValueError, match="unknown collective 'scan'"):
        simulate_nccl(star(2, 1e9), "scan", MB)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        simulate_nccl(star(2, 1e9), "all_reduce", MB, placement=["g0"])


def test_fit_recovers_the_figures_that_made_the_timings():
    truth = NcclParams(host_s=40e-6, launch_s=8e-6, step_latency_s=3e-6, channel_bytes_per_s=300e9 / 16)
    topo = Transport(name="nvlink").topology(4)

    def timing(n: int, params: NcclParams) -> float:
        return simulate_nccl(topo, "all_reduce", n, params=params).time_s

    sizes = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
    fitted = fit_nccl([NcclPoint(collective="all_reduce", nbytes=n, seconds=timing(n, truth)) for n in sizes], topo)
    assert fitted.host_s == pytest.approx(40e-6)
    assert fitted.connection_cap == pytest.approx(300e9, rel=0.02)
    # launch and step latency trade off where pieces are few; what they give together is what was timed
    for n in sizes:
        assert timing(n, fitted) == pytest.approx(timing(n, truth), rel=0.02)


def test_coordinate_fit_with_a_grid_finds_a_minimum_beside_a_flat_region():
    # the loss stops depending on x above 10 (a cap that no longer binds): golden search alone walks to the bound
    def loss(v):
        return (math.log(min(v["x"], 10.0) / 2.0)) ** 2 + (math.log(v["y"] / 50.0)) ** 2

    found = coordinate_fit(loss, {"x": 5.0, "y": 5.0}, {"x": (1.0, 1e3), "y": (1.0, 1e3)}, grid=8)
    assert found["x"] == pytest.approx(2.0, rel=1e-3) and found["y"] == pytest.approx(50.0, rel=1e-3)


# ------------------------------------------------------------------------------------------ transports


def _links(transport: str, src: str = "n0/gpu0", dst: str = "n0/gpu1") -> list[str]:
    return [link.kind for link in Transport(name=transport).topology(4).route(src, dst)]


def test_nvlink_skips_host_memory_and_shm_crosses_it_between_two_pcie_hops():
    assert _links("nvlink") == ["nvlink4", "nvlink4"]
    assert _links("shm") == ["pcie5x16", "ddr5-4800x8", "pcie5x16"]


def test_host_memory_hop_is_dram_over_its_passes():
    # DDR5-4800 x 8 channels: 307.2 GB/s; shm writes and reads each byte once, sockets six times
    assert Transport(name="shm").host_bytes_per_s == pytest.approx(153.6e9)
    assert Transport(name="socket").host_bytes_per_s == pytest.approx(51.2e9)
    assert Transport(name="nvlink").host_bytes_per_s is None


def test_all_gpus_share_the_host_memory_hop():
    # a ring all-reduce on shm: four connections through one 153.6 GB/s hop, 38.4 GB/s each
    result = simulate_nccl(Transport(name="shm").topology(4), "all_reduce", 1 << 30, params=NcclParams())
    assert result.bottleneck.link.kind == "ddr5-4800x8"
    assert 1.5 * (1 << 30) / result.time_s == pytest.approx(38.4e9, rel=0.01)


def test_socket_hop_carries_tcp_overhead_both_ends():
    topo = Transport(name="socket").topology(4)
    assert sum(link.latency_s for link in topo.route("n0/gpu0", "n0/gpu1")) == pytest.approx(2e-6 + 0.1e-6 + 20e-6)


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="unknown transport 'ib'"):
        Transport(name="ib")


def _fitted(name: str) -> Transport:
    fit = json.loads((DATA / "sim_validation-transports-summary-h200x4.jsonl").read_text().splitlines()[0])["fit"]
    figures = {k: v for k, v in fit[f"{name}/fitted"].items() if k != "host_hop_bytes_per_s"}
    return Transport(**figures)


def test_fitted_transports_preserve_the_measured_order_of_native_all_reduce():
    fit = json.loads((DATA / "sim_validation-transports-summary-h200x4.jsonl").read_text().splitlines()[0])["fit"][
        "native"
    ]
    native = NcclParams(**{k: v for k, v in fit.items() if k != "connection_bytes_per_s"})
    for nbytes in (4 << 20, 64 << 20):
        measured, simulated = {}, {}
        for name in ("nvlink", "shm", "socket"):
            rows = (json.loads(line) for line in (DATA / f"transport-{name}-h200x4.jsonl").read_text().splitlines())
            measured[name] = next(r["time_us"] for r in rows if r["algorithm"] == "native" and r["nbytes"] == nbytes)
            transport = _fitted(name)
            params = native
            if transport.kernel_cap is not None:
                params = NcclParams(**{**vars(native), "channel_bytes_per_s": transport.kernel_cap / native.channels})
            simulated[name] = simulate_nccl(transport.topology(4), "all_reduce", nbytes, params=params).time_s
        assert sorted(measured, key=measured.get) == sorted(simulated, key=simulated.get) == ["nvlink", "shm", "socket"]


def test_simulate_collective_hands_native_to_the_nccl_model():
    from dtrain.sim.api import simulate_collective

    params = NcclParams(launch_s=5e-6)
    result = simulate_collective(star(4, 100e9), "all_gather", "native", 64 << 20, nccl=params)
    assert result.time_s == simulate_nccl(star(4, 100e9), "all_gather", 64 << 20, params=params).time_s
    assert result.bottleneck.link.kind == "nvlink4"


@pytest.mark.parametrize("name", ["nvlink", "shm", "socket"])
def test_every_transport_node_is_a_valid_topology_with_every_gpu_reachable(name):
    Transport(name=name).topology(4).validate()


def test_a_few_bytes_all_reduced_cost_nccls_tree_or_ring_latency():
    from dtrain.sim.nccl import small_all_reduce_s

    # NCCL 2.17's model by hand: the tree over 56 servers of 8 GPUs, 4.4 + 2 (7 x 0.52 x 1.8 + 5 x 5.0) us, beats
    # the ring's 894 steps; on one server of 4 the ring, 3.6 + 6 x 0.47 us, beats the tree's 4.4 + 2 x 3 x 0.52
    assert small_all_reduce_s(448, 56) == pytest.approx((4.4 + 2 * (7 * 0.52 * 1.8 + 5 * 5.0)) * 1e-6)
    assert small_all_reduce_s(4, 1) == pytest.approx((3.6 + 6 * 0.47) * 1e-6)
    assert small_all_reduce_s(1, 1) == 0.0
    # the tree grows with the logarithm of the servers: 8 and 12 servers alike, 16 one level more
    assert small_all_reduce_s(64, 8) == small_all_reduce_s(96, 12) < small_all_reduce_s(128, 16)
    with pytest.raises(ValueError, match="ranks >= 1 on 1 to ranks nodes"):
        small_all_reduce_s(8, 9)
