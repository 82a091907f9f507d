"""The schedule IR: a collective algorithm as data.

A :class:`Schedule` is a list of rounds; a round is a set of :class:`Transfer` s that may all happen at
once. Every rank holds one flat *work buffer* cut into ``nchunks`` chunks: ``nblocks`` equal blocks (one, or
one per rank for the block collectives such as all-gather), each cut into ``chunks_per_block`` nearly equal
chunks. A transfer moves chunk ``src_chunk`` of rank ``src`` into chunk ``dst_chunk`` of rank ``dst`` and
either overwrites it (copy) or combines it with the reduction operator (reduce).

Semantics of a round (the checker, the runtime and the simulator all follow them): every transfer reads its
source as it stood at the start of the round, and all writes land at the end of the round. A chunk may take
several reduces in one round (the operator is commutative) but at most one copy, and never a copy and a
reduce together.

After msccl-tools: an algorithm is a short pure function that returns this data; nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

__all__ = [
    "Collective",
    "Transfer",
    "Schedule",
    "ScheduleError",
    "BLOCK_COLLECTIVES",
    "ROOTED_COLLECTIVES",
    "chunk_bounds",
    "make_schedule",
]


class Collective(StrEnum):
    """The collectives of ``dtrain.comm``; the value is the public function's name."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    GATHER = "gather"
    SCATTER = "scatter"
    ALL_TO_ALL = "all_to_all"
    SCAN = "scan"
    BARRIER = "barrier"


#: Collectives whose work buffer is one block per rank (rank-major), the rest use a single block.
BLOCK_COLLECTIVES = frozenset(
    {
        Collective.ALL_GATHER,
        Collective.REDUCE_SCATTER,
        Collective.GATHER,
        Collective.SCATTER,
        Collective.ALL_TO_ALL,
    }
)

#: Collectives with a root rank (``src`` or ``dst`` in the API).
ROOTED_COLLECTIVES = frozenset({Collective.BROADCAST, Collective.REDUCE, Collective.GATHER, Collective.SCATTER})


class ScheduleError(ValueError):
    """A schedule is malformed, or does not compute its collective."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """Move chunk ``src_chunk`` of rank ``src`` to chunk ``dst_chunk`` of rank ``dst``.

    ``reduce=False`` overwrites the destination chunk; ``reduce=True`` combines into it.
    """

    src: int
    dst: int
    src_chunk: int
    dst_chunk: int
    reduce: bool = False

    def __str__(self) -> str:
        kind = "+=" if self.reduce else "<-"
        return f"r{self.dst}[{self.dst_chunk}] {kind} r{self.src}[{self.src_chunk}]"


@dataclass(frozen=True)
class Schedule:
    """A collective algorithm for ``world_size`` ranks, as rounds of transfers.

    ``root`` is the source (broadcast, scatter) or destination (reduce, gather) rank, else ``None``.
    """

    collective: Collective
    algorithm: str
    world_size: int
    rounds: tuple[tuple[Transfer, ...], ...]
    nblocks: int = 1
    chunks_per_block: int = 1
    root: int | None = None
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ScheduleError(f"world_size must be >= 1, got {self.world_size}")
        if self.nblocks < 1 or self.chunks_per_block < 1:
            raise ScheduleError(
                f"nblocks and chunks_per_block must be >= 1, got {self.nblocks} and {self.chunks_per_block}"
            )
        expected_blocks = self.world_size if self.collective in BLOCK_COLLECTIVES else 1
        if self.nblocks != expected_blocks:
            raise ScheduleError(
                f"{self.collective.value} needs nblocks={expected_blocks} for world {self.world_size}, "
                f"got {self.nblocks}"
            )
        if (self.collective in ROOTED_COLLECTIVES) != (self.root is not None):
            raise ScheduleError(f"{self.collective.value}: root is {self.root!r}")
        if self.root is not None and not 0 <= self.root < self.world_size:
            raise ScheduleError(f"root {self.root} is outside world of size {self.world_size}")

    def __hash__(self) -> int:
        # Hashed on every runtime call (plan cache): compute once, the schedule is immutable.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(
                (
                    self.collective,
                    self.algorithm,
                    self.world_size,
                    self.rounds,
                    self.nblocks,
                    self.chunks_per_block,
                    self.root,
                )
            )
            object.__setattr__(self, "_hash", cached)
        return cached

    @cached_property
    def reduces(self) -> bool:
        """Whether any transfer reduces (so the runtime has reductions to overlap)."""
        return any(t.reduce for t in self.transfers())

    @property
    def nchunks(self) -> int:
        return self.nblocks * self.chunks_per_block

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    def transfers(self) -> Iterable[Transfer]:
        for round_ in self.rounds:
            yield from round_

    def describe(self) -> str:
        """A human-readable listing, one round a line."""
        head = f"{self.collective.value}/{self.algorithm} world={self.world_size} chunks={self.nchunks}"
        if self.root is not None:
            head += f" root={self.root}"
        lines = [head]
        for i, round_ in enumerate(self.rounds):
            lines.append(f"  round {i}: " + ", ".join(str(t) for t in round_))
        return "\n".join(lines)


def chunk_bounds(numel: int, nblocks: int, chunks_per_block: int) -> list[tuple[int, int]]:
    """(offset, length) of every chunk of a ``numel``-element buffer, in chunk order.

    The buffer is ``nblocks`` equal blocks (``numel`` must divide evenly), each cut into
    ``chunks_per_block`` pieces whose lengths differ by at most one; pieces may be empty.
    """
    if numel % nblocks:
        raise ValueError(f"a buffer of {numel} elements does not split into {nblocks} equal blocks")
    block = numel // nblocks
    base, extra = divmod(block, chunks_per_block)
    bounds = []
    for b in range(nblocks):
        offset = b * block
        for i in range(chunks_per_block):
            length = base + (1 if i < extra else 0)
            bounds.append((offset, length))
            offset += length
    return bounds


def make_schedule(
    collective: Collective,
    algorithm: str,
    world_size: int,
    rounds: Sequence[Sequence[Transfer]],
    *,
    chunks_per_block: int = 1,
    root: int | None = None,
    notes: str = "",
) -> Schedule:
    """Build a Schedule, dropping empty rounds and choosing ``nblocks`` from the collective."""
    nblocks = world_size if collective in BLOCK_COLLECTIVES else 1
    frozen = tuple(tuple(r) for r in rounds if r)
    return Schedule(
        collective=collective,
        algorithm=algorithm,
        world_size=world_size,
        rounds=frozen,
        nblocks=nblocks,
        chunks_per_block=chunks_per_block,
        root=root,
        notes=notes,
    )
