"""Many concurrent collectives replayed at cluster scale: independent parts apart, identical parts once.

:func:`replay_jobs` gives what :func:`dtrain.sim.collective.replay_concurrent` gives, faster:

1. **Independent parts apart.** Jobs whose messages can share no link (over every equal-cost path of every pair
   of ranks that talk) cannot change each other's max-min fair rates, so each connected part is replayed on its
   own (exact: the same flows, the same ECMP hashes, the same events).
2. **Identical parts once.** Parts that run the same schedules on the same bytes over paths of the same shape
   (links of equal rate and latency in the same pattern, each pair with a single path so no hash picks one)
   give the same times: one is replayed and the others take its result, link by link. The tensor-parallel
   all-reduce of every server of a cluster is one replay. Parts whose pairs have several equal-cost paths are
   replayed each on its own: which path a hash picks for each pair decides their collisions.
3. **Rounds in lock step beyond ``flow_limit``.** When the jobs would start more than ``flow_limit`` messages, each
   part is replayed round by round, every rank waiting for the round's last message before the next (a bulk-
   synchronous approximation; ranks of a real run may run ahead), and rounds that move the same bytes between the
   same ranks are replayed once and counted as often as they occur: a ring all-reduce over ``n`` ranks is two round
   replays (one reduce-scatter round, one all-gather round) instead of ``2 (n - 1)``. Each round's messages still
   share the links max-min fairly and take their own ECMP paths. A pair's path is its connection's, the same in
   every round (the flow hash names the job and the two ranks, not the round): an InfiniBand subnet manager routes
   each destination over one fixed path (fat-tree routing, Zahavi et al. 2010, "Optimized InfiniBand fat-tree
   routing for shift all-to-all communication patterns"), and RoCE v2's ECMP hashes the UDP source port, which is
   fixed for a queue pair's life (InfiniBand Trade Association, RoCEv2 annex A17); NCCL keeps its connections
   for the communicator's life. So a repeated round collides where its first occurrence did, and lock step
   loses nothing there. This is how flow-level simulators reach tens of
   thousands of GPUs (SimAI, Wang et al., NSDI 2025, and ASTRA-sim's analytical backend replay a collective's phases
   rather than its packets).

No torch here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from dtrain.cluster.topology import Link, Topology, collector_paused
from dtrain.sim.collective import (
    CollectiveResult,
    Job,
    RankRound,
    SoftwareCost,
    _api_times,
    _rank_rounds_cached,
    _start_jobs,
    check_placement,
)
from dtrain.sim.flows import FlowNetwork, LinkUsage, relayed_routes, usage_rows

__all__ = ["replay_jobs", "DEFAULT_FLOW_LIMIT"]

#: Messages a part may start before it is replayed round by round (point 3 of the module docstring).
DEFAULT_FLOW_LIMIT = 50_000

_Key = tuple[str, str]


class _Part:
    """What one replayed part gave: its end, each job's ranks' finish times, each link's bytes and busy time (a
    link once)."""

    def __init__(self, end: float, finish: list[list[float]], links: list[tuple[Link, float, float]]) -> None:
        self.end, self.finish, self.links = end, finish, links


def _schedule_facts(rounds: list[list[RankRound]]) -> tuple[list[tuple[int, int]], int]:
    """The (sender, receiver) pairs of a schedule's rounds and how many messages it starts."""
    pairs, messages = set(), 0
    for rank, rrs in enumerate(rounds):
        for rr in rrs:
            messages += len(rr.sends)
            pairs.update((rank, peer) for peer in rr.sends)
    return sorted(pairs), messages


def replay_jobs(
    jobs: Sequence[Job],
    topology: Topology,
    *,
    cost: SoftwareCost | None = None,
    itemsize: int = 4,
    flow_limit: int | None = DEFAULT_FLOW_LIMIT,
) -> CollectiveResult:
    """:func:`~dtrain.sim.collective.replay_concurrent` of ``jobs``, replaying independent parts apart and
    identical parts once; a part of more than ``flow_limit`` messages in lock-step rounds (None: never)."""
    with collector_paused():
        return _replay_jobs(jobs, topology, cost or SoftwareCost(), itemsize, flow_limit)


