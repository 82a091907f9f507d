"""The rank grid: ``dp x pp x tp`` over a world of ranks, validated once, holding every group a rank is in.

Tensor parallelism is innermost: a tensor-parallel group is ``tp`` consecutive ranks, on one server, where its
collective in every layer runs over the fastest links. The next two axes come in one of two orders
(``ParallelDims.order``, ``[parallel] rank_order``):

- ``tp-pp-dp`` (the default): pipeline next, data outermost, global rank ``((dp_rank * pp) + pp_rank) * tp +
  tp_rank``. A replica's stages are neighbours, so pipeline messages between them may stay inside a server,
  and each data-parallel group spans the servers.
- ``tp-dp-pp``: data next, pipeline outermost, global rank ``((pp_rank * dp) + dp_rank) * tp + tp_rank``, the
  order of Megatron-LM (``initialize_model_parallel``), DeepSpeed (``PipeModelDataParallelTopology``) and
  torchtitan (its device mesh ``pp, dp, tp``). A stage's replicas are neighbours: with ``tp`` below a server's
  width, part of each gradient reduction stays inside a server and, where a stage fills whole servers, every pipeline
  message crosses servers.

``dtrain simulate train --placement aware`` and ``--placement megatron`` price the two. A :class:`RankGrid` is
built once and passed to each strategy: there are no process-group globals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["RANK_ORDERS", "ParallelDims", "RankGrid"]

#: the grid's rank orders, innermost axis first
RANK_ORDERS = ("tp-pp-dp", "tp-dp-pp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of data (``dp``), pipeline (``pp``) and tensor (``tp``) parallelism over ``world_size`` ranks, laid
    out in rank order ``order`` (one of :data:`RANK_ORDERS`, innermost first)."""

    world_size: int
    dp: int = 1
    pp: int = 1
    tp: int = 1
    order: str = RANK_ORDERS[0]

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "pp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.order not in RANK_ORDERS:
            raise ValueError(f"order must be one of {', '.join(RANK_ORDERS)}, got {self.order!r}")
        if self.dp * self.pp * self.tp != self.world_size:
            raise ValueError(
                f"dp x pp x tp = {self.dp} x {self.pp} x {self.tp} = {self.dp * self.pp * self.tp}, "
                f"but the world has {self.world_size} ranks; the degrees must multiply to the world size"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of grid rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid of {self.world_size} ranks")
        rest, tp_rank = divmod(rank, self.tp)
        if self.order == "tp-dp-pp":
            pp_rank, dp_rank = divmod(rest, self.dp)
        else:
            dp_rank, pp_rank = divmod(rest, self.pp)
        return dp_rank, pp_rank, tp_rank

    def rank(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """Grid rank at the given coordinates."""
        if self.order == "tp-dp-pp":
            return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """Grid ranks that share every coordinate of ``rank`` but ``axis`` ("dp", "pp" or "tp"), in axis order."""
        dp_rank, pp_rank, tp_rank = self.coords(rank)
        if axis == "dp":
            return [self.rank(d, pp_rank, tp_rank) for d in range(self.dp)]
        if axis == "pp":
            return [self.rank(dp_rank, p, tp_rank) for p in range(self.pp)]
        if axis == "tp":
            return [self.rank(dp_rank, pp_rank, t) for t in range(self.tp)]
        raise ValueError(f"axis must be 'dp', 'pp' or 'tp', got {axis!r}")


@dataclass
class RankGrid:
    """This rank's place in the grid and the process groups of its three axes.

    ``base_ranks`` are the global ranks that make up the grid's world (all of them by default), so a grid
    can live on part of the world. Build it with :meth:`build` on every process.
    """

    dims: ParallelDims
    rank: int  # grid rank of this process
    base_ranks: tuple[int, ...]
    dp_group: object = field(repr=False)
    pp_group: object = field(repr=False)
    tp_group: object = field(repr=False)
    #: the pipeline group's ranks again, for gradients: on NCCL each direction between two stages then has its
    #: own communicator and stream (see dtrain.parallel.pipeline_parallel_communications)
    pp_grad_group: object = field(default=None, repr=False)

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(self.rank)[2]

    def global_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's ``axis`` group, in axis order."""
        return [self.base_ranks[r] for r in self.dims.group_ranks(axis, self.rank)]

    @classmethod
    def build(cls, dims: ParallelDims, base_ranks: Sequence[int] | None = None) -> RankGrid | None:
        """Create every dp, pp and tp group of the grid; returns this rank's grid, or None off the grid.

        Every process of the default group must call it with the same arguments (torch.distributed creates a
        group with all processes taking part), including processes that are not among ``base_ranks``.
        """
        if not dist.is_initialized():
            raise ValueError("RankGrid.build: torch.distributed is not initialized")
        base = tuple(base_ranks) if base_ranks is not None else tuple(range(dist.get_world_size()))
        if len(base) != dims.world_size:
            raise ValueError(f"the grid has {dims.world_size} ranks but {len(base)} base ranks were given")
        me = dist.get_rank()
        mine: dict[str, object] = {}
        for axis in ("dp", "pp", "tp", "pp_grad"):
            for members in _axis_groups(dims, axis.removesuffix("_grad")):
                group = dist.new_group([base[r] for r in members])
                if me in (base[r] for r in members):
                    mine[axis] = group
        if me not in base:
            return None
        return cls(
            dims=dims,
            rank=base.index(me),
            base_ranks=base,
            dp_group=mine["dp"],
            pp_group=mine["pp"],
            tp_group=mine["tp"],
            pp_grad_group=mine["pp_grad"],
        )


def _axis_groups(dims: ParallelDims, axis: str) -> list[list[int]]:
    """Every group of ``axis``, each as its grid ranks, in a fixed order (the same on every process)."""
    seen: dict[tuple[int, ...], None] = {}
    for rank in range(dims.world_size):
        seen.setdefault(tuple(dims.group_ranks(axis, rank)), None)
    return [list(g) for g in seen]
