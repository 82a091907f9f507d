"""The one validated description of a parameter-server job, shared by every role.

The coordinator holds it and hands it to each server and worker as a msgpack map when they register, so a
cluster is configured in one place. Modes follow the seed text's parameter-server section (seed 001):
``sync`` (every worker's gradient, then one averaged step), ``quorum`` (the first ``quorum`` of N workers, the
straggler mitigation of "e.g. 90%"), ``async`` (each push applied at once) and ``ssp`` (bounded staleness:
Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS 2013).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["JobConfig", "MODES", "OPTIMIZERS", "REPLICATION"]

MODES = ("sync", "quorum", "async", "ssp")
OPTIMIZERS = ("sgd", "adam")
REPLICATION = ("chain", "primary_backup")
LATE = ("drop", "fold")


@dataclass(kw_only=True)
class JobConfig:
    """A parameter-server job: its key space, its roles, its consistency, its optimizer and its replication."""

    num_keys: int  # rows in the key space; key k is row k
    width: int  # floats in each row (dense parameters are cut into rows of this width)
    num_servers: int = 1
    num_workers: int = 1
    mode: str = "sync"
    quorum: int = 0  # quorum mode: pushes that close a round (0: all workers)
    late: str = "drop"  # quorum mode: a push for a closed round is dropped or folded into the open one
    staleness: int = 0  # ssp mode: a worker at clock c waits until every worker reached c - staleness
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    replicas: int = 1  # servers holding each shard
    replication: str = "chain"  # chain (ack after the tail applied) or primary_backup (ack by the leader)
    propagate_interval_s: float = 0.02  # primary_backup: the leader ships updates to followers this often
    hot_keys: int = 0  # per server: the hottest rows copied to other servers (0: off)
    hot_replicas: int = 1  # other servers each hot row is copied to
    hot_after: int = 10  # rounds of counting before a server picks its hot rows
    hot_min_share: float = 0.01  # a hot row is in at least this share of the pulls its owner answered
    heartbeat_s: float = 0.05
    dead_after_s: float = 1.0  # a server silent this long is declared dead
    timeout_s: float = 30.0  # a request with no answer this long is an error naming the server

    def __post_init__(self) -> None:
        for name in ("num_keys", "width", "num_servers", "num_workers", "replicas", "hot_replicas", "hot_after"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"JobConfig.{name} must be a positive int, got {value!r}")
        for name, allowed in (("mode", MODES), ("optimizer", OPTIMIZERS), ("replication", REPLICATION)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"JobConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.late not in LATE:
            raise ValueError(f"JobConfig.late must be one of {LATE}, got {self.late!r}")
        if not 0 <= self.quorum <= self.num_workers:
            raise ValueError(f"JobConfig.quorum must be in [0, num_workers={self.num_workers}], got {self.quorum}")
        if self.staleness < 0 or self.hot_keys < 0:
            raise ValueError(f"staleness and hot_keys must be >= 0, got {self.staleness}, {self.hot_keys}")
        if self.num_keys < self.num_servers:
            raise ValueError(f"num_keys={self.num_keys} must be at least num_servers={self.num_servers}")
        if self.replicas > self.num_servers:
            raise ValueError(f"replicas={self.replicas} needs at least that many servers, got {self.num_servers}")
        if self.hot_keys and (self.replicas > 1 or self.hot_replicas >= self.num_servers):
            raise ValueError(
                f"hot-key copies need replicas=1 and hot_replicas < num_servers; got replicas={self.replicas}, "
                f"hot_replicas={self.hot_replicas}, num_servers={self.num_servers}"
            )
        if not 0.0 <= self.hot_min_share <= 1.0:
            raise ValueError(f"JobConfig.hot_min_share must be in [0, 1], got {self.hot_min_share}")
        for name in ("lr", "heartbeat_s", "dead_after_s", "timeout_s", "propagate_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"JobConfig.{name} must be > 0, got {getattr(self, name)}")

    @property
    def round_size(self) -> int:
        """Pushes that close a round: all workers in sync mode, ``quorum`` in quorum mode."""
        return self.quorum if self.mode == "quorum" and self.quorum else self.num_workers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """Rebuild from :meth:`to_dict`'s map; unknown or missing fields are a ``ValueError``."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - names:
            raise ValueError(
                f"unknown JobConfig fields: {sorted(set(data) - names) if isinstance(data, dict) else data}"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"bad JobConfig: {exc}") from None
