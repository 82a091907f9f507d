"""The worker API's errors: bad input before anything is sent; a silent server named with its address."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from dtrain.ps import messages
from dtrain.ps.config import JobConfig
from dtrain.ps.launch import LocalCluster
from dtrain.ps.worker import PSError, PSTimeoutError, Worker


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


def test_a_gradient_that_is_not_finite_is_refused_naming_its_key(cluster):
    _, worker = cluster
    grads = np.zeros((2, 2), np.float32)
    grads[1, 1] = np.nan
    with pytest.raises(PSError, match=r"refused push of shard 1: push: values must be finite, got NaN or infinity at "
                                      r"key 7$"):  # fmt: skip
        worker.wait(worker.push(np.array([9, 7]), grads))


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


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("staleness", 2**70, r"staleness must be below 2\*\*62, got 1180591620717411303424"),
        ("hot_after", 2**62, r"hot_after must be below 2\*\*62"),
        ("heartbeat_s", float("inf"), "heartbeat_s must be a finite number, got inf"),
        ("momentum", float("inf"), "momentum must be a finite number, got inf"),
        ("timeout_s", float("nan"), "timeout_s must be a finite number, got nan"),
        ("lr", True, "lr must be a finite number, got True"),
    ],
)
def test_the_job_config_refuses_ints_msgpack_cannot_carry_and_numbers_that_are_not_finite(field, value, reason):
    """Every role gets the job as msgpack: an int past its range would leave the coordinator unable to send the
    welcome (every role waiting on it), so the job refuses it, and a welcome that carries one is malformed."""
    with pytest.raises(ValueError, match=reason):
        JobConfig(num_keys=8, width=2, **{field: value})
    config = {**JobConfig(num_keys=8, width=2).to_dict(), field: value}
    with pytest.raises(messages.MessageError, match=reason):
        messages.job_config({"op": "welcome", "config": config})


def test_a_pull_reply_whose_rows_are_not_finite_is_refused_naming_the_key():
    """Finite gradients can still carry a row past float32's range (here 3e38 + 3e38): a worker takes no such row
    for training, and says which key it is."""
    config = JobConfig(num_keys=4, width=2, num_servers=1, num_workers=1, mode="async", lr=1.0, timeout_s=5.0)
    with LocalCluster(config) as c:
        worker = Worker(c.coordinator, c.worker_secret, 0)
        try:
            worker.wait(worker.init(np.full((4, 2), 3e38, np.float32)))
            worker.wait(worker.push(np.array([2]), np.full((1, 2), -3e38, np.float32)))
            with pytest.raises(PSError, match=r"answered pull of shard 0 with a malformed reply: pull: rows must be "
                                              r"finite, got NaN or infinity at key 2$"):  # fmt: skip
                worker.wait(worker.pull(np.array([3, 0, 2])))
        finally:
            worker.close()
