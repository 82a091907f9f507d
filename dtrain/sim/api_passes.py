"""The public API's own work around a schedule: the torch operations :mod:`dtrain.comm.api` runs on a rank's
device before the schedule starts and after it ends.

A collective call is more than its schedule. The API lays the caller's tensors out as the schedule's flat work
buffer and copies the result back where it belongs, and each of those steps is one torch operation: a launch
on the host and one pass over local memory on the device. They run on every transport, and eagerly when only
the schedule is replayed from a CUDA graph (:mod:`dtrain.comm.peer.graphs`). Per collective, as
``dtrain/comm/api.py`` has it (``n``: the work buffer's bytes, ``n / world``: one rank's block):

| collective | before the schedule | after it |
| --- | --- | --- |
| all-reduce, broadcast, scan | (the caller's tensor is the work buffer) | ``avg``: divide ``n`` (all-reduce, scan) |
| reduce | other ranks than ``dst``: clone ``n`` (keep the caller's tensor) | ``dst``, ``avg``: divide ``n`` |
| all-gather, gather | copy the input's ``n / world`` into the work buffer | |
| reduce-scatter | clone ``n`` (the input is left intact) | ``avg``: divide ``n / world``; copy ``n / world`` out |
| reduce-scatter, out of place | (the push form reads the input, writes the output) | ``avg``: divide ``n / world`` |
| scatter | ``src``: clone ``n`` | copy ``n / world`` out |
| all-to-all | clone ``n`` | copy ``n`` out |
| barrier | fill a one-element token | (a stream synchronisation, no pass) |

"Out of place" is the peer transport's push form where the plan stores only into the rank's own block
(``api._out_of_place``). Where the table says clone, a CUDA call copies into a work buffer the API keeps for
the next call of that group, size and dtype (``api._scratch``, so that the call replays): the same pass and
launch.
The table is for contiguous tensors, as training and ``dtrain bench comm`` pass them; a tensor that is not
contiguous adds a copy into a contiguous buffer (and, for one that receives the result, a copy back), which is
not priced. Allocations (``torch.empty``) launch nothing and are not listed.
``tests/sim/test_sim_api_passes.py`` runs the API's functions on CPU tensors under a recording dispatch mode, with
the schedule stubbed out, and checks this table against the operations they really make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.comm.ir.schedule import Collective, Schedule

__all__ = ["Pass", "RankPasses", "rank_passes", "api_passes"]

PassKind = Literal["clone", "copy", "div", "fill"]


@dataclass(frozen=True)
class Pass:
    """One torch operation of the API on a rank's device, writing ``nbytes`` (a launch and a local pass)."""

    kind: PassKind
    nbytes: int


@dataclass(frozen=True)
class RankPasses:
    """A rank's API operations ``before`` its schedule runs and ``after`` it, in order."""

    before: tuple[Pass, ...] = ()
    after: tuple[Pass, ...] = ()

    @property
    def launches(self) -> int:
        return len(self.before) + len(self.after)

    @property
    def before_bytes(self) -> int:
        return sum(p.nbytes for p in self.before)

    @property
    def after_bytes(self) -> int:
        return sum(p.nbytes for p in self.after)


def rank_passes(
    collective: Collective,
    nbytes: int,
    world: int,
    rank: int,
    *,
    root: int | None = None,
    op: str = "sum",
    out_of_place: bool = False,
) -> RankPasses:
    """Rank ``rank``'s API operations for a call of ``collective`` on a ``nbytes`` work buffer of contiguous
    tensors (the module's table). ``root``: the rooted collectives' ``src`` or ``dst``; ``op``: the reduction
    ("avg" adds a division); ``out_of_place``: a reduce-scatter run without a copy of its input."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a group of {world} ranks")
    block = nbytes // world
    is_root = rank == root
    divide = (Pass("div", nbytes),) if op == "avg" else ()
    if collective in (Collective.ALL_REDUCE, Collective.SCAN):  # the caller's tensor is the work buffer
        return RankPasses(after=divide)
    if collective == Collective.BROADCAST:
        return RankPasses()
    if collective == Collective.REDUCE:  # other ranks' partial sums pass through a clone of the caller's tensor
        return RankPasses(after=divide) if is_root else RankPasses(before=(Pass("clone", nbytes),))
    if collective in (Collective.ALL_GATHER, Collective.GATHER):  # own input into its block of the work buffer
        return RankPasses(before=(Pass("copy", block),))
    if collective == Collective.REDUCE_SCATTER:
        mine = (Pass("div", block),) if op == "avg" else ()
        if out_of_place:
            return RankPasses(after=mine)
        return RankPasses(before=(Pass("clone", nbytes),), after=(*mine, Pass("copy", block)))
    if collective == Collective.SCATTER:
        return RankPasses(before=(Pass("clone", nbytes),) if is_root else (), after=(Pass("copy", block),))
    if collective == Collective.ALL_TO_ALL:
        return RankPasses(before=(Pass("clone", nbytes),), after=(Pass("copy", nbytes),))
    if collective == Collective.BARRIER:
        return RankPasses(before=(Pass("fill", 4),))
    raise ValueError(f"no API passes known for collective {collective!r}")


def api_passes(
    schedule: Schedule, nbytes: int, *, op: str = "sum", out_of_place: bool = False
) -> tuple[RankPasses, ...]:
    """Every rank's API operations for a call that runs ``schedule`` on a ``nbytes`` work buffer."""
    world = schedule.world_size
    return tuple(
        rank_passes(schedule.collective, nbytes, world, r, root=schedule.root, op=op, out_of_place=out_of_place)
        for r in range(world)
    )
