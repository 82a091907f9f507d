"""Keys: the row space ``[0, num_keys)`` cut into contiguous ranges, one a shard, and models laid onto it.

ps-lite (Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014) partitions
keys across servers by range, so a worker splits a sorted key list with one search per server. Here a key is
a row of ``width`` floats: an embedding row is one key; a dense parameter is flattened and cut into
``ceil(numel / width)`` consecutive keys (the last row padded with zeros that no gradient ever moves).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["KeyRange", "ParamSlot", "partition", "split_by_range", "dense_slots"]


@dataclass(frozen=True)
class KeyRange:
    """Keys ``lo <= k < hi``."""

    lo: int
    hi: int

    def __len__(self) -> int:
        return self.hi - self.lo

    def holds(self, keys: np.ndarray) -> bool:
        """Whether every key is in range (an empty array is)."""
        return keys.size == 0 or (int(keys.min()) >= self.lo and int(keys.max()) < self.hi)


def partition(num_keys: int, parts: int) -> list[KeyRange]:
    """``num_keys`` keys in ``parts`` contiguous ranges whose sizes differ by at most one."""
    if parts < 1 or num_keys < parts:
        raise ValueError(f"cannot cut {num_keys} keys into {parts} non-empty ranges")
    bounds = [num_keys * i // parts for i in range(parts + 1)]
    return [KeyRange(bounds[i], bounds[i + 1]) for i in range(parts)]


def split_by_range(keys: np.ndarray, ranges: list[KeyRange]) -> list[np.ndarray]:
    """For each range, the positions in ``keys`` (int64, any order) that fall in it."""
    his = np.array([r.hi for r in ranges], dtype=np.int64)
    owner = np.searchsorted(his, keys, side="right")
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=len(ranges))
    return np.split(order, np.cumsum(counts)[:-1])


@dataclass(frozen=True)
class ParamSlot:
    """Where one dense parameter lives: keys ``first .. first + rows - 1`` hold its ``numel`` values."""

    name: str
    shape: tuple[int, ...]
    first: int
    rows: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    def keys(self) -> np.ndarray:
        return np.arange(self.first, self.first + self.rows, dtype=np.int64)

    def to_rows(self, flat: np.ndarray, width: int) -> np.ndarray:
        """A flat float32 array of ``numel`` values -> ``(rows, width)``, zero-padded."""
        out = np.zeros(self.rows * width, dtype=np.float32)
        out[: self.numel] = flat.reshape(-1)
        return out.reshape(self.rows, width)

    def from_rows(self, rows: np.ndarray) -> np.ndarray:
        """``(rows, width)`` -> the parameter's values in its shape."""
        return rows.reshape(-1)[: self.numel].reshape(self.shape)


def dense_slots(named_shapes: Iterable[tuple[str, tuple[int, ...]]], width: int, first: int = 0) -> list[ParamSlot]:
    """Consecutive key ranges for dense parameters, in the given order, starting at key ``first``."""
    slots, key = [], first
    for name, shape in named_shapes:
        numel = int(np.prod(shape)) if shape else 1
        rows = -(-numel // width)
        slots.append(ParamSlot(name=name, shape=tuple(shape), first=key, rows=rows))
        key += rows
    return slots
