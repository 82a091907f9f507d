"""What a worker process runs: a training task on its share of each global batch, with metrics as JSON lines.

Tasks: ``mlp`` (the dense MLP of :mod:`dtrain.ps.classification` on its linear-teacher classification data),
``ctr`` (an embedding model on :class:`~dtrain.ps.data.ClickData`, sparse rows pulled and pushed) and
``synthetic`` (NumPy only, no torch: pulls and pushes of ``keys_per_step`` keys, uniform or Zipf, with a
fixed ``compute_s`` of simulated compute: for consistency tests and benchmarks). A straggler multiplies its
step's compute time by ``straggler_factor``. Every step appends a line to ``<out>/worker-<rank>.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields

import numpy as np

from dtrain.ps.worker import Worker

__all__ = ["TaskConfig", "run_task", "build_task_model", "job_keys"]

TASKS = ("mlp", "ctr", "synthetic")


@dataclass(kw_only=True)
class TaskConfig:
    """A worker's training task (all workers of a job get the same one)."""

    task: str = "mlp"
    steps: int = 20
    batch_size: int = 32  # global: each of W workers takes batch_size / W examples
    seed: int = 0
    out: str = ""  # directory for worker-<rank>.jsonl ("" : no file)
    straggler: int = -1  # rank of the slow worker (-1: none)
    straggler_factor: float = 1.0
    compute_s: float = 0.0  # simulated compute added to each step (synthetic: all of its compute)
    keys_per_step: int = 0  # synthetic: keys pulled and pushed per step (0: every key)
    zipf: float = 0.0  # synthetic: Zipf exponent of the keys (0: uniform)
    width: int = 16  # floats per key

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"TaskConfig.task must be one of {TASKS}, got {self.task!r}")
        if self.steps < 1 or self.batch_size < 1 or self.width < 1 or self.straggler_factor < 1:
            raise ValueError(f"bad TaskConfig: steps {self.steps}, batch {self.batch_size}, width {self.width}, "
                             f"straggler_factor {self.straggler_factor} (all >= 1)")  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TaskConfig:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown TaskConfig fields {sorted(unknown)}")
        return cls(**data)


def build_task_model(task: TaskConfig):
    """The task's torch model, seeded, and the names of its sparse tables."""
    import torch

    from dtrain.ps.classification import mlp_classifier
    from dtrain.ps.data import ClickData

    torch.manual_seed(task.seed)
    if task.task == "mlp":
        return mlp_classifier(in_features=16, hidden=32, num_layers=2, num_classes=4), ()
    vocab = ClickData(seed=task.seed, examples=1).total_vocab
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(vocab, task.width),
                                 "mlp": torch.nn.Sequential(torch.nn.Linear(3 * task.width, 32), torch.nn.ReLU(),
                                                            torch.nn.Linear(32, 1))})  # fmt: skip
    with torch.no_grad():
        model["emb"].weight.mul_(0.1)
    return model, ("emb.weight",)


def job_keys(task: TaskConfig, synthetic_keys: int = 0) -> int:
    """Keys the task needs (``synthetic_keys`` for the synthetic task)."""
    if task.task == "synthetic":
        return synthetic_keys
    import torch

    from dtrain.ps.module import key_space

    with torch.device("meta"):  # shapes alone: no memory for a width the job's checks may yet refuse
        model, sparse = build_task_model(task)
    return key_space(model, task.width, sparse)[2]


def _local(rank: int, workers: int, batch_size: int) -> slice:
    if batch_size % workers:
        raise ValueError(f"global batch {batch_size} does not split evenly over {workers} workers")
    share = batch_size // workers
    return slice(rank * share, (rank + 1) * share)


