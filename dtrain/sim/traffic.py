"""Where each parallel strategy talks to the network, simulated: one step's kinds of traffic, each replayed as
the ``dtrain.comm`` schedules :mod:`dtrain.parallel` would run, every group of a kind at once.

As picotron keeps each strategy's communication in a ``*_communications`` file, this module is the simulator's
side of :mod:`dtrain.parallel.tensor_parallel_communications` (an all-reduce of the activation ``b s h`` in
every tensor-parallel group), :mod:`dtrain.parallel.pipeline_parallel_communications` (one activation from
stage to stage, between ranks of equal ``tp_rank``) and the data-parallel gradient exchange
(:mod:`dtrain.parallel.data_parallel_communications`, :mod:`dtrain.parallel.zero`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dtrain.cluster.topology import Topology, collector_paused
from dtrain.comm.ir.algorithms import build as build_schedule
from dtrain.comm.ir.algorithms import needs_local_size
from dtrain.comm.ir.schedule import Collective, Schedule, Transfer, make_schedule
from dtrain.sim.classes import DEFAULT_FLOW_LIMIT, replay_jobs
from dtrain.sim.collective import CollectiveResult, Job, SoftwareCost
from dtrain.sim.model import Layout, ModelSpec
from dtrain.sim.placement import grid_rank, group

__all__ = ["Traffic", "Cache", "ZERO_PHASES", "NCCL_RING", "dp_phase_bytes", "nccl_rings", "simulate_traffic"]

#: The data-parallel collectives of a step by ZeRO stage, as dtrain.parallel.zero runs them (stage 1 all-reduces
#: and all-gathers the updated shards; stage 2 reduce-scatters instead); stage 3 (dtrain.parallel.fsdp) adds the
#: ZeRO paper's second all-gather of the weights (forward and backward).
ZERO_PHASES = {
    0: (Collective.ALL_REDUCE,),
    1: (Collective.ALL_REDUCE, Collective.ALL_GATHER),
    2: (Collective.REDUCE_SCATTER, Collective.ALL_GATHER),
    3: (Collective.REDUCE_SCATTER, Collective.ALL_GATHER, Collective.ALL_GATHER),
}


def dp_phase_bytes(
    model: ModelSpec, layout: Layout, gradient_bytes: int | None = None, distributed_optimizer: bool = False
) -> list[tuple]:
    """Each data-parallel phase of a step (:data:`ZERO_PHASES`) as ``(collective, bytes a rank holds, item size)``:
    the gradient reduction (all-reduce or reduce-scatter) at ``gradient_bytes`` a value (default the model's
    ``bytes_per_value``; 4 where the optimizer keeps and reduces 32-bit gradients, as DeepSpeed's
    ``BF16_Optimizer`` does, ``get_grads_for_reduction``), the all-gathers of weights at ``bytes_per_value`` (1
    where the weights are kept in 8 bits, ``Layout.fp8_params``).
    ``distributed_optimizer``: ZeRO stage 1 reduce-scatters the gradients, each rank receiving only the shard its
    optimizer updates, as Megatron-Core's distributed optimizer does (``--use-distributed-optimizer``:
    ``megatron/core/distributed/param_and_grad_buffer.py`` reduce-scatters each bucket when the optimizer is
    distributed; Megatron-LM's "Distributed Optimizer" documentation), instead of all-reducing them."""
    item = model.bytes_per_value
    grad_item = gradient_bytes or item
    values = model.parameters / (layout.tp * layout.pp)
    out = []
    phases = ZERO_PHASES[layout.zero_stage]
    if distributed_optimizer and layout.zero_stage == 1:
        phases = ZERO_PHASES[2]
    for c in phases:
        size = (1 if layout.fp8_params else item) if c is Collective.ALL_GATHER else grad_item
        out.append((c, values * size, size))
    return out


