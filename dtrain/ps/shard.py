"""One shard's state on one server, changed only by applying numbered log entries.

Every replica of a shard applies the same entries in the same order (entry ``seq`` after ``seq - 1``), so
replicas that applied the same prefix hold bit-identical weights and optimizer state: the state-machine
approach of chain replication (van Renesse and Schneider, "Chain Replication for Supporting High Throughput
and Availability", OSDI 2004). An entry is either the initial values or one optimizer step on some rows,
together with the pushes it accounts for, so each replica also knows which pushes it holds.

An entry is checked whole before it changes anything (:meth:`ShardState.refusal`): a step needs the initial
values first, values are finite and of the shard's shape, keys distinct and in the shard, every push's worker,
id and clock in range. A refused entry leaves the state as it was (its sequence number too), so the same entry
is refused, or taken, alike on every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.keys import KeyRange
from dtrain.ps.messages import MAX_COUNT
from dtrain.ps.optimizers import make_optimizer, rows_index

__all__ = ["Entry", "EntryError", "ShardState"]


class EntryError(ValueError):
    """A log entry that the shard's state refuses: it is not applied and changes nothing."""


@dataclass
class Entry:
    """A log entry: ``kind`` is ``"init"`` (``values`` are all rows) or ``"step"`` (``values`` are the
    gradients of ``keys``). ``pushes`` lists ``[worker, push_id, clock]`` of every push it accounts for;
    ``round`` is the shard's round after it."""

    seq: int
    kind: str
    round: int
    keys: np.ndarray
    values: np.ndarray
    pushes: list[list[int]] = field(default_factory=list)

    def header(self, shard: int) -> dict:
        return {"op": "rep", "shard": shard, "seq": self.seq, "kind": self.kind, "round": self.round,
                "pushes": self.pushes}  # fmt: skip


class ShardState:
    """Weights ``(rows, width)`` of keys ``key_range``, the optimizer's state and what has been applied."""

    def __init__(self, config: JobConfig, index: int, key_range: KeyRange) -> None:
        self.config, self.index, self.key_range = config, index, key_range
        self.weights: np.ndarray | None = None
        self.optimizer = make_optimizer(config, len(key_range), config.width)
        self.seq = 0  # last applied entry
        self.round = 0
        workers = config.num_workers
        self.clocks = np.zeros(workers, np.int64)  # per worker: pushes applied so far (its SSP clock)
        self.applied = np.zeros(workers, np.int64)  # per worker: pushes folded into the weights
        # per worker: every push id up to last_push is accounted for, and these ids above it too (a retried push
        # may arrive after a later one, so the highest id seen would not say which are held)
        self.last_push = np.full(workers, -1, np.int64)
        self.pushes_above: list[set[int]] = [set() for _ in range(workers)]

    @property
    def weights_shape(self) -> tuple[int, int]:
        return (len(self.key_range), self.config.width)

    @property
    def ready(self) -> bool:
        return self.weights is not None

    def refusal(self, entry: Entry) -> str:
        """Why ``entry``, the next one, cannot be applied to this state, or ``""``: every check comes before any
        change, so a refused entry changes nothing."""
        if entry.kind == "init":
            if self.ready:
                return "the shard is initialised already"
            want = self.weights_shape
            if entry.keys.size or entry.values.shape != want or entry.values.dtype != np.float32:
                return f"an init entry holds no keys and float32 rows {want}, got {entry.values.shape}"
        elif entry.kind == "step":
            if not self.ready:
                return "a step before the shard's initial values"
            keys, values = entry.keys, entry.values
            if keys.ndim != 1 or keys.dtype != np.int64 or not self.key_range.holds(keys):
                return f"keys must be int64 inside [{self.key_range.lo}, {self.key_range.hi})"
            if keys.size > 1 and not bool((keys[1:] > keys[:-1]).all()):
                return "keys must be strictly increasing"
            if values.shape != (keys.size, self.config.width) or values.dtype != np.float32:
                return f"values must be float32 ({keys.size}, {self.config.width}), got {values.shape}"
        else:
            return f"unknown kind {entry.kind!r}"
        if entry.values.size and not bool(np.isfinite(entry.values).all()):
            return "its values are not all finite (NaN or infinity)"
        if not (type(entry.round) is int and 0 <= entry.round < MAX_COUNT):
            return f"round {entry.round!r} out of [0, 2**62)"
        for push in entry.pushes:
            if not (len(push) == 3 and all(type(v) is int and 0 <= v < MAX_COUNT for v in push)
                    and push[0] < self.config.num_workers):  # fmt: skip
                return f"push {push!r} is not [worker < {self.config.num_workers}, push_id, clock] in [0, 2**62)"
        return ""

    def apply(self, entry: Entry) -> bool:
        """Apply ``entry`` if it is the next one; ``False`` (and nothing changes) if it is old or out of order;
        :class:`EntryError` (and nothing changes) if it is the next one but refused (:meth:`refusal`)."""
        if entry.seq != self.seq + 1:
            return False
        reason = self.refusal(entry)
        if reason:
            raise EntryError(f"shard {self.index}: {entry.kind} entry {entry.seq} refused: {reason}")
        if entry.kind == "init":
            self.weights = np.array(entry.values, dtype=np.float32, copy=True)
        elif entry.keys.size:
            local = entry.keys - self.key_range.lo
            self.optimizer.step(self.weights, local, entry.values)
        for worker, push_id, clock in entry.pushes:
            self.applied[worker] += 1
            self.record_push(worker, push_id)
            self.clocks[worker] = max(self.clocks[worker], clock + 1)
        self.seq, self.round = entry.seq, entry.round
        return True

    def rows(self, keys: np.ndarray) -> np.ndarray:
        """The current values of ``keys`` (all in range), ``(len(keys), width)``."""
        return self.weights[rows_index(keys - self.key_range.lo)].copy()  # a copy: replies are sent later

    def holds_push(self, worker: int, push_id: int) -> bool:
        """Whether push ``push_id`` of ``worker`` (ids count 0, 1, ... per worker and shard) is accounted for."""
        return push_id <= self.last_push[worker] or push_id in self.pushes_above[worker]

    def record_push(self, worker: int, push_id: int) -> None:
        above = self.pushes_above[worker]
        above.add(push_id)
        while self.last_push[worker] + 1 in above:
            above.discard(int(self.last_push[worker]) + 1)
            self.last_push[worker] += 1

    def arrays(self) -> dict[str, np.ndarray]:
        """Everything a replica holds, for comparing replicas."""
        out = {"weights": self.weights, "applied": self.applied, "clocks": self.clocks}
        out.update({f"opt.{k}": v for k, v in self.optimizer.arrays().items()})
        return out
