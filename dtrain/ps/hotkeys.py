"""Hot keys: count accesses, copy a shard's hottest rows to other servers, spread pulls over the copies.

Under a power-law key distribution (as in the sparse, high-dimensional data of Li et al., "Scaling Distributed
Machine Learning with the Parameter Server", OSDI 2014) a few rows take most requests, so the server that owns
them is the bottleneck; copying those rows to several servers spreads the reads. Here the owner counts rows
pulled; once its shard reached round ``hot_after`` it picks its (at most) ``hot_keys`` most-pulled rows among
those in at least ``hot_min_share`` of its pulls and installs copies on the next ``hot_replicas`` servers
(:meth:`~dtrain.ps.config.JobConfig.hot_copy_servers`). Pushes still go to the owner only, which combines them
as usual and sends the new values of the hot rows to every copy after each step, with the round they belong to,
so a copy answers a pull under the same consistency rule as the owner. Workers learn the hot rows and their
servers from the owner's pull replies and send pulls of hot rows round-robin over the copies, leaving the owner
its pushes and its other rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.consistency import MAX_WAITING, ahead_refusal
from dtrain.ps.keys import KeyRange
from dtrain.ps.replication import Replica

__all__ = ["HotCopies", "HotRouter"]


class HotCopies:
    """One server's side of hot keys: counters and choices for the shards it owns, copies of others' rows."""

    def __init__(self, config: JobConfig, rank: int, ranges: list[KeyRange], send: Callable) -> None:
        self.config, self.rank, self.ranges, self.send = config, rank, ranges, send
        self.enabled = config.hot_keys > 0
        self.counts: dict[int, np.ndarray] = {}  # owned shard -> pulls of each row
        self.pulls: dict[int, int] = {}  # owned shard -> pulls answered
        self.chosen: dict[int, tuple[np.ndarray, list[int]]] = {}  # owned shard -> (hot keys, copy servers)
        self.copies: dict[int, dict] = {}  # other's shard -> {"keys", "rows", "round", "slowest"}
        self.waiting: dict[int, list[tuple]] = {}

    # owner -----------------------------------------------------------------------------------------------
    def count(self, replica: Replica, keys: np.ndarray) -> None:
        if self.enabled:
            rows = len(self.ranges[replica.index])
            counts = self.counts.setdefault(replica.index, np.zeros(rows, np.int64))
            counts += np.bincount(keys - self.ranges[replica.index].lo, minlength=rows)
            self.pulls[replica.index] = self.pulls.get(replica.index, 0) + 1

    def after_update(self, replica: Replica) -> None:
        """After a push or a ``leave`` at the owner (either may close rounds): pick the hot rows once, then keep every
        copy current."""
        shard = replica.index
        if not self.enabled or not replica.is_head:
            return
        if shard not in self.chosen and replica.state.round >= self.config.hot_after and shard in self.counts:
            counts = self.counts[shard]
            top = np.argsort(-counts, kind="stable")[: self.config.hot_keys]
            # only rows that are hot in absolute terms: a cold shard's "top" rows are not worth copying
            top = top[counts[top] >= self.config.hot_min_share * self.pulls[shard]]
            servers = self.config.hot_copy_servers(shard)
            self.chosen[shard] = (np.sort(top + self.ranges[shard].lo).astype(np.int64), servers if top.size else [])
        if shard in self.chosen:
            keys, servers = self.chosen[shard]
            header = {"op": "hot_update", "shard": shard, "round": replica.state.round,
                      "slowest": int(replica.state.clocks.min())}  # fmt: skip
            for server in servers:
                self.send(server, header, [keys, replica.state.rows(keys)])

    def advertise(self, shard: int, seen: int) -> tuple[dict, list]:
        """What an owner's pull reply adds for a worker that has seen ``seen`` hot sets of ``shard``."""
        if shard not in self.chosen or seen >= 1:
            return {}, []
        keys, servers = self.chosen[shard]
        return {"hot_version": 1, "hot_servers": servers}, [keys]

    # copy holder -----------------------------------------------------------------------------------------
    def holds(self, shard: int) -> bool:
        return shard in self.copies

    def update(
        self, shard: int, round_: int, slowest: int, keys: np.ndarray, rows: np.ndarray, serve: Callable
    ) -> None:
        """``hot_update`` from ``shard``'s owner: its hot ``keys`` (sorted) and their ``rows`` as of ``round_`` (and
        the slowest worker's clock); answer the pulls that are now ready. The message was checked against its
        schema and the job (:data:`dtrain.ps.messages.SERVER`): hot keys are on, this server is one of the
        shard's copy holders, the keys lie in the shard, the rows are ``width`` wide."""
        self.copies[shard] = {"keys": keys, "rows": rows, "round": round_, "slowest": slowest}
        self.serve(shard, serve)

    def pull(self, shard: int, request: tuple, serve: Callable) -> None:
        """A pull of rows copied here; ``request`` is ``(reply, worker, clock, keys)``. ``ValueError`` (and nothing
        kept) for keys not copied here, a clock too far ahead of the copy, or a worker with too many waiting."""
        _, worker, clock, keys = request
        copy = self.copies[shard]
        if not np.isin(keys, copy["keys"]).all():
            raise ValueError(f"server {self.rank} holds copies of shard {shard}'s hot rows only")
        c = self.config
        reason = ahead_refusal(c.mode, clock, copy["round"], copy["slowest"], c.staleness)
        if reason:
            raise ValueError(f"pull of shard {shard}'s hot rows: {reason}")
        if sum(r[1] == worker for r in self.waiting.get(shard, [])) >= MAX_WAITING:
            raise ValueError(f"worker {worker} has {MAX_WAITING} pulls of shard {shard}'s hot rows waiting already")
        self.waiting.setdefault(shard, []).append(request)
        self.serve(shard, serve)

    def serve(self, shard: int, serve: Callable) -> None:
        copy, still = self.copies[shard], []
        for reply, worker, clock, keys in self.waiting.get(shard, []):
            if self._ready(copy, clock):
                serve(reply, copy["round"], copy["rows"][np.searchsorted(copy["keys"], keys)], keys.size)
            else:
                still.append((reply, worker, clock, keys))
        self.waiting[shard] = still

    def _ready(self, copy: dict, clock: int) -> bool:
        if self.config.mode in ("sync", "quorum"):
            return copy["round"] >= clock
        if self.config.mode == "ssp":
            return copy["slowest"] >= clock - self.config.staleness
        return True

    def stats(self) -> dict:
        return {"owned_hot": {str(s): len(k) for s, (k, _) in self.chosen.items()}, "copies": len(self.copies)}


class HotRouter:
    """A worker's side: which rows are hot and where their copies are; picks a server for each pull."""

    def __init__(self, start: int = 0) -> None:
        self.hot: dict[int, tuple[np.ndarray, list[int]]] = {}
        self.turn = start  # workers start at different servers, so their pulls spread from the first one

    def seen(self, shard: int) -> int:
        return 1 if shard in self.hot else 0

    def learn(self, shard: int, header: dict, tensors: list) -> None:
        if "hot_version" in header and len(tensors) > 1:
            self.hot[shard] = (np.array(tensors[1], dtype=np.int64), list(header["hot_servers"]))

    def split(self, shard: int, keys: np.ndarray) -> tuple[np.ndarray, int | None]:
        """Mask of ``keys`` to pull from a copy, and which server holds it (``None``: all go to the owner)."""
        if shard not in self.hot:
            return np.zeros(keys.size, bool), None
        hot_keys, servers = self.hot[shard]
        if not servers:
            return np.zeros(keys.size, bool), None
        # the copies take every pull of a hot row, in turn; the owner keeps the pushes and the other rows
        self.turn += 1
        return np.isin(keys, hot_keys), servers[self.turn % len(servers)]
