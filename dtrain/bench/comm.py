"""``dtrain bench comm``: time every collective algorithm over a size sweep, next to the cost model.

For each collective, message size and algorithm ("auto" and "native" included): ``warmup`` untimed calls,
then ``trials`` runs of ``iters`` calls back to back between two synchronizations (as nccl-tests times);
a rank's time is its median run divided by ``iters``, the reported time the largest over ranks. Each record also
carries ``host_us``: the host's time to issue one call (the same loop, up to its last call's return, before the
synchronization), median over runs, largest over ranks; where it is close to ``time_us`` the call is bound by the
host, not the devices. On GPUs the sweep starts with ``warm_s`` seconds (default 1) of its first case, untimed,
so that the first sizes are not timed on idle clocks and cold caches (without it the first size timed 1.5-2.5x
slow on 4 H100s).
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

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.comm.cost import model as cost
from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import BLOCK_COLLECTIVES, Collective
from dtrain.launch import rank_device, run_ranks

__all__ = [
    "BUS_FACTORS",
    "TRANSPORTS",
    "BenchConfig",
    "Sync",
    "run",
    "bench_on_rank",
    "bus_factor",
    "operation",
    "time_us",
]

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


def bus_factor(collective: str, world_size: int) -> float:
    return BUS_FACTORS[collective](world_size)


@dataclass(kw_only=True)
class BenchConfig:
    """What to measure. Sizes are bytes of the work buffer; ``None`` picks the device's default sweep
    (CPU 1 KiB .. 64 MiB, GPU 8 KiB .. 1 GiB)."""

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

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not known; use {' or '.join(TRANSPORTS)}")
        unknown = [c for c in self.collectives if c not in BUS_FACTORS and c != "barrier"]
        if unknown:
            raise ValueError(f"unknown collectives {unknown}; known: {', '.join([*BUS_FACTORS, 'barrier'])}")
        if self.factor < 2:
            raise ValueError(f"factor must be >= 2, got {self.factor}")
        if self.iters < 1 or self.warmup < 0 or self.trials < 1 or not (self.warm_s is None or self.warm_s >= 0):
            raise ValueError(
                f"need iters >= 1, trials >= 1, warmup >= 0, warm_s >= 0; got {self.iters}, {self.trials}, "
                f"{self.warmup}, {self.warm_s}"
            )
        if self.min_bytes is not None and self.max_bytes is not None and self.min_bytes > self.max_bytes:
            raise ValueError(f"min_bytes {self.min_bytes} is above max_bytes {self.max_bytes}")

    def sizes(self, device_type: str) -> list[int]:
        lo = self.min_bytes if self.min_bytes is not None else (1 << 10 if device_type == "cpu" else 8 << 10)
        hi = self.max_bytes if self.max_bytes is not None else (64 << 20 if device_type == "cpu" else 1 << 30)
        lo = min(lo, hi)
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= self.factor
        return out


def run(config: BenchConfig) -> list[dict]:
    """Measure on ``config.nproc`` local ranks (or the torchrun job this process is in; with
    ``transport="mpi"``, the mpirun job this process is in); the records."""
    if config.transport == "mpi":
        return bench_on_rank(config)
    return run_ranks(bench_on_rank, config.nproc, config)


class Sync:
    """The few group calls timing needs (barrier, largest over ranks, rank 0's flag), on a torch.distributed
    group (None: the default one) or an :class:`~dtrain.comm.mpi.MPIGroup`, outside the calls being timed."""

    def __init__(self, group=None) -> None:
        from dtrain.comm.mpi import is_mpi_group

        self.group = group
        self.mpi = is_mpi_group(group)
        self.rank = group.rank if self.mpi else dist.get_rank(group)
        self.world = group.size if self.mpi else dist.get_world_size(group)

    def barrier(self) -> None:
        if self.mpi:
            self.group.comm.Barrier()
        else:
            dist.barrier(group=self.group)

    def largest(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over ranks of a float64 tensor, in place."""
        if self.mpi:
            from mpi4py import MPI

            self.group.comm.Allreduce(MPI.IN_PLACE, [values.numpy(), MPI.DOUBLE], op=MPI.MAX)
        else:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values

    def from_rank0(self, flag: torch.Tensor) -> None:
        """Rank 0's int32 ``flag`` into every rank's, in place."""
        if self.mpi:
            from mpi4py import MPI

            self.group.comm.Bcast([flag.numpy(), MPI.INT32_T], root=0)
        else:
            dist.broadcast(flag, dist.get_global_rank(self.group, 0) if self.group is not None else 0, self.group)


def operation(coll: str, nbytes: int, world: int, rank: int, device, group=None) -> tuple[Callable[[str], None], int]:
    """A call of ``coll`` on ``group`` on fresh float32 buffers of about ``nbytes``, and the bytes it really
    moves."""
    from dtrain import comm

    per_block = Collective(coll) in BLOCK_COLLECTIVES
    numel = max(world, nbytes // 4 // world * world) if per_block else max(1, nbytes // 4)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world, device=device)
    g = group
    calls: dict[str, Callable[[str], object]] = {
        "all_reduce": lambda a: comm.all_reduce(full, algorithm=a, group=g),
        "broadcast": lambda a: comm.broadcast(full, 0, algorithm=a, group=g),
        "reduce": lambda a: comm.reduce(full, 0, algorithm=a, group=g),
        "scan": lambda a: comm.scan(full, algorithm=a, group=g),
        "all_gather": lambda a: comm.all_gather(full, part, algorithm=a, group=g),
        "reduce_scatter": lambda a: comm.reduce_scatter(part, full, algorithm=a, group=g),
        "gather": lambda a: comm.gather(full if rank == 0 else None, part, 0, algorithm=a, group=g),
        "scatter": lambda a: comm.scatter(part, full if rank == 0 else None, 0, algorithm=a, group=g),
        "all_to_all": lambda a: comm.all_to_all(torch.empty_like(full), full, algorithm=a, group=g),
        "barrier": lambda a: comm.barrier(group=g, algorithm="dissemination" if a == "auto" else a),
    }
    return calls[coll], (0 if coll == "barrier" else numel * 4)


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

    def __init__(self, call: Callable[[str], None], algorithm: str) -> None:
        from dtrain import comm

        self.replay = comm.capture(lambda: call(algorithm))

    def __call__(self, _algorithm: str) -> None:
        self.replay()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _predicted_us(
    coll: str, algorithm: str, nbytes: int, world: int, params, local_size, kind: str
) -> tuple[float | None, str]:
    """The model's time for ``algorithm`` (for "auto", for what the API chooses: a measured rule or the model's
    pick) and the algorithm priced."""
    from dtrain.comm.api import _auto

    collective = Collective(coll)
    ours = registry.names(collective)
    if algorithm == "auto":
        if not ours:
            return None, algorithm
        usable = local_size if local_size and 1 < local_size < world else None
        algorithm = _auto(collective, nbytes, world, kind, usable)
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


def _cases(config: BenchConfig, device) -> list[tuple[str, int, str]]:
    """(collective, size, algorithm) to time: every algorithm ``comm.algorithms`` lists ("auto" only for the
    barrier; with the MPI transport "dissemination" and "native", MPI_Barrier)."""
    from dtrain import comm

    cases = []
    for coll in config.collectives:
        if coll == "barrier":
            names = ["dissemination", "native"] if config.transport == "mpi" else ["auto"]
        else:
            names = comm.algorithms(coll)
        names = [a for a in names if config.algorithms is None or a in config.algorithms]
        if config.graphs and device.type == "cuda" and coll != "barrier":
            names += [f"{a}+graph" for a in names if a != "auto"]
        sizes = [0] if coll == "barrier" else config.sizes(device.type)
        cases += [(coll, size, a) for size in sizes for a in names]
    return cases


def bench_on_rank(config: BenchConfig) -> list[dict]:
    """Every rank runs this; rank 0 reports and returns the records (the others return ``[]``)."""
    from dtrain.bench.report import Progress, print_table, write_outputs
    from dtrain.comm.api import _kind, transport_name

    group = None
    if config.transport == "mpi":
        from dtrain.comm.mpi import world as mpi_world

        group = mpi_world()
    sync = Sync(group)
    device = torch.device("cpu") if group is not None else rank_device()
    rank, world = sync.rank, sync.world
    transport = transport_name(group, device)  # our algorithms' transport, priced by its own parameters
    kind = _kind(group, device)
    params = cost.load_params(device=kind)
    local_size = group.local_size if group is not None else _local_size(world)
    from dtrain.comm.peer import graphs as persistent

    backend = mpi_backend() if group is not None else None
    machine = {**_machine(device, backend), "transport": transport, "persistent": persistent.enabled()}
    records = []
    cases = _cases(config, device)
    with Progress(len(cases), enabled=rank == 0) as progress:
        for coll, size, algorithm in cases:
            call, nbytes = operation(coll, size, world, rank, device, group)
            if algorithm.endswith("+graph"):
                call = _Captured(call, algorithm.removesuffix("+graph"))
            progress.step(f"{coll} {nbytes} B {algorithm}")
            try:
                if not records:  # the sweep's first case: warm the devices first
                    _warm(call, algorithm.removesuffix("+graph"), config.warm_s, device, sync)
                took_us, host_us = time_us(call, algorithm, config, device, sync)
            except ValueError as exc:  # e.g. an algorithm that needs a node size it was not given
                progress.note(f"skipped {coll}/{algorithm}: {exc}")
                continue
            finally:
                if isinstance(call, _Captured):  # no graph may outlive the process group (see comm.graph)
                    call.replay.release()
            predicted, resolved = _predicted_us(
                coll, algorithm.removesuffix("+graph"), nbytes, world, params, local_size, kind
            )
            if algorithm.endswith("+graph"):  # the model prices eager rounds (host start-up included)
                predicted = None
            records.append(_record(coll, algorithm, nbytes, world, took_us, predicted, resolved, config, machine))
            records[-1]["host_us"] = host_us
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
        print(f"no rules written: {err}")
        return
    path = rules.save_rules(made, config.rules_out or None)
    print(f"rules for algorithm='auto' ({kind}, {world} ranks) written to {path}")


def _local_size(world: int) -> int | None:
    """Ranks per node, as the launcher tells it (LOCAL_WORLD_SIZE), if it divides the world."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(env) if env.isdigit() and int(env) > 0 and world % int(env) == 0 else None
