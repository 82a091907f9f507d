"""``dtrain bench verify``: every (collective, algorithm) on the group it runs on, against torch.distributed.

The check a person runs first on a new cluster or backend (NCCL on GPUs, say), where the test suite's Gloo
pool does not reach: for several sizes (0, 1, a prime, one large), random float32 data, every algorithm is
compared with ``algorithm="native"`` on the same input, and small integers in int32, int8 and uint8 and booleans
(:data:`EXACT_DTYPES`) exactly. Rank 0 prints one line per pair and the worst relative difference (infinite where
an exact dtype differed); the return value is the number of failures.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm.ir.schedule import BLOCK_COLLECTIVES, Collective

__all__ = ["verify_on_rank"]

_TOLERANCE = 1e-5
#: Dtypes compared exactly, on integers 0..2 (booleans 0..1): sums stay in range on groups of up to 63 ranks.
EXACT_DTYPES = (torch.int32, torch.int8, torch.uint8, torch.bool)


def _call(
    coll: Collective, data: torch.Tensor, algorithm: str, world: int, rank: int, group=None
) -> torch.Tensor | None:
    """Run ``coll`` on a copy of ``data`` (the rank's whole work buffer) and return what this rank holds."""
    x = data.clone()
    m = x.numel() // world if coll in BLOCK_COLLECTIVES else x.numel()
    root = world - 1
    if coll in (Collective.ALL_REDUCE, Collective.SCAN):
        getattr(comm, coll.value)(x, group=group, algorithm=algorithm)
        return x
    if coll == Collective.BROADCAST:
        return comm.broadcast(x, root, group=group, algorithm=algorithm)
    if coll == Collective.REDUCE:
        comm.reduce(x, root, group=group, algorithm=algorithm)
        return x if rank == root else None
    if coll == Collective.ALL_GATHER:
        out = torch.empty_like(x)
        return comm.all_gather(out, x[:m], group=group, algorithm=algorithm)
    if coll == Collective.GATHER:
        out = torch.empty_like(x) if rank == root else None
        return comm.gather(out, x[:m], root, group=group, algorithm=algorithm)
    out = torch.empty(m, dtype=x.dtype, device=x.device)
    if coll == Collective.REDUCE_SCATTER:
        return comm.reduce_scatter(out, x, group=group, algorithm=algorithm)
    if coll == Collective.SCATTER:
        return comm.scatter(out, x if rank == root else None, root, group=group, algorithm=algorithm)
    out = torch.empty_like(x)
    return comm.all_to_all(out, x, group=group, algorithm=algorithm)


def _worst(coll: Collective, algorithm: str, sizes: list[int], device: torch.device, group=None) -> float:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    worst = 0.0
    for size in sizes:
        numel = size * world if coll in BLOCK_COLLECTIVES else size
        g = torch.Generator().manual_seed(1000 * size + rank)
        data = torch.randn(numel, generator=g).to(device)
        ours = _call(coll, data, algorithm, world, rank, group)
        theirs = _call(coll, data, "native", world, rank, group)
        if ours is not None and ours.numel():  # every rank makes the same calls below, those without a result too
            scale = max(theirs.abs().max().item(), 1e-30)
            worst = max(worst, (ours - theirs).abs().max().item() / scale)
        for dtype in EXACT_DTYPES:
            values = torch.randint(0, 2 if dtype == torch.bool else 3, (numel,), generator=g).to(dtype).to(device)
            ours = _call(coll, values, algorithm, world, rank, group)
            theirs = _call(coll, values, "native", world, rank, group)
            if ours is not None and not torch.equal(ours, theirs):
                worst = float("inf")
    verdict = torch.tensor([worst], dtype=torch.float64, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    return verdict.item()


def verify_on_rank(device: torch.device, sizes: list[int] | None = None, group=None) -> int:
    """Compare every algorithm of every collective with native on ``group`` (default: the world); returns the
    failure count."""
    sizes = sizes or [0, 1, 1031, 1 << 20]
    world = dist.get_world_size(group)
    failures = 0
    for coll in Collective:
        if coll == Collective.BARRIER:
            continue
        for algorithm in comm.algorithms(coll.value):
            if algorithm == "native":
                continue
            if algorithm == "hierarchical" and not (group is None and _has_nodes()):
                # One node: check the two-level code path by declaring nodes of 2 ranks.
                if world % 2 or world < 4:
                    continue
                comm.set_local_size(2, group)
            worst = _worst(coll, algorithm, sizes, device, group)
            comm.set_local_size(None, group)
            ok = worst < _TOLERANCE
            failures += not ok
            if dist.get_rank(group) == 0:
                print(f"{'ok  ' if ok else 'FAIL'} {coll.value:15s} {algorithm:19s} worst rel diff {worst:.2e}")
    if device.type == "cuda" and group is None:
        failures += _verify_captured(device)
    comm.barrier(group=group)
    return failures


def _verify_captured(device: torch.device) -> int:
    """Graph-captured all-reduces (comm.capture), replayed on new data, against native."""
    failures = 0
    for algorithm in comm.algorithms("all_reduce"):
        if algorithm == "hierarchical" and not _has_nodes():
            continue
        x = torch.empty(1 << 20, device=device)
        replay = comm.capture(lambda x=x, a=algorithm: comm.all_reduce(x, algorithm=a))
        worst = 0.0
        for seed in range(3):
            g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
            data = torch.randn(x.numel(), generator=g).to(device)
            x.copy_(data)
            replay()
            want = data.clone()
            dist.all_reduce(want)
            worst = max(worst, ((x - want).abs().max() / want.abs().max()).item())
        replay.release()
        verdict = torch.tensor([worst], dtype=torch.float64, device=device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        ok = verdict.item() < _TOLERANCE
        failures += not ok
        if dist.get_rank() == 0:
            print(f"{'ok  ' if ok else 'FAIL'} all_reduce+graph {algorithm:19s} worst rel diff {verdict.item():.2e}")
    return failures


def _has_nodes() -> bool:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    world = dist.get_world_size()
    return 1 < local < world and world % local == 0
