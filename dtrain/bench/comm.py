"""``dtrain bench comm``: time every collective algorithm over a size sweep, next to the cost model.

For each collective, message size and algorithm ("auto" and "native" included, and with ``--algorithms torch,...``
torch.distributed's own call with nothing of dtrain between, the peer ``vs_torch`` compares with): ``warmup``
untimed calls,
then ``trials`` rounds in which every algorithm runs ``iters`` calls back to back between two synchronizations (as
nccl-tests times), the algorithms taking turns, their order turning by one each round
(:func:`dtrain.comm.tune.time_interleaved`); a round's time is the slowest rank's run, the reported time the median
round divided by ``iters``. Each record also carries ``host_us``: the host's time to issue one call (the same loop,
up to its last call's return, before the synchronization), likewise the slowest rank's, median over rounds;
where it is close to ``time_us`` the call is bound by the host, not the devices. On GPUs the sweep starts with
``warm_s`` seconds (default 1) of its first case, untimed, so that the first sizes are not timed on idle clocks
and cold caches (without it the first size timed 1.5-2.5x slow on 4 H100s).
Bandwidths follow nccl-tests (doc/PERFORMANCE.md): ``algbw = size /
time`` and ``busbw = algbw * factor`` with the factor of :data:`BUS_FACTORS`; ``size`` is the work buffer of
:mod:`dtrain.comm.cost.model` (all-gather: output, reduce-scatter / gather / scatter / all-to-all: the full W-block
buffer). Rank 0 prints a table, writes one JSON line a measurement to ``out`` (replacing the file) and draws
busbw against size next to it (same name, ``.png``).

``transport="mpi"`` (``dtrain bench comm --transport mpi``, started by ``mpirun``) measures on an
:class:`~dtrain.comm.mpi.MPIGroup` over ``MPI_COMM_WORLD`` instead of a torch.distributed group: "native" is MPI's
own collective and our algorithms run over MPI point-to-point; each record's ``transport`` and ``backend``
say so. benchmarks/collectives/mpi_vs_gloo.py puts Gloo and MPI side by side in one job.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.comm.cost import model as cost
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.comm.tune import TORCH, Sync, iters_for, make_call, time_interleaved
from dtrain.launch import rank_device, run_ranks

__all__ = [
    "BUS_FACTORS",
    "check_fits",
    "names_given",
    "TRANSPORTS",
    "BenchConfig",
    "Sync",
    "run",
    "bench_on_rank",
    "bus_factor",
    "operation",
    "time_us",
]

#: The suffix of a name timed on new tensors every call beside the same name on the same tensors
#: (:attr:`BenchConfig.fresh_beside`).
FRESH = "+fresh"

#: Bytes of fresh tensors one rank may hold for a timed run (``fresh``): fewer calls a run where they exceed it.
FRESH_BYTES = 1 << 30

#: ``BenchConfig.transport``: "torch" (the torch.distributed group, our algorithms on its transport) or "mpi".
TRANSPORTS = ("torch", "mpi")

#: busbw / algbw per collective (nccl-tests); scan, like broadcast, moves each byte over one link.
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "gather": lambda w: (w - 1) / w,
    "scatter": lambda w: (w - 1) / w,
    "broadcast": lambda w: 1.0,
    "reduce": lambda w: 1.0,
    "scan": lambda w: 1.0,
}


def names_given(flag: str, names: list[str] | tuple[str, ...]) -> None:
    """ValueError naming ``flag`` where its list of names is empty or names one twice (a repeat would time the
    same thing twice, as two rows)."""
    if not names:
        raise ValueError(f"{flag}: none given")
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ValueError(f"{flag}: {twice} given twice")


def memory_bytes() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(flag: str, nbytes: int, ranks: int, cpu: bool) -> None:
    """ValueError naming ``flag`` where ``ranks`` ranks on this machine's CPU, each holding a buffer of ``nbytes``,
    need more than the machine's memory (on GPUs a rank out of device memory stops the run in one line)."""
    total = memory_bytes() if cpu else None
    if total is not None and nbytes * ranks > total:
        raise ValueError(
            f"{flag} {nbytes}: {ranks} rank(s) on this machine hold a buffer of that many bytes each, more than its "
            f"{total / 2**30:.1f} GiB of memory"
        )


def local_ranks(nproc: int) -> int:
    """The ranks a run has on this machine: torchrun's LOCAL_WORLD_SIZE under torchrun, else ``nproc``."""
    from dtrain.env import under_torchrun

    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    return (int(env) if env.isdigit() else 1) if under_torchrun() else nproc


