"""The time of a schedule on the peer-memory transport (:mod:`dtrain.comm.peer`), from its compiled pull plan.

On that transport nothing is a message: every rank reads its peers' windows with one kernel a destination range,
between device barriers, and a rank's host enqueues the whole call ahead of its GPU. So the model walks the
plan the runtime itself runs (:func:`dtrain.comm.peer_plan.compile_pull`), per rank:

- **GPU time**: for each round, a barrier (every rank waits for the slowest to arrive), the copies into the
  window at the local copy rate, then the pull passes one after another: a pass reading one peer at the pair
  rate, a pass reading several peers at once at the fan-in rate (what one rank reads in all; on 4 H200s all
  ranks reading all peers contend, so this is *lower* than one pair's), plus a second barrier and its local
  copies where the plan defers window writes; at the end the copies out and the last barrier.
- **Host time**: a fixed cost a call, and a cost for each barrier and each kernel or copy it enqueues.

A call takes the larger of the two: the host runs ahead of the GPU until the GPU catches up with it (small
messages are host-bound, large ones GPU-bound). Graph-replayed calls (``DTRAIN_COMM_PERSISTENT=1``) have no
host time. Figures are fitted to ``dtrain bench comm`` runs (:func:`fit_peer_cost`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from dtrain.comm.peer_plan import compile_pull
from dtrain.comm.schedule import Schedule

__all__ = ["PeerCost", "PeerTime", "peer_time", "fit_peer_cost"]


@dataclass(frozen=True, kw_only=True)
class PeerCost:
    """The peer transport's figures. Rates in bytes per second, times in seconds.

    ``pair_bytes_per_s``: a pass reading one peer; ``fanin_bytes_per_s``: all a rank reads in a pass that reads
    several peers; ``local_bytes_per_s``: a copy within the GPU's memory; ``barrier_s``: a device barrier;
    ``host_call_s``, ``host_barrier_s``, ``host_launch_s``: host time a call, a barrier, a kernel or copy.
    """

    pair_bytes_per_s: float
    fanin_bytes_per_s: float
    local_bytes_per_s: float
    barrier_s: float
    host_call_s: float = 0.0
    host_barrier_s: float = 0.0
    host_launch_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("pair_bytes_per_s", "fanin_bytes_per_s", "local_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PeerCost.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("barrier_s", "host_call_s", "host_barrier_s", "host_launch_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PeerCost.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class PeerTime:
    """A call's predicted ``time_s`` = max(``gpu_s``, ``host_s``), and what it is made of."""

    time_s: float
    gpu_s: float
    host_s: float
    barriers: int
    launches: int


def _phases(schedule: Schedule, numel: int, itemsize: int) -> list[list[tuple[float, list[tuple[float, int]]]]]:
    """Per rank, the stretches of work between two barriers, in order: (local bytes copied, passes), a pass
    being (bytes read, peers read). The runtime's order: copy-in, barrier; the round's passes (then a second
    barrier and the deferred copies), the next round's copy-in, barrier; ...; the copy-out, barrier."""
    out = []
    for r in range(schedule.world_size):
        plan = compile_pull(schedule, r, numel)
        phases: list[tuple[float, list[tuple[float, int]]]] = []
        local = sum(n for _, n in plan.rounds[0].copy_in) * itemsize if plan.rounds else 0.0
        passes: list[tuple[float, int]] = []
        for k, rnd in enumerate(plan.rounds):
            phases.append((local, passes))  # ends at the barrier before round k
            local, passes = 0.0, [(op.length * itemsize * len(op.reads), len(op.reads)) for op in rnd.ops]
            if rnd.second_barrier:
                phases.append((local, passes))
                local, passes = sum(n for _, n in rnd.deferred) * itemsize, []
            if k + 1 < len(plan.rounds):
                local += sum(n for _, n in plan.rounds[k + 1].copy_in) * itemsize
        local += sum(n for _, n in plan.copy_out) * itemsize
        phases.append((local, passes))  # ends at the last barrier
        out.append(phases)
    return out


def peer_time(
    schedule: Schedule, nbytes: int, cost: PeerCost, *, itemsize: int = 4, replayed: bool = False
) -> PeerTime:
    """Predicted time of ``schedule`` on a ``nbytes`` work buffer through the peer transport.

    ``replayed``: the call is a CUDA-graph replay, so it costs no host time.
    """
    numel = max(nbytes // itemsize, 0)
    ranks = _phases(schedule, numel, itemsize)
    nphases = len(ranks[0])
    gpu = 0.0
    launches = 0
    for k in range(nphases):  # every phase ends at a barrier all ranks take, so the slowest rank sets it
        slowest = 0.0
        for phases in ranks:
            local, passes = phases[k]
            t = local / cost.local_bytes_per_s
            for read, peers in passes:
                t += read / (cost.pair_bytes_per_s if peers == 1 else cost.fanin_bytes_per_s)
            slowest = max(slowest, t)
        gpu += slowest + cost.barrier_s
    barriers = nphases
    launches = max(sum(len(passes) + (1 if local else 0) for local, passes in phases) for phases in ranks)
    host = 0.0 if replayed else cost.host_call_s + barriers * cost.host_barrier_s + launches * cost.host_launch_s
    return PeerTime(time_s=max(gpu, host), gpu_s=gpu, host_s=host, barriers=barriers, launches=launches)


def fit_peer_cost(
    points: Sequence[tuple[Schedule, int, float, bool]],
    base: PeerCost,
    *,
    host_below_bytes: int = 1 << 20,
    gpu: bool = True,
) -> PeerCost:
    """Fit ``base``'s figures to measured ``(schedule, nbytes, seconds, replayed)`` points.

    The host terms by non-negative least squares on the eager points of at most ``host_below_bytes`` (where a
    call is host-bound); then, with ``gpu``, the pair rate, the fan-in rate and the barrier, each by a
    golden-section search on the mean squared log error of every point, in turn, three times.
    """
    small = [(s, n, t) for s, n, t, rep in points if not rep and n <= host_below_bytes]
    cost = base
    if small:
        rows, rhs = [], []
        for s, n, t in small:
            pt = peer_time(s, n, cost)
            rows.append([1.0, pt.barriers, pt.launches])
            rhs.append(t)
        coef = _nnls(np.array(rows), np.array(rhs))
        cost = replace(cost, host_call_s=coef[0], host_barrier_s=coef[1], host_launch_s=coef[2])

    def loss(c: PeerCost) -> float:
        errs = [np.log(peer_time(s, n, c, replayed=rep).time_s / t) for s, n, t, rep in points]
        return float(np.mean(np.square(errs)))

    for _ in range(3 if gpu else 0):
        for name, low, high in (
            ("pair_bytes_per_s", 50e9, 900e9),
            ("fanin_bytes_per_s", 50e9, 900e9),
            ("barrier_s", 0.0, 50e-6),
        ):
            best = _golden(lambda v, n=name, c=cost: loss(replace(c, **{n: v})), low, high)
            cost = replace(cost, **{name: best})
    return cost


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop the most negative and refit until none is)."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        x[active] = sol
        if (x >= 0).all() or not active:
            return np.maximum(x, 0)
        active.remove(active[int(np.argmin(sol))])


def _golden(loss, low: float, high: float, steps: int = 40) -> float:
    ratio = (5**0.5 - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = loss(d)
    return (a + b) / 2