def _replay_jobs(
    jobs: Sequence[Job], topology: Topology, cost: SoftwareCost, itemsize: int, flow_limit: int | None
) -> CollectiveResult:
    if flow_limit is not None and flow_limit < 1:
        raise ValueError(f"flow_limit must be >= 1 or None, got {flow_limit!r}")
    facts: dict[tuple[int, int], tuple[list[tuple[int, int]], int]] = {}
    job_rounds, job_pairs, job_messages = [], [], []
    for job in jobs:
        check_placement(topology, job.placement, job.schedule.world_size)
        rounds = _rank_rounds_cached(job.schedule, job.nbytes, itemsize)
        key = (id(rounds), 0)
        if key not in facts:
            facts[key] = _schedule_facts(rounds)
        job_rounds.append(rounds)
        job_pairs.append(facts[key][0])
        job_messages.append(facts[key][1])
    # the limit counts every message to replay: many small parts cost as much as one large one
    lock_step = flow_limit is not None and sum(job_messages) > flow_limit
    by_server = _on_servers(jobs, topology)
    if by_server is not None:
        found = _replay_servers(jobs, by_server, job_pairs, job_rounds, topology, cost, itemsize, lock_step)
        if found is not None:
            return _result(jobs, *found)
    routes = [
        [relayed_routes(topology, job.placement[a], job.placement[b], job.relay[a] if job.relay else None)
         for a, b in pairs]
        for job, pairs in zip(jobs, job_pairs, strict=True)
    ]  # fmt: skip
    parts = _connected(routes)
    results: dict[int, _Part] = {}  # by part index
    seen: dict[tuple, tuple[int, dict[int, int]]] = {}  # signature -> (part replayed, its links' signature order)
    for p, members in enumerate(parts):
        signature, order = _signature(members, jobs, job_pairs, routes, topology, cost)
        if signature is not None and signature in seen:
            first, index = seen[signature]
            results[p] = _relabel(results[first], index, order)
            continue
        sub = [jobs[j] for j in members]
        if lock_step:
            results[p] = _lock_step(sub, members, [job_rounds[j] for j in members], topology, cost)
        else:
            results[p] = _exact(sub, members, topology, cost, itemsize)
        if signature is not None:
            seen[signature] = (p, {id(link): i for i, link in enumerate(order)})
    return _result(jobs, parts, results)


def _result(jobs: Sequence[Job], parts: list[list[int]], results: dict[int, _Part]) -> CollectiveResult:
    finish_by_job: dict[int, list[float]] = {}
    for p, members in enumerate(parts):
        for j, times in zip(members, results[p].finish, strict=True):
            finish_by_job[j] = times
    finish = [t for j in range(len(jobs)) for t in finish_by_job[j]]
    end = max((r.end for r in results.values()), default=0.0)
    entries = [entry for r in results.values() for entry in r.links]
    return CollectiveResult(time_s=max(finish, default=0.0), rank_finish_s=finish, links=_busiest_first(entries, end))


def _busiest_first(entries: list[tuple[Link, float, float]], end: float) -> list[LinkUsage]:
    """``(link, bytes, busy seconds)`` as link rows of an ``end``-second run, busiest first, then by name: the
    order of sorting the rows by ``(-utilisation, name)``, found by one array sort (each utilisation the same float
    :attr:`LinkUsage.utilisation` gives; a link is named once)."""
    if not entries:
        return []
    links, nbytes, _ = zip(*entries, strict=True)
    nbytes = np.array(nbytes, dtype=float)
    if end > 0:
        util = nbytes / (end * np.fromiter(map(_RATE, links), dtype=float, count=len(links)))
    else:
        util = np.zeros(len(entries))
    by_name = np.empty(len(entries), dtype=np.int64)
    by_name[np.argsort(np.array(list(map(_NAME, links))), kind="stable")] = np.arange(len(entries))
    order = np.lexsort((by_name, -util))
    return usage_rows(map(entries.__getitem__, order.tolist()), end)


