"""Pipeline parallelism: schedules as data, shapes that travel, and training equal to the unsplit model."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dtrain.parallel.pipeline_parallel import partition_layers
from dtrain.parallel.pipeline_parallel_communications import decode_header, encode_header
from dtrain.parallel.pipeline_schedules import (
    bubble_fraction,
    draw_schedule,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
    simulate,
    simulated_bubble,
    theoretical_bubble,
    validate_schedule,
)
from tests.jobs import pipeline as pipeline_jobs

STAGES = (1, 2, 3, 4, 8)
MICROBATCHES = (1, 2, 3, 4, 8, 9)


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_every_microbatch_is_forwarded_before_its_backward_on_every_stage(p, m):
    for build in (gpipe, one_f_one_b):
        for s in range(p):
            validate_schedule(build(p, m, s), m)


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_1f1b_holds_at_most_p_minus_stage_microbatches_and_gpipe_holds_all(p, m):
    for s in range(p):
        assert validate_schedule(one_f_one_b(p, m, s), m) == min(p - s, m)
        assert validate_schedule(gpipe(p, m, s), m) == m


def test_1f1b_is_warmup_then_one_forward_one_backward_then_cooldown():
    assert one_f_one_b(4, 6, 1) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2), ("F", 5), ("B", 3),
        ("B", 4), ("B", 5),
    ]  # fmt: skip
    assert gpipe(2, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("m", (1, 2, 4, 8))
def test_simulated_bubble_of_both_schedules_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for build in (gpipe, one_f_one_b):
        times = simulate([build(p, m, s) for s in range(p)], forward_cost=1, backward_cost=2)
        total = max(end for stage in times for _, end in stage)
        idle = p * total - p * m * 3
        assert idle / (p * total) == pytest.approx((p - 1) / (m + p - 1))
    assert theoretical_bubble(p, m) == pytest.approx((p - 1) / (m + p - 1))


def test_simulate_reports_a_deadlock_instead_of_hanging():
    backwards_first = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(backwards_first)


def test_invalid_schedules_are_rejected():
    with pytest.raises(ValueError, match="before its forward"):
        validate_schedule([("B", 0), ("F", 0)], 1)
    with pytest.raises(ValueError, match="only 1 of 2"):
        validate_schedule([("F", 0), ("B", 0)], 2)


def test_schedule_is_drawn_one_row_per_stage():
    chart = draw_schedule([one_f_one_b(3, 4, s) for s in range(3)], backward_cost=1)
    rows = chart.splitlines()
    assert len(rows) == 3 and rows[0].startswith("stage 0 | F0 F1 ") and rows[2].startswith("stage 2 | .. .. F0 B0")


def test_header_carries_shape_and_dtype():
    for t in (torch.zeros(3, 4, 5), torch.zeros((), dtype=torch.int64), torch.zeros(2, 0, dtype=torch.bfloat16)):
        assert decode_header(encode_header(t)) == (tuple(t.shape), t.dtype)
    with pytest.raises(ValueError, match="at most 8 dims"):
        encode_header(torch.zeros([1] * 9))
    # a header that would size a receive buffer wrongly is refused before anything is allocated
    good = encode_header(torch.zeros(3, 4))
    for change in ({2: -3}, {2: 1 << 30, 3: 1 << 30}, {4: 7}, {0: 9}, {1: 99}):
        bad = good.clone()
        for i, v in change.items():
            bad[i] = v
        with pytest.raises(ValueError, match="corrupt pipeline header"):
            decode_header(bad)


def test_layers_balance_by_count_and_by_parameters():
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())
    assert partition_layers(model, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert partition_layers(model, 2, balance="params") == [range(0, 1), range(1, 6)]
    small, big = nn.Linear(2, 2), nn.Linear(10, 10)  # 6 and 110 parameters
    assert partition_layers(nn.Sequential(small, small, small, big), 2, balance="params") == [range(0, 3), range(3, 4)]


def test_more_stages_than_layers_is_a_value_error_naming_both():
    with pytest.raises(ValueError, match=r"3 layers into 4 pipeline stages"):
        partition_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), 4)


def _assert_equivalent(results):
    for rank, r in enumerate(results):
        for key, value in r.items():
            assert value == 0.0, f"rank {rank}: {key} off by {value} beyond rtol 1e-5, atol 1e-6 ({r})"


@pytest.mark.parametrize("p", (2, 4))
@pytest.mark.parametrize("m", (1, 2, 4, 8))
def test_gpipe_and_1f1b_train_like_the_unsplit_model(pool, p, m):
    _assert_equivalent(pool.run(pipeline_jobs.equivalence, p, m, ranks=p))


def test_shapes_travel_between_stages_that_change_width_and_rank(pool):
    _assert_equivalent(pool.run(pipeline_jobs.equivalence, 4, 4, "reshaping", ranks=4))


def test_parameter_balanced_stages_train_like_the_unsplit_model(pool):
    _assert_equivalent(pool.run(pipeline_jobs.equivalence, 3, 2, "mlp", 2, "params", ranks=3))


@pytest.mark.parametrize("schedule,p,m", [("1f1b", 3, 4), ("interleaved-1f1b", 2, 4), ("zb-v", 2, 4)])
def test_peer_channels_train_like_the_process_groups_through_eval_and_a_new_shape(pool, schedule, p, m):
    for rank, r in enumerate(pool.run(pipeline_jobs.transports_agree, p, m, schedule, ranks=p)):
        assert r.pop("used") == {"group": "group", "peer": "peer", "auto": "peer"}, f"rank {rank}"
        assert all(value == 0.0 for value in r.values()), f"rank {rank}: {r}"


def test_auto_takes_peer_channels_on_the_cpu_and_on_gpus_for_messages_of_64_kib_whose_rings_fit():
    from dtrain.parallel.pipeline_parallel_communications import auto_takes_channels

    mib = 1 << 20
    assert auto_takes_channels("cpu", 64, 64) and auto_takes_channels("cpu", 4096 * mib, 1 << 40)
    assert not auto_takes_channels("cuda", (64 << 10) - 1, 32 * mib)  # smaller than any message measured
    assert auto_takes_channels("cuda", 64 << 10, 32 * mib) and auto_takes_channels("cuda", mib, 32 * mib)
    assert auto_takes_channels("cuda", 2 * mib, 32 * mib) and auto_takes_channels("cuda", 8 * mib, 1024 * mib)
    assert not auto_takes_channels("cuda", 128 * mib, 4096 * mib)  # a step's messages past RING_BYTES


def test_an_unknown_transport_is_refused(pool):
    for message in pool.run(pipeline_jobs.bad_transport, ranks=2):
        assert "transport must be one of auto, group, peer, got 'nccl'" in message


def test_more_stages_than_layers_raises_on_every_rank(pool):
    for message in pool.run(pipeline_jobs.too_many_stages, ranks=4):
        assert "3 layers into 4 pipeline stages" in message


def test_indivisible_batch_raises_before_sending_anything(pool):
    for answer in pool.run(pipeline_jobs.indivisible_batch, ranks=2):
        message, trained_after = answer.split("|")
        assert "10 samples cannot be split into 4" in message and trained_after == "True"


@pytest.mark.parametrize("p,m", [(4, 8)])
def test_timeline_reports_a_bubble_and_1f1b_holds_fewer_activations(pool, p, m):
    report = {}
    for schedule in ("gpipe", "1f1b"):
        timelines = pool.run(pipeline_jobs.timeline, p, m, schedule, ranks=p)
        bubble = bubble_fraction(timelines)
        assert 0.0 < bubble < 1.0
        assert {e.kind for e in timelines[1].events} >= {"F", "B", "send_forward", "recv_forward", "recv_backward"}
        report[schedule] = (bubble, [t.peak_activations for t in timelines])
    print(f"\np={p} m={m} theory {theoretical_bubble(p, m):.3f}; measured (bubble, peak per stage): {report}")
    assert report["1f1b"][1] == [min(p - s, m) for s in range(p)]
    assert report["gpipe"][1] == [m] * p
    assert all(a <= b for a, b in zip(report["1f1b"][1], report["gpipe"][1], strict=True))


def test_interleaved_1f1b_is_groups_of_p_through_the_chunks_forward_and_back_in_reverse():
    got = [(kind, chunk, mb) for kind, mb, chunk in interleaved_one_f_one_b(2, 4, 1, virtual_stages=2)]
    # (kind, chunk, micro-batch); warm-up 2 (p - 1 - s) + (v - 1) p = 2 forwards, then 1F1B, then 2 backwards
    assert got == [
        ("F", 0, 0), ("F", 0, 1),
        ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 0, 2), ("B", 0, 0), ("F", 0, 3), ("B", 0, 1),
        ("F", 1, 2), ("B", 1, 2), ("F", 1, 3), ("B", 1, 3),
        ("B", 0, 2), ("B", 0, 3),
    ]  # fmt: skip


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("v", (1, 2, 3))
@pytest.mark.parametrize("groups", (1, 2, 4))
def test_interleaved_1f1b_is_valid_and_its_simulated_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, v, groups):
    m = groups * p
    schedules = [interleaved_one_f_one_b(p, m, s, v) for s in range(p)]
    for s in range(p):
        validate_schedule(schedules[s], m, virtual_stages=v)
    times = simulate(schedules, forward_cost=1, backward_cost=2)  # costs of one chunk
    total = max(end for stage in times for _, end in stage)
    idle = p * total - p * v * m * 3
    assert idle / (p * total) == pytest.approx((p - 1) / (v * m + p - 1))
    assert theoretical_bubble(p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    assert theoretical_bubble(p, m, v) <= theoretical_bubble(p, m)


def test_interleaved_1f1b_needs_microbatches_in_groups_of_p():
    with pytest.raises(ValueError, match="6 micro-batches is not a multiple of 4"):
        interleaved_one_f_one_b(4, 6, 0, 2)


def test_a_larger_microbatch_group_runs_g_microbatches_through_each_chunk_before_the_next():
    got = [(kind, chunk, mb) for kind, mb, chunk in interleaved_one_f_one_b(2, 4, 1, virtual_stages=2, group=4)]
    # warm-up 2 (p - 1 - s) + (v - 1) g = 4 forwards: chunk 0 of all four micro-batches, then 1F1B on chunk 1
    assert got == [
        ("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3),
        ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2), ("F", 1, 3), ("B", 1, 3),
        ("B", 0, 0), ("B", 0, 1), ("B", 0, 2), ("B", 0, 3),
    ]  # fmt: skip


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("v", (2, 3))
def test_every_microbatch_group_keeps_the_bubble_and_holds_v_minus_1_chunks_more_a_microbatch_added(p, v):
    m = 4 * p
    for g in (p, 2 * p, 4 * p):
        schedules = [interleaved_one_f_one_b(p, m, s, v, group=g) for s in range(p)]
        peaks = [validate_schedule(schedules[s], m, virtual_stages=v) for s in range(p)]
        # the first stage holds its warm-up forwards and one more: 2 (p - 1) + (v - 1) g + 1
        assert peaks[0] == 2 * (p - 1) + (v - 1) * g + 1
        assert peaks == sorted(peaks, reverse=True)
        assert simulated_bubble(simulate(schedules, forward_cost=1, backward_cost=2)) == pytest.approx(
            theoretical_bubble(p, m, v)
        )
        sent, received = _messages(schedules, p, v)
        # the same messages on every pair of ranks; with g > p not always used in the order sent, so a stage posts
        # its receives in its peer's send order (StageLink), the order NCCL matches them in
        assert {k: sorted(x) for k, x in sent.items()} == {k: sorted(x) for k, x in received.items()}


def test_a_larger_microbatch_group_hides_the_messages_from_the_last_stage_to_the_first():
    # each message a fifth of a chunk's forward: with g = p every one back to the first stage waits on the path
    p, m, v = 4, 16, 2
    bubbles = {}
    for g in (4, 8, 16):
        schedules = [interleaved_one_f_one_b(p, m, s, v, group=g) for s in range(p)]
        bubbles[g] = simulated_bubble(simulate(schedules, forward_cost=1, backward_cost=2, p2p_cost=0.2))
    assert bubbles[8] < bubbles[4] - 0.01  # 0.096 against 0.110; 0.086 with free messages
    assert bubbles[16] <= bubbles[8] + 1e-12


@pytest.mark.parametrize(
    ("p", "m", "group", "message"),
    [
        (4, 16, 6, "must be a multiple of the 4 pipeline stages, got 6"),
        (4, 16, 2, "must be a multiple of the 4 pipeline stages, got 2"),
        (4, 8, 12, "groups of 12; 8 micro-batches is not a multiple of 12"),
        (2, 6, 4, "groups of 4; 6 micro-batches is not a multiple of 4"),
        (2, 4, True, "must be a multiple of the 2 pipeline stages, got True"),
    ],
)
def test_a_microbatch_group_that_does_not_fit_is_refused(p, m, group, message):
    with pytest.raises(ValueError, match=message):
        interleaved_one_f_one_b(p, m, 0, 2, group=group)


def test_only_interleaved_1f1b_takes_a_microbatch_group():
    with pytest.raises(ValueError, match="microbatch_group is interleaved-1f1b's; schedule '1f1b' takes none"):
        make_schedule("1f1b", 2, 4, 0, 1, 4)
    assert make_schedule("interleaved-1f1b", 2, 4, 0, 2, 4) == interleaved_one_f_one_b(2, 4, 0, 2, group=4)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2)])
def test_interleaved_1f1b_trains_like_the_unsplit_model(pool, p, m, v):
    _assert_equivalent(pool.run(pipeline_jobs.interleaved, p, m, v, ranks=p))


@pytest.mark.parametrize(("p", "m", "v", "group", "transport"), [(2, 4, 2, 4, "group"), (2, 8, 3, 4, "peer")])
def test_interleaved_1f1b_in_larger_microbatch_groups_trains_like_the_unsplit_model(pool, p, m, v, group, transport):
    _assert_equivalent(pool.run(pipeline_jobs.interleaved, p, m, v, 3, group, transport, ranks=p))


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)])
def test_graphed_steps_capture_each_microbatch_once_and_train_like_the_unsplit_model(pool, schedule, v):
    p, m, steps = 2, 4, 3
    for r in pool.run(pipeline_jobs.graphed, p, m, schedule, v, steps, ranks=p):
        keys, captures, replays = r.pop("keys"), r.pop("captures"), r.pop("replays")
        recorded_w = r.pop("recorded_w")
        assert r.pop("split") == [schedule.startswith("zb")]  # B alone is captured where backward is split
        assert keys == [(c, mb) for c in range(v) for mb in range(m)] and captures == [m * v]
        assert replays == (steps - 1) * m * v  # every forward after the first step, none of the first
        # a split backward keeps each graphed B's deferred weight gradients: one per linear layer of the chunk
        assert [key for key, _, _ in recorded_w] == (keys if schedule.startswith("zb") else [])
        assert all(count == linears > 0 for _, count, linears in recorded_w)
        _assert_equivalent([r])


def test_graphs_are_refused_on_the_cpu(pool):
    errors = pool.run(pipeline_jobs.graphs_refused, ranks=2)
    assert errors[0] == errors[1]
    assert "needs the stage's parameters on a CUDA device" in errors[0][0]
    assert errors[0][1] == "graphs must be False, True or 'step', got 'steps'"
    assert "transport 'group' has none" in errors[0][2]


def test_a_step_recorded_whole_runs_its_forwards_under_autocast_without_its_cache_and_trains_as_eager_ones(pool):
    for r in pool.run(pipeline_jobs.step_graphed_autocast, 2, 2, ranks=2):
        assert r["recorded"] and r["worst"] == 0.0
        assert r["recorded_under"] == [(True, False)]  # autocast on, its cast cache off


@pytest.mark.parametrize(
    ("schedule", "keep_grads"),
    [("1f1b", False), ("interleaved-1f1b", True), ("zb-h1", False), ("zb-v", True), ("gpipe", False)],
)
def test_a_step_recorded_whole_replays_over_peer_channels_and_trains_like_the_unsplit_model(pool, schedule, keep_grads):
    """``graphs="step"`` (a stand-in graph): two eager steps, one recording, then replays, with a forward-only
    step in between; the channels' rounds make every replay issue the same messages. Gradients left in place
    (zeroed) between steps take the replay's gradient added, not aliased."""
    p, m, steps = 2, 4, 6
    results = pool.run(pipeline_jobs.step_graphed, p, m, schedule, steps, keep_grads, ranks=p)
    assert schedule == "zb-v" or "other_shape" in results[0]  # ZB-V's first stage is its last too
    for r in results:
        assert r["transport"] == "peer"
        assert r["records"] == 1 and r["replays"] == steps - 2
        assert r["clock"] == "none"  # a replayed step has no action times
        assert r["loss"] == 0.0 and r["grad"] == 0.0 and r["param"] == 0.0, r
        assert r["eval"] < 1e-6
        if "other_shape" in r:  # the first stage, where it is not also the last: a batch of another shape
            assert r["other_shape"].startswith("graphs='step': the step was recorded for a batch of ((16, 6)"), r