@dataclass(frozen=True)
class Traffic:
    """One call of each kind, simulated: the tp all-reduce of one layer's activation (None without tp), the
    pp message of one micro-batch (None without pp), and the dp phases of the step. With split pipeline sends,
    ``pp`` is each tensor-parallel rank's ``1/tp`` of the activation and ``pp_gather`` the all-gather that
    rebuilds it on the receiving stage (None otherwise)."""

    tp: CollectiveResult | None
    pp: CollectiveResult | None
    dp: list[CollectiveResult]
    pp_gather: CollectiveResult | None = None


@functools.cache
def _p2p() -> Schedule:
    """One message from rank 0 to rank 1: a two-rank broadcast is exactly a point-to-point send (one object, so
    replays of its many pairs are recognised as identical)."""
    return make_schedule(Collective.BROADCAST, "p2p", 2, [[Transfer(0, 1, 0, 0)]], root=0)


#: NCCL's rings on a group that spans servers (:func:`nccl_rings`): the default data-parallel algorithm.
NCCL_RING = "nccl-ring"


def nccl_rings(ranks: Sequence[int], placement: Sequence[str], topo: Topology) -> list[tuple[list[int], list]]:
    """The rings (channels) NCCL runs a collective of the group ``ranks`` over, each as ``(ring order, relay)``:
    ``relay[i]`` the device through which the ``i``-th rank of the ring sends to the next (None: directly).

    A group with ``L >= 2`` ranks on each of two or more servers gets ``L`` rings, one entering each server at
    each of the group's GPUs there. Ring ``j`` visits every server in the group's order, on each its ranks from
    the ``j``-th on (rotated), and leaves a server from its last rank there through the server's ``j``-th GPU:
    NCCL's ring search sends a ring into and out of a node through one NIC (``NCCL_CROSS_NIC``, default 2: the
    same NIC where it can, ``src/graph/search.cc``), so on a rail-optimised fabric every hop between servers
    stays on one rail, the ``j``-th GPU's; the last GPU reaches that NIC over NVLink through the GPU beside it
    (PXN, NCCL 2.12 and later: NVIDIA, "Doubling all2all Performance with NVIDIA Collective Communication
    Library 2.12", 2022; ``NCCL_PXN_DISABLE``). The ``L`` rings share the data evenly and run at once, as NCCL's
    channels do (``NCCL_MIN_NCHANNELS``, ``NCCL_MAX_NCHANNELS``; the search puts channels on the NICs nearest
    the communicator's GPUs), so a server's ``L`` NICs all carry traffic. The ``j``-th GPU of each server is the
    group's ``j``-th rank on it, the same local GPU on every server under the ``aware`` and ``megatron``
    placements (:mod:`dtrain.sim.placement`).

    Otherwise (one server, one rank a server, or unequal counts) one ring in the group's order: with one GPU a
    server, GPU ``k`` of each, that ring is already on rail ``k``."""
    servers: dict[str, list[int]] = {}
    for r in ranks:
        servers.setdefault(topo.device(placement[r]).server, []).append(r)
    runs = list(servers.values())
    size = len(runs[0])
    if len(runs) < 2 or size < 2 or any(len(run) != size for run in runs):
        return [(list(ranks), [None] * len(ranks))]
    rings = []
    for j in range(size):
        order, relay = [], []
        for run in runs:
            order += [run[(j + i) % size] for i in range(size)]
            relay += [None] * (size - 1) + [placement[run[j]]]
        rings.append((order, relay))
    return rings


def _build(collective: Collective, algorithm: str, ranks: Sequence[int], placement: Sequence[str], topo: Topology):
    """The schedule of ``algorithm`` on the group ``ranks`` in their order (:data:`NCCL_RING`: the ring)."""
    if algorithm == NCCL_RING:
        algorithm = "ring"
    local = None
    if needs_local_size(algorithm):
        local = _local_size([topo.device(placement[r]).server for r in ranks])
    return build_schedule(collective, algorithm, len(ranks), local_size=local)


def _local_size(servers: list[str]) -> int:
    """Ranks per server of a group laid out server by server; ValueError if it is not evenly so."""
    run = next((i for i, s in enumerate(servers) if s != servers[0]), len(servers))
    runs = [servers[i : i + run] for i in range(0, len(servers), run)]
    if len(servers) % run or any(len(set(r)) != 1 for r in runs) or len({r[0] for r in runs}) != len(runs):
        raise ValueError(f"a hierarchical algorithm needs groups of equal runs of ranks per server, got {servers}")
    return run


