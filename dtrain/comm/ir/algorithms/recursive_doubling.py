"""Recursive doubling: log2 W rounds of pairwise exchange with partner v XOR 2^k, for any world size.

With p2 the largest power of two not above W, the W - p2 extra ranks first fold into partner r - p2
(all-reduce sends the whole buffer as a reduce, all-gather copies the extra's block); the p2 active ranks
then exchange with v XOR 1, v XOR 2, ..., each sending everything it has (all-reduce: its partial sum;
all-gather: every block it knows, which doubles each round); finally the results are copied back to the
extra ranks. After Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
MPICH" (2005), sections 4.1 and 4.4. log2 W rounds when W is a power of two, floor(log2 W) + 2 otherwise.
"""

from __future__ import annotations

from dtrain.comm.ir.algorithms.registry import register
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule

__all__ = ["largest_power_of_two", "recursive_doubling_all_reduce", "recursive_doubling_all_gather"]


def largest_power_of_two(world: int) -> int:
    """The largest power of two not above ``world`` (the number of ranks that take part in the exchange)."""
    return 1 << (world.bit_length() - 1)


def _known_blocks(v: int, size: int, p2: int, world: int) -> list[int]:
    """The blocks active rank v holds once its aligned group of ``size`` active ranks has pooled them."""
    base = v - v % size
    active = list(range(base, base + size))
    return active + [u + p2 for u in active if u + p2 < world]


@register(Collective.ALL_REDUCE, "recursive_doubling")
def recursive_doubling_all_reduce(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    p2 = largest_power_of_two(world_size)
    extras = range(p2, world_size)
    rounds = [[Transfer(r, r - p2, 0, 0, reduce=True) for r in extras]]
    d = 1
    while d < p2:
        rounds.append([Transfer(v, v ^ d, 0, 0, reduce=True) for v in range(p2)])
        d *= 2
    rounds.append([Transfer(r - p2, r, 0, 0) for r in extras])
    return make_schedule(Collective.ALL_REDUCE, "recursive_doubling", world_size, rounds)


@register(Collective.ALL_GATHER, "recursive_doubling")
def recursive_doubling_all_gather(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    p2 = largest_power_of_two(world_size)
    extras = range(p2, world_size)
    rounds = [[Transfer(r, r - p2, r, r) for r in extras]]
    d = 1
    while d < p2:
        rounds.append([Transfer(v, v ^ d, b, b) for v in range(p2) for b in _known_blocks(v, d, p2, world_size)])
        d *= 2
    rounds.append([Transfer(r - p2, r, b, b) for r in extras for b in range(world_size) if b != r])
    return make_schedule(Collective.ALL_GATHER, "recursive_doubling", world_size, rounds)
