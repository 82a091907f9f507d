"""The symbolic checker proves every registered algorithm, and catches schedules that are wrong."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.comm.ir.algorithms import build, names, needs_local_size
from dtrain.comm.ir.check import check
from dtrain.comm.ir.schedule import (
    ROOTED_COLLECTIVES,
    Collective,
    Schedule,
    ScheduleError,
    Transfer,
    make_schedule,
)

WORLDS = range(1, 17)
REGISTERED = [(coll, name) for coll in Collective for name in names(coll)]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def variants(coll: Collective, name: str, world: int) -> list[dict]:
    """Every root, every local size and two pipeline depths that ``name`` takes on ``world`` ranks."""
    roots = list(range(world)) if coll in ROOTED_COLLECTIVES else [None]
    local_sizes = divisors(world) if needs_local_size(name) else [None]
    return [
        {"root": root, "local_size": local, "pipeline": pipeline}
        for root in roots
        for local in local_sizes
        for pipeline in (1, 3)
    ]


def rebuilt(schedule: Schedule, rounds: list[list[Transfer]]) -> Schedule:
    return make_schedule(
        schedule.collective,
        schedule.algorithm,
        schedule.world_size,
        rounds,
        chunks_per_block=schedule.chunks_per_block,
        root=schedule.root,
    )


# ---------------------------------------------------------------- the registry


def test_every_family_registers_its_algorithms():
    expected = {
        Collective.ALL_REDUCE: {"ring", "tree", "recursive_doubling", "halving_doubling", "direct", "one_shot", "star"}
        | {"hierarchical"},
        Collective.BROADCAST: {"ring", "tree", "star", "hierarchical"},
        Collective.REDUCE: {"ring", "tree", "star", "hierarchical"},
        Collective.ALL_GATHER: {"ring", "recursive_doubling", "direct", "star", "hierarchical"},
        Collective.REDUCE_SCATTER: {"ring", "halving_doubling", "direct", "star", "hierarchical"},
        Collective.GATHER: {"tree", "star"},
        Collective.SCATTER: {"tree", "star"},
        Collective.ALL_TO_ALL: {"direct", "star"},
        Collective.SCAN: {"recursive_doubling", "linear"},
        Collective.BARRIER: {"dissemination"},
    }
    for coll, want in expected.items():
        assert want <= set(names(coll)), coll


# ---------------------------------------------------------------- correctness


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("coll", "name"), REGISTERED, ids=[f"{c.value}-{n}" for c, n in REGISTERED])
def test_checker_proves_algorithm(coll, name, world):
    for kwargs in variants(coll, name, world):
        schedule = build(coll, name, world, **kwargs)
        assert schedule.world_size == world
        report = check(schedule)
        assert report.num_rounds == schedule.num_rounds


@pytest.mark.parametrize(("coll", "name"), REGISTERED, ids=[f"{c.value}-{n}" for c, n in REGISTERED])
def test_world_of_one_needs_no_rounds(coll, name):
    schedule = build(coll, name, 1, root=0 if coll in ROOTED_COLLECTIVES else None, local_size=1)
    assert schedule.rounds == ()
    check(schedule)


@given(data=st.data(), world=st.integers(min_value=1, max_value=48))
@settings(max_examples=60, deadline=None)
def test_checker_proves_algorithms_on_larger_worlds(data, world):
    coll, name = data.draw(st.sampled_from(REGISTERED))
    root = data.draw(st.integers(0, world - 1)) if coll in ROOTED_COLLECTIVES else None
    local = data.draw(st.sampled_from(divisors(world))) if needs_local_size(name) else None
    pipeline = data.draw(st.integers(1, 4))
    check(build(coll, name, world, root=root, local_size=local, pipeline=pipeline))


@given(data=st.data(), world=st.integers(min_value=2, max_value=10))
@settings(max_examples=80, deadline=None)
def test_every_transfer_is_needed(data, world):
    """Dropping any one transfer of any algorithm breaks it, and the checker notices."""
    coll, name = data.draw(st.sampled_from(REGISTERED))
    root = data.draw(st.integers(0, world - 1)) if coll in ROOTED_COLLECTIVES else None
    local = data.draw(st.sampled_from(divisors(world))) if needs_local_size(name) else None
    schedule = build(coll, name, world, root=root, local_size=local)
    rounds = [list(r) for r in schedule.rounds]
    i = data.draw(st.integers(0, len(rounds) - 1))
    del rounds[i][data.draw(st.integers(0, len(rounds[i]) - 1))]
    with pytest.raises(ScheduleError):
        check(rebuilt(schedule, rounds))


def test_hierarchical_rejects_local_size_that_does_not_divide_world():
    with pytest.raises(ValueError, match="local_size"):
        build(Collective.ALL_REDUCE, "hierarchical", 6, local_size=4)
    with pytest.raises(ValueError, match="local_size"):
        build(Collective.ALL_REDUCE, "hierarchical", 6, local_size=None)


def test_star_rejects_hub_outside_world():
    with pytest.raises(ValueError, match="outside world"):
        build(Collective.ALL_REDUCE, "star", 4, root=4)


# ---------------------------------------------------------------- the checker catches broken schedules


def _all_reduce_two_ranks(*rounds: list[Transfer]) -> Schedule:
    return make_schedule(Collective.ALL_REDUCE, "broken", 2, rounds)


def test_checker_catches_double_counting():
    bad = _all_reduce_two_ranks([Transfer(0, 1, 0, 0, reduce=True)], [Transfer(0, 1, 0, 0, reduce=True)])
    with pytest.raises(ScheduleError, match="expected"):
        check(bad)


def test_checker_catches_missing_contribution():
    bad = _all_reduce_two_ranks([Transfer(0, 1, 0, 0)], [Transfer(1, 0, 0, 0)])
    with pytest.raises(ScheduleError, match="expected"):
        check(bad)


def test_checker_catches_read_of_undefined_chunk():
    bad = make_schedule(Collective.BROADCAST, "broken", 3, [[Transfer(1, 2, 0, 0)]], root=0)
    with pytest.raises(ScheduleError, match="holds nothing"):
        check(bad)


def test_checker_catches_copy_and_reduce_into_one_chunk():
    bad = make_schedule(Collective.ALL_REDUCE, "broken", 3, [[Transfer(1, 0, 0, 0), Transfer(2, 0, 0, 0, reduce=True)]])
    with pytest.raises(ScheduleError, match="copy together"):
        check(bad)


def test_checker_catches_rank_outside_world():
    bad = _all_reduce_two_ranks([Transfer(0, 2, 0, 0, reduce=True)])
    with pytest.raises(ScheduleError, match="outside world"):
        check(bad)


def test_checker_catches_round_that_reads_a_write_of_the_same_round():
    """Ring all-reduce squeezed into one round per phase is wrong: reads see the start of the round."""
    ring = build(Collective.ALL_REDUCE, "ring", 4)
    squeezed = [[t for r in ring.rounds[:3] for t in r], [t for r in ring.rounds[3:] for t in r]]
    with pytest.raises(ScheduleError):
        check(rebuilt(ring, squeezed))


# ---------------------------------------------------------------- round counts the theory predicts


@pytest.mark.parametrize("world", WORLDS)
def test_round_counts_match_theory(world):
    log2_ceil = math.ceil(math.log2(world))

    def rounds(coll: Collective, name: str, **kwargs) -> int:
        return build(coll, name, world, **kwargs).num_rounds

    assert rounds(Collective.ALL_REDUCE, "ring") == 2 * (world - 1)
    assert rounds(Collective.ALL_GATHER, "ring") == world - 1
    for coll in (Collective.BROADCAST, Collective.REDUCE, Collective.GATHER, Collective.SCATTER):
        assert rounds(coll, "tree", root=world - 1) == log2_ceil
    assert rounds(Collective.ALL_REDUCE, "tree") == 2 * log2_ceil
    assert rounds(Collective.SCAN, "recursive_doubling") == log2_ceil
    assert rounds(Collective.BARRIER, "dissemination") == log2_ceil
    assert rounds(Collective.SCAN, "linear", pipeline=3) == (world - 1 + 2 if world > 1 else 0)
    assert rounds(Collective.ALL_TO_ALL, "direct") == min(1, world - 1)
    assert rounds(Collective.ALL_REDUCE, "direct") == min(2, 2 * (world - 1))
    assert rounds(Collective.ALL_REDUCE, "star") == min(2, 2 * (world - 1))
    power_of_two = world & (world - 1) == 0
    extra = 0 if power_of_two else 2
    assert rounds(Collective.ALL_REDUCE, "recursive_doubling") == int(math.log2(world)) + extra
    assert rounds(Collective.ALL_GATHER, "recursive_doubling") == int(math.log2(world)) + extra
    assert rounds(Collective.REDUCE_SCATTER, "halving_doubling") == int(math.log2(world)) + extra
    assert rounds(Collective.ALL_REDUCE, "halving_doubling") == 2 * int(math.log2(world)) + extra
    for local in divisors(world):
        nodes = world // local
        ring_rounds = 2 * (local - 1) + 2 * (nodes - 1)
        tree_rounds = math.ceil(math.log2(local)) + math.ceil(math.log2(nodes))
        assert rounds(Collective.ALL_REDUCE, "hierarchical", local_size=local) == ring_rounds
        assert rounds(Collective.BROADCAST, "hierarchical", root=0, local_size=local) == tree_rounds


@pytest.mark.parametrize(
    ("coll", "name"),
    [
        (Collective.BROADCAST, "tree"),
        (Collective.REDUCE, "tree"),
        (Collective.GATHER, "tree"),
        (Collective.SCATTER, "tree"),
        (Collective.ALL_REDUCE, "recursive_doubling"),
        (Collective.ALL_GATHER, "recursive_doubling"),
        (Collective.ALL_REDUCE, "halving_doubling"),
        (Collective.REDUCE_SCATTER, "halving_doubling"),
        (Collective.SCAN, "recursive_doubling"),
    ],
)
def test_logarithmic_algorithms_send_to_one_partner_a_round(coll, name):
    for world in WORLDS:
        schedule = build(coll, name, world, root=0 if coll in ROOTED_COLLECTIVES else None)
        for round_ in schedule.rounds:
            partners: dict[int, set[int]] = {}
            for t in round_:
                partners.setdefault(t.src, set()).add(t.dst)
            assert all(len(p) == 1 for p in partners.values()), (world, round_)


def test_star_all_to_all_relays_every_non_hub_pair_through_the_hub():
    schedule = build(Collective.ALL_TO_ALL, "star", 6)
    assert all(0 in (t.src, t.dst) for t in schedule.transfers())
