"""The server role: holds replicas of some shards, answers workers' push / pull / init, replicates, heartbeats.

One thread, one ZeroMQ ROUTER socket that workers and peer servers send to, one DEALER to the coordinator
(registration, heartbeats, membership changes) and one DEALER per peer it replicates to. Every message is
checked by :func:`dtrain.ps.wire.decode` and then against the request's schema (the shard is here and led by
this server, keys int64 and inside the shard's range, gradients float32 ``(n, width)``): a bad one gets an error
reply or, when it is not authenticated, is dropped and counted; the server keeps serving either way.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import zmq

from dtrain.ps import wire
from dtrain.ps.config import JobConfig
from dtrain.ps.consistency import Push
from dtrain.ps.hotkeys import HotCopies
from dtrain.ps.keys import partition
from dtrain.ps.replication import Replica
from dtrain.ps.shard import Entry
from dtrain.ps.transport import Endpoint, await_message

__all__ = ["Server", "RequestError", "NotLeaderError"]


class RequestError(ValueError):
    """A well-formed, authenticated request that asks for something this server cannot do."""


class NotLeaderError(RequestError):
    """A request for a shard this server does not lead (now): the worker may hold an older layout, or a newer."""


class Server:
    """A parameter server process's state and event loop."""

    def __init__(self, coordinator: str, secret: bytes, rank: int, host: str = "127.0.0.1") -> None:
        self.secret, self.rank = secret, rank
        self.ctx = zmq.Context()
        self.router = wire.configure_socket(self.ctx.socket(zmq.ROUTER))
        self.router.bind(f"tcp://{host}:0" if ":" not in host else f"tcp://{host}")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.coord = Endpoint(self.ctx, coordinator, secret, "coordinator")
        self.coord.send({"op": "register", "role": "server", "rank": rank, "endpoint": self.endpoint})
        welcome = await_message(self.coord, "welcome", 60.0)
        self.config = JobConfig.from_dict(welcome.header["config"])
        self.ranges = partition(self.config.num_keys, self.config.num_servers)
        self.replicas: dict[int, Replica] = {}
        self.peers: dict[int, Endpoint] = {}
        self.endpoints: list[str | None] = []
        self.deferred: dict[int, list[tuple]] = {}
        self.hot = HotCopies(self.config, rank, self.ranges, self._send_peer)
        self.counts = {"rejected": 0, "errors": 0, "pulls": 0, "rows_served": 0, "pushes": 0}
        self.guard = wire.ReplayGuard()
        self.running = True
        self._layout(welcome.header["layout"])

    # membership ------------------------------------------------------------------------------------------
    def _layout(self, layout: dict) -> None:
        self.endpoints = layout["endpoints"]
        for peer in [p for p in self.peers if self.endpoints[p] is None]:
            self.peers.pop(peer).close()
        for shard, chain in enumerate(layout["chains"]):
            if self.rank in chain and shard not in self.replicas:
                self.replicas[shard] = Replica(self.config, shard, self.ranges[shard], self.rank, self._send_peer,
                                               self._ack)  # fmt: skip
            if shard in self.replicas:
                self.replicas[shard].set_chain(chain)
                self._serve_deferred(shard)

    def _send_peer(self, rank: int, header: dict, tensors: list) -> None:
        if self.endpoints[rank] is None:
            return
        if rank not in self.peers:
            self.peers[rank] = Endpoint(self.ctx, self.endpoints[rank], self.secret, f"server {rank}")
        self.peers[rank].send(header, tensors)

    def _reply(self, reply: tuple, header: dict, tensors: list = ()) -> None:
        ident, req = reply
        self.router.send_multipart([ident, *wire.encode(self.secret, {"op": "reply", "req": req, **header}, tensors)],
                                   copy=False)  # fmt: skip

    def _ack(self, reply: tuple, header: dict) -> None:
        if reply:
            self._reply(reply, header)

    # requests --------------------------------------------------------------------------------------------
    def _replica(self, header: dict, head: bool = True) -> Replica:
        shard = header.get("shard")
        replica = self.replicas.get(shard) if isinstance(shard, int) else None
        if replica is None or (head and not replica.is_head):
            raise NotLeaderError(f"server {self.rank} does not lead shard {shard!r}")
        return replica

    def _keys(self, replica: Replica, tensors: list, values: bool) -> tuple[np.ndarray, np.ndarray | None]:
        if len(tensors) != (2 if values else 1) or tensors[0].dtype != np.int64 or tensors[0].ndim != 1:
            raise RequestError("expected int64 keys (n,)" + (" and float32 values (n, width)" if values else ""))
        keys = tensors[0]
        if not replica.state.key_range.holds(keys):
            r = replica.state.key_range
            raise RequestError(f"keys outside shard {replica.index}'s range [{r.lo}, {r.hi})")
        if values and (tensors[1].dtype != np.float32 or tensors[1].shape != (keys.size, self.config.width)):
            raise RequestError(f"values must be float32 ({keys.size}, {self.config.width}), got "
                               f"{tensors[1].dtype} {tensors[1].shape}")  # fmt: skip
        return keys, tensors[1] if values else None

    def _worker(self, header: dict) -> int:
        worker = header.get("worker")
        if not isinstance(worker, int) or not 0 <= worker < self.config.num_workers:
            raise RequestError(f"worker must be in [0, {self.config.num_workers}), got {worker!r}")
        return worker

    def _int(self, header: dict, name: str) -> int:
        value = header.get(name)
        if not isinstance(value, int) or value < 0:
            raise RequestError(f"{name} must be a non-negative int, got {value!r}")
        return value

    def _entry(self, h: dict, tensors: list) -> Entry:
        """A replication entry from a peer, checked as a push is before anything is applied."""
        replica = self._replica(h, head=False)
        kind, pushes = h.get("kind"), h.get("pushes")
        if kind not in ("init", "step"):
            raise RequestError(f"replication entry kind must be 'init' or 'step', got {kind!r}")
        if not (isinstance(pushes, list) and all(_is_push(p) for p in pushes)):
            raise RequestError(f"replication entry pushes must be [worker, push_id, clock] ints, got {pushes!r}")
        if any(p[0] >= self.config.num_workers for p in pushes):
            raise RequestError(f"replication entry names a worker beyond {self.config.num_workers}: {pushes!r}")
        if kind == "step":
            keys, values = self._keys(replica, tensors, values=True)
        else:
            shape = replica.state.weights_shape
            if len(tensors) != 2 or tensors[1].dtype != np.float32 or tensors[1].shape != shape:
                raise RequestError(f"an init entry carries float32 rows {shape}")
            keys, values = tensors
        return Entry(self._int(h, "seq"), kind, self._int(h, "round"), keys, values, pushes)

    def handle(self, ident: bytes, msg: wire.Message) -> None:
        """Dispatch one authenticated message from a worker or a peer."""
        op, h = msg.op, msg.header
        if op == "rep":
            entry = self._entry(h, msg.tensors)
            self._replica(h, head=False).receive(entry)
            return self._serve_deferred(h["shard"])
        if op == "chain_ack":
            return self._replica(h, head=False).chain_ack(self._int(h, "seq"))
        if op.startswith("hot_"):
            return self.hot.handle(op, h, msg.tensors, self._serve)
        reply = (ident, self._int(h, "req"))
        try:
            self._request(op, h, msg.tensors, reply)
        except RequestError as exc:
            self.counts["errors"] += 1
            code = "not_leader" if isinstance(exc, NotLeaderError) else "bad_request"
            self._reply(reply, {"status": "error", "code": code, "error": str(exc)})

    def _request(self, op: str, h: dict, tensors: list, reply: tuple) -> None:
        if op == "stats":
            return self._reply(reply, {"status": "ok", "stats": self.stats()})
        if op == "dump":
            replica = self._replica(h, head=False)
            names, arrays = zip(*replica.state.arrays().items(), strict=True)
            return self._reply(reply, {"status": "ok", "names": list(names), "seq": replica.state.seq}, arrays)
        if op not in ("pull", "push", "init", "leave"):
            raise RequestError(f"unknown op {op!r}; a server answers pull, push, init, leave, stats and dump")
        if op == "pull" and self.hot.holds(h.get("shard")) and not self._leads(h.get("shard")):
            keys = tensors[0] if len(tensors) == 1 and tensors[0].dtype == np.int64 and tensors[0].ndim == 1 else None
            if keys is None:
                raise RequestError("expected int64 keys (n,)")
            try:
                return self.hot.pull(h["shard"], (reply, self._worker(h), self._int(h, "clock"), keys), self._serve)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        replica = self._replica(h)
        if op == "pull":
            keys, _ = self._keys(replica, tensors, values=False)
            self.hot.count(replica, keys)
            seen = h.get("hot_seen", 0)
            request = (reply, self._worker(h), self._int(h, "clock"), keys, seen if isinstance(seen, int) else 0)
            self.deferred.setdefault(replica.index, []).append(request)
            return self._serve_deferred(replica.index)
        if not replica.is_head:
            raise NotLeaderError(f"server {self.rank} does not lead shard {replica.index} (pushes go to the leader)")
        if op == "leave":
            replica.leave(self._worker(h))
            self._reply(reply, {"status": "ok"})
            return self._serve_deferred(replica.index)
        if op == "init":
            shape = replica.state.weights_shape
            if replica.state.ready or len(tensors) != 1 or tensors[0].shape != shape or tensors[0].dtype != np.float32:
                raise RequestError(f"init of shard {replica.index}: once, float32 {shape}")
            replica.init(np.array(tensors[0], dtype=np.float32), Push(0, -1, -1, None, None, reply))
            return self._serve_deferred(replica.index)
        if op == "push":
            keys, grads = self._keys(replica, tensors, values=True)
            if not replica.state.ready:
                raise RequestError(f"shard {replica.index} is not initialised yet")
            self.counts["pushes"] += 1
            push = Push(self._worker(h), self._int(h, "push_id"), self._int(h, "clock"), keys, grads, reply)
            replica.push(push)
            self.hot.after_update(replica)
            return self._serve_deferred(replica.index)

    def _leads(self, shard: object) -> bool:
        return isinstance(shard, int) and shard in self.replicas and self.replicas[shard].is_head

    def _serve(self, reply: tuple, round_: int, rows: np.ndarray, nkeys: int, extra: tuple = ({}, [])) -> None:
        self.counts["pulls"] += 1
        self.counts["rows_served"] += nkeys
        self._reply(reply, {"status": "ok", "round": round_, **extra[0]}, [rows, *extra[1]])

    def _serve_deferred(self, shard: int) -> None:
        replica, waiting = self.replicas.get(shard), self.deferred.get(shard, [])
        if replica is None or not waiting:
            return
        if not replica.is_head:  # lost the lead: the workers resend these to the new leader
            self.deferred[shard] = []
            return
        still = []
        for request in waiting:
            reply, worker, clock, keys, seen = request
            if not replica.state.ready or not replica.policy.pull_ready(worker, clock):
                still.append(request)
                continue
            extra = self.hot.advertise(shard, seen)
            self._serve(reply, replica.state.round, replica.state.rows(keys), int(keys.size), extra)
        self.deferred[shard] = still

    def stats(self) -> dict:
        """Counters of this server and of each shard it holds."""
        shards = {}
        for i, r in self.replicas.items():
            policy = r.policy
            shards[str(i)] = {"seq": r.state.seq, "round": r.state.round, "head": r.is_head,
                              "applied": r.state.applied.tolist(), "dropped": policy.dropped if policy else 0,
                              "folded": policy.folded_total if policy else 0,
                              "staleness": policy.staleness_log if policy else []}  # fmt: skip
        return {"rank": self.rank, **self.counts, "shards": shards, "hot": self.hot.stats()}

    # the loop --------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until told to stop (by the coordinator or a ``stop`` request)."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.coord.sock, zmq.POLLIN)
        tick = min(self.config.heartbeat_s, self.config.propagate_interval_s)
        next_tick = 0.0
        while self.running:
            events = dict(poller.poll(timeout=tick * 1000))
            if self.router in events:
                self._drain_router(tick)
            if self.coord.sock in events:
                self._drain_coordinator()
            now = time.monotonic()
            if now >= next_tick:
                self.coord.send({"op": "hb", "rank": self.rank})
                for replica in self.replicas.values():
                    replica.ship()
                next_tick = now + tick
        self.ctx.destroy(linger=0)

    def _drain_router(self, budget_s: float) -> None:
        """Handle waiting messages for at most ``budget_s``, so heartbeats go out even under a flood."""
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = wire.decode(self.secret, frames[1:], guard=self.guard)
            except wire.WireError:
                self.counts["rejected"] += 1
                continue
            try:
                self.handle(frames[0].bytes, msg)
            except Exception as exc:  # an authenticated but malformed message must not end the server
                self.counts["errors"] += 1
                print(f"server {self.rank}: bad {msg.op!r} message: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _drain_coordinator(self) -> None:
        while (msg := self.coord.try_recv()) is not None:
            if msg.op == "layout":
                self._layout(msg.header["layout"])
            elif msg.op == "stop":
                self.running = False


def _is_push(push: object) -> bool:
    return isinstance(push, list) and len(push) == 3 and all(type(v) is int and v >= 0 for v in push)