def _torch_steps(worker: Worker, task: TaskConfig):
    """Yield after each step of the mlp / ctr task: (loss, push statuses, compute seconds)."""
    import torch
    import torch.nn.functional as F

    from dtrain.ps.classification import ClassificationBatches
    from dtrain.ps.data import ClickData
    from dtrain.ps.module import PSModule

    torch.set_num_threads(1)
    model, sparse = build_task_model(task)
    ps = PSModule(worker, model, sparse)
    if worker.rank == 0:
        ps.initialize()
    part = _local(worker.rank, worker.config.num_workers, task.batch_size)
    data = ClickData(seed=task.seed) if task.task == "ctr" else None
    batches = ClassificationBatches(in_features=16, num_classes=4, batch_size=task.batch_size, seed=task.seed)
    for step in range(task.steps):
        if data is None:
            x, y = (t[part] for t in batches.batch(step))
            loss_fn, ids = (lambda x=x, y=y: F.cross_entropy(model(x), y)), None
        else:
            ids_np, labels = (a[part] for a in data.batch(step, task.batch_size))
            x, y = torch.from_numpy(ids_np), torch.from_numpy(labels)
            loss_fn = lambda x=x, y=y: F.binary_cross_entropy_with_logits(  # noqa: E731
                model["mlp"](model["emb"](x).flatten(1)).squeeze(1), y)  # fmt: skip
            ids = {"emb.weight": x.reshape(-1)}
        start = time.perf_counter()
        loss, statuses = ps.step(loss_fn, ids, after_backward=lambda start=start: _straggle(task, worker.rank, start))
        yield loss, statuses, time.perf_counter() - start, {}


def _straggle(task: TaskConfig, rank: int, start: float) -> None:
    """Simulated extra compute (``compute_s``), then the straggler's slowdown of the whole compute."""
    time.sleep(task.compute_s)
    if rank == task.straggler:
        time.sleep((task.straggler_factor - 1) * (time.perf_counter() - start))


def _synthetic_steps(worker: Worker, task: TaskConfig):
    c = worker.config
    rng = np.random.default_rng(task.seed * 1000 + worker.rank)
    if worker.rank == 0:
        worker.wait(worker.init(np.zeros((c.num_keys, c.width), np.float32)))
    weights = np.arange(1, c.num_keys + 1, dtype=np.float64) ** -task.zipf
    weights /= weights.sum()
    for _ in range(task.steps):
        if task.keys_per_step:
            # Zipf rank k is key k: ids handed out in order of first appearance put the popular ones first
            keys = np.unique(rng.choice(c.num_keys, size=task.keys_per_step, p=weights)).astype(np.int64)
        else:
            keys = np.arange(c.num_keys, dtype=np.int64)
        start = time.perf_counter()
        clock = worker.clock
        rows = worker.wait(worker.pull(keys))
        pulled_at = time.monotonic()
        time.sleep(task.compute_s * (task.straggler_factor if worker.rank == task.straggler else 1.0))
        pushed_at = time.monotonic()
        # the gradient depends on the values pulled, so a stale or wrong copy changes the result
        statuses = worker.wait(worker.push(keys, np.float32(1e-3) * (1 + rows)))
        worker.tick()
        trace = {"step_clock": clock, "pulled_at": pulled_at, "pushed_at": pushed_at}
        yield float(rows.mean()) if rows.size else 0.0, statuses, time.perf_counter() - start, trace


def run_task(coordinator: str, secret: bytes, rank: int, task: TaskConfig) -> int:
    """Register as worker ``rank``, run ``task``, write its metrics; the exit status."""
    worker = Worker(coordinator, secret, rank)
    out = None
    if task.out:
        os.makedirs(task.out, exist_ok=True)
        out = open(os.path.join(task.out, f"worker-{rank}.jsonl"), "w")  # noqa: SIM115 (written step by step)
    steps = _synthetic_steps(worker, task) if task.task == "synthetic" else _torch_steps(worker, task)
    begin = time.time()
    try:
        for step, (loss, statuses, step_s, trace) in enumerate(steps):
            record = {"worker": rank, "step": step, "loss": loss, "step_s": step_s, "t": time.time(),
                      "mono": time.monotonic(), "clock": worker.clock, "rounds": worker.round_of,
                      "dropped": statuses.count("dropped"), "folded": statuses.count("folded"),
                      "failovers": worker.failovers, **trace}  # fmt: skip
            if out:
                out.write(json.dumps(record) + "\n")
                out.flush()
        worker.leave()
        if out:
            final = {"worker": rank, "final": True, "wall_s": time.time() - begin, "failovers": worker.failovers,
                     **{status: counts.tolist() for status, counts in worker.acks.items()}}  # fmt: skip
            out.write(json.dumps(final) + "\n")
    finally:
        if out:
            out.close()
        worker.close()
    return 0
