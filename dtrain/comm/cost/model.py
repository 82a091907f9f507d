"""The alpha-beta-gamma cost model of collective algorithms.

A message of ``n`` bytes between two ranks costs ``alpha + n * beta`` seconds, and reducing ``n`` bytes into a
buffer costs ``n * gamma`` (Hockney's model with a compute term, as used by Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1), 2005, section 2). Two ways to
price an algorithm:

- :func:`predict`: the closed form of each registered (collective, algorithm), in the paper's notation;
- :func:`predict_schedule`: any :class:`Schedule` priced round by round (so a new or searched algorithm is
  priced without anyone writing its formula).

Choices the closed forms and the round pricing share (so that they agree exactly where the paper's model is
the same):

- ``nbytes`` is the rank's whole work buffer: the tensor for all-reduce, broadcast, reduce and scan; all W
  blocks for all-gather (output), reduce-scatter, gather, scatter and all-to-all (input).
- Within a round a rank's messages to one peer are packed into one. The runtime posts all of a round's
  messages at once (one NCCL group; every Gloo request together), so a rank that talks to ``k`` peers in a
  round pays ``alpha + (k - 1) alpha_peer`` of start-up: the first message's full start-up, then
  ``alpha_peer`` for each further peer (``k`` is the larger of the peers it sends to and receives from). With
  ``alpha_peer = alpha`` this is the paper's single-port model, where start-ups serialize at the rank (its
  pairwise-exchange all-to-all costs ``(p-1) alpha``); a smaller ``alpha_peer`` generalises it to a
  multi-port one in which posted messages overlap, as in the LogGP model's gap per message (Alexandrov et
  al., SPAA 1995) and the k-port models of collective algorithms (Bruck et al., IEEE TPDS 8(11), 1997).
- Bandwidth is limited twice, as in that multi-port model with per-link and injection limits: per rank,
  ``beta`` on the most bytes one rank sends or receives to and from all its peers together (links are full
  duplex; the injection bandwidth), and per pair, ``beta_peer`` on the most bytes between one pair of ranks in
  one direction (the per-link bandwidth). A round's wire time is the larger, ``max(beta * rank bytes,
  beta_peer * pair bytes)``: ``max(beta, beta_peer) * m`` when each rank talks to one peer, and for a direct
  round of ``q`` messages of ``m`` bytes ``max(beta q m, beta_peer m)``, so a rank reaches its total bandwidth
  only by talking to several peers at once. ``beta_peer = None`` is no per-pair limit beyond ``beta`` (one
  pair's bytes never exceed the rank's, so the term is ``beta * rank bytes``). The round takes as long as
  its slowest rank.
- With ``local_size`` (ranks per node), a message between nodes is priced with ``params.inter``; a round
  that mixes both kinds of message takes the longer of the two, and a reduction is priced with the gamma of
  the link its data came over. The closed forms of flat (not hierarchical) algorithms price every round at
  the inter-node link when there are several nodes: exact for the ring, whose every round crosses, and an
  upper bound for the others, whose early or late rounds may stay inside a node.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from dtrain.comm.cost.forms import CLOSED_FORMS, Form
from dtrain.comm.cost.params import CostParams, LinkCost
from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Collective, Schedule, chunk_bounds
from dtrain.env import comm_env

__all__ = [
    "LinkCost",
    "CostParams",
    "predict",
    "predict_schedule",
    "choose",
    "optimal_pipeline",
    "default_params",
    "params_path",
    "load_params",
    "save_params",
]


def _validate(world_size: int, nbytes: int, local_size: int | None) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    if local_size is not None and (local_size < 1 or world_size % local_size):
        raise ValueError(f"local_size {local_size} must be >= 1 and divide world_size {world_size}")


def predict(
    collective: Collective | str,
    algorithm: str,
    nbytes: int,
    world_size: int,
    params: CostParams,
    *,
    local_size: int | None = None,
    pipeline: int = 1,
) -> float:
    """Predicted seconds of ``algorithm`` for ``collective`` on a ``nbytes`` work buffer and ``world_size``
    ranks, from its closed form (see :mod:`dtrain.comm.cost.forms`).

    An algorithm with no closed form but a registered schedule is priced with :func:`predict_schedule`.
    ``pipeline`` is the number of pieces the chain algorithms cut the message into.
    """
    collective = Collective(collective)
    _validate(world_size, nbytes, local_size)
    if pipeline < 1:
        raise ValueError(f"pipeline must be >= 1, got {pipeline}")
    form: Form | None = CLOSED_FORMS.get((collective, algorithm))
    if form is None:
        return _predict_from_schedule(collective, algorithm, nbytes, world_size, params, local_size, pipeline)
    if world_size == 1:
        return 0.0
    if form.needs_local_size and local_size is None:
        raise ValueError(f"{collective.value}/{algorithm} needs local_size (ranks per node)")
    if not form.needs_local_size and local_size is not None and local_size < world_size:
        # a flat algorithm knows nothing of nodes: price every round at the link between them
        params = CostParams(intra=params.inter_link)
    return form.seconds(float(nbytes), world_size, params, local_size or world_size, pipeline)


def _predict_from_schedule(
    collective: Collective,
    algorithm: str,
    nbytes: int,
    world_size: int,
    params: CostParams,
    local_size: int | None,
    pipeline: int,
) -> float:
    from dtrain.comm.ir import algorithms  # deferred: the registry imports every family

    if algorithm not in algorithms.names(collective):
        known = sorted({a for (c, a) in CLOSED_FORMS if c == collective} | set(algorithms.names(collective)))
        raise ValueError(f"no cost model for {collective.value}/{algorithm!r}; known: {', '.join(known)}")
    root = 0 if collective in ROOTED_COLLECTIVES else None
    schedule = algorithms.build(collective, algorithm, world_size, root=root, pipeline=pipeline, local_size=local_size)
    unit = schedule.nblocks  # round the buffer up to whole 1-byte elements per block
    padded = -(-nbytes // unit) * unit
    return predict_schedule(schedule, padded, params, local_size=local_size, itemsize=1)


def predict_schedule(
    schedule: Schedule,
    nbytes: int,
    params: CostParams,
    *,
    local_size: int | None = None,
    itemsize: int = 4,
) -> float:
    """Seconds to run ``schedule`` on a ``nbytes`` work buffer of ``itemsize``-byte elements, round by round.

    Chunk sizes come from :func:`chunk_bounds`, so they are the runtime's to the element. Each round costs,
    for each kind of link used, ``alpha + (k - 1) alpha_peer + max(beta * (most bytes one rank sends or
    receives, all peers together), beta_peer * (most bytes between one pair in one direction)) + gamma *
    (most bytes one rank reduces)``, ``k`` the most peers one rank sends to or receives from, and the round
    takes the longest kind. Empty messages are free (the runtime skips them) except in barrier, whose
    messages are all tokens.
    """
    _validate(schedule.world_size, nbytes, local_size)
    if itemsize < 1 or nbytes % itemsize:
        raise ValueError(f"nbytes {nbytes} is not a whole number of {itemsize}-byte elements")
    numel = nbytes // itemsize
    if numel % schedule.nblocks:
        raise ValueError(f"{numel} elements do not split into {schedule.nblocks} equal blocks")
    sizes = [length * itemsize for _, length in chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)]
    node_size = local_size or schedule.world_size
    tokens = schedule.collective == Collective.BARRIER
    return sum(_round_seconds(r, sizes, params, node_size, tokens) for r in schedule.rounds)


def _round_seconds(transfers, sizes: list[int], params: CostParams, node_size: int, tokens: bool) -> float:
    # per link kind (False: intra, True: inter): bytes per (src, dst) pair and reduced bytes per destination
    pairs: dict[bool, dict[tuple[int, int], int]] = {False: {}, True: {}}
    reduced: dict[bool, dict[int, int]] = {False: {}, True: {}}
    for t in transfers:
        nbytes = sizes[t.src_chunk]
        if nbytes == 0 and not tokens:
            continue
        inter = t.src // node_size != t.dst // node_size
        pairs[inter][(t.src, t.dst)] = pairs[inter].get((t.src, t.dst), 0) + nbytes
        if t.reduce:
            reduced[inter][t.dst] = reduced[inter].get(t.dst, 0) + nbytes
    seconds = 0.0
    for inter, link in ((False, params.intra), (True, params.inter_link)):
        if pairs[inter]:
            seconds = max(seconds, _kind_seconds(pairs[inter], reduced[inter], link))
    return seconds


def _kind_seconds(pairs: dict[tuple[int, int], int], reduced: dict[int, int], link: LinkCost) -> float:
    peers: dict[tuple[int, bool], int] = {}
    volume: dict[tuple[int, bool], int] = {}
    for (src, dst), nbytes in pairs.items():
        for key in ((src, True), (dst, False)):
            peers[key] = peers.get(key, 0) + 1
            volume[key] = volume.get(key, 0) + nbytes
    return (
        link.round_start_s(max(peers.values()))
        + link.wire_s(max(volume.values()), max(pairs.values()))
        + link.gamma_s_per_byte * max(reduced.values(), default=0)
    )


def _usable(algorithm: str, collective: Collective, world_size: int, local_size: int | None) -> bool:
    if algorithm in ("auto", "native"):
        return False
    form = CLOSED_FORMS.get((collective, algorithm))
    if form is not None and form.needs_local_size:
        return local_size is not None and 1 < local_size < world_size and world_size % local_size == 0
    return True


def choose(
    collective: Collective | str,
    nbytes: int,
    world_size: int,
    params: CostParams,
    *,
    candidates: Sequence[str],
    local_size: int | None = None,
    pipeline: int | None = None,
) -> str:
    """The candidate with the least predicted time; ties go to the earlier candidate.

    "auto" and "native" are skipped, and so are hierarchical algorithms unless ``local_size`` splits the world
    into several nodes of several ranks. ``pipeline=None`` prices each pipelined chain at
    :func:`optimal_pipeline`.
    """
    collective = Collective(collective)
    usable = [a for a in candidates if _usable(a, collective, world_size, local_size)]
    if not usable:
        raise ValueError(f"no candidate to choose from for {collective.value}: {list(candidates)!r}")
    times = [
        predict(
            collective,
            a,
            nbytes,
            world_size,
            params,
            local_size=local_size,
            pipeline=pipeline or _pipeline_for(collective, a, nbytes, world_size, params),
        )
        for a in usable
    ]
    return usable[times.index(min(times))]


def _pipeline_for(collective: Collective, algorithm: str, nbytes: int, world_size: int, params: CostParams) -> int:
    form = CLOSED_FORMS.get((collective, algorithm))
    return optimal_pipeline(nbytes, world_size, params.intra) if form is not None and form.pipelined else 1


def optimal_pipeline(nbytes: int, world_size: int, link: LinkCost, *, limit: int = 64) -> int:
    """Pieces that minimise the chain's ``(p + k - 2)(alpha + n/k beta)``: ``k* = sqrt((p-2) n beta / alpha)``
    (set the derivative in k to zero), clamped to ``[1, limit]``; 1 for two ranks or fewer. A chain's rounds
    have one peer each, so ``beta`` is the slower of the rank's and the pair's."""
    if world_size <= 2:
        return 1
    best = math.sqrt((world_size - 2) * nbytes * link.one_peer_s_per_byte / max(link.alpha_s, 1e-12))
    return max(1, min(limit, round(best)))


def default_params(device_type: str) -> CostParams:
    """Defaults until ``dtrain bench calibrate`` measures the machine (its file replaces them).

    "cpu": Gloo over loopback, about 50 us a message, 1.5 GB/s, reductions at 5 GB/s. "cuda": an NVLink node,
    rounded from ``dtrain bench calibrate`` on 4 H200s (benchmarks/results/): 90 us a round
    and 45 us more for each further peer in it (the host cost of an NCCL group), 330 GB/s out of a rank, 270 GB/s
    to one peer, reductions at 1.4 TB/s. The per-peer terms matter: without them the model cannot see that
    sending to every peer at once (``direct``) beats halving-doubling on such a node.
    """
    if device_type == "cpu":
        return CostParams(intra=LinkCost(alpha_s=50e-6, beta_s_per_byte=1 / 1.5e9, gamma_s_per_byte=1 / 5e9))
    if device_type == "cuda":
        nvlink = LinkCost(
            alpha_s=90e-6,
            beta_s_per_byte=1 / 330e9,
            gamma_s_per_byte=1 / 1.4e12,
            alpha_peer_s=45e-6,
            beta_peer_s_per_byte=1 / 270e9,
        )
        return CostParams(intra=nvlink)
    if device_type == "cuda-peer":
        # the peer-memory transport (dtrain.comm.peer.window) on 4 H200s (benchmarks/collectives/probe.py symm and
        # peer-host): a round is a device barrier and a kernel, ~15 us of host time to enqueue; one
        # peer is read at ~310 GB/s, but all ranks reading all peers at once get only ~215 GB/s into each
        # rank, so one-peer algorithms win at large sizes
        peer_link = LinkCost(
            alpha_s=15e-6,
            beta_s_per_byte=1 / 310e9,
            gamma_s_per_byte=0.0,
            alpha_peer_s=2e-6,
            beta_many_s_per_byte=1 / 215e9,
        )
        return CostParams(intra=peer_link)
    if device_type == "cpu-peer":
        return CostParams(intra=LinkCost(alpha_s=150e-6, beta_s_per_byte=1 / 4e9, gamma_s_per_byte=0.0))
    if device_type == "cpu-mpi":
        # our schedules over MPI point-to-point (dtrain.comm.mpi), Open MPI's shared memory on one host
        return CostParams(intra=LinkCost(alpha_s=30e-6, beta_s_per_byte=1 / 3e9, gamma_s_per_byte=1 / 5e9))
    raise ValueError(
        f"no default cost parameters for device type {device_type!r}; use 'cpu', 'cuda', 'cpu-peer', 'cuda-peer' "
        "or 'cpu-mpi'"
    )


def params_path(device: str = "cpu") -> Path:
    """``$DTRAIN_CALIBRATION`` if set, else ``~/.cache/dtrain/calibration-{device}.json``."""
    env = comm_env().calibration
    if env is not None:
        return env
    return Path.home() / ".cache" / "dtrain" / f"calibration-{device}.json"


def load_params(path: str | Path | None = None, *, device: str = "cpu") -> CostParams:
    """Calibrated parameters from ``path`` (default :func:`params_path`); with no path given and no file
    there, :func:`default_params`. A named file that is missing raises ``FileNotFoundError``; a file that cannot
    be read or is not calibration data raises ``ValueError`` naming it."""
    if path is None:
        path = params_path(device)
        if not path.exists():
            return default_params(device)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such calibration file")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        return CostParams.from_dict(data)
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not a dtrain calibration file: {str(err).splitlines()[0]}") from None


def save_params(
    params: CostParams, path: str | Path | None = None, meta: Mapping | None = None, *, device: str = "cpu"
) -> Path:
    """Write ``params`` (and ``meta``: where and how they were measured) as JSON, atomically."""
    path = Path(path) if path is not None else params_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({**params.to_dict(), "meta": dict(meta or {})}, indent=2) + "\n")
    tmp.replace(path)
    return path
