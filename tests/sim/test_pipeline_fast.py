"""The wave evaluation of a pipeline schedule (dtrain.sim.pipeline) against its event replay."""

import random

import pytest

from dtrain.sim import pipeline
from dtrain.sim.pipeline import pipeline_bubble, pipeline_makespan

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")


def _random_pipeline(rng: random.Random, schedule: str, most_stages: int, most_microbatches: int):
    """(stages, chunks a stage, micro-batches, forward times, backward times) drawn at random for ``schedule``."""
    p = rng.randint(1, most_stages)
    v = rng.choice((2, 3))
    m = p * rng.randint(1, 3) if schedule == "interleaved-1f1b" else rng.randint(1, most_microbatches)
    forward = [rng.uniform(0.2, 2.0) for _ in range(p)]
    backward = [rng.uniform(0.3, 4.0) for _ in range(p)]
    return p, v, m, forward, backward


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_waves_give_the_event_replays_makespan_on_random_stages(schedule: str) -> None:
    rng = random.Random(hash(schedule) & 0xFFFF)
    for _ in range(40):
        p, v, m, forward, backward = _random_pipeline(rng, schedule, 9, 14)
        weight = [rng.uniform(0.1, 1.5) for _ in range(p)] if rng.random() < 0.5 else None
        p2p = rng.choice((0.0, rng.uniform(0.0, 1.5)))
        args = (forward, backward, p2p, m, schedule, weight, v)
        span, work = pipeline._run(*args)
        replayed, replayed_work = pipeline._replay(*args)
        assert span == pytest.approx(replayed, rel=1e-12, abs=0.0)
        assert work == pytest.approx(replayed_work, rel=1e-12)


def test_wide_pipelines_take_the_array_path_and_agree() -> None:
    # 32 stages, 128 micro-batches: waves of up to 32 actions, timed with array operations
    rng = random.Random(7)
    p, m = 32, 128
    forward = [rng.uniform(0.9, 1.1) for _ in range(p)]
    backward = [rng.uniform(1.8, 2.2) for _ in range(p)]
    for schedule in ("1f1b", "interleaved-1f1b"):
        graph = pipeline._graph(schedule, p, m, 2 if schedule == "interleaved-1f1b" else 1)
        assert graph.size >= pipeline._WIDE * (len(graph.waves) - 1)
        for p2p in (0.0, 0.05):
            span = pipeline_makespan(forward, backward, p2p, m, schedule)
            assert span == pytest.approx(pipeline._replay(forward, backward, p2p, m, schedule, None, 2)[0], rel=1e-12)


def test_equal_stages_keep_the_gpipe_bubble() -> None:
    # (p - 1) / (m + p - 1) with equal stages and free messages (GPipe paper, section 2.3)
    for p, m in ((4, 8), (8, 3), (1, 5)):
        assert pipeline_bubble([1.0] * p, [2.0] * p, 0.0, m, "1f1b") == pytest.approx((p - 1) / (m + p - 1))


def test_bad_stage_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="one forward, one backward"):
        pipeline_makespan([1.0, 1.0], [1.0], 0.0, 4)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pipeline_makespan([1.0], [1.0], 0.0, 4, "2f2b")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_synchronous_messages_give_the_event_replays_makespan(schedule: str) -> None:
    rng = random.Random(hash(schedule) & 0xFFF)
    for _ in range(20):
        p, v, m, forward, backward = _random_pipeline(rng, schedule, 7, 10)
        p2p, gather = rng.uniform(0.0, 1.0), rng.uniform(0.0, 0.5)
        args = (forward, backward, p2p, m, schedule, None, v, gather)
        span, work = pipeline._run(*args, True)
        assert span == pytest.approx(pipeline._replay(*args, True)[0], rel=1e-12, abs=0.0)
        assert work == pytest.approx(pipeline._run(*args, False)[1], rel=1e-12)
        # a blocking exchange holds both stages: never faster than a message that only delays its receiver
        assert span >= pipeline._run(*args, False)[0] * (1 - 1e-12)


def test_a_synchronous_exchange_holds_the_sender() -> None:
    # 1F1B, 2 stages, 2 micro-batches, f = b = 1, message d: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1.
    # Delayed messages: 6 + 2d (B1 on stage 0 waits for stage 1's B1, d late). Blocking: stage 0's F1 is held
    # for its send, and stage 1's B0 for its, so stage 1's F1 starts at 3 + 2d and stage 0's B1 ends at 6 + 3d.
    d = 0.25
    assert pipeline_makespan([1.0, 1.0], [1.0, 1.0], d, 2, "1f1b") == pytest.approx(6 + 2 * d)
    assert pipeline_makespan([1.0, 1.0], [1.0, 1.0], d, 2, "1f1b", synchronous=True) == pytest.approx(6 + 3 * d)
    # the receiver's gather runs after the blocking exchange: stage 1's F0 and F1 and stage 0's B1, on the critical
    # path, each pay it
    g = 0.5
    span = pipeline_makespan([1.0, 1.0], [1.0, 1.0], d, 2, "1f1b", gather_s=g, synchronous=True)
    assert span == pytest.approx(6 + 3 * d + 3 * g)
    # one stage sends nothing
    assert pipeline_makespan([1.0], [1.0], d, 3, "1f1b", gather_s=0.5, synchronous=True) == pytest.approx(6.0)


