"""Consistency modes under a straggler: quorum drops or folds late pushes and counts them; SSP never lets a
worker run more than ``staleness`` clocks ahead of the slowest; async lets it run freely."""

from __future__ import annotations

import pytest

from dtrain.ps.config import JobConfig
from dtrain.ps.train import TaskConfig
from tests.jobs.ps import run_job

STEPS = 12
STRAGGLER = TaskConfig(task="synthetic", steps=STEPS, compute_s=0.02, straggler=3, straggler_factor=5.0, width=4)


def _steps(records):
    return [r for r in records if "step" in r]


#: These tests are about consistency, not failure detection: a server is declared dead only after 10 s of
#: silence (the default is 1 s), so a 2-core machine busy with other jobs cannot fail them by starving a server.
CALM = {"dead_after_s": 10.0}


def _final(records):
    return next(r for r in records if r.get("final"))


@pytest.mark.parametrize("late", ["drop", "fold"])
def test_quorum_under_a_5x_straggler_handles_late_pushes_as_configured(tmp_path, late):
    job = JobConfig(num_keys=8, width=4, num_servers=2, num_workers=4, mode="quorum", quorum=3, late=late, **CALM)
    _, records, stats, _ = run_job(job, STRAGGLER, tmp_path)
    late_status = "dropped" if late == "drop" else "folded"
    shards = [s for st in stats.values() for s in st["shards"].values()]
    server_count = sum(s["dropped" if late == "drop" else "folded"] for s in shards)
    worker_counts = {w: sum(_final(recs)[late_status]) for w, recs in records.items()}
    assert server_count == sum(worker_counts.values())  # what the servers counted is what the workers were told
    # quorum takes the first 3 pushes of a round: the straggler is nearly always the one left out (a fast
    # worker can be, when the straggler happens to be on time, so theirs are only bounded, not zero)
    assert worker_counts[3] >= 2 and worker_counts[3] > max(worker_counts[w] for w in range(3))
    other = "folded" if late == "drop" else "dropped"
    assert sum(s[other] for s in shards) == 0
    for shard, s in enumerate(shards):  # every push is in the weights unless it was dropped
        for w in range(4):
            dropped_here = _final(records[w])["dropped"][shard]
            assert s["applied"][w] == STEPS - dropped_here, (shard, w)


def test_ssp_never_exceeds_its_staleness_bound(tmp_path):
    staleness = 1
    job = JobConfig(num_keys=8, width=4, num_servers=2, num_workers=4, mode="ssp", staleness=staleness, **CALM)
    _, records, stats, _ = run_job(job, STRAGGLER, tmp_path)
    pushed = {(w, r["step_clock"]): r["pushed_at"] for w, recs in records.items() for r in _steps(recs)}
    for w, recs in records.items():
        for r in _steps(recs):  # every other worker had sent its push of clock c - s - 1 before w's pull at c
            need = r["step_clock"] - staleness - 1
            for v in records:
                if need >= 0:
                    assert pushed[(v, need)] < r["pulled_at"], (w, r["step_clock"], v)
    logs = [tuple(e) for st in stats.values() for s in st["shards"].values() for e in s["staleness"]]
    assert logs and max(c - slowest for _, c, slowest in logs) == staleness  # the bound is reached, not exceeded


def test_async_lets_fast_workers_run_ahead_of_a_straggler(tmp_path):
    job = JobConfig(num_keys=8, width=4, num_servers=2, num_workers=4, mode="async", **CALM)
    _, records, stats, _ = run_job(job, STRAGGLER, tmp_path)
    fast_done = max(_steps(records[w])[-1]["pulled_at"] for w in range(3))
    straggler_steps_by_then = sum(r["pulled_at"] <= fast_done for r in _steps(records[3]))
    assert straggler_steps_by_then < STEPS - 2  # the fast ones finished while the straggler was far behind
    for st in stats.values():
        for s in st["shards"].values():
            assert s["applied"] == [STEPS] * 4 and s["dropped"] == 0