def _padded(nbytes: float, itemsize: int, ranks: int) -> int:
    unit = itemsize * ranks
    return int(math.ceil(nbytes / unit)) * unit


def _groups(layout: Layout, axis: str) -> list[list[int]]:
    """Every group along ``axis``, each once, in the order of its first rank."""
    ranges = {"dp": range(1), "pp": range(layout.dp), "tp": range(layout.dp)}
    out = []
    for d in ranges[axis]:
        for p in range(1) if axis == "pp" else range(layout.pp):
            for t in range(1) if axis == "tp" else range(layout.tp):
                out.append(group(layout, axis, d, p, t))
    return sorted(out)


#: Replays already made, by (topology, jobs, software costs, item size): what a planner's layouts share.
Cache = dict[tuple, CollectiveResult]


def _replay(
    jobs: list[Job] | Callable[[], list[Job]],
    topo: Topology,
    cost: SoftwareCost,
    item: int,
    cache: Cache | None,
    flow_limit: int | None,
    shape: tuple | None = None,
) -> CollectiveResult:
    """``jobs`` (or what ``jobs()`` builds) replayed, through ``cache``: keyed by ``shape`` where the caller names
    what decides the jobs (the same shape, the same jobs: cheaper to hash than the jobs), else by the jobs."""
    if shape is not None and cache is not None:
        key = (id(topo), topo.nic_affinity, shape, cost, item, flow_limit)
        if key in cache:
            return cache[key]
    if callable(jobs):
        jobs = jobs()
    if cache is None:
        return replay_jobs(jobs, topo, cost=cost, itemsize=item, flow_limit=flow_limit)
    if shape is None:
        key = (id(topo), topo.nic_affinity, tuple(jobs), cost, item, flow_limit)
    if key not in cache:
        cache[key] = replay_jobs(jobs, topo, cost=cost, itemsize=item, flow_limit=flow_limit)
    return cache[key]


def _group_jobs(
    collective: Collective,
    algorithm: str,
    groups: list[list[int]],
    placement: Sequence[str],
    topo: Topology,
    nbytes: float,
    item: int,
) -> list[Job]:
    """One job of ``collective`` on ``nbytes`` in each group, its ranks on their devices of ``placement``; with
    :data:`NCCL_RING`, one job a ring of :func:`nccl_rings`, each on its share of the bytes."""
    if algorithm == NCCL_RING:
        jobs = []
        for g in groups:
            rings = nccl_rings(g, placement, topo)
            schedule = build_schedule(collective, "ring", len(g))
            share = _padded(nbytes / len(rings), item, len(g))
            for order, relay in rings:
                relays = tuple(relay) if any(relay) else None
                jobs.append(Job(schedule, share, tuple(placement[r] for r in order), relay=relays))
        return jobs
    return [
        Job(_build(collective, algorithm, g, placement, topo), _padded(nbytes, item, len(g)),
            tuple(placement[r] for r in g))
        for g in groups
    ]  # fmt: skip


def group_shape(layout: Layout, axis: str, placement: Sequence[str], *what) -> tuple:
    """What decides the jobs of every ``axis`` group of ``layout`` on ``placement`` (with ``what``: the
    collective, algorithm and bytes): a cache key for :func:`_replay`. Tensor-parallel groups are runs of ``tp``
    consecutive grid ranks whatever the other degrees."""
    dims = (layout.tp,) if axis == "tp" else (layout.dp, layout.tp, layout.pp)
    return (axis, *dims, tuple(placement), *what)


