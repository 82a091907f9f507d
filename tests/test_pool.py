"""The test pool: jobs given as functions (a job that moved or was renamed fails where it is imported), and a
failed or stalled job reported, with the pool started again for the next."""

from __future__ import annotations

import time

import pytest

from dtrain.testing.pool import JobError, ProcessPool, job_target
from tests.jobs import comm as comm_jobs
from tests.jobs import pool as pool_jobs


def test_a_module_level_function_is_named_by_its_module_and_name():
    assert job_target(comm_jobs.check_collective) == "tests.jobs.comm:check_collective"


@pytest.mark.parametrize("job", [lambda: None, "tests.jobs.comm:check_collective", comm_jobs])
def test_anything_but_a_module_level_function_is_refused(job):
    with pytest.raises(TypeError, match="module-level function"):
        job_target(job)


def test_a_job_runs_on_the_ranks_asked_for(pool):
    assert pool.run(comm_jobs.rank_and_world, ranks=3) == [(0, 8), (1, 8), (2, 8)]


def test_a_failed_job_is_reported_and_the_next_job_runs_on_fresh_processes():
    with ProcessPool(2, timeout_s=30) as pool:
        before = pool.run(pool_jobs.pid)
        with pytest.raises(JobError, match="rank 1 fails on purpose") as caught:
            pool.run(pool_jobs.fail_on, 1)
        assert "--- rank 0 ---" not in str(caught.value)  # rank 0 finished its part
        after = pool.run(pool_jobs.pid)
        assert pool.restarts == 1 and set(after).isdisjoint(before)


def test_a_rank_that_does_not_finish_is_named_with_its_stack_and_the_pool_starts_again():
    with ProcessPool(2, timeout_s=3) as pool:
        started = time.monotonic()
        with pytest.raises(JobError) as caught:
            pool.run(pool_jobs.sleep_on, 1, 60.0)
        assert time.monotonic() - started < 15
        message = str(caught.value)
        assert "--- rank 1, still running ---" in message and "in sleep_on" in message
        assert "rank 0, still running" not in message
        assert pool.run(pool_jobs.sleep_on, 1, 0.0) == ["ok", "ok"]


def test_workers_get_the_environment_the_pool_was_made_in_not_the_fork_servers(monkeypatch):
    monkeypatch.setenv("DTRAIN_POOL_PROBE", "made")
    with ProcessPool(2, timeout_s=30) as pool:
        monkeypatch.setenv("DTRAIN_POOL_PROBE", "later")
        pool.restart()
        assert pool.run(pool_jobs.env, "DTRAIN_POOL_PROBE") == ["made", "made"]
