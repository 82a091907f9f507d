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

__all__ = ["Entry", "EntryError", "ShardState", "Snapshot"]


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


@dataclass
class Snapshot:
    """A replica's whole state, as a new ``primary_backup`` leader sends it to its followers: the sequence number and
    round, the ``weights`` (no rows before the initial values), the optimizer's float arrays stacked ``(k, rows,
    width)`` and its count arrays stacked ``(j, rows)`` (in name order), the workers' ``clocks``, ``applied`` and
    ``last_push`` stacked ``(3, workers)``, and the ids held above ``last_push`` as ``(worker, push_id)`` pairs."""

    seq: int
    round: int
    weights: np.ndarray
    optimizer_rows: np.ndarray
    optimizer_counts: np.ndarray
    progress: np.ndarray
    pushes_above: np.ndarray

    def header(self, shard: int) -> dict:
        return {"op": "state", "shard": shard, "seq": self.seq, "round": self.round}

    def tensors(self) -> list[np.ndarray]:
        return [self.weights, self.optimizer_rows, self.optimizer_counts, self.progress, self.pushes_above]


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

    # a whole state, for a follower that has to be made equal to a new leader ---------------------------------
    def _optimizer_arrays(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The optimizer's float32 arrays ``(rows, width)`` and its int64 count arrays ``(rows,)``, in name order."""
        arrays = [a for _, a in sorted(self.optimizer.arrays().items())]
        return [a for a in arrays if a.dtype == np.float32], [a for a in arrays if a.dtype == np.int64]

    def snapshot(self) -> Snapshot:
        """This replica's whole state (copies: it is sent later)."""
        (rows, width), (floats, counts) = self.weights_shape, self._optimizer_arrays()
        weights = self.weights.copy() if self.ready else np.zeros((0, width), np.float32)
        pairs = [(w, i) for w, ids in enumerate(self.pushes_above) for i in sorted(ids)]
        return Snapshot(self.seq, self.round, weights,
                        np.stack(floats) if floats else np.zeros((0, rows, width), np.float32),
                        np.stack(counts) if counts else np.zeros((0, rows), np.int64),
                        np.stack([self.clocks, self.applied, self.last_push]),
                        np.array(pairs, np.int64).reshape(-1, 2))  # fmt: skip

    def snapshot_refusal(self, snap: Snapshot) -> str:
        """Why ``snap`` cannot replace this state, or ``""``: every array of this shard's shape and dtype (the
        weights without rows at entry 0, before the initial values), floats finite, counts and push ids in range,
        each id held above ``last_push`` once. Checked whole, before any change."""
        (rows, width), (floats, counts) = self.weights_shape, self._optimizer_arrays()
        wanted = (("weights", snap.weights, np.float32, (rows if snap.seq else 0, width)),
                  ("optimizer rows", snap.optimizer_rows, np.float32, (len(floats), rows, width)),
                  ("optimizer counts", snap.optimizer_counts, np.int64, (len(counts), rows)),
                  ("progress", snap.progress, np.int64, (3, self.config.num_workers)))  # fmt: skip
        for name, got, dtype, shape in wanted:
            if got.dtype != dtype or got.shape != shape:
                return f"{name} must be {np.dtype(dtype)} {shape} at entry {snap.seq}, got {got.dtype} {got.shape}"
            if dtype == np.float32 and got.size and not bool(np.isfinite(got).all()):
                return f"its {name} are not all finite (NaN or infinity)"
        low = np.array([[0], [0], [-1]], np.int64)  # clocks and applied from 0, last_push from -1
        if (snap.optimizer_counts.size and (snap.optimizer_counts.min() < 0 or snap.optimizer_counts.max() >= MAX_COUNT)
                or bool((snap.progress < low).any()) or bool((snap.progress >= MAX_COUNT).any())):  # fmt: skip
            return "its counts, clocks or push ids are out of [0, 2**62)"
        pairs = snap.pushes_above
        if pairs.dtype != np.int64 or pairs.ndim != 2 or pairs.shape[1] != 2:
            return f"pushes above must be int64 (n, 2), got {pairs.dtype} {pairs.shape}"
        if pairs.size:
            workers, ids = pairs[:, 0], pairs[:, 1]
            if workers.min() < 0 or workers.max() >= self.config.num_workers or ids.max() >= MAX_COUNT:
                return "pushes above name a worker or push id out of range"
            if not bool((ids > snap.progress[2][workers]).all()):
                return "pushes above must lie above their worker's last push"
            if np.unique(pairs, axis=0).shape[0] != pairs.shape[0]:
                return "pushes above must be distinct"
        return ""

    def restore(self, snap: Snapshot) -> None:
        """Become ``snap``: :class:`EntryError` (and nothing changes) if it does not fit this shard."""
        reason = self.snapshot_refusal(snap)
        if reason:
            raise EntryError(f"shard {self.index}: state at entry {snap.seq} refused: {reason}")
        self.weights = np.array(snap.weights, np.float32, copy=True) if snap.seq else None
        floats, counts = self._optimizer_arrays()
        for mine, theirs in zip([*floats, *counts], [*snap.optimizer_rows, *snap.optimizer_counts], strict=True):
            mine[...] = theirs
        self.clocks[...], self.applied[...], self.last_push[...] = snap.progress
        self.pushes_above = [set() for _ in range(self.config.num_workers)]
        for worker, push_id in snap.pushes_above.tolist():
            self.pushes_above[worker].add(push_id)
        self.seq, self.round = snap.seq, snap.round

    def arrays(self) -> dict[str, np.ndarray]:
        """Everything a replica holds, for comparing replicas."""
        out = {"weights": self.weights, "applied": self.applied, "clocks": self.clocks}
        out.update({f"opt.{k}": v for k, v in self.optimizer.arrays().items()})
        return out
