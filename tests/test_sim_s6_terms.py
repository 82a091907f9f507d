"""Session 6's model terms, by hand-worked sums: a peer copy's own fixed time and rate (dtrain.sim.peer_model),
NCCL's protocols and its smaller chunks for smaller calls (dtrain.sim.nccl)."""

from __future__ import annotations

import pytest

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.sim.nccl import PROTOCOL_EFFICIENCY, NcclParams, pieces, simulate_nccl
from dtrain.sim.peer_model import PeerCost, _phases, peer_time
from dtrain.sim.transports import Transport

KIB, MIB = 1 << 10, 1 << 20


def _cost(**kw) -> PeerCost:
    return PeerCost(pair_bytes_per_s=1e11, fanin_bytes_per_s=1e11, local_bytes_per_s=1e12, barrier_s=0.0, **kw)


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
    base = _cost()
    slow_copies = _cost(gpu_peer_copy_s=5e-6, peer_copy_bytes_per_s=5e10)
    # the broadcast's one copy: 5 us more, and its 64 KiB at half the rate
    added = peer_time(bcast, n, slow_copies).gpu_s - peer_time(bcast, n, base).gpu_s
    assert added == pytest.approx(5e-6 + n / 5e10 - n / 1e11, rel=1e-9)
    # the reduce has none
    assert peer_time(reduce, n, slow_copies).gpu_s == pytest.approx(peer_time(reduce, n, base).gpu_s, rel=1e-12)
    # unset, a copy costs gpu_op_s like any operation
    assert (
        peer_time(bcast, n, _cost(gpu_op_s=2e-6)).gpu_s
        == peer_time(bcast, n, _cost(gpu_op_s=2e-6, gpu_peer_copy_s=None)).gpu_s
    )
    with pytest.raises(ValueError, match="gpu_peer_copy_s"):
        _cost(gpu_peer_copy_s=-1.0)
    with pytest.raises(ValueError, match="peer_copy_bytes_per_s"):
        _cost(peer_copy_bytes_per_s=0.0)


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
