"""Usage: python benchmarks/ps/bench.py [--out benchmarks/results] [--only NAMES] [--where cpu2] [--plot PNG]

Parameter-server numbers, all in one run on one machine (docs/results.md shows them):

1. push+pull throughput (GB/s) against worker and server counts on loopback, beside a raw ZeroMQ transfer of the
   same bytes in the same pattern (pull: small request, big reply; push: big request, small reply), the ceiling;
2. iteration time with one worker slowed 5x: sync, quorum (first N-1 of N) and async, against no straggler;
3. load imbalance (max / mean rows served per server) on a Zipf workload, with and without hot-key copies;
4. time from a server's death (kill -9) to training going on, chain and primary-backup, with the acknowledged
   updates the weak mode lost.

``python benchmarks/ps/bench.py --out benchmarks/results`` writes ps_*-cpu2.jsonl there (``--plot PNG``: the
throughput plot).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from dtrain.ps.config import JobConfig
from dtrain.ps.run import Fault, run_job
from dtrain.ps.train import TaskConfig

MACHINE = "this 2-core CPU machine, shared with other jobs"


def _raw_server(address_queue, nbytes: int) -> None:
    """A ZeroMQ ROUTER that answers a pull (b"p") with ``nbytes`` and a push (big frame) with a small ack."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    address_queue.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    payload = np.ones(nbytes // 4, np.float32)
    while True:
        ident, frame = sock.recv_multipart(copy=False)
        if frame.bytes == b"stop":
            break
        sock.send_multipart([ident, payload if len(frame) == 1 else b"a"], copy=False)
    ctx.destroy(linger=0)


def _raw_client(addresses: list[str], nbytes: int, steps: int, result_queue) -> None:
    ctx = zmq.Context()
    socks = []
    for address in addresses:
        s = ctx.socket(zmq.DEALER)
        s.connect(address)
        socks.append(s)
    grad = np.ones(nbytes // 4, np.float32)
    start = time.monotonic()  # one clock for every process of the host: the span runs from the first start
    for _ in range(steps):
        for s in socks:
            s.send(b"p")
        pulled = [np.frombuffer(s.recv(copy=False).buffer, np.float32) for s in socks]
        for s, rows in zip(socks, pulled, strict=True):
            s.send(grad + rows[0], copy=False)
        for s in socks:
            s.recv()
    result_queue.put((start, time.monotonic()))
    ctx.destroy(linger=0)


def raw_zeromq(workers: int, servers: int, shard_bytes: int, steps: int) -> float:
    """GB/s of the same pulls and pushes over bare ZeroMQ (no headers, no HMAC, no checks, no optimizer)."""
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_raw_server, args=(addresses, shard_bytes)) for _ in range(servers)]
    for p in procs:
        p.start()
    endpoints = [addresses.get(timeout=60) for _ in range(servers)]
    clients = [ctx.Process(target=_raw_client, args=(endpoints, shard_bytes, steps, results)) for _ in range(workers)]
    for p in clients:
        p.start()
    spans = [results.get(timeout=300) for _ in range(workers)]
    # from the first client's start to the last one's end, as ps_throughput spans its workers' steps
    seconds = max(end for _, end in spans) - min(start for start, _ in spans)
    zctx = zmq.Context()
    for e in endpoints:
        s = zctx.socket(zmq.DEALER)
        s.connect(e)
        s.send(b"stop")
    for p in clients + procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    zctx.destroy(linger=0)
    return 2 * shard_bytes * servers * workers * steps / seconds / 1e9


def ps_throughput(workers: int, servers: int, shard_bytes: int, steps: int, tmp: Path) -> float:
    """GB/s of push+pull of every key through the parameter server (async: nobody waits for anybody)."""
    width = 256
    num_keys = shard_bytes * servers // (4 * width)
    job = JobConfig(num_keys=num_keys, width=width, num_servers=servers, num_workers=workers, mode="async")
    task = TaskConfig(task="synthetic", steps=steps, width=width)
    run_job(job, task, tmp)
    begin, end = [], []
    for r in range(workers):
        recs = [json.loads(x) for x in (tmp / f"worker-{r}.jsonl").read_text().splitlines()]
        steps_r = [x for x in recs if "step" in x]
        begin.append(steps_r[0]["mono"] - steps_r[0]["step_s"])
        end.append(steps_r[-1]["mono"])
    return 2 * num_keys * width * 4 * workers * steps / (max(end) - min(begin)) / 1e9


