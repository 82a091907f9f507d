"""Megatron-Core's overlaps with a pipeline: the reduction under each stage's last backward
(``StepConfig.overlap_grad_reduce``), the weights' all-gather under the next forward (``overlap_param_gather``), both
per model chunk under interleaved 1F1B, and the interleaved schedule's exchanges under compute
(``overlap_p2p_comm``)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from dtrain.sim.model import Layout, ModelSpec
from dtrain.sim.pipeline import pipeline_chunk_edges, pipeline_makespan, pipeline_stage_spans
from dtrain.sim.placement import place
from dtrain.sim.step import (
    StepConfig,
    _stage_times,
    chunked_reduction_s,
    exposed_bucket_s,
    overlapped_reduction_s,
    simulate_step,
    step_lower_bound,
)
from dtrain.sim.traffic import simulate_traffic
from tests.sim.test_sim_topologies import GB, star

MODEL = ModelSpec(parameters=1e9, layers=8, hidden=1024, heads=16, sequence=512)


def test_1f1b_stages_end_one_backward_and_message_apart_and_start_one_forward_apart() -> None:
    f, b, p2p, p = 1.0, 2.0, 0.1, 4
    spans = pipeline_stage_spans([f] * p, [b] * p, p2p, 8)
    makespan = pipeline_makespan([f] * p, [b] * p, p2p, 8)
    for s, (start, end) in enumerate(spans):
        assert start == pytest.approx(s * (f + p2p))
        assert end == pytest.approx(makespan - s * (b + p2p))


def test_the_latest_stage_reduction_and_the_first_forward_gather_decide_the_exposed_time() -> None:
    layout = Layout(dp=4, pp=2, global_batch=8, zero_stage=1)
    dp = [SimpleNamespace(time_s=1.3), SimpleNamespace(time_s=0.5)]  # reduce-scatter, all-gather
    spans, makespan = [(0.0, 10.0), (1.1, 9.5)], 10.0
    config = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    first = 0.5e9 * 2  # the first stage's gradients in bytes: buckets of 40 M parameters
    assert exposed_bucket_s(1.3, 2.0, first, 80e6) < 0.5  # stage 0's buckets hide behind its last backward
    gather = exposed_bucket_s(0.5, 1.0, first, 80e6)  # under stage 0's first forward; stage 1 starts after 0.5 s
    exposed = overlapped_reduction_s(MODEL, layout, config, dp, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], spans, makespan)
    assert exposed == pytest.approx(9.5 + 1.3 - makespan + gather)  # stage 1's one bucket waits for its backward
    config = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True)
    exposed = overlapped_reduction_s(MODEL, layout, config, dp, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], spans, makespan)
    assert exposed == pytest.approx(9.5 + 1.3 - makespan + 0.5)  # without overlap_param_gather the gather shows


def test_a_pipelined_step_hides_part_of_its_reduction_only_with_overlap_grad_reduce() -> None:
    topo = star(4, bytes_per_s=10 * GB)
    layout = Layout(dp=2, pp=2, global_batch=8, zero_stage=1)
    placement = place(topo, layout)
    plain = simulate_step(MODEL, layout, topo, placement, StepConfig(distributed_optimizer=True))
    assert plain.dp_exposed_s == pytest.approx(plain.dp_s)
    config = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    overlapped = simulate_step(MODEL, layout, topo, placement, config)
    assert 0 <= overlapped.dp_exposed_s < plain.dp_exposed_s
    assert overlapped.step_s == pytest.approx(overlapped.pipeline_s + overlapped.dp_exposed_s + overlapped.optimizer_s)
    # the planner's bound leaves the overlapped reduction out, so it stays below the step
    assert step_lower_bound(MODEL, layout, topo, placement, config, exact_pipeline=True) <= overlapped.step_s


@pytest.mark.parametrize("pp", [1, 2])
def test_zero2_reduce_scatters_in_buckets_under_backward_only_with_overlap_grad_reduce(pp: int) -> None:
    topo = star(4, bytes_per_s=10 * GB)
    layout = Layout(dp=4 // pp, pp=pp, global_batch=8, zero_stage=2)
    placement = place(topo, layout)
    after = simulate_step(MODEL, layout, topo, placement, StepConfig())
    assert after.dp_exposed_s == pytest.approx(after.dp_s)  # reduce-scatter and all-gather after backward
    config = StepConfig(overlap_grad_reduce=True)
    under = simulate_step(MODEL, layout, topo, placement, config)
    assert under.dp_s == pytest.approx(after.dp_s)  # the same bytes, at another time
    assert 0 <= under.dp_exposed_s < after.dp_exposed_s
    # the stages' rule, the same as the distributed optimizer's reduce-scatter and all-gather
    traffic = simulate_traffic(MODEL, layout, topo, placement)
    (f, *_), (b, *_), (w, *_) = _stage_times(MODEL, layout, topo, placement, [1.0] * 4, config, 0.0)
    spans = pipeline_stage_spans(f, b, traffic.pp.time_s if traffic.pp else 0.0, layout.microbatches)
    expected = overlapped_reduction_s(MODEL, layout, config, traffic.dp, f, b, w, spans, under.pipeline_s)
    assert under.dp_exposed_s == pytest.approx(expected)
    gathered = simulate_step(MODEL, layout, topo, placement, replace(config, overlap_param_gather=True))
    assert gathered.dp_exposed_s < under.dp_exposed_s  # the all-gather under the next step's first forward
    assert step_lower_bound(MODEL, layout, topo, placement, config, exact_pipeline=True) <= under.step_s


def test_zero3_keeps_its_collectives_after_backward_whatever_overlap_grad_reduce_says() -> None:
    topo = star(4, bytes_per_s=10 * GB)
    layout = Layout(dp=4, global_batch=8, zero_stage=3)
    placement = place(topo, layout)
    plain = simulate_step(MODEL, layout, topo, placement, StepConfig())
    flagged = simulate_step(MODEL, layout, topo, placement, StepConfig(overlap_grad_reduce=True))
    assert flagged.dp_exposed_s == pytest.approx(plain.dp_s) and flagged.step_s == pytest.approx(plain.step_s)


def test_overlapped_exchanges_hide_under_compute_until_the_receive_is_late() -> None:
    f, b, m = [1.0] * 4, [2.0] * 4, 8  # a chunk's forward 0.5 s and backward 1 s

    def span(message: float, schedule: str = "interleaved-1f1b", **how) -> float:
        return pipeline_makespan(f, b, message, m, schedule, virtual_stages=2, **how)

    # Megatron-Core's overlap_p2p_comm takes the place of the synchronous, paired exchanges
    overlapped = span(0.1, synchronous=True, paired=True, overlapped=True)
    assert overlapped < span(0.1, synchronous=True, paired=True)
    assert overlapped == pytest.approx(span(0.1))  # shorter than the compute between post and wait: only arrival
    # longer than a backward: the receive, posted after the stage's previous forward, is not done when compute ends
    assert span(1.5, overlapped=True) > span(1.5) + 1.0
    assert span(1.5, overlapped=True, schedule="1f1b") == span(1.5, schedule="1f1b")  # interleaved only


def test_each_chunk_reduces_after_its_own_last_backward_delayed_by_the_stage_index() -> None:
    layout = Layout(dp=4, pp=2, global_batch=8, zero_stage=1, schedule="interleaved-1f1b", chunks=2)
    dp = [SimpleNamespace(time_s=4.0), SimpleNamespace(time_s=1.0)]  # reduce-scatter, all-gather: 2.0, 0.5 a chunk
    edges = [([0.0, 2.0], [(1, 10.0), (1, 11.0), (0, 12.0), (0, 13.0)]),
             ([1.0, 3.0], [(1, 9.0), (1, 10.5), (0, 11.5), (0, 12.5)])]  # fmt: skip
    # stage 0: chunk 1 after its backward at 11, done 13, chunk 0 after 13, done 15; stage 1 launches chunk 1 one
    # backward late (11.5, done 13.5), then chunk 0 (15.5): 2.5 s past the pipeline's 13 s
    config = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True)
    assert chunked_reduction_s(MODEL, layout, config, dp, [1.0, 1.0], edges, 13.0) == pytest.approx(2.5 + 1.0)
    config = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    first = 0.25e9 * 2  # the first stage's first chunk's weights in bytes
    gather = exposed_bucket_s(0.5, 0.5, first, 80e6)  # chunk 0's buckets under stage 0's first forward
    assert chunked_reduction_s(MODEL, layout, config, dp, [1.0, 1.0], edges, 13.0) == pytest.approx(2.5 + gather)


def test_an_interleaved_step_reduces_per_chunk() -> None:
    topo = star(4, bytes_per_s=10 * GB)
    layout = Layout(dp=2, pp=2, global_batch=8, zero_stage=1, schedule="interleaved-1f1b", chunks=2)
    placement = place(topo, layout)
    config = StepConfig(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                        overlap_p2p_comm=True)  # fmt: skip
    result = simulate_step(MODEL, layout, topo, placement, config)
    plain = simulate_step(MODEL, layout, topo, placement, StepConfig(distributed_optimizer=True))
    assert 0 <= result.dp_exposed_s < plain.dp_exposed_s
    assert result.step_s == pytest.approx(result.pipeline_s + result.dp_exposed_s + result.optimizer_s)
    assert step_lower_bound(MODEL, layout, topo, placement, config, exact_pipeline=True) <= result.step_s
    # the step takes the chunks' rule over the pipeline's chunk edges, not the stages' (the 1F1B rule)
    traffic = simulate_traffic(MODEL, layout, topo, placement, distributed_optimizer=True)
    (f, *_), (b, *_), _ = _stage_times(MODEL, layout, topo, placement, [1.0] * 4, config, 0.0)
    send = traffic.pp.time_s
    edges = pipeline_chunk_edges(f, b, send, 4, virtual_stages=2, overlapped=True)
    chunked = chunked_reduction_s(MODEL, layout, config, traffic.dp, f, edges, result.pipeline_s)
    spans = pipeline_stage_spans(f, b, send, 4, "interleaved-1f1b", virtual_stages=2, overlapped=True)
    staged = overlapped_reduction_s(MODEL, layout, config, traffic.dp, f, b, [0.0, 0.0], spans, result.pipeline_s)
    assert result.dp_exposed_s == pytest.approx(chunked)
    assert chunked < staged
    assert [e[0][0] for e in edges] == [pytest.approx(start) for start, _ in spans]  # chunk 0 first
    assert [e[1][-1][1] for e in edges] == [pytest.approx(end) for _, end in spans]  # and last backward


def test_the_exposed_bucket_time_is_the_bucket_queue_s_in_closed_form():
    """Bucket by bucket (each ready at (i + 1) / B of backward, reduced in order, one at a time) against the
    closed form, which prices a gradient of any size at once."""
    import math
    import random

    def queue(all_reduce_s, backward_s, gradient_bytes, bucket_bytes):
        buckets = max(1, math.ceil(gradient_bytes / bucket_bytes))
        done = 0.0
        for i in range(buckets):
            done = max(done, (i + 1) / buckets * backward_s) + all_reduce_s / buckets
        return max(0.0, done - backward_s)

    rng = random.Random(0)
    for _ in range(2000):
        case = (rng.uniform(0, 5), rng.uniform(0, 5), rng.uniform(1, 1e9), rng.choice([1e5, 25 << 20, 1e9]))
        assert exposed_bucket_s(*case) == pytest.approx(queue(*case), abs=1e-9), case
    assert exposed_bucket_s(1.0, 2.0, 1e30, 25 << 20) == pytest.approx(0.0, abs=1e-12)  # 4e22 buckets, at once
