"""Fit the NCCL model's few figures (:mod:`dtrain.sim.nccl`) to measured calls, through the simulator itself.

Two regimes, as in :mod:`dtrain.sim.fit`:

1. small calls (``host_max_bytes`` and below) are host-bound: back-to-back calls cost ``max(host, kernel)`` and
   the kernel is the shorter, so ``host_s`` is their median time (a median, because one call in a run is
   often an outlier: the first size pays the communicator's set-up);
2. larger calls are kernel-bound: one connection's rate (all channels together), the kernel's launch and a
   step's latency are fitted by coordinate descent, each by golden-section search of the squared log error.

The rate of the kernel's local copies is not fitted: given ``local_per_connection`` it is that multiple of the
connection rate (:data:`dtrain.sim.nccl.LOCAL_OVER_CONNECTION` from NCCL's memory accesses). Fitted freely it
trades off against the connection rate and the launch, and the fit wanders along that valley (docs/simulator.md).

Fit on one run, test on others (benchmarks/sim/validate.py transports).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dtrain.cluster.topology import Topology
from dtrain.sim.fit import _golden
from dtrain.sim.nccl import NcclParams, simulate_nccl

__all__ = ["NcclPoint", "fit_nccl", "coordinate_fit"]


@dataclass(frozen=True, kw_only=True)
class NcclPoint:
    """One measured NCCL call: ``seconds`` for ``collective`` on a ``nbytes`` work buffer."""

    collective: str
    nbytes: int
    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds > 0 or self.nbytes < 0:
            raise ValueError(f"NcclPoint({self.collective}, {self.nbytes} B): seconds must be > 0, got {self.seconds}")


def coordinate_fit(
    loss: Callable[[dict[str, float]], float],
    start: dict[str, float],
    bounds: dict[str, tuple[float, float]],
    *,
    sweeps: int = 2,
    steps: int = 24,
    grid: int = 0,
) -> dict[str, float]:
    """Minimise ``loss`` over the named figures, one at a time in log space within ``bounds``, ``sweeps`` times;
    with ``grid > 1``, first take the best point of a log-spaced ``grid ** len(bounds)`` grid and search only
    one grid step around it (where a figure stops binding the loss goes flat, and golden-section search,
    which assumes one valley, then walks off to a bound)."""
    values = dict(start)
    if grid > 1:
        axes = {
            name: [low * (high / low) ** (i / (grid - 1)) for i in range(grid)] for name, (low, high) in bounds.items()
        }
        candidates = [{**values, **dict(zip(axes, point, strict=True))} for point in itertools.product(*axes.values())]
        values = min(candidates, key=loss)
        # golden-section search needs one valley: search one grid step either side of the best point only
        step = {name: (high / low) ** (1 / (grid - 1)) for name, (low, high) in bounds.items()}
        bounds = {name: (max(low, values[name] / step[name]), min(high, values[name] * step[name]))
                  for name, (low, high) in bounds.items()}  # fmt: skip
    for _ in range(sweeps):
        for name, (low, high) in bounds.items():
            values[name] = _golden(lambda v, name=name: loss({**values, name: v}), low, high, steps)
    return values


def _log_loss(points: Sequence[NcclPoint], topology: Topology, params: NcclParams) -> float:
    return sum(math.log(simulate_nccl(topology, p.collective, p.nbytes, params=params).time_s / p.seconds) ** 2
               for p in points)  # fmt: skip


def fit_nccl(
    points: Sequence[NcclPoint],
    topology: Topology,
    *,
    base: NcclParams | None = None,
    host_max_bytes: int = 1 << 20,
    kernel_min_bytes: int = 4 << 20,
    local_per_connection: float | None = None,
) -> NcclParams:
    """``base`` with ``host_s``, ``channel_bytes_per_s``, ``launch_s`` and ``step_latency_s`` fitted to
    ``points`` (see the module docstring); with ``local_per_connection``, ``local_bytes_per_s`` is that multiple
    of the fitted connection rate."""
    base = base or NcclParams()
    small = [p.seconds for p in points if p.nbytes <= host_max_bytes]
    large = [p for p in points if p.nbytes >= kernel_min_bytes]
    if not small or not large:
        raise ValueError(
            f"fit_nccl needs calls of at most {host_max_bytes} B and of at least {kernel_min_bytes} B; "
            f"got sizes {sorted({p.nbytes for p in points})}"
        )
    if local_per_connection is not None and not local_per_connection > 0:
        raise ValueError(f"local_per_connection must be > 0 or None, got {local_per_connection!r}")
    params = replace(base, host_s=statistics.median(small))

    def with_figures(v: dict[str, float]) -> NcclParams:
        local = params.local_bytes_per_s if local_per_connection is None else local_per_connection * v["connection"]
        return replace(params, channel_bytes_per_s=v["connection"] / params.channels, launch_s=v["launch"],
                       step_latency_s=v["step"], local_bytes_per_s=local)  # fmt: skip

    figures = coordinate_fit(
        lambda v: _log_loss(large, topology, with_figures(v)),
        {"connection": 300e9, "launch": 10e-6, "step": 2e-6},
        {"connection": (1e9, 2e12), "launch": (1e-7, 2e-4), "step": (1e-8, 5e-5)},
        sweeps=8,  # the connection rate and the launch trade off along a narrow valley: 2 sweeps stop short
    )
    return with_figures(figures)
