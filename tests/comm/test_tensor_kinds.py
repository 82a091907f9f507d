"""Tensors as a training script has them: parameters and tensors that require grad, tensors made under
``torch.inference_mode()``, and calls in place (a collective's input inside its output, or its output inside its
input), through every algorithm, against the reference."""

from __future__ import annotations

import pytest

from tests.jobs import comm as jobs


@pytest.mark.parametrize("transport", ["p2p", "peer"])
@pytest.mark.parametrize("kind", ["grad", "inference"])
def test_parameters_and_inference_tensors_are_written_by_every_algorithm(pool, kind, transport):
    # as torch.distributed's all-reduce writes them in place: every collective and algorithm, on the kept path of a
    # repeated call too, with no result taking autograd history
    problems = pool.run(jobs.guarded_tensors, kind, transport, ranks=2)
    assert [p for per_rank in problems for p in per_rank] == []


@pytest.mark.parametrize("transport", ["p2p", "peer"])
def test_calls_under_inference_mode_leave_buffers_that_serve_calls_outside_it(pool, transport):
    results = pool.run(jobs.inference_mode_first, transport, ranks=3)
    assert results == [[[0.0, 0.0, 1.0, 1.0, 2.0, 2.0], [6.0] * 5] * 2] * 3


def test_every_algorithm_runs_in_place_calls(pool):
    problems = pool.run(jobs.in_place_calls, 3, ranks=3)
    assert [p for per_rank in problems for p in per_rank] == []
