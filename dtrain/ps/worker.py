"""The worker role's API, ps-lite style: ``push(keys, values)`` and ``pull(keys)`` return a handle; ``wait``.

A call splits its keys by range over the shards (:func:`dtrain.ps.keys.split_by_range`), sends one request to
each shard's head at once and returns; :meth:`Worker.wait` gathers the answers. Requests not answered when a
new layout arrives from the coordinator (a server died, a follower was promoted) are sent again to the new
heads with the same push ids, so a server recognises pushes it already holds. A request with no answer within
the job's ``timeout_s`` raises :class:`PSTimeoutError` naming the server, its address, the op and the shard.

Clocks: in every mode but ``async`` each push and pull goes to every shard (empty when no key of it is
involved), so every shard sees every worker's progress. In ``sync`` and ``quorum`` mode a push carries the round
of the values its gradient was computed from and a pull asks for the round after the last push; in ``ssp``
mode both carry the worker's clock, advanced by :meth:`Worker.tick`. A server's ``not_leader`` answer (the
layout reached it before or after this worker) is retried every 20 ms until ``timeout_s``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from dtrain.ps import messages
from dtrain.ps.config import JobConfig
from dtrain.ps.hotkeys import HotRouter
from dtrain.ps.keys import partition, split_by_range
from dtrain.ps.optimizers import rows_index
from dtrain.ps.transport import Endpoint, PSError, PSTimeoutError, await_message

__all__ = ["Worker", "PSError", "PSTimeoutError"]


@dataclass
class _Request:
    handle: int
    shard: int
    server: int
    header: dict
    tensors: list
    positions: np.ndarray | None  # pull: where its rows go in the handle's result
    inverse: np.ndarray | None = None  # pull: for each of those places, which of the distinct keys sent
    copy: bool = False  # pull from a hot-row copy rather than the shard's head
    sent_at: float = 0.0
    first_sent: float = 0.0
    retry_at: float = 0.0


@dataclass
class _Handle:
    kind: str
    left: int
    result: np.ndarray | None = None
    statuses: list[str] = field(default_factory=list)


class Worker:
    """One worker process's connection to the parameter server (see the module docstring)."""

    def __init__(self, coordinator: str, secret: bytes, rank: int, register_timeout_s: float = 60.0) -> None:
        self.rank, self.secret = rank, secret
        self.ctx = zmq.Context()
        self.coord = Endpoint(self.ctx, coordinator, secret, "coordinator")
        self.coord.send({"op": "register", "role": "worker", "rank": rank})
        try:
            welcome = await_message(self.coord, "welcome", register_timeout_s)
            # the job first (the welcome's other fields are checked against it), then the whole welcome
            self.config: JobConfig = messages.job_config(welcome.header)
            messages.check(messages.WORKER_CONTROL, "welcome", welcome.header, welcome.tensors, self.config)
        except messages.MessageError as exc:
            self.ctx.destroy(linger=0)
            raise PSError(f"worker {rank}: a malformed welcome from the coordinator at {coordinator}: {exc}") from None
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.layout = welcome.header["layout"]
        self.ranges = partition(self.config.num_keys, self.config.num_servers)
        self.servers: dict[int, Endpoint] = {}
        self.requests: dict[int, _Request] = {}
        self.handles: dict[int, _Handle] = {}
        self._ids = itertools.count(1)
        shards = self.config.num_servers
        self.push_ids = [0] * shards
        self.round_of = [0] * shards
        self.pushed = [False] * shards
        self.clock = 0
        self.hot = HotRouter(start=rank)
        # pushes acknowledged per status ("applied", "dropped", "folded"), per shard
        self.acks = {status: np.zeros(shards, np.int64) for status in ("applied", "dropped", "folded")}
        self.failovers = 0
        self.retries: list[_Request] = []

    # the API ---------------------------------------------------------------------------------------------
    def init(self, values: np.ndarray) -> int:
        """Worker 0 only: the initial value of every row, ``(num_keys, width)`` float32."""
        c = self.config
        if values.shape != (c.num_keys, c.width) or values.dtype != np.float32:
            raise ValueError(f"init needs float32 ({c.num_keys}, {c.width}), got {values.dtype} {values.shape}")
        handle = self._handle("init", c.num_servers)
        for shard, r in enumerate(self.ranges):
            self._send(_Request(handle, shard, self._head(shard), {"op": "init", "shard": shard},
                                [values[r.lo : r.hi]], None))  # fmt: skip
        return handle

    def push(self, keys: np.ndarray, values: np.ndarray) -> int:
        """Send gradients ``values`` ``(n, width)`` float32 of ``keys`` ``(n,)`` int64 (any order); a handle to wait
        on. A key given more than once has its gradients summed, as an embedding's gradient sums over repeated
        ids; across workers the step then takes the mean of these sums."""
        keys, values = self._check(keys), np.ascontiguousarray(values, dtype=np.float32)
        if values.shape != (keys.size, self.config.width):
            raise ValueError(f"push of {keys.size} keys needs values ({keys.size}, {self.config.width}), "
                             f"got {values.shape}")  # fmt: skip
        parts = self._parts(keys, every_shard=self.config.mode != "async")
        handle = self._handle("push", len(parts))
        for shard, pos in parts:
            clock = self.round_of[shard] if self.config.mode in ("sync", "quorum") else self.clock
            header = {"op": "push", "shard": shard, "worker": self.rank, "push_id": self.push_ids[shard],
                      "clock": clock}  # fmt: skip
            self.push_ids[shard] += 1
            self.pushed[shard] = True
            self._send(_Request(handle, shard, self._head(shard), header, [keys[pos], values[pos]], None))
        return handle

    def pull(self, keys: np.ndarray) -> int:
        """Ask for the rows of ``keys`` (any order, repeats allowed); ``wait`` returns them ``(n, width)`` in the
        order of ``keys``, a repeated key's row at each of its places. Each server is asked for a key once (it
        refuses repeats), so an answer is never larger than the shard."""
        keys = self._check(keys)
        parts = self._parts(keys, every_shard=self.config.mode != "async")
        handle = self._handle("pull", 0)
        self.handles[handle].result = np.empty((keys.size, self.config.width), np.float32)
        for shard, pos in parts:
            if self.config.mode in ("sync", "quorum"):
                clock = self.round_of[shard] + int(self.pushed[shard])
            else:
                clock = self.clock
            self.pushed[shard] = False
            copy_mask, copy_server = self.hot.split(shard, keys[pos])
            for mask, server, copy in ((~copy_mask, self._head(shard), False), (copy_mask, copy_server, True)):
                if server is None or (copy and not mask.any()):
                    continue
                header = {"op": "pull", "shard": shard, "worker": self.rank, "clock": clock,
                          "hot_seen": self.hot.seen(shard)}  # fmt: skip
                self.handles[handle].left += 1
                part, inverse = keys[pos][mask], None
                if part.size > 1 and not bool((part[1:] > part[:-1]).all()):  # repeats or out of order: send each once
                    part, inverse = np.unique(part, return_inverse=True)
                self._send(_Request(handle, shard, server, header, [part], pos[mask], inverse, copy=copy))
        return handle

    def tick(self) -> None:
        """One iteration done (ssp clocks)."""
        self.clock += 1

    def wait(self, handle: int) -> np.ndarray | list[str]:
        """Block until every part of ``handle`` is answered: pulled rows, or the push's per-shard statuses."""
        while self.handles[handle].left > 0:
            self._progress()
        done = self.handles.pop(handle)
        return done.result if done.kind == "pull" else done.statuses

    def leave(self) -> None:
        """Tell every shard this worker is done, so rounds stop waiting for it (call once, at the end)."""
        handle = self._handle("leave", self.config.num_servers)
        for shard in range(self.config.num_servers):
            self._send(_Request(handle, shard, self._head(shard), {"op": "leave", "shard": shard,
                                                                   "worker": self.rank}, [], None))  # fmt: skip
        self.wait(handle)

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    # internals -------------------------------------------------------------------------------------------
    def _check(self, keys: np.ndarray) -> np.ndarray:
        keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        if keys.size and (keys.min() < 0 or keys.max() >= self.config.num_keys):
            raise ValueError(f"keys must be in [0, {self.config.num_keys}), got [{keys.min()}, {keys.max()}]")
        return keys

    def _parts(self, keys: np.ndarray, every_shard: bool) -> list[tuple[int, np.ndarray]]:
        groups = split_by_range(keys, self.ranges)
        return [(s, pos) for s, pos in enumerate(groups) if every_shard or pos.size]

    def _handle(self, kind: str, left: int) -> int:
        handle = next(self._ids)
        self.handles[handle] = _Handle(kind, left)
        return handle

    def _head(self, shard: int) -> int:
        chain = self.layout["chains"][shard]
        if not chain:
            raise PSError(f"shard {shard} has no live server left (every replica died)")
        return chain[0]

    def _send(self, req: _Request) -> None:
        req_id = next(self._ids)
        req.header["req"] = req_id
        req.sent_at = time.monotonic()
        req.first_sent = req.first_sent or req.sent_at
        self.requests[req_id] = req
        if req.server not in self.servers:
            address = self.layout["endpoints"][req.server]
            self.servers[req.server] = Endpoint(self.ctx, address, self.secret, f"server {req.server}")
        self.servers[req.server].send(req.header, req.tensors)

    def _progress(self) -> None:
        poller = zmq.Poller()
        poller.register(self.coord.sock, zmq.POLLIN)
        for ep in self.servers.values():
            poller.register(ep.sock, zmq.POLLIN)
        events = dict(poller.poll(timeout=50))
        if self.coord.sock in events:
            while (msg := self.coord.try_recv()) is not None:
                try:
                    messages.check(messages.WORKER_CONTROL, msg.op, msg.header, msg.tensors, self.config)
                except messages.MessageError as exc:
                    raise PSError(f"worker {self.rank}: a malformed message from the coordinator: {exc}") from None
                if msg.op == "layout":
                    self._relayout(msg.header["layout"])
        for ep in list(self.servers.values()):
            if ep.sock in events:
                while (msg := ep.try_recv()) is not None:
                    self._answer(msg)
        self._check_timeouts()

    def _answer(self, msg) -> None:
        req_id = msg.header.get("req")
        req = self.requests.pop(req_id, None) if type(req_id) is int else None
        if req is None:
            return  # an answer to a request already resent elsewhere
        handle, h = self.handles[req.handle], msg.header
        try:
            if msg.op != "reply":
                raise messages.MessageError(f"a server sends a worker replies only, got {msg.op!r}")
            keys = req.tensors[0] if req.header["op"] == "pull" else None
            n = None if keys is None else keys.shape[0]
            messages.check(messages.WORKER_REPLIES, req.header["op"], h, msg.tensors, self.config, shard=req.shard, n=n,
                           keys=keys)  # fmt: skip
        except messages.MessageError as exc:
            raise PSError(f"server {req.server} answered {req.header['op']} of shard {req.shard} with a malformed "
                          f"reply: {exc}") from None  # fmt: skip
        if h.get("status") == "error" and h.get("code") == "not_leader":
            self._retry(req)  # layouts reach servers and workers in either order: ask again shortly
            return
        if h.get("status") == "error":
            raise PSError(f"server {req.server} refused {req.header['op']} of shard {req.shard}: {h.get('error')}")
        if req.header["op"] == "pull":
            rows = msg.tensors[0] if req.inverse is None else msg.tensors[0][req.inverse.reshape(-1)]
            handle.result[rows_index(req.positions)] = rows
            self.round_of[req.shard] = max(self.round_of[req.shard], h["round"])
            if not req.copy:
                self.hot.learn(req.shard, h, msg.tensors)
        elif req.header["op"] == "push":
            status = h["status"]
            handle.statuses.append(status)
            self.acks[status][req.shard] += 1
        handle.left -= 1

    def _retry(self, req: _Request) -> None:
        if time.monotonic() - req.first_sent > self.config.timeout_s:
            raise PSError(f"server {req.server} does not lead shard {req.shard} after {self.config.timeout_s} s")
        req.retry_at = time.monotonic() + 0.02
        self.retries.append(req)

    def _relayout(self, layout: dict) -> None:
        """A new layout: resend every unanswered request whose server is gone to the shard's new head."""
        self.layout = layout
        self.failovers += 1
        for rank in [r for r in self.servers if layout["endpoints"][r] is None]:
            self.servers.pop(rank).close()
        for req_id, req in list(self.requests.items()):
            if layout["endpoints"][req.server] is None:
                del self.requests[req_id]
                req.server, req.copy = self._head(req.shard), False
                self._send(req)

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        due = [r for r in self.retries if r.retry_at <= now]
        self.retries = [r for r in self.retries if r.retry_at > now]
        for req in due:
            req.server, req.copy = self._head(req.shard), False
            self._send(req)
        for req in self.requests.values():
            if now - req.sent_at > self.config.timeout_s:
                address = self.layout["endpoints"][req.server]
                raise PSTimeoutError(
                    f"worker {self.rank}: no answer from server {req.server} at {address} to "
                    f"{req.header['op']} of shard {req.shard} within {self.config.timeout_s} s"
                )
