"""ZeRO with several param groups, its gradient norm and scaling over the ranks, and gradients averaged in bf16,
on real Gloo ranks against one process on the whole batch (jobs in tests/jobs/precision.py)."""

from __future__ import annotations

import pytest

from tests.jobs import precision as jobs


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_decay_and_no_decay_groups_norm_and_scaling_equal_one_process(pool, stage):
    for got in pool.run(jobs.zero_groups_norm_and_scaling, 2, stage, ranks=2):
        assert got["groups"] == 2 and got["decays"] == [0.0, 0.1]
        assert got["norm_error"] < 1e-5, got
        assert got["param_error"] < 1e-6, got
        assert got["moved"] > 1e-3, got  # the steps moved the parameters far beyond the tolerance
        assert got["state"] > 0


def test_weighted_square_sum_counts_each_element_by_its_parameter(pool):
    for got in pool.run(jobs.weighted_square_sum, 4, ranks=4):
        assert got["got"] == pytest.approx(got["expected"], rel=1e-5)


def test_gradients_averaged_in_bf16_round_like_bf16_and_agree_over_ranks(pool):
    bf16 = pool.run(jobs.bf16_reduction, 2, "bf16", ranks=2)
    exact = pool.run(jobs.bf16_reduction, 2, "float32", ranks=2)
    for low, high in zip(bf16, exact, strict=True):
        assert low["dtype"] == "torch.float32" and low["same_on_every_rank"]
        assert high["error"] < 1e-6 * high["scale"]
        assert 0 < low["error"] < 2**-7 * low["scale"]  # bf16's 8-bit mantissa, and really rounded
