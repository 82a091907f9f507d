"""The NCCL model's terms (dtrain.sim.nccl), by hand-worked sums: its protocols and their launches, its
smaller chunks for smaller calls, and gather, scatter and reduce around a root."""

from __future__ import annotations

import pytest

from dtrain.sim.nccl import PROTOCOL_EFFICIENCY, NcclParams, pieces, ring_steps, simulate_nccl
from dtrain.sim.transports import Transport

KIB, MIB = 1 << 10, 1 << 20


def test_nccl_chunks_shrink_for_smaller_calls_down_to_64_kib():
    p = NcclParams(channels=16, slice_bytes=512 * KIB, chunk_depth=4)
    # all-gather of 4 MiB on 4 ranks: a 1 MiB block; 512 KiB slices on 16 channels leave 1 piece, so the slice
    # halves to 64 KiB (the floor): 1 MiB / (16 x 64 KiB) = 1 piece still
    assert pieces("all_gather", 4 * MIB, 4, p) == 1
    # broadcast of 16 MiB: 16 MiB / 8 MiB = 2 pieces; halved three times to 64 KiB: 16 pieces, which is 4 n
    assert pieces("broadcast", 16 * MIB, 4, p) == 16
    assert pieces("broadcast", 16 * MIB, 4, NcclParams(channels=16, slice_bytes=512 * KIB)) == 2  # depth 0: never
    assert pieces("broadcast", 1 << 30, 4, p) == 64  # large calls keep their slice (max_pieces bounds it)


def test_nccl_protocols_carry_their_flags_and_their_own_launch():
    topo = Transport(name="nvlink").topology(4)
    p = NcclParams(channel_bytes_per_s=20e9, launch_s=10e-6, ll_launch_s=3e-6, step_latency_s=0.0)
    simple = simulate_nccl(topo, "all_gather", 64 * MIB, params=p)
    ll = simulate_nccl(topo, "all_gather", 64 * MIB, params=p, protocol="ll")
    # LL moves twice the bytes (a flag per 4 data bytes) and starts 7 us sooner; 64 pieces pipeline it finely
    assert PROTOCOL_EFFICIENCY["ll"] == 0.5
    assert ll.pieces == 64
    wire = ll.kernel_s - 3e-6
    assert wire == pytest.approx(2 * (simple.kernel_s - 10e-6), rel=0.1)
    with pytest.raises(ValueError, match="protocol"):
        simulate_nccl(topo, "all_gather", MIB, params=p, protocol="ll64")
    with pytest.raises(ValueError, match="ll_launch_s"):
        NcclParams(ll_launch_s=-1.0)


def test_nccl_gather_and_scatter_are_one_grouped_step_around_the_root():
    assert ring_steps("scatter", 4, root=1) == [[(1, 0), (1, 2), (1, 3)]]
    assert ring_steps("gather", 4, root=1) == [[(0, 1), (2, 1), (3, 1)]]
    assert ring_steps("reduce", 4, root=0) == [[(1, 2)], [(2, 3)], [(3, 0)]]  # the chain ends at the root
    assert ring_steps("broadcast", 4, root=2) == [[(2, 3)], [(3, 0)], [(0, 1)]]


def test_nccl_gather_is_capped_by_the_roots_receiving_kernel_as_scatter_by_its_sending_one():
    # 4 x 450 GB/s NVLink ports, a connection of 16 x 20 GB/s = 320 GB/s: the root's three flows share it either
    # way, so the 3/4 GiB that crosses its port takes 3/4 GiB / 320 GB/s, plus launch and torch's copy of the
    # root's own quarter before the kernel
    topo = Transport(name="nvlink").topology(4)
    p = NcclParams(launch_s=10e-6, step_latency_s=0.0, channels=16, channel_bytes_per_s=20e9, max_pieces=1,
                   self_copy_bytes_per_s=2e12)  # fmt: skip
    n = 1 << 30
    hop = 2 * 0.5e-6  # GPU -> switch -> GPU
    expected = 10e-6 + (n / 4) / 2e12 + (3 * n / 4) / 320e9 + hop
    for coll in ("gather", "scatter"):
        assert simulate_nccl(topo, coll, n, params=p).time_s == pytest.approx(expected, rel=1e-6)


def test_nccl_reduce_is_the_chain_at_its_efficiency():
    topo = Transport(name="nvlink").topology(4)
    p = NcclParams(launch_s=0.0, step_latency_s=0.0, channels=1, channel_bytes_per_s=100e9, max_pieces=1)
    n = 64 * MIB
    hop = 2 * 0.5e-6
    # one piece through three hops: 3 (n / rate + hop)
    assert simulate_nccl(topo, "reduce", n, params=p).time_s == pytest.approx(3 * (n / 100e9 + hop), rel=1e-9)
    slow = NcclParams(launch_s=0.0, step_latency_s=0.0, channels=1, channel_bytes_per_s=100e9, max_pieces=1,
                      reduce_efficiency=0.8)  # fmt: skip
    assert simulate_nccl(topo, "reduce", n, params=slow).time_s == pytest.approx(3 * (n / 80e9 + hop), rel=1e-9)
    # the broadcast over the same chain ignores it
    assert simulate_nccl(topo, "broadcast", n, params=slow).time_s == pytest.approx(3 * (n / 100e9 + hop), rel=1e-9)
    with pytest.raises(ValueError, match="reduce_efficiency"):
        NcclParams(reduce_efficiency=0.0)
    with pytest.raises(ValueError, match="root"):
        simulate_nccl(topo, "reduce", n, params=p, root=4)


def test_nccl_ll_efficiency_and_the_p2p_launch_are_their_own_terms():
    topo = Transport(name="nvlink").topology(4)
    base = NcclParams(launch_s=20e-6, ll_launch_s=5e-6, channels=16, channel_bytes_per_s=20e9)
    n = 4 * MIB
    half = simulate_nccl(topo, "all_gather", n, params=base, protocol="ll").time_s
    quarter = simulate_nccl(topo, "all_gather", n, params=NcclParams(**{**base.__dict__, "ll_efficiency": 0.25}),
                            protocol="ll").time_s  # fmt: skip
    assert quarter > half * 1.5  # twice the bytes on the wires, the same start
    a2a = simulate_nccl(topo, "all_to_all", n, params=base).time_s
    sooner = NcclParams(**{**base.__dict__, "p2p_launch_s": 12e-6})
    assert a2a - simulate_nccl(topo, "all_to_all", n, params=sooner).time_s == pytest.approx(8e-6, rel=1e-6)
    # the ring collectives keep launch_s
    assert (
        simulate_nccl(topo, "all_gather", n, params=sooner).time_s
        == simulate_nccl(topo, "all_gather", n, params=base).time_s
    )


def test_the_simulator_prices_nccls_rooted_collectives_through_its_public_entry():
    from dtrain.sim import simulate_collective

    topo = Transport(name="nvlink").topology(4)
    for coll in ("gather", "scatter", "reduce"):
        got = simulate_collective(topo, coll, "native", 64 * MIB).time_s
        assert got == simulate_nccl(topo, coll, 64 * MIB).time_s
        assert got > 0