def bus_factor(collective: str, world_size: int) -> float:
    return BUS_FACTORS[collective](world_size)


@dataclass(kw_only=True)
class BenchConfig:
    """What to measure. Sizes are bytes of the work buffer, ``min_bytes`` times powers of ``factor`` and then
    ``max_bytes`` itself; ``None`` picks the device's default sweep (CPU 1 KiB .. 64 MiB, GPU 8 KiB .. 1 GiB)."""

    collectives: list[str] = field(default_factory=lambda: ["all_reduce"])
    algorithms: list[str] | None = None  # None: every name comm.algorithms() lists
    graphs: bool = False  # on GPUs, also time each algorithm captured as a CUDA graph ("ring+graph")
    min_bytes: int | None = None
    max_bytes: int | None = None
    factor: int = 4
    warmup: int = 2
    warm_s: float | None = None  # untimed calls of the first case for this long first (None: 1 s on GPUs, else 0)
    iters: int = 10
    trials: int = 3
    out: str = "runs/bench-comm.jsonl"
    nproc: int = 2
    rules_out: str | None = None  # write measured rules for ``auto`` here ("" : the default rules path)
    transport: str = "torch"  # "mpi": an MPIGroup over MPI_COMM_WORLD, in a job mpirun started
    #: each call of a run on its own set of input and output tensors (made before the timed loop; as many sets as
    #: a run has calls, up to :data:`FRESH_BYTES` a rank, fewer calls a run past that; the same sets in warm-up
    #: and in every round, ``fresh_sets`` in each record), else the same tensors every call
    fresh: bool = False
    #: each name also as ``NAME+fresh`` on its own sets as ``fresh`` makes them, in the same rounds as on the same
    #: tensors
    fresh_beside: bool = False
    sizes_iters: bool = False  # fewer calls a run for large sizes (:func:`dtrain.comm.tune.iters_for`)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport {self.transport!r} is not known; use {' or '.join(TRANSPORTS)}")
        names_given("--collectives", self.collectives)
        unknown = [c for c in self.collectives if c not in BUS_FACTORS and c != "barrier"]
        if unknown:
            raise ValueError(f"--collectives: unknown {unknown}; known: {', '.join([*BUS_FACTORS, 'barrier'])}")
        if self.factor < 2:
            raise ValueError(f"--factor must be >= 2, got {self.factor}")
        for flag, value, least in (("--nproc", self.nproc, 1), ("--iters", self.iters, 1),
                                   ("--trials", self.trials, 1), ("--warmup", self.warmup, 0)):  # fmt: skip
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")
        if not (self.warm_s is None or 0 <= self.warm_s < math.inf):
            raise ValueError(f"--warm-s must be a finite number of seconds >= 0, got {self.warm_s}")
        for flag, value in (("--min-bytes", self.min_bytes), ("--max-bytes", self.max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag} must be a whole number of bytes >= 1, got {value!r}")
        if self.min_bytes is not None and self.max_bytes is not None and self.min_bytes > self.max_bytes:
            raise ValueError(f"--min-bytes {self.min_bytes} is above --max-bytes {self.max_bytes}")
        if self.algorithms is not None:
            names_given("--algorithms", self.algorithms)
            self._check_algorithms()
        if self.fresh and self.fresh_beside:
            raise ValueError("--fresh and --fresh-beside: --fresh-beside already times fresh tensors, beside the same")

    def _check_algorithms(self) -> None:
        """Every name of ``algorithms`` runs at least one of ``collectives`` (a name another collective has, or a
        typo, would be dropped from every case without a word)."""
        from dtrain import comm

        known = {TORCH}
        for coll in self.collectives:
            known |= {"auto", "dissemination", "native"} if coll == "barrier" else set(comm.algorithms(coll))
        unknown = [a for a in self.algorithms if a.partition("@")[0] not in known]
        if unknown:
            raise ValueError(
                f"--algorithms {unknown} run none of {', '.join(self.collectives)}; known: {', '.join(sorted(known))} "
                "(ours may end in @p2p or @peer)"
            )

    def sizes(self, device_type: str) -> list[int]:
        lo = self.min_bytes if self.min_bytes is not None else (1 << 10 if device_type == "cpu" else 8 << 10)
        hi = self.max_bytes if self.max_bytes is not None else (64 << 20 if device_type == "cpu" else 1 << 30)
        lo = min(lo, hi)
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= self.factor
        if out[-1] != hi:  # the sweep ends where asked, where the factor's steps fall short of it
            out.append(hi)
        return out


def run(config: BenchConfig) -> list[dict]:
    """Measure on ``config.nproc`` local ranks (or the torchrun job this process is in; with
    ``transport="mpi"``, the mpirun job this process is in); the records."""
    cpu = config.transport == "mpi" or not torch.cuda.is_available()
    if config.graphs and cpu:
        raise ValueError("--graphs: CUDA graphs need GPUs; this run measures on the CPU")
    ranks = 1 if config.transport == "mpi" else local_ranks(config.nproc)
    largest = max(config.sizes("cpu" if cpu else "cuda"))
    check_fits("--max-bytes", largest, ranks, cpu)
    if config.transport == "mpi":
        return bench_on_rank(config)
    return run_ranks(bench_on_rank, config.nproc, config)


def operation(coll: str, nbytes: int, world: int, rank: int, device, group=None) -> tuple[Callable[[str], None], int]:
    """A call of ``coll`` on ``group`` on float32 buffers of about ``nbytes`` (the same ones every call), and
    the bytes it really moves."""
    call, moved = make_call(coll, nbytes, world, rank, device, group)
    return (lambda a: call(a, 0)), moved


def time_us(
    call: Callable[[str], None], algorithm: str, config: BenchConfig, device, sync: Sync | None = None
) -> tuple[float, float]:
    """Time of one call in microseconds, as nccl-tests measures it: ``iters`` calls back to back between
    two synchronizations, divided by ``iters``; the median of ``trials`` such runs on each rank, then the
    largest over ranks. Also the host's time to issue one call (the loop without its closing synchronization),
    median and largest alike."""
    sync = Sync() if sync is None else sync
    for _ in range(config.warmup):
        call(algorithm)
    runs, issued = [], []
    for _ in range(config.trials):
        _sync(device)
        sync.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(config.iters):
            call(algorithm)
        issued.append((time.perf_counter() - start) / config.iters)
        _sync(device)
        runs.append((time.perf_counter() - start) / config.iters)
    worst = torch.tensor(
        [statistics.median(runs) * 1e6, statistics.median(issued) * 1e6], dtype=torch.float64, device=device
    )
    sync.largest(worst)
    return float(worst[0].item()), float(worst[1].item())


def _warm(call: Callable[[str], None], algorithm: str, seconds: float | None, device, sync: Sync) -> None:
    """Untimed calls for about ``seconds`` (None: 1 s on GPUs, none elsewhere), ten at a time until rank 0's clock
    says enough (it tells the others, so every rank makes the same calls)."""
    seconds = (1.0 if device.type == "cuda" else 0.0) if seconds is None else seconds
    if seconds <= 0:
        return
    go = torch.ones(1, dtype=torch.int32, device=device)
    start = time.perf_counter()
    while int(go.item()):
        for _ in range(10):
            call(algorithm)
        go.fill_(int(time.perf_counter() - start < seconds))
        sync.from_rank0(go)


class _Captured:
    """``call`` recorded once as a CUDA graph (:func:`dtrain.comm.capture`); calling it replays the graph."""

    def __init__(self, call: Callable[[str, int], object], algorithm: str) -> None:
        from dtrain import comm

        self.replay = comm.capture(lambda: call(algorithm, 0))

    def __call__(self, _algorithm: str, _k: int = 0) -> None:
        self.replay()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _predicted_us(
    coll: str, algorithm: str, nbytes: int, world: int, params, local_size, kind: str
) -> tuple[float | None, str]:
    """The model's time for ``algorithm`` (for "auto", for what the API chooses: a measured rule or the model's
    pick) and the algorithm priced."""
    from dtrain.comm.api import _choose
    from dtrain.comm.state import states

    collective = Collective(coll)
    ours = registry.names(collective)
    if algorithm == "auto":
        if not ours:
            return None, algorithm
        usable = local_size if local_size and 1 < local_size < world else None
        measured = next((s.rules[kind] for s in states() if s.rules.get(kind) is not None), None)
        algorithm = _choose(collective, nbytes, world, kind, usable, measured)  # what the group's rules choose
        if "@" in algorithm:
            return None, algorithm
    if algorithm == TORCH:  # the call native makes
        return None, "native"
    if algorithm not in ours:
        return None, algorithm
    if registry.needs_local_size(algorithm) and local_size is None:
        return None, algorithm
    pipeline = cost.optimal_pipeline(nbytes, world, params.intra)
    seconds = cost.predict(collective, algorithm, nbytes, world, params, local_size=local_size, pipeline=pipeline)
    return seconds * 1e6, algorithm


def _record(coll, algorithm, nbytes, world, time_us, predicted, resolved, config, machine) -> dict:
    algbw = nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
    factor = bus_factor(coll, world) if coll in BUS_FACTORS else 0.0
    return {
        "collective": coll,
        "algorithm": algorithm,
        "resolved_algorithm": resolved,
        "nbytes": nbytes,
        "world_size": world,
        "time_us": time_us,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor,
        "predicted_us": predicted,
        "predicted_over_measured": None if predicted is None or time_us <= 0 else predicted / time_us,
        "warmup": config.warmup,
        "iters": config.iters,
        "dtype": "float32",
        **machine,
    }


def _machine(device, backend: str | None = None) -> dict:
    """Where the records were measured; ``backend`` defaults to the default group's."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "hostname": platform.node(),
        "torch_version": torch.__version__,
        "device": device.type,
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "backend": backend or dist.get_backend(),
    }


def mpi_backend() -> str:
    """The MPI library, e.g. "mpi (Open MPI v5.0.11)"."""
    from mpi4py import MPI

    return f"mpi ({MPI.Get_library_version().split(',')[0].strip()})"


def _cases(config: BenchConfig, device) -> list[tuple[str, int, list[str]]]:
    """(collective, size, algorithms) to time side by side: every algorithm ``comm.algorithms`` lists ("auto"
    only for the barrier; with the MPI transport "dissemination" and "native", MPI_Barrier)."""
    from dtrain import comm

    cases = []
    for coll in config.collectives:
        if coll == "barrier":
            names = ["dissemination", "native"] if config.transport == "mpi" else ["auto"]
        else:
            names = comm.algorithms(coll)
        if config.algorithms is not None:
            peer = coll != "barrier" and config.transport != "mpi"  # torch.distributed's own call, beside ours
            names = [a for a in config.algorithms if a.partition("@")[0] in names or (a == TORCH and peer)]
        if config.graphs and device.type == "cuda" and coll != "barrier":
            names += [f"{a}+graph" for a in names if a != "auto"]
        sizes = [0] if coll == "barrier" else config.sizes(device.type)
        cases += [(coll, size, names) for size in sizes]
    return cases


def _usable(call, names: list[str], config: BenchConfig, device, sync: Sync, note) -> list[str]:
    """The names whose first call succeeds on every rank (e.g. not an algorithm that needs a node size it was not
    given: a ValueError raised alike on every rank, before anything is sent)."""
    kept = []
    for name in names:
        try:
            call(name.removesuffix("+graph"), 0)
        except ValueError as exc:
            note(f"skipped {name}: {exc}")
            continue
        kept.append(name)
    return kept


def bench_on_rank(config: BenchConfig, group=None) -> list[dict]:
    """Every rank runs this; rank 0 reports and returns the records (the others return ``[]``).

    For each collective and size, the algorithms are timed side by side (:func:`dtrain.comm.tune.time_interleaved`:
    ``iters`` calls between two synchronizations, the algorithms alternating in ``trials`` rounds, the slowest
    rank's time, the median round); each record carries ``vs_native``, the backend's own time over its own
    (above 1: faster than the backend's collective). ``group``: a torch.distributed group to measure on (None:
    the default group, or with ``transport="mpi"`` MPI_COMM_WORLD)."""
    from dtrain.bench.report import Progress, print_table, write_outputs
    from dtrain.comm.api import _kind, transport_name

    if config.transport == "mpi":
        from dtrain.comm.mpi import world as mpi_world

        group = mpi_world()
    sync = Sync(group)
    device = torch.device("cpu") if config.transport == "mpi" else rank_device()
    rank, world = sync.rank, sync.world
    transport = transport_name(group, device)  # our algorithms' transport, priced by its own parameters
    kind = _kind(group, device)
    params = cost.load_params(device=kind)
    local_size = group.local_size if config.transport == "mpi" else _local_size(world)
    from dtrain.comm.peer import graphs as persistent

    backend = mpi_backend() if config.transport == "mpi" else dist.get_backend(group)
    machine = {**_machine(device, backend), "transport": transport, "persistent": persistent.enabled()}
    records = []
    cases = _cases(config, device)
    warmed = False
    with Progress(len(cases), enabled=rank == 0) as progress:
        for coll, size, names in cases:
            iters = iters_for(size, device) if config.sizes_iters else config.iters
            fresh = config.fresh or config.fresh_beside
            copies = max(1, min(iters, FRESH_BYTES // max(1, 2 * size))) if fresh else 1
            iters = copies if fresh else iters
            call, nbytes = make_call(coll, size, world, rank, device, group, copies=copies)
            progress.step(f"{coll} {nbytes} B")
            names = _usable(call, names, config, device, sync, progress.note)
            if config.fresh_beside:
                names += [f"{n}{FRESH}" for n in names if not n.endswith("+graph")]
            captured = {n: _Captured(call, n.removesuffix("+graph")) for n in names if n.endswith("+graph")}

            def run_one(name: str, k: int, call=call, captured=captured) -> object:
                if name in captured:
                    return captured[name](name, k)
                if name.endswith(FRESH):  # call k on the k-th set of tensors
                    return call(name.removesuffix(FRESH), k)
                return call(name, 0 if config.fresh_beside else k)  # beside fresh ones: the same tensors

            try:
                if not warmed and names:  # the sweep's first case: warm the devices first
                    _warm(lambda a, run_one=run_one: run_one(a, 0), names[0], config.warm_s, device, sync)
                    warmed = True
                timed = time_interleaved(
                    run_one, names, iters=iters, rounds=config.trials, warmup=config.warmup, device=device, sync=sync
                )
            finally:
                for replay in captured.values():  # no graph may outlive the process group (see comm.graph)
                    replay.replay.release()
            for name in names:
                suffix = FRESH if name.endswith(FRESH) else ""  # a fresh call is compared with fresh ones
                native = timed.get("native" + suffix, {}).get("time_us")
                peer = timed.get(TORCH + suffix, {}).get("time_us")
                took_us, host_us = timed[name]["time_us"], timed[name]["host_us"]
                base = name.removesuffix(FRESH).removesuffix("+graph").partition("@")[0]
                predicted, resolved = _predicted_us(coll, base, nbytes, world, params, local_size, kind)
                if name.endswith("+graph") or "@" in name:  # the model prices eager rounds of the group's transport
                    predicted = None
                record = _record(coll, name, nbytes, world, took_us, predicted, resolved, config, machine)
                record.update(
                    host_us=host_us,
                    runs_us=timed[name]["runs_us"],
                    rounds=config.trials,
                    iters=iters,
                    fresh=config.fresh or bool(suffix),
                    # the sets of tensors a fresh run's calls take in turn, the same sets in warm-up and every round
                    fresh_sets=copies if config.fresh or suffix else None,
                    vs_native=None if not native or not took_us else native / took_us,
                    vs_torch=None if not peer or not took_us else peer / took_us,
                )
                records.append(record)
    if rank != 0:
        return []
    print_table(records)
    write_outputs(records, Path(config.out))
    if config.rules_out is not None:
        _write_rules(records, config, kind, local_size, machine)
    return records


def _write_rules(records: list[dict], config: BenchConfig, kind: str, local_size: int | None, machine) -> None:
    """Rules for ``auto`` from this sweep's winners (:mod:`dtrain.comm.cost.rules`), where the API will look."""
    from dtrain.comm.cost import rules

    world = records[0]["world_size"] if records else 1
    usable = local_size if local_size and 1 < local_size < world else None
    meta = {k: machine[k] for k in ("hostname", "device_name", "torch_version", "persistent")}
    try:
        made = rules.from_records(records, kind=kind, local_size=usable, meta={**meta, "from": config.out})
    except ValueError as err:
        print(f"dtrain bench comm: no rules written: {err}", file=sys.stderr)
        return
    path = rules.save_rules(made, config.rules_out or None)
    print(f"rules for algorithm='auto' ({kind}, {world} ranks) written to {path}")


def _local_size(world: int) -> int | None:
    """Ranks per node, as the launcher tells it (LOCAL_WORLD_SIZE), if it divides the world."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(env) if env.isdigit() and int(env) > 0 and world % int(env) == 0 else None


def options(args) -> dict:
    """The :class:`BenchConfig` fields of the ``--fresh``, ``--fresh-beside`` and ``--sizes-iters`` flags (absent
    flags: off)."""
    return {name: bool(getattr(args, name, False)) for name in ("fresh", "fresh_beside", "sizes_iters")}
