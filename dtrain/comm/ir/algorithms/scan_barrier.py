"""Scan (inclusive prefix over ranks) and barrier algorithms.

Scan "recursive_doubling" is Hillis and Steele's parallel prefix ("Data Parallel Algorithms", 1986): in round
k every rank r >= 2^k adds in rank r - 2^k's partial result; reads see the start of the round, so one buffer
suffices; ceil(log2 W) rounds. Scan "linear" is the chain 0 -> 1 -> ... -> W-1, pipelined like the chain
broadcast: piece p leaves rank i in round i + p. Barrier "dissemination" is Hensgen, Finkel and Manber's
("Two algorithms for barrier synchronization", 1988): in round k rank r signals rank (r + 2^k) mod W, and
after ceil(log2 W) rounds every rank has heard, directly or not, from every other.
"""

from __future__ import annotations

from dtrain.comm.ir.algorithms.registry import register
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule

__all__ = ["recursive_doubling_scan", "linear_scan", "dissemination_barrier"]


def _powers_below(world: int) -> list[int]:
    out, d = [], 1
    while d < world:
        out.append(d)
        d *= 2
    return out


@register(Collective.SCAN, "recursive_doubling")
def recursive_doubling_scan(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    rounds = [[Transfer(r - d, r, 0, 0, reduce=True) for r in range(d, world_size)] for d in _powers_below(world_size)]
    return make_schedule(Collective.SCAN, "recursive_doubling", world_size, rounds)


@register(Collective.SCAN, "linear")
def linear_scan(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """W - 1 + pipeline - 1 rounds; rank i + 1 adds piece p of rank i's finished prefix in round i + p."""
    hops = world_size - 1
    rounds = [
        [Transfer(i, i + 1, t - i, t - i, reduce=True) for i in range(hops) if 0 <= t - i < pipeline]
        for t in range(hops + pipeline - 1)
    ]
    return make_schedule(Collective.SCAN, "linear", world_size, rounds, chunks_per_block=pipeline)


@register(Collective.BARRIER, "dissemination")
def dissemination_barrier(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    rounds = [
        [Transfer(r, (r + d) % world_size, 0, 0, reduce=True) for r in range(world_size)]
        for d in _powers_below(world_size)
    ]
    return make_schedule(Collective.BARRIER, "dissemination", world_size, rounds)
