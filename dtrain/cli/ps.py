"""``dtrain ps``: train through the parameter server, every role a local process (see :mod:`dtrain.ps`).

On a cluster, start each process with ``python -m dtrain.ps`` and its role, rank, the coordinator's address and
the shared secret in the environment (:mod:`dtrain.ps.launch`).
"""

from __future__ import annotations

import argparse
import math
import sys

__all__ = ["register"]


def _pair(text: str) -> tuple[int, float]:
    try:
        a, b = text.split(":")
        return int(a), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I:X, e.g. 1:5 or 2:10, got {text!r}") from None


def register(commands) -> None:
    """Add ``dtrain ps`` to the ``dtrain`` command's subparsers."""
    p = commands.add_parser("ps", help="train through the parameter server (coordinator, servers, workers)")
    p.add_argument("--model", choices=["mlp", "ctr", "synthetic"], default="mlp",
                   help="mlp: dense MLP; ctr: embeddings on power-law click data; synthetic: no torch")  # fmt: skip
    p.add_argument("--servers", type=int, default=2, help="server processes, 1 to 256 (default: 2)")
    p.add_argument("--workers", type=int, default=2, help="worker processes, 1 to 256 (default: 2)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over the workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=["sync", "quorum", "async", "ssp"], default="sync")
    p.add_argument("--quorum", type=int, default=0, help="quorum mode: pushes that close a round (0: all)")
    p.add_argument("--late", choices=["drop", "fold"], default="drop", help="quorum mode: what a late push becomes")
    p.add_argument("--staleness", type=int, default=2, help="ssp mode: clocks a worker may run ahead")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=None, help="a finite number > 0; default 0.1 (sgd) or 0.01 (adam)")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd's, at least 0 and below 1 (default: 0.9)")
    p.add_argument("--replicas", type=int, default=1, help="servers holding each shard")
    p.add_argument("--replication", choices=["chain", "primary_backup"], default="chain")
    p.add_argument("--hot-keys", type=int, default=0, help="hottest rows per server copied to other servers")
    p.add_argument("--hot-replicas", type=int, default=1, help="servers each hot row is copied to")
    p.add_argument("--straggler", type=_pair, default=None, metavar="I:F", help="slow worker I by factor F")
    p.add_argument("--fault", type=_pair, default=None, metavar="J:N", help="kill -9 server J after step N")
    p.add_argument("--dead-after-s", type=float, default=1.0, help="heartbeat silence that declares a server dead")
    p.add_argument("--compute-s", type=float, default=0.0, help="simulated compute added to each step")
    p.add_argument("--width", type=int, default=16, help="floats per key (the embedding width for ctr)")
    p.add_argument("--out", default="runs/ps", help="worker-<rank>.jsonl and metrics.jsonl")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=_run)


# JobConfig's fields as the flags that set them, for error messages
FLAGS = {"num_keys": "the model's key count (--model)", "width": "--width", "num_servers": "--servers",
         "num_workers": "--workers", "mode": "--mode", "quorum": "--quorum", "late": "--late",
         "staleness": "--staleness", "optimizer": "--optimizer", "lr": "--lr", "momentum": "--momentum",
         "replicas": "--replicas", "replication": "--replication", "hot_keys": "--hot-keys",
         "hot_replicas": "--hot-replicas", "dead_after_s": "--dead-after-s"}  # fmt: skip


#: The most servers, and the most workers, ``dtrain ps`` starts (each a process on this machine).
MAX_PROCESSES = 256
#: The longest simulated compute a step (``--compute-s``) and the largest straggler slowdown: a sleep beyond
#: what the platform's timer takes would end every worker with an OverflowError.
MAX_DELAY_S = 86400.0
MAX_SLOWDOWN = 1000.0