def test_graphed_steps_record_forwards_under_autocast_without_its_cache_and_train_as_eager_ones(pool):
    for r in pool.run(pipeline_jobs.graphed_autocast, 2, 2, ranks=2):
        assert r["captured"] and r["worst"] == 0.0
        assert r["recorded_under"] == [(True, False)]  # autocast on, its cast cache off


def test_interleaved_timeline_records_each_chunk_and_a_bubble(pool):
    results = pool.run(pipeline_jobs.timeline, 4, 8, "interleaved-1f1b", True, ranks=4)
    timelines, reports = [t for t, _ in results], [r for _, r in results]
    assert 0.0 < bubble_fraction(timelines) < 1.0
    # every virtual-stage boundary carries each micro-batch's activation up and its gradient down: 2 m (v p - 1)
    assert sum(r["sends"] for r in reports) == sum(r["recvs"] for r in reports) == 2 * 8 * (2 * 4 - 1)
    assert all(r["headers"] == 0 and r["device_wait_s"] is None and r["recv_wait_s"] >= 0 for r in reports)
    for t in timelines:
        assert t.virtual_stages == 2
        assert {(e.kind, e.chunk) for e in t.events if e.kind in ("F", "B")} == {(k, c) for k in "FB" for c in (0, 1)}


def _messages(schedules, p: int, v: int) -> tuple[dict, dict]:
    """Per ordered pair of ranks, the (kind, receiving virtual stage, micro-batch) sent and received, in order."""
    last = v * p - 1
    sent: dict = {}
    received: dict = {}
    for s, actions in enumerate(schedules):
        for kind, mb, chunk in actions:
            u = chunk * p + s
            if kind == "F" and u < last:
                sent.setdefault((s, (u + 1) % p), []).append(("act", u + 1, mb))
            if kind == "F" and u > 0:
                received.setdefault(((u - 1) % p, s), []).append(("act", u, mb))
            if kind == "B" and u > 0:
                sent.setdefault((s, (u - 1) % p), []).append(("grad", u - 1, mb))
            if kind == "B" and u < last:
                received.setdefault(((u + 1) % p, s), []).append(("grad", u, mb))
    return sent, received


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("v", (2, 3))
def test_interleaved_messages_arrive_in_the_order_they_are_sent_on_every_pair_of_ranks(p, v):
    # so a transport that ignores tags (NCCL) matches every receive with the right send
    for m in (p, 2 * p, 4 * p):
        sent, received = _messages([interleaved_one_f_one_b(p, m, s, v) for s in range(p)], p, v)
        assert sent == received


