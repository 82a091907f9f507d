"""One parameter-server step on a topology: pushes, the servers' applies, chain forwarding, hot-row copies, pulls.

What is simulated is what :mod:`dtrain.ps` does (docs/ps.md; a parameter server after Li et al., "Scaling
Distributed Machine Learning with the Parameter Server", OSDI 2014), as flows on :class:`dtrain.sim.flows.FlowNetwork`:

- **Keys.** Dense parameters are cut evenly over the ``S`` servers; embedding key ``k`` is on server
  ``k S // key_space``. Each worker draws ``rows_per_worker`` Zipf ids (rank ``k`` with probability ~
  ``k^-zipf``; rank is key, as dtrain.ps's synthetic task hands ids out, or a seeded permutation of it with
  ``permute``, as ``dtrain.ps.data`` hashes ids) and pushes and pulls each distinct row once.
- **Sync.** Every worker pushes to every shard's head (shard ``i`` lives on servers ``i, i+1, ...``, the
  coordinator's layout). Once all ``W`` pushes are in, the head applies one entry (dense shard plus the union
  of pushed rows) at ``apply_s_per_byte``; each further replica of the chain receives the entry, applies it and
  forwards it (van Renesse and Schneider 2004); the tail's acknowledgement releases the workers, which then
  pull. A server applies one entry at a time.
- **Async.** No barrier: each push is its own entry, applied, forwarded and acknowledged alone (each worker's
  push+pull time is reported).
- **Hot rows.** The ``hot_keys`` rows of each server that most workers pull this step are also held by the
  ``hot_replicas`` next servers. Pulls of such a row are dealt round-robin over owner and copies; pushes stay
  at the owner, which sends the new rows to its copies once its shard is committed. In sync mode a copy answers
  pulls only after that refresh (a copy serves round ``r`` with the owner's round-``r`` rows, as in dtrain.ps).
- **Host work.** With ``host_s_per_byte``, a message costs its sender that much time per byte before it
  leaves and its receiver as much once it is in (dtrain.ps serialises and HMAC-SHA256s every byte at both
  ends, docs/ps.md). A node's work (this, and a server's applies) is done one piece at a time.
Requests are latency-only messages (their key lists are not counted). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.cluster.topology import Topology
from dtrain.sim.flows import FlowNetwork, LinkUsage
from dtrain.sim.ps_traffic import PSStep, PSTraffic, ps_traffic

__all__ = ["PSStep", "ServerLoad", "PSResult", "PSTraffic", "ps_traffic", "simulate_ps"]


@dataclass(frozen=True, kw_only=True)
class ServerLoad:
    """What one server handled in the step: bytes from and to workers, requests, and server-to-server bytes."""

    node: str
    push_bytes: float
    pull_bytes: float
    requests: int
    replication_bytes: float

    @property
    def nbytes(self) -> float:  # exchanged with workers: pushes in, pull replies out
        return self.push_bytes + self.pull_bytes


@dataclass(frozen=True, kw_only=True)
class PSResult:
    """A simulated step: ``time_s`` (last worker done), each worker's finish, the servers' loads, the links."""

    mode: str
    time_s: float
    worker_s: list[float]
    servers: list[ServerLoad]
    links: list[LinkUsage] = field(repr=False)

    @property
    def bottleneck(self) -> LinkUsage | None:
        """The link with the highest utilisation (None when no byte crossed a link)."""
        return self.links[0] if self.links else None

    @property
    def byte_imbalance(self) -> float:
        """Max over mean of the servers' worker-facing bytes (1.0: even; 1.0 when nothing moved)."""
        return _imbalance([s.nbytes for s in self.servers])

    @property
    def pull_imbalance(self) -> float:
        """Max over mean of the bytes each server sent back to pulls (the load hot copies move)."""
        return _imbalance([s.pull_bytes for s in self.servers])

    @property
    def request_imbalance(self) -> float:
        """Max over mean of the requests each server received."""
        return _imbalance([float(s.requests) for s in self.servers])


def _imbalance(values: list[float]) -> float:
    return max(values) * len(values) / sum(values) if sum(values) > 0 else 1.0


def simulate_ps(topology: Topology, step: PSStep) -> PSResult:
    """Simulate ``step`` on ``topology``; see the module docstring for what happens in which order."""
    for role in ("workers", "servers"):
        for name in getattr(step, role):
            if name not in topology.graph:
                raise ValueError(f"PSStep.{role}: {name!r} is not a node of topology {topology.name!r}")
    return _Run(topology, step, ps_traffic(step)).run()