def _check_flags(args: argparse.Namespace) -> None:
    """Flags the job's own validation cannot name, refused before any process starts."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--width", args.width)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.workers >= 1 and args.model != "synthetic" and args.batch_size % args.workers:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over --workers {args.workers}")
    if not 0 <= args.compute_s <= MAX_DELAY_S:
        raise ValueError(f"--compute-s must be a finite number of seconds >= 0, got {args.compute_s} (at most "
                         f"{MAX_DELAY_S:.0f})")  # fmt: skip
    # the job's own checks refuse NaN, zero and negative values, naming the flag (FLAGS); not infinity
    if args.lr is not None and args.lr == math.inf:
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    if args.momentum >= 1:
        raise ValueError(f"--momentum must be below 1 (0.9 keeps nine tenths of the last update), got {args.momentum}")
    if args.dead_after_s == math.inf:
        raise ValueError(f"--dead-after-s must be a finite number of seconds > 0, got {args.dead_after_s}")
    for flag, value in (("--servers", args.servers), ("--workers", args.workers)):
        if value > MAX_PROCESSES:
            raise ValueError(f"{flag} {value}: each is a local process; at most {MAX_PROCESSES}")
    if args.straggler:
        worker, factor = args.straggler
        if not 0 <= worker < args.workers:
            raise ValueError(f"--straggler names worker {worker}; workers are 0..{args.workers - 1}")
        if not 1 <= factor <= MAX_SLOWDOWN:
            raise ValueError(f"--straggler {worker}:{factor}: the slowdown factor must be a finite number >= 1 (at "
                             f"most {MAX_SLOWDOWN:.0f})")  # fmt: skip
    if args.fault:
        server, step = args.fault
        if not 0 <= server < args.servers:
            raise ValueError(f"--fault names server {server}; servers are 0..{args.servers - 1}")
        if not math.isfinite(step) or step != int(step) or not 0 <= step < args.steps:
            raise ValueError(f"--fault {server}:{step}: the step must be a whole number in 0..{args.steps - 1}")
        if args.replicas < 2:
            raise ValueError(f"--fault kills a server, and with --replicas {args.replicas} its shard dies with it: "
                             "add --replicas 2 (or more) to run with a fault")  # fmt: skip
    from dtrain.cli.paths import check_dir_out

    check_dir_out("--out", args.out)


def _run(args: argparse.Namespace) -> int:
    try:
        return _train(args)
    except KeyboardInterrupt:
        print("dtrain ps: interrupted; every process it started is stopped", file=sys.stderr)
        return 130


def _loss(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "n/a"


def _train(args: argparse.Namespace) -> int:
    from dtrain.ps.config import JobConfig, JobConfigError
    from dtrain.ps.run import Fault, run_job
    from dtrain.ps.train import TaskConfig, job_keys

    _check_flags(args)
    straggler, factor = args.straggler if args.straggler else (-1, 1.0)
    task = TaskConfig(task=args.model, steps=args.steps, batch_size=args.batch_size, seed=args.seed, width=args.width,
                      straggler=straggler, straggler_factor=factor, compute_s=args.compute_s,
                      keys_per_step=64 if args.model == "synthetic" else 0, zipf=1.1)  # fmt: skip
    lr = args.lr if args.lr is not None else (0.1 if args.optimizer == "sgd" else 0.01)
    try:
        job = JobConfig(num_keys=job_keys(task, synthetic_keys=4096), width=args.width, num_servers=args.servers,
                        num_workers=args.workers, mode=args.mode, quorum=args.quorum, late=args.late,
                        staleness=args.staleness, optimizer=args.optimizer, lr=lr, momentum=args.momentum,
                        replicas=args.replicas, replication=args.replication, hot_keys=args.hot_keys,
                        hot_replicas=args.hot_replicas, dead_after_s=args.dead_after_s)  # fmt: skip
    except JobConfigError as exc:
        raise ValueError(exc.worded(FLAGS)) from None
    fault = Fault(server=int(args.fault[0]), step=int(args.fault[1])) if args.fault else None
    s = run_job(job, task, args.out, fault=fault, progress=not args.no_progress)
    ok = all(v == 0 for v in s["worker_exit"].values())
    iteration = f"{s['iteration_s'] * 1e3:.1f} ms/iteration" if s["iteration_s"] is not None else "no full iteration"
    load = f"{s['load_max_over_mean']:.2f}" if s["load_max_over_mean"] is not None else "n/a"
    losses = f"loss {_loss(s['first_loss'])} -> {_loss(s['final_loss'])}"
    print(f"dtrain ps: {args.mode}, {args.workers} workers, {args.servers} servers: {losses}, {iteration}, dropped "
          f"{s['dropped']}, folded {s['folded']}, lost acknowledged updates {s['lost_acknowledged_updates']}, "
          f"load max/mean {load}; metrics in {args.out}/metrics.jsonl")  # fmt: skip
    if fault:
        if s.get("recovery_s") is not None:
            went_on = f"training went on after {s['recovery_s']:.2f} s"
        else:
            went_on = "training did not go on after it"
        print(f"dtrain ps: server {fault.server} killed after step {fault.step}; {went_on}")
    if not ok:
        failed = sorted(r for r, v in s["worker_exit"].items() if v != 0)
        print(f"dtrain ps: workers {failed} failed (exit statuses {s['worker_exit']})", file=sys.stderr)
    return 0 if ok else 1
