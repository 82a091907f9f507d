"""Hot-key copies on a Zipf workload: the load spreads over servers and training gives the same result."""

from __future__ import annotations

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.train import TaskConfig
from tests.jobs.ps import run_job


def test_hot_key_copies_spread_a_zipf_load_without_changing_the_result(tmp_path):
    task = TaskConfig(task="synthetic", steps=25, keys_per_step=64, zipf=1.2, width=4)
    runs = {}
    for hot in (0, 64):
        job = JobConfig(num_keys=4000, width=4, num_servers=4, num_workers=2, mode="sync", hot_keys=hot, hot_after=3,
                        hot_replicas=3)  # fmt: skip
        out = tmp_path / f"hot{hot}"
        out.mkdir()
        weights, _, stats, _ = run_job(job, task, out)
        rows = np.array([stats[r]["rows_served"] for r in sorted(stats)])
        runs[hot] = (weights, rows.max() / rows.mean(), stats)
    (w_plain, imbalance_plain, _), (w_hot, imbalance_hot, stats) = runs[0], runs[64]
    assert imbalance_plain > 2.5  # Zipf ids in key ranges: server 0 holds the popular rows
    assert imbalance_hot < 0.75 * imbalance_plain
    assert stats[0]["hot"]["owned_hot"]["0"] > 0  # server 0 owns the popular rows and copied some
    assert all(stats[r]["hot"]["copies"] >= 1 for r in (1, 2, 3))  # to each of the 3 others
    # in sync mode a copy answers a pull for round r with the owner's round-r rows, so nothing changes
    np.testing.assert_array_equal(w_hot, w_plain)