_RATE, _NAME = operator.attrgetter("bytes_per_s"), operator.attrgetter("name")
_RATE_LATENCY = operator.attrgetter("bytes_per_s", "latency_s")


def _on_servers(jobs: Sequence[Job], topology: Topology) -> list[str] | None:
    """The one server each job runs on, when every job runs on one server that is a copy of a template (see
    :meth:`dtrain.cluster.routing.TierRouter.template`) and routing is decided tier by tier; else None."""
    router = topology.router
    if not router.exact:
        return None
    servers = []
    for job in jobs:
        if job.relay is not None and any(job.relay):
            return None
        names = {topology.device(d).server for d in job.placement}
        if len(names) != 1:
            return None
        server = names.pop()
        if not router.template(server)[1]:
            return None
        servers.append(server)
    return servers


def _replay_servers(jobs, servers, job_pairs, job_rounds, topology: Topology, cost, itemsize, lock_step):
    """Jobs that each stay inside one server: the jobs of a server form a part (parts on different servers
    share no link when their routes stay inside), and parts on servers of one template running the same jobs
    on the same parts of their servers are copies: one is replayed, the others take its result with the
    server's name swapped in. None when a replayed part's route leaves its server or, outside lock step, has a
    choice of paths (a hash of device names would pick one): the general way then decides."""
    router = topology.router
    members: dict[str, list[int]] = {}
    for j, server in enumerate(servers):
        members.setdefault(server, []).append(j)
    parts = list(members.values())
    results: dict[int, _Part] = {}
    seen: dict[tuple, tuple[int, str]] = {}
    for p, (server, part) in enumerate(members.items()):
        template, prefix = router.template(server)
        cut = len(prefix)
        signature = (template, *(_job_shape(jobs[j], job_pairs[j], topology, cost, cut) for j in part))
        if signature in seen:
            first, first_prefix = seen[signature]
            results[p] = _swap(results[first], first_prefix, prefix, topology)
            continue
        for j in part:
            job = jobs[j]
            for a, b in job_pairs[j]:
                paths = topology.equal_cost_routes(job.placement[a], job.placement[b])
                if len(paths) != 1 and not lock_step:
                    return None
                if any(not (link.src.startswith(prefix) and link.dst.startswith(prefix)) for q in paths for link in q):
                    return None
        sub = [jobs[j] for j in part]
        if lock_step:
            results[p] = _lock_step(sub, part, [job_rounds[j] for j in part], topology, cost)
        else:
            results[p] = _exact(sub, part, topology, cost, itemsize)
        seen[signature] = (p, prefix)
    return parts, results


def _job_shape(job: Job, pairs, topology: Topology, cost: SoftwareCost, cut: int) -> tuple:
    """What decides a job's replay on a server, naming its devices by their part of the server."""
    devices = [topology.device(d) for d in job.placement]
    times = tuple(map(tuple, _api_times(job, topology, list(job.placement), cost))) if job.api is not None else None
    return (id(job.schedule), job.nbytes, tuple(pairs), tuple(d.name[cut:] for d in devices),
            tuple((d.memory_bytes_per_s, d.peak_flops) for d in devices), times)  # fmt: skip


def _swap(part: _Part, first: str, other: str, topology: Topology) -> _Part:
    """``part``, replayed on the server whose names start ``first``, moved to the server whose names start
    ``other``."""
    cut = len(first)
    link = topology.link
    links = [(link(other + u.src[cut:], other + u.dst[cut:]), nbytes, busy) for u, nbytes, busy in part.links]
    return _Part(part.end, part.finish, links)


