"""The time of a schedule on the peer-memory transport (:mod:`dtrain.comm.peer`), from its compiled pull plan.

On that transport nothing is a message: every rank reads its peers' windows with one kernel a destination range,
between device barriers, and a rank's host enqueues the whole call ahead of its GPU. So the model walks the
plan the runtime itself runs (:func:`dtrain.comm.peer.pull.compile_pull`), per rank:

- **GPU time**: for each round, a barrier (every rank waits for the slowest to arrive), the copies into the
  window at the local copy rate, then the pull passes one after another: a pass reading one peer at the pair
  rate, a pass reading several peers at once at the fan-in rate (what one rank reads in all; on 4 H200s all
  ranks reading all peers contend, so this is *lower* than one pair's), plus a second barrier and its local
  copies where the plan defers window writes; at the end the copies out and the last barrier. Every kernel
  or torch operation also costs ``gpu_op_s`` besides its bytes (the gap between kernels and the ramp to full
  rate: on 4 H100s a 16 MiB read takes 4.4 us more than its bytes at the rate of a 256 MiB one). Ranks' passes
  between two barriers run at once, so with ``port_bytes_per_s`` the transfers out of and into one GPU share
  its port (a star's three readers of the root, three pushes into it), and a pass reading several peers while
  nobody reads its rank runs at the lone fan-in rate (one direction of the port loaded, not both).
- **Host time**: a fixed cost a call, and a cost for each barrier, each torch operation (a copy, a small
  pass) and each launch of the fused Triton kernel it enqueues (the runtime's own rule,
  :func:`dtrain.comm.peer.kernels.wants_kernel`, says which passes are fused).

A call takes the larger of the two: the host runs ahead of the GPU until the GPU catches up with it (small
messages are host-bound, large ones GPU-bound). A graph-replayed call (``DTRAIN_COMM_PERSISTENT=1``) costs
``host_replay_s`` on the host (the API's checks, the look-ups, the graph launch). Figures come from the
micro-benchmarks or are fitted to ``dtrain bench comm`` runs (:func:`fit_peer_cost`).

``api`` adds the public API's own operations around the schedule (:mod:`dtrain.sim.api_passes`: the clones and
copies of reduce-scatter, all-gather, all-to-all, ...), replayed or not: each is a torch operation on the host
(``host_launch_s``) and a local pass on the GPU, those before the schedule ahead of its first barrier, those
after it behind its last.

``push=True`` prices the push form instead (:func:`dtrain.comm.peer.push.compile_push`): a barrier before every
round and one after the last; a round's sends one after another at the push rate (a pass that reads local
buffers and stores into a peer), its local folds at the local rate; after the last barrier, the final folds.

**One kernel.** Over NVLink the one-round schedules run as one call of the exchange kernel
(:func:`dtrain.comm.peer.kernels.exchange`, up to 8 MiB a rank; the one-shot all-reduce up to 256 KiB), not as
a pull plan: :func:`exchange_time` prices that call (:func:`exchange_form` says which calls run it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from dtrain.comm.ir.schedule import Schedule
from dtrain.comm.peer.pull import PullOp, compile_pull, wants_kernel
from dtrain.comm.peer.push import PushOp, compile_push
from dtrain.sim.api_passes import RankPasses

__all__ = [
    "EXCHANGE_FORMS", "ExchangeTime", "PeerCost", "PeerTime", "exchange_form", "exchange_time", "fit_peer_cost",
    "peer_time",
]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PeerCost:
    """The peer transport's figures. Rates in bytes per second, times in seconds.

    ``pair_bytes_per_s``: a pass reading one peer; ``fanin_bytes_per_s``: all a rank reads in a pass that reads
    several peers; ``local_bytes_per_s``: a copy within the GPU's memory; ``barrier_s``: a device barrier;
    ``host_call_s``, ``host_barrier_s``, ``host_launch_s``: host time a call, a barrier, a kernel or copy;
    ``push_bytes_per_s``: a push pass (reads local buffers, stores into a peer; None: the pair rate);
    ``host_kernel_s``: host time of a fused-kernel launch (None: ``host_launch_s``); ``host_replay_s``: host
    time of a graph-replayed call (the API's checks, the plan and graph look-up, the graph launch);
    ``gpu_op_s``: GPU time of each kernel or torch operation besides its bytes (the gap between two kernels and
    the ramp to full rate), so that a pass of ``b`` bytes takes ``gpu_op_s + b / rate``; with it, the rates are
    those a pass reaches when large (0: the rates carry it, as measured at one size); ``gpu_peer_copy_s``: the
    same for a plain ``copy_`` out of or into a peer's memory, which CUDA runs on a copy engine, not on the SMs
    (None: ``gpu_op_s``); ``peer_copy_bytes_per_s``: the rate of such a copy (None: the pair or push rate).

    ``port_bytes_per_s``: what one GPU's port to the others (its NVLinks, one direction) carries in all. Every
    pass between two barriers runs at once with the other ranks' passes, so the transfers out of one GPU (the
    reads of its memory, its pushes) and into it (its reads, the pushes into it) share that port: a pass takes
    at least the time the busiest port it crosses needs for all of that stretch's bytes (a star broadcast's
    three readers share the root's port; None: ports are not shared). ``lone_fanin_bytes_per_s``: a pass
    reading several peers while no rank reads this one's memory (a star reduce's root: one direction of its
    port only; None: the port rate if given, else ``fanin_bytes_per_s``); ``fanin_curve``: the fan-in rate by
    the bytes a pass reads, ``((bytes, rate), ...)`` from a micro-benchmark, interpolated in log bytes and held
    beyond its ends (every rank reading every peer at once reaches more of the port the more it reads; empty:
    ``fanin_bytes_per_s`` at every size).
    """

    pair_bytes_per_s: float
    fanin_bytes_per_s: float
    local_bytes_per_s: float
    barrier_s: float
    host_call_s: float = 0.0
    host_barrier_s: float = 0.0
    host_launch_s: float = 0.0
    push_bytes_per_s: float | None = None
    host_kernel_s: float | None = None
    host_replay_s: float = 0.0
    gpu_op_s: float = 0.0
    gpu_peer_copy_s: float | None = None
    peer_copy_bytes_per_s: float | None = None
    port_bytes_per_s: float | None = None
    lone_fanin_bytes_per_s: float | None = None
    fanin_curve: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("port_bytes_per_s", "lone_fanin_bytes_per_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"PeerCost.{name} must be > 0 or None, got {getattr(self, name)!r}")
        curve = tuple(tuple(point) for point in self.fanin_curve)
        if any(len(point) != 2 or not (point[0] > 0 and point[1] > 0) for point in curve):
            raise ValueError(f"PeerCost.fanin_curve must be (bytes > 0, rate > 0) pairs, got {self.fanin_curve!r}")
        if any(b[0] <= a[0] for a, b in zip(curve, curve[1:], strict=False)):
            raise ValueError(f"PeerCost.fanin_curve must be in increasing bytes, got {self.fanin_curve!r}")
        object.__setattr__(self, "fanin_curve", curve)
        if self.host_kernel_s is not None and not self.host_kernel_s >= 0:
            raise ValueError(f"PeerCost.host_kernel_s must be >= 0 or None, got {self.host_kernel_s!r}")
        if self.gpu_peer_copy_s is not None and not self.gpu_peer_copy_s >= 0:
            raise ValueError(f"PeerCost.gpu_peer_copy_s must be >= 0 or None, got {self.gpu_peer_copy_s!r}")
        if self.peer_copy_bytes_per_s is not None and not self.peer_copy_bytes_per_s > 0:
            raise ValueError(f"PeerCost.peer_copy_bytes_per_s must be > 0 or None, got {self.peer_copy_bytes_per_s!r}")
        if self.push_bytes_per_s is not None and not self.push_bytes_per_s > 0:
            raise ValueError(f"PeerCost.push_bytes_per_s must be > 0 or None, got {self.push_bytes_per_s!r}")
        for name in ("pair_bytes_per_s", "fanin_bytes_per_s", "local_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PeerCost.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("barrier_s", "host_call_s", "host_barrier_s", "host_launch_s", "host_replay_s", "gpu_op_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PeerCost.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class PeerTime:
    """A call's predicted ``time_s`` = max(``gpu_s``, ``host_s``), and what it is made of."""

    time_s: float
    gpu_s: float
    host_s: float
    barriers: int
    launches: int  # torch operations and fused-kernel launches, on the rank with the most host work
    kernels: int = 0  # of which fused-kernel launches
    api_launches: int = 0  # of which the API's own operations (``api``), on the rank with the most


