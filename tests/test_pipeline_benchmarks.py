"""The pipeline benchmarks (benchmarks/pipeline/bubble.py, the pp section of benchmarks/training/tp_pp.py) on 2 Gloo
ranks with tiny sizes: every configuration leaves a row in --out, in the promised order, with the schedule's
memory bound and the same gradients as torch.distributed.pipelining."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dtrain.launch import run_ranks
from dtrain.parallel.pipeline_schedules import (
    SCHEDULES,
    chunks_per_stage,
    make_schedule,
    theoretical_bubble,
    validate_schedule,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks" / "pipeline"), str(ROOT / "benchmarks" / "training")]

import bubble as pipeline_bubble  # noqa: E402
import device_profile  # noqa: E402
import tp_pp as peers_tp_pp  # noqa: E402
from bubble import expected_peak  # noqa: E402
from tp_pp import PP_FAMILIES, _pipeline_order  # noqa: E402


def _both_benchmarks(bubble_args, pp_args) -> None:
    """What each of the 2 ranks runs: the bubble sweep, then the pipeline pairs (one launch for both)."""
    pipeline_bubble._rank_main(bubble_args)
    peers_tp_pp._rank_main(pp_args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Both benchmarks on 2 Gloo ranks, tiny sizes, in one launch (each launch costs seconds of start-up)."""
    out = tmp_path_factory.mktemp("bench")
    bubble = pipeline_bubble.parse_args(
        ["--microbatches", "1", "2", "--layers", "4", "--width", "8", "--batch", "8", "--warmup", "1", "--steps", "1"]
        + ["--stall-s", "60", "--out", str(out / "bubble.jsonl")]
    )
    pp = peers_tp_pp.parse_args(
        ["--sections", "pp", "--pp-width", "8", "--pp-layers", "4", "--pp-batch", "8", "--microbatches", "2"]
        + ["--pp-iters", "1", "--pp-trials", "1", "--stall-s", "60", "--out", str(out / "pp.jsonl")]
    )
    run_ranks(_both_benchmarks, 2, bubble, pp)
    return {
        name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        for name in ("bubble", "pp")
    }


@pytest.fixture(scope="module")
def bubble_rows(runs) -> list[dict]:
    return runs["bubble"]


@pytest.fixture(scope="module")
def pp_rows(runs) -> list[dict]:
    return runs["pp"]


@given(p=st.integers(1, 6), groups=st.integers(1, 4), stage=st.integers(0, 5), v=st.integers(1, 3))
def test_expected_peak_is_the_schedules_most_microbatches_in_flight(p: int, groups: int, stage: int, v: int) -> None:
    stage, m = stage % p, groups * p
    for name in SCHEDULES:
        chunks = chunks_per_stage(name, v)
        actions = make_schedule(name, p, m, stage, v)
        assert expected_peak(name, p, m, stage, chunks) == validate_schedule(actions, m, chunks)


def test_bubble_sweep_writes_a_row_per_schedule_and_microbatch_count(bubble_rows: list[dict]) -> None:
    # a schedule at a time; interleaved 1F1B needs m to be a multiple of p = 2
    assert [(r["schedule"], r["microbatches"]) for r in bubble_rows] == [
        ("gpipe", 1),
        ("gpipe", 2),
        ("1f1b", 1),
        ("1f1b", 2),
        ("interleaved-1f1b", 2),
    ]


def test_bubble_rows_hold_the_theory_and_the_held_microbatches(bubble_rows: list[dict]) -> None:
    for r in bubble_rows:
        assert r["bubble_theory"] == pytest.approx(theoretical_bubble(2, r["microbatches"], r["virtual_stages"]))
        assert r["peak_activations_per_stage"] == r["peak_expected_per_stage"]
        assert r["bubble_measured"] < 1 and 0 <= r["bubble_timeline"] < 1
        assert r["device"] == "cpu" and r["step_s"] > 0


def test_pipeline_pairs_come_gpipe_and_1f1b_first_then_interleaved() -> None:
    args = argparse.Namespace(microbatches=[4, 8, 16, 6], pp_variants=PP_FAMILIES, pp_layers=16, pp_virtual_stages=2)
    assert _pipeline_order(args, 4) == [
        ("gpipe", 4),
        ("1f1b", 4),
        ("gpipe", 8),
        ("1f1b", 8),
        ("gpipe", 16),
        ("1f1b", 16),
        ("gpipe", 6),
        ("1f1b", 6),
        ("interleaved", 4),
        ("interleaved", 8),
        ("interleaved", 16),  # not 6: interleaved takes micro-batches in groups of the 4 stages
    ]


def test_pipeline_pairs_each_leave_ours_and_torchs_row(pp_rows: list[dict]) -> None:
    assert [(r["variant"], r["microbatches"]) for r in pp_rows] == [
        ("ours-gpipe", 2),
        ("torch-gpipe", 2),
        ("ours-1f1b", 2),
        ("torch-1f1b", 2),
        ("ours-interleaved", 2),
        ("torch-interleaved", 2),
    ]


def test_pipeline_peers_give_torchs_gradients(pp_rows: list[dict]) -> None:
    for r in pp_rows:
        assert r["max_abs_grad_diff_vs_torch"] < 1e-6, r
        assert r["step_s"] > 0 and r["iters"] == 1


def test_the_device_profile_sums_kernels_copies_and_idle_by_fifth_of_a_step():
    # two steps of 100 us each (windows), a kernel and a copy in each, one exchange kernel (a wait, so idle)
    events = [
        ("sgemm", 0.0, 40.0), ("Memcpy PtoP (Device -> Device)", 30.0, 50.0), ("exchange_kernel", 80.0, 100.0),
        ("sgemm", 200.0, 220.0), ("Memset (Unknown)", 260.0, 270.0),
    ]  # fmt: skip
    sums = device_profile._sums(events, runs=2)
    assert sums["compute_ms"] == pytest.approx((40 + 20 + 20) / 2 / 1e3)  # the exchange kernel is a kernel here
    assert sums["copy_ms"] == pytest.approx((20 + 10) / 2 / 1e3)
    assert sums["busy_ms"] == pytest.approx((50 + 20 + 20 + 10) / 2 / 1e3)  # the union of the intervals
    fifths = device_profile._gaps(events, [(0.0, 100.0), (200.0, 300.0)])
    # step 1 idles 50-100 (10, 20, 20 us in fifths 3-5), step 2 220-260 and 270-300 (20, 20, 10, 20 in fifths 2-5)
    assert fifths == pytest.approx([0.0, 0.01, 0.015, 0.015, 0.02])
