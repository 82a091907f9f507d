"""Binomial-tree algorithms: ceil(log2 W) rounds, every rank talking to at most one partner a round.

Ranks are relabelled relative to the root (position v = (r - root) mod W). Broadcast and scatter halve the
distance each round, the root serving the far half first, so every subtree is a contiguous range of
positions; reduce and gather double it. Gather and scatter move a whole subtree's blocks per hop. All-reduce
is a binomial reduce to rank 0 followed by a binomial broadcast from it. After the MPICH binomial algorithms
(Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005).
"""

from __future__ import annotations

from collections.abc import Sequence

from dtrain.comm.ir.algorithms.registry import register
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule

__all__ = [
    "binomial_broadcast_rounds",
    "binomial_reduce_rounds",
    "tree_broadcast",
    "tree_reduce",
    "tree_gather",
    "tree_scatter",
    "tree_all_reduce",
]


def _distances(n: int) -> list[int]:
    """The powers of two below ``n``, ascending: the hop lengths of a binomial tree over n positions."""
    out, d = [], 1
    while d < n:
        out.append(d)
        d *= 2
    return out


def _relabelled(world: int, root: int) -> list[int]:
    """Ranks in tree order: position v is rank (root + v) mod W."""
    return [(root + v) % world for v in range(world)]


def binomial_broadcast_rounds(group: Sequence[int], chunks: Sequence[int]) -> list[list[Transfer]]:
    """``group[0]`` holds ``chunks``; after ceil(log2 len(group)) rounds every member does."""
    n = len(group)
    return [
        [Transfer(group[v], group[v + d], c, c) for v in range(0, n - d, 2 * d) for c in chunks]
        for d in reversed(_distances(n))
    ]


def binomial_reduce_rounds(group: Sequence[int], chunks: Sequence[int]) -> list[list[Transfer]]:
    """After ceil(log2 len(group)) rounds ``group[0]`` holds ``chunks`` reduced over the whole group."""
    n = len(group)
    return [
        [Transfer(group[v], group[v - d], c, c, reduce=True) for v in range(d, n, 2 * d) for c in chunks]
        for d in _distances(n)
    ]


def _gather_rounds(group: Sequence[int]) -> list[list[Transfer]]:
    """Block ``group[u]`` starts on ``group[u]``; position v forwards its subtree [v, v + d) to v - d."""
    n = len(group)
    return [
        [Transfer(group[v], group[v - d], b, b) for v in range(d, n, 2 * d) for b in group[v : min(v + d, n)]]
        for d in _distances(n)
    ]


def _scatter_rounds(group: Sequence[int]) -> list[list[Transfer]]:
    """``group[0]`` holds every block; position v hands v + d the blocks of its subtree [v + d, v + 2d)."""
    n = len(group)
    return [
        [
            Transfer(group[v], group[v + d], b, b)
            for v in range(0, n - d, 2 * d)
            for b in group[v + d : min(v + 2 * d, n)]
        ]
        for d in reversed(_distances(n))
    ]


@register(Collective.BROADCAST, "tree")
def tree_broadcast(
    world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    root = 0 if root is None else root
    rounds = binomial_broadcast_rounds(_relabelled(world_size, root), [0])
    return make_schedule(Collective.BROADCAST, "tree", world_size, rounds, root=root)


@register(Collective.REDUCE, "tree")
def tree_reduce(world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None) -> Schedule:
    root = 0 if root is None else root
    rounds = binomial_reduce_rounds(_relabelled(world_size, root), [0])
    return make_schedule(Collective.REDUCE, "tree", world_size, rounds, root=root)


@register(Collective.GATHER, "tree")
def tree_gather(world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None) -> Schedule:
    root = 0 if root is None else root
    rounds = _gather_rounds(_relabelled(world_size, root))
    return make_schedule(Collective.GATHER, "tree", world_size, rounds, root=root)


@register(Collective.SCATTER, "tree")
def tree_scatter(
    world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    root = 0 if root is None else root
    rounds = _scatter_rounds(_relabelled(world_size, root))
    return make_schedule(Collective.SCATTER, "tree", world_size, rounds, root=root)


@register(Collective.ALL_REDUCE, "tree")
def tree_all_reduce(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """Binomial reduce to rank 0, then binomial broadcast from it: 2 ceil(log2 W) rounds."""
    group = list(range(world_size))
    rounds = binomial_reduce_rounds(group, [0]) + binomial_broadcast_rounds(group, [0])
    return make_schedule(Collective.ALL_REDUCE, "tree", world_size, rounds)
