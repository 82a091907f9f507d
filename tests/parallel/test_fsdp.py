"""ZeRO-3 (fully sharded data parallel) through ``HybridParallel(zero_stage=3)``: equal to one process in every
layout, sharding that is real, and ``dtrain train --zero 3``.

Jobs in tests/jobs/fsdp.py: a tiny Llama (tied embeddings), 3 AdamW steps with two param groups, clipping and
2 accumulation chunks, float32 within rtol 1e-5, atol 1e-6 of one process on the global batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import fsdp as jobs

POOL_WORLD = 8
REPO = Path(__file__).resolve().parents[2]

LAYOUTS = {  # name -> (grid ranks, layout)
    "dp2": (2, {"dp": 2, "algorithm": "native"}),
    "dp4": (4, {"dp": 4, "algorithm": "auto"}),
    "tp2xdp2": (4, {"dp": 2, "tp": 2, "algorithm": "native"}),
    "pp2xdp2": (4, {"dp": 2, "pp": 2, "num_microbatches": 2, "algorithm": "native"}),
    "shard2xreplicate2": (4, {"dp": 4, "shard_size": 2, "algorithm": "native"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero3_trains_like_one_process(pool, layout):
    world, spec = LAYOUTS[layout]
    results = pool.run(jobs.train, {**spec, "accumulation": 2})  # every process: groups are made collectively
    assert results[world:] == [None] * (POOL_WORLD - world)
    dp = spec["dp"]
    for rank, got in enumerate(results[:world]):
        assert (got["loss"], got["norm"], got["shards"]) == (0.0, 0.0, 0.0), (rank, got)
        assert got["problems"] == [] and got["launches"] > 0, (rank, got)
        # this rank holds its 1/shard share of its stage's (tp-local) parameters, not all of them
        shard = spec.get("shard_size", dp)
        assert got["local_numel"] // shard <= got["held"] <= got["local_numel"] // shard + 16, (rank, got)
    assert results[0]["exported"] == 0.0


def test_memory_report_shows_parameters_gradients_and_state_sharded(pool):
    dp = 4
    got = pool.run(jobs.memory, dp, 6, ranks=dp)
    for r in got:
        report, model_nbytes = r["report"], r["model_nbytes"]
        assert report.stage == 3 and report.world_size == dp
        assert report.data_parallel.parameter_nbytes == model_nbytes
        # float32 shards of 1/dp each (padding: fewer than dp elements a unit)
        for zero, full in [
            (report.zero.parameter_nbytes, report.data_parallel.parameter_nbytes),
            (report.zero.gradient_nbytes, report.data_parallel.gradient_nbytes),
        ]:
            assert full / dp <= zero <= full / dp + 4 * dp * len(r["units"])
        assert report.zero.optimizer_state_nbytes < report.data_parallel.optimizer_state_nbytes / dp * 1.01
        # at most a few units' full parameters were ever gathered at once: the current one, a prefetched one, and
        # in backward the one whose gradient is still being reduced; far from the whole model
        assert report.largest_unit_nbytes >= max(r["units"])
        assert max(r["units"]) <= report.gathered_peak_nbytes <= 3 * report.largest_unit_nbytes
        assert report.gathered_peak_nbytes < 0.6 * model_nbytes
        assert r["resident_after_step"] == 0  # between steps no full parameter is allocated


def _run(out: Path, *flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "dtrain", "train", "--out", str(out), "--no-export", "--no-tensorboard"]
    command += ["--seq-len", "32", "--batch-size", "8", "--precision", "float32", "--warmup-steps", "1", *flags]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dtrain_train_zero3_matches_one_rank(tmp_path):
    one = _run(tmp_path / "one", "--nproc", "1", "--steps", "2")
    sharded = _run(tmp_path / "zero3", "--nproc", "2", "--dp", "2", "--zero", "3", "--steps", "2")
    for a, b in zip(one, sharded, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