# a pass: (bytes, peers read, a plain copy, its flows: (peer, bytes) read from the peer's memory or pushed into it)
Pass = tuple[float, int, bool, tuple[tuple[int, float], ...]]
# (local bytes, passes, operations, of which copies from or into a peer's memory) between two barriers
Stretch = tuple[float, list[Pass], int, int]


def _pull_op_launches(op: PullOp, itemsize: int) -> tuple[int, int]:
    """(torch operations, fused-kernel launches) of one pull pass, by the runtime's rule (``wants_kernel``)."""
    nouts = int(op.to_x) + int(op.to_w)
    if wants_kernel(nouts, len(op.reads), op.length * itemsize, has_base=op.base is not None):
        return 0, 1
    return len(op.reads) + (nouts > 1), 0


def _pull_peer_copies(op: PullOp, itemsize: int) -> int:
    """1 if the pass is a plain ``copy_`` out of one peer's memory (no reduction, no fused kernel), else 0."""
    nouts = int(op.to_x) + int(op.to_w)
    if wants_kernel(nouts, len(op.reads), op.length * itemsize, has_base=op.base is not None):
        return 0
    return int(op.base is None and len(op.reads) == 1)


def _push_peer_copies(op: PushOp, itemsize: int) -> int:
    """1 if the pass is a plain ``copy_`` into a peer's memory, else 0."""
    operands = int(op.base_x) + len(op.banks)
    if op.dst is None:
        return 0
    nouts = 1 + int(op.to_x)
    if wants_kernel(nouts, max(operands - 1, 1), op.length * itemsize, has_base=operands > 1, remote=True):
        return 0
    return int(operands == 1)


