"""Consistency policies: when a shard's head turns pushes into an optimizer step, and when it answers a pull.

- ``sync`` (bulk synchronous): round ``r`` closes once every worker pushed for ``r``; the step uses the mean
  of their gradients; a pull for round ``r`` waits until the shard reached it.
- ``quorum``: round ``r`` closes with the first ``k`` pushes, so a straggler does not hold everyone back (the
  backup workers of Chen et al., "Revisiting Distributed Synchronous SGD", 2016). A push for a closed round is
  *late*: dropped, or folded into the open round's mean, as the job says; each is counted.
- ``async``: every push is a step on its own; pulls never wait (Hogwild-style staleness, Recht et al. 2011).
- ``ssp``: every push is a step on its own; a worker at clock ``c`` gets its pull answered only once every
  worker has pushed ``c - s`` times (Ho et al., NIPS 2013, the stale synchronous parallel model).

A pull that must wait is kept until it can be answered, so how long it may wait is bounded: a pull or push
whose clock is more than :data:`MAX_AHEAD` rounds (clocks) past what the shard could answer is refused
(:meth:`Policy.refusal`). An honest worker is at most one round (``s + 1`` clocks) ahead, plus what a failover
lost; a clock far past that is a malformed request, not one to wait for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtrain.ps.config import JobConfig
from dtrain.ps.shard import ShardState

__all__ = ["MAX_AHEAD", "MAX_WAITING", "Push", "Step", "Policy", "ahead_refusal"]

MAX_AHEAD = 1 << 16
"""Rounds (sync, quorum) or clocks (ssp) past the shard's that a push or a waiting pull may be."""

MAX_WAITING = 16
"""Pulls of one worker that a shard (or a server's copy of its hot rows) keeps waiting at once; a worker waits
for each of its pulls, so an honest one has one or two waiting."""


def ahead_refusal(mode: str, clock: int, round_: int, slowest: int, staleness: int) -> str:
    """Why a clock is too far ahead of a shard at round ``round_`` whose slowest worker is at ``slowest``, or
    ``""``. Async never waits, so any clock is taken there."""
    if mode in ("sync", "quorum"):
        reachable, what = round_ + MAX_AHEAD, f"round {round_}"
    elif mode == "ssp":
        reachable, what = slowest + staleness + MAX_AHEAD, f"slowest clock {slowest}, staleness {staleness}"
    else:
        return ""
    if clock > reachable:
        return f"clock {clock} is more than {MAX_AHEAD} past what the shard can answer ({what})"
    return ""


@dataclass
class Push:
    """One worker's gradient for some rows of a shard; ``reply`` is where its acknowledgement goes."""

    worker: int
    push_id: int
    clock: int
    keys: np.ndarray
    grads: np.ndarray
    reply: tuple
    late: str = ""  # "folded" once folded into a later round: its acknowledgement, when durable, says so


@dataclass
class Step:
    """Pushes turned into one optimizer step: gradients for ``keys`` and the shard's round after it."""

    keys: np.ndarray
    grads: np.ndarray
    pushes: list[Push]
    round: int


def _strictly_increasing(keys: np.ndarray) -> bool:
    return keys.size < 2 or bool((keys[1:] > keys[:-1]).all())


