"""Usage: sudo python benchmarks/emulation/exchange.py [--out benchmarks/results/emulation-exchange.jsonl]

Why dtrain's exchange-based all-reduces run at half speed over Gloo, measured on the emulated cluster.

Gloo sends a message only after the receiver has announced its receive buffer, and that announcement travels
on the same TCP connection as the receiver's own outgoing data. dtrain's transport (dtrain/comm/transport.py)
posts a round's sends before its receives, so when two ranks exchange with each other in one round (recursive
doubling, a two-member ring as in a rack-level hierarchical all-reduce) each one's announcement queues behind
its own payload: the two directions go one after the other instead of at once. A ring whose successor and
predecessor differ does not exchange, and does not suffer.

This script runs, on the emulated 2 racks x 2 servers cluster at 1:4 (the one of emulation/measure.py, packed),
ring, recursive doubling and hierarchical all-reduce twice: with the transport as shipped, and with a
transport that posts receives first (patched in this script's worker processes only), next to the
simulator's network-only prediction. Needs root.

    sudo python benchmarks/emulation/exchange.py [--out benchmarks/results/emulation-exchange.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SIZES = (1 << 20, 4 << 20)
ALGORITHMS = ("ring", "recursive_doubling", "hierarchical")


def _receives_first(self, sends, recvs):
    """TorchP2PTransport.start with the receives posted before the sends (Gloo path only)."""
    from dtrain.comm.p2p.transport import _TAG, Pending

    recv_works = [self.group.recv([t], peer, _TAG) for peer, t in recvs]
    send_works = [self.group.send([t], peer, _TAG) for peer, t in sends]
    return [Pending(peer=p, is_send=True, nbytes=t.numel() * t.element_size(), work=w)
            for (p, t), w in zip(sends, send_works, strict=True)] + [
        Pending(peer=p, is_send=False, nbytes=t.numel() * t.element_size(), work=w)
        for (p, t), w in zip(recvs, recv_works, strict=True)]  # fmt: skip


def _time(algorithm: str, nbytes: int) -> float:
    import torch
    import torch.distributed as dist

    from dtrain import comm

    x = torch.ones(nbytes // 4)
    comm.all_reduce(x, algorithm=algorithm)
    runs = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        comm.all_reduce(x, algorithm=algorithm)
        runs.append(time.perf_counter() - start)
    worst = torch.tensor([statistics.median(runs)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def worker(out: str) -> None:
    """Every rank (under torchrun): both transports, every algorithm and size; rank 0 writes the records."""
    import torch.distributed as dist

    from dtrain import comm
    from dtrain.comm.p2p.transport import TorchP2PTransport

    dist.init_process_group("gloo")
    comm.set_local_size(2)  # a rack (2 servers of 1 rank) is the hierarchy's node
    shipped = TorchP2PTransport.start
    rows = []
    for order, start in (("sends-first", shipped), ("receives-first", _receives_first)):
        TorchP2PTransport.start = start
        for algorithm in ALGORITHMS:
            for nbytes in SIZES:
                rows.append(
                    {"order": order, "algorithm": algorithm, "nbytes": nbytes, "seconds": _time(algorithm, nbytes)}
                )
    TorchP2PTransport.start = shipped
    if dist.get_rank() == 0:
        Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.destroy_process_group()


def _predict(rows: list[dict], topology, placement) -> None:
    from dtrain.comm.ir import algorithms
    from dtrain.comm.ir.schedule import Collective
    from dtrain.sim.collective import replay

    for r in rows:
        local = 2 if algorithms.needs_local_size(r["algorithm"]) else None
        schedule = algorithms.build(Collective.ALL_REDUCE, r["algorithm"], 4, local_size=local)
        r["predicted_s"] = replay(schedule, r["nbytes"], topology, placement).time_s
        r["error"] = r["predicted_s"] / r["seconds"] - 1


def main() -> None:
    from measure import cluster

    from dtrain.emulate.build import Emulation
    from dtrain.emulate.model import emulated_topology
    from dtrain.emulate.plan import plan_emulation
    from dtrain.emulate.run import JobConfig, run_job

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/emulation-exchange.jsonl")
    parser.add_argument("--scale", type=float, default=1e-3)
    args = parser.parse_args()
    topology = cluster(4)
    plan = plan_emulation(topology, scale=args.scale, tag="xchg")
    raw = Path("runs/emulate-exchange/raw.jsonl")
    raw.parent.mkdir(parents=True, exist_ok=True)
    with Emulation(plan):
        job = JobConfig(command=["worker", str(raw.resolve())], script=os.path.abspath(__file__),
                        log_dir=raw.parent, timeout_s=600)  # fmt: skip
        if run_job(plan, job):
            raise RuntimeError(f"the exchange benchmark failed; logs in {raw.parent}")
    rows = [json.loads(x) for x in raw.read_text().splitlines()]
    _predict(rows, emulated_topology(topology, plan), [f"{s.server}/gpu0" for s in plan.servers])
    machine = "this 2-core CPU machine, shared with other jobs"
    Path(args.out).write_text("".join(json.dumps({**r, "scale": args.scale, "machine": machine}) + "\n" for r in rows))
    for r in rows:
        print(f"{r['order']:>14} {r['algorithm']:>18} {r['nbytes'] >> 20} MiB: measured {r['seconds'] * 1e3:6.0f} ms, "
              f"simulated {r['predicted_s'] * 1e3:6.0f} ms ({r['error']:+.0%})")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2])
    else:
        main()
