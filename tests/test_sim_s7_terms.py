"""Session 7's model terms, by hand-worked sums: one GPU's port shared by concurrent transfers, the lone and
curved fan-in rates (dtrain.sim.peer_model); NCCL's gather, scatter and reduce (dtrain.sim.nccl)."""

from __future__ import annotations

import pytest

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.nccl import NcclParams, ring_steps, simulate_nccl
from dtrain.sim.peer_model import PeerCost, _fanin_rate, _phases, _port_loads, peer_time
from dtrain.sim.transports import Transport

MIB = 1 << 20


def _cost(**kw) -> PeerCost:
    base = {"pair_bytes_per_s": 1e11, "fanin_bytes_per_s": 5e10, "local_bytes_per_s": 1e13, "barrier_s": 0.0}
    return PeerCost(**{**base, **kw})


def _star(coll: Collective):
    return registry.build(coll, "star", 4, root=0)


def test_the_readers_of_one_gpu_share_its_port():
    # star broadcast, pulled: ranks 1-3 each copy the root's n bytes in one stretch. Alone a copy takes n / pair;
    # through the root's port, 3 n / port
    n = 4 * MIB
    bcast = _star(Collective.BROADCAST)
    loads = _port_loads([ph[1] for ph in (rank[1] for rank in _phases(bcast, n // 4, 4))], push=False)
    assert loads == ([3.0 * n, 0.0, 0.0, 0.0], [0.0, n, n, n])
    free = peer_time(bcast, n, _cost()).gpu_s
    shared = peer_time(bcast, n, _cost(port_bytes_per_s=2e11)).gpu_s
    assert shared - free == pytest.approx(3 * n / 2e11 - n / 1e11, rel=1e-9)
    # a port fast enough for all three leaves the pair rate in charge
    assert peer_time(bcast, n, _cost(port_bytes_per_s=1e13)).gpu_s == pytest.approx(free, rel=1e-12)


def test_pushes_into_one_gpu_share_its_port():
    # star gather, pushed: ranks 1-3 each store their n/4 into the root at once
    n = 64 * MIB
    gather = _star(Collective.GATHER)
    free = peer_time(gather, n, _cost(), push=True).gpu_s
    shared = peer_time(gather, n, _cost(port_bytes_per_s=1.5e11), push=True).gpu_s
    assert shared - free == pytest.approx(3 * (n / 4) / 1.5e11 - (n / 4) / 1e11, rel=1e-9)


def test_a_ring_crosses_each_port_once_each_way_so_sharing_changes_nothing():
    n = 16 * MIB
    ring = registry.build(Collective.ALL_REDUCE, "ring", 4)
    assert peer_time(ring, n, _cost(port_bytes_per_s=1.5e11)).gpu_s == pytest.approx(
        peer_time(ring, n, _cost()).gpu_s, rel=1e-12
    )


def test_a_lone_fan_in_reads_at_its_own_rate_and_a_crowded_one_at_the_fan_in_rate():
    n = 16 * MIB
    reduce = _star(Collective.REDUCE)  # the root sums three peers' n bytes; nobody reads the root meanwhile
    base = peer_time(reduce, n, _cost()).gpu_s  # 3n at the fan-in rate
    lone = peer_time(reduce, n, _cost(lone_fanin_bytes_per_s=2e11)).gpu_s
    assert base - lone == pytest.approx(3 * n / 5e10 - 3 * n / 2e11, rel=1e-9)
    # unset, the lone rate is the port's
    assert peer_time(reduce, n, _cost(port_bytes_per_s=2e11)).gpu_s == pytest.approx(lone, rel=1e-12)
    # the direct all-reduce's first round: every rank reads every peer, so each is read meanwhile: not lone
    direct = registry.build(Collective.ALL_REDUCE, "direct", 4)
    assert peer_time(direct, n, _cost(lone_fanin_bytes_per_s=2e11)).gpu_s == pytest.approx(
        peer_time(direct, n, _cost()).gpu_s, rel=1e-12
    )


def test_the_fan_in_curve_interpolates_in_log_bytes_and_holds_at_its_ends():
    cost = _cost(fanin_curve=((1 * MIB, 1e11), (4 * MIB, 2e11)))
    assert _fanin_rate(cost, 0.5 * MIB, lone=False) == 1e11
    assert _fanin_rate(cost, 2 * MIB, lone=False) == pytest.approx(1.5e11)  # halfway in log bytes
    assert _fanin_rate(cost, 64 * MIB, lone=False) == 2e11
    assert _fanin_rate(_cost(), 2 * MIB, lone=False) == 5e10  # no curve: the one rate
    for bad in (((1.0, 0.0),), ((2.0, 1.0), (1.0, 1.0)), ((1.0,),)):
        with pytest.raises(ValueError, match="fanin_curve"):
            _cost(fanin_curve=bad)
    with pytest.raises(ValueError, match="port_bytes_per_s"):
        _cost(port_bytes_per_s=0.0)


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
