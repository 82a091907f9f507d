"""The test pool takes its jobs as functions: a job that moved or was renamed fails where it is imported."""

from __future__ import annotations

import pytest

from dtrain.testing.pool import job_target
from tests.jobs import comm as comm_jobs


def test_a_module_level_function_is_named_by_its_module_and_name():
    assert job_target(comm_jobs.check_collective) == "tests.jobs.comm:check_collective"


@pytest.mark.parametrize("job", [lambda: None, "tests.jobs.comm:check_collective", comm_jobs])
def test_anything_but_a_module_level_function_is_refused(job):
    with pytest.raises(TypeError, match="module-level function"):
        job_target(job)


def test_a_job_runs_on_the_ranks_asked_for(pool):
    assert pool.run(comm_jobs.rank_and_world, ranks=3) == [(0, 8), (1, 8), (2, 8)]