def test_weight_gradients_of_two_microbatches_accumulate_in_place_like_autograd():
    from dtrain.parallel.weight_gradients import WeightGradStore

    torch.manual_seed(0)
    net, reference = nn.Linear(6, 3), nn.Linear(6, 3)
    reference.load_state_dict(net.state_dict())
    store = WeightGradStore()
    store.attach(net)
    xs = [torch.randn(5, 6) for _ in range(2)]
    for mb, x in enumerate(xs):
        reference(x).square().sum().backward()
        with store.deferring(mb):
            net(x.requires_grad_()).square().sum().backward()
    store.flush(0)
    first = net.weight.grad
    store.flush(1)  # into the first micro-batch's gradient: one GEMM with beta = 1, no new tensor
    assert net.weight.grad is first
    torch.testing.assert_close(net.weight.grad, reference.weight.grad)
    torch.testing.assert_close(net.bias.grad, reference.bias.grad)


def test_accumulating_in_place_adds_each_weight_gradient_into_grad_and_matches_autograd():
    from dtrain.parallel.weight_gradients import WeightGradStore

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3, bias=False))
    reference = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3, bias=False))
    reference.load_state_dict(net.state_dict())
    store = WeightGradStore(accumulate_in_place=True)
    assert store.attach(net) == 2
    first = None
    for _ in range(3):
        x = torch.randn(5, 6)
        reference(x).square().sum().backward()
        net(x).square().sum().backward()
        first = first if first is not None else net[0].weight.grad
    assert net[0].weight.grad is first  # the first backward's gradient, added into by the later GEMMs
    assert store.fused == 4 and store.pending() == 0  # two layers, from the second backward on
    for got, want in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    store.accumulate_in_place = False  # autograd's own accumulation again
    net(torch.randn(5, 6)).sum().backward()
    assert store.fused == 4