def combine(pushes: list[Push], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean over pushes of their gradients, rows missing from a push counting as zero and a key repeated within a
    push counting with the sum of its gradients; the keys come out sorted and distinct; summed in the given order
    so that every run (and every replica) gets the same bits."""
    if not pushes:
        return np.zeros(0, np.int64), np.zeros((0, width), np.float32)
    if len(pushes) == 1 and _strictly_increasing(pushes[0].keys):
        return pushes[0].keys, pushes[0].grads  # the common async case: nothing to sum, nothing to copy
    n = np.float32(len(pushes))
    first = pushes[0].keys
    if all(p.keys.shape == first.shape and np.array_equal(p.keys, first) for p in pushes):
        total = pushes[0].grads.astype(np.float32, copy=True)
        for p in pushes[1:]:
            total += p.grads
        order = np.argsort(first, kind="stable")
        if np.unique(first).size == first.size:
            return first[order], total[order] / n
        pushes = [Push(0, 0, 0, first, total, ())]  # repeated keys inside the push: fall through and sum them
    keys = np.concatenate([p.keys for p in pushes])
    unique, inverse = np.unique(keys, return_inverse=True)
    sums = np.zeros((unique.size, width), np.float32)
    np.add.at(sums, inverse, np.concatenate([p.grads for p in pushes]))
    return unique, sums / n


class Policy:
    """The head's rules for one shard under ``config.mode``; counts what it dropped and folded."""

    def __init__(self, config: JobConfig, state: ShardState) -> None:
        self.config, self.state = config, state
        self.pending: dict[int, dict[int, Push]] = {}  # round -> worker -> push (sync, quorum)
        self.folded: list[Push] = []
        self.last_clock = np.full(config.num_workers, -1, np.int64)
        self.left: set[int] = set()  # workers that finished: rounds no longer wait for them
        self.dropped = 0
        self.folded_total = 0
        self.staleness_log: list[tuple[int, int, int]] = []  # ssp: (worker, clock, slowest clock) per answer

    @property
    def rounds_mode(self) -> bool:
        return self.config.mode in ("sync", "quorum")

    def offer(self, push: Push) -> tuple[list[Step], str]:
        """Take a push; the steps it completes and, for a late push, ``"dropped"`` or ``"folded"`` (a dropped
        push is acknowledged at once; a folded one when the open round it joined is applied and durable)."""
        if not self.rounds_mode:
            return [Step(*self._mean([push]), [push], self.state.round + 1)], ""
        self.last_clock[push.worker] = max(self.last_clock[push.worker], push.clock)
        if push.clock < self.state.round:
            if self.config.mode == "quorum" and self.config.late == "fold":
                push.late = "folded"
                self.folded.append(push)
                self.folded_total += 1
                return self._close_ready(), "folded"
            self.dropped += 1
            return self._close_ready(), "dropped"
        self.pending.setdefault(push.clock, {})[push.worker] = push
        return self._close_ready(), ""

    def _mean(self, pushes: list[Push]) -> tuple[np.ndarray, np.ndarray]:
        return combine(pushes, self.config.width)

    def _closable(self, r: int) -> bool:
        got = self.pending.get(r, {})
        if len(got) >= self.config.round_size:
            return True
        # A worker that already pushed for a later round will never push for this one (it saw this round
        # closed by a leader that then died without passing it on): do not wait for it.
        if not got and not self.folded and len(self.left) == self.config.num_workers:
            return False  # everyone left: no round to close
        # A worker whose late push is folded into this round has given it what it will give (it may be waiting
        # for that push's acknowledgement before it goes on).
        folded = {p.worker for p in self.folded}
        return all(
            w in got or self.last_clock[w] > r or w in self.left or w in folded for w in range(self.config.num_workers)
        )

    def leave(self, worker: int) -> list[Step]:
        """``worker`` finished training: close the rounds that were waiting only for it."""
        self.left.add(worker)
        return self._close_ready() if self.rounds_mode else []

    def _close_ready(self) -> list[Step]:
        steps, r = [], self.state.round
        while self._closable(r):
            got = self.pending.pop(r, {})
            pushes = [got[w] for w in sorted(got)] + self.folded
            self.folded = []
            steps.append(Step(*self._mean(pushes), pushes, r + 1))
            r += 1
        return steps

    def refusal(self, clock: int) -> str:
        """Why a push or pull at ``clock`` is refused as too far ahead of the shard, or ``""``."""
        c = self.config
        return ahead_refusal(c.mode, clock, self.state.round, int(self.state.clocks.min()), c.staleness)

    def pull_ready(self, worker: int, clock: int) -> bool:
        """Whether a pull by ``worker`` at ``clock`` may be answered now (and, for ssp, log the staleness)."""
        if self.rounds_mode:
            return self.state.round >= clock
        if self.config.mode == "ssp":
            slowest = int(self.state.clocks.min())
            if slowest < clock - self.config.staleness:
                return False
            self.staleness_log.append((worker, clock, slowest))
        return True
