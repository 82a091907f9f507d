"""The coordinator role: registers servers and workers, hands out the job and its layout, watches heartbeats.

ps-lite's scheduler, with failover added: the layout says, for each shard, its chain of servers (head first,
``replicas`` long, shard ``i`` on servers ``i, i+1, ...``). A server silent for ``dead_after_s`` is declared
dead: it is removed from every chain, so the next server of a chain it led becomes the head (the follower is
promoted), and the new layout, with a higher epoch, goes to every live server and worker. Workers resend what
the dead server had not answered to the new heads; training goes on.

It takes messages signed with the job's secret (servers, tools) or with the key workers are given
(:func:`dtrain.ps.wire.worker_key`); with the latter only a worker's registration and the read-only queries,
never a server's registration, a heartbeat or ``stop``. It answers each sender with the key it signed with.
"""

from __future__ import annotations

import sys
import time

import zmq

from dtrain.ps import messages, wire
from dtrain.ps.config import JobConfig

__all__ = ["Coordinator"]


class Coordinator:
    """Coordinator state and event loop; :attr:`endpoint` is the address servers and workers register at."""

    def __init__(self, config: JobConfig, secret: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config, self.secret = config, secret
        self.keys = (secret, wire.worker_key(secret))
        self.ctx = zmq.Context()
        self.router = wire.configure_socket(self.ctx.socket(zmq.ROUTER))
        self.router.bind(f"tcp://{host}:{port}")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        s, r = config.num_servers, config.replicas
        self.chains = [[(i + j) % s for j in range(r)] for i in range(s)]
        self.servers: dict[int, dict] = {}
        self.workers: dict[int, tuple[bytes, bytes]] = {}  # rank -> (ident, the key it registered with)
        self.dead: set[int] = set()
        self.epoch = 0
        self.events: list[dict] = []
        self.rejected = 0
        self.guard = wire.ReplayGuard()
        self.started = False  # workers were welcomed
        self.running = True

    @property
    def ready(self) -> bool:
        return len(self.servers) == self.config.num_servers

    def layout(self) -> dict:
        endpoints = [None] * self.config.num_servers
        for rank, info in self.servers.items():
            if rank not in self.dead:
                endpoints[rank] = info["endpoint"]
        return {"epoch": self.epoch, "chains": self.chains, "endpoints": endpoints}

    def _send(self, ident: bytes, header: dict, tensors: list = (), key: bytes | None = None) -> None:
        self.router.send_multipart([ident, *wire.encode(key or self.secret, header, tensors)])

    def _welcome(self, ident: bytes, role: str, rank: int, key: bytes | None = None) -> None:
        self._send(ident, {"op": "welcome", "role": role, "rank": rank, "config": self.config.to_dict(),
                           "layout": self.layout()}, key=key)  # fmt: skip

    def _register(self, ident: bytes, h: dict, key: bytes) -> None:
        role, rank = h["role"], h["rank"]
        if role == "worker":
            self.workers[rank] = (ident, key)
        else:
            self.servers[rank] = {"ident": ident, "endpoint": h["endpoint"], "last": time.monotonic()}
            if self.ready:
                for r, info in self.servers.items():
                    # servers heartbeat only once welcomed: the silence clock starts now, not at registration
                    info["last"] = time.monotonic()
                    self._welcome(info["ident"], "server", r)
        # Workers start together (a start barrier, like ps-lite's scheduler): once every server and every
        # worker is there; a worker that registers again later (a restart) is welcomed at once.
        if not self.ready or len(self.workers) < self.config.num_workers:
            return
        if not self.started:
            for r, (w, k) in self.workers.items():
                self._welcome(w, "worker", r, k)
            self.started = True
        elif role == "worker":
            self._welcome(ident, "worker", rank, key)

    def handle(self, ident: bytes, msg: wire.Message) -> None:
        """Act on one authenticated message, once it passed its schema (:data:`dtrain.ps.messages.COORDINATOR`)."""
        h = msg.header
        messages.check(messages.COORDINATOR, msg.op, h, msg.tensors, self.config)
        if msg.key != self.secret and not (msg.op in ("layout?", "events") or h.get("role") == "worker"):
            raise messages.MessageError(f"{msg.op}: not taken with the key workers hold")
        if msg.op == "hb":
            if h["rank"] in self.servers and h["rank"] not in self.dead:
                self.servers[h["rank"]]["last"] = time.monotonic()
        elif msg.op == "register":
            self._register(ident, h, msg.key)
        elif msg.op in ("layout?", "events", "stop"):
            body = {"layout": self.layout()} if msg.op == "layout?" else {"events": self.events}
            self._send(ident, {"op": "reply", "req": h.get("req", 0), "status": "ok", **body}, key=msg.key)
            if msg.op == "stop":
                self.stop()

    def check_heartbeats(self) -> None:
        """Declare silent servers dead; promote followers; tell every live process the new layout."""
        if not self.ready:
            return
        now = time.monotonic()
        newly = [r for r, info in self.servers.items()
                 if r not in self.dead and now - info["last"] > self.config.dead_after_s]  # fmt: skip
        alive = [r for r in self.servers if r not in self.dead and r not in newly]
        if not newly or not alive:
            # every server silent at once: far likelier that this process was starved of CPU than that all
            # died together (and with none left there is nobody to fail over to): wait to hear from them
            return
        self.dead.update(newly)
        self.chains = [[s for s in chain if s not in self.dead] for chain in self.chains]
        self.epoch += 1
        lost = [i for i, chain in enumerate(self.chains) if not chain]
        self.events.append({"event": "failover", "dead": newly, "epoch": self.epoch, "chains": self.chains,
                            "lost_shards": lost, "t": time.time()})  # fmt: skip
        for r, info in self.servers.items():
            if r not in self.dead:
                self._send(info["ident"], {"op": "layout", "layout": self.layout()})
        for w, key in self.workers.values():
            self._send(w, {"op": "layout", "layout": self.layout()}, key=key)

    def stop(self) -> None:
        for r, info in self.servers.items():
            if r not in self.dead:
                self._send(info["ident"], {"op": "stop"})
        self.running = False

    def serve(self) -> None:
        poll_ms = max(1, int(self.config.heartbeat_s * 1000))
        last_loop = time.monotonic()
        while self.running:
            now = time.monotonic()
            if now - last_loop > 4 * self.config.heartbeat_s:  # this process was not running: not their silence
                for info in self.servers.values():
                    info["last"] += now - last_loop
            last_loop = now
            if self.router.poll(timeout=poll_ms):
                while True:
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self.handle(frames[0], wire.decode(self.keys, frames[1:], guard=self.guard))
                    except wire.WireError:
                        self.rejected += 1
                    except Exception as exc:  # counted, logged and dropped; the coordinator keeps serving
                        self.rejected += 1
                        print(f"coordinator: dropped a message: {type(exc).__name__}: {exc}", file=sys.stderr)
            self.check_heartbeats()
        time.sleep(0.05)  # let the stop messages leave before the context goes
        self.ctx.destroy(linger=0)