def _push_op_launches(op: PushOp, itemsize: int) -> tuple[int, int]:
    """(torch operations, fused-kernel launches) of one push pass or local fold."""
    operands = int(op.base_x) + len(op.banks)
    nouts = int(op.dst is not None) + int(op.to_x)
    remote = op.dst is not None
    if wants_kernel(nouts, max(operands - 1, 1), op.length * itemsize, has_base=operands > 1, remote=remote):
        return 0, 1
    return (1 if operands <= 2 else operands - 1) + (nouts > 1), 0


def _phases(schedule: Schedule, numel: int, itemsize: int) -> list[list[Stretch]]:
    """Per rank, the stretches of work between two barriers, in order: (local bytes copied, passes,
    operations launched), a pass being (bytes read, peers read). The runtime's order: copy-in, barrier; the
    round's passes (then a second barrier and the deferred copies), the next round's copy-in, barrier; ...;
    the copy-out, barrier."""
    out = []
    for r in range(schedule.world_size):
        plan = compile_pull(schedule, r, numel)
        phases: list[Stretch] = []
        first = plan.rounds[0].copy_in if plan.rounds else ()
        local, ops, peer = sum(n for _, n in first) * itemsize, len(first), 0
        passes: list[tuple[float, int]] = []
        for k, rnd in enumerate(plan.rounds):
            phases.append((local, passes, ops, peer))  # ends at the barrier before round k
            passes = [
                (
                    op.length * itemsize * len(op.reads),
                    len(op.reads),
                    bool(_pull_peer_copies(op, itemsize)),
                    tuple((peer, op.length * itemsize) for peer, _ in op.reads),
                )
                for op in rnd.ops
            ]
            local, ops = 0.0, sum(sum(_pull_op_launches(op, itemsize)) for op in rnd.ops)
            peer = sum(_pull_peer_copies(op, itemsize) for op in rnd.ops)
            if rnd.second_barrier:
                phases.append((local, passes, ops, peer))
                local, passes, ops, peer = sum(n for _, n in rnd.deferred) * itemsize, [], len(rnd.deferred), 0
            if k + 1 < len(plan.rounds):
                local += sum(n for _, n in plan.rounds[k + 1].copy_in) * itemsize
                ops += len(plan.rounds[k + 1].copy_in)
        local += sum(n for _, n in plan.copy_out) * itemsize
        phases.append((local, passes, ops + len(plan.copy_out), peer))  # ends at the last barrier
        out.append(phases)
    return out


