"""The optimizers a server runs on the rows of its shard: SGD with momentum and Adam, row-sparse.

The formulas are torch.optim's (``SGD``: ``buf = momentum * buf + g`` with the first step ``buf = g``;
``Adam``: Kingma and Ba, ICLR 2015, Algorithm 1, with torch's ``eps`` outside the bias-corrected square root),
so a dense job matches single-process torch training to float32 rounding. A step touches only the rows that
received a gradient; Adam keeps a step count per row for its bias correction (the "lazy" Adam that sparse
embedding training uses), which equals dense Adam when every row is pushed every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the job's config validates its size with these optimizers' state
    from dtrain.ps.config import JobConfig

__all__ = ["RowOptimizer", "make_optimizer"]


class RowOptimizer:
    """Optimizer state for ``(rows, width)`` weights; :meth:`step` updates the given rows in place."""

    def __init__(self, config: JobConfig, rows: int, width: int) -> None:
        self.config = config
        self.state: dict[str, np.ndarray] = {}

    def step(self, weights: np.ndarray, rows: np.ndarray, grads: np.ndarray) -> None:
        """Update ``weights[rows]`` by ``grads`` ``(len(rows), width)``. ``rows`` may come in any order but must be
        distinct: a server combines a step's pushes first (:func:`dtrain.ps.consistency.combine` sums the
        gradients of a repeated key), so a step never names a row twice."""
        raise NotImplementedError

    def arrays(self) -> dict[str, np.ndarray]:
        """Every state array, for replicas to compare and for checkpoints."""
        return self.state


def rows_index(rows: np.ndarray) -> np.ndarray | slice:
    """``rows`` as an index: a slice when they are one contiguous increasing run ``a, a+1, ..., b`` (whole-shard
    steps then work in place), else the array itself, so rows in any order, or repeated, keep their order."""
    n = rows.size
    if n and int(rows[-1]) - int(rows[0]) + 1 == n and (n < 3 or bool((np.diff(rows) == 1).all())):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


class SGD(RowOptimizer):
    def __init__(self, config: JobConfig, rows: int, width: int) -> None:
        super().__init__(config, rows, width)
        if config.momentum:
            self.state = {"buf": np.zeros((rows, width), np.float32), "started": np.zeros(rows, np.int64)}

    def step(self, weights: np.ndarray, rows: np.ndarray, grads: np.ndarray) -> None:
        c = self.config
        rows = rows_index(rows)
        g = grads + np.float32(c.weight_decay) * weights[rows] if c.weight_decay else grads
        if c.momentum:
            buf, started = self.state["buf"], self.state["started"]
            old = buf[rows]
            new = np.where((started[rows] != 0)[:, None], np.float32(c.momentum) * old + g, g)
            buf[rows] = new
            started[rows] = 1
            g = new
        weights[rows] -= np.float32(c.lr) * g


class Adam(RowOptimizer):
    def __init__(self, config: JobConfig, rows: int, width: int) -> None:
        super().__init__(config, rows, width)
        self.state = {
            "m": np.zeros((rows, width), np.float32),
            "v": np.zeros((rows, width), np.float32),
            "t": np.zeros(rows, np.int64),
        }

    def step(self, weights: np.ndarray, rows: np.ndarray, grads: np.ndarray) -> None:
        c = self.config
        rows = rows_index(rows)
        g = grads + np.float32(c.weight_decay) * weights[rows] if c.weight_decay else grads
        m, v, t = self.state["m"], self.state["v"], self.state["t"]
        t[rows] += 1
        m[rows] = np.float32(c.beta1) * m[rows] + np.float32(1 - c.beta1) * g
        v[rows] = np.float32(c.beta2) * v[rows] + np.float32(1 - c.beta2) * g * g
        steps = t[rows].astype(np.float64)
        bias1 = (1 - c.beta1**steps).astype(np.float32)[:, None]
        bias2_sqrt = np.sqrt(1 - c.beta2**steps).astype(np.float32)[:, None]
        denom = np.sqrt(v[rows]) / bias2_sqrt + np.float32(c.eps)
        weights[rows] -= (np.float32(c.lr) / bias1) * m[rows] / denom


def make_optimizer(config: JobConfig, rows: int, width: int) -> RowOptimizer:
    """The optimizer ``config.optimizer`` names, for a shard of ``rows`` rows."""
    return {"sgd": SGD, "adam": Adam}[config.optimizer](config, rows, width)
