"""One call for the common question: how long does this collective take on this cluster, and where does it
wait? Builds the schedule the runtime would run (root 0 for rooted collectives; for hierarchical algorithms
the node size read off the placement) and replays it (:mod:`dtrain.sim.collective`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dtrain.cluster.topology import Topology
from dtrain.comm.ir.algorithms import build, names, needs_local_size
from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Collective
from dtrain.sim.collective import CollectiveResult, SoftwareCost, replay
from dtrain.sim.nccl import NcclParams, simulate_nccl

__all__ = ["simulate_collective", "algorithms_for", "software_cost_from_calibration", "ranks_per_server"]


def ranks_per_server(topology: Topology, placement: Sequence[str]) -> int:
    """Ranks on the first rank's server: the node size a hierarchical algorithm is built for."""
    first = topology.device(placement[0]).server
    return sum(topology.device(d).server == first for d in placement)


def algorithms_for(collective: str | Collective) -> list[str]:
    """Every dtrain algorithm registered for ``collective``."""
    return names(Collective(collective))


def simulate_collective(
    topology: Topology,
    collective: str | Collective,
    algorithm: str,
    nbytes: int,
    *,
    placement: Sequence[str] | None = None,
    cost: SoftwareCost | None = None,
    itemsize: int = 1,
    pipeline: int = 1,
    local_size: int | None = None,
    nccl: NcclParams | None = None,
) -> CollectiveResult:
    """Replay ``algorithm`` for ``collective`` on a work buffer of ``nbytes`` (rounded up to whole blocks),
    rank ``i`` on ``placement[i]`` (default: every device of ``topology``, in order). ``algorithm="native"``
    is NCCL's own kernel (:mod:`dtrain.sim.nccl`, with ``nccl``'s figures), not a dtrain schedule."""
    collective = Collective(collective)
    placement = list(placement) if placement is not None else [d.name for d in topology.devices()]
    if not placement:
        raise ValueError(f"topology {topology.name!r} has no device to place a rank on")
    if algorithm == "native":
        result = simulate_nccl(topology, collective.value, nbytes, placement, params=nccl)
        return CollectiveResult(time_s=result.time_s, rank_finish_s=[result.time_s] * len(placement),
                                links=result.links)  # fmt: skip
    if needs_local_size(algorithm) and local_size is None:
        local_size = ranks_per_server(topology, placement)
    root = 0 if collective in ROOTED_COLLECTIVES else None
    schedule = build(collective, algorithm, len(placement), root=root, pipeline=pipeline, local_size=local_size)
    unit = schedule.nblocks * itemsize
    padded = -(-nbytes // unit) * unit
    return replay(schedule, padded, topology, placement, cost=cost, itemsize=itemsize)


def software_cost_from_calibration(path: str | Path) -> SoftwareCost:
    """The software costs of a ``dtrain bench calibrate`` file (its intra-node link): ``alpha``, ``alpha_peer``
    and ``gamma``; its bandwidths describe links, which the topology holds."""
    from dtrain.comm.cost.model import CostParams

    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        link = CostParams.from_dict(data).intra
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = "no such file" if isinstance(err, FileNotFoundError) else str(err).splitlines()[0]
        raise ValueError(f"--calibration {path}: not a dtrain calibration file ({reason})") from None
    return SoftwareCost(alpha_s=link.alpha_s, alpha_peer_s=link.alpha_peer_s, gamma_s_per_byte=link.gamma_s_per_byte)
