"""Measuring what ``algorithm="auto"`` follows: candidates timed side by side, and the rules they make.

:func:`time_interleaved` is the measurement ``dtrain bench comm`` reports and the calibration decides by: for one
collective and size, every candidate (the backend's own collective, ``native``, among them) runs ``iters`` calls
back to back between two synchronizations, the candidates alternating in rounds in one process, so that each
sees the same machine (a shared host's load moves between rounds, not between candidates); a round's time is
the slowest rank's, and a candidate's the median over rounds. With ``fresh`` every call gets its own input and
output tensors, made before the timed loop (what a training step passes: new gradients each time), beside the
same tensors every call (what a benchmark loop usually passes).

:func:`calibrate_rules` sweeps sizes per collective over the candidates of :func:`candidates` (``native``, ours
on the group's transport, and, where ``DTRAIN_COMM_TRANSPORT=auto`` lets a call change transport, ours on the
other one: on the CPU the /dev/shm peer transport beside Gloo's messages) and turns the winners into rules
(:func:`dtrain.comm.cost.rules.from_records`). :func:`autotune` is the short sweep a group runs at its first
``auto`` call when ``DTRAIN_COMM_AUTOTUNE=1`` and no rules were found; rank 0 saves the rules to the per-machine
cache (:func:`dtrain.comm.cost.rules.cache_path`), which later runs load.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dtrain.comm import native
from dtrain.comm.ir.schedule import BLOCK_COLLECTIVES, Collective

__all__ = [
    "CALIBRATED",
    "NATIVE_MARGIN",
    "AUTOTUNE_SIZES",
    "AUTOTUNE_ALGORITHMS",
    "Sync",
    "make_call",
    "candidates",
    "iters_for",
    "time_interleaved",
    "calibrate_rules",
    "autotune",
]

#: The collectives a calibration measures by default.
CALIBRATED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

#: Sizes :func:`autotune` measures (bytes of the work buffer); a rule holds up to the geometric midpoints, the
#: largest's winner above it.
AUTOTUNE_SIZES = (4 << 10, 256 << 10, 16 << 20)

#: How much faster than ``native`` another path must have been to win a size band (:func:`dtrain.comm.cost.rules.
#: from_records`): on 4 ranks of a shared 2-core host, the rounds of one path spread by +-50 % at 16 MiB and the
#: median of 3 by about 10 % (benchmarks/results/cpu_transports-cpu4.jsonl), so a smaller lead is not a win.
NATIVE_MARGIN = 0.10

#: Our algorithms :func:`autotune` times beside ``native`` (None: every one that applies).
AUTOTUNE_ALGORITHMS: tuple[str, ...] | None = None

#: Bytes of fresh tensors one rank may hold for a timed run (``fresh``): fewer calls a run where they exceed it.
FRESH_BYTES = 1 << 30


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


#: The name under which a sweep times torch.distributed's own call, with nothing of dtrain between (the peer our
#: collectives are measured against; ``native`` is the same call made through :mod:`dtrain.comm`).
TORCH = "torch"


def _torch_calls(group, rank: int) -> dict[str, Callable]:
    """torch.distributed's own calls on flat float32 tensors ``(full, part, out)``, as :func:`make_call` lays
    them out (a rooted call's root is rank 0 of the group)."""
    root = 0 if group is None else dist.get_global_rank(group, 0)
    return {
        "all_reduce": lambda full, part, out: dist.all_reduce(full, group=group),
        "broadcast": lambda full, part, out: dist.broadcast(full, root, group=group),
        "reduce": lambda full, part, out: dist.reduce(full, root, group=group),
        "all_gather": lambda full, part, out: native.all_gather_single(full, part, group=group),
        "reduce_scatter": lambda full, part, out: native.reduce_scatter_single(part, full, group=group),
        "all_to_all": lambda full, part, out: dist.all_to_all_single(out, full, group=group),
        "barrier": lambda full, part, out: dist.barrier(group=group),
    }


def make_call(
    coll: str, nbytes: int, world: int, rank: int, device, group=None, copies: int = 1
) -> tuple[Callable[[str, int], object], int]:
    """A call of ``coll`` on ``group`` on float32 buffers of about ``nbytes``: ``call(algorithm, k)`` uses the
    ``k % copies``-th set of input and output tensors (all made here, before any timing); and the bytes of its
    work buffer."""
    from dtrain import comm

    per_block = Collective(coll) in BLOCK_COLLECTIVES
    numel = max(world, nbytes // 4 // world * world) if per_block else max(1, nbytes // 4)
    fulls = [torch.ones(numel, device=device) for _ in range(copies)]
    parts = [torch.ones(numel // world, device=device) for _ in range(copies)]
    outs = [torch.empty_like(fulls[0]) for _ in range(copies)] if coll == "all_to_all" else fulls
    g = group
    calls: dict[str, Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
        "all_reduce": lambda a, full, part, out: comm.all_reduce(full, algorithm=a, group=g),
        "broadcast": lambda a, full, part, out: comm.broadcast(full, 0, algorithm=a, group=g),
        "reduce": lambda a, full, part, out: comm.reduce(full, 0, algorithm=a, group=g),
        "scan": lambda a, full, part, out: comm.scan(full, algorithm=a, group=g),
        "all_gather": lambda a, full, part, out: comm.all_gather(full, part, algorithm=a, group=g),
        "reduce_scatter": lambda a, full, part, out: comm.reduce_scatter(part, full, algorithm=a, group=g),
        "gather": lambda a, full, part, out: comm.gather(full if rank == 0 else None, part, 0, algorithm=a, group=g),
        "scatter": lambda a, full, part, out: comm.scatter(part, full if rank == 0 else None, 0, algorithm=a, group=g),
        "all_to_all": lambda a, full, part, out: comm.all_to_all(out, full, algorithm=a, group=g),
        "barrier": lambda a, full, part, out: comm.barrier(group=g, algorithm="dissemination" if a == "auto" else a),
    }
    one = calls[coll]
    peer: list = []  # torch.distributed's own call, made on first use (an MPI group has none)

    def call(algorithm: str, k: int = 0) -> object:
        i = k % copies
        if algorithm == TORCH:
            if not peer:
                peer.append(_torch_calls(g, rank).get(coll))
            if peer[0] is None:
                raise ValueError(f"{TORCH!r}: torch.distributed has no {coll} call to time beside ours")
            return peer[0](fulls[i], parts[i], outs[i])
        return one(algorithm, fulls[i], parts[i], outs[i])

    return call, (0 if coll == "barrier" else numel * 4)


def iters_for(nbytes: int, device) -> int:
    """Calls a timed run on ``device``: on the CPU 10 up to 1 MiB and fewer above (a 64 MiB call takes a good
    part of a second on a few shared cores), on GPUs 20."""
    if device.type != "cpu":
        return 20
    return 10 if nbytes <= 1 << 20 else 4 if nbytes <= 4 << 20 else 2 if nbytes <= 16 << 20 else 1


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    call: Callable[[str, int], object],
    names: Sequence[str],
    *,
    iters: int,
    rounds: int,
    warmup: int,
    device,
    sync: Sync,
) -> dict[str, dict]:
    """Per name: ``time_us`` (one call: the median over ``rounds`` of the slowest rank's run of ``iters`` calls
    between two synchronizations, divided by ``iters``), ``host_us`` (the same, up to the last call's return,
    before the closing synchronization), ``runs_us`` (each round's time). The names alternate within a round,
    and the order turns by one each round so that none always follows the same one. Call ``k`` of a run passes
    ``k`` to ``call`` (which set of tensors it uses). Every rank passes the same names."""
    for name in names:
        for k in range(warmup):
            call(name, k)
    runs = {n: [] for n in names}
    issued = {n: [] for n in names}
    for r in range(rounds):
        order = [names[(i + r) % len(names)] for i in range(len(names))]
        for name in order:
            _sync(device)
            sync.barrier()
            _sync(device)
            start = time.perf_counter()
            for k in range(iters):
                call(name, k)
            issued[name].append((time.perf_counter() - start) / iters)
            _sync(device)
            runs[name].append((time.perf_counter() - start) / iters)
    flat = [v * 1e6 for n in names for v in (*runs[n], *issued[n])]
    worst = sync.largest(torch.tensor(flat, dtype=torch.float64, device=device)).cpu().tolist()
    out = {}
    for i, name in enumerate(names):
        mine = worst[i * 2 * rounds : (i + 1) * 2 * rounds]
        out[name] = {
            "time_us": statistics.median(mine[:rounds]),
            "host_us": statistics.median(mine[rounds:]),
            "runs_us": mine[:rounds],
        }
    return out


def candidates(coll: str, group, device, kind: str, algorithms: Sequence[str] | None = None) -> list[str]:
    """What a calibration times for ``coll``: ``native``, ours on the group's transport, and where the group may
    change transport per call (``DTRAIN_COMM_TRANSPORT=auto``, not MPI) ours on the other transport
    (``"ring@peer"``; the peer transport only where every rank shares this host: a collective question).
    ``algorithms`` keeps only those names (plain names; their ``@`` forms come along). ``hierarchical`` only
    where the group has a node size."""
    from dtrain.comm import algorithms as accepted
    from dtrain.comm.api import _transport_setting, transport_name
    from dtrain.comm.arguments import _local_size
    from dtrain.comm.ir import algorithms as registry
    from dtrain.comm.peer import window as peer

    world = group.size if kind.endswith("-mpi") else dist.get_world_size(group)
    local = _local_size(group, world)
    usable = local is not None and 1 < local < world and world % local == 0
    ours = [a for a in accepted(coll) if a not in ("auto", "native")]
    ours = [a for a in ours if usable or not registry.needs_local_size(a)]
    if algorithms is not None:
        ours = [a for a in ours if a in algorithms]
    names = ["native", *ours] if algorithms is None or "native" in algorithms else list(ours)
    own = transport_name(group, device)
    if own != "mpi" and _transport_setting() == "auto":
        other = "p2p" if own == "peer" else "peer"
        if other == "p2p" or peer.peer_available(group, device):
            names += [f"{a}@{other}" for a in ours]
    return names


def calibrate_rules(
    group,
    device,
    *,
    collectives: Sequence[str] = CALIBRATED,
    sizes: Sequence[int] = AUTOTUNE_SIZES,
    algorithms: Sequence[str] | None = None,
    rounds: int = 3,
    warmup: int = 1,
    fresh: bool = False,
    progress: Callable[[str], None] | None = None,
):
    """Time every candidate of each collective at each size (:func:`time_interleaved`) on ``group`` (every rank
    calls this); (rules, records) on rank 0, (None, records) elsewhere."""
    from dtrain.comm.api import _kind
    from dtrain.comm.cost import rules
    from dtrain.comm.cost.rules import from_records

    sync = Sync(group)
    kind = _kind(group, device)
    records = []
    for coll in collectives:
        names = candidates(coll, group, device, kind, algorithms)
        for size in sizes:
            iters = iters_for(size, device)
            call, nbytes = make_call(coll, size, sync.world, sync.rank, device, group, copies=iters if fresh else 1)
            timed = time_interleaved(call, names, iters=iters, rounds=rounds, warmup=warmup, device=device, sync=sync)
            native = timed.get("native", {}).get("time_us")
            for name, t in timed.items():
                records.append({
                    "collective": coll, "algorithm": name, "nbytes": nbytes, "world_size": sync.world,
                    "time_us": t["time_us"], "host_us": t["host_us"], "runs_us": t["runs_us"], "iters": iters,
                    "rounds": rounds, "fresh": fresh, "kind": kind,
                    "vs_native": None if not native or not t["time_us"] else native / t["time_us"],
                })  # fmt: skip
            if progress is not None and sync.rank == 0:
                best = min(timed, key=lambda n: timed[n]["time_us"])
                progress(f"{coll} {nbytes} B: {best} ({timed[best]['time_us']:.0f} us)")
            del call
    if sync.rank != 0:
        return None, records
    meta = {
        "hostname": platform.node(),
        "torch_version": torch.__version__,
        "transport_setting": _setting(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sizes": list(sizes),
        "rounds": rounds,
        "fresh": fresh,
    }
    from dtrain.comm.arguments import _local_size

    local = _local_size(group, sync.world)
    local = local if local is not None and 1 < local < sync.world and sync.world % local == 0 else None
    made = from_records(
        records, kind=kind, local_size=local, meta={**meta, "margin": NATIVE_MARGIN}, margin=NATIVE_MARGIN
    )
    assert isinstance(made, rules.Rules)
    return made, records


def _setting() -> str:
    from dtrain.comm.api import _transport_setting

    return _transport_setting()


def cache_path_for(group, device, kind: str):
    """Where the per-machine cache of ``group``'s rules lives (:func:`dtrain.comm.cost.rules.cache_path`)."""
    from dtrain.comm.cost import rules

    world = group.size if kind.endswith("-mpi") else dist.get_world_size(group)
    return rules.cache_path(kind, world, _setting(), torch.__version__)


def autotune(group, device, kind: str):
    """The short calibration of a group's first ``auto`` call (``DTRAIN_COMM_AUTOTUNE=1``, no rules found):
    :data:`CALIBRATED` at :data:`AUTOTUNE_SIZES`; rank 0 saves the rules to :func:`cache_path_for` and returns
    them (None elsewhere). Every rank of the group calls it at the same call."""
    import warnings

    from dtrain.comm.cost import rules

    group = dist.group.WORLD if group is None else group
    started = time.perf_counter()
    algorithms = None if AUTOTUNE_ALGORITHMS is None else ("native", *AUTOTUNE_ALGORITHMS)
    made, _ = calibrate_rules(group, device, collectives=CALIBRATED, sizes=AUTOTUNE_SIZES, algorithms=algorithms)
    if made is None:
        return None
    path = rules.save_rules(made, cache_path_for(group, device, kind))
    warnings.warn(
        f"dtrain.comm: measured rules for algorithm='auto' in {time.perf_counter() - started:.1f} s, saved to {path}",
        stacklevel=3,
    )
    return made
