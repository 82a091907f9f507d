"""Gloo and MPI side by side, native and our schedules over each, in one job started by mpirun.

Usage (4 ranks; ``--oversubscribe`` where the host has fewer cores; as root add ``--allow-run-as-root``)::

    mpirun -n 4 --oversubscribe python -m mpi4py benchmarks/collectives/mpi_vs_gloo.py \\
        [--collectives all_reduce,all_gather] [--min-bytes 1K] [--max-bytes 64M] [--out FILE]

Every rank joins two groups of the same processes: torch.distributed's Gloo group, initialised from the MPI
ranks (rank 0 picks a port and broadcasts it over MPI), and an :class:`~dtrain.comm.mpi.MPIGroup` over
``MPI_COMM_WORLD``. For each collective and size it then times, one after the other (interleaved, so that both
see the same machine): Gloo's own collective, MPI's own collective, and each of our algorithms over Gloo
point-to-point and over MPI point-to-point, with :func:`dtrain.bench.comm.time_us` (``iters`` calls between two
barriers, each rank's median of ``trials`` runs, then the largest over ranks; fewer calls a run for large sizes;
``dtrain bench comm`` itself takes each round's slowest rank, then the median over rounds). Records: the
``dtrain bench comm`` fields, ``transport`` "gloo" or "mpi" (what carried the bytes: the backend's own
collective for ``native``, its point-to-point messages for ours), ``backend`` and ``machine`` (host, cores,
ranks). Rank 0 prints a table and writes ``--out`` (default benchmarks/results/mpi_vs_gloo-cpu<ranks>.jsonl).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: Collectives timed by default (every one with a torch.distributed and an MPI equivalent works).
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def _iters(nbytes: int) -> int:
    """Calls a timed run: 10 up to 1 MiB, fewer above (a 64 MiB call takes a good part of a second here)."""
    return 10 if nbytes <= 1 << 20 else 4 if nbytes <= 4 << 20 else 2 if nbytes <= 16 << 20 else 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_gloo(mpi_comm) -> None:
    """The torch.distributed Gloo group of this MPI job's ranks (OMPI_COMM_WORLD_RANK/SIZE as rank/world)."""
    import numpy as np
    import torch.distributed as dist
    from mpi4py import MPI

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", mpi_comm.Get_rank()))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", mpi_comm.Get_size()))
    port = np.array([_free_port() if rank == 0 else 0], dtype=np.int64)
    mpi_comm.Bcast([port, MPI.INT64_T], root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(int(port[0]))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def main(argv: list[str] | None = None) -> int:
    from dtrain.cli.units import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--algorithms", default=None, help="comma-separated subset of ours (default: all)")
    parser.add_argument("--min-bytes", type=parse_bytes, default=1 << 10)
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from dtrain import comm
    from dtrain.bench import comm as bench
    from dtrain.comm.mpi import world as mpi_world

    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    chosen = None if args.algorithms is None else {a.strip() for a in args.algorithms.split(",")}
    config = bench.BenchConfig(
        collectives=collectives, min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor,
        warmup=1, trials=args.trials,
    )  # fmt: skip
    torch.set_num_threads(1)
    _init_gloo(MPI.COMM_WORLD)
    mpi = mpi_world()
    rank, world = mpi.rank, mpi.size
    device = torch.device("cpu")
    groups = {"gloo": (None, bench.Sync(None)), "mpi": (mpi, bench.Sync(mpi))}
    backends = {"gloo": "gloo", "mpi": bench.mpi_backend()}
    machine = {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "ranks": world,
        "machine": f"{world} ranks on {os.cpu_count()} cores of {socket.gethostname()} (one host)",
        "torch_version": torch.__version__,
        "device": "cpu",
    }
    records = []
    for coll in collectives:
        ours = [a for a in comm.algorithms(coll) if a not in ("auto", "native", "hierarchical")]
        ours = [a for a in ours if chosen is None or a in chosen]
        for size in config.sizes("cpu"):
            sized = dataclasses.replace(config, iters=_iters(size))
            for algorithm in ["native", *ours]:
                for over in ("gloo", "mpi"):  # interleaved: the two transports back to back
                    group, sync = groups[over]
                    call, nbytes = bench.operation(coll, size, world, rank, device, group)
                    took_us, host_us = bench.time_us(call, algorithm, sized, device, sync)
                    algbw = nbytes / (took_us * 1e-6) / 1e9
                    records.append({
                        "collective": coll, "algorithm": algorithm, "transport": over, "backend": backends[over],
                        "nbytes": nbytes, "world_size": world, "time_us": took_us, "host_us": host_us,
                        "algbw_gbps": algbw, "busbw_gbps": algbw * bench.bus_factor(coll, world),
                        "iters": sized.iters, "trials": sized.trials, "warmup": sized.warmup, "dtype": "float32",
                        **machine,
                    })  # fmt: skip
                    if rank == 0:
                        print(f"{coll:15s} {nbytes:>10d} B {over:4s} {algorithm:18s} {took_us:12.1f} us", flush=True)
    dist.barrier()
    if rank == 0:
        out = Path(args.out or ROOT / "benchmarks" / "results" / f"mpi_vs_gloo-cpu{world}.jsonl")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, out)
        _summary(records)
        print(f"wrote {len(records)} records to {out}")
    dist.destroy_process_group()
    return 0


def _summary(records: list[dict]) -> None:
    """Per collective and size: Gloo native, MPI native and the best of ours over each, in microseconds."""
    head = ("collective", "bytes", "gloo native", "mpi native", "ours over gloo", "ours over mpi")
    print("\n{:15s} {:>10s} {:>12s} {:>12s} {:>26s} {:>26s}".format(*head))
    for coll, nbytes in dict.fromkeys((r["collective"], r["nbytes"]) for r in records):
        rows = [r for r in records if r["collective"] == coll and r["nbytes"] == nbytes]
        native = {r["transport"]: r["time_us"] for r in rows if r["algorithm"] == "native"}
        best = {}
        for over in ("gloo", "mpi"):
            top = min((r for r in rows if r["transport"] == over and r["algorithm"] != "native"),
                      key=lambda r: r["time_us"], default=None)  # fmt: skip
            best[over] = "-" if top is None else f"{top['time_us']:.0f} ({top['algorithm']})"
        row = (coll, nbytes, native.get("gloo", 0.0), native.get("mpi", 0.0), best["gloo"], best["mpi"])
        print("{:15s} {:>10d} {:12.0f} {:12.0f} {:>26s} {:>26s}".format(*row))


if __name__ == "__main__":
    sys.exit(main())
