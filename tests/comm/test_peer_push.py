"""The push form of the peer-memory transport: its plans are race-free and compute every schedule that has one,
whatever order ranks run in and however their element-sized steps interleave; on real Gloo processes (windows
in /dev/shm) every (collective, algorithm) run with DTRAIN_COMM_PEER_MODE=push matches the reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.comm import Collective
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import ScheduleError, chunk_bounds
from dtrain.comm.peer.push import PushPlan, _compile_all, has_push_form, races, writes_own_block_only
from tests.comm.test_peer import _random_schedules, _reference, _schedules
from tests.jobs import peer as jobs

GARBAGE = None  # a window element nobody stored


def _steps(plan: PushPlan):
    """The plan as phases: the ops of each round (after its barrier), then the final folds."""
    return [list(rnd.ops) for rnd in plan.rounds] + [list(plan.final)]


def _apply(op, r: int, j: int, x, w, numel: int) -> str | None:
    """Element ``j`` of ``op`` on rank ``r``: combine its operands, store them; an error text if it read garbage."""
    operands = [x[r][op.offset + j]] if op.base_x else []
    for b in op.banks:
        value = w[r][b * numel + op.offset + j]
        if value is GARBAGE:
            return f"rank {r} read bank {b} at {op.offset + j} before anything was stored there"
        operands.append(value)
    value = sum(operands)
    if op.dst is not None:
        w[op.dst][op.dst_bank * numel + op.dst_offset + j] = value
    if op.to_x:
        x[r][op.offset + j] = value
    return None


def _run(plans, start, numel: int, pick) -> list[list[int]] | str:
    """Every phase with the ranks' element-sized steps taken in the order ``pick`` chooses among them."""
    x = [list(b) for b in start]
    w = [[GARBAGE] * (2 * numel) for _ in start]
    phases = [_steps(p) for p in plans]
    for i in range(len(phases[0])):
        queues = [[(op, j) for op in phases[r][i] for j in range(op.length)] for r in range(len(plans))]
        while any(queues):
            r = pick([q for q, steps in enumerate(queues) if steps])
            op, j = queues[r].pop(0)
            problem = _apply(op, r, j, x, w, numel)
            if problem:
                return problem
    return x


def _name(s) -> str:
    return f"{s.collective.value}-{s.algorithm}-{s.world_size}"


@pytest.mark.parametrize("schedule", [s for s in _schedules() if has_push_form(s)], ids=_name)
def test_a_push_plan_computes_its_schedule_whatever_order_ranks_run_in(schedule):
    numel = schedule.nblocks * (2 * schedule.chunks_per_block + 1)  # uneven chunks
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    plans = _compile_all(schedule, numel)
    assert races(plans) == []
    start = [[1000 * r + i for i in range(numel)] for r in range(schedule.world_size)]
    want = _reference(schedule, start, bounds)
    assert _run(plans, start, numel, lambda ready: ready[0]) == want  # rank by rank, lowest first
    assert _run(plans, start, numel, lambda ready: ready[-1]) == want  # highest first


def _uneven(s) -> int:
    return s.nblocks * (2 * s.chunks_per_block + 1)  # uneven chunks


# the reduce-scatters whose push plan stores only into the rank's own block (the others copy their input)
_OUT_OF_PLACE = [
    s for s in _schedules() if s.collective == Collective.REDUCE_SCATTER and writes_own_block_only(s, _uneven(s))
]


@pytest.mark.parametrize("schedule", _OUT_OF_PLACE, ids=_name)
def test_a_reduce_scatter_plan_for_its_own_block_leaves_the_input_alone_and_computes_that_block(schedule):
    numel = _uneven(schedule)
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    plans = _compile_all(schedule, numel, True)
    assert races(plans) == []
    start = [[1000 * r + i for i in range(numel)] for r in range(schedule.world_size)]
    want = _reference(schedule, start, bounds)
    per = schedule.chunks_per_block
    for pick in (lambda ready: ready[0], lambda ready: ready[-1]):
        got = _run(plans, start, numel, pick)
        assert not isinstance(got, str), got
        for r in range(schedule.world_size):
            lo, hi = bounds[r * per][0], bounds[(r + 1) * per - 1][0] + bounds[(r + 1) * per - 1][1]
            assert got[r][lo:hi] == want[r][lo:hi]  # the result
            assert got[r][:lo] + got[r][hi:] == start[r][:lo] + start[r][hi:]  # the input elsewhere, untouched


def test_the_ring_and_halving_doubling_reduce_scatters_run_without_copying_their_input():
    for world in (2, 3, 4, 8):
        ring = registry.build(Collective.REDUCE_SCATTER, "ring", world)
        assert writes_own_block_only(ring, world << 10)
    assert writes_own_block_only(registry.build(Collective.REDUCE_SCATTER, "halving_doubling", 4), 1 << 20)
    assert not writes_own_block_only(registry.build(Collective.ALL_REDUCE, "ring", 4), 1 << 20)


def test_the_algorithms_that_matter_on_gpus_have_a_push_form_and_direct_reductions_do_not():
    for algorithm in ("ring", "halving_doubling", "recursive_doubling", "tree"):
        assert has_push_form(registry.build(Collective.ALL_REDUCE, algorithm, 4)), algorithm
    assert not has_push_form(registry.build(Collective.REDUCE_SCATTER, "direct", 4))
    with pytest.raises(ScheduleError, match="no push form"):
        _compile_all(registry.build(Collective.REDUCE_SCATTER, "direct", 4), 16)


