"""Star algorithms: every byte passes through one rank, the hub.

The baseline the ring improves on (gather to one rank, reduce, broadcast back): the hub's links carry
everything, so its time grows with W while the ring's does not. Rooted collectives use their root as
the hub; the others use the ``root`` argument if one is given, else rank 0 (their schedule has no root).
"""

from __future__ import annotations

from dtrain.comm.ir.algorithms.registry import register
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule

__all__ = [
    "star_all_reduce",
    "star_broadcast",
    "star_reduce",
    "star_gather",
    "star_scatter",
    "star_all_gather",
    "star_reduce_scatter",
    "star_all_to_all",
]


def _hub(world: int, root: int | None) -> int:
    """The rank everything passes through: ``root``, or rank 0 when none is given."""
    hub = 0 if root is None else root
    if not 0 <= hub < world:
        raise ValueError(f"star hub (root) {hub} is outside world of size {world}; expected 0..{world - 1}")
    return hub


def _others(world: int, hub: int) -> list[int]:
    return [r for r in range(world) if r != hub]


def _to_hub(world: int, hub: int, blocks: bool, reduce: bool) -> list[Transfer]:
    """Every other rank sends the hub its own block (``blocks``) or its whole buffer of one chunk."""
    if blocks:
        return [Transfer(r, hub, r, r, reduce=reduce) for r in _others(world, hub)]
    return [Transfer(r, hub, 0, 0, reduce=reduce) for r in _others(world, hub)]


@register(Collective.ALL_REDUCE, "star")
def star_all_reduce(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    hub = _hub(world_size, root)
    back = [Transfer(hub, r, 0, 0) for r in _others(world_size, hub)]
    rounds = [_to_hub(world_size, hub, False, True), back]
    return make_schedule(Collective.ALL_REDUCE, "star", world_size, rounds)


@register(Collective.BROADCAST, "star")
def star_broadcast(
    world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    root = _hub(world_size, root)
    rounds = [[Transfer(root, r, 0, 0) for r in _others(world_size, root)]]
    return make_schedule(Collective.BROADCAST, "star", world_size, rounds, root=root)


@register(Collective.REDUCE, "star")
def star_reduce(world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None) -> Schedule:
    root = _hub(world_size, root)
    return make_schedule(Collective.REDUCE, "star", world_size, [_to_hub(world_size, root, False, True)], root=root)


@register(Collective.GATHER, "star")
def star_gather(world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None) -> Schedule:
    root = _hub(world_size, root)
    return make_schedule(Collective.GATHER, "star", world_size, [_to_hub(world_size, root, True, False)], root=root)


@register(Collective.SCATTER, "star")
def star_scatter(
    world_size: int, *, root: int | None = 0, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    root = _hub(world_size, root)
    rounds = [[Transfer(root, r, r, r) for r in _others(world_size, root)]]
    return make_schedule(Collective.SCATTER, "star", world_size, rounds, root=root)


@register(Collective.ALL_GATHER, "star")
def star_all_gather(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """Gather to the hub, then the hub sends each rank every block but its own."""
    hub = _hub(world_size, root)
    back = [Transfer(hub, r, b, b) for r in _others(world_size, hub) for b in range(world_size) if b != r]
    rounds = [_to_hub(world_size, hub, True, False), back]
    return make_schedule(Collective.ALL_GATHER, "star", world_size, rounds)


@register(Collective.REDUCE_SCATTER, "star")
def star_reduce_scatter(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """Every rank sends the hub every block as a reduce; the hub hands rank r its summed block r."""
    hub = _hub(world_size, root)
    others = _others(world_size, hub)
    to_hub = [Transfer(r, hub, b, b, reduce=True) for r in others for b in range(world_size)]
    rounds = [to_hub, [Transfer(hub, r, r, r) for r in others]]
    return make_schedule(Collective.REDUCE_SCATTER, "star", world_size, rounds)


def _relay_phases(world: int, hub: int) -> list[list[Transfer]]:
    """Swap block j of rank i with block i of rank j, for every pair of non-hub ranks, through the hub.

    The hub has no spare buffer, so it parks its own blocks: in the first round of a phase, rank i swaps
    its block j with hub slot a (and j its block i with hub slot b); in the second, the hub delivers both
    and takes its parked blocks back. A phase moves (W - 1) // 2 pairs, each on two hub slots of its own.
    """
    others = _others(world, hub)
    pairs = [(i, j) for n, i in enumerate(others) for j in others[n + 1 :]]
    per_phase = max(1, len(others) // 2)
    rounds = []
    for start in range(0, len(pairs), per_phase):
        park, deliver = [], []
        for (i, j), a, b in zip(pairs[start : start + per_phase], others[0::2], others[1::2], strict=False):
            park += [
                Transfer(i, hub, j, a),
                Transfer(hub, i, a, j),
                Transfer(j, hub, i, b),
                Transfer(hub, j, b, i),
            ]
            deliver += [
                Transfer(hub, j, a, i),
                Transfer(j, hub, i, b),
                Transfer(hub, i, b, j),
                Transfer(i, hub, j, a),
            ]
        rounds += [park, deliver]
    return rounds


@register(Collective.ALL_TO_ALL, "star")
def star_all_to_all(
    world_size: int, *, root: int | None = None, pipeline: int = 1, local_size: int | None = None
) -> Schedule:
    """The hub swaps blocks with each rank directly, then relays every other pair (2 rounds a phase)."""
    hub = _hub(world_size, root)
    others = _others(world_size, hub)
    exchange = [Transfer(hub, r, r, hub) for r in others] + [Transfer(r, hub, hub, r) for r in others]
    rounds = [exchange, *_relay_phases(world_size, hub)]
    return make_schedule(Collective.ALL_TO_ALL, "star", world_size, rounds)
