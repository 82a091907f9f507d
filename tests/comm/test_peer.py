"""The peer-memory transport: its pull plans are race-free and compute every schedule, and every
(collective, algorithm) run through it on real Gloo processes (windows in /dev/shm) matches the reference."""

from __future__ import annotations

import glob

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.comm import Collective, algorithms
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Schedule, chunk_bounds
from dtrain.comm.peer import window as peer_window
from dtrain.comm.peer.pull import PullPlan, _compile_all, races
from tests.jobs import peer as jobs

SIZES = [0, 1, 13, 4099]


def _schedules():
    for coll in Collective:
        for algorithm in registry.names(coll):
            for world in range(1, 10):
                local = None
                if registry.needs_local_size(algorithm):
                    if world < 4 or world % 2:
                        continue
                    local = 2
                root = world - 1 if coll in ROOTED_COLLECTIVES else None
                pipeline = 3 if algorithm == "ring" and coll in (Collective.BROADCAST, Collective.REDUCE) else 1
                yield registry.build(coll, algorithm, world, root=root, pipeline=pipeline, local_size=local)


def _reference(schedule: Schedule, start: list[list[int]], bounds) -> list[list[int]]:
    """The schedule's own semantics: every round reads the state at its start."""
    bufs = [list(b) for b in start]
    for rnd in schedule.rounds:
        snap = [list(b) for b in bufs]
        for t in rnd:
            (so, n), (do, _) = bounds[t.src_chunk], bounds[t.dst_chunk]
            for i in range(n):
                value = snap[t.src][so + i]
                bufs[t.dst][do + i] = bufs[t.dst][do + i] + value if t.reduce else value
    return bufs


def _execute(plans: tuple[PullPlan, ...], start: list[list[int]], order: list[int]) -> list[list[int]]:
    """Run every rank's plan phase by phase, ranks in ``order`` within a phase, reading peers' windows live."""
    x = [list(b) for b in start]
    w = [[-(10**9)] * len(b) for b in start]  # garbage until written
    nrounds = len(plans[0].rounds)

    def copy(dst, src, ranges):
        for off, n in ranges:
            dst[off : off + n] = src[off : off + n]

    for r in order:
        copy(w[r], x[r], plans[r].rounds[0].copy_in if nrounds else ())
    for k in range(nrounds):
        for r in order:
            rnd = plans[r].rounds[k]
            for op in rnd.ops:
                for i in range(op.length):
                    acc = 0 if op.base is None else (x if op.base == "x" else w)[r][op.offset + i]
                    for peer, off in op.reads:
                        acc += w[peer][off + i]
                    if op.to_x:
                        x[r][op.offset + i] = acc
                    if op.to_w:
                        w[r][op.offset + i] = acc
            if not rnd.second_barrier and k + 1 < nrounds:
                copy(w[r], x[r], plans[r].rounds[k + 1].copy_in)
        for r in order:
            rnd = plans[r].rounds[k]
            if rnd.second_barrier:
                copy(w[r], x[r], rnd.deferred)
                if k + 1 < nrounds:
                    copy(w[r], x[r], plans[r].rounds[k + 1].copy_in)
    for r in order:
        copy(x[r], w[r], plans[r].copy_out)
    return x


@pytest.mark.parametrize(
    "schedule", list(_schedules()), ids=lambda s: f"{s.collective.value}-{s.algorithm}-{s.world_size}"
)
def test_a_pull_plan_computes_its_schedule_whatever_order_ranks_run_in(schedule):
    numel = schedule.nblocks * (2 * schedule.chunks_per_block + 1)  # uneven chunks
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    plans = _compile_all(schedule, numel)
    assert races(plans) == []
    start = [[1000 * r + i for i in range(numel)] for r in range(schedule.world_size)]
    want = _reference(schedule, start, bounds)
    ranks = list(range(schedule.world_size))
    assert _execute(plans, start, ranks) == want
    assert _execute(plans, start, ranks[::-1]) == want


def test_recursive_doubling_defers_its_window_writes_behind_a_second_barrier():
    # both partners read and write the same chunk every round: the new value may reach the window only
    # once the partner has read the old one
    schedule = registry.build(Collective.ALL_REDUCE, "recursive_doubling", 4)
    plan = _compile_all(schedule, 8)[0]
    assert all(r.second_barrier for r in plan.rounds[:-1])
    assert not plan.rounds[-1].deferred  # nobody reads the final value: no copy into the window


def test_the_ring_copies_in_one_chunk_and_writes_its_results_straight_into_the_callers_tensor():
    schedule = registry.build(Collective.ALL_REDUCE, "ring", 4)
    plan = _compile_all(schedule, 16)[1]
    assert sum(n for r in plan.rounds for _, n in r.copy_in) == 4
    assert plan.copy_out == ()
    assert not any(r.second_barrier for r in plan.rounds)


