"""kill -9 of a server mid-training under chain replication: training goes on, no acknowledged update is lost
(the result equals one process training on the global batch), and the surviving replicas end identical."""

from __future__ import annotations

import time

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.train import TaskConfig, job_keys
from tests.jobs.ps import dump, read_jsonl, reference_rows, run_job


def _kill_at_step(name: str, step: int, out, killed: dict):
    def during(cluster):
        path = out / "worker-0.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.exists() and sum('"step"' in line for line in path.read_text().splitlines()) > step:
                break
            time.sleep(0.01)
        cluster.kill(name)
        killed["t"] = time.time()

    return during


def test_kill_9_under_chain_replication_loses_no_acknowledged_update(tmp_path):
    task = TaskConfig(task="mlp", steps=18, batch_size=16, seed=5, width=8, compute_s=0.03)
    job = JobConfig(num_keys=job_keys(task), width=8, num_servers=3, num_workers=2, mode="sync", lr=0.1,
                    momentum=0.9, replicas=3, replication="chain", dead_after_s=2.0)  # fmt: skip
    killed: dict = {}
    replicas: dict = {}

    def during(cluster):
        _kill_at_step("server1", 6, tmp_path, killed)(cluster)
        cluster.wait_workers(60)
        chains = cluster.layout()["chains"]
        for shard, chain in enumerate(chains):
            replicas[shard] = [dump(cluster, server, shard) for server in chain]

    weights, records, stats, events = run_job(job, task, tmp_path, during=during)
    assert [e["dead"] for e in events if e["event"] == "failover"] == [[1]], events
    assert all(1 not in chain for chain in events[-1]["chains"])
    np.testing.assert_allclose(weights, reference_rows(task, "sgd", 0.1), rtol=1e-4, atol=1e-5)
    for shard, copies in replicas.items():
        assert len(copies) == 2
        for name in copies[0]:
            np.testing.assert_array_equal(copies[0][name], copies[1][name], err_msg=f"shard {shard} {name}")
    for rank, recs in records.items():
        final = next(r for r in recs if r.get("final"))
        assert final["failovers"] == 1
        for shard in range(3):  # every push a worker saw acknowledged is in the surviving weights
            head = next(st for st in stats.values() if st["shards"].get(str(shard), {}).get("head"))
            assert head["shards"][str(shard)]["applied"][rank] == final["applied"][shard] == task.steps
    steps_after = [r for r in read_jsonl(tmp_path / "worker-0.jsonl") if r.get("t", 0) > killed["t"]]
    assert len(steps_after) >= 5  # training went on after the death