def test_a_store_that_only_fuses_leaves_products_below_its_size_to_plain_linear():
    from dtrain.parallel.weight_gradients import WeightGradStore

    net = nn.Linear(8, 4)
    store = WeightGradStore(accumulate_in_place=True, defers=False, min_macs=10 * 8 * 4)
    store.attach(net)
    for rows in (9, 9, 10, 10):  # 9 x 8 x 4 multiply-adds run as F.linear; 10 x 8 x 4 fuse once .grad exists
        net(torch.randn(rows, 8)).sum().backward()
    assert store.fused == 2
    assert not store.takes(torch.randn(9, 8), net.weight) and store.takes(torch.randn(10, 8), net.weight)
    store.accumulate_in_place = False
    assert not store.takes(torch.randn(10, 8), net.weight)
    with store.deferring(0):  # it never defers
        net(torch.randn(10, 8)).sum().backward()
    assert store.pending() == 0


@pytest.mark.parametrize(
    ("job", "args"),
    [
        ("equivalence", (2, 4, "mlp", 3, "layers", True)),
        ("equivalence", (4, 8, "reshaping", 2, "layers", True)),
        ("interleaved", (2, 4, 2, 3, None, "auto", True)),
        ("step_graphed", (2, 4, "1f1b", 6, False, True)),
        ("step_graphed", (2, 4, "interleaved-1f1b", 6, True, True)),
    ],
)
def test_gradient_accumulation_fusion_trains_like_the_unsplit_model(pool, job, args):
    """Each stage's weight gradients added into ``.grad`` by their GEMMs from the second micro-batch on: GPipe,
    1F1B and interleaved 1F1B, eagerly and recorded whole (gradients replaced, and added into ones kept)."""
    p, every_stage_linear = args[0], "reshaping" not in args  # a reshaping stage may hold no linear layer
    added = 0
    for rank, r in enumerate(pool.run(getattr(pipeline_jobs, job), *args, ranks=p)):
        fused = {k: r.pop(k) for k in list(r) if k.endswith("fused")}
        assert fused, f"rank {rank}: {r}"
        assert not every_stage_linear or all(n > 0 for n in fused.values()), f"rank {rank}: none in place ({fused})"
        added += sum(fused.values())
        assert r.pop("eval", 0.0) < 1e-6
        for key in ("records", "replays", "transport", "other_shape", "clock"):
            r.pop(key, None)
        assert all(value == 0.0 for value in r.values()), f"rank {rank}: {r}"
    assert added > 0