def _pairs():
    for coll in Collective:
        if coll == Collective.BARRIER:
            continue
        for algorithm in algorithms(coll.value):
            if algorithm not in ("hierarchical", "native"):
                yield coll.value, algorithm


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(("coll", "algorithm"), list(_pairs()))
def test_every_collective_through_peer_memory_matches_the_reference(pool, coll, algorithm, world):
    # every dtype on 2 and 3 ranks, one of each element width on 4 (tests/comm/test_collectives.py says why)
    problems = pool.run(jobs.check_collective, coll, algorithm, world, SIZES, every_dtype=world < 4, ranks=world)
    assert [p for per_rank in problems for p in per_rank] == []


@pytest.mark.parametrize(("coll", "algorithm"), [p for p in _pairs() if p[1] != "auto"])
def test_peer_memory_matches_torch_distributed_on_a_large_buffer(pool, coll, algorithm):
    worst = pool.run(jobs.check_against_native, coll, algorithm, 4, (1 << 15) + 3, ranks=4)
    assert max(worst) < 1e-5


def test_hierarchical_through_peer_memory(pool):
    problems = pool.run(jobs.check_collective, "all_reduce", "hierarchical", 4, SIZES, local_size=2, ranks=4)
    assert [p for per_rank in problems for p in per_rank] == []


def test_a_missing_peer_times_out_at_a_named_barrier(pool):
    answer, _ = pool.run(jobs.missing_peer, "all_reduce", "ring", 2.0, ranks=2)
    seconds, message = answer.split("|", 1)
    assert float(seconds) < 15
    assert "all_reduce/ring" in message or "peer transport set-up" in message
    assert "rank 0 (global 0)" in message


def test_ranks_that_made_different_numbers_of_windows_are_refused_alike_before_a_rendezvous(pool):
    # torch's CUDA rendezvous would hang there (pytorch/pytorch#196082): every rank must get the error
    answers = pool.run(jobs.rendezvous_counts_differ, ranks=3)
    assert all("[1, 0, 0]" in a and "#196082" in a for a in answers), answers


def test_no_window_file_outlives_its_mapping(pool):
    pool.run(jobs.check_collective, "all_reduce", "ring", 2, [5], ranks=2)
    assert glob.glob("/dev/shm/dtrain-*") == []


def test_in_a_direct_round_each_rank_reads_a_different_peer_first():
    # all-gather by direct copies: rank r takes peer r+1's block first, so no peer serves every rank at once
    schedule = registry.build(Collective.ALL_GATHER, "direct", 4)
    plans = _compile_all(schedule, 16)
    firsts = [plans[r].rounds[0].ops[0].reads[0][0] for r in range(4)]
    assert firsts == [1, 2, 3, 0]


def test_a_transfer_between_chunks_of_different_lengths_has_no_pull_form():
    from dtrain.comm.ir.schedule import Collective as C
    from dtrain.comm.ir.schedule import Schedule as S
    from dtrain.comm.ir.schedule import ScheduleError, Transfer

    odd = S(
        collective=C.ALL_REDUCE, algorithm="odd", world_size=2, rounds=((Transfer(0, 1, 0, 1),),), chunks_per_block=2
    )
    with pytest.raises(ScheduleError, match="equal lengths"):
        _compile_all(odd, 3)  # chunks of 2 and 1 elements


def test_a_rank_that_cannot_see_its_peers_windows_fails_everywhere_with_a_clear_error(pool):
    answers = pool.run(jobs.private_shm, ranks=2)
    assert "not in this rank's /dev/shm" in answers[1]
    assert "failed on some rank" in answers[0]
    assert glob.glob("/dev/shm/dtrain-*") == []


# ------------------------------------------------------------------ random schedules, element by element


