"""The symbolic checker: run a schedule on symbolic chunks and prove it computes its collective.

Each chunk of each rank holds a *term*: ``None`` (nothing defined yet) or a multiset of contributions
``(origin_rank, origin_chunk)``, kept as a sorted tuple. A copy replaces the term, a reduce adds the two
multisets, so a schedule that counts a contribution twice or misses one is caught, as is one that reads a
chunk before anything was written there. Barrier carries no data: its terms are sets (knowledge of who has
arrived), so overlap is harmless.

After msccl-tools' checker (a collective is a program over chunks, proved without processes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dtrain.comm.ir.schedule import Collective, Schedule, ScheduleError, Transfer

__all__ = ["check", "CheckReport", "initial_state", "expected_state"]

Term = tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class CheckReport:
    """What the checker learned about a schedule that passed."""

    collective: Collective
    algorithm: str
    world_size: int
    num_rounds: int
    num_transfers: int
    max_sends_per_rank_round: int


def _contribution(rank: int, chunk: int) -> Term:
    return ((rank, chunk),)


def _all_ranks(world: int, chunk: int) -> Term:
    return tuple((r, chunk) for r in range(world))


def initial_state(schedule: Schedule) -> list[list[Term]]:
    """The terms each rank's work buffer holds before the first round."""
    world, nchunks, k = schedule.world_size, schedule.nchunks, schedule.chunks_per_block
    coll, root = schedule.collective, schedule.root
    state: list[list[Term]] = [[None] * nchunks for _ in range(world)]
    for rank in range(world):
        for c in range(nchunks):
            if coll in (Collective.BROADCAST, Collective.SCATTER):
                defined = rank == root
            elif coll in (Collective.ALL_GATHER, Collective.GATHER):
                defined = c // k == rank
            else:
                defined = True
            if defined:
                state[rank][c] = _contribution(rank, c)
    return state


def expected_state(schedule: Schedule) -> list[list[Term | str]]:
    """The term every (rank, chunk) must hold at the end; ``"any"`` where the result does not matter."""
    world, nchunks, k = schedule.world_size, schedule.nchunks, schedule.chunks_per_block
    coll, root = schedule.collective, schedule.root
    want: list[list[Term | str]] = [["any"] * nchunks for _ in range(world)]
    for rank in range(world):
        for c in range(nchunks):
            block = c // k
            if coll in (Collective.ALL_REDUCE, Collective.BARRIER) or coll == Collective.REDUCE and rank == root:
                want[rank][c] = _all_ranks(world, c)
            elif coll == Collective.BROADCAST:
                want[rank][c] = _contribution(root, c)
            elif coll == Collective.ALL_GATHER or (coll == Collective.GATHER and rank == root):
                want[rank][c] = _contribution(block, c)
            elif coll == Collective.REDUCE_SCATTER and block == rank:
                want[rank][c] = _all_ranks(world, c)
            elif coll == Collective.SCATTER and block == rank:
                want[rank][c] = _contribution(root, c)
            elif coll == Collective.ALL_TO_ALL:
                want[rank][c] = _contribution(block, rank * k + c % k)
            elif coll == Collective.SCAN:
                want[rank][c] = tuple((r, c) for r in range(rank + 1))
    return want


def _combine(a: Term, b: Term, as_set: bool) -> Term:
    if as_set:
        return tuple(sorted(set(a) | set(b)))
    return tuple(sorted(a + b))


def _validate(t: Transfer, schedule: Schedule, where: str) -> None:
    world, nchunks = schedule.world_size, schedule.nchunks
    if not (0 <= t.src < world and 0 <= t.dst < world):
        raise ScheduleError(f"{where}: {t} names a rank outside world of size {world}")
    if t.src == t.dst:
        raise ScheduleError(f"{where}: {t} sends to itself")
    if not (0 <= t.src_chunk < nchunks and 0 <= t.dst_chunk < nchunks):
        raise ScheduleError(f"{where}: {t} names a chunk outside 0..{nchunks - 1}")


def _run_round(state: list[list[Term]], schedule: Schedule, index: int) -> None:
    as_set = schedule.collective == Collective.BARRIER
    writes: dict[tuple[int, int], list[tuple[bool, Term]]] = {}
    for t in schedule.rounds[index]:
        where = f"{schedule.collective.value}/{schedule.algorithm} round {index}"
        _validate(t, schedule, where)
        value = state[t.src][t.src_chunk]
        if value is None:
            raise ScheduleError(f"{where}: {t} reads a chunk that holds nothing yet")
        writes.setdefault((t.dst, t.dst_chunk), []).append((t.reduce, value))
    for (rank, chunk), incoming in writes.items():
        copies = [v for is_reduce, v in incoming if not is_reduce]
        if copies and len(incoming) > 1:
            raise ScheduleError(
                f"{schedule.collective.value}/{schedule.algorithm} round {index}: chunk {chunk} of rank "
                f"{rank} takes a copy together with {len(incoming) - 1} other write(s)"
            )
        if copies:
            state[rank][chunk] = copies[0]
            continue
        current = state[rank][chunk]
        if current is None:
            raise ScheduleError(
                f"{schedule.collective.value}/{schedule.algorithm} round {index}: reduce into chunk "
                f"{chunk} of rank {rank}, which holds nothing yet"
            )
        for _, value in incoming:
            current = _combine(current, value, as_set)
        state[rank][chunk] = current


def check(schedule: Schedule) -> CheckReport:
    """Execute ``schedule`` symbolically; raise :class:`ScheduleError` unless it computes its collective."""
    state = initial_state(schedule)
    for index in range(schedule.num_rounds):
        _run_round(state, schedule, index)
    want = expected_state(schedule)
    for rank in range(schedule.world_size):
        for chunk in range(schedule.nchunks):
            goal, got = want[rank][chunk], state[rank][chunk]
            if goal != "any" and goal != got:
                raise ScheduleError(
                    f"{schedule.collective.value}/{schedule.algorithm} world={schedule.world_size}: rank "
                    f"{rank} chunk {chunk} ends with {_show(got)}, expected {_show(goal)}"
                )
    per_rank_round = Counter((i, t.src) for i, r in enumerate(schedule.rounds) for t in r)
    return CheckReport(
        collective=schedule.collective,
        algorithm=schedule.algorithm,
        world_size=schedule.world_size,
        num_rounds=schedule.num_rounds,
        num_transfers=sum(len(r) for r in schedule.rounds),
        max_sends_per_rank_round=max(per_rank_round.values(), default=0),
    )


def _show(term: Term | str) -> str:
    if term is None or isinstance(term, str):
        return str(term)
    counts = Counter(term)
    return "{" + ", ".join(f"r{r}c{c}" + (f"x{n}" if n > 1 else "") for (r, c), n in sorted(counts.items())) + "}"
