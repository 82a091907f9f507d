"""The peer-transport model: a schedule's pull plan priced pass by pass, host against GPU; one call of the
exchange kernel priced as its copy in, one barrier and its reads."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.sim import peer_model
from dtrain.sim.api_passes import api_passes
from dtrain.sim.peer_model import PeerCost, exchange_form, exchange_time, fit_peer_cost, peer_time

COST = PeerCost(
    pair_bytes_per_s=300e9,
    fanin_bytes_per_s=200e9,
    local_bytes_per_s=2e12,
    barrier_s=6e-6,
    host_call_s=25e-6,
    host_barrier_s=5e-6,
    host_launch_s=6e-6,
)


def test_a_ring_all_reduce_costs_its_barriers_its_one_peer_passes_and_one_chunk_copied_in():
    n = 64 << 20
    t = peer_time(registry.build(Collective.ALL_REDUCE, "ring", 4), n, COST)
    want = 7 * COST.barrier_s + 6 * (n / 4) / COST.pair_bytes_per_s + (n / 4) / COST.local_bytes_per_s
    assert t.gpu_s == pytest.approx(want)
    assert t.time_s == t.gpu_s  # 64 MiB: the GPU, not the host, sets the pace


def test_a_pushed_ring_all_reduce_costs_a_barrier_a_round_and_one_more_its_pushes_and_a_final_fold():
    n = 64 << 20
    cost = PeerCost(**{**COST.__dict__, "push_bytes_per_s": 350e9})
    t = peer_time(registry.build(Collective.ALL_REDUCE, "ring", 4), n, cost, push=True)
    # no copy-in; 6 pushes of a quarter; the chunk that arrived last is folded into x after the last barrier
    want = 7 * COST.barrier_s + 6 * (n / 4) / 350e9 + (n / 4) / COST.local_bytes_per_s
    assert t.gpu_s == pytest.approx(want) and t.barriers == 7
    assert peer_time(registry.build(Collective.ALL_REDUCE, "ring", 4), n, COST, push=True).gpu_s == pytest.approx(
        7 * COST.barrier_s + 6 * (n / 4) / COST.pair_bytes_per_s + (n / 4) / COST.local_bytes_per_s
    )  # no push rate given: the pair rate


def test_a_pass_reading_several_peers_goes_at_the_fan_in_rate():
    n = 64 << 20
    direct = peer_time(registry.build(Collective.REDUCE_SCATTER, "direct", 4), n, COST)
    # one pass reads 3 peers' blocks of n/4 at once, then the last barrier; the own block is copied in first
    want = 2 * COST.barrier_s + 3 * (n / 4) / COST.fanin_bytes_per_s + 3 * (n / 4) / COST.local_bytes_per_s
    assert direct.gpu_s == pytest.approx(want)


def test_small_calls_are_host_bound_and_a_replayed_call_has_no_host_time():
    schedule = registry.build(Collective.ALL_REDUCE, "ring", 4)
    eager = peer_time(schedule, 16 << 10, COST)
    assert eager.time_s == eager.host_s > eager.gpu_s
    assert eager.host_s == pytest.approx(
        COST.host_call_s + eager.barriers * COST.host_barrier_s + eager.launches * COST.host_launch_s
    )
    replayed = peer_time(schedule, 16 << 10, COST, replayed=True)
    assert replayed.host_s == 0 and replayed.time_s == replayed.gpu_s


def test_recursive_doubling_pays_a_second_barrier_a_round():
    t = peer_time(registry.build(Collective.ALL_REDUCE, "recursive_doubling", 4), 1 << 20, COST)
    assert t.barriers == 4  # before round 0, after it, before round 1, at the end


def test_the_host_terms_are_recovered_from_points_the_model_made():
    truth = COST
    base = PeerCost(pair_bytes_per_s=300e9, fanin_bytes_per_s=200e9, local_bytes_per_s=2e12, barrier_s=6e-6)
    points = []
    for algorithm in ("ring", "halving_doubling", "direct", "recursive_doubling"):
        schedule = registry.build(Collective.ALL_REDUCE, algorithm, 4)
        for n in (16 << 10, 256 << 10):
            points.append((schedule, n, peer_time(schedule, n, truth).time_s, False))
    fitted = fit_peer_cost(points, base, gpu=False)
    assert fitted.host_call_s == pytest.approx(truth.host_call_s, rel=1e-6)
    assert fitted.host_barrier_s == pytest.approx(truth.host_barrier_s, rel=1e-6)
    assert fitted.host_launch_s == pytest.approx(truth.host_launch_s, rel=1e-6)


@pytest.mark.parametrize("field", ["pair_bytes_per_s", "fanin_bytes_per_s", "local_bytes_per_s"])
def test_a_rate_that_is_not_positive_is_refused(field):
    kwargs = {"pair_bytes_per_s": 1.0, "fanin_bytes_per_s": 1.0, "local_bytes_per_s": 1.0, "barrier_s": 0.0}
    with pytest.raises(ValueError, match=field):
        PeerCost(**{**kwargs, field: 0.0})


def test_a_replayed_call_costs_its_host_replay_time_and_the_fit_takes_it_from_small_replays():
    schedule = registry.build(Collective.ALL_REDUCE, "ring", 4)
    cost = PeerCost(**{**COST.__dict__, "host_replay_s": 30e-6})
    small = peer_time(schedule, 16 << 10, cost, replayed=True)
    assert small.host_s == 30e-6 and small.time_s == max(small.gpu_s, 30e-6)
    big = peer_time(schedule, 1 << 30, cost, replayed=True)
    assert big.time_s == big.gpu_s  # a large replay is the GPU's
    points = [(schedule, n, t, True) for n, t in ((16 << 10, 28e-6), (64 << 10, 30e-6), (256 << 10, 33e-6))]
    fitted = fit_peer_cost(points, COST, gpu=False)
    assert fitted.host_replay_s == pytest.approx(30e-6)


def test_the_api_s_clone_and_copy_out_are_local_passes_and_launches_around_a_reduce_scatter():
    n = 64 << 20
    schedule = registry.build(Collective.REDUCE_SCATTER, "ring", 4)
    alone = peer_time(schedule, n, COST)
    call = peer_time(schedule, n, COST, api=api_passes(schedule, n))
    # every rank clones the n-byte input before the first barrier and copies its n/4 block out after the last
    assert call.gpu_s == pytest.approx(alone.gpu_s + (n + n / 4) / COST.local_bytes_per_s)
    assert call.host_s == pytest.approx(alone.host_s + 2 * COST.host_launch_s)
    assert (call.api_launches, call.launches) == (2, alone.launches + 2)


def test_a_replayed_call_still_launches_the_api_s_own_operations():
    schedule = registry.build(Collective.ALL_TO_ALL, "direct", 4)
    cost = PeerCost(**{**COST.__dict__, "host_replay_s": 30e-6})
    t = peer_time(schedule, 16 << 10, cost, replayed=True, api=api_passes(schedule, 16 << 10))
    assert t.host_s == pytest.approx(30e-6 + 2 * COST.host_launch_s)  # the clone in, the copy out
    assert t.time_s == t.host_s


@pytest.mark.parametrize("push", [False, True])
def test_an_averaging_all_reduce_pays_one_division_over_the_buffer_after_its_schedule(push):
    n = 64 << 20
    schedule = registry.build(Collective.ALL_REDUCE, "ring", 4)
    alone = peer_time(schedule, n, COST, push=push)
    call = peer_time(schedule, n, COST, push=push, api=api_passes(schedule, n, op="avg"))
    assert call.gpu_s == pytest.approx(alone.gpu_s + n / COST.local_bytes_per_s)
    assert peer_time(schedule, n, COST, push=push, api=api_passes(schedule, n)).gpu_s == alone.gpu_s  # sum: none


def test_api_passes_for_another_world_are_refused():
    schedule = registry.build(Collective.ALL_GATHER, "ring", 4)
    with pytest.raises(ValueError, match="2 ranks' passes for a schedule of 4"):
        peer_time(schedule, 1 << 20, COST, api=api_passes(registry.build(Collective.ALL_GATHER, "ring", 2), 1 << 20))


def test_the_replay_host_time_is_fitted_net_of_the_api_s_launches():
    schedule = registry.build(Collective.REDUCE_SCATTER, "ring", 4)
    api = api_passes(schedule, 16 << 10)
    points = [(schedule, 16 << 10, 30e-6 + 2 * COST.host_launch_s, True, False, api)]
    assert fit_peer_cost(points, COST, gpu=False).host_replay_s == pytest.approx(30e-6)


@pytest.mark.parametrize("push", [False, True])
def test_every_operation_costs_gpu_op_s_of_gpu_time_besides_its_bytes(push):
    n = 64 << 20
    schedule = registry.build(Collective.ALL_REDUCE, "ring", 4)
    cost = PeerCost(**{**COST.__dict__, "gpu_op_s": 5e-6})
    alone, with_ops = peer_time(schedule, n, COST, push=push), peer_time(schedule, n, cost, push=push)
    # the ring's ranks are alike, so every operation a rank launches is on the critical path once
    assert with_ops.gpu_s == pytest.approx(alone.gpu_s + with_ops.launches * 5e-6)
    assert with_ops.host_s == alone.host_s


def test_the_api_s_operations_cost_gpu_op_s_each_too():
    n = 64 << 20
    schedule = registry.build(Collective.REDUCE_SCATTER, "ring", 4)
    cost = PeerCost(**{**COST.__dict__, "gpu_op_s": 5e-6})
    api = api_passes(schedule, n)
    alone, call = peer_time(schedule, n, cost), peer_time(schedule, n, cost, api=api)
    # the copy into the work buffer before the first barrier, the block copied out after the last
    assert call.gpu_s == pytest.approx(alone.gpu_s + (n + n / 4) / COST.local_bytes_per_s + 2 * 5e-6)


def test_a_negative_gpu_op_s_is_refused():
    with pytest.raises(ValueError, match="gpu_op_s"):
        PeerCost(**{**COST.__dict__, "gpu_op_s": -1e-6})


def test_a_small_replay_its_gpu_time_explains_does_not_raise_the_replay_host_time():
    ring = registry.build(Collective.ALL_REDUCE, "ring", 4)
    doubling = registry.build(Collective.ALL_REDUCE, "recursive_doubling", 4)
    n = 16 << 10
    ring_gpu = peer_time(ring, n, COST, replayed=True).gpu_s  # 7 barriers: 42 us
    assert peer_time(doubling, n, COST, replayed=True).gpu_s < 28e-6 < ring_gpu
    # two ring replays a little slower than their GPU time, one doubling replay held up by the host at 28 us:
    # the median of the three (44 us) would price the doubling at 44 us; 28 us explains all three best
    points = [(ring, n, ring_gpu * 1.05, True), (ring, n, ring_gpu * 1.05, True), (doubling, n, 28e-6, True)]
    assert fit_peer_cost(points, COST, gpu=False).host_replay_s == pytest.approx(28e-6)


MIB = 1 << 20


def test_an_exchange_kernel_all_gather_copies_in_passes_one_barrier_and_reads_three_peers_at_the_fan_in_rate():
    cost = replace(COST, gpu_op_s=4e-6)
    t = exchange_time("gather", 4, 2 * MIB, cost, host_s=20e-6)
    # 2 MiB a rank: 128 chunks of 2048 8-byte words, 64 programs of 2 chunks each, together at the full rates
    copy_in, reads, own = 2 * MIB / 2e12, 3 * 2 * MIB / 200e9, 2 * MIB / 2e12
    assert t.programs == 64
    assert t.gpu_s == pytest.approx(4e-6 + copy_in + 6e-6 + reads + own)
    assert t.time_s == t.gpu_s  # 6 MiB over NVLink: above the host's 20 us
    two = exchange_time("gather", 2, 2 * MIB, cost)  # one peer: the pair rate
    assert two.read_s == pytest.approx(2 * MIB / 300e9 + own)


def test_a_small_exchange_kernel_call_runs_few_programs_and_is_host_bound():
    # an 8 KiB one-shot all-reduce of float32: one chunk of 2048 elements, one program at a 32nd of each rate
    t = exchange_time("reduce", 4, 8192, COST, host_s=26.5e-6)
    assert t.programs == 1
    want = 8192 / (2e12 / 32) + 6e-6 + 3 * 8192 / (200e9 / 32) + 8192 / (2e12 / 32)
    assert t.gpu_s == pytest.approx(want)  # 1.7 us of bytes, 6 us of barrier, no launch time in COST
    assert t.time_s == 26.5e-6


def test_the_broadcast_s_readers_share_the_root_s_port_and_a_reduce_scatter_reads_one_block_of_each():
    t = exchange_time("broadcast", 4, 2 * MIB, COST)
    assert t.copy_in_s == pytest.approx(2 * MIB / 2e12)  # the root's copy in
    assert t.read_s == pytest.approx(2 * MIB / (200e9 / 3))  # three readers of the root at a third of the port
    assert exchange_time("broadcast", 2, 2 * MIB, COST).read_s == pytest.approx(2 * MIB / 300e9)
    rs = exchange_time("scatter", 4, 8 * MIB, COST)  # four 2 MiB blocks in, one 2 MiB block of every rank read
    assert rs.copy_in_s == pytest.approx(8 * MIB / 2e12)
    assert rs.read_s == pytest.approx(3 * 2 * MIB / 200e9 + 2 * MIB / 2e12)


def test_the_two_shot_reads_twice_and_the_relay_sends_the_root_s_buffer_once():
    """The two-shot all-reduce: a reduce-scatter's reads and two stores, a second barrier, an all-gather's reads;
    the scatter-allgather broadcast: each reader takes a third of the buffer from the root's port, then the
    other two thirds from the two other readers, after a second barrier."""
    two = exchange_time("two_shot", 4, 8 * MIB, COST)
    assert two.copy_in_s == pytest.approx(8 * MIB / 2e12)
    assert two.read_s == pytest.approx(2 * 3 * 2 * MIB / 200e9 + 3 * 2 * MIB / 2e12 + 6e-6)
    relay = exchange_time("relay", 4, 6 * MIB, COST)
    assert relay.copy_in_s == pytest.approx(6 * MIB / 2e12)  # the root's three shares
    first = 2 * MIB / (200e9 / 3) + 2 * 2 * MIB / 2e12
    assert relay.read_s == pytest.approx(first + 6e-6 + 2 * 2 * MIB / 200e9)
    star = exchange_time("broadcast", 4, 6 * MIB, COST)
    assert relay.time_s < star.time_s  # the root's port carries the buffer once


def test_exchange_form_takes_the_runtime_s_collectives_and_limits():
    assert exchange_form("all_gather", "direct", 8 * MIB) == "gather"
    assert exchange_form("all_gather", "direct", 8 * MIB + 4) is None
    assert exchange_form("all_reduce", "one_shot", 256 << 10) == "reduce"
    assert exchange_form("all_reduce", "one_shot", 512 << 10) is None  # torch's one-shot kernel
    assert exchange_form("all_reduce", "direct", 64 << 20) == "two_shot"
    assert exchange_form("all_reduce", "direct", (64 << 20) + 4) is None  # torch's two-shot kernel
    assert exchange_form("broadcast", "star", 8192) == "broadcast"
    assert exchange_form("broadcast", "scatter_allgather", 8 * MIB) == "relay"
    assert exchange_time("relay", 2, 8192, COST) == exchange_time("broadcast", 2, 8192, COST)  # as the runtime
    with pytest.raises(ValueError, match="form 'ring'"):
        exchange_time("ring", 4, 8192, COST)


def test_the_exchange_kernel_s_figures_are_the_runtime_s():
    """dtrain.sim imports no torch: the runtime's constants are read from its source."""
    peer = Path(__file__).resolve().parents[2] / "dtrain" / "comm" / "peer"
    source = (peer / "fused.py").read_text() + (peer / "kernels.py").read_text()

    def value(name: str) -> int:
        return eval(re.search(rf"^{name} = (.+)$", source, re.M).group(1))  # a constant expression such as 8 << 20

    names = ("ONE_PASS_MAX_BYTES", "REDUCE_MAX_BYTES", "TWO_SHOT_MAX_BYTES", "EXCHANGE_BLOCK", "EXCHANGE_PROGRAMS")
    for name in (*names, "EXCHANGE_PAIRS", "TWO_SHOT_PROGRAMS"):
        assert getattr(peer_model, name) == value(name), name
    pattern = r"\(Collective\.(\w+), \"(\w+)\"\): \"(\w+)\""  # fused.ONE_PASS's entries
    one_pass = {(c.lower(), a): f for c, a, f in re.findall(pattern, source)}
    assert one_pass and one_pass.items() <= peer_model.EXCHANGE_FORMS.items()
    assert set(peer_model.EXCHANGE_FORMS) - set(one_pass) == {("all_reduce", "one_shot"), ("all_reduce", "direct")}