def _push_phases(schedule: Schedule, numel: int, itemsize: int) -> list[list[Stretch]]:
    """The push plan as :func:`_phases` gives the pull plan: per rank, (local bytes, passes, operations)
    between barriers, a pass being (bytes stored into a peer, 1); local folds count as local bytes. The last
    stretch (the final folds) ends at no barrier."""
    out = []
    for r in range(schedule.world_size):
        plan = compile_push(schedule, r, numel)
        phases: list[Stretch] = [(0.0, [], 0, 0)]  # ends at the barrier before round 0
        for rnd in plan.rounds:
            local = sum(op.length for op in rnd.ops if op.dst is None) * itemsize
            passes = [
                (op.length * itemsize, 1, bool(_push_peer_copies(op, itemsize)), ((op.dst, op.length * itemsize),))
                for op in rnd.ops
                if op.dst is not None
            ]
            ops = sum(sum(_push_op_launches(op, itemsize)) for op in rnd.ops)
            phases.append((local, passes, ops, sum(_push_peer_copies(op, itemsize) for op in rnd.ops)))
        folds = sum(sum(_push_op_launches(op, itemsize)) for op in plan.final)
        phases.append((sum(op.length for op in plan.final) * itemsize, [], folds, 0))
        out.append(phases)
    return out


