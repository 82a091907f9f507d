"""Sync mode through real server and worker processes equals one process training on the whole global batch."""

from __future__ import annotations

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.train import TaskConfig, job_keys
from tests.jobs.ps import reference_ctr_rows, reference_rows, run_job


def test_sync_training_equals_single_process_on_the_global_batch(tmp_path, optimizer="sgd", lr=0.1):
    task = TaskConfig(task="mlp", steps=6, batch_size=16, seed=3, width=8)
    job = JobConfig(num_keys=job_keys(task), width=8, num_servers=2, num_workers=2, mode="sync",
                    optimizer=optimizer, lr=lr, momentum=0.9 if optimizer == "sgd" else 0.0)  # fmt: skip
    weights, records, _, _ = run_job(job, task, tmp_path)
    want = reference_rows(task, optimizer, lr)
    np.testing.assert_allclose(weights, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(want, reference_rows(TaskConfig(task="mlp", steps=1, seed=3, width=8), optimizer, lr))
    assert all(len([r for r in recs if "step" in r]) == task.steps for recs in records.values())


def test_sync_sparse_embedding_training_equals_single_process(tmp_path):
    """Workers pull and push only the embedding rows their batch uses; the servers average rows that some
    workers did not touch as zeros, exactly as one process's mean over the global batch does."""
    task = TaskConfig(task="ctr", steps=5, batch_size=32, seed=2, width=8)
    job = JobConfig(num_keys=job_keys(task), width=8, num_servers=2, num_workers=2, mode="sync", lr=0.5)
    weights, _, _, _ = run_job(job, task, tmp_path)
    want = reference_ctr_rows(task, 0.5)
    np.testing.assert_allclose(weights, want, rtol=1e-4, atol=1e-6)