class _Run:
    """The event-driven state of one step: acknowledgements awaited, servers' apply queues, pulls waiting."""

    def __init__(self, topology: Topology, step: PSStep, traffic: PSTraffic) -> None:
        self.net, self.step, self.t = FlowNetwork(topology), step, traffic
        n_w, n_s, self.sync = len(step.workers), len(step.servers), step.mode == "sync"
        # sync: every worker pushes every shard (the barrier needs them all); async: only what it has
        self.pushes = [[i for i in range(n_s) if self.sync or traffic.push[w, i] > 0] for w in range(n_w)]
        self.acks = [len(p) for p in self.pushes]
        self.arrived, self.busy_until = [0] * n_s, {}  # node -> when its process is free
        self.entries_left = [sum(i in p for p in self.pushes) if not self.sync else 1 for i in range(n_s)]
        self.refresh_left = [sum(1 for (_, j) in traffic.hot if j == c) for c in range(n_s)]
        self.waiting: list[list[int]] = [[] for _ in range(n_s)]  # pull requests held for a refresh
        self.pulls_left, self.finish = [0] * n_w, [0.0] * n_w
        self.requests, self.replication = [0] * n_s, [0.0] * n_s

    def run(self) -> PSResult:
        for w, shards in enumerate(self.pushes):
            for i in shards:
                self.requests[i] += 1
                nbytes = self.t.push[w, i]
                self._send_worker(w, i, nbytes, lambda _t, w=w, i=i, b=nbytes: self._pushed(w, i, b), up=True)
            if not shards:
                self._pull(w)
        end = self.net.run()
        loads = [
            ServerLoad(node=node, push_bytes=sum(b for (_, i), b in self.t.push.items() if i == s),
                       pull_bytes=sum(b for (_, i), b in self.t.pull.items() if i == s),
                       requests=self.requests[s], replication_bytes=self.replication[s])
            for s, node in enumerate(self.step.servers)
        ]  # fmt: skip
        return PSResult(mode=self.step.mode, time_s=max(self.finish), worker_s=self.finish, servers=loads,
                        links=self.net.usage(end))  # fmt: skip

    def _send_worker(self, w: int, s: int, nbytes: float, on_done, *, up: bool) -> None:
        a, b = self.step.workers[w], self.step.servers[s]
        self._transfer(*((a, b) if up else (b, a)), nbytes, w * 7919 + s, on_done)

    def _transfer(self, src: str, dst: str, nbytes: float, flow_id: int, on_done) -> None:
        """A message: the sender's work on its bytes, the flow, the receiver's work, then ``on_done(t)``."""
        cost = nbytes * self.step.host_s_per_byte
        if not cost:
            return self.net.send(src, dst, nbytes, flow_id=flow_id, on_done=on_done)
        received = lambda _t: self.net.at(self._work(dst, cost), lambda: on_done(self.net.now))  # noqa: E731
        self.net.at(self._work(src, cost), lambda: self.net.send(src, dst, nbytes, flow_id=flow_id, on_done=received))

    def _work(self, node: str, seconds: float) -> float:
        """Queue ``seconds`` of work on ``node``'s process (one piece at a time); when it is done."""
        self.busy_until[node] = max(self.net.now, self.busy_until.get(node, 0.0)) + seconds
        return self.busy_until[node]

    def _apply(self, s: int, nbytes: float, then) -> None:
        self.net.at(self._work(self.step.servers[s], nbytes * self.step.apply_s_per_byte), then)

    def _pushed(self, w: int, i: int, nbytes: float) -> None:
        self.arrived[i] += 1
        if not self.sync:
            self._apply(i, nbytes, lambda: self._forward(i, 1, nbytes, [w]))
        elif self.arrived[i] == len(self.step.workers):
            workers = list(range(len(self.step.workers)))
            self._apply(i, self.t.entry[i], lambda: self._forward(i, 1, self.t.entry[i], workers))

    def _forward(self, i: int, hop: int, nbytes: float, workers: list[int]) -> None:
        """Shard ``i``'s entry has been applied at chain member ``hop - 1``: pass it on, or commit at the tail."""
        n_s = len(self.step.servers)
        if hop == self.step.replicas:
            return self._committed(i, (i + hop - 1) % n_s, workers)
        src, dst = (i + hop - 1) % n_s, (i + hop) % n_s
        self.replication[src] += nbytes
        self.replication[dst] += nbytes
        arrived = lambda _t: self._apply(dst, nbytes, lambda: self._forward(i, hop + 1, nbytes, workers))  # noqa: E731
        self._transfer(self.step.servers[src], self.step.servers[dst], nbytes, i, arrived)

    def _committed(self, i: int, tail: int, workers: list[int]) -> None:
        for w in workers:  # the tail's acknowledgement (a latency-only message)
            self._send_worker(w, tail, 0, lambda _t, w=w: self._acked(w), up=False)
        self.entries_left[i] -= 1
        if self.entries_left[i] == 0:  # the shard's step is in: refresh its hot rows on their copies
            for (owner, copy), nbytes in self.t.hot.items():
                if owner == i:
                    self.replication[owner] += nbytes
                    self.replication[copy] += nbytes
                    self._transfer(self.step.servers[owner], self.step.servers[copy], nbytes, copy,
                                   lambda _t, c=copy: self._refreshed(c))  # fmt: skip

    def _refreshed(self, copy: int) -> None:
        self.refresh_left[copy] -= 1
        if self.refresh_left[copy] == 0:
            for w in self.waiting[copy]:
                self._reply(w, copy)
            self.waiting[copy].clear()

    def _pull(self, w: int) -> None:
        targets = [s for (v, s) in self.t.pull if v == w]
        self.pulls_left[w] = len(targets)
        if not targets:
            self.finish[w] = self.net.now
        for s in targets:
            self.requests[s] += 1
            self._send_worker(w, s, 0, lambda _t, s=s: self._requested(w, s), up=True)

    def _requested(self, w: int, s: int) -> None:
        if self.sync and self.refresh_left[s]:
            self.waiting[s].append(w)
        else:
            self._reply(w, s)

    def _reply(self, w: int, s: int) -> None:
        self._send_worker(w, s, self.t.pull[w, s], lambda _t: self._pulled(w), up=False)

    def _acked(self, w: int) -> None:
        self.acks[w] -= 1
        if self.acks[w] == 0:
            self._pull(w)

    def _pulled(self, w: int) -> None:
        self.pulls_left[w] -= 1
        if self.pulls_left[w] == 0:
            self.finish[w] = self.net.now
