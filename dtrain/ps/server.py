"""The server role: holds replicas of some shards, answers workers' push / pull / init, replicates, heartbeats.

One thread, one ZeroMQ ROUTER socket that workers and peer servers send to, one DEALER to the coordinator (registration,
heartbeats, membership changes) and one DEALER per peer it replicates to. Every message is checked by
:func:`dtrain.ps.wire.decode` (envelope, HMAC, freshness), then by who signed it (replication entries, chain
acknowledgements, a leader's whole state and hot-row copies only with the job's secret, which workers are not given),
then against its kind's schema and the job's configuration (:mod:`dtrain.ps.messages`: shard ids in range, ints bounded,
keys int64 inside the shard's range, a pull's keys distinct, rows float32 ``(n, width)`` and finite, hot-key copies and
replication entries only where the job has them), then, for a peer's message, against this server's view
(:meth:`Server._sender_refusal`; one sent in a view whose layout has not arrived here waits for it), then against this
server's state (the shard is here, initialised where it must be, and for pushes and pulls led by this server; clocks not
too far ahead; an entry whole, :meth:`~dtrain.ps.shard.ShardState.refusal`; a ``chain_ack`` only for an entry applied
here), all before anything changes. A bad request gets an error reply (``not_leader`` or ``bad_request``), and so does
one whose handling fails in any other way (logged too), and one whose answer would be over the size a message may carry;
any other bad message, or one not authenticated, is dropped, logged and counted; the server keeps serving either way.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import zmq

from dtrain.env import PS_HOST, EnvError
from dtrain.ps import messages, wire
from dtrain.ps.consistency import MAX_AHEAD, MAX_WAITING, Push
from dtrain.ps.hotkeys import HotCopies
from dtrain.ps.keys import partition
from dtrain.ps.replication import Replica
from dtrain.ps.shard import Entry, EntryError, Snapshot
from dtrain.ps.transport import Endpoint, PSError, await_message

__all__ = ["Server", "RequestError", "NotLeaderError", "MAX_EARLY"]

MAX_EARLY = 4096
"""Peer messages from a view this server has not reached yet that it keeps until the coordinator's layout of that
view arrives (a peer may act on a new layout before this server has it); more are refused."""


class RequestError(ValueError):
    """A well-formed, authenticated request that asks for something this server cannot do."""


class NotLeaderError(RequestError):
    """A request for a shard this server does not lead (now): the worker may hold an older layout, or a newer."""


class Server:
    """A parameter server process's state and event loop."""

    def __init__(self, coordinator: str, secret: bytes, rank: int, host: str = "127.0.0.1") -> None:
        self.secret, self.rank = secret, rank
        self.worker_key = wire.worker_key(secret)
        self.keys = (self.worker_key, secret)  # what a request may be signed with; peers use the secret
        self.limits = wire.Limits()
        self.ctx = zmq.Context()
        self.router = wire.configure_socket(self.ctx.socket(zmq.ROUTER))
        address = f"tcp://{host}:0" if ":" not in host else f"tcp://{host}"
        try:
            self.router.bind(address)
        except zmq.ZMQError as exc:
            self.ctx.destroy(linger=0)
            raise EnvError(f"{PS_HOST}: server {rank} cannot listen at {address}: {exc}") from None
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.coord = Endpoint(self.ctx, coordinator, secret, "coordinator")
        self.coord.send({"op": "register", "role": "server", "rank": rank, "endpoint": self.endpoint})
        welcome = await_message(self.coord, "welcome", 60.0)
        try:  # the job first (the welcome's other fields are checked against it), then the whole welcome
            self.config = messages.job_config(welcome.header)
            messages.check(messages.SERVER_CONTROL, "welcome", welcome.header, welcome.tensors, self.config)
        except messages.MessageError as exc:
            raise PSError(f"server {rank}: a malformed welcome from the coordinator at {coordinator}: {exc}") from None
        self.ranges = partition(self.config.num_keys, self.config.num_servers)
        self.replicas: dict[int, Replica] = {}
        self.peers: dict[int, Endpoint] = {}
        self.endpoints: list[str | None] = []
        self.chains: list[list[int]] = []
        self.epoch = -1  # the view (layout epoch) this server acts in
        self.early: list[wire.Message] = []  # peer messages of a later view, kept until its layout arrives
        self.deferred: dict[int, list[tuple]] = {}
        self.hot = HotCopies(self.config, rank, self.ranges, self._send_peer)
        self.counts = {"rejected": 0, "errors": 0, "pulls": 0, "rows_served": 0, "pushes": 0}
        self.guard = wire.ReplayGuard()
        self.running = True
        self._layout(welcome.header["layout"])

    # membership ------------------------------------------------------------------------------------------
    def _layout(self, layout: dict) -> None:
        if layout["epoch"] < self.epoch:  # an older view than this server's: nothing to act on
            return
        self.epoch, self.chains, self.endpoints = layout["epoch"], layout["chains"], layout["endpoints"]
        for peer in [p for p in self.peers if self.endpoints[p] is None]:
            self.peers.pop(peer).close()
        for shard, chain in enumerate(layout["chains"]):
            if self.rank in chain and shard not in self.replicas:
                self.replicas[shard] = Replica(self.config, shard, self.ranges[shard], self.rank, self._send_peer,
                                               self._ack)  # fmt: skip
            if shard in self.replicas:
                self.replicas[shard].set_chain(chain)
                self._serve_deferred(shard)
        early, self.early = self.early, []
        for msg in early:  # peers' messages of this view that came before its layout (later ones wait on)
            self.handle(b"", msg)

    def _send_peer(self, rank: int, header: dict, tensors: list) -> None:
        """Send to a peer server, stamped with this server's view and rank (see :meth:`_sender_refusal`)."""
        if self.endpoints[rank] is None:
            return
        if rank not in self.peers:
            self.peers[rank] = Endpoint(self.ctx, self.endpoints[rank], self.secret, f"server {rank}")
        self.peers[rank].send({**header, "epoch": self.epoch, "from": self.rank}, tensors)

    def _sender_refusal(self, op: str, h: dict) -> str:
        """Why a peer message (of this server's view or an earlier one) is not taken from its sender, or ``""``:
        in this server's view, entries come only from the shard's predecessor (chain) or leader (primary_backup),
        a ``chain_ack`` only from the tail, hot rows only from their owner. A server no longer in the view
        (declared dead while it was only slow) is none of these, so what it still sends changes nothing here."""
        shard, sender = h["shard"], h["from"]
        chain = self.chains[shard]
        if op == "hot_update":
            senders, role = chain[:1], "the owner"
        elif self.rank not in chain:
            senders, role = [], "a member"
        elif op == "chain_ack":
            senders, role = chain[-1:], "the tail"
        elif self.config.replication == "chain" and op == "rep":
            at = chain.index(self.rank)
            senders, role = chain[at - 1 : at] if at else [], "the predecessor"
        else:
            senders, role = [s for s in chain[:1] if s != self.rank], "the leader"
        if sender in senders:
            return ""
        return (f"{op} of shard {shard} from server {sender} (view {h['epoch']}): in view {self.epoch} (chain "
                f"{chain}) server {self.rank} takes it from {role} only")  # fmt: skip

    def _reply(self, reply: tuple, header: dict, tensors: list = ()) -> None:
        """Answer a request, signed with the key it was signed with. An answer too large for a message to carry
        becomes an error answer saying so: the asker would otherwise only see its request time out."""
        ident, req, key = reply
        frames = wire.encode(key, {"op": "reply", "req": req, **header}, tensors)
        too_big = wire.oversize(frames, self.limits)
        if too_big:
            error = f"server {self.rank}: the answer is {too_big}"
            print(f"server {self.rank}: answered request {req} with an error: {error}", file=sys.stderr)
            frames = wire.encode(key, {"op": "reply", "req": req, "status": "error", "code": "bad_request",
                                       "error": error})  # fmt: skip
        self.router.send_multipart([ident, *frames], copy=False)

    def _ack(self, reply: tuple, header: dict) -> None:
        if reply:
            self._reply(reply, header)

    # requests --------------------------------------------------------------------------------------------
    def _replica(self, header: dict, head: bool = True) -> Replica:
        shard = header["shard"]
        replica = self.replicas.get(shard)
        if replica is None or (head and not replica.is_head):
            raise NotLeaderError(f"server {self.rank} does not lead shard {shard!r}")
        return replica

    def handle(self, ident: bytes, msg: wire.Message) -> None:
        """Check one authenticated message from a worker, a tool or a peer against who may send it, its schema
        and the job (:mod:`dtrain.ps.messages`), then act on it. A request that fails, in any way, gets an error
        reply; anything else that fails is counted, logged and dropped."""
        op, h = msg.op, msg.header
        req = h.get("req")
        peer = op in messages.PEER
        reply = (ident, req, msg.key) if not peer and type(req) is int and 0 <= req < messages.MAX_COUNT else None
        try:
            if peer and msg.key != self.secret:
                raise messages.MessageError(f"{op}: servers send it to each other, and this one is signed with the "
                                            "key workers hold")  # fmt: skip
            messages.check(messages.SERVER, op, h, msg.tensors, self.config, rank=self.rank)
            if peer and h["epoch"] > self.epoch:  # sent in a view whose layout has not reached this server yet
                if len(self.early) >= MAX_EARLY:
                    raise RequestError(f"{op} of view {h['epoch']}: {MAX_EARLY} messages of views after {self.epoch} "
                                       "wait already")  # fmt: skip
                self.early.append(msg)
                return
            if peer and (reason := self._sender_refusal(op, h)):
                raise RequestError(reason)
            self._dispatch(op, h, msg.tensors, reply)
        except (messages.MessageError, RequestError, EntryError) as exc:
            self._failed(op, reply, "not_leader" if isinstance(exc, NotLeaderError) else "bad_request", str(exc))
        except Exception as exc:  # not the message's fault as far as the checks tell: still answered, and logged
            self._failed(op, reply, "bad_request", f"server {self.rank} failed on it: {type(exc).__name__}: {exc}",
                         log=True)  # fmt: skip

    def _failed(self, op: str, reply: tuple | None, code: str, error: str, log: bool = False) -> None:
        self.counts["errors"] += 1
        if reply is None or log:
            what = "dropped a" if reply is None else "answered with an error a"
            print(f"server {self.rank}: {what} {op!r} message: {error}", file=sys.stderr)
        if reply is not None:
            self._reply(reply, {"status": "error", "code": code, "error": error})

    def _dispatch(self, op: str, h: dict, tensors: list, reply: tuple | None) -> None:
        """Act on a message that passed its schema: fields, shapes, dtypes and key ranges are as the job says."""
        if op == "rep":
            replica = self._replica(h, head=False)
            keys, values = tensors
            replica.receive(Entry(h["seq"], h["kind"], h["round"], keys, values, h["pushes"]))
            return self._serve_deferred(h["shard"])
        if op == "chain_ack":
            return self._replica(h, head=False).take_ack(h["seq"])
        if op == "state":
            return self._replica(h, head=False).take_state(Snapshot(h["seq"], h["round"], *tensors))
        if op == "hot_update":
            return self.hot.update(h["shard"], h["round"], h["slowest"], *tensors, self._serve)
        if op == "stats":
            return self._reply(reply, {"status": "ok", "stats": self.stats()})
        if op == "dump":
            replica = self._replica(h, head=False)
            if not replica.state.ready:
                raise RequestError(f"dump of shard {replica.index}: it is not initialised yet on server {self.rank}")
            names, arrays = zip(*replica.state.arrays().items(), strict=True)
            return self._reply(reply, {"status": "ok", "names": list(names), "seq": replica.state.seq}, arrays)
        if op == "pull" and self.hot.holds(h["shard"]) and not self._leads(h["shard"]):
            try:
                return self.hot.pull(h["shard"], (reply, h["worker"], h["clock"], tensors[0]), self._serve)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        replica = self._replica(h)
        if op == "pull":
            keys = tensors[0]
            reason = replica.policy.refusal(h["clock"])
            if reason:
                raise RequestError(f"pull of shard {replica.index}: {reason}")
            if sum(r[1] == h["worker"] for r in self.deferred.get(replica.index, [])) >= MAX_WAITING:
                raise RequestError(f"pull of shard {replica.index}: worker {h['worker']} has {MAX_WAITING} pulls "
                                   "waiting already")  # fmt: skip
            self.hot.count(replica, keys)
            request = (reply, h["worker"], h["clock"], keys, h.get("hot_seen", 0))
            self.deferred.setdefault(replica.index, []).append(request)
            return self._serve_deferred(replica.index)
        if op == "leave":
            replica.leave(h["worker"])
            self.hot.after_update(replica)  # a round the leave closed reaches the hot-row copies, as a push's does
            self._reply(reply, {"status": "ok"})
            return self._serve_deferred(replica.index)
        if op == "init":
            if replica.state.ready:
                raise RequestError(f"init of shard {replica.index}: it is initialised already (init is once)")
            replica.init(np.array(tensors[0], dtype=np.float32), Push(0, -1, -1, None, None, reply))
            return self._serve_deferred(replica.index)
        if op == "push":
            keys, grads = tensors
            if not replica.state.ready:
                raise RequestError(f"shard {replica.index} is not initialised yet")
            reason = replica.policy.refusal(h["clock"])
            if reason:
                raise RequestError(f"push to shard {replica.index}: {reason}")
            held = int(replica.state.last_push[h["worker"]])
            if h["push_id"] > held + MAX_AHEAD:
                raise RequestError(f"push to shard {replica.index}: push_id {h['push_id']} is more than {MAX_AHEAD} "
                                   f"past worker {h['worker']}'s pushes held ({held})")  # fmt: skip
            self.counts["pushes"] += 1
            replica.push(Push(h["worker"], h["push_id"], h["clock"], keys, grads, reply))
            self.hot.after_update(replica)
            return self._serve_deferred(replica.index)
        raise AssertionError(f"a schema in dtrain.ps.messages.SERVER without a handler: {op!r}")

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
                msg = wire.decode(self.keys, frames[1:], self.limits, guard=self.guard)
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
            try:
                messages.check(messages.SERVER_CONTROL, msg.op, msg.header, msg.tensors, self.config)
            except messages.MessageError as exc:
                self.counts["errors"] += 1
                print(f"server {self.rank}: dropped a message from the coordinator: {exc}", file=sys.stderr)
                continue
            if msg.op == "layout":
                self._layout(msg.header["layout"])
            elif msg.op == "stop":
                self.running = False