def test_paired_exchanges_give_the_event_replays_makespan() -> None:
    # interleaved 1F1B's steady-state forward sends with the next backward (Megatron-LM's interleaved schedule)
    rng = random.Random(11)
    for _ in range(20):
        p, v = rng.randint(2, 6), rng.choice((2, 3))
        m = p * rng.randint(1, 3)
        forward = [rng.uniform(0.2, 2.0) for _ in range(p)]
        backward = [rng.uniform(0.3, 4.0) for _ in range(p)]
        p2p, gather = rng.uniform(0.0, 1.0), rng.uniform(0.0, 0.5)
        for synchronous in (False, True):
            args = (forward, backward, p2p, m, "interleaved-1f1b", None, v, gather, synchronous)
            span = pipeline._run(*args, True)[0]
            assert span == pytest.approx(pipeline._replay(*args, True)[0], rel=1e-12, abs=0.0)
            assert span >= pipeline._run(*args, False)[0] * (1 - 1e-12)
    # other schedules send after every action either way
    assert pipeline_makespan([1.0] * 3, [2.0] * 3, 0.3, 6, "1f1b", paired=True) == pipeline_makespan(
        [1.0] * 3, [2.0] * 3, 0.3, 6, "1f1b"
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_hosts_issue_time_gives_the_event_replays_makespan(schedule: str) -> None:
    rng = random.Random(11 + len(schedule))
    for _ in range(15):
        p, v, m, forward, backward = _random_pipeline(rng, schedule, 6, 12)
        host = rng.uniform(0.1, 3.0)
        args = (forward, backward, rng.uniform(0.0, 0.5), m, schedule, None, v)
        span = pipeline._run(*args, host_s=host)[0]
        assert span == pytest.approx(pipeline._replay(*args, host_s=host)[0], rel=1e-12, abs=0.0)
        assert span >= pipeline._run(*args)[0]
    # wide waves (the array path) agree too
    forward, backward = [1.0] * 32, [2.0] * 32
    span = pipeline_makespan(forward, backward, 0.05, 128, "1f1b", host_s=0.7)
    assert span == pytest.approx(pipeline._replay(forward, backward, 0.05, 128, "1f1b", None, 1, host_s=0.7)[0])


def test_a_host_slower_than_the_device_sets_the_pace() -> None:
    # 1F1B, 4 stages, 8 micro-batches: 16 actions a stage, the last of each the backward of micro-batch 7. With
    # actions of 0.1 and a host taking 1.0 to issue each, the last stage's starts once issued (16.0), and the
    # gradient then crosses the other three stages: 16.4. The device alone takes (m + p - 1)(f + b) = 11 * 0.2.
    ones = [0.1] * 4
    assert pipeline_makespan(ones, ones, 0.0, 8, "1f1b") == pytest.approx(11 * 0.2)
    assert pipeline_makespan(ones, ones, 0.0, 8, "1f1b", host_s=1.0) == pytest.approx(16.4)
    assert pipeline_bubble(ones, ones, 0.0, 8, "1f1b", host_s=1.0) == pytest.approx(1 - 1.6 / 16.4)
    with pytest.raises(ValueError, match="host_s"):
        pipeline_makespan(ones, ones, 0.0, 8, "1f1b", host_s=-1.0)


def test_microbatch_groups_give_the_event_replays_makespan_and_the_step_sees_them() -> None:
    # interleaved 1F1B in groups of g micro-batches: the waves agree with the event replay, paired or not
    rng = random.Random(17)
    for _ in range(20):
        p, v = rng.randint(2, 5), rng.choice((2, 3))
        g = p * rng.randint(1, 3)
        m = g * rng.randint(1, 2)
        forward = [rng.uniform(0.2, 2.0) for _ in range(p)]
        backward = [rng.uniform(0.3, 4.0) for _ in range(p)]
        p2p = rng.uniform(0.0, 1.0)
        for paired in (False, True):
            args = (forward, backward, p2p, m, "interleaved-1f1b", None, v, 0.0, False, paired)
            span = pipeline._run(*args, 0.0, False, g)[0]
            assert span == pytest.approx(pipeline._replay(*args, 0.0, g)[0], rel=1e-12, abs=0.0)
    # with free messages the group changes nothing; with messages a larger one hides the turn back to stage 0
    f, b = [1.0] * 4, [2.0] * 4
    free = {g: pipeline_makespan(f, b, 0.0, 16, "interleaved-1f1b", microbatch_group=g) for g in (4, 8, 16)}
    assert free[4] == free[8] == free[16] == pytest.approx((16 + 3 / 2) * 3)
    slow = {g: pipeline_makespan(f, b, 0.1, 16, "interleaved-1f1b", microbatch_group=g) for g in (4, 8)}
    assert slow[8] < slow[4]
    with pytest.raises(ValueError, match="microbatch_group is interleaved-1f1b's"):
        pipeline_makespan(f, b, 0.0, 16, "1f1b", microbatch_group=8)
    with pytest.raises(ValueError, match="modelled with micro-batches in groups of the 4 stages only, not 8"):
        pipeline_makespan(f, b, 0.1, 16, "interleaved-1f1b", microbatch_group=8, overlapped=True)
