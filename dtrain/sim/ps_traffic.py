"""What one parameter-server step moves: :class:`PSStep` (the step) and :func:`ps_traffic` (its bytes by server).

The rules (key ranges, Zipf rows, hot-row copies dealt round-robin) are :mod:`dtrain.sim.ps`'s, after
:mod:`dtrain.ps` (docs/ps.md); :func:`dtrain.sim.ps.simulate_ps` turns these bytes into flows and time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MODES", "PSStep", "PSTraffic", "ps_traffic"]

MODES = ("sync", "async")


@dataclass(frozen=True, kw_only=True)
class PSStep:
    """One step: ``workers`` and ``servers`` (topology node names), ``dense_bytes`` of parameters, embedding rows
    (``rows_per_worker`` Zipf draws over ``key_space`` keys of ``row_bytes``), ``mode`` ("sync" or "async"),
    ``replicas`` per chain, ``hot_keys`` rows per server copied to ``hot_replicas`` others, the servers'
    optimizer at ``apply_s_per_byte``, and each process's own work on a message at ``host_s_per_byte`` (paid
    by the sender before the bytes leave and by the receiver once they are in: dtrain.ps serialises and
    HMACs every byte at both ends)."""

    workers: Sequence[str]
    servers: Sequence[str]
    dense_bytes: float = 0.0
    rows_per_worker: int = 0
    key_space: int = 0
    row_bytes: int = 0
    zipf: float = 1.1
    permute: bool = False
    seed: int = 0
    mode: str = "sync"
    replicas: int = 1
    hot_keys: int = 0
    hot_replicas: int = 0
    apply_s_per_byte: float = 0.0
    host_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(self.workers))
        object.__setattr__(self, "servers", tuple(self.servers))
        for role in ("workers", "servers"):
            names = getattr(self, role)
            if not names:
                raise ValueError(f"PSStep.{role} is empty; give at least one topology node")
            if len(set(names)) != len(names):
                raise ValueError(f"PSStep.{role} names a node twice: {list(names)}")
        for name in ("dense_bytes", "rows_per_worker", "key_space", "row_bytes", "zipf", "hot_keys",
                     "apply_s_per_byte", "host_s_per_byte"):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"PSStep.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.rows_per_worker and not (self.key_space >= 1 and self.row_bytes > 0):
            raise ValueError(
                f"PSStep: rows_per_worker={self.rows_per_worker} needs key_space >= 1 and row_bytes > 0, "
                f"got key_space={self.key_space}, row_bytes={self.row_bytes}"
            )
        if self.mode not in MODES:
            raise ValueError(f"PSStep.mode must be one of {MODES}, got {self.mode!r}")
        servers = len(self.servers)
        if not 1 <= self.replicas <= servers:
            raise ValueError(f"PSStep.replicas must be in 1..{servers} (the servers), got {self.replicas!r}")
        if not 0 <= self.hot_replicas < servers:
            raise ValueError(f"PSStep.hot_replicas must be in 0..{servers - 1} (others), got {self.hot_replicas!r}")


@dataclass(frozen=True)
class PSTraffic:
    """The bytes of a step, by server index (shard ``i``'s head is server ``i``)."""

    push: dict[tuple[int, int], float]  # (worker, shard) -> bytes to the shard's head
    pull: dict[tuple[int, int], float]  # (worker, server) -> bytes that server sends back
    entry: list[float]  # per shard: a sync step's entry (the dense shard plus the union of pushed rows)
    hot: dict[tuple[int, int], float]  # (owner, copy) -> bytes of the owner's hot rows refreshed on the copy


def ps_traffic(step: PSStep) -> PSTraffic:
    """The step's bytes: each push, each pull reply, each shard's entry and each hot-row refresh."""
    n_w, n_s = len(step.workers), len(step.servers)
    shard = step.dense_bytes / n_s
    push = {(w, i): shard for w in range(n_w) for i in range(n_s)}
    pull = {(w, i): shard for w in range(n_w) for i in range(n_s) if shard > 0}
    entry, hot = [shard] * n_s, {}
    if not step.rows_per_worker:
        return PSTraffic(push, pull, entry, hot)
    rng = np.random.default_rng(step.seed)
    permutation = rng.permutation(step.key_space) if step.permute else np.arange(step.key_space)
    weights = np.arange(1, step.key_space + 1, dtype=np.float64) ** -step.zipf
    rows = [np.unique(permutation[rng.choice(step.key_space, size=step.rows_per_worker, p=weights / weights.sum())])
            for _ in range(n_w)]  # fmt: skip
    pullers: dict[int, list[int]] = {}  # key -> the workers that pull it, in order
    for w, k in ((w, k) for w, keys in enumerate(rows) for k in keys.tolist()):
        pullers.setdefault(k, []).append(w)
    owner = {k: k * n_s // step.key_space for k in pullers}
    for k, ws in pullers.items():
        i = owner[k]
        entry[i] += step.row_bytes
        for w in ws:
            push[w, i] += step.row_bytes
    for i in range(n_s):
        mine = sorted((k for k in pullers if owner[k] == i), key=lambda k: (-len(pullers[k]), k))
        hot_rows = set(mine[: step.hot_keys]) if step.hot_replicas else set()
        holders = [i] + [(i + j) % n_s for j in range(1, step.hot_replicas + 1)]
        for k in mine:
            for turn, w in enumerate(pullers[k]):
                j = holders[(turn + k) % len(holders)] if k in hot_rows else i
                pull[w, j] = pull.get((w, j), 0.0) + step.row_bytes
        hot.update({(i, j): len(hot_rows) * step.row_bytes for j in holders[1:] if hot_rows})
    return PSTraffic(push, pull, entry, hot)
