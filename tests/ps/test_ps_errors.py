"""The worker API's errors: bad input before anything is sent; a silent server named with its address."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from dtrain.ps.config import JobConfig
from dtrain.ps.launch import LocalCluster
from dtrain.ps.worker import PSTimeoutError, Worker


@pytest.fixture(scope="module")
def cluster():
    config = JobConfig(num_keys=10, width=2, num_servers=2, num_workers=1, mode="async", timeout_s=1.0,
                       dead_after_s=30.0)  # fmt: skip
    with LocalCluster(config) as c:
        worker = Worker(c.coordinator, c.secret, 0)
        worker.wait(worker.init(np.zeros((10, 2), np.float32)))
        yield c, worker
        worker.close()


def test_bad_keys_and_values_are_refused_before_sending(cluster):
    _, worker = cluster
    with pytest.raises(ValueError, match=r"keys must be in \[0, 10\)"):
        worker.pull(np.array([3, 10]))
    with pytest.raises(ValueError, match=r"needs values \(2, 2\)"):
        worker.push(np.array([1, 2]), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="init needs float32"):
        worker.init(np.zeros((10, 2), np.float64))
    assert not worker.requests  # nothing went out


def test_a_server_that_stops_answering_is_named_with_its_address(cluster):
    c, worker = cluster
    address = c.server_address(1)
    os.kill(c.procs["server1"].pid, signal.SIGSTOP)
    try:
        handle = worker.pull(np.array([0, 9]))
        with pytest.raises(PSTimeoutError, match=f"no answer from server 1 at {address} to pull of shard 1"):
            worker.wait(handle)
    finally:
        os.kill(c.procs["server1"].pid, signal.SIGCONT)


def test_the_job_config_names_bad_values():
    with pytest.raises(ValueError, match="quorum must be in \\[0, num_workers=4\\], got 5"):
        JobConfig(num_keys=8, width=2, num_workers=4, mode="quorum", quorum=5)
    with pytest.raises(ValueError, match="replicas=3 needs at least that many servers"):
        JobConfig(num_keys=8, width=2, num_servers=2, replicas=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        JobConfig(num_keys=8, width=2, mode="eventual")
