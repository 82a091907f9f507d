"""Recursive halving and doubling (Rabenseifner): bandwidth-optimal in log2 W steps, for any world size.

Reduce-scatter by recursive halving: at distance d = p2/2, p2/4, ..., 1 each active rank v sends its partner
v XOR d, as a reduce, the half of its current range that the partner's side is responsible for, and keeps the
other half, so the range it answers for halves each round and stays a contiguous run of blocks. All-reduce is
that reduce-scatter over p2 chunks of the one block followed by the recursive-doubling all-gather (the same
steps in reverse, copying). As in recursive doubling, the W - p2 extra ranks (p2 the largest power of two not
above W) first fold their whole buffer into rank r - p2 and are handed their result at the end; for
reduce-scatter active rank v answers for blocks v and v + p2. After Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH" (2005), sections 4.2 and 4.4.
"""

from __future__ import annotations

from collections.abc import Callable

from dtrain.comm.ir.algorithms.recursive_doubling import largest_power_of_two
from dtrain.comm.ir.algorithms.registry import register
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule

__all__ = ["halving_doubling_reduce_scatter", "halving_doubling_all_reduce"]

#: The chunks that active rank u answers for at the end of the halving.
Owned = Callable[[int], list[int]]


def _descending_distances(p2: int) -> list[int]:
    return [p2 >> s for s in range(1, p2.bit_length())]


def _range_chunks(start: int, size: int, owned: Owned) -> list[int]:
    """The chunks owned by active ranks start .. start + size - 1, kept in that (contiguous) order."""
    first = [owned(u)[0] for u in range(start, start + size)]
    rest = [c for u in range(start, start + size) for c in owned(u)[1:]]
    return first + rest


def _halving_rounds(p2: int, owned: Owned) -> list[list[Transfer]]:
    """Active rank v sends partner v ^ d the partner's half [p - p % d, + d) of the range they share."""
    rounds = []
    for d in _descending_distances(p2):
        rounds.append(
            [
                Transfer(v, v ^ d, c, c, reduce=True)
                for v in range(p2)
                for c in _range_chunks((v ^ d) - (v ^ d) % d, d, owned)
            ]
        )
    return rounds


def _doubling_rounds(p2: int, owned: Owned) -> list[list[Transfer]]:
    """Active rank v, holding the range [v - v % d, + d), copies it to partner v ^ d."""
    rounds = []
    for d in reversed(_descending_distances(p2)):
        rounds.append([Transfer(v, v ^ d, c, c) for v in range(p2) for c in _range_chunks(v - v % d, d, owned)])
    return rounds


@register(Collective.REDUCE_SCATTER, "halving_doubling")
def halving_doubling_reduce_scatter(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    p2 = largest_power_of_two(world_size)
    extras = range(p2, world_size)

    def owned(u: int) -> list[int]:
        return [u, u + p2] if u + p2 < world_size else [u]

    fold = [Transfer(r, r - p2, b, b, reduce=True) for r in extras for b in range(world_size)]
    unfold = [Transfer(r - p2, r, r, r) for r in extras]
    rounds = [fold, *_halving_rounds(p2, owned), unfold]
    return make_schedule(Collective.REDUCE_SCATTER, "halving_doubling", world_size, rounds)


@register(Collective.ALL_REDUCE, "halving_doubling")
def halving_doubling_all_reduce(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """The one block is cut into p2 chunks; active rank u answers for chunk u."""
    p2 = largest_power_of_two(world_size)
    extras = range(p2, world_size)

    def owned(u: int) -> list[int]:
        return [u]

    fold = [Transfer(r, r - p2, c, c, reduce=True) for r in extras for c in range(p2)]
    unfold = [Transfer(r - p2, r, c, c) for r in extras for c in range(p2)]
    rounds = [fold, *_halving_rounds(p2, owned), *_doubling_rounds(p2, owned), unfold]
    return make_schedule(Collective.ALL_REDUCE, "halving_doubling", world_size, rounds, chunks_per_block=p2)
