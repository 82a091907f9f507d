"""Tensor parallelism (Megatron-LM) on real Gloo processes, against the same modules on one device.

Each test runs a job of ``tests.jobs.tensor_parallel`` on tensor-parallel groups of 2 and 4 ranks; the job lists every
output, input-gradient and (sharded) parameter-gradient mismatch against the single-device reference, in
float32 within rtol 1e-5, atol 1e-6 (1e-5 for attention, whose softmax runs through a different kernel).
"""

from __future__ import annotations

import pytest

from tests.jobs import tensor_parallel as jobs

TP_SIZES = (2, 4)


def _run(pool, job, tp: int, *args) -> list[str]:
    return [p for per_rank in pool.run(job, tp, *args, ranks=tp) for p in per_rank]


@pytest.mark.parametrize("algorithm", ["auto", "ring", "native"])
def test_all_gather_along_last_dim_places_rank_blocks_in_order(pool, algorithm):
    assert _run(pool, jobs.all_gather_last_dim, 4, algorithm) == []


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("gather_output", [True, False])
def test_column_parallel_linear_matches_nn_linear(pool, tp, gather_output):
    assert _run(pool, jobs.column_linear, tp, gather_output, "auto") == []


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_nn_linear(pool, tp, input_is_parallel):
    assert _run(pool, jobs.row_linear, tp, input_is_parallel, "auto") == []


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_linear_layers_match_with_a_chosen_algorithm(pool, algorithm):
    assert _run(pool, jobs.column_linear, 4, True, algorithm) == []
    assert _run(pool, jobs.row_linear, 4, False, algorithm) == []


@pytest.mark.parametrize("tp", TP_SIZES)
def test_parallel_mlp_matches_single_device_mlp(pool, tp):
    assert _run(pool, jobs.mlp, tp, "auto") == []


@pytest.mark.parametrize("tp", TP_SIZES)
def test_parallel_self_attention_matches_single_device_attention(pool, tp):
    assert _run(pool, jobs.attention, tp, "auto") == []


@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_parallel_embedding_matches_nn_embedding(pool, tp):
    assert _run(pool, jobs.embedding, tp, "auto") == []


@pytest.mark.parametrize(("tp", "algorithm"), [(2, "auto"), (4, "auto"), (4, "ring")])
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(pool, tp, algorithm):
    assert _run(pool, jobs.cross_entropy, tp, algorithm) == []


@pytest.mark.parametrize(("tp", "algorithm"), [(2, "auto"), (4, "auto"), (4, "ring"), (2, "native")])
def test_training_steps_match_single_device(pool, tp, algorithm):
    assert _run(pool, jobs.train_classifier, tp, algorithm, 3) == []


@pytest.mark.parametrize("tp", TP_SIZES)
def test_sizes_that_do_not_divide_by_the_group_raise_value_error(pool, tp):
    assert _run(pool, jobs.bad_sizes, tp) == []