def peer_time(
    schedule: Schedule,
    nbytes: int,
    cost: PeerCost,
    *,
    itemsize: int = 4,
    replayed: bool = False,
    push: bool = False,
    api: Sequence[RankPasses] | None = None,
) -> PeerTime:
    """Predicted time of ``schedule`` on a ``nbytes`` work buffer through the peer transport.

    ``replayed``: the call is a CUDA-graph replay, so its host time is ``host_replay_s`` and the API's own
    operations. ``push``: the push form. ``api``: each rank's API operations around the schedule
    (:func:`dtrain.sim.api_passes.api_passes`); None: the schedule alone.
    """
    numel = max(nbytes // itemsize, 0)
    ranks = (_push_phases if push else _phases)(schedule, numel, itemsize)
    api = list(api) if api is not None else [RankPasses()] * schedule.world_size
    if len(api) != schedule.world_size:
        raise ValueError(f"api gives {len(api)} ranks' passes for a schedule of {schedule.world_size} ranks")
    gpu = _gpu_s(ranks, api, cost, push)
    nphases = len(ranks[0])
    barriers = nphases - 1 if push else nphases
    torch_ops, kernels, api_launches = _launches(schedule, numel, itemsize, push, [p.launches for p in api])
    kernel_s = cost.host_launch_s if cost.host_kernel_s is None else cost.host_kernel_s
    if replayed:  # the graph holds the schedule's launches; the API's operations are still the host's
        api_launches = max(p.launches for p in api)
        host = cost.host_replay_s + api_launches * cost.host_launch_s
    else:
        host = cost.host_call_s + barriers * cost.host_barrier_s + torch_ops * cost.host_launch_s + kernels * kernel_s
    return PeerTime(
        time_s=max(gpu, host),
        gpu_s=gpu,
        host_s=host,
        barriers=barriers,
        launches=torch_ops + kernels,
        kernels=kernels,
        api_launches=api_launches,
    )


def _gpu_s(ranks: list[list[Stretch]], api: Sequence[RankPasses], cost: PeerCost, push: bool) -> float:
    """GPU time of every rank's stretches (:func:`_phases`, :func:`_push_phases`) with the API's passes, those
    before the schedule ahead of its first barrier and those after it behind its last; every operation costs
    ``gpu_op_s`` besides its bytes."""
    for phases, passes in zip(ranks, api, strict=True):
        local, reads, ops, peer = phases[0]
        phases[0] = (local + passes.before_bytes, reads, ops + len(passes.before), peer)
        if push:  # the final folds end at no barrier: the API's copies out follow them
            local, reads, ops, peer = phases[-1]
            phases[-1] = (local + passes.after_bytes, reads, ops + len(passes.after), peer)
    nphases = len(ranks[0])
    copy_s = cost.gpu_op_s if cost.gpu_peer_copy_s is None else cost.gpu_peer_copy_s
    pair = (cost.push_bytes_per_s or cost.pair_bytes_per_s) if push else cost.pair_bytes_per_s
    copy_rate = cost.peer_copy_bytes_per_s or pair
    gpu = 0.0
    for k in range(nphases):  # every phase ends at a barrier all ranks take, so the slowest rank sets it
        out_load, in_load = _port_loads([phases[k][1] for phases in ranks], push)
        slowest = 0.0
        for r, phases in enumerate(ranks):
            local, passes, ops, peer = phases[k]
            t = local / cost.local_bytes_per_s + (ops - peer) * cost.gpu_op_s + peer * copy_s
            moving, busiest = 0.0, 0.0
            for read, peers, plain_copy, flows in passes:
                if peers > 1:
                    rate = _fanin_rate(cost, read, lone=out_load[r] == 0)
                else:
                    rate = copy_rate if plain_copy else pair
                moving += read / rate
                for p, _ in flows:  # the ports this pass crosses: its own and its peer's
                    mine, theirs = (out_load[r], in_load[p]) if push else (in_load[r], out_load[p])
                    busiest = max(busiest, mine, theirs)
            if cost.port_bytes_per_s is not None:
                moving = max(moving, busiest / cost.port_bytes_per_s)
            slowest = max(slowest, t + moving)
        gpu += slowest + (cost.barrier_s if not push or k + 1 < nphases else 0.0)
    if not push:
        gpu += max(p.after_bytes / cost.local_bytes_per_s + len(p.after) * cost.gpu_op_s for p in api)
    return gpu


def _port_loads(passes: Sequence[Sequence[Pass]], push: bool) -> tuple[list[float], list[float]]:
    """Bytes out of and into each GPU's port in one stretch, every rank's passes (``passes[r]``) together: a
    pull moves bytes out of the peer read and into the reader, a push out of the pusher and into the peer."""
    out_load, in_load = [0.0] * len(passes), [0.0] * len(passes)
    for r, rank_passes in enumerate(passes):
        for *_, flows in rank_passes:
            for p, nbytes in flows:
                src, dst = (r, p) if push else (p, r)
                out_load[src] += nbytes
                in_load[dst] += nbytes
    return out_load, in_load


def _fanin_rate(cost: PeerCost, nbytes: float, *, lone: bool) -> float:
    """The rate of a pass reading ``nbytes`` from several peers: alone (no rank reads this one's memory
    meanwhile) at the lone fan-in rate, else by the fan-in curve (or the one fan-in rate)."""
    if lone:
        if cost.lone_fanin_bytes_per_s is not None:
            return cost.lone_fanin_bytes_per_s
        if cost.port_bytes_per_s is not None:
            return cost.port_bytes_per_s
    curve = cost.fanin_curve
    if not curve:
        return cost.fanin_bytes_per_s
    if nbytes <= curve[0][0]:
        return curve[0][1]
    if nbytes >= curve[-1][0]:
        return curve[-1][1]
    xs = np.log([b for b, _ in curve])
    return float(np.interp(np.log(nbytes), xs, [rate for _, rate in curve]))


def _launches(
    schedule: Schedule, numel: int, itemsize: int, push: bool, api_launches: Sequence[int]
) -> tuple[int, int, int]:
    """(torch operations, fused-kernel launches, of the operations the API's own) of the rank that enqueues
    the most (then the most kernels): chosen by counts alone, so fitting the host terms sees the same rank
    whatever the figures. ``api_launches``: each rank's API operations, counted as torch operations."""
    best = (0, 0, 0)
    for r in range(schedule.world_size):
        torch_ops, kernels = api_launches[r], 0
        if push:
            plan = compile_push(schedule, r, numel)
            counts = [_push_op_launches(op, itemsize) for rnd in plan.rounds for op in rnd.ops]
            counts += [_push_op_launches(op, itemsize) for op in plan.final]
        else:
            plan = compile_pull(schedule, r, numel)
            counts = [_pull_op_launches(op, itemsize) for rnd in plan.rounds for op in rnd.ops]
            torch_ops += sum(len(rnd.copy_in) + len(rnd.deferred) for rnd in plan.rounds) + len(plan.copy_out)
        torch_ops += sum(c[0] for c in counts)
        kernels += sum(c[1] for c in counts)
        if (torch_ops + kernels, kernels) > (best[0] + best[1], best[1]):
            best = (torch_ops, kernels, api_launches[r])
    return best


def fit_peer_cost(
    points: Sequence[tuple],
    base: PeerCost,
    *,
    host_below_bytes: int = 1 << 20,
    gpu: bool = True,
) -> PeerCost:
    """Fit ``base``'s figures to measured ``(schedule, nbytes, seconds, replayed[, push[, api]])`` points.

    The host terms by non-negative least squares on the eager points of at most ``host_below_bytes`` (where a
    call is host-bound; a fused-kernel launch keeps ``base.host_kernel_s`` when that is given), and the host
    time of a replay from the replayed points up to that size (:func:`_fit_replay_host`); then, with ``gpu``,
    the pair rate, the fan-in rate and the barrier, each by a
    golden-section search on the mean squared log error of every point, in turn, three times. A point may carry
    a fifth element, True for a call in the push form, and a sixth, the API's passes (:func:`peer_time`'s
    ``api``).
    """
    pts = [(p[0], p[1], p[2], p[3], bool(p[4]) if len(p) > 4 else False, p[5] if len(p) > 5 else None) for p in points]
    replays = [(s, n, t, push, api) for s, n, t, rep, push, api in pts if rep and n <= host_below_bytes]
    if replays:
        base = replace(base, host_replay_s=_fit_replay_host(replays, base))
    small = [(s, n, t, push, api) for s, n, t, rep, push, api in pts if not rep and n <= host_below_bytes]
    cost = base
    if small:
        rows, rhs = [], []
        for s, n, t, push, api in small:
            pt = peer_time(s, n, cost, push=push, api=api)
            if cost.host_kernel_s is None:  # every launch at one price
                rows.append([1.0, pt.barriers, pt.launches])
                rhs.append(t)
            else:  # kernel launches at their given price, the torch operations' price fitted
                rows.append([1.0, pt.barriers, pt.launches - pt.kernels])
                rhs.append(t - pt.kernels * cost.host_kernel_s)
        coef = _nnls(np.array(rows), np.array(rhs))
        cost = replace(cost, host_call_s=coef[0], host_barrier_s=coef[1], host_launch_s=coef[2])

    def loss(c: PeerCost) -> float:
        errs = [
            np.log(peer_time(s, n, c, replayed=rep, push=push, api=api).time_s / t) for s, n, t, rep, push, api in pts
        ]
        return float(np.mean(np.square(errs)))

    for _ in range(3 if gpu else 0):
        for name, low, high in (
            ("pair_bytes_per_s", 50e9, 900e9),
            ("fanin_bytes_per_s", 50e9, 900e9),
            ("barrier_s", 0.0, 50e-6),
        ):
            best = _golden(lambda v, n=name, c=cost: loss(replace(c, **{n: v})), low, high)
            cost = replace(cost, **{name: best})
    return cost


def _fit_replay_host(replays: Sequence[tuple], cost: PeerCost) -> float:
    """The host time of a replayed call that best explains ``(schedule, nbytes, seconds, push, api)`` replays:
    the value, of those the points themselves imply (``seconds`` less their API operations at
    ``cost.host_launch_s``), with the least absolute log error of ``max(GPU, host)`` summed over the points, the
    GPU time priced with ``cost``; the median of the values tied for it.

    A small replay is not always host-bound: on 4 H100s a replayed ring all-reduce of 1 MiB waits 70-87 us on
    its barriers and kernels against ~34 us of host time (``benchmarks/collectives/probe.py replay-host``). Where every
    point is host-bound this is the median of what they imply; a point its GPU time explains does not pull the
    host time up to its own.
    """
    points = []
    for s, n, t, push, api in replays:
        pt = peer_time(s, n, cost, replayed=True, push=push, api=api)
        points.append((t, pt.gpu_s, pt.api_launches * cost.host_launch_s))
    candidates = sorted(max(t - api_s, 0.0) for t, _, api_s in points)

    def loss(host: float) -> float:
        return sum(abs(np.log(max(gpu, host + api_s) / t)) for t, gpu, api_s in points)

    losses = [loss(h) for h in candidates]
    best = min(losses) * (1 + 1e-9) + 1e-15  # ties: equal up to rounding
    return float(np.median([h for h, v in zip(candidates, losses, strict=True) if v <= best]))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop the most negative and refit until none is)."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        x[active] = sol
        if (x >= 0).all() or not active:
            return np.maximum(x, 0)
        active.remove(active[int(np.argmin(sol))])


