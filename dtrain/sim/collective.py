"""Replay a ``dtrain.comm`` schedule on a topology: time, link utilisation and the bottleneck link.

What is replayed is what :mod:`dtrain.comm.p2p.runtime` does, rank by rank (its plan, :mod:`dtrain.comm.ir.plan`):
each rank walks the rounds it takes part in, in order; in a round it posts every message at once (a rank's
messages to one peer in one round are packed into one), waits for all of them, then reduces what it received
into its buffer, and only then enters its next round. There is no barrier between rounds: a rank runs ahead
as far as its own messages allow. A message flows once both its sender and its receiver have posted the round
(NCCL's and Gloo's point-to-point calls both rendezvous), along the route of the ranks' devices, sharing links
max-min fairly with every other message then in flight (:mod:`dtrain.sim.flows`).

Software costs follow :mod:`dtrain.comm.cost.model`: posting a round with ``k`` peers takes ``alpha + (k-1)
alpha_peer`` of host time on the rank, and reducing ``r`` bytes takes ``r x 3 / memory_bytes_per_s`` (read two
operands, write one) on its device unless a ``gamma_s_per_byte`` is given. On a uniform network these give the
closed forms of :mod:`dtrain.comm.cost.forms` (tests/sim/test_sim_collective.py checks ring, tree and
halving-doubling).

A job may carry the public API's own operations around its schedule (:mod:`dtrain.sim.api_passes`): a rank
runs those before its first round and those after its last, each ``launch_s`` of host time and its bytes at the
device's copy rate, one after the other like everything else on the rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dtrain.cluster.topology import Topology
from dtrain.comm.ir.schedule import Collective, Schedule, chunk_bounds
from dtrain.sim.api_passes import RankPasses
from dtrain.sim.flows import FlowNetwork, LinkUsage

__all__ = [
    "SoftwareCost",
    "RankRound",
    "CollectiveResult",
    "Job",
    "rank_rounds",
    "replay",
    "replay_concurrent",
    "check_placement",
]


@dataclass(frozen=True, kw_only=True)
class SoftwareCost:
    """Host and device time outside the network.

    ``call_s``: a call's fixed start-up before its first round (argument checks, plan look-up, the copies
    into and out of the work buffer); ``alpha_s``: posting a round's first message; ``alpha_peer_s``: each
    further peer of that round (None: ``alpha_s``); ``gamma_s_per_byte``: reducing a received byte (None:
    ``3 / memory_bytes_per_s`` of the device); ``flow_cap_bytes_per_s``: the most one message reaches on its
    own (one connection's limit; None: links only); ``message_caps``: ``(max_bytes, cap)`` pairs, ascending,
    that cap a message of at most ``max_bytes`` at ``cap`` instead (a transport whose point-to-point rate
    depends on the message size, as NCCL's does with the channels it gives one peer). For the API's own
    operations (a job's ``api``): ``launch_s``, host time of one torch operation; ``copy_s_per_byte``, a byte
    written by a local copy (None: ``2 / memory_bytes_per_s`` of the device, one read and one write).
    """

    call_s: float = 0.0
    alpha_s: float = 0.0
    alpha_peer_s: float | None = None
    gamma_s_per_byte: float | None = None
    flow_cap_bytes_per_s: float | None = None
    message_caps: tuple[tuple[float, float], ...] = ()
    launch_s: float = 0.0
    copy_s_per_byte: float | None = None

    def __post_init__(self) -> None:
        sizes = [m for m, _ in self.message_caps]
        if sizes != sorted(sizes) or any(not (m > 0 and c > 0) for m, c in self.message_caps):
            raise ValueError(
                f"SoftwareCost.message_caps must be ascending (max_bytes, cap) pairs > 0, got {self.message_caps!r}"
            )
        for name in ("call_s", "alpha_s", "alpha_peer_s", "gamma_s_per_byte", "launch_s", "copy_s_per_byte"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise ValueError(f"SoftwareCost.{name} must be a finite number >= 0, got {value!r}")
        if self.flow_cap_bytes_per_s is not None and not self.flow_cap_bytes_per_s > 0:
            raise ValueError(f"SoftwareCost.flow_cap_bytes_per_s must be > 0, got {self.flow_cap_bytes_per_s!r}")

    def cap_for(self, nbytes: float) -> float | None:
        """The rate cap of one message of ``nbytes``: the first ``message_caps`` entry it fits, else the flow cap."""
        for max_bytes, cap in self.message_caps:
            if nbytes <= max_bytes:
                return cap
        return self.flow_cap_bytes_per_s

    def start_s(self, peers: int) -> float:
        """Host time to post a round with ``peers`` peers (the busier of sends and receives)."""
        per_peer = self.alpha_s if self.alpha_peer_s is None else self.alpha_peer_s
        return self.alpha_s + (peers - 1) * per_peer if peers > 0 else 0.0


@dataclass(frozen=True)
class RankRound:
    """One rank's part of one round: bytes to and from each peer (packed), and bytes it reduces."""

    index: int
    sends: dict[int, int]
    recvs: dict[int, int]
    reduce_bytes: int

    @property
    def peers(self) -> int:
        return max(len(self.sends), len(self.recvs))


@dataclass(frozen=True, kw_only=True)
class CollectiveResult:
    """A replayed schedule: ``time_s`` (last rank done), each rank's finish, and each link's usage."""

    time_s: float
    rank_finish_s: list[float]
    links: list[LinkUsage] = field(repr=False)

    @property
    def bottleneck(self) -> LinkUsage | None:
        """The link with the highest utilisation (None when no byte crossed a link)."""
        return self.links[0] if self.links else None


def rank_rounds(schedule: Schedule, nbytes: int, itemsize: int = 4) -> list[list[RankRound]]:
    """Each rank's rounds (those it sends or receives in) for a ``nbytes`` work buffer, as the runtime plans."""
    if itemsize < 1 or nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"nbytes {nbytes} is not a whole number of {itemsize}-byte elements")
    numel = nbytes // itemsize
    if numel % schedule.nblocks:
        raise ValueError(f"{numel} elements do not split into the schedule's {schedule.nblocks} equal blocks")
    sizes = [n * itemsize for _, n in chunk_bounds(numel, schedule.nblocks, schedule.chunks_per_block)]
    per_rank: list[list[RankRound]] = [[] for _ in range(schedule.world_size)]
    tokens = schedule.collective == Collective.BARRIER  # a barrier's messages are one-byte tokens
    for index, transfers in enumerate(schedule.rounds):
        sends: list[dict[int, int]] = [{} for _ in range(schedule.world_size)]
        recvs: list[dict[int, int]] = [{} for _ in range(schedule.world_size)]
        reduced = [0] * schedule.world_size
        for t in transfers:
            size = max(sizes[t.src_chunk], 1) if tokens else sizes[t.src_chunk]
            if size == 0:  # the runtime skips empty ranges
                continue
            sends[t.src][t.dst] = sends[t.src].get(t.dst, 0) + size
            recvs[t.dst][t.src] = recvs[t.dst].get(t.src, 0) + size
            if t.reduce:
                reduced[t.dst] += size
        for rank in range(schedule.world_size):
            if sends[rank] or recvs[rank]:
                per_rank[rank].append(RankRound(index, sends[rank], recvs[rank], reduced[rank]))
    return per_rank


#: rank_rounds by (schedule identity, bytes, item size); the schedule is kept so its identity is not reused.
_ROUNDS: dict[tuple[int, int, int], tuple[Schedule, list[list[RankRound]]]] = {}


def _rank_rounds_cached(schedule: Schedule, nbytes: int, itemsize: int) -> list[list[RankRound]]:
    """:func:`rank_rounds`, cached for the schedules the registry hands out (one object per algorithm and size);
    the result is shared, so callers must not change it."""
    key = (id(schedule), nbytes, itemsize)
    found = _ROUNDS.get(key)
    if found is None or found[0] is not schedule:
        if len(_ROUNDS) > 4096:
            _ROUNDS.clear()
        found = _ROUNDS[key] = (schedule, rank_rounds(schedule, nbytes, itemsize))
    return found[1]


def check_placement(topology: Topology, placement: Sequence[str], world_size: int) -> list[str]:
    """``placement`` as a list, checked: one device of ``topology`` per rank."""
    placement = list(placement)
    if len(placement) != world_size:
        raise ValueError(f"placement names {len(placement)} devices for {world_size} ranks; give one per rank")
    for name in placement:
        topology.device(name)
    return placement


class _Replay:
    """The event-driven state of one replay: where each rank is, and which messages are waiting for a peer."""

    def __init__(
        self, net: FlowNetwork, rounds, placement, cost: SoftwareCost, gammas, start_s, end_s, tag: int = 0,
        relay=None,
    ) -> None:  # fmt: skip
        self.net, self.rounds, self.placement, self.cost, self.gammas = net, rounds, placement, cost, gammas
        self.relay = relay or (None,) * len(placement)  # the node each rank's messages pass through (None: none)
        self.end_s = end_s  # each rank's work after its last round (the API's copies out)
        self.tag = tag  # tells concurrent replays' flows apart for ECMP
        self.position = [0] * len(rounds)
        self.posted: set[tuple[int, int]] = set()  # (rank, round index) posted and not finished
        self.pending = [0] * len(rounds)  # messages of the current round not yet done, per rank
        self.start_s = list(start_s)
        self.finish = [t + end for t, end in zip(start_s, end_s, strict=True)]  # a rank with no rounds

    def start(self) -> None:
        for rank, t in enumerate(self.start_s):
            self.net.at(t, lambda r=rank: self._enter(r))

    def _enter(self, rank: int) -> None:
        if self.position[rank] == len(self.rounds[rank]):
            self.finish[rank] = self.net.now + self.end_s[rank]
            return
        rr = self.rounds[rank][self.position[rank]]
        self.pending[rank] = len(rr.sends) + len(rr.recvs)
        self.net.at(self.net.now + self.cost.start_s(rr.peers), lambda: self._post(rank, rr))

    def _post(self, rank: int, rr: RankRound) -> None:
        self.posted.add((rank, rr.index))
        # A message goes when both ends have posted: the later of the two starts it.
        for peer, nbytes in rr.sends.items():
            if (peer, rr.index) in self.posted:
                self._start(rank, peer, rr.index, nbytes)
        for peer in rr.recvs:
            if (peer, rr.index) in self.posted:
                # the peer has posted this round and cannot have left it: the message is still to come
                self._start(peer, rank, rr.index, self.rounds[peer][self.position[peer]].sends[rank])

    def _start(self, src: int, dst: int, index: int, nbytes: int) -> None:
        flow_id = hash((self.tag, src, dst)) & 0x7FFFFFFF  # one path a connection (dtrain.sim.classes, point 3)
        done = lambda _t: (self._done(src, index), self._done(dst, index))  # noqa: E731
        cap = self.cost.cap_for(nbytes)
        self.net.send(
            self.placement[src],
            self.placement[dst],
            nbytes,
            flow_id=flow_id,
            on_done=done,
            cap_bytes_per_s=cap,
            via=self.relay[src],
        )

    def _done(self, rank: int, index: int) -> None:
        self.pending[rank] -= 1
        if self.pending[rank]:
            return
        rr = self.rounds[rank][self.position[rank]]
        self.posted.discard((rank, index))
        self.position[rank] += 1
        self.net.at(self.net.now + rr.reduce_bytes * self.gammas[rank], lambda: self._enter(rank))


@dataclass(frozen=True)
class Job:
    """One collective call among several that run at the same time: ``schedule`` on ``nbytes`` of work buffer,
    rank ``i`` on device ``placement[i]``; ``api``: each rank's API operations around it (None: none);
    ``relay``: for each rank, the node its messages pass through (None: straight to the peer; see
    :func:`dtrain.sim.flows.relayed_route`), or None for no relays at all."""

    schedule: Schedule
    nbytes: int
    placement: tuple[str, ...]
    api: tuple[RankPasses, ...] | None = None
    relay: tuple[str | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.relay is not None and len(self.relay) != len(self.placement):
            raise ValueError(f"a job's relay names {len(self.relay)} nodes for {len(self.placement)} ranks")


def replay(
    schedule: Schedule,
    nbytes: int,
    topology: Topology,
    placement: Sequence[str] | None = None,
    *,
    cost: SoftwareCost | None = None,
    itemsize: int = 4,
    api: Sequence[RankPasses] | None = None,
) -> CollectiveResult:
    """Simulate ``schedule`` on a ``nbytes`` work buffer (see :mod:`dtrain.comm.cost.model` for what that is per
    collective), rank ``i`` on device ``placement[i]`` (default: :meth:`Topology.devices` in order); ``api``:
    each rank's API operations around the schedule (:func:`dtrain.sim.api_passes.api_passes`; None: the schedule
    alone)."""
    if placement is None:
        placement = [d.name for d in topology.devices()][: schedule.world_size]
    placement = check_placement(topology, placement, schedule.world_size)
    job = Job(schedule, nbytes, tuple(placement), tuple(api) if api is not None else None)
    return replay_concurrent([job], topology, cost=cost, itemsize=itemsize)


def replay_concurrent(
    jobs: Sequence[Job], topology: Topology, *, cost: SoftwareCost | None = None, itemsize: int = 4
) -> CollectiveResult:
    """Simulate several collectives started together (every tensor-parallel group's all-reduce of a layer, say),
    sharing the network; ``rank_finish_s`` lists the ranks of each job in turn."""
    cost = cost or SoftwareCost()
    net, states = _start_jobs(jobs, range(len(jobs)), topology, cost, itemsize)
    end = net.run()
    finish = [t for state in states for t in state.finish]
    return CollectiveResult(time_s=max(finish, default=0.0), rank_finish_s=finish, links=net.usage(end))


def _start_jobs(
    jobs: Sequence[Job], tags: Sequence[int], topology: Topology, cost: SoftwareCost, itemsize: int
) -> tuple[FlowNetwork, list[_Replay]]:
    """A network with ``jobs`` started on it, job ``i`` hashing its flows over equal-cost paths as ``tags[i]``."""
    net = FlowNetwork(topology, flow_cap_bytes_per_s=cost.flow_cap_bytes_per_s)
    states = []
    for tag, job in zip(tags, jobs, strict=True):
        placement = check_placement(topology, job.placement, job.schedule.world_size)
        gammas = [
            cost.gamma_s_per_byte if cost.gamma_s_per_byte is not None else 3 / topology.device(d).memory_bytes_per_s
            for d in placement
        ]
        rounds = _rank_rounds_cached(job.schedule, job.nbytes, itemsize)
        start, end = _api_times(job, topology, placement, cost)
        states.append(_Replay(net, rounds, placement, cost, gammas, start, end, tag, job.relay))
        states[-1].start()
    return net, states


def _api_times(
    job: Job, topology: Topology, placement: list[str], cost: SoftwareCost
) -> tuple[list[float], list[float]]:
    """Each rank's time before its first round (the call's start-up and the API's operations before the
    schedule) and after its last (the API's operations after it)."""
    api = job.api if job.api is not None else (RankPasses(),) * len(placement)
    if len(api) != len(placement):
        raise ValueError(f"the job's api gives {len(api)} ranks' passes for {len(placement)} ranks")
    start, end = [], []
    for passes, device in zip(api, placement, strict=True):
        copy = (
            cost.copy_s_per_byte if cost.copy_s_per_byte is not None else 2 / topology.device(device).memory_bytes_per_s
        )
        start.append(cost.call_s + len(passes.before) * cost.launch_s + passes.before_bytes * copy)
        end.append(len(passes.after) * cost.launch_s + passes.after_bytes * copy)
    return start, end