def test_bench_pipeline_profile_must_name_a_directory(tmp_path, capsys):
    from dtrain.cli.main import main

    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(["bench", "pipeline", "--profile", str(taken), "--out", str(tmp_path / "rows.jsonl")]) == 2
    assert f"--profile {taken}: exists and is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "rows.jsonl").exists()  # refused before any rank starts or any file is written


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--transport", "group,nccl"], "--transport: unknown nccl; accepted: auto, group, peer"),
        (["--lookahead", "0,-1"], "--lookahead [0, -1]: each must be 0 or more"),
        (["--graphs", "step,steps"], "--graphs: unknown steps; accepted: actions, step"),
        (["--microbatch-group", "0,-4"], "--microbatch-group [0, -4]: each must be 0 or more"),
        (["--in-place", "yes,maybe"], "--in-place: unknown maybe; accepted: yes, no"),
        (["--grad-fusion", "auto,always"], "--grad-fusion: unknown always; accepted: yes, no, auto"),
        (["--send-engine", "kernel,dma"], "--send-engine: unknown dma; accepted: stream, inline, kernel"),
    ],
)
def test_bench_pipeline_refuses_an_unknown_transport_and_a_negative_lookahead(tmp_path, capsys, flags, said):
    from dtrain.cli.main import main

    assert main(["bench", "pipeline", *flags, "--out", str(tmp_path / "rows.jsonl")]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "rows.jsonl").exists()