def hmac_gb_s(nbytes: int = 4 << 20, repeats: int = 20) -> float:
    """HMAC-SHA256 speed on this machine: every byte on the wire is hashed by its sender and its receiver."""
    import hashlib
    import hmac

    data = np.ones(nbytes // 4, np.float32).tobytes()
    start = time.perf_counter()
    for _ in range(repeats):
        hmac.new(b"k" * 32, data, hashlib.sha256).digest()
    return nbytes * repeats / (time.perf_counter() - start) / 1e9


def throughput(plot: Path | None, tmp: Path) -> list[dict]:
    rows = [{"bench": "hmac", "hmac_sha256_gb_s": hmac_gb_s(), "machine": MACHINE}]
    print(rows[0], flush=True)
    shard_bytes, steps = 4 << 20, 15
    for workers, servers in [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (2, 4)]:
        ps = ps_throughput(workers, servers, shard_bytes, steps, tmp)
        raw = raw_zeromq(workers, servers, shard_bytes, steps)
        row = {"bench": "throughput", "workers": workers, "servers": servers, "bytes_per_server_per_pull": shard_bytes,
               "ps_gb_s": ps, "raw_zeromq_gb_s": raw, "ratio": ps / raw, "machine": MACHINE}  # fmt: skip
        print(row, flush=True)
        rows.append(row)
    if plot is not None:
        _plot(rows[1:], plot)
    return rows


def stragglers(tmp: Path) -> list[dict]:
    rows = []
    base = {"task": "synthetic", "steps": 30, "compute_s": 0.05, "width": 16, "keys_per_step": 0}
    cases = [("no straggler", "sync", {}), ("sync", "sync", {}), ("quorum 3 of 4", "quorum", {"quorum": 3}),
             ("async", "async", {})]  # fmt: skip
    for name, mode, extra in cases:
        slow = {} if name == "no straggler" else {"straggler": 3, "straggler_factor": 5.0}
        job = JobConfig(num_keys=4096, width=16, num_servers=2, num_workers=4, mode=mode, **extra)
        s = run_job(job, TaskConfig(**base, **slow), tmp)
        fast = [s["iteration_s_per_worker"][r] for r in (0, 1, 2)]
        rows.append({"bench": "straggler", "case": name, "mode": mode,
                     "fast_worker_iteration_s": float(np.median(fast)),
                     "straggler_iteration_s": s["iteration_s_per_worker"][3], "dropped": s["dropped"],
                     "compute_s": 0.05, "machine": MACHINE})  # fmt: skip
        print(rows[-1], flush=True)
    baseline = rows[0]["fast_worker_iteration_s"]
    for row in rows:
        row["vs_no_straggler"] = row["fast_worker_iteration_s"] / baseline
    return rows


def hot_keys(tmp: Path) -> list[dict]:
    rows = []
    for zipf in (1.0, 1.2):
        for hot in (0, 64, 256, 1024):
            job = JobConfig(num_keys=8192, width=16, num_servers=4, num_workers=4, mode="async", hot_keys=hot,
                            hot_replicas=3)  # fmt: skip
            task = TaskConfig(task="synthetic", steps=40, keys_per_step=256, zipf=zipf, width=16)
            s = run_job(job, task, tmp)
            reqs = np.array(list(s["requests"].values()), float)
            rows.append({"bench": "hot_keys", "zipf": zipf, "hot_keys_per_server": hot, "hot_replicas": 3,
                         "rows_served": s["rows_served"], "rows_max_over_mean": s["load_max_over_mean"],
                         "requests_max_over_mean": float(reqs.max() / reqs.mean()), "machine": MACHINE})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def failover(tmp: Path) -> list[dict]:
    rows = []
    for replication in ("chain", "primary_backup"):
        for dead_after in (0.5, 1.0, 2.0):
            job = JobConfig(num_keys=4096, width=16, num_servers=3, num_workers=2, mode="async", replicas=2,
                            replication=replication, dead_after_s=dead_after)  # fmt: skip
            task = TaskConfig(task="synthetic", steps=150, compute_s=0.005, width=16, keys_per_step=256, zipf=0.5)
            s = run_job(job, task, tmp, fault=Fault(server=1, step=60))
            rows.append({"bench": "failover", "replication": replication, "dead_after_s": dead_after,
                         "recovery_s": s.get("recovery_s"), "lost_acknowledged_updates": s["lost_acknowledged_updates"],
                         "failovers": len(s["failovers"]), "machine": MACHINE})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['workers']}w x {r['servers']}s" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(x - 0.2, [r["ps_gb_s"] for r in rows], 0.4, label="dtrain.ps push+pull")
    ax.bar(x + 0.2, [r["raw_zeromq_gb_s"] for r in rows], 0.4, label="raw ZeroMQ, same bytes")
    ax.set_xticks(x, labels)
    ax.set_ylabel("GB/s")
    ax.set_title(f"push+pull throughput on loopback ({MACHINE})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--only", default="throughput,straggler,hot_keys,failover")
    parser.add_argument("--where", default="cpu2", help="the machine's tag in the file names (ps_NAME-WHERE.jsonl)")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the throughput to this PNG")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    benches = {"throughput": throughput, "straggler": stragglers, "hot_keys": hot_keys, "failover": failover}
    for name in args.only.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            rows = benches[name](args.plot, Path(tmp)) if name == "throughput" else benches[name](Path(tmp))
        with open(out / f"ps_{name}-{args.where}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
