"""The peer-memory model's terms (dtrain.sim.peer_model), by hand-worked sums: one GPU's port shared by
concurrent transfers, the lone and curved fan-in rates, and a peer copy's own fixed time and rate."""

from __future__ import annotations

import pytest

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.peer_model import PeerCost, _fanin_rate, _phases, _port_loads, peer_time

KIB, MIB = 1 << 10, 1 << 20


def _cost(**kw) -> PeerCost:
    base = {"pair_bytes_per_s": 1e11, "fanin_bytes_per_s": 5e10, "local_bytes_per_s": 1e13, "barrier_s": 0.0}
    return PeerCost(**{**base, **kw})


def _copy_cost(**kw) -> PeerCost:
    return PeerCost(pair_bytes_per_s=1e11, fanin_bytes_per_s=1e11, local_bytes_per_s=1e12, barrier_s=0.0, **kw)


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


def test_a_broadcast_pulls_with_plain_copies_and_a_reduce_with_reductions():
    # star broadcast: every non-root copies the root's buffer (one plain copy); star reduce: the root adds
    bcast = _phases(registry.build(Collective.BROADCAST, "star", 4, root=0), 1024, 4)
    reduce = _phases(registry.build(Collective.REDUCE, "star", 4, root=0), 1024, 4)
    assert max(sum(ph[3] for ph in rank) for rank in bcast) == 1
    assert all(ph[3] == 0 for rank in reduce for ph in rank)


def test_the_peer_copy_terms_price_only_plain_copies():
    bcast = registry.build(Collective.BROADCAST, "star", 4, root=0)
    reduce = registry.build(Collective.REDUCE, "star", 4, root=0)
    n = 64 * KIB
    base = _copy_cost()
    slow_copies = _copy_cost(gpu_peer_copy_s=5e-6, peer_copy_bytes_per_s=5e10)
    # the broadcast's one copy: 5 us more, and its 64 KiB at half the rate
    added = peer_time(bcast, n, slow_copies).gpu_s - peer_time(bcast, n, base).gpu_s
    assert added == pytest.approx(5e-6 + n / 5e10 - n / 1e11, rel=1e-9)
    # the reduce has none
    assert peer_time(reduce, n, slow_copies).gpu_s == pytest.approx(peer_time(reduce, n, base).gpu_s, rel=1e-12)
    # unset, a copy costs gpu_op_s like any operation
    assert (
        peer_time(bcast, n, _copy_cost(gpu_op_s=2e-6)).gpu_s
        == peer_time(bcast, n, _copy_cost(gpu_op_s=2e-6, gpu_peer_copy_s=None)).gpu_s
    )
    with pytest.raises(ValueError, match="gpu_peer_copy_s"):
        _copy_cost(gpu_peer_copy_s=-1.0)
    with pytest.raises(ValueError, match="peer_copy_bytes_per_s"):
        _copy_cost(peer_copy_bytes_per_s=0.0)
