"""A shard's replica on one server, and how replicas keep each other up to date.

Each shard lives on the servers of its *chain*, head first, replicated in one of two ways:

- ``chain`` (van Renesse and Schneider, "Chain Replication for Supporting High Throughput and Availability",
  OSDI 2004): the head turns pushes into log entries, applies each and sends it down the chain; every node
  applies in order and forwards; the tail, having applied an entry, tells every member, who then forget it; only
  then does the head acknowledge the pushes in it. An acknowledged push is therefore on every live replica and
  survives any failure that leaves one. When the chain changes, each node resends to its (new) successor every
  entry not yet known to be at the tail; replicas skip entries they have.
- ``primary_backup``: the head applies and acknowledges at once and ships entries to its followers every
  ``propagate_interval_s``; a leader's death loses what it had not shipped to the follower that takes over,
  which workers count. A leader may die between its sends to two followers (or with entries still queued for
  one), so followers may differ: the new leader sends every other follower its whole state
  (:class:`~dtrain.ps.shard.Snapshot`), which replaces theirs, before any entry of its own.

Pushes are numbered per worker and shard, so a push resent to a new head after a failover is recognised as one
that an entry already holds and is acknowledged, not applied twice.

Entries and acknowledgements travel only between servers (signed with the job's secret, which workers do not
hold). Every replica checks an entry whole before applying it (:meth:`~dtrain.ps.shard.ShardState.refusal`),
the head too, before it applies or forwards one, so no replica takes what another would refuse; and a
``chain_ack`` for an entry this replica never applied (so never sent on) is refused, not taken as durable. Each
carries its sender's view and rank, and a server takes it only from the shard's predecessor, leader or tail in its
own view (:meth:`dtrain.ps.server.Server._sender_refusal`), so a server declared dead while it was only slow
changes no replica of the new view.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.consistency import Policy, Push, Step
from dtrain.ps.keys import KeyRange
from dtrain.ps.shard import Entry, EntryError, ShardState, Snapshot

__all__ = ["Replica"]

# send(server_rank, header, tensors) to a peer server; ack(reply, header) to a worker
SendPeer = Callable[[int, dict, list], None]
AckWorker = Callable[[tuple, dict], None]


class Replica:
    """One server's copy of one shard, with its role in the shard's chain."""

    def __init__(self, config: JobConfig, index: int, key_range: KeyRange, me: int, send: SendPeer,
                 ack: AckWorker) -> None:  # fmt: skip
        self.config, self.index, self.me = config, index, me
        self.state = ShardState(config, index, key_range)
        self.send, self.ack = send, ack
        self.chain: list[int] = []
        self.policy: Policy | None = None
        self.log: list[Entry] = []  # chain: entries not yet known to be at the tail
        self.waiting: dict[int, list[Push]] = {}  # head, chain: seq -> pushes acknowledged once it is durable
        self.outbox: list[Entry] = []  # head, primary_backup: entries not yet shipped

    # roles -------------------------------------------------------------------------------------------------
    @property
    def is_head(self) -> bool:
        return bool(self.chain) and self.chain[0] == self.me

    @property
    def chain_mode(self) -> bool:
        return self.config.replication == "chain"

    def _successor(self) -> int | None:
        i = self.chain.index(self.me)
        return self.chain[i + 1] if i + 1 < len(self.chain) else None

    def set_chain(self, chain: list[int]) -> None:
        """A new membership for this shard (from the coordinator): take up the role it gives."""
        old_successor = self._successor() if self.me in self.chain else None
        old_head = self.chain[0] if self.chain else None
        self.chain = list(chain)
        if self.me not in self.chain:  # declared dead while alive (a long pause): stop acting for the shard
            self.policy, self.log, self.waiting, self.outbox = None, [], {}, []
            return
        if self.is_head and self.policy is None:
            self.policy = Policy(self.config, self.state)
        successor = self._successor()
        if not self.chain_mode:
            if self.is_head and old_head not in (None, self.me):
                self._send_state()
            return
        if successor is None:
            self._durable(self.state.seq)
        elif successor != old_successor:
            for entry in self.log:
                self._forward(successor, entry)

    # head: pushes and init ---------------------------------------------------------------------------------
    def init(self, values: np.ndarray, push: Push) -> None:
        """The initial values of every row, from worker 0."""
        entry = Entry(self.state.seq + 1, "init", 0, np.zeros(0, np.int64), values, [])
        self._commit(entry, [push])

    def push(self, push: Push) -> None:
        """A worker's gradient: let the consistency policy decide; apply, replicate and acknowledge."""
        if self.state.holds_push(push.worker, push.push_id):
            self._ack_when_durable(push)  # a resend after failover of a push some entry already holds
            return
        steps, late = self.policy.offer(push)
        if late:
            self.state.record_push(push.worker, push.push_id)
            if late == "dropped":
                self.ack(push.reply, {"status": late})
            # a folded push is acknowledged with the entry of the round it joined, once that entry is durable:
            # acknowledged earlier, it would be lost with this head
        for step in steps:
            self._commit(self._entry(step), step.pushes)

    def leave(self, worker: int) -> None:
        """``worker`` finished: rounds stop waiting for it."""
        for step in self.policy.leave(worker):
            self._commit(self._entry(step), step.pushes)

    def _entry(self, step: Step) -> Entry:
        pushes = [[p.worker, p.push_id, p.clock] for p in step.pushes]
        return Entry(self.state.seq + 1, "step", step.round, step.keys, step.grads, pushes)

    def _commit(self, entry: Entry, pushes: list[Push]) -> None:
        try:
            self.state.apply(entry)
        except EntryError as exc:  # e.g. a mean of finite gradients that overflows float32: applied nowhere
            for p in pushes:
                self.ack(p.reply, {"status": "error", "code": "bad_request", "error": str(exc)})
            return
        successor = self._successor()
        if successor is None:
            for p in pushes:
                self.ack(p.reply, {"status": p.late or "applied"})
        elif self.chain_mode:
            self.log.append(entry)
            self.waiting[entry.seq] = pushes
            self._forward(successor, entry)
        else:
            self.outbox.append(entry)
            for p in pushes:
                self.ack(p.reply, {"status": p.late or "applied"})

    def _ack_when_durable(self, push: Push) -> None:
        if self.chain_mode and self.log and self._successor() is not None:
            self.waiting.setdefault(self.log[-1].seq, []).append(push)
        else:
            self.ack(push.reply, {"status": "applied"})

    def _send_state(self) -> None:
        """primary_backup, on taking the lead: make every follower equal to this replica. The old leader may have
        died between its sends to two followers, or with entries still queued for one: a follower may lack
        entries this one holds, or hold some it lacks, and entries from here on would never fit it."""
        snap = self.state.snapshot()
        for follower in self.chain[1:]:
            self.send(follower, snap.header(self.index), snap.tensors())

    def take_state(self, snap: Snapshot) -> None:
        """primary_backup follower: the leader's whole state (:meth:`_send_state`) replaces this replica's."""
        if self.chain_mode or self.is_head or self.me not in self.chain:
            raise EntryError(f"state of shard {self.index}: server {self.me} does not follow it under primary_backup")
        self.state.restore(snap)

    def ship(self) -> None:
        """primary_backup: send the entries applied since the last call to every follower."""
        if not self.outbox:
            return
        for follower in self.chain[1:]:
            for entry in self.outbox:
                self.send(follower, entry.header(self.index), [entry.keys, entry.values])
        self.outbox = []

    # followers ---------------------------------------------------------------------------------------------
    def receive(self, entry: Entry) -> None:
        """An entry from the predecessor (chain) or the leader (primary_backup)."""
        applied = self.state.apply(entry)
        if not self.chain_mode or self.me not in self.chain:
            return
        successor = self._successor()
        if successor is None:  # the tail: a resent entry it already holds is acknowledged again
            self._durable(self.state.seq)
        elif not applied:
            return
        else:
            self.log.append(entry)
            self._forward(successor, entry)

    def _forward(self, successor: int, entry: Entry) -> None:
        self.send(successor, entry.header(self.index), [entry.keys, entry.values])

    def _durable(self, seq: int) -> None:
        """This node is the tail and has applied everything up to ``seq``: tell the others, and itself."""
        for member in self.chain:
            if member != self.me:
                self.send(member, {"op": "chain_ack", "shard": self.index, "seq": seq}, [])
        self.chain_ack(seq)

    def take_ack(self, seq: int) -> None:
        """A ``chain_ack`` from the tail: refused (:class:`~dtrain.ps.shard.EntryError`) unless this replica is in
        a chain and has applied entry ``seq``, as every replica before the tail has applied what the tail has."""
        if self.me not in self.chain or not self.chain_mode:
            raise EntryError(f"chain_ack for shard {self.index}: server {self.me} is not in its chain")
        if seq > self.state.seq:
            raise EntryError(f"chain_ack for shard {self.index} up to entry {seq}: server {self.me} has applied and "
                             f"sent on only {self.state.seq}")  # fmt: skip
        self.chain_ack(seq)

    def chain_ack(self, seq: int) -> None:
        """Entries up to ``seq`` are at the tail: forget them and acknowledge their pushes."""
        self.log = [e for e in self.log if e.seq > seq]
        for s in sorted(k for k in self.waiting if k <= seq):
            for p in self.waiting.pop(s):
                self.ack(p.reply, {"status": p.late or "applied"})