def _interleaved(plans, start, rnd) -> list[list[int]] | str:
    """Run the plans with every rank's element-sized steps of a phase interleaved at random."""
    x = [list(b) for b in start]
    w = [[None] * len(b) for b in start]
    per_rank = []
    for plan in plans:
        phases = [[]]
        for rnd_ in plan.rounds:
            phases[-1] += [("in", off, n) for off, n in rnd_.copy_in]
            phases.append([("op", op) for op in rnd_.ops])
            if rnd_.second_barrier:
                phases.append([("in", off, n) for off, n in rnd_.deferred])
        phases[-1] += [("out", off, n) for off, n in plan.copy_out]
        per_rank.append(phases)
    for i in range(len(per_rank[0])):
        queues = []
        for r, phases in enumerate(per_rank):
            steps = []
            for item in phases[i]:
                if item[0] == "op":
                    steps += [(r, item[1], j) for j in range(item[1].length)]
                else:
                    steps += [(r, item, j) for j in range(item[2])]
            queues.append(steps)
        while any(queues):
            r, item, j = queues[rnd.choice([q for q, steps in enumerate(queues) if steps])].pop(0)
            if isinstance(item, tuple):
                kind, off, _ = item
                if kind == "in":
                    w[r][off + j] = x[r][off + j]
                else:
                    x[r][off + j] = w[r][off + j]
                continue
            acc = 0 if item.base is None else (x if item.base == "x" else w)[r][item.offset + j]
            for peer, off in item.reads:
                if w[peer][off + j] is None:
                    return "read a window element nobody wrote"
                acc += w[peer][off + j]
            if item.to_x:
                x[r][item.offset + j] = acc
            if item.to_w:
                w[r][item.offset + j] = acc
    return x


@st.composite
def _random_schedules(draw):
    from dtrain.comm.ir.schedule import Transfer, make_schedule

    world, nchunks, nrounds = draw(st.integers(2, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rounds = []
    for _ in range(nrounds):
        kinds: dict[tuple[int, int], bool] = {}
        transfers = []
        for _ in range(draw(st.integers(1, 3 * world))):
            src, dst = draw(st.sampled_from([(s, d) for s in range(world) for d in range(world) if s != d]))
            chunk, reduce = draw(st.integers(0, nchunks - 1)), draw(st.booleans())
            dst_chunk = draw(st.sampled_from([chunk, draw(st.integers(0, nchunks - 1))]))
            if kinds.get((dst, dst_chunk), reduce) != reduce or kinds.get((dst, dst_chunk)) is False:
                continue  # at most one copy into a chunk a round, never with reduces
            kinds[(dst, dst_chunk)] = reduce
            transfers.append(Transfer(src, dst, chunk, dst_chunk, reduce))
        rounds.append(transfers)
    schedule = make_schedule(Collective.ALL_REDUCE, "random", world, rounds, chunks_per_block=nchunks)
    return schedule, nchunks * draw(st.sampled_from([0, 1, 3]))  # equal chunks: any chunk may feed any other


@settings(max_examples=150, deadline=None)
@given(_random_schedules(), st.randoms(use_true_random=False))
def test_any_schedule_pulled_with_ranks_interleaved_element_by_element_computes_its_rounds(case, rnd):
    schedule, numel = case
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    plans = _compile_all(schedule, numel)
    assert races(plans) == []
    start = [[1000 * r + i + 1 for i in range(numel)] for r in range(schedule.world_size)]
    assert _interleaved(plans, start, rnd) == _reference(schedule, start, bounds)


@pytest.mark.parametrize(("text", "want"), [("", 0), ("4096", 4096), ("64M", 64 << 20), ("2GiB", 2 << 30)])
def test_windows_can_be_made_at_a_least_size_given_in_bytes(monkeypatch, text, want):
    from dtrain.comm.peer import window as peer

    monkeypatch.setenv("DTRAIN_COMM_PEER_WINDOW_BYTES", text)
    assert peer._presize() == want


def test_a_window_size_that_is_not_a_size_is_refused(monkeypatch):
    from dtrain.comm.peer import window as peer

    monkeypatch.setenv("DTRAIN_COMM_PEER_WINDOW_BYTES", "lots")
    with pytest.raises(ValueError, match="DTRAIN_COMM_PEER_WINDOW_BYTES"):
        peer._presize()


def test_a_window_name_from_rank_0_is_checked_before_any_file_is_opened():
    good = b"dtrain-123-4-" + b"0123456789ab"
    assert peer_window.window_stem(good.ljust(64, b"\0")) == good.decode()
    for bad in (b"../../tmp/dtrain-123-4-0123456789ab", good + b"/x", b"dtrain-1-2-\xff\xfe", good + b"\0junk", b""):
        with pytest.raises(ValueError, match="^peer transport: rank 0 named the window files"):
            peer_window.window_stem(bad.ljust(64, b"\0"))
    with pytest.raises(ValueError, match="rank 0 named"):
        peer_window.window_stem(good)  # not 64 bytes


@pytest.mark.parametrize("tag", [b"../../tmp/dtrain-1-2-0123456789ab", b"dtrain-\xff\xfe-0"])
def test_every_rank_refuses_window_files_named_outside_dev_shm_alike(pool, tag):
    got = pool.run(jobs.window_named_by, tag.ljust(64, b"\0"), ranks=2)
    assert got[0] == got[1] and got[0].startswith("ValueError: peer transport: rank 0 named the window files b")
    assert glob.glob("/tmp/dtrain-1-2-*") == []
