"""Every CPU path side by side in one job started by mpirun: Gloo's own, MPI's own, ``auto``, and our algorithms over
Gloo messages, over /dev/shm peer memory and over MPI messages.

Usage (4 ranks; ``--oversubscribe`` where the host has fewer cores; as root add ``--allow-run-as-root``)::

    mpirun -n 4 --oversubscribe python -m mpi4py benchmarks/collectives/cpu_transports.py \\
        [--calibrate] [--fresh] [--collectives all_reduce,all_gather] [--min-bytes 1K] [--max-bytes 64M] [--out FILE]

Every rank joins torch.distributed's Gloo group (initialised from the MPI ranks) and an
:class:`~dtrain.comm.mpi.MPIGroup` over ``MPI_COMM_WORLD``. ``--calibrate`` first measures ``auto``'s candidates on
the Gloo group (:func:`dtrain.comm.tune.calibrate_rules`: ``native``, ours over Gloo and ours over /dev/shm) and
saves the rules to the per-machine cache that ``auto`` loads by default, as ``dtrain bench calibrate --rules``
does. Then for each collective and size every path is timed by :func:`dtrain.comm.tune.time_interleaved`: ``iters``
calls between two barriers, the paths alternating in ``--rounds`` rounds, the slowest rank's time, the median
round. ``auto`` runs on the Gloo group with whatever rules it loads. Records: ``path`` ("gloo", "peer", "mpi":
what carried the bytes), ``algorithm``, ``time_us``, ``vs_gloo`` (Gloo's own time over this one), ``vs_mpi``,
the load average before and after, and the machine. Rank 0 prints a summary and writes ``--out`` (default
benchmarks/results/cpu_transports-cpu<ranks>.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def main(argv: list[str] | None = None) -> int:
    from dtrain.cli.units import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--min-bytes", type=parse_bytes, default=1 << 10)
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fresh", action="store_true", help="new input and output tensors every call")
    parser.add_argument("--calibrate", action="store_true", help="measure and cache auto's rules first")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from dtrain import comm
    from dtrain.bench import comm as bench
    from dtrain.comm import tune
    from dtrain.comm.cost import rules
    from dtrain.comm.mpi import world as mpi_world

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpi_vs_gloo import _init_gloo

    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    sizes = bench.BenchConfig(min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor).sizes("cpu")
    torch.set_num_threads(1)
    _init_gloo(MPI.COMM_WORLD)
    mpi = mpi_world()
    rank, world = mpi.rank, mpi.size
    device = torch.device("cpu")
    gloo = dist.group.WORLD
    sync = tune.Sync(None)
    load_before = os.getloadavg()
    if args.calibrate:
        made, _ = tune.calibrate_rules(gloo, device, collectives=collectives, sizes=sizes, rounds=args.rounds)
        if rank == 0:
            path = rules.save_rules(made, tune.cache_path_for(gloo, device, "cpu"))
            print(f"rules for auto written to {path}", flush=True)
            for coll, steps in made.table.items():
                print(f"  {coll}: " + ", ".join(f"from {n} B {a}" for n, a in steps), flush=True)
        sync.barrier()
    machine = {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "ranks": world,
        "machine": f"{world} ranks on {os.cpu_count()} cores of {socket.gethostname()} (one host)",
        "torch_version": torch.__version__,
        "mpi": bench.mpi_backend(),
        "device": "cpu",
    }
    records = []
    for coll in collectives:
        ours = [a for a in comm.algorithms(coll) if a not in ("auto", "native", "hierarchical")]
        paths = {"gloo:native": ("gloo", "native"), "mpi:native": ("mpi", "native"), "gloo:auto": ("gloo", "auto")}
        paths |= {f"gloo:{a}": ("gloo", f"{a}@p2p") for a in ours}
        paths |= {f"peer:{a}": ("gloo", f"{a}@peer") for a in ours}
        paths |= {f"mpi:{a}": ("mpi", a) for a in ours}
        names = list(paths)
        for size in sizes:
            iters = tune.iters_for(size, device)
            copies = iters if args.fresh else 1
            on_gloo, nbytes = tune.make_call(coll, size, world, rank, device, None, copies=copies)
            on_mpi, _ = tune.make_call(coll, size, world, rank, device, mpi, copies=copies)
            calls = {"gloo": on_gloo, "mpi": on_mpi}

            def call(name: str, k: int, calls=calls, paths=paths) -> object:
                where, algorithm = paths[name]
                return calls[where](algorithm, k)

            timed = tune.time_interleaved(
                call, names, iters=iters, rounds=args.rounds, warmup=1, device=device, sync=sync
            )
            resolved = comm.api._resolve(
                comm.Collective(coll), "auto", world, nbytes, device, None, None
            )  # what auto ran (kept per group: no communication now)
            g, m = timed["gloo:native"]["time_us"], timed["mpi:native"]["time_us"]
            for name in names:
                t = timed[name]
                where, algorithm = name.split(":")
                records.append({
                    "collective": coll, "nbytes": nbytes, "path": where, "algorithm": algorithm,
                    "resolved_algorithm": resolved if algorithm == "auto" else algorithm,
                    "time_us": t["time_us"], "host_us": t["host_us"], "runs_us": t["runs_us"],
                    "vs_gloo": g / t["time_us"], "vs_mpi": m / t["time_us"], "iters": iters, "rounds": args.rounds,
                    "fresh": args.fresh, "fresh_sets": copies if args.fresh else None, "world_size": world,
                    "dtype": "float32", **machine,
                })  # fmt: skip
            if rank == 0:
                best = min((n for n in names if not n.endswith(("native", "auto"))), key=lambda n: timed[n]["time_us"])
                a, b = timed["gloo:auto"]["time_us"], timed[best]["time_us"]
                print(
                    f"{coll:15s} {nbytes:>10d} B  gloo {g:10.0f}  mpi {m:10.0f}  auto {a:10.0f} ({resolved}, "
                    f"{g / a:.2f}x gloo)  best {best} {b:10.0f} ({g / b:.2f}x gloo, {m / b:.2f}x mpi)  "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            del on_gloo, on_mpi, calls
    sync.barrier()
    if rank == 0:
        load_after = os.getloadavg()
        for r in records:
            r["load_before"], r["load_after"] = load_before[0], load_after[0]
        name = f"cpu_transports{'-fresh' if args.fresh else ''}-cpu{world}.jsonl"
        out = Path(args.out or ROOT / "benchmarks" / "results" / name)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, out)
        print(f"wrote {len(records)} records to {out} (load {load_before[0]:.1f} before, {load_after[0]:.1f} after)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
