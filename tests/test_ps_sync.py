"""Sync mode through real server and worker processes equals one process training on the whole global batch."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from ps_helpers import run_job

from dtrain.ps.config import JobConfig
from dtrain.ps.module import key_space
from dtrain.ps.train import TaskConfig, build_task_model, job_keys
from dtrain.train.data import ClassificationBatches


def reference_rows(task: TaskConfig, optimizer: str, lr: float) -> np.ndarray:
    """Single-process torch training on the global batch, laid out as the parameter server's rows."""
    model, _ = build_task_model(task)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam(
        model.parameters(), lr=lr)  # fmt: skip
    batches = ClassificationBatches(in_features=16, num_classes=4, batch_size=task.batch_size, seed=task.seed)
    for step in range(task.steps):
        x, y = batches.batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    slots, _, num_keys = key_space(model, task.width)
    rows = np.zeros((num_keys, task.width), np.float32)
    params = dict(model.named_parameters())
    for s in slots:
        rows[s.first : s.first + s.rows] = s.to_rows(params[s.name].detach().numpy(), task.width)
    return rows


def test_sync_training_equals_single_process_on_the_global_batch(tmp_path, optimizer="sgd", lr=0.1):
    task = TaskConfig(task="mlp", steps=6, batch_size=16, seed=3, width=8)
    job = JobConfig(num_keys=job_keys(task), width=8, num_servers=2, num_workers=2, mode="sync",
                    optimizer=optimizer, lr=lr, momentum=0.9 if optimizer == "sgd" else 0.0)  # fmt: skip
    weights, records, _, _ = run_job(job, task, tmp_path)
    want = reference_rows(task, optimizer, lr)
    np.testing.assert_allclose(weights, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(want, reference_rows(TaskConfig(task="mlp", steps=1, seed=3, width=8), optimizer, lr))
    assert all(len([r for r in recs if "step" in r]) == task.steps for recs in records.values())
