"""Direct algorithms: one round in which every rank talks to every other rank at once.

All-to-all sends rank r's block j straight to block r of rank j; reduce-scatter sends block j to rank j as a
reduce; all-gather sends each rank's block to everyone; all-reduce is a direct reduce-scatter then a direct
all-gather over W chunks of the one block (the "two-shot" all-reduce); the one-shot all-reduce is a single
round in which every rank reduces every peer's whole buffer into its own; the scatter-allgather broadcast
scatters the root's buffer over the other ranks, then runs a direct all-gather among them (van de Geijn's
long-message broadcast: Barnett et al., "Interprocessor Collective Communication Library (InterCom)", 1994).
Latency-optimal (one or two rounds) at
the price of W - 1 messages per rank per round, the "pairwise"/"linear" algorithms of MPI libraries (Thakur,
Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005).
"""

from __future__ import annotations

from dtrain.comm.ir.algorithms.registry import register
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule

__all__ = [
    "direct_all_to_all",
    "direct_reduce_scatter",
    "direct_all_gather",
    "direct_all_reduce",
    "one_shot_all_reduce",
    "scatter_allgather_broadcast",
]


def _pairs(world: int) -> list[tuple[int, int]]:
    return [(src, dst) for src in range(world) for dst in range(world) if src != dst]


def _reduce_scatter_round(world: int) -> list[Transfer]:
    """Chunk j of every rank is summed into chunk j of rank j."""
    return [Transfer(src, dst, dst, dst, reduce=True) for src, dst in _pairs(world)]


def _all_gather_round(world: int) -> list[Transfer]:
    """Chunk r of rank r is copied to every other rank."""
    return [Transfer(src, dst, src, src) for src, dst in _pairs(world)]


@register(Collective.ALL_TO_ALL, "direct")
def direct_all_to_all(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    rounds = [[Transfer(src, dst, dst, src) for src, dst in _pairs(world_size)]]
    return make_schedule(Collective.ALL_TO_ALL, "direct", world_size, rounds)


@register(Collective.REDUCE_SCATTER, "direct")
def direct_reduce_scatter(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    return make_schedule(Collective.REDUCE_SCATTER, "direct", world_size, [_reduce_scatter_round(world_size)])


@register(Collective.ALL_GATHER, "direct")
def direct_all_gather(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    return make_schedule(Collective.ALL_GATHER, "direct", world_size, [_all_gather_round(world_size)])


@register(Collective.ALL_REDUCE, "direct")
def direct_all_reduce(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """Two rounds over W chunks: rank j sums chunk j from everyone, then hands it to everyone."""
    rounds = [_reduce_scatter_round(world_size), _all_gather_round(world_size)]
    return make_schedule(Collective.ALL_REDUCE, "direct", world_size, rounds, chunks_per_block=world_size)


@register(Collective.ALL_REDUCE, "one_shot")
def one_shot_all_reduce(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """One round: every rank sums every peer's whole buffer into its own (W - 1 full-size reads a rank, the
    fewest rounds and barriers; the latency path for small buffers)."""
    rounds = [[Transfer(src, dst, 0, 0, reduce=True) for src, dst in _pairs(world_size)]]
    return make_schedule(Collective.ALL_REDUCE, "one_shot", world_size, rounds)


@register(Collective.BROADCAST, "scatter_allgather")
def scatter_allgather_broadcast(
    world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """Two rounds over ``W - 1`` chunks, one for each rank but the root: the root hands each its chunk, then each
    hands its chunk to every other rank but the root. The root sends the buffer once (the star broadcast: ``W -
    1`` times), every other rank ``(W - 2) / (W - 1)`` of it."""
    root = 0 if root is None else root
    if not 0 <= root < world_size:
        raise ValueError(f"broadcast root {root} is outside world of size {world_size}; expected 0..{world_size - 1}")
    others = [r for r in range(world_size) if r != root]
    scatter = [Transfer(root, r, k, k) for k, r in enumerate(others)]
    gather = [Transfer(r, d, k, k) for k, r in enumerate(others) for d in others if d != r]
    return make_schedule(
        Collective.BROADCAST,
        "scatter_allgather",
        world_size,
        [scatter, gather],
        chunks_per_block=max(1, len(others)),
        root=root,
    )
