"""dtrain.sim.collective: schedules replayed on a uniform star equal their closed forms (dtrain.comm.cost.model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.cluster.topology import Topology
from dtrain.comm.cost.model import CostParams, LinkCost, predict
from dtrain.comm.ir import algorithms
from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Collective
from dtrain.sim.api_passes import api_passes
from dtrain.sim.collective import Job, SoftwareCost, rank_rounds, replay, replay_concurrent
from tests.sim.test_sim_topologies import GB, device, star

RATE = 10 * GB
HOP_S = 1e-6
ALPHA_S = 20e-6
MEMORY_BYTES_PER_S = 1.5e12


def closed_form(collective: str, algorithm: str, nbytes: int, world: int) -> float:
    # the closed forms' alpha is a round's whole start-up: host time plus the two hops' latency
    link = LinkCost(alpha_s=ALPHA_S + 2 * HOP_S, beta_s_per_byte=1 / RATE, gamma_s_per_byte=3 / MEMORY_BYTES_PER_S)
    return predict(collective, algorithm, nbytes, world, CostParams(intra=link))


def simulated(collective: str, algorithm: str, nbytes: int, world: int) -> float:
    topo = star(world, bytes_per_s=RATE, latency_s=HOP_S, memory_bytes_per_s=MEMORY_BYTES_PER_S)
    schedule = algorithms.build(Collective(collective), algorithm, world)
    return replay(schedule, nbytes, topo, cost=SoftwareCost(alpha_s=ALPHA_S), itemsize=1).time_s


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving_doubling", "recursive_doubling"])
@pytest.mark.parametrize("nbytes", [8 * 2**10, 64 * 2**20])
def test_all_reduce_on_a_uniform_star_matches_its_closed_form(algorithm: str, world: int, nbytes: int) -> None:
    expected = closed_form("all_reduce", algorithm, nbytes, world)
    assert simulated("all_reduce", algorithm, nbytes, world) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(
    ("collective", "algorithm"),
    [("all_gather", "ring"), ("reduce_scatter", "ring"), ("broadcast", "tree"), ("reduce", "tree")],
)
def test_other_collectives_on_a_uniform_star_match_their_closed_forms(collective: str, algorithm: str) -> None:
    nbytes = 8 * 2**20
    expected = closed_form(collective, algorithm, nbytes, 8)
    assert simulated(collective, algorithm, nbytes, 8) == pytest.approx(expected, rel=1e-3)


def test_ring_on_a_star_is_bottlenecked_by_no_link_more_than_another() -> None:
    topo = star(4, bytes_per_s=RATE)
    result = replay(algorithms.build(Collective.ALL_REDUCE, "ring", 4), 2**24, topo, itemsize=1)
    utilisations = {round(u.utilisation, 6) for u in result.links}
    assert len(result.links) == 8 and len(utilisations) == 1


def test_star_all_reduce_is_bottlenecked_at_the_hub() -> None:
    topo = star(4, bytes_per_s=RATE)
    result = replay(algorithms.build(Collective.ALL_REDUCE, "star", 4), 2**24, topo, itemsize=1)
    assert result.bottleneck is not None and "g0" in result.bottleneck.link.name


def test_a_slow_link_slows_the_ring_to_its_rate() -> None:
    topo = star(4, bytes_per_s=RATE)
    slow = Topology("star4-slow")  # star(4), with g2's link to the switch at half the rate
    slow.add_node("sw", kind="switch")
    for i in range(4):
        slow.add_device(device(f"g{i}", f"s{i}"))
        slow.add_link(f"g{i}", "sw", bytes_per_s=RATE / 2 if i == 2 else RATE, latency_s=0.0, kind="test")
    schedule = algorithms.build(Collective.ALL_REDUCE, "ring", 4)
    fast_s = replay(schedule, 2**26, topo, itemsize=1).time_s
    slow_result = replay(schedule, 2**26, slow, itemsize=1)
    assert slow_result.time_s == pytest.approx(2 * fast_s, rel=0.02)
    assert slow_result.bottleneck.link.name == "g2->sw"


def test_rank_rounds_pack_one_message_per_peer_and_skip_idle_rounds() -> None:
    schedule = algorithms.build(Collective.BROADCAST, "tree", 4, root=0)
    rounds = rank_rounds(schedule, 4096, itemsize=4)
    assert [len(r) for r in rounds] == [2, 1, 2, 1]  # root sends to 2 then 1; rank 2 receives then sends to 3
    assert rounds[0][0].sends and not rounds[0][0].recvs


def test_placement_must_name_one_device_per_rank() -> None:
    schedule = algorithms.build(Collective.ALL_REDUCE, "ring", 4)
    with pytest.raises(ValueError, match="3 devices for 4 ranks"):
        replay(schedule, 1024, star(4), ["g0", "g1", "g2"])
    with pytest.raises(ValueError, match="'gx'"):
        replay(schedule, 1024, star(4), ["g0", "g1", "g2", "gx"])


def test_concurrent_collectives_share_the_links_they_both_cross() -> None:
    # two 2-rank rings whose every message crosses the single sw0-sw1 link: together they take twice as long
    topo = Topology("dumbbell")
    for s in (0, 1):
        topo.add_node(f"sw{s}", kind="switch")
        for g in (0, 1):
            topo.add_device(device(f"s{s}/g{g}", f"s{s}"))
            topo.add_link(f"s{s}/g{g}", f"sw{s}", bytes_per_s=RATE, latency_s=0.0, kind="nvlink")
    topo.add_link("sw0", "sw1", bytes_per_s=RATE, latency_s=0.0, kind="ethernet")
    schedule = algorithms.build(Collective.ALL_REDUCE, "ring", 2)
    gamma_free = SoftwareCost(gamma_s_per_byte=0.0)
    alone = replay_concurrent([Job(schedule, 2**24, ("s0/g0", "s1/g0"))], topo, cost=gamma_free, itemsize=1)
    both = replay_concurrent(
        [Job(schedule, 2**24, ("s0/g0", "s1/g0")), Job(schedule, 2**24, ("s0/g1", "s1/g1"))],
        topo,
        cost=gamma_free,
        itemsize=1,
    )
    assert both.time_s == pytest.approx(2 * alone.time_s)
    assert both.bottleneck is not None and both.bottleneck.link.kind == "ethernet"


def test_simulate_collective_reads_the_node_size_off_the_placement() -> None:
    from dtrain.sim.api import ranks_per_server, simulate_collective

    topo = Topology("two-nodes")
    for s in (0, 1):
        topo.add_node(f"sw{s}", kind="switch")
        for g in range(4):
            topo.add_device(device(f"s{s}/g{g}", f"s{s}"))
            topo.add_link(f"s{s}/g{g}", f"sw{s}", bytes_per_s=RATE, latency_s=0.0, kind="nvlink")
    topo.add_link("sw0", "sw1", bytes_per_s=RATE / 10, latency_s=0.0, kind="ethernet")
    assert ranks_per_server(topo, [d.name for d in topo.devices()]) == 4
    hierarchical = simulate_collective(topo, "all_reduce", "hierarchical", 2**24)
    ring = simulate_collective(topo, "all_reduce", "ring", 2**24)
    assert hierarchical.time_s < ring.time_s  # a quarter of the bytes cross the slow link


_ALGORITHMS = sorted(
    (c.value, a)
    for c in Collective
    if c != Collective.BARRIER
    for a in algorithms.names(c)
    if not algorithms.needs_local_size(a)
)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(_ALGORITHMS), st.integers(2, 9), st.integers(1, 4096))
def test_every_schedule_moves_its_bytes_and_no_faster_than_its_busiest_link(case, world: int, units: int) -> None:
    collective, algorithm = case
    coll = Collective(collective)
    schedule = algorithms.build(coll, algorithm, world, root=0 if coll in ROOTED_COLLECTIVES else None)
    nbytes = units * schedule.nblocks * 64
    result = replay(schedule, nbytes, star(world, bytes_per_s=RATE), itemsize=1)
    sent = [sum(sum(r.sends.values()) for r in rank) for rank in rank_rounds(schedule, nbytes, itemsize=1)]
    # on a star every message crosses two links: its sender's uplink and its receiver's downlink
    assert sum(u.nbytes for u in result.links) == pytest.approx(2 * sum(sent))
    assert result.time_s >= max(sent) / RATE * (1 - 1e-9)


def test_a_barrier_costs_its_rounds_of_tokens() -> None:
    schedule = algorithms.build(Collective.BARRIER, "dissemination", 8)
    result = replay(schedule, 0, star(8), cost=SoftwareCost(alpha_s=ALPHA_S), itemsize=1)
    assert result.time_s == pytest.approx(3 * ALPHA_S, rel=0.01)  # lg 8 rounds, one token each way


def test_the_api_s_operations_run_before_a_rank_s_first_round_and_after_its_last() -> None:
    n = 1 << 20
    topo = star(4, bytes_per_s=RATE, latency_s=HOP_S, memory_bytes_per_s=MEMORY_BYTES_PER_S)
    schedule = algorithms.build(Collective.ALL_TO_ALL, "direct", 4)
    cost = SoftwareCost(alpha_s=ALPHA_S, launch_s=5e-6, copy_s_per_byte=1e-12)
    alone = replay(schedule, n, topo, cost=cost, itemsize=1).time_s
    call = replay(schedule, n, topo, cost=cost, itemsize=1, api=api_passes(schedule, n)).time_s
    # a clone of n before, a copy of n after: two launches and 2 n bytes copied, in series with the rounds
    assert call == pytest.approx(alone + 2 * 5e-6 + 2 * n * 1e-12)


def test_the_api_s_copies_default_to_a_read_and_a_write_of_device_memory() -> None:
    n = 1 << 20
    topo = star(4, bytes_per_s=RATE, memory_bytes_per_s=MEMORY_BYTES_PER_S)
    schedule = algorithms.build(Collective.ALL_GATHER, "ring", 4)
    alone = replay(schedule, n, topo, itemsize=1).time_s
    call = replay(schedule, n, topo, itemsize=1, api=api_passes(schedule, n)).time_s
    assert call == pytest.approx(alone + (n / 4) * 2 / MEMORY_BYTES_PER_S)  # the own block copied in
