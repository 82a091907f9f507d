"""Hierarchical (two-level) algorithms: keep the heavy traffic inside a node, send little between nodes.

Rank r sits on node r // L at local index r % L, L = ``local_size`` ranks a node. All-reduce is a ring
reduce-scatter inside every node (local rank l ends with piece l summed over its node), then for each l a
ring all-reduce across the nodes among the ranks of local index l on piece l (cut into one sub-chunk per
node), then a ring all-gather inside every node: the scheme of Horovod's hierarchical allreduce (Sergeev and
Del Balso, 2018) and of 2-D ring all-reduce, where only 1/L of the data crosses between nodes per rank.
Reduce-scatter and all-gather are its two halves on the rank-major blocks. Broadcast and reduce run a
binomial tree among the node leaders (the ranks with the root's local index) and one inside every node.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtrain.comm.ir.algorithms.registry import register
from dtrain.comm.ir.algorithms.tree import binomial_broadcast_rounds, binomial_reduce_rounds
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule

__all__ = [
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "hierarchical_all_gather",
    "hierarchical_broadcast",
    "hierarchical_reduce",
]

Rounds = list[list[Transfer]]


def _node_count(world: int, local_size: int | None) -> int:
    if local_size is None or local_size < 1 or world % local_size:
        raise ValueError(
            f"hierarchical algorithms need local_size (ranks per node) to be a positive divisor of the world "
            f"size {world}, got {local_size!r}"
        )
    return world // local_size


def _ring_reduce_scatter(group: Sequence[int], pieces: Sequence[Sequence[int]]) -> Rounds:
    """After len(group) - 1 rounds ``group[i]`` holds the chunks ``pieces[i]`` summed over the group."""
    n = len(group)
    return [
        [Transfer(group[i], group[(i + 1) % n], c, c, reduce=True) for i in range(n) for c in pieces[(i - s - 1) % n]]
        for s in range(n - 1)
    ]


def _ring_all_gather(group: Sequence[int], pieces: Sequence[Sequence[int]]) -> Rounds:
    """With ``group[i]`` holding ``pieces[i]``, after len(group) - 1 rounds every member holds them all."""
    n = len(group)
    return [
        [Transfer(group[i], group[(i + 1) % n], c, c) for i in range(n) for c in pieces[(i - s) % n]]
        for s in range(n - 1)
    ]


def _side_by_side(schedules: Sequence[Rounds]) -> Rounds:
    """Run independent round lists (on disjoint groups of ranks) at the same time, round by round."""
    depth = max((len(s) for s in schedules), default=0)
    return [[t for s in schedules if i < len(s) for t in s[i]] for i in range(depth)]


def _nodes(n_nodes: int, local: int) -> list[list[int]]:
    return [[m * local + lr for lr in range(local)] for m in range(n_nodes)]


def _peers(n_nodes: int, local: int) -> list[list[int]]:
    """For each local index l, the ranks holding it on every node, in node order."""
    return [[m * local + lr for m in range(n_nodes)] for lr in range(local)]


@register(Collective.ALL_REDUCE, "hierarchical", needs_local_size=True)
def hierarchical_all_reduce(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """2(L - 1) + 2(W/L - 1) rounds over W chunks; piece l is chunks l*N .. l*N + N - 1 (N nodes)."""
    n_nodes = _node_count(world_size, local_size)
    pieces = [list(range(lr * n_nodes, (lr + 1) * n_nodes)) for lr in range(local_size)]
    nodes, peers = _nodes(n_nodes, local_size), _peers(n_nodes, local_size)
    across = [
        _ring_reduce_scatter(group, [[c] for c in piece]) + _ring_all_gather(group, [[c] for c in piece])
        for group, piece in zip(peers, pieces, strict=True)
    ]
    rounds = (
        _side_by_side([_ring_reduce_scatter(node, pieces) for node in nodes])
        + _side_by_side(across)
        + _side_by_side([_ring_all_gather(node, pieces) for node in nodes])
    )
    return make_schedule(Collective.ALL_REDUCE, "hierarchical", world_size, rounds, chunks_per_block=world_size)


@register(Collective.REDUCE_SCATTER, "hierarchical", needs_local_size=True)
def hierarchical_reduce_scatter(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """Inside nodes, local rank l sums the blocks of every rank with local index l; then across nodes."""
    n_nodes = _node_count(world_size, local_size)
    nodes, peers = _nodes(n_nodes, local_size), _peers(n_nodes, local_size)
    inside = _side_by_side([_ring_reduce_scatter(node, peers) for node in nodes])
    rounds = inside + _side_by_side([_ring_reduce_scatter(group, [[b] for b in group]) for group in peers])
    return make_schedule(Collective.REDUCE_SCATTER, "hierarchical", world_size, rounds)


@register(Collective.ALL_GATHER, "hierarchical", needs_local_size=True)
def hierarchical_all_gather(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """Across nodes among ranks of one local index first, then inside nodes: each block crosses once."""
    n_nodes = _node_count(world_size, local_size)
    nodes, peers = _nodes(n_nodes, local_size), _peers(n_nodes, local_size)
    across = _side_by_side([_ring_all_gather(group, [[b] for b in group]) for group in peers])
    rounds = across + _side_by_side([_ring_all_gather(node, peers) for node in nodes])
    return make_schedule(Collective.ALL_GATHER, "hierarchical", world_size, rounds)


def _root_trees(world: int, root: int, local: int) -> tuple[list[int], list[list[int]]]:
    """The leaders (root's local index on every node, root's node first) and each node in tree order."""
    n_nodes = _node_count(world, local)
    if not 0 <= root < world:
        raise ValueError(f"root {root} is outside world of size {world}")
    home, lr = divmod(root, local)
    leaders = [((home + i) % n_nodes) * local + lr for i in range(n_nodes)]
    nodes = [[m * local + (lr + i) % local for i in range(local)] for m in range(n_nodes)]
    return leaders, nodes


@register(Collective.BROADCAST, "hierarchical", needs_local_size=True)
def hierarchical_broadcast(
    world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """ceil(log2 N) + ceil(log2 L) rounds: a binomial tree over the leaders, then one in every node."""
    root = 0 if root is None else root
    leaders, nodes = _root_trees(world_size, root, local_size)
    rounds = binomial_broadcast_rounds(leaders, [0]) + _side_by_side(
        [binomial_broadcast_rounds(node, [0]) for node in nodes]
    )
    return make_schedule(Collective.BROADCAST, "hierarchical", world_size, rounds, root=root)


@register(Collective.REDUCE, "hierarchical", needs_local_size=True)
def hierarchical_reduce(
    world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """The broadcast reversed: a binomial reduce in every node to its leader, then over the leaders."""
    root = 0 if root is None else root
    leaders, nodes = _root_trees(world_size, root, local_size)
    rounds = _side_by_side([binomial_reduce_rounds(node, [0]) for node in nodes]) + binomial_reduce_rounds(leaders, [0])
    return make_schedule(Collective.REDUCE, "hierarchical", world_size, rounds, root=root)