def _golden(loss, low: float, high: float, steps: int = 40) -> float:
    ratio = (5**0.5 - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = loss(d)
    return (a + b) / 2


# --- the exchange kernel ---------------------------------------------------------------------------------------

#: The collective and algorithm that the exchange kernel runs, and its form (:data:`dtrain.comm.peer.fused.ONE_PASS`,
#: and the one-shot all-reduce of :func:`dtrain.comm.peer.fused.reducer`).
EXCHANGE_FORMS = {
    ("all_gather", "direct"): "gather",
    ("all_to_all", "direct"): "exchange",
    ("reduce_scatter", "direct"): "scatter",
    ("broadcast", "star"): "broadcast",
    ("broadcast", "scatter_allgather"): "relay",
    ("all_reduce", "one_shot"): "reduce",
    ("all_reduce", "direct"): "two_shot",
    ("reduce", "star"): "rooted",
    ("gather", "star"): "gather_to",
    ("scatter", "star"): "scatter_from",
}
#: The most bytes a rank puts into a one-pass call (:data:`dtrain.comm.peer.fused.ONE_PASS_MAX_BYTES`) and into the
#: kernel's one-shot and two-shot all-reduces (:data:`dtrain.comm.peer.fused.REDUCE_MAX_BYTES`,
#: ``TWO_SHOT_MAX_BYTES``; above them torch's kernels).
ONE_PASS_MAX_BYTES = 8 << 20
REDUCE_MAX_BYTES = 256 << 10
TWO_SHOT_MAX_BYTES = 64 << 20
_LIMITS = {"reduce": REDUCE_MAX_BYTES, "two_shot": TWO_SHOT_MAX_BYTES}
#: The kernel's elements a chunk, most programs and most (program, peer) pairs
#: (:data:`dtrain.comm.peer.kernels.EXCHANGE_BLOCK`, ``EXCHANGE_PROGRAMS``, ``EXCHANGE_PAIRS``), and the words its
#: copy forms copy in, widest first
#: (:func:`dtrain.comm.peer.kernels.word_bytes`).
EXCHANGE_BLOCK = 2048
EXCHANGE_PROGRAMS = 128
EXCHANGE_PAIRS = 256
#: The two-shot all-reduce's programs (:data:`dtrain.comm.peer.kernels.TWO_SHOT_PROGRAMS`).
TWO_SHOT_PROGRAMS = 256
#: Programs of the exchange kernel that together reach each of :class:`PeerCost`'s rates (the kernel the rates
#: were measured beside ran 32)
RATE_PROGRAMS = 32
EXCHANGE_WORDS = (8, 4, 2, 1)


def exchange_form(collective: str, algorithm: str, nbytes: int) -> str | None:
    """The exchange kernel's form that runs ``algorithm`` for ``collective`` with ``nbytes`` a rank puts in (an
    all-gather's or gather's input, a reduce-scatter's or all-to-all's whole input, the scatter's root's input, the
    broadcast's, reduce's or all-reduce's tensor),
    or None (a pull plan or torch's kernels run it): the runtime's limits, 8 MiB a rank, 256 KiB a one-shot
    all-reduce, 64 MiB a two-shot one."""
    form = EXCHANGE_FORMS.get((collective, algorithm))
    limit = _LIMITS.get(form, ONE_PASS_MAX_BYTES)
    return form if form is not None and 0 < nbytes <= limit else None


@dataclass(frozen=True)
class ExchangeTime:
    """One exchange-kernel call: ``time_s`` = max(``gpu_s``, ``host_s``); ``gpu_s`` = ``launch_s`` + ``copy_in_s``
    + ``barrier_s`` + ``read_s`` on the slowest rank; ``programs``: the kernel's grid."""

    time_s: float
    gpu_s: float
    host_s: float
    launch_s: float
    copy_in_s: float
    barrier_s: float
    read_s: float
    programs: int


def exchange_time(
    form: str, world: int, nbytes: int, cost: PeerCost, *, itemsize: int = 4, host_s: float = 0.0
) -> ExchangeTime:
    """One call of the exchange kernel in ``form`` (:data:`EXCHANGE_FORMS`'s values) on ``world`` GPUs, each rank
    putting in ``nbytes`` (as :func:`exchange_form`; the scatter's root puts in every block, the others nothing);
    ``itemsize``: the element of a sum (the copy forms copy the widest word that divides a block, 8 bytes at most);
    ``host_s``: the host's time a call. The reduce's and the gather's root, which reads every peer, is the slowest
    rank: they are priced as the one-shot all-reduce and the all-gather; the scatter as the broadcast, its readers
    each taking one block of the root's.

    The GPU's time, on the slowest rank: one kernel's ``gpu_op_s``; the copy of the rank's input into its window
    (the broadcast: the root's alone) at ``local_bytes_per_s``; one device barrier, ``barrier_s`` (a signal into
    every peer's pad and a wait for theirs, the peers in parallel); then the reads: what the rank takes from its
    peers' windows at ``pair_bytes_per_s`` on 2 GPUs (one peer) and ``fanin_bytes_per_s`` on more (every rank
    reading every peer at once, as the fan-in micro-benchmark), the broadcast's ``world - 1`` readers sharing the
    root's port (each at ``fanin_bytes_per_s / (world - 1)``, the fan-in rate being what a GPU's port gave all its
    readers, at most the pair rate), and its own block out of its own window at the local rate. The kernel runs
    ``min(grid, chunks)`` programs (a chunk: 2048 words of a block; ``grid``: ``EXCHANGE_PAIRS / world``, at most
    ``EXCHANGE_PROGRAMS``, as the runtime's ``exchange_programs``), each copying its share of the chunks of every
    block; a program moves ``1/32`` of each rate (:data:`RATE_PROGRAMS`: 32 programs reach it) and more programs
    share it, so the busiest program's share sets each phase's time (a small call runs few programs, each at its
    32nd of the rate).
    """
    if form not in EXCHANGE_FORMS.values():
        raise ValueError(f"exchange_time: form {form!r}; accepted: {sorted(set(EXCHANGE_FORMS.values()))}")
    if world < 2:
        raise ValueError(f"exchange_time: world {world!r} must be at least 2")
    if nbytes < 0 or itemsize <= 0:
        raise ValueError(f"exchange_time: nbytes {nbytes!r} must be >= 0 and itemsize {itemsize!r} > 0")
    if form == "relay" and world < 3:  # one reader takes the root's whole buffer: the runtime's broadcast form
        form = "broadcast"
    blocks = world if form in ("exchange", "scatter", "two_shot", "scatter_from") else 1  # blocks a rank copies in
    shares = world - 1 if form == "relay" else blocks  # the parts a program's chunks are cut from
    block = nbytes // shares
    summed = form in ("scatter", "reduce", "two_shot", "rooted")
    word = itemsize if summed else next(w for w in EXCHANGE_WORDS if block % w == 0)
    chunk = EXCHANGE_BLOCK * word
    chunks = max(1, -(-block // chunk))
    grid = TWO_SHOT_PROGRAMS if form == "two_shot" else max(1, min(EXCHANGE_PROGRAMS, EXCHANGE_PAIRS // world))
    programs = min(grid, chunks)
    share = min(-(-chunks // programs) * chunk, block)  # the busiest program's bytes of one block
    per_program = 1 / max(RATE_PROGRAMS, programs)  # of each rate
    local = cost.local_bytes_per_s * per_program
    if form in ("broadcast", "scatter_from"):
        peer_rate = (
            cost.pair_bytes_per_s if world == 2 else min(cost.pair_bytes_per_s, cost.fanin_bytes_per_s / (world - 1))
        )
        copy_in = blocks * share / local  # the root's; the readers wait for it at the barrier
        read = share / (peer_rate * per_program)  # a reader takes one block of the root's, nothing of its own
    elif form == "relay":
        # the root copies in every share; each other rank takes its share from the root (the root's port shared
        # by world - 1 readers), stores it twice, passes a second barrier and takes the world - 2 other shares
        root_rate = min(cost.pair_bytes_per_s, cost.fanin_bytes_per_s / (world - 1))
        copy_in = shares * share / local
        first = share / (root_rate * per_program) + 2 * share / local
        read = first + cost.barrier_s + (world - 2) * share / (cost.fanin_bytes_per_s * per_program)
    elif form == "two_shot":
        # the reduce-scatter's reads and two stores, a second barrier, then the all-gather's reads
        peer_rate = cost.pair_bytes_per_s if world == 2 else cost.fanin_bytes_per_s
        copy_in = blocks * share / local
        gathered = (world - 1) * share / (peer_rate * per_program)
        read = gathered + 3 * share / local + cost.barrier_s + gathered
    else:
        peer_rate = cost.pair_bytes_per_s if world == 2 else cost.fanin_bytes_per_s
        copy_in = blocks * share / local
        # every form reads one block of every rank's window: world - 1 over NVLink, its own locally
        read = (world - 1) * share / (peer_rate * per_program) + share / local
    gpu = cost.gpu_op_s + copy_in + cost.barrier_s + read
    return ExchangeTime(
        time_s=max(gpu, host_s),
        gpu_s=gpu,
        host_s=host_s,
        launch_s=cost.gpu_op_s,
        copy_in_s=copy_in,
        barrier_s=cost.barrier_s,
        read_s=read,
        programs=programs,
    )
