"""The ``dtrain`` command: ``dtrain check``, ``dtrain bench comm|calibrate|verify|compute|overlap``, ``dtrain train``.

Multi-rank commands take ``--nproc N`` and start N local ranks through torch's launcher API; under torchrun
(``torchrun --nproc-per-node 4 -m dtrain bench comm``) they join the job torchrun started instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dtrain.cli.units import parse_bytes, whole
from dtrain.env import CommEnv
from dtrain.interrupts import note_interrupts

__all__ = ["main", "build_parser", "parse_bytes"]


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_bench_comm(sub) -> None:
    p = sub.add_parser("comm", help="time every collective algorithm over a size sweep, next to the cost model")
    p.add_argument("--nproc", type=whole(1), default=2, help="local ranks to start (ignored under torchrun)")
    p.add_argument(
        "--collectives",
        type=_names,
        default=["all_reduce"],
        help="comma-separated, e.g. all_reduce,all_gather",
    )
    p.add_argument(
        "--algorithms",
        type=_names,
        default=None,
        help="comma-separated subset (default: all, auto and native too); torch: torch.distributed's own call, "
        "beside ours (each record's vs_torch)",
    )
    p.add_argument("--min-bytes", type=parse_bytes, default=None, help="default 1K on CPU, 8K on GPU")
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="default 64M on CPU, 1G on GPU")
    p.add_argument("--factor", type=int, default=4, help="size step (2 or 4)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--warm-s", type=float, default=None, help="seconds of untimed calls first (default: 1 on GPUs)")
    p.add_argument("--iters", type=int, default=None, help="calls back to back per timed run (default 10)")
    p.add_argument("--trials", type=int, default=3, help="timed runs; the median counts")
    p.add_argument("--graphs", action="store_true", help="on GPUs, also time each algorithm as a CUDA graph")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="each call of a run on its own set of input and output tensors, made before the timed loop (the same "
        "sets every round; fewer calls a run past 1 GiB of sets a rank)",
    )
    p.add_argument(
        "--fresh-beside",
        action="store_true",
        help="also time each algorithm as NAME+fresh on new tensors every call, in the same rounds",
    )
    p.add_argument(
        "--sizes-iters",
        action="store_true",
        help="instead of --iters: on the CPU fewer calls a timed run for large sizes (10 up to 1 MiB, down to 1 from "
        "16 MiB), on GPUs 20",
    )
    p.add_argument("--out", default="runs/bench-comm.jsonl", help="JSON lines; the plot goes beside it as .png")
    p.add_argument(
        "--transport",
        choices=("torch", "mpi"),
        default="torch",
        help="torch: a torch.distributed group (Gloo/NCCL; our algorithms on DTRAIN_COMM_TRANSPORT's transport); "
        "mpi: an MPI group, native = MPI's collectives, ours over MPI point-to-point; start it with mpirun "
        "(mpirun -n 4 dtrain bench comm --transport mpi; --nproc is ignored)",
    )
    p.add_argument(
        "--rules-out",
        nargs="?",
        const="",
        default=None,
        help="also write the measured winners as rules for algorithm='auto' (default path: $DTRAIN_COMM_RULES "
        "or ~/.cache/dtrain/rules-<kind>.json, the kind such as cpu, cuda or cuda-peer)",
    )


def _add_bench_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure alpha, beta, gamma and save them for algorithm='auto'")
    p.add_argument("--nproc", type=whole(1), default=2, help="local ranks to start (ignored under torchrun)")
    p.add_argument(
        "--out", default=None, help="default $DTRAIN_CALIBRATION or ~/.cache/dtrain/calibration-<device>.json"
    )
    p.add_argument("--repeats", type=whole(1), default=None, help="without --rules: timed calls a size (default 10)")
    p.add_argument(
        "--rules",
        action="store_true",
        help="instead: time auto's candidates (native among them) side by side and save the winners as the "
        "per-machine rules algorithm='auto' follows",
    )
    p.add_argument("--collectives", type=_names, default=None, help="with --rules: comma-separated (default: five)")
    p.add_argument("--min-bytes", type=parse_bytes, default=None, help="with --rules (default 1K)")
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="with --rules (default 64M)")
    p.add_argument("--factor", type=int, default=None, help="with --rules: size step (default 4)")
    p.add_argument("--rounds", type=int, default=None, help="with --rules: interleaved rounds (default 3)")
    p.add_argument("--fresh", action="store_true", help="with --rules: new tensors every call")
    p.add_argument("--records-out", default=None, help="with --rules: every timing as JSON lines")
    p.add_argument(
        "--transport", choices=("torch", "mpi"), default=None, help="with --rules: torch (the default) or mpi group"
    )


#: ``dtrain bench calibrate``'s flags that only ``--rules`` reads, and the values they stand for when not given.
RULES_FLAGS = {"collectives": None, "min_bytes": 1 << 10, "max_bytes": 64 << 20, "factor": 4, "rounds": 3,
               "fresh": False, "records_out": None, "transport": "torch"}  # fmt: skip


def _check_calibrate_flags(args: argparse.Namespace) -> None:
    """``bench calibrate``'s flags for one mode given to the other are refused (not ignored); those not given take
    their defaults."""
    if not args.rules:
        given = [name for name in RULES_FLAGS if getattr(args, name) not in (None, False)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            what = " (the records are the rules calibration's timings)" if given[0] == "records_out" else ""
            raise ValueError(f"{flag}: needs --rules{what}")
        args.repeats = 10 if args.repeats is None else args.repeats
        return
    if args.repeats is not None:
        raise ValueError("--repeats: not with --rules (its rounds are --rounds)")
    for name, default in RULES_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _add_bench_verify(sub) -> None:
    p = sub.add_parser("verify", help="check every collective algorithm against torch.distributed on this group")
    p.add_argument("--nproc", type=whole(1), default=2, help="local ranks to start (ignored under torchrun)")


def _add_train(commands) -> None:
    from dtrain.train.config import add_arguments

    p = commands.add_parser("train", help="train a model data, pipeline and/or tensor parallel (see dtrain.train.loop)")
    p.add_argument("--nproc", type=int, default=1, help="local ranks to start (ignored under torchrun) (default: 1)")
    add_arguments(p)  # one flag per dtrain.train.config.TrainConfig field


#: ``dtrain check``'s largest --max-world and --pipeline: the proofs of every algorithm take seconds up to these.
MAX_CHECK_WORLD = 32
MAX_CHECK_PIPELINE = 64


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is one ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dtrain", description="distributed training, from the collectives up")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="prove every registered algorithm on symbolic chunks")
    check.add_argument("--max-world", type=whole(1, MAX_CHECK_WORLD), default=8,
                       help=f"largest world size proved, 1 to {MAX_CHECK_WORLD} (32 takes about 15 s on 2 cores; the "
                            "time grows with the cube of it) (default: 8)")  # fmt: skip
    check.add_argument("--pipeline", type=whole(1, MAX_CHECK_PIPELINE), default=1,
                       help=f"pieces for the pipelined algorithms, 1 to {MAX_CHECK_PIPELINE} (default: 1)")  # fmt: skip
    bench = commands.add_parser("bench", help="measure the machine")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    _add_bench_comm(bench_commands)
    _add_bench_calibrate(bench_commands)
    _add_bench_verify(bench_commands)
    from dtrain.cli import bench_pipeline

    bench_pipeline.add_parser(bench_commands)
    from dtrain.cli import bench_compute

    bench_compute.add_parser(bench_commands)
    from dtrain.cli import bench_overlap

    bench_overlap.add_parser(bench_commands)
    _add_train(commands)
    for module in _feature_modules():
        module.register(commands)
    return parser


def _feature_modules() -> list:
    """Feature areas that own their subcommands: each has ``register(commands)``, setting ``handler`` on its
    parsers (``handler(args) -> int``)."""
    import importlib

    modules = []
    for name in _FEATURE_COMMANDS:
        try:
            modules.append(importlib.import_module(f"dtrain.cli.{name}"))
        except ModuleNotFoundError as exc:
            if exc.name != f"dtrain.cli.{name}":
                raise
    return modules


# dtrain.cli.<name> modules: data (prepare), generate, ps (the parameter server), cluster (calc, simulate, plan),
# emulate.
_FEATURE_COMMANDS = ("data", "generate", "ps", "cluster", "emulate", "export")


#: Where ``bench comm --rules-out`` and ``bench calibrate`` write by default (dtrain.comm.cost.rules.rules_path and
#: dtrain.comm.cost.model.params_path); ``calibrate --rules`` writes in dtrain.comm.cost.rules.cache_dir().
_HOME_CACHE = os.path.join("~", ".cache", "dtrain")


def _check_bench_outputs(args: argparse.Namespace) -> None:
    """The files ``bench comm`` and ``bench calibrate`` write, refused before torch is imported and any rank starts
    where they cannot be written (nothing is made)."""
    from dtrain.cli.paths import check_dir_out, check_file_out

    env = CommEnv.from_env()
    if args.bench_command == "comm":
        check_file_out("--out", args.out)
        check_file_out("--out (its plot)", Path(args.out).with_suffix(".png"))
        if args.rules_out is not None:
            rules = args.rules_out or env.rules
            if rules:
                check_file_out("--rules-out", rules)
            else:
                check_dir_out("--rules-out (default)", os.path.expanduser(_HOME_CACHE))
        return
    if args.rules:
        if args.out:
            check_file_out("--out", args.out)
        else:
            from dtrain.comm.cost.rules import cache_dir

            check_dir_out("--out (default)", cache_dir())
        if args.records_out:
            check_file_out("--records-out", args.records_out)
        return
    out = args.out or env.calibration
    if out:
        check_file_out("--out", out)
    else:
        check_dir_out("--out (default)", os.path.expanduser(_HOME_CACHE))


def _check_mpi_world(command: str) -> None:
    """``--transport mpi`` in a process mpirun started with others; ValueError saying how to start it if not."""
    from dtrain.comm.mpi.group import mpi

    size = mpi().COMM_WORLD.Get_size()
    if size < 2:
        raise ValueError(
            f"--transport mpi: this process is an MPI world of {size} rank; start it with mpirun, e.g. "
            f"mpirun -n 4 dtrain bench {command} --transport mpi"
        )


def _bench_comm(args: argparse.Namespace) -> int:
    if args.iters is not None and args.sizes_iters:
        raise ValueError("--iters and --sizes-iters: --sizes-iters sets the calls a timed run by size; give one")
    _check_bench_outputs(args)
    if args.transport == "mpi":
        _check_mpi_world("comm")
    rules = CommEnv.from_env().rules
    timed = args.algorithms is None or any(a.partition("@")[0] == "auto" for a in args.algorithms)
    if rules is not None and timed:  # the file auto follows, read before any rank starts (ranks would skip auto)
        from dtrain.comm.cost.rules import load_rules

        try:
            load_rules("", rules)
        except ValueError as err:
            raise ValueError(f"DTRAIN_COMM_RULES: {err}") from None
    from dtrain.bench import comm as bench_comm

    config = bench_comm.BenchConfig(
        collectives=args.collectives,
        algorithms=args.algorithms,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        factor=args.factor,
        warmup=args.warmup,
        warm_s=args.warm_s,
        iters=10 if args.iters is None else args.iters,
        trials=args.trials,
        graphs=args.graphs,
        out=args.out,
        nproc=args.nproc,
        rules_out=args.rules_out,
        transport=args.transport,
        **bench_comm.options(args),
    )
    bench_comm.run(config)
    return 0


def _may_write(out: str) -> bool:
    """Whether ``out`` is, or could be made, a directory this process writes in: the nearest existing directory on
    its path is writable (the run's own check makes it and writes a file there)."""
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _train(args: argparse.Namespace) -> int:
    from dtrain.env import SameOnEveryRank, under_torchrun
    from dtrain.train.config import check_out, from_arguments, run_world

    try:
        config = from_arguments(args)  # bad flags end here, before torch is imported
        run_world(args.nproc)
    except ValueError as exc:
        raise SameOnEveryRank(str(exc)) from None
    if not under_torchrun() and not config.checkpoint.resume:
        check_out(config.logging.out, create=False)  # the run's check, before torch (nothing made on bad input)
    # the workers' fork server imports torch on another core while this process does; not where --out cannot be
    # written, where the run's checks end it before any worker starts (and the server's import would be waited for)
    if not under_torchrun() and _may_write(config.logging.out):
        from dtrain.workers import start_fork_server

        start_fork_server(args.nproc)
    from dtrain.train.loop import train

    # CUDA memory in segments that grow rather than fixed blocks: large sharded models otherwise fail on
    # fragmentation with gigabytes reserved but free (torch's CUDA notes, "Optimizing memory usage"); a value the
    # user set wins. Read when the first CUDA tensor is made, so it reaches every rank this process starts too.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    records = train(config, args.nproc, announce=lambda line: print(f"dtrain train: {line}", flush=True))
    if records and int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank returns; rank 0 says it
        print(
            f"dtrain train: {len(records)} steps, final loss {records[-1]['loss']:.4f}, metrics in {config.logging.out}"
        )
        if "plan_measured_step_s" in records[-1]:
            from dtrain.train.metrics import describe_plan_score

            print(f"dtrain train: {describe_plan_score(records[-1])}")
    return 0


def _verify_rank() -> int:
    from dtrain.bench.verify import verify_on_rank
    from dtrain.launch import rank_device

    return verify_on_rank(rank_device())


def _interrupted(exc: BaseException) -> int | None:
    """The exit status for a Ctrl-C or a termination signal (128 + its number), None for anything else.

    torch's elastic launcher turns SIGINT/SIGTERM in the launching process into ``SignalException`` after
    stopping the ranks; a process without it gets ``KeyboardInterrupt``. An exception raised *from* one counts too:
    Python 3.11 wraps what a class body's ``__set_name__`` raises in a ``RuntimeError``, so a Ctrl-C that lands
    while a module defines a dataclass arrives as that ``RuntimeError``.
    """
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if type(exc).__name__ == "SignalException" and hasattr(exc, "sigval"):
            return 128 + int(exc.sigval)
        exc, seen = exc.__cause__, seen + 1
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dtrain`` command line; the process exit status. Called without ``argv``, as the ``dtrain`` command
    is, a command that has ended (done, refused or interrupted) ignores SIGINT and SIGTERM from then on: a Ctrl-C as
    it ends would otherwise raise outside this function, or kill the process without a word once the interpreter's
    teardown (a second or more after torch) has given SIGINT its default action back; the command's own status and
    lines stay the last."""
    note_interrupts()  # a Ctrl-C dropped during an import still stops the launch (dtrain.interrupts)
    try:
        CommEnv.from_env()  # a bad DTRAIN_COMM_* value stops here, before any rank starts
        status = _run(build_parser().parse_args(argv))
    except ValueError as exc:  # bad input: one line on stderr, where it never mixes with --json output
        _ended(argv)
        from dtrain import env

        if not isinstance(exc, env.SameOnEveryRank) or env.says_refusals():  # under torchrun, once a node
            print(f"dtrain: error: {exc}", file=sys.stderr)
        else:  # the node's first rank says it; torchrun stops the job as soon as this rank ends, so this one waits
            if argv is None:  # the dtrain command: torchrun's SIGTERM, once that rank has ended, ends this one too
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(env.QUIET_REFUSAL_WAIT_S)
        return 2
    except OSError as exc:  # a path that cannot be read or written (a file where a folder should be, no room): named
        _ended(argv)
        print(f"dtrain: error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        status = _interrupted(exc)
        if status is None:
            raise
        _ended(argv)
        print(f"dtrain: interrupted (signal {status - 128}); the ranks were stopped", file=sys.stderr)
        return status
    _ended(argv)
    return status


def _ended(argv: Sequence[str] | None) -> None:
    """The ``dtrain`` command (``argv`` None) has ended: SIGINT and SIGTERM are ignored from here to its exit.

    Its status is the process's too: a ``KeyboardInterrupt`` that left code Python compiled from text (``exec`` and
    ``eval`` of a string, as dataclasses and namedtuples make their methods while torch imports) is marked unhandled
    by the interpreter, even once caught here, and ``python -m`` then ends the process by SIGINT after its teardown
    in place of the status returned. Running text again clears that mark."""
    if argv is None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        exec("")  # clears the interpreter's mark of an unhandled KeyboardInterrupt (see above)


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "handler", None) is not None:
        return args.handler(args)
    if args.command == "check":
        from dtrain.cli.check import check_all

        return 0 if check_all(args.max_world, args.pipeline) else 1
    if args.command == "train":
        return _train(args)
    if args.bench_command == "pipeline":
        from dtrain.cli import bench_pipeline

        return bench_pipeline.run(args)
    if args.bench_command == "comm":
        return _bench_comm(args)
    if args.bench_command == "verify":
        from dtrain.launch import run_ranks

        failures = run_ranks(_verify_rank, args.nproc)
        return 0 if failures == 0 else 1
    _check_calibrate_flags(args)
    _check_bench_outputs(args)
    if args.rules and args.transport == "mpi":
        _check_mpi_world("calibrate --rules")
    from dtrain.bench import calibrate as bench_calibrate

    return bench_calibrate.run_from_arguments(args)
