"""One parameter-server job on this machine, start to end: what ``dtrain ps`` and the benchmarks run.

Starts the coordinator and servers (:class:`~dtrain.ps.launch.LocalCluster`) and the workers, shows progress
(rich) from the workers' JSON lines, injects the fault asked for (``kill -9`` of server ``j`` once worker 0
finished step ``n``), then reads every server's counters and writes ``metrics.jsonl``: each worker step, then
one summary line (losses, iteration times, late pushes, failovers with the time from the death to the next
step, and the acknowledged updates lost, per the workers' acknowledgements against the surviving heads).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.launch import LocalCluster
from dtrain.ps.train import TaskConfig

__all__ = ["Fault", "run_job", "summarize"]


@dataclass(frozen=True)
class Fault:
    """Kill server ``server`` with SIGKILL once worker 0 completed step ``step``."""

    server: int
    step: int


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _watch(cluster: LocalCluster, job: JobConfig, task: TaskConfig, out: Path, fault: Fault | None,
           progress: bool) -> float | None:  # fmt: skip
    """Follow the workers until they exit; kill the faulty server on time. The kill's time, if any."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    killed_at = None
    columns = (TextColumn("[bold]dtrain ps[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task_id = bar.add_task(f"{job.mode} x{job.num_workers} workers", total=task.steps * job.num_workers)
        workers = [p for name, p in cluster.procs.items() if name.startswith("worker")]
        while any(p.poll() is None for p in workers):
            records = [_read(out / f"worker-{r}.jsonl") for r in range(job.num_workers)]
            done = sum(sum("step" in x for x in recs) for recs in records)
            losses = [x["loss"] for x in records[0] if "step" in x]
            bar.update(task_id, completed=done, description=f"{job.mode}, loss {losses[-1]:.4f}" if losses else "")
            if fault and killed_at is None and len(losses) > fault.step:
                cluster.kill(f"server{fault.server}")
                killed_at = time.time()
            time.sleep(0.05)
    return killed_at


def run_job(job: JobConfig, task: TaskConfig, out: str | Path, fault: Fault | None = None,
            progress: bool = False, timeout_s: float = 600.0) -> dict:  # fmt: skip
    """Run the job; the summary (also the last line of ``<out>/metrics.jsonl``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("worker-*.jsonl"):
        old.unlink()
    if fault and not 0 <= fault.server < job.num_servers:
        raise ValueError(f"fault: server {fault.server} does not exist (servers 0..{job.num_servers - 1})")
    if fault and job.replicas < 2:
        raise ValueError(f"fault: killing server {fault.server} loses its shard without replication (replicas=1)")
    task_map = {**task.to_dict(), "out": str(out)}
    began = time.time()
    with LocalCluster(job) as cluster:
        for rank in range(job.num_workers):
            cluster.start_worker(rank, task_map)
        killed_at = _watch(cluster, job, task, out, fault, progress)
        statuses = cluster.wait_workers(timeout_s)
        layout = cluster.layout()
        stats = {r: cluster.ask_server(r, {"op": "stats"}).header["stats"]
                 for r, ep in enumerate(layout["endpoints"]) if ep}  # fmt: skip
        events = cluster.events()
    records = {r: _read(out / f"worker-{r}.jsonl") for r in range(job.num_workers)}
    summary = summarize(job, records, stats, layout, events, killed_at)
    summary.update(wall_s=time.time() - began, worker_exit=statuses, job=job.to_dict(), task=task.to_dict())
    with open(out / "metrics.jsonl", "w") as f:
        for rank in sorted(records):
            for record in records[rank]:
                if "step" in record:
                    f.write(json.dumps(record) + "\n")
        f.write(json.dumps({"summary": True, **summary}) + "\n")
    return summary


def _mean_loss(steps: dict[int, list[dict]], part: slice) -> float | None:
    losses = [x["loss"] for recs in steps.values() for x in recs[part]]
    return float(np.mean(losses)) if losses else None


def summarize(job: JobConfig, records: dict, stats: dict, layout: dict, events: list, killed_at: float | None) -> dict:
    """Numbers of a finished job (see the module docstring)."""
    steps = {r: [x for x in recs if "step" in x] for r, recs in records.items()}
    finals = {r: next((x for x in recs if x.get("final")), {}) for r, recs in records.items()}
    heads = {int(s): st["shards"][s] for st in stats.values() for s in st["shards"] if st["shards"][s]["head"]}
    lost = 0
    for r, final in finals.items():
        for shard, acked in enumerate(final.get("applied", [])):
            if shard in heads:
                lost += max(0, acked - heads[shard]["applied"][r])
    step_s = [x["step_s"] for recs in steps.values() for x in recs[1:]]
    out = {
        # mean over every worker's first / last five steps: one local batch's loss is noisy
        "first_loss": _mean_loss(steps, slice(0, 5)),
        "final_loss": _mean_loss(steps, slice(-5, None)),
        "iteration_s": float(np.median(step_s)) if step_s else None,
        "iteration_s_per_worker": {
            r: float(np.median([x["step_s"] for x in recs[1:]])) for r, recs in steps.items() if len(recs) > 1
        },  # fmt: skip
        "dropped": sum(h["dropped"] for h in heads.values()),
        "folded": sum(h["folded"] for h in heads.values()),
        "rows_served": {r: st["rows_served"] for r, st in stats.items()},
        "requests": {r: st["pulls"] for r, st in stats.items()},
        "rejected_messages": sum(st["rejected"] for st in stats.values()),
        "lost_acknowledged_updates": lost,
        "failovers": [e for e in events if e["event"] == "failover"],
    }
    rows = np.array(list(out["rows_served"].values()), dtype=float)
    out["load_max_over_mean"] = float(rows.max() / rows.mean()) if rows.size and rows.mean() else None
    if killed_at is not None:
        resumed = [x["t"] for recs in steps.values() for x in recs if x["t"] > killed_at and x["failovers"] > 0]
        out["killed_at"] = killed_at
        out["recovery_s"] = min(resumed) - killed_at if resumed else None
    return out