def _connected(routes: list[list[list[list[Link]]]]) -> list[list[int]]:
    """Jobs grouped into parts that may share a link (union-find over every equal-cost path's links)."""
    parent = list(range(len(routes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}  # by the link's identity: a topology has one Link a pair of nodes
    for j, job_routes in enumerate(routes):
        for paths in job_routes:
            for path in paths:
                for link in path:
                    other = owner.setdefault(id(link), j)
                    if other != j:
                        a, b = find(other), find(j)
                        if a != b:
                            parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for j in range(len(routes)):
        groups.setdefault(find(j), []).append(j)
    return list(groups.values())


def _signature(members, jobs, job_pairs, routes, topology: Topology, cost: SoftwareCost):
    """A part's shape, equal for parts that replay alike, and its links in the order the shape names them; None
    (no copies) where a pair has several equal-cost paths."""
    label: dict[int, int] = {}  # by the link's identity: a topology has one Link a pair of nodes
    order: list[Link] = []
    shape = []
    for j in members:
        job = jobs[j]
        devices = [topology.device(d) for d in job.placement]
        # without API operations every rank starts after the call's start-up and ends with its last round
        api = tuple(map(tuple, _api_times(job, topology, list(job.placement), cost))) if job.api is not None else None
        labels, hops, lengths = [], [], []  # each path's links: their numbers, rates and latencies
        for paths_of_pair in routes[j]:
            if len(paths_of_pair) != 1:
                return None, order
            path = paths_of_pair[0]
            lengths.append(len(path))
            for link in path:
                at = label.get(id(link))
                if at is None:
                    at = label[id(link)] = len(order)
                    order.append(link)
                labels.append(at)
            hops += map(_RATE_LATENCY, path)
        memory = tuple(d.memory_bytes_per_s for d in devices)
        shape.append((id(job.schedule), job.nbytes, tuple(job_pairs[j]), tuple(lengths), tuple(labels), tuple(hops),
                      memory, api))  # fmt: skip
    return tuple(shape), order


def _relabel(part: _Part, index: dict[int, int], other: list[Link]) -> _Part:
    """``part``, replayed on links that ``index`` numbers (by identity), moved to the links ``other`` of the same
    numbers."""
    return _Part(part.end, part.finish, [(other[index[id(u)]], nbytes, busy) for u, nbytes, busy in part.links])


def _exact(jobs: list[Job], tags: list[int], topology: Topology, cost: SoftwareCost, itemsize: int) -> _Part:
    net, states = _start_jobs(jobs, tags, topology, cost, itemsize)
    end = net.run()
    links = [(u.link, u.nbytes, u.busy_s) for u in net.usage(end)]
    return _Part(end, [state.finish for state in states], links)


#: Per schedule's rank rounds (by identity): each round index's traffic pattern as a small integer.
_PATTERNS: dict[int, tuple[list[list[RankRound]], dict[int, int], dict[int, dict[int, RankRound]]]] = {}


def _patterns(rounds: list[list[RankRound]]) -> tuple[dict[int, int], dict[int, dict[int, RankRound]]]:
    """Round index -> pattern id (rounds moving the same bytes between the same ranks share one), and round
    index -> {rank: its part of the round}."""
    found = _PATTERNS.get(id(rounds))
    if found is None or found[0] is not rounds:
        by_index: dict[int, dict[int, RankRound]] = {}
        for rank, rrs in enumerate(rounds):
            for rr in rrs:
                by_index.setdefault(rr.index, {})[rank] = rr
        ids: dict[tuple, int] = {}
        pattern = {}
        for index in sorted(by_index):
            key = tuple(
                (rank, tuple(rr.sends.items()), tuple(rr.recvs.items()), rr.reduce_bytes)
                for rank, rr in sorted(by_index[index].items())
            )
            pattern[index] = ids.setdefault(key, len(ids))
        if len(_PATTERNS) > 256:
            _PATTERNS.clear()
        found = _PATTERNS[id(rounds)] = (rounds, pattern, by_index)
    return found[1], found[2]


def _lock_step(
    jobs: list[Job],
    tags: list[int],
    rounds: list[list[list[RankRound]]],
    topology: Topology,
    cost: SoftwareCost,
) -> _Part:
    """Point 3 of the module docstring: every round a barrier for each job, each distinct round replayed once
    (all jobs' messages of it at once), each job's time the sum of its rounds' lengths."""
    per_job = [_patterns(r) for r in rounds]
    indices = sorted({i for pattern, _ in per_job for i in pattern})
    occurs: dict[tuple, list[int]] = {}  # combined pattern -> the round indices it occurs at
    for index in indices:
        key = tuple(pattern.get(index, -1) for pattern, _ in per_job)
        occurs.setdefault(key, []).append(index)
    gammas, starts, ends = [], [], []
    for job in jobs:
        placement = list(job.placement)
        gammas.append([
            cost.gamma_s_per_byte if cost.gamma_s_per_byte is not None else 3 / topology.device(d).memory_bytes_per_s
            for d in placement
        ])  # fmt: skip
        start, end = _api_times(job, topology, placement, cost)
        starts.append(start)
        ends.append(end)
    totals = [max(s, default=0.0) for s in starts]
    links: dict[_Key, list] = {}
    for at in occurs.values():
        weight = len(at)
        for index in at[:1]:
            lengths, usage = _one_round(jobs, tags, [by_index.get(index, {}) for _, by_index in per_job], gammas,
                                        index, topology, cost)  # fmt: skip
            for j, length in enumerate(lengths):
                totals[j] += weight * length
            for u in usage:
                entry = links.setdefault((u.link.src, u.link.dst), [u.link, 0.0, 0.0])
                entry[1] += weight * u.nbytes
                entry[2] += weight * u.busy_s
    totals = [t + max(e, default=0.0) for t, e in zip(totals, ends, strict=True)]
    finish = [[t] * len(job.placement) for t, job in zip(totals, jobs, strict=True)]
    return _Part(max(totals, default=0.0), finish, [(v[0], v[1], v[2]) for v in links.values()])


def _one_round(jobs, tags, parts, gammas, index: int, topology: Topology, cost: SoftwareCost):
    """One round of every job at once from a common start: each job's length (its last rank to finish its
    messages and reduction) and the links' usage."""
    net = FlowNetwork(topology, flow_cap_bytes_per_s=cost.flow_cap_bytes_per_s)
    done: dict[tuple[int, int], float] = {}
    for j, job in enumerate(jobs):
        posted = {rank: cost.start_s(rr.peers) for rank, rr in parts[j].items()}
        for rank, t in posted.items():
            done[(j, rank)] = t
        for rank, rr in parts[j].items():
            for peer, nbytes in rr.sends.items():
                flow_id = hash((tags[j], rank, peer)) & 0x7FFFFFFF  # the connection's path, every round

                def finished(t: float, j=j, a=rank, b=peer) -> None:
                    done[(j, a)] = max(done[(j, a)], t)
                    done[(j, b)] = max(done[(j, b)], t)

                src, dst = job.placement[rank], job.placement[peer]
                via = job.relay[rank] if job.relay else None
                start = max(posted[rank], posted.get(peer, 0.0))
                net.at(start, lambda s=src, d=dst, n=nbytes, f=flow_id, cb=finished, v=via: net.send(
                    s, d, n, flow_id=f, on_done=cb, cap_bytes_per_s=cost.cap_for(n), via=v))  # fmt: skip
    end = net.run()
    lengths = [0.0] * len(jobs)
    for (j, rank), t in done.items():
        lengths[j] = max(lengths[j], t + parts[j][rank].reduce_bytes * gammas[j][rank])
    return [length if math.isfinite(length) else end for length in lengths], net.usage(end)
