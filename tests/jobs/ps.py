"""Shared code of the parameter-server tests: run a job on a local cluster, read back shards and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dtrain.ps.classification import ClassificationBatches
from dtrain.ps.config import JobConfig
from dtrain.ps.keys import partition
from dtrain.ps.launch import LocalCluster
from dtrain.ps.module import key_space
from dtrain.ps.train import TaskConfig, build_task_model


def dump(cluster: LocalCluster, server: int, shard: int) -> dict[str, np.ndarray]:
    """Every array of ``shard``'s replica on ``server``."""
    msg = cluster.ask_server(server, {"op": "dump", "shard": shard})
    return {name: np.array(t) for name, t in zip(msg.header["names"], msg.tensors, strict=True)}


def gather_weights(cluster: LocalCluster) -> np.ndarray:
    """The full ``(num_keys, width)`` weights, each shard read from its current head."""
    chains = cluster.layout()["chains"]
    shards = range(len(partition(cluster.config.num_keys, cluster.config.num_servers)))
    return np.concatenate([dump(cluster, chains[s][0], s)["weights"] for s in shards])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_job(job: JobConfig, task: TaskConfig, out: Path, timeout_s: float = 60.0, during=None):
    """Start a cluster and ``job.num_workers`` workers on ``task``; ``during(cluster)`` runs while they train.
    Returns (weights at the end, per-worker metric records, the cluster's server stats, coordinator events)."""
    task_map = {**task.to_dict(), "out": str(out)}
    with LocalCluster(job) as cluster:
        for rank in range(job.num_workers):
            cluster.start_worker(rank, task_map)
        if during is not None:
            during(cluster)
        statuses = cluster.wait_workers(timeout_s)
        assert statuses == dict.fromkeys(range(job.num_workers), 0), f"worker exit statuses {statuses}"
        weights = gather_weights(cluster)
        layout = cluster.layout()
        stats = {r: cluster.ask_server(r, {"op": "stats"}).header["stats"]
                 for r, ep in enumerate(layout["endpoints"]) if ep}  # fmt: skip
        events = cluster.events()
    records = {r: read_jsonl(out / f"worker-{r}.jsonl") for r in range(job.num_workers)}
    return weights, records, stats, events


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


def reference_ctr_rows(task: TaskConfig, lr: float) -> np.ndarray:
    """Single-process torch training of the ctr embedding model on the global batch, as the server's rows."""
    from dtrain.ps.data import ClickData

    model, sparse = build_task_model(task)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = ClickData(seed=task.seed)
    for step in range(task.steps):
        ids, labels = (torch.from_numpy(a) for a in data.batch(step, task.batch_size))
        opt.zero_grad()
        logits = model["mlp"](model["emb"](ids).flatten(1)).squeeze(1)
        F.binary_cross_entropy_with_logits(logits, labels).backward()
        opt.step()
    slots, tables, num_keys = key_space(model, task.width, sparse)
    rows = np.zeros((num_keys, task.width), np.float32)
    params = dict(model.named_parameters())
    for s in slots:
        rows[s.first : s.first + s.rows] = s.to_rows(params[s.name].detach().numpy(), task.width)
    for name, first in tables.items():
        rows[first : first + params[name].shape[0]] = params[name].detach().numpy()
    return rows
