"""Jobs run under ``mpirun`` for the MPI transport tests: ``python -m mpi4py -m tests.jobs.mpi CASE...``.

Each rank checks itself against a single-process reference (every rank makes every rank's input from a seed,
:mod:`tests.jobs.comm`), prints one summary line per case (``OK``/``FAIL`` CASE rank R/W: ...) and exits
non-zero on any mismatch.
``python -m mpi4py`` aborts the whole job when a rank raises, instead of leaving its peers waiting.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from dtrain import comm
from dtrain.comm.mpi import MPIGroup
from tests.jobs.comm import BLOCKED, _call, _cases, _expected, _input, _strided

#: Two of our algorithms per collective, next to native (and "auto", native where nothing was measured).
OURS = {
    "all_reduce": ("ring", "recursive_doubling", "auto"),
    "broadcast": ("tree", "ring"),
    "reduce": ("tree", "ring"),
    "all_gather": ("ring", "recursive_doubling"),
    "reduce_scatter": ("ring", "halving_doubling"),
    "gather": ("tree", "star"),
    "scatter": ("tree", "star"),
    "all_to_all": ("direct", "star"),
    "scan": ("recursive_doubling", "linear"),
}


def _check(coll: str, algorithm: str, group: MPIGroup, sizes: list[int], seed: int) -> tuple[list[str], int]:
    rank, world = group.rank, group.size
    problems, calls = [], 0
    for size in sizes:
        numel = size * world if coll in BLOCKED else size
        for dtype, op, contiguous, root in _cases(coll, world):
            if world > 2 and dtype not in (torch.float32, torch.bfloat16, torch.int64):
                continue  # every dtype runs on 2 ranks
            seed += 1
            inputs = [_input(r, numel, dtype, seed, op) for r in range(world)]
            mine = _strided(inputs[rank], contiguous)
            got = _call(coll, mine, rank, world, op, root, group, algorithm)
            calls += 1
            if coll in BLOCKED and not torch.equal(mine.reshape(-1), inputs[rank].reshape(-1)):
                problems.append(f"{coll}/{algorithm} world={world} {dtype}: the input was changed")
            want = _expected(coll, inputs, rank, op, root)
            if want is None:
                continue
            if dtype == torch.bool:  # a sum is true where any is, a product where all are: torch's booleans
                want = want.to(torch.bool).double()
            tol = 1e-2 if op == "avg" and dtype in (torch.float16, torch.bfloat16) else 1e-6
            if not torch.allclose(got.double().reshape(-1), want.reshape(-1), rtol=tol, atol=tol):
                problems.append(
                    f"{coll}/{algorithm} world={world} size={size} {dtype} op={op} contiguous={contiguous} "
                    f"root={root}: got {got.reshape(-1)[:6].tolist()} want {want.reshape(-1)[:6].tolist()}"
                )
    return problems, calls


def collectives() -> int:
    """Every collective, native and each of our algorithms, every dtype and op, over MPI; then the same on the
    two halves of the world (a split communicator, whose ranks differ from the world's)."""
    from mpi4py import MPI

    group = MPIGroup()
    if group.size % 2 == 0 and group.size > 2:
        comm.set_local_size(2, group)
    problems, calls, seed = [], 0, 0
    sizes = [1, 5] if group.size <= 2 else [5]
    for coll, ours in OURS.items():
        for algorithm in ("native", *(ours if group.size <= 2 else ours[:1])):
            seed += 1000
            found, n = _check(coll, algorithm, group, sizes, seed)
            problems += found
            calls += n
    if group.local_size == 2:  # two nodes of two ranks, as declared
        found, n = _check("all_reduce", "hierarchical", group, [5], seed + 1)
        problems += found
        calls += n
    halves = MPIGroup(MPI.COMM_WORLD.Split(color=group.rank % 2, key=group.rank))
    if halves.global_rank(halves.rank) != group.rank:
        problems.append(f"split group: global rank {halves.global_rank(halves.rank)} is not {group.rank}")
    for coll, algorithm in (("all_reduce", "ring"), ("all_gather", "native"), ("broadcast", "tree")):
        found, n = _check(coll, algorithm, halves, [3], 99)
        problems += found
        calls += n
    late = group.size - 1
    for algorithm in ("native", "dissemination", "auto"):  # no rank may leave before the late rank entered
        if group.rank == late:
            time.sleep(0.1)
        entered = time.time()
        comm.barrier(group=group, algorithm=algorithm)
        left = time.time()
        stamp = torch.tensor([entered], dtype=torch.float64)
        MPI.COMM_WORLD.Bcast([stamp.numpy(), MPI.DOUBLE], root=late)
        if left < stamp.item():
            problems.append(f"barrier/{algorithm}: rank {group.rank} left before the late rank entered")
    return _report(group, "collectives", problems, calls)


def errors() -> int:
    """Bad input, then a missing peer twice (the group's timeout, then DTRAIN_COMM_TIMEOUT's), each on a fresh
    group."""
    problems = _bad_input() + _missing_peer("all_reduce", "ring", "group") + _missing_peer("broadcast", "tree", "env")
    problems += _default_group_is_mpi() + _mismatched_sizes()
    from dtrain.comm.mpi import world

    return _report(world(), "errors", problems, 5)


def _default_group_is_mpi() -> list[str]:
    """``DTRAIN_COMM_TRANSPORT=mpi``: ``group=None`` is MPI_COMM_WORLD (no torch.distributed group exists here)."""
    from dtrain.comm.mpi import world

    os.environ["DTRAIN_COMM_TRANSPORT"] = "mpi"
    problems = []
    try:
        rank, size = world().rank, world().size
        for algorithm in ("ring", "native", "auto"):
            x = torch.full((10,), float(rank + 1))
            comm.all_reduce(x, algorithm=algorithm)
            if not bool((x == size * (size + 1) / 2).all()):
                problems.append(f"DTRAIN_COMM_TRANSPORT=mpi all_reduce/{algorithm}: got {x.tolist()}")
    finally:
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)
    return problems