def simulate_traffic(
    model: ModelSpec,
    layout: Layout,
    topo: Topology,
    placement: Sequence[str],
    *,
    tp_algorithm: str = "ring",
    dp_algorithm: str = NCCL_RING,
    cost: SoftwareCost | None = None,
    cache: Cache | None = None,
    split_pipeline: bool = False,
    flow_limit: int | None = DEFAULT_FLOW_LIMIT,
    gradient_bytes: int | None = None,
    distributed_optimizer: bool = False,
) -> Traffic:
    """Each strategy's collective simulated once, every group of a kind at the same time on the network.

    ``tp_algorithm``, ``dp_algorithm``: a ``dtrain.comm`` algorithm of the tensor-parallel and data-parallel
    collectives (the pipeline's gather takes ``tp_algorithm``, the data-parallel phases ``dp_algorithm``), or
    :data:`NCCL_RING`, NCCL's channels of rail-aligned rings (:func:`nccl_rings`), the default of the
    data-parallel phases.

    ``cache`` (a dict the caller keeps) reuses replays between calls on the same, unchanged topology.
    ``split_pipeline``: each tensor-parallel rank sends ``1/tp`` of the activation to its peer of the next stage,
    which all-gathers it over its tensor-parallel group (Megatron-LM's scatter-gather optimisation, Narayanan et
    al. 2021, section 4.1); otherwise every tensor-parallel rank sends the whole activation. ``flow_limit``: see
    :func:`dtrain.sim.classes.replay_jobs` (None: every collective replayed message by message).
    ``gradient_bytes``: bytes a gradient value takes in the data-parallel reduction (the all-reduce or
    reduce-scatter of :data:`ZERO_PHASES`; default the model's ``bytes_per_value``), the all-gather of updated
    weights keeping the model's; see :func:`dp_phase_bytes`, which also says what ``distributed_optimizer``
    changes."""
    with collector_paused():
        return _simulate_traffic(model, layout, topo, tuple(placement), tp_algorithm, dp_algorithm,
                                 cost or SoftwareCost(), cache, split_pipeline, flow_limit, gradient_bytes,
                                 distributed_optimizer)  # fmt: skip


def _simulate_traffic(
    model, layout, topo, placement, tp_algorithm, dp_algorithm, cost, cache, split_pipeline, flow_limit,
    gradient_bytes, distributed_optimizer,
) -> Traffic:  # fmt: skip
    item = model.bytes_per_value
    activation = layout.micro_batch * model.sequence * model.hidden * item

    def run(collective: Collective, algorithm: str, axis: str, nbytes: float, groups=None, size=item):
        def jobs() -> list[Job]:
            ranks = groups() if groups is not None else _groups(layout, axis)
            return _group_jobs(collective, algorithm, ranks, placement, topo, nbytes, size)

        shape = group_shape(layout, axis, placement, collective, algorithm, nbytes)
        return _replay(jobs, topo, cost, size, cache, flow_limit, shape)

    tp = run(Collective.ALL_REDUCE, tp_algorithm, "tp", activation) if layout.tp > 1 else None
    pp = pp_gather = None
    if layout.pp > 1:
        split = split_pipeline and layout.tp > 1
        message = _padded(activation, item, layout.tp) // layout.tp if split else _padded(activation, item, 1)

        def sends() -> list[Job]:
            pairs = [
                (grid_rank(layout, d, p, t), grid_rank(layout, d, p + 1, t))
                for d in range(layout.dp) for p in range(layout.pp - 1) for t in range(layout.tp)
            ]  # fmt: skip
            return [Job(_p2p(), message, (placement[a], placement[b])) for a, b in pairs]

        pp = _replay(sends, topo, cost, item, cache, flow_limit, group_shape(layout, "pp", placement, message))
        if split:

            def receivers() -> list[list[int]]:
                return [group(layout, "tp", d, p, 0) for d in range(layout.dp) for p in range(1, layout.pp)]

            pp_gather = run(Collective.ALL_GATHER, tp_algorithm, "pp-gather", activation, receivers)
    dp: list[CollectiveResult] = []
    if layout.dp > 1:
        dp = [run(c, dp_algorithm, "dp", nbytes, size=size)
              for c, nbytes, size in dp_phase_bytes(model, layout, gradient_bytes, distributed_optimizer)]  # fmt: skip
    return Traffic(tp=tp, pp=pp, dp=dp, pp_gather=pp_gather)
