"""Ring algorithms: every rank talks only to its two neighbours.

All-reduce is a reduce-scatter followed by an all-gather, each W-1 steps round the ring: the buffer cut into
W partitions, W-1 reduce steps, then W-1 gather steps (Patarasuk and Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 69(2), 2009; the ring of NCCL's all-reduce). Broadcast and
reduce are a pipelined chain (a ring less one link): the message is cut into ``pipeline`` pieces that follow
each other down the chain.
"""

from __future__ import annotations

from dtrain.comm.ir.algorithms.registry import register
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule

__all__ = [
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "chain_broadcast",
    "chain_reduce",
]


def _reduce_scatter_rounds(world: int) -> list[list[Transfer]]:
    """After these W-1 rounds, rank r holds the fully reduced chunk r."""
    return [
        [Transfer(r, (r + 1) % world, (r - s - 1) % world, (r - s - 1) % world, reduce=True) for r in range(world)]
        for s in range(world - 1)
    ]


def _all_gather_rounds(world: int) -> list[list[Transfer]]:
    """With rank r holding chunk r, after these W-1 rounds every rank holds every chunk."""
    return [
        [Transfer(r, (r + 1) % world, (r - s) % world, (r - s) % world) for r in range(world)] for s in range(world - 1)
    ]


@register(Collective.ALL_REDUCE, "ring")
def ring_all_reduce(world_size: int, *, root=None, pipeline: int = 1, local_size=None) -> Schedule:
    rounds = _reduce_scatter_rounds(world_size) + _all_gather_rounds(world_size)
    return make_schedule(Collective.ALL_REDUCE, "ring", world_size, rounds, chunks_per_block=world_size)


@register(Collective.REDUCE_SCATTER, "ring")
def ring_reduce_scatter(world_size: int, *, root=None, pipeline: int = 1, local_size=None) -> Schedule:
    return make_schedule(Collective.REDUCE_SCATTER, "ring", world_size, _reduce_scatter_rounds(world_size))


@register(Collective.ALL_GATHER, "ring")
def ring_all_gather(world_size: int, *, root=None, pipeline: int = 1, local_size=None) -> Schedule:
    return make_schedule(Collective.ALL_GATHER, "ring", world_size, _all_gather_rounds(world_size))


def _chain_rounds(chain: list[int], pieces: int, reduce: bool) -> list[list[Transfer]]:
    """Piece p leaves chain position i in round i + p: the pieces follow each other down the chain."""
    hops = len(chain) - 1
    rounds = []
    for t in range(pieces + hops - 1):
        rounds.append(
            [Transfer(chain[i], chain[i + 1], t - i, t - i, reduce=reduce) for i in range(hops) if 0 <= t - i < pieces]
        )
    return rounds


@register(Collective.BROADCAST, "ring")
def chain_broadcast(world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size=None) -> Schedule:
    root = 0 if root is None else root
    chain = [(root + i) % world_size for i in range(world_size)]
    rounds = _chain_rounds(chain, pipeline, reduce=False)
    return make_schedule(Collective.BROADCAST, "ring", world_size, rounds, chunks_per_block=pipeline, root=root)


@register(Collective.REDUCE, "ring")
def chain_reduce(world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size=None) -> Schedule:
    root = 0 if root is None else root
    chain = [(root + i) % world_size for i in range(1, world_size + 1)]
    rounds = _chain_rounds(chain, pipeline, reduce=True)
    return make_schedule(Collective.REDUCE, "ring", world_size, rounds, chunks_per_block=pipeline, root=root)
