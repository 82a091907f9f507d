"""Megatron-Core's data-parallel overlaps with a pipeline: the reduction under each stage's last backward
(``StepConfig.overlap_grad_reduce``), the weights' all-gather under the next forward (``overlap_param_gather``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dtrain.sim.model import Layout, ModelSpec
from dtrain.sim.pipeline import pipeline_makespan, pipeline_stage_spans
from dtrain.sim.placement import place
from dtrain.sim.step import StepConfig, exposed_bucket_s, overlapped_reduction_s, simulate_step, step_lower_bound
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