def test_bench_pipeline_times_interleaved_1f1b_in_each_valid_microbatch_group(tmp_path):
    from dtrain.cli.main import main

    out = tmp_path / "rows.jsonl"
    flags = ["--nproc", "2", "--schedules", "interleaved-1f1b", "--microbatches", "2,4", "--layers", "4"]
    flags += ["--width", "8", "--batch", "8", "--warmup", "1", "--steps", "1", "--no-torch", "--out", str(out)]
    assert main(["bench", "pipeline", *flags, "--microbatch-group", "0,3,4"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # 3 is no multiple of the 2 stages, 4 does not divide 2 micro-batches: skipped; 0 is the stages' count
    assert [(r["microbatches"], r["microbatch_group"]) for r in rows] == [(2, 2), (4, 2), (4, 4)]
    held = {r["microbatch_group"]: r["held_first_stage"] for r in rows if r["microbatches"] == 4}
    assert held == {2: 2 * (2 - 1) + 2 + 1, 4: 2 * (2 - 1) + 4 + 1}  # 2 (p - 1) + (v - 1) g + 1
    assert len({r["loss"] for r in rows if r["microbatches"] == 4}) == 1  # the same training either way


def test_bench_pipeline_computes_on_messages_in_their_slots_or_on_copies_sent_by_any_engine_alike(tmp_path):
    from dtrain.cli.main import main

    out = tmp_path / "rows.jsonl"
    flags = ["--nproc", "2", "--schedules", "1f1b", "--microbatches", "2", "--layers", "2", "--width", "8"]
    flags += ["--batch", "4", "--warmup", "1", "--steps", "1", "--no-torch", "--transport", "peer", "--out", str(out)]
    assert main(["bench", "pipeline", *flags, "--in-place", "yes,no", "--send-engine", "stream,kernel"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    got = [(r["transport"], r["in_place"], r["send_engine"]) for r in rows]
    assert got == [("peer", i, e) for i in (True, False) for e in ("stream", "kernel")]
    assert len({(r["loss"], r["grad_sq"]) for r in rows}) == 1
    for r in rows:  # each step timed alone and in a run of steps back to back, and the bubble by each
        assert r["step_ms"] > 0 and r["step_ms_steady"] > 0 and r["bubble_steady"] < 1
