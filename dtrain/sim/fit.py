"""Fit the simulator's software costs and link rate to measured collectives.

A network model alone cannot know what a runtime spends on the host: on GPUs a Python-driven round of
NCCL point-to-point calls costs tens of microseconds, more than moving a megabyte over NVLink. This module
fits those costs the way the alpha-beta model is calibrated (Hockney's two-point fit, generalised to least
squares), but through the simulator itself, so contention and rank skew stay in the model:

1. on small messages (where the wire time is negligible) the time is linear in the software costs:
   ``call_s + alpha_s x (rounds on the critical path) + alpha_peer_s x (extra peers on it)``; the two counts
   are measured by replaying with unit costs, and the three costs are fitted by non-negative least squares
   on relative error;
2. on large messages the link rate, then the per-message rate cap (one for all messages, or one for the
   messages up to a size threshold), are the ones that minimise the squared log error (golden-section
   search, one at a time).

Fit on one measurement, test on another (benchmarks/sim/validate.py does).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dtrain.cluster.topology import Topology
from dtrain.comm.ir.algorithms import build as build_schedule
from dtrain.comm.ir.algorithms import needs_local_size
from dtrain.comm.ir.schedule import ROOTED_COLLECTIVES, Collective, Schedule
from dtrain.sim.api_passes import api_passes
from dtrain.sim.collective import SoftwareCost, replay

__all__ = [
    "Measurement",
    "fit_software",
    "fit_link_rate",
    "fit_flow_cap",
    "fit_message_cap",
    "simulate_measurement",
]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measured collective call: ``seconds`` for ``nbytes`` of work buffer on ``world_size`` ranks."""

    collective: str
    algorithm: str
    nbytes: int
    world_size: int
    seconds: float
    pipeline: int = 1
    local_size: int | None = None
    itemsize: int = 4

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"measurement of {self.collective}/{self.algorithm}: seconds must be > 0")

    def schedule(self) -> Schedule:
        collective = Collective(self.collective)
        return build_schedule(
            collective,
            self.algorithm,
            self.world_size,
            root=0 if collective in ROOTED_COLLECTIVES else None,
            pipeline=self.pipeline,
            local_size=self.local_size if needs_local_size(self.algorithm) else None,
        )


def simulate_measurement(m: Measurement, topology: Topology, cost: SoftwareCost) -> float:
    """Simulated seconds of the call ``m`` describes (default placement): the public API's call, its own
    operations around the schedule included (:mod:`dtrain.sim.api_passes`, priced by ``cost.launch_s`` and
    ``cost.copy_s_per_byte``)."""
    schedule = m.schedule()
    api = api_passes(schedule, m.nbytes)
    return replay(schedule, m.nbytes, topology, cost=cost, itemsize=m.itemsize, api=api).time_s


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, by trying each subset of columns (three at most here)."""
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x < 0):
                continue
            residual = float(np.sum((a[:, cols] @ x - b) ** 2))
            if residual < best_residual:
                best, best_residual = np.zeros(a.shape[1]), residual
                best[list(cols)] = x
    return best


def fit_software(measurements: Sequence[Measurement], topology: Topology, base: SoftwareCost) -> SoftwareCost:
    """``base`` with ``call_s``, ``alpha_s`` and ``alpha_peer_s`` fitted to small-message ``measurements``.

    The measured times are taken as all software: fit on calls without API operations of their own (an
    all-reduce), or the operations' time lands in the fitted costs."""
    if not measurements:
        raise ValueError("fit_software needs at least one measurement")
    counts = replace(base, launch_s=0.0, copy_s_per_byte=0.0)  # replays that count rounds and peers, nothing else
    unit = replace(counts, call_s=0.0, alpha_s=1.0, alpha_peer_s=0.0)
    peer = replace(counts, call_s=0.0, alpha_s=0.0, alpha_peer_s=1.0)
    rows, rhs = [], []
    for m in measurements:
        rounds = simulate_measurement(m, topology, unit)
        peers = simulate_measurement(m, topology, peer)
        # relative error: each equation divided by the measured time
        rows.append([1 / m.seconds, rounds / m.seconds, peers / m.seconds])
        rhs.append(1.0)
    call_s, alpha_s, alpha_peer_s = _nonnegative_lstsq(np.array(rows), np.array(rhs))
    return replace(base, call_s=float(call_s), alpha_s=float(alpha_s), alpha_peer_s=float(alpha_peer_s))


def _golden(loss: Callable[[float], float], low: float, high: float, steps: int) -> float:
    """The minimiser of ``loss`` over ``[low, high]`` in log space (golden-section search; ``loss`` unimodal)."""
    a, b = math.log(low), math.log(high)
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = loss(math.exp(c)), loss(math.exp(d))
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = loss(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = loss(math.exp(d))
    return math.exp((a + b) / 2)


def _log_loss(measurements: Sequence[Measurement], topology: Topology, cost: SoftwareCost) -> float:
    return sum(math.log(simulate_measurement(m, topology, cost) / m.seconds) ** 2 for m in measurements)


def fit_link_rate(
    measurements: Sequence[Measurement],
    build: Callable[[float], Topology],
    cost: SoftwareCost,
    *,
    low: float = 1e9,
    high: float = 5e12,
    steps: int = 40,
) -> float:
    """The link rate (bytes/s) for ``build(rate)`` that minimises the squared log error on ``measurements``."""
    if not measurements:
        raise ValueError("fit_link_rate needs at least one measurement")
    return _golden(lambda rate: _log_loss(measurements, build(rate), cost), low, high, steps)


def fit_flow_cap(
    measurements: Sequence[Measurement],
    topology: Topology,
    cost: SoftwareCost,
    *,
    low: float = 1e9,
    high: float = 5e12,
    steps: int = 40,
) -> float:
    """The per-message rate cap (bytes/s) that minimises the squared log error on ``measurements``: what one
    point-to-point connection reaches on its own when it cannot fill its links (e.g. NCCL's channels per peer)."""
    if not measurements:
        raise ValueError("fit_flow_cap needs at least one measurement")
    return _golden(
        lambda cap: _log_loss(measurements, topology, replace(cost, flow_cap_bytes_per_s=cap)), low, high, steps
    )


def fit_message_cap(
    measurements: Sequence[Measurement],
    topology: Topology,
    cost: SoftwareCost,
    *,
    thresholds: Sequence[float] = tuple(2.0**k for k in range(20, 31)),
    low: float = 1e9,
    high: float = 5e12,
    steps: int = 30,
) -> tuple[float, float]:
    """``(max_bytes, cap)``: the size threshold (from ``thresholds``) and the cap of the messages up to it that
    minimise the squared log error, larger messages keeping ``cost``'s own cap. For a transport whose
    point-to-point rate steps up with the message size (NCCL gives a peer more channels for large messages)."""
    if not measurements:
        raise ValueError("fit_message_cap needs at least one measurement")
    best: tuple[float, float, float] | None = None
    for threshold in thresholds:

        def loss(cap: float, threshold: float = threshold) -> float:
            return _log_loss(measurements, topology, replace(cost, message_caps=((threshold, cap),)))

        cap = _golden(loss, low, high, steps)
        value = loss(cap)
        if best is None or value < best[0]:
            best = (value, threshold, cap)
    assert best is not None
    return best[1], best[2]
