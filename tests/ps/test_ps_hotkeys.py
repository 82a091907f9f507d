"""Hot-key copies on a Zipf workload: the load spreads over servers and training gives the same result."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.launch import LocalCluster
from dtrain.ps.train import TaskConfig
from dtrain.ps.worker import Worker
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


def test_a_round_closed_by_a_leave_reaches_the_hot_row_copies():
    """Sync, 2 workers: once worker 1 leaves, worker 0's push alone closes each round. A pull of the hot rows for
    the round a leave closed goes to a copy, which is sent that round's rows as after any closing push."""
    job = JobConfig(num_keys=8, width=2, num_servers=2, num_workers=2, mode="sync", lr=1.0, hot_keys=2, hot_after=1,
                    hot_replicas=1, timeout_s=3.0)  # fmt: skip
    with LocalCluster(job) as cluster:
        with ThreadPoolExecutor(2) as pool:  # the coordinator welcomes workers once all have registered
            workers = list(pool.map(lambda rank: Worker(cluster.coordinator, cluster.worker_secret, rank), range(2)))
        try:
            w0, w1 = workers
            w0.wait(w0.init(np.zeros((8, 2), np.float32)))
            hot, grad = np.array([0, 1], np.int64), np.ones((2, 2), np.float32)
            for _ in range(2):  # round 1 picks shard 0's hot rows; round 2's pulls learn where their copies are
                for w in workers:
                    w.wait(w.pull(hot))
                handles = [w.push(hot, grad) for w in workers]
                for w, h in zip(workers, handles, strict=True):
                    w.wait(h)
            assert w0.hot.hot[0][1] == [1]  # shard 0's hot rows are copied to server 1
            np.testing.assert_array_equal(w0.wait(w0.pull(hot)), np.full((2, 2), -2.0, np.float32))  # from the copy
            handle = w0.push(hot, grad)  # round 2 waits for worker 1's push ...
            w1.leave()  # ... which never comes: the leave closes it
            w0.wait(handle)
            rows = w0.wait(w0.pull(hot))  # round 3's rows, from server 1's copy
            np.testing.assert_array_equal(rows, np.full((2, 2), -3.0, np.float32))
        finally:
            for w in workers:
                w.close()
