"""Rank placements for a ``dp x pp x tp`` layout: which device each grid rank runs on.

Grid ranks follow :class:`dtrain.parallel.grid.ParallelDims`' default order ``tp-pp-dp``: ``((dp_rank * pp) +
pp_rank) * tp + tp_rank``, tensor parallel innermost. Three placements:

- ``aware``: consecutive grid ranks on consecutive devices of :meth:`Topology.devices` (server by server), so a
  tensor-parallel group shares a server's NVLink, pipeline neighbours come next and data-parallel replicas span
  servers and racks: ``dtrain train``'s default rank order (``tp-pp-dp``) under torchrun, which numbers a node's
  processes consecutively.
- ``megatron``: devices taken in Megatron-LM's and DeepSpeed's rank order, tensor parallel innermost, then data,
  then pipeline (Megatron-LM ``parallel_state.initialize_model_parallel``, whose pipeline groups are every
  ``world / pp``-th rank; DeepSpeed ``PipeModelDataParallelTopology``, axes ``pipe, data, model``). A server then
  holds replicas of one stage rather than stages of one replica (with tensor parallelism below a server's
  width), a stage's data-parallel group occupies consecutive servers, and, where a stage fills whole servers,
  every pipeline message crosses the network.
- ``oblivious``: the ranks dealt round-robin over the servers, as a scheduler that knows nothing of the job
  would, so neighbours in every group land on different servers.

Narayanan et al. 2021, section 3.2, keep tensor parallelism within a server, as the first two do.

With context parallelism (``Layout.cp``) the data-parallel axis holds ``dp x cp`` ranks, replica ``d``'s
context-parallel rank ``c`` at ``d cp + c`` (:func:`dtrain.sim.model.context_view`): Megatron-Core's order,
tensor, context, data, pipeline, so that under ``megatron`` a context-parallel group takes the next ``cp x tp``
devices, one server's NVLink where they fit.
"""

from __future__ import annotations

from dtrain.cluster.topology import Topology
from dtrain.sim.model import Layout

__all__ = ["PLACEMENTS", "place", "grid_rank", "group"]

PLACEMENTS = ("aware", "megatron", "oblivious")


def grid_rank(layout: Layout, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
    """The grid rank at these coordinates (``ParallelDims.rank``'s default order, ``tp-pp-dp``)."""
    return (dp_rank * layout.pp + pp_rank) * layout.tp + tp_rank


def group(layout: Layout, axis: str, dp_rank: int, pp_rank: int, tp_rank: int) -> list[int]:
    """Grid ranks sharing every coordinate but ``axis`` ("dp", "pp" or "tp"), in axis order ("dp": the ``dp x
    cp`` ranks that reduce a gradient together)."""
    if axis == "dp":
        return [grid_rank(layout, d, pp_rank, tp_rank) for d in range(layout.dp * layout.cp)]
    if axis == "pp":
        return [grid_rank(layout, dp_rank, p, tp_rank) for p in range(layout.pp)]
    if axis == "tp":
        return [grid_rank(layout, dp_rank, pp_rank, t) for t in range(layout.tp)]
    raise ValueError(f"axis must be 'dp', 'pp' or 'tp', got {axis!r}")


def place(topology: Topology, layout: Layout, how: str = "aware") -> list[str]:
    """The device of each grid rank under placement ``how`` ("aware", "megatron" or "oblivious")."""
    devices = topology.devices()
    if layout.world_size > len(devices):
        raise ValueError(
            f"layout {layout.describe()} needs {layout.world_size} devices; topology {topology.name!r} has "
            f"{len(devices)}"
        )
    if how == "aware":
        return [d.name for d in devices[: layout.world_size]]
    if how == "megatron":
        names = [d.name for d in devices]
        data = layout.dp * layout.cp
        return [
            names[(p * data + d) * layout.tp + t]
            for d in range(data)
            for p in range(layout.pp)
            for t in range(layout.tp)
        ]
    if how == "oblivious":
        by_server: dict[str, list[str]] = {}
        for d in devices:
            by_server.setdefault(d.server, []).append(d.name)
        dealt = [name for row in _interleave(list(by_server.values())) for name in row]
        return dealt[: layout.world_size]
    raise ValueError(f"unknown placement {how!r}; known: {', '.join(PLACEMENTS)}")


def _interleave(columns: list[list[str]]) -> list[list[str]]:
    """Rows of one device from each server in turn: server 0's first, server 1's first, ..."""
    depth = max(len(c) for c in columns)
    return [[c[i] for c in columns if i < len(c)] for i in range(depth)]