def _mismatched_sizes() -> list[str]:
    """A ring all-reduce of 8 float32 on rank 0 and 16 on rank 1: rank 0's first message is shorter than rank 1
    posted for it, rank 1's longer than rank 0 posted. Each rank raises ValueError naming the peer and both lengths
    at once (no timeout), and a call on the group after it runs."""
    from mpi4py import MPI

    group = MPIGroup(timeout=30.0)
    problems = []
    if group.rank < 2:
        want = {
            0: "rank 1 sent a message longer than the 16 bytes this rank expected",
            1: "rank 0 sent a message of 16 bytes where this rank expected 32",
        }[group.rank]
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(8 if group.rank == 0 else 16), group=group, algorithm="ring")
            problems.append("mismatched sizes: no error")
        except ValueError as err:
            text, took = str(err), time.monotonic() - start
            print(f"rank {group.rank} (mismatched sizes): raised after {took:.2f} s: {text}", flush=True)
            for words in ("all_reduce/ring", "round 0", f"rank {1 - group.rank} (global {1 - group.rank})", want):
                if words not in text:
                    problems.append(f"the error does not say {words!r}: {text}")
            if took > 10:
                problems.append(f"mismatched sizes: raised after {took:.2f} s")
    MPI.COMM_WORLD.Barrier()
    return problems


def _missing_peer(coll: str, algorithm: str, how: str) -> list[str]:
    """Rank 1 never calls; rank 0's call must raise CommTimeoutError naming rank 1 within the timeout: the
    group's (1 s), or DTRAIN_COMM_TIMEOUT's (1 s) with a long group timeout."""
    from mpi4py import MPI

    group = MPIGroup(timeout=1.0 if how == "group" else 600.0)
    problems = []
    if group.rank == 0:
        if how == "env":
            os.environ["DTRAIN_COMM_TIMEOUT"] = "1"
        t = torch.ones(8)
        start = time.monotonic()
        try:
            if coll == "broadcast":
                comm.broadcast(t, 1, group=group, algorithm=algorithm)
            else:
                comm.all_reduce(t, group=group, algorithm=algorithm)
            problems.append(f"{coll}/{algorithm}: no error")
        except comm.CommTimeoutError as err:
            took = time.monotonic() - start
            text = str(err)
            print(f"rank 0 ({how} timeout): raised after {took:.2f} s: {text}", flush=True)
            for words in (f"{coll}/{algorithm}", "round 0", "rank 1 (global 1)", "timed out"):
                if words not in text:
                    problems.append(f"the error does not say {words!r}: {text}")
            if not 0.9 < took < 10:
                problems.append(f"{coll}/{algorithm}: raised after {took:.2f} s, not about 1 s")
        finally:
            os.environ.pop("DTRAIN_COMM_TIMEOUT", None)
    MPI.COMM_WORLD.Barrier()
    return problems


def _bad_input() -> list[str]:
    """Rank 0 alone makes bad calls: each raises ValueError before anything is sent (rank 1 then finds no
    message waiting), and the group works afterwards."""
    from mpi4py import MPI

    group = MPIGroup()
    problems = []
    if group.rank == 0:
        calls = {
            "unknown op 'mean'": lambda: comm.all_reduce(torch.ones(4), op="mean", group=group),
            "unknown algorithm 'butterfly'": lambda: comm.all_reduce(torch.ones(4), group=group, algorithm="butterfly"),
            "src=5 is outside": lambda: comm.broadcast(torch.ones(4), 5, group=group, algorithm="native"),
            "output has 7 elements, expected 8": lambda: comm.all_gather(torch.empty(7), torch.ones(4), group=group),
            "CPU tensors only": lambda: comm.all_reduce(torch.ones(4, device="meta"), group=group, algorithm="ring"),
            "needs a floating dtype": lambda: comm.scan(torch.ones(4, dtype=torch.int32), op="avg", group=group),
            "unknown algorithm 'ring'": lambda: comm.barrier(group=group, algorithm="ring"),
            "timeout must be a positive number": lambda: MPIGroup(MPI.COMM_SELF, timeout=-1),
        }
        for words, call in calls.items():
            try:
                call()
                problems.append(f"no error for {words!r}")
            except ValueError as err:
                if words not in str(err):
                    problems.append(f"expected {words!r} in {err}")
    MPI.COMM_WORLD.Barrier()
    if group.rank != 0 and group.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        problems.append(f"rank {group.rank} found a message rank 0 should not have sent")
    MPI.COMM_WORLD.Barrier()
    t = torch.full((5,), float(group.rank + 1))
    comm.all_reduce(t, group=group, algorithm="ring")
    if t[0].item() != group.size * (group.size + 1) / 2:
        problems.append(f"after the bad calls all_reduce gave {t[0].item()}")
    return problems


def _report(group: MPIGroup, case: str, problems: list[str], calls: int) -> int:
    status = "FAIL" if problems else "OK"
    print(f"{status} {case} rank {group.rank}/{group.size}: {calls} calls, {len(problems)} mismatches", flush=True)
    for p in problems[:20]:
        print(f"  {p}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    cases = {"collectives": collectives, "errors": errors}
    sys.exit(max(cases[name]() for name in sys.argv[1:]))
