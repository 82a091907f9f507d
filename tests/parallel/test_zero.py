"""ZeRO stages 1 and 2 with several buckets: equal to one process, and stage 2 reduce-scatters during backward.

Jobs in tests/jobs/zero.py (the MLP of tests/jobs/data_parallel.py, 484 parameters, buckets closing at 256 bytes:
3 buckets).
"""

from __future__ import annotations

import pytest
import torch

from tests.jobs import zero as jobs

RTOL, ATOL = 1e-5, 1e-6


def _assert_matches_reference(results: list[dict]) -> None:
    for r in results:
        assert r["buckets"] == 3
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["params"], r["ref_params"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("world", "stage", "optimizer", "algorithm"),
    [(2, 2, "adamw", "auto"), (4, 2, "sgd", "ring"), (4, 2, "adamw", "native"), (2, 1, "adamw", "ring")],
)
def test_bucketed_zero_equals_one_process(pool, world, stage, optimizer, algorithm):
    _assert_matches_reference(pool.run(jobs.train, world, stage, optimizer, algorithm, ranks=world))


@pytest.mark.parametrize("stage", [1, 2])
def test_backward_passes_before_a_step_accumulate(pool, stage):
    _assert_matches_reference(pool.run(jobs.train, 2, stage, "adamw", "auto", micro_batches=2, ranks=2))


@pytest.fixture(scope="module")
def allocated(pool):
    return {stage: pool.run(jobs.allocations, 4, stage, ranks=4)[0] for stage in (1, 2)}


def test_stage_2_reduce_scatters_buckets_while_backward_still_runs(allocated):
    r = allocated[2]
    # When the first layer's output gradient exists, the later layers' buckets have already gone out.
    assert 0 < r["launches_mid_backward"] < r["buckets"]


def test_stage_2_releases_the_full_gradients_during_backward(allocated):
    assert allocated[2]["full_grads_after_backward"] == 0
    assert allocated[1]["full_grads_after_backward"] == 484


def test_stage_2_holds_a_gradient_shard_not_the_full_gradient(allocated):
    one, two = allocated[1]["memory"], allocated[2]["memory"]
    assert two.zero.gradient_nbytes < one.zero.gradient_nbytes == one.data_parallel.gradient_nbytes
    assert two.zero.gradient_nbytes * 4 == one.zero.gradient_nbytes  # 4 ranks, buckets padded to 4 elements


def test_stage_2_allocates_no_full_size_gradient_buffer_at_the_step(allocated):
    assert allocated[2]["largest_step_allocation"] < allocated[2]["flat_nbytes"] // 2


@pytest.mark.parametrize("stage", [1, 2])
def test_a_layer_without_a_gradient_on_any_rank_is_not_stepped(pool, stage):
    _assert_matches_reference(pool.run(jobs.unused_parameters, 4, stage, ranks=4))


UNUSED_LAYOUTS = {
    "dp2": {"dp": 2},  # DataParallel's buckets
    "dp2xpp2": {"dp": 2, "pp": 2, "num_microbatches": 2},  # the pipeline's flat all-reduce
    "zero1": {"dp": 2, "zero_stage": 1},
    "zero2": {"dp": 4, "zero_stage": 2},
    "zero3": {"dp": 2, "zero_stage": 3},
}


def test_a_parameter_no_forward_reads_is_left_alone_in_every_layout(pool):
    """A parameter with no gradient on any rank is neither decayed by AdamW nor moved by momentum: one process's
    parameters after 3 steps, in data parallel, a pipeline's data parallel and ZeRO 1, 2 and 3."""
    results = pool.run(jobs.unused_in_hybrid, UNUSED_LAYOUTS)
    off = []
    for name, layout in UNUSED_LAYOUTS.items():
        world = layout["dp"] * layout.get("pp", 1)
        for kind in ("adamw", "sgd"):
            got = [r[f"{name} {kind}"] for r in results]
            assert got[world:] == [None] * (len(results) - world), (name, kind)
            if max(got[:world]) >= 1e-6:
                off.append((name, kind, max(got[:world])))
    assert off == []


def test_replicas_start_from_dp_rank_0s_frozen_parameters_and_buffers_under_every_zero_stage(pool):
    """HybridParallel's replicas start from dp rank 0's model under ZeRO too: its frozen weights and its buffers,
    which no ZeRO stage shards, as well as the parameters it does."""
    results = pool.run(jobs.frozen_and_buffers_from_rank_0, [1, 2, 3])
    assert results[2:] == [None] * (len(results) - 2)
    for got in results[:2]:
        assert all(error < 1e-6 for error in got.values()), got
