"""The one validated description of a parameter-server job, shared by every role.

The coordinator holds it and hands it to each server and worker as a msgpack map when they register, so a
cluster is configured in one place. Modes: ``sync`` (bulk synchronous: every worker's gradient, then one averaged
step), ``quorum`` (the first ``quorum`` of N workers close a round, so a straggler does not hold the others back;
the backup-worker idea of Chen et al., "Revisiting Distributed Synchronous SGD", 2016), ``async`` (each push
applied at once, as in Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014)
and ``ssp`` (bounded staleness: Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel
Parameter Server", NIPS 2013).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["JobConfig", "JobConfigError", "MODES", "OPTIMIZERS", "REPLICATION"]

MODES = ("sync", "quorum", "async", "ssp")
OPTIMIZERS = ("sgd", "adam")
REPLICATION = ("chain", "primary_backup")
LATE = ("drop", "fold")


class JobConfigError(ValueError):
    """A bad :class:`JobConfig` field. The message names fields as ``<name>`` in :attr:`template`; ``str()`` shows
    them as ``JobConfig``'s field names, :meth:`worded` as whatever the caller's user typed (a command's flags)."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__("JobConfig: " + self.worded({}))

    def worded(self, names: Mapping[str, str]) -> str:
        """The message with each field ``<f>`` shown as ``names.get(f, f)``."""
        known = {f.name for f in fields(JobConfig)}
        return re.sub(r"<(\w+)>", lambda m: names.get(m[1], m[1]) if m[1] in known else m[0], self.template)


MAX_INT = 1 << 62
"""Bound of every int field: the job travels to every role as msgpack, and counters derived from it stay int64."""
_INTS = ("num_keys", "width", "num_servers", "num_workers", "replicas", "hot_replicas", "hot_after")
_FLOATS = ("lr", "momentum", "weight_decay", "beta1", "beta2", "eps", "propagate_interval_s", "hot_min_share",
           "heartbeat_s", "dead_after_s", "timeout_s")  # fmt: skip


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
        for name in _INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise JobConfigError(f"<{name}> must be a positive int, got {value!r}")
        for name, allowed in (("mode", MODES), ("optimizer", OPTIMIZERS), ("replication", REPLICATION), ("late", LATE)):
            if getattr(self, name) not in allowed:
                raise JobConfigError(f"<{name}> must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("quorum", "staleness", "hot_keys"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise JobConfigError(f"<{name}> must be an int >= 0, got {value!r}")
        for name in (*_INTS, "quorum", "staleness", "hot_keys"):
            if getattr(self, name) >= MAX_INT:  # every role gets the job as msgpack, whose ints end at 2**64
                raise JobConfigError(f"<{name}> must be below 2**62, got {getattr(self, name)}")
        for name in _FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise JobConfigError(f"<{name}> must be a finite number, got {value!r}")
        if self.quorum > self.num_workers:
            raise JobConfigError(f"<quorum> must be in [0, <num_workers>={self.num_workers}], got {self.quorum}")
        if self.num_keys < self.num_servers:
            raise JobConfigError(f"<num_keys>={self.num_keys} must be at least <num_servers>={self.num_servers}")
        if self.replicas > self.num_servers:
            raise JobConfigError(
                f"<replicas>={self.replicas} needs at least that many servers, got <num_servers>={self.num_servers}"
            )
        if self.hot_keys and (self.replicas > 1 or self.hot_replicas >= self.num_servers):
            raise JobConfigError(
                f"<hot_keys> needs <replicas>=1 and <hot_replicas> < <num_servers>; got <replicas>={self.replicas}, "
                f"<hot_replicas>={self.hot_replicas}, <num_servers>={self.num_servers}"
            )
        if not 0.0 <= self.hot_min_share <= 1.0:
            raise JobConfigError(f"<hot_min_share> must be in [0, 1], got {self.hot_min_share}")
        for name in ("lr", "eps", "heartbeat_s", "dead_after_s", "timeout_s", "propagate_interval_s"):
            if not getattr(self, name) > 0:
                raise JobConfigError(f"<{name}> must be > 0, got {getattr(self, name)}")
        for name in ("momentum", "weight_decay"):
            if not getattr(self, name) >= 0:
                raise JobConfigError(f"<{name}> must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise JobConfigError(f"<{name}> must be in [0, 1), got {getattr(self, name)}")

        # a shard travels whole in one message (init, a replica's catch-up): it must fit the wire's message limit
        from dtrain.ps.wire import Limits

        shard_bytes = -(-self.num_keys // self.num_servers) * self.width * 4 + (1 << 16)
        limit = Limits().max_message_bytes
        if shard_bytes > limit:
            raise JobConfigError(
                f"a shard of <num_keys>={self.num_keys} over <num_servers>={self.num_servers} in rows of "
                f"<width>={self.width} floats is {shard_bytes / 2**20:,.0f} MiB, above the {limit >> 20} MiB a "
                "message may carry: use more <num_servers> or a smaller <width>"
            )
        if self.replicas > 1 and self.replication == "primary_backup":  # a new leader sends its whole state at once
            from dtrain.ps.optimizers import make_optimizer

            row_bytes = self.width * 4 + sum(a.nbytes for a in make_optimizer(self, 1, self.width).arrays().values())
            state_bytes = -(-self.num_keys // self.num_servers) * row_bytes + 24 * self.num_workers + (1 << 16)
            if state_bytes > limit:
                raise JobConfigError(
                    f"a shard's rows and {self.optimizer} state under <replication>=primary_backup are "
                    f"{state_bytes / 2**20:,.0f} MiB, above the {limit >> 20} MiB a message may carry (a new leader "
                    "sends them whole to its followers): use more <num_servers> or a smaller <width>"
                )

    @property
    def round_size(self) -> int:
        """Pushes that close a round: all workers in sync mode, ``quorum`` in quorum mode."""
        return self.quorum if self.mode == "quorum" and self.quorum else self.num_workers

    def hot_copy_servers(self, shard: int) -> list[int]:
        """The servers that hold copies of ``shard``'s hot rows: the ``hot_replicas`` servers after its owner
        (server ``shard``, as hot-key copies need ``replicas=1``)."""
        return [(shard + 1 + j) % self.num_servers for j in range(self.hot_replicas)]

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