def test_the_ring_reduces_at_the_sender_in_one_pass_that_stores_locally_and_remotely():
    schedule = registry.build(Collective.ALL_REDUCE, "ring", 4)
    plan = _compile_all(schedule, 16)[0]
    assert all(len(rnd.ops) == 1 for rnd in plan.rounds)  # one pass a round, no separate fold
    first, second = plan.rounds[0].ops[0], plan.rounds[1].ops[0]
    assert (first.base_x, first.banks, first.dst, first.to_x) == (True, (), 1, False)  # round 0 reads x itself
    assert (second.base_x, len(second.banks), second.dst, second.to_x) == (True, 1, 1, True)  # x + arrival
    assert len(plan.final) == 1 and plan.final[0].dst is None  # the chunk that arrived last, folded into x


def test_a_chunk_receiving_twice_in_a_row_folds_the_older_contribution_first():
    from dtrain.comm.ir.schedule import Transfer, make_schedule

    # rank 0 receives chunk 0 from rank 1 in rounds 0, 1 and 2 and never sends it: bank 0 is reused in round 2
    rounds = [[Transfer(1, 0, 0, 0, True)], [Transfer(2, 0, 0, 0, True)], [Transfer(1, 0, 0, 0, True)]]
    schedule = make_schedule(Collective.ALL_REDUCE, "again", 3, rounds, chunks_per_block=1)
    plans = _compile_all(schedule, 4)
    assert races(plans) == []
    folds = [op for op in plans[0].rounds[1].ops if op.dst is None]
    assert len(folds) == 1 and folds[0].banks == (0,)
    start = [[10 * r + i for i in range(4)] for r in range(3)]
    assert _run(plans, start, 4, lambda ready: ready[0]) == _reference(schedule, start, chunk_bounds(4, 1, 1))


@settings(max_examples=150, deadline=None)
@given(_random_schedules(), st.randoms(use_true_random=False))
def test_any_schedule_with_a_push_form_computes_its_rounds_with_steps_interleaved_at_random(case, rnd):
    schedule, numel = case
    if not has_push_form(schedule):
        return
    bounds = chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)
    plans = _compile_all(schedule, numel)
    assert races(plans) == []
    start = [[1000 * r + i + 1 for i in range(numel)] for r in range(schedule.world_size)]
    assert _run(plans, start, numel, rnd.choice) == _reference(schedule, start, bounds)


def _pairs():
    for coll in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        for algorithm in registry.names(Collective(coll)):
            if registry.needs_local_size(algorithm):
                continue
            root = 0 if coll in ("broadcast", "reduce") else None
            if has_push_form(registry.build(Collective(coll), algorithm, 3, root=root)):
                yield coll, algorithm


@pytest.mark.parametrize(("coll", "algorithm"), list(_pairs()))
def test_every_collective_pushed_through_peer_memory_matches_the_reference(pool, coll, algorithm):
    problems = pool.run(jobs.check_collective_push, coll, algorithm, 3, [0, 1, 13, 4099], ranks=3)
    assert [p for per_rank in problems for p in per_rank] == []


def test_the_push_form_is_taken_from_its_size_threshold_where_the_schedule_has_one(monkeypatch):
    from dtrain.comm.peer import window as peer

    ring = registry.build(Collective.ALL_REDUCE, "ring", 4)
    direct = registry.build(Collective.REDUCE_SCATTER, "direct", 4)
    big, small = peer.PUSH_FROM_BYTES, peer.PUSH_FROM_BYTES - 4
    monkeypatch.delenv("DTRAIN_COMM_PEER_MODE", raising=False)  # auto
    assert peer.push_mode(ring, big) and not peer.push_mode(ring, small) and not peer.push_mode(direct, big)
    assert not peer.push_mode(ring, big, "cpu")  # on the CPU auto pulls at every size
    monkeypatch.setenv("DTRAIN_COMM_PEER_MODE", "push")
    assert peer.push_mode(ring, 4) and not peer.push_mode(direct, 4) and peer.push_mode(ring, 4, "cpu")
    monkeypatch.setenv("DTRAIN_COMM_PEER_MODE", "pull")
    assert not peer.push_mode(ring, big)
    monkeypatch.setenv("DTRAIN_COMM_PEER_MODE", "sideways")
    with pytest.raises(ValueError, match="pull, push or auto"):
        peer.push_mode(ring, big)


def test_the_race_check_catches_a_read_of_a_bank_nothing_in_this_call_stored():
    from dataclasses import replace

    schedule = registry.build(Collective.ALL_REDUCE, "ring", 3)
    plans = list(_compile_all(schedule, 9))
    first = plans[0].rounds[0]
    stale = replace(first.ops[0], banks=(1,))  # round 0 reading bank 1: only a previous call wrote it
    plans[0] = replace(plans[0], rounds=(replace(first, ops=(stale,)), *plans[0].rounds[1:]))
    assert any("no earlier round stored" in problem for problem in races(plans))


def test_a_pushed_ring_reduce_scatter_reads_the_input_and_writes_the_output_with_no_copy(pool):
    answers = pool.run(jobs.reduce_scatter_without_a_copy, "ring", ranks=3)
    assert answers == [{"out_of_place": True, "right": True, "input": True}] * 3
    # direct has no push form: the pull form reduces in a copy of the input, and is right as well
    answers = pool.run(jobs.reduce_scatter_without_a_copy, "direct", ranks=3)
    assert answers == [{"out_of_place": False, "right": True, "input": True}] * 3
