"""Timing of one pipeline step with real costs: the stages' actions in the order that
:mod:`dtrain.parallel.pipeline_schedules` gives them (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V), each waiting
for its input from the neighbouring (virtual) stage plus the point-to-point time.

With equal stages and free messages GPipe and 1F1B take ``(m + p - 1)(f + b)``, the bubble ``(p - 1) / (m + p - 1)``
of the GPipe paper (section 2.3); unequal stages (a straggler, a slower device) and message time stretch it.
The zero-bubble schedules (Qi et al. 2024) split each backward into B (input gradient) and W (weight gradient):
give ``weight_s`` and ``backward_s`` is B alone; ZB-H1 then idles ``(p - 1)(f + b - w)`` a stage (section 3.1).
Schedules with several chunks a stage (interleaved 1F1B, ZB-V) split each stage's costs evenly over its chunks.

Each action ends at ``max(its stage's previous action's end, its input's end + message) + its cost``: a longest
path through the schedule's dependency graph. The graph of a (schedule, stages, micro-batches, chunks) is built
once and cut into waves (an action's wave is one more than the later of its two predecessors'), so timing it with
other costs is one array operation a wave, the same floats as an event replay of the actions (:func:`_replay`):
a 128-stage 1F1B pipeline of 512 micro-batches (131,072 actions) in about 20 ms once its graph is built.

Messages are asynchronous by default: a message delays its receiver's action and nothing else. With
``synchronous``, each exchange blocks both stages, as Megatron-LM's ``_communicate`` (megatron/p2p_communication.py,
2021-2022) does: it posts the sends and receives of both directions with ``torch.distributed.batch_isend_irecv``,
waits for all of them and calls ``torch.cuda.synchronize()``, then all-gathers a split activation over the
tensor-parallel group on the compute stream (the scatter-gather of Narayanan et al. 2021, section 4.1). An action
whose output goes to another stage then holds its stage for the message time (the exchange with that stage runs in
the same call, so its receiver is held as long), and the message is there when the action ends; an action whose
input comes from another stage runs the gather (``gather_s``) first.

With ``paired``, interleaved 1F1B's steady state exchanges once per forward-backward pair, as Megatron-LM's
``forward_backward_pipelining_with_interleaving`` (megatron/schedules.py, 2021-2022) does: it runs the forward,
then the backward, then sends the forward's output and the backward's gradient together
(``send_forward_backward_recv_forward_backward``), so a forward followed by a backward on its stage releases its
output only when that backward ends (and, synchronous, the pair holds its stage for both messages). Warm-up and
cool-down actions send at once. Other schedules send after every action either way.

With ``overlapped``, interleaved 1F1B's exchanges run as Megatron-Core's ``overlap_p2p_comm`` runs them
(``megatron/core/pipeline_parallel/schedules.py``, ``forward_backward_pipelining_with_interleaving``, and
``p2p_communication.py`` at core_r0.8.0): after each forward a stage posts, without waiting, the send of its output
and the receive of its next forward's input (``send_forward_recv_forward(..., overlap_p2p_comm=True)``: separate
``isend`` and ``irecv``, no ``torch.cuda.synchronize()``), after each backward the send of its input gradient and
the receive of its next backward's output gradient (the first backward's receive is posted after the last
warm-up forward), and it waits for those handles just before its next action of the same kind. A message leaves
when its sender's action has ended and its receive has been posted (the receiver's previous action of the same
kind has ended: NCCL's kernels run after the work queued before them on the stream) and takes the message time;
an action starts once its input has arrived and the message its stage's previous action of the same kind sent has
been delivered. The transfers run under the compute between posting and waiting and show only where they are not
done by then. Other schedules ignore it (Megatron-LM's ``validate_args`` turns ``overlap_p2p_comm`` off without
an interleaved schedule). Left out: a pair of stages' sends and receives share one NCCL communicator and run in
the order they were posted.

With ``host_s``, the host's time to issue one action (launch its kernels, post its messages): on a GPU the host
issues a stage's actions one after another and does not wait for the device (a receive makes the stream wait,
not the host), so the k-th action of a stage cannot start before ``k host_s`` from the step's start. Where a
micro-batch's compute takes less than that, the host sets the pace and the bubble grows past the schedule's own:
the regime of small micro-batches (``dtrain bench pipeline`` reports the measured host time an action).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from dtrain.parallel.pipeline_schedules import (
    PLACEMENT,
    SCHEDULES,
    chunk_of,
    chunks_per_stage,
    interleaved_warmup,
    make_schedule,
    stage_of_virtual,
    virtual_stage,
    zb_v_costs,
    zb_v_weights,
)

__all__ = ["pipeline_bubble", "pipeline_chunk_edges", "pipeline_makespan", "pipeline_stage_spans"]


def pipeline_makespan(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: float,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    weight_s: Sequence[float] | None = None,
    virtual_stages: int = 2,
    microbatch_group: int | None = None,
    gather_s: float = 0.0,
    synchronous: bool = False,
    paired: bool = False,
    host_s: float = 0.0,
    overlapped: bool = False,
    order_costs: Sequence[float] | None = None,
    chunk_shares: Sequence[Sequence[float]] | None = None,
    order_weights: Sequence[float] | None = None,
) -> float:
    """Seconds from the first forward to the last backward; ``forward_s[s]`` / ``backward_s[s]`` are stage
    ``s``'s time for one micro-batch (all its chunks), ``p2p_s`` the time of one activation (or gradient) between
    stages and ``gather_s`` the receiver's all-gather of a split one. For ZB-H1 and ZB-V, ``backward_s`` is the
    input-gradient pass B and ``weight_s`` the weight-gradient pass W (none given: W costs as much as B, the
    paper's T_B = T_W). ``virtual_stages``: interleaved 1F1B's chunks a stage, ``microbatch_group`` its micro-batch
    group (:func:`dtrain.parallel.pipeline_schedules.interleaved_one_f_one_b`; None: the stages' count).
    ``synchronous``: messages block both stages (module docstring); otherwise each arrives ``p2p_s + gather_s``
    after its sender's action ends.
    ``paired``: interleaved 1F1B's steady-state forward sends with the next backward (module docstring).
    ``host_s``: the host's time to issue one action; a stage's k-th action starts no earlier than ``k host_s``
    (module docstring). ``overlapped``: interleaved 1F1B's exchanges posted after each action and waited for
    before the stage's next action of the same kind (Megatron-Core's ``overlap_p2p_comm``; module docstring);
    it takes the place of ``synchronous`` and ``paired``. ``order_costs``: the (T_F, T_B, T_W) ZB-V's order is built
    for (:func:`dtrain.parallel.pipeline_schedules.zb_v`), as the run being replayed built it; None: the stages' mean
    times, the order a run that measured them would build. ``chunk_shares``: ZB-V's, each stage's share of its
    times in each of its two chunks (None: halves), the order then built for each virtual stage's weight
    (``zb_v(..., weights=)``): ``order_weights``, one a virtual stage, as the run being replayed built it
    (``dtrain.parallel.PipelineParallel``: each chunk's forward FLOPs), or else each virtual stage's time."""
    return _run(forward_s, backward_s, p2p_s, microbatches, schedule, weight_s, virtual_stages, gather_s,
                synchronous, paired, host_s, overlapped, microbatch_group, order_costs, chunk_shares,
                order_weights)[0]  # fmt: skip


def pipeline_stage_spans(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: float,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    weight_s: Sequence[float] | None = None,
    virtual_stages: int = 2,
    microbatch_group: int | None = None,
    gather_s: float = 0.0,
    synchronous: bool = False,
    paired: bool = False,
    overlapped: bool = False,
    chunk_shares: Sequence[Sequence[float]] | None = None,
    order_weights: Sequence[float] | None = None,
) -> list[tuple[float, float]]:
    """Each stage's ``(start of its first action, end of its last action)`` in the pipeline
    :func:`pipeline_makespan` times (same arguments): when a stage's first forward may begin and when its last
    backward (or weight-gradient pass) ends, what a data-parallel reduction overlapping the pipeline's edges
    waits for."""
    _check(forward_s, backward_s, weight_s, schedule)
    weights = list(weight_s) if weight_s is not None else list(backward_s)
    shares = _shares(schedule, len(forward_s), chunk_shares)
    graph = _graph(schedule, len(forward_s), microbatches, chunks_per_stage(schedule, virtual_stages), paired,
                   overlapped, microbatch_group, _order_costs(schedule, forward_s, backward_s, weights),
                   _order_weights(forward_s, backward_s, weights, shares, order_weights))  # fmt: skip
    return graph.times(forward_s, backward_s, weights, p2p_s, gather_s, synchronous, spans=True, shares=shares)


def pipeline_chunk_edges(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: float,
    microbatches: int,
    schedule: str = "interleaved-1f1b",
    *,
    weight_s: Sequence[float] | None = None,
    virtual_stages: int = 2,
    microbatch_group: int | None = None,
    gather_s: float = 0.0,
    synchronous: bool = False,
    paired: bool = False,
    overlapped: bool = False,
) -> list[tuple[list[float], list[tuple[int, float]]]]:
    """Each stage's chunks' edges in the pipeline :func:`pipeline_makespan` times (same arguments): the start of
    each chunk's first forward (by chunk), and each of the stage's backwards (or weight-gradient passes, for the
    schedules that split backward) in the order the stage runs them, as (chunk, end): what a data-parallel
    reduction and gather kept per model chunk wait for (Megatron-Core's one ``DistributedDataParallel`` a chunk,
    :func:`dtrain.sim.step.overlapped_reduction_s`)."""
    _check(forward_s, backward_s, weight_s, schedule)
    weights = list(weight_s) if weight_s is not None else list(backward_s)
    graph = _graph(schedule, len(forward_s), microbatches, chunks_per_stage(schedule, virtual_stages), paired,
                   overlapped, microbatch_group, _order_costs(schedule, forward_s, backward_s, weights))  # fmt: skip
    return graph.times(forward_s, backward_s, weights, p2p_s, gather_s, synchronous, chunks=True)


def pipeline_bubble(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: float,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    weight_s: Sequence[float] | None = None,
    virtual_stages: int = 2,
    microbatch_group: int | None = None,
    gather_s: float = 0.0,
    synchronous: bool = False,
    paired: bool = False,
    host_s: float = 0.0,
    overlapped: bool = False,
) -> float:
    """The idle share of the step :func:`pipeline_makespan` times: 1 - work / (p x makespan), work being the
    stages' compute (a synchronous message's time counts as idle)."""
    span, work = _run(forward_s, backward_s, p2p_s, microbatches, schedule, weight_s, virtual_stages, gather_s,
                      synchronous, paired, host_s, overlapped, microbatch_group)  # fmt: skip
    return 1.0 - work / (len(forward_s) * span) if span else 0.0


def _run(forward_s, backward_s, p2p_s, microbatches, schedule, weight_s, virtual_stages, gather_s=0.0,
         synchronous=False, paired=False, host_s=0.0, overlapped=False, group=None,
         order_costs=None, chunk_shares=None, order_weights=None) -> tuple[float, float]:  # fmt: skip
    stages = len(forward_s)
    _check(forward_s, backward_s, weight_s, schedule)
    weights = list(weight_s) if weight_s is not None else list(backward_s)
    costs = _order_costs(schedule, forward_s, backward_s, weights, order_costs)
    shares = _shares(schedule, stages, chunk_shares)
    graph = _graph(schedule, stages, microbatches, chunks_per_stage(schedule, virtual_stages), paired, overlapped,
                   group, costs, _order_weights(forward_s, backward_s, weights, shares, order_weights))  # fmt: skip
    if host_s < 0 or not math.isfinite(host_s):
        raise ValueError(f"host_s must be a finite number of seconds >= 0, got {host_s!r}")
    return graph.times(forward_s, backward_s, weights, p2p_s, gather_s, synchronous, host_s, shares=shares)


def _shares(schedule: str, stages: int, chunk_shares) -> tuple[tuple[float, ...], ...] | None:
    """ZB-V's chunk shares, checked (``stages`` pairs of numbers >= 0 summing to 1); None where they are halves
    or the schedule is another."""
    if chunk_shares is None or schedule != "zb-v":
        return None
    shares = tuple(tuple(float(x) for x in pair) for pair in chunk_shares)
    if len(shares) != stages or any(
        len(pair) != 2 or min(pair) < 0 or not math.isclose(sum(pair), 1.0, abs_tol=1e-9) for pair in shares
    ):
        raise ValueError(f"chunk_shares: {stages} pairs of shares >= 0 summing to 1, got {chunk_shares!r}")
    return None if all(pair == (0.5, 0.5) for pair in shares) else shares


def _order_weights(forward_s, backward_s, weights, shares, given=None) -> tuple[float, ...] | None:
    """ZB-V's virtual-stage weights for its order (:func:`dtrain.parallel.pipeline_schedules.zb_v_weights`):
    ``given``, or each virtual stage's time, its stage's times times its chunk's share; None without shares."""
    if shares is None:
        return None
    stages = len(forward_s)
    if given is not None:
        return zb_v_weights(given, stages)
    totals = [f + b + w for f, b, w in zip(forward_s, backward_s, weights, strict=True)]
    by_virtual = [0.0] * (2 * stages)
    for s, pair in enumerate(shares):
        for c, share in enumerate(pair):
            by_virtual[virtual_stage(s, c, stages, "v")] = totals[s] * share
    return zb_v_weights(by_virtual, stages)


def _order_costs(schedule: str, forward_s, backward_s, weights, given=None) -> tuple[float, float, float] | None:
    """The (T_F, T_B, T_W) a schedule's order is built for: ZB-V's, ``given`` or else the stages' mean times
    (:func:`dtrain.parallel.pipeline_schedules.zb_v_costs`, rounded so that near costs share one order); None for
    the schedules whose order is fixed."""
    if schedule != "zb-v":
        return None
    if given is not None:
        return zb_v_costs(given)
    p = len(forward_s)
    return zb_v_costs((sum(forward_s) / p, sum(backward_s) / p, sum(weights) / p))


def _check(forward_s, backward_s, weight_s, schedule) -> None:
    stages = len(forward_s)
    if stages != len(backward_s) or stages < 1 or (weight_s is not None and len(weight_s) != stages):
        raise ValueError(
            f"need one forward, one backward (and one weight-gradient) time per stage, got {len(forward_s)}, "
            f"{len(backward_s)} and {None if weight_s is None else len(weight_s)}"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


_KINDS = {"F": 0, "B": 1, "W": 2}


class _Graph:
    """A schedule's actions as a dependency graph in waves: every action of a wave waits only for actions of
    earlier waves (its stage's previous action and its input), so a wave's end times are a few array operations.
    Arrays in wave order: ``prev`` and ``dep`` index the end times (``size``: none, a 0), ``cross`` is 1 where the
    input comes from another stage (a message), ``slot`` indexes the cost table ``[F / v, B / v, W / v]`` by
    ``kind * stages + stage``, ``chunk`` is the action's chunk on its stage; ``sends`` counts the messages the action
    sends to other stages. With overlapped exchanges (module docstring) ``post`` indexes the action after which the
    action's input is received (its stage's previous action of its kind), ``sent`` the stage's previous action of
    its kind where that one sent a message to another stage, ``sent_post`` the action after which that message's
    receiver posted its receive (``size`` where none)."""

    def __init__(self, prev, dep, cross, slot, waves: list[int], v: int, order=None, chunk=None,
                 overlap=None) -> None:  # fmt: skip
        self.prev, self.dep, self.cross, self.slot = prev, dep, cross, slot
        #: each action's place among its stage's actions (0 for the first), for the host's issue times
        self.order = np.zeros(len(slot)) if order is None else order
        self.chunk = np.zeros(len(slot), dtype=np.int64) if chunk is None else chunk
        #: (post, sent, sent_post) under overlapped exchanges, else None
        self.overlap = overlap
        self.waves, self.v, self.size = waves, v, len(slot)
        sends = np.zeros(self.size + 1)
        np.add.at(sends, dep[cross > 0], 1.0)  # a pair's backward sends two messages
        self.sends = sends[: self.size]

    def times(self, forward_s, backward_s, weight_s, p2p_s: float, gather_s: float = 0.0,
              synchronous: bool = False, host_s: float = 0.0, spans: bool = False, chunks: bool = False,
              shares=None):  # fmt: skip
        """(makespan, compute) with these per-stage costs (all chunks of a stage) and message times: each
        action ends at ``max(previous action's end, input's end + message) + its cost``, the event replay's
        arithmetic (:func:`_replay`) in the same order, so the same floats; synchronous messages are part of
        the cost instead (module docstring); overlapped ones (``self.overlap``) leave once their receive is posted
        and hold the sender's next action of their kind until delivered. ``spans``: each stage's (first start, last
        end) instead; ``chunks``: each stage's chunks' first forward starts and its backwards' (chunk, end) in
        order (:func:`pipeline_chunk_edges`); ``shares``: each stage's share of its times in each chunk (None:
        ``1 / v`` each)."""
        v = self.v
        table = np.array([c / v for c in forward_s] + [c / v for c in backward_s] + [c / v for c in weight_s])
        work = table[self.slot]
        if shares is not None:
            work = work * (v * np.asarray(shares, dtype=float))[self.slot % len(forward_s), self.chunk]
        message = float(p2p_s) + float(gather_s)
        if self.overlap is not None:
            end = self._overlapped_ends(work, message, host_s)
            cost = work
        else:
            if synchronous:
                cost = work + self.sends * float(p2p_s) + self.cross * float(gather_s)
                arrive = np.zeros(self.size)
            else:
                cost = work
                arrive = self.cross * (float(p2p_s) + float(gather_s))
            end = self._ends(cost, arrive, host_s)
        if spans or chunks:
            stages = len(forward_s)
            stage = self.slot % stages
            if chunks:
                return self._chunk_edges(end, cost, stages)
            first, last = np.full(stages, np.inf), np.zeros(stages)
            np.minimum.at(first, stage, end[: self.size] - cost)
            np.maximum.at(last, stage, end[: self.size])
            return [(float(a), float(b)) for a, b in zip(first, last, strict=True)]
        return float(end[: self.size].max()), float(math.fsum(work.tolist()))

    def _ends(self, cost, arrive, host_s: float):
        prev, dep, waves = self.prev, self.dep, self.waves
        if host_s:
            issued = (self.order + 1.0) * float(host_s)
        if self.size < _WIDE * (len(waves) - 1):  # narrow waves: a plain loop costs less than array calls
            out = [0.0] * (self.size + 1)
            steps = zip(prev.tolist(), dep.tolist(), arrive.tolist(), cost.tolist(), strict=True)
            if host_s:
                for i, ((a, d, x, c), h) in enumerate(zip(steps, issued.tolist(), strict=True)):
                    t, r = out[a], out[d] + x
                    t = t if t >= h else h
                    out[i] = (t if t >= r else r) + c
            else:
                for i, (a, d, x, c) in enumerate(steps):
                    t, r = out[a], out[d] + x
                    out[i] = (t if t >= r else r) + c
            return np.array(out)
        end = np.zeros(self.size + 1)
        for a, b in zip(waves[:-1], waves[1:], strict=True):
            free = end[prev[a:b]] if not host_s else np.maximum(end[prev[a:b]], issued[a:b])
            end[a:b] = np.maximum(free, end[dep[a:b]] + arrive[a:b]) + cost[a:b]
        return end

    def _overlapped_ends(self, cost, message: float, host_s: float):
        """End times under overlapped exchanges: an action starts at the latest of its stage's previous action's
        end, its input's delivery (``max(sender's end, receive posted) + message``) and the delivery of the message
        its stage's previous action of its kind sent."""
        post, sent, sent_post = self.overlap
        prev, dep, waves, size = self.prev, self.dep, self.waves, self.size
        arrive = self.cross * message
        has_sent = (sent < size) * message
        issued = (self.order + 1.0) * float(host_s)
        end = np.zeros(size + 1)
        for a, b in zip(waves[:-1], waves[1:], strict=True):
            free = np.maximum(end[prev[a:b]], issued[a:b])
            came = np.maximum(end[dep[a:b]], end[post[a:b]] * self.cross[a:b]) + arrive[a:b]
            delivered = np.maximum(end[sent[a:b]], end[sent_post[a:b]]) + has_sent[a:b]
            end[a:b] = np.maximum(np.maximum(free, came), delivered) + cost[a:b]
        return end

    def _chunk_edges(self, end, cost, stages: int):
        stage = self.slot % stages
        kind = self.slot // stages
        starts = end[: self.size] - cost
        last_kind = 2 if (kind == 2).any() else 1  # the weight-gradient pass where backward is split
        out = []
        for s in range(stages):
            firsts = [np.inf] * self.v
            here = np.flatnonzero((stage == s) & (kind == 0))
            for i in here.tolist():
                c = int(self.chunk[i])
                firsts[c] = min(firsts[c], float(starts[i]))
            mine = np.flatnonzero((stage == s) & (kind == last_kind))
            mine = mine[np.argsort(self.order[mine], kind="stable")]
            out.append(([f if math.isfinite(f) else 0.0 for f in firsts],
                        [(int(self.chunk[i]), float(end[i])) for i in mine.tolist()]))  # fmt: skip
        return out


#: Wave graphs by (schedule, stages, micro-batches, chunks a stage): a planner times many pipelines of one shape.
_GRAPHS: dict[tuple, _Graph] = {}
#: Below this many actions a wave on average, :meth:`_Graph.times` loops in Python rather than over arrays.
_WIDE = 24


def _graph(schedule: str, stages: int, microbatches: int, v: int, paired: bool = False,
           overlapped: bool = False, group: int | None = None,
           costs: tuple[float, float, float] | None = None,
           weights: tuple[float, ...] | None = None) -> _Graph:  # fmt: skip
    overlapped = overlapped and schedule in _OVERLAPPED and stages > 1
    paired = paired and schedule in _PAIRED and not overlapped
    if group == stages and schedule == "interleaved-1f1b":
        group = None  # the default group: one graph
    if overlapped and group is not None:
        raise ValueError(
            f"overlapped exchanges (Megatron-Core's overlap_p2p_comm) are modelled with micro-batches in groups of the "
            f"{stages} stages only, not {group}: with a larger group a stage takes its messages out of their send order"
        )
    key = (schedule, stages, microbatches, v, paired, overlapped, group, costs, weights)
    found = _GRAPHS.get(key)
    if found is None:
        if len(_GRAPHS) >= 32 or sum(g.size for g in _GRAPHS.values()) > 2_000_000:  # about 60 MB of arrays
            _GRAPHS.clear()
        found = _GRAPHS[key] = _build_graph(schedule, stages, microbatches, v, paired, overlapped, group, costs,
                                            weights)  # fmt: skip
    return found


#: Schedules whose steady state Megatron-LM runs as forward-backward pairs with one exchange after each pair.
_PAIRED = ("interleaved-1f1b",)
#: Schedules whose exchanges Megatron-Core overlaps with compute (``overlap_p2p_comm``; module docstring).
_OVERLAPPED = ("interleaved-1f1b",)


def _released(actions_by_stage: list[list[tuple]], stages: int, v: int, group: int | None = None) -> dict[tuple, tuple]:
    """Under paired exchanges, each steady-state forward mapped to the backward it is paired with: its output
    leaves when that backward ends. ``actions_by_stage``: each stage's actions (keys) in order: its warm-up
    forwards, then forward-backward pairs, then its cool-down backwards. Stage ``s`` warms up with
    ``min(2 (p - 1 - s) + (v - 1) g, m v)`` forwards (Megatron-LM's interleaved schedule, as
    :func:`dtrain.parallel.pipeline_schedules.interleaved_one_f_one_b`, ``g`` the micro-batch group); the order alone
    does not tell a last warm-up forward (sent at once) from a first paired one when one pair is all the steady state
    holds."""
    out = {}
    for s, actions in enumerate(actions_by_stage):
        total = len(actions) // 2
        warmup = interleaved_warmup(stages, s, v, total, group)
        for i in range(total - warmup):
            out[actions[warmup + 2 * i]] = actions[warmup + 2 * i + 1]
    return out


def _posts(plans: list[list[tuple]], stages: int, v: int, group: int | None = None) -> dict[int, int]:
    """Under overlapped exchanges, each action that receives from another stage mapped to the action of its stage
    after which Megatron-Core posts that receive: the stage's previous action of the same kind, the last warm-up
    forward for the first backward (none for the first forward, whose receive is posted at the start)."""
    out = {}
    for s, plan in enumerate(plans):
        total = len(plan) // 2
        warmup = interleaved_warmup(stages, s, v, total, group)
        last: dict[int, int] = {}
        for key, _, cross, slot, _ in plan:
            kind = slot // stages
            before = last.get(kind)
            if kind == 1 and before is None and warmup:
                before = plan[warmup - 1][0]
            if cross and before is not None:
                out[key] = before
            last[kind] = key
    return out


def _build_graph(schedule: str, stages: int, m: int, v: int, paired: bool = False,
                 overlapped: bool = False, group: int | None = None,
                 costs: tuple[float, float, float] | None = None,
                 weights: tuple[float, ...] | None = None) -> _Graph:  # fmt: skip
    """Each stage's actions with what each waits for, put in waves: an action's wave is one more than the later
    of its stage's previous action's and its input's (ValueError if the schedule deadlocks)."""
    placement = PLACEMENT.get(schedule, "loop")
    virtual = v * stages
    last = virtual - 1
    owner = [stage_of_virtual(u, stages, placement)[0] for u in range(virtual)]
    schedules = [make_schedule(schedule, stages, m, s, v, group, costs, weights) for s in range(stages)]
    release: dict = {}
    if paired:
        release = _released([[(_KINDS[a[0]] * virtual + virtual_stage(s, chunk_of(a), stages, placement)) * m + a[1]
                              for a in actions] for s, actions in enumerate(schedules)], stages, v, group)  # fmt: skip
    plans = []  # per stage: (id, dependency id or -1, 1 if the input crosses stages, cost slot, chunk)
    for s in range(stages):
        plan = []
        for action in schedules[s]:
            kind, mb = _KINDS[action[0]], action[1]
            u = virtual_stage(s, chunk_of(action), stages, placement)
            dep, other = -1, s
            if kind == 0 and u > 0:
                dep, other = (u - 1) * m + mb, owner[u - 1]
                if other != s:
                    dep = release.get(dep, dep)
            elif kind == 1:
                dep, other = (u * m + mb, s) if u == last else ((virtual + u + 1) * m + mb, owner[u + 1])
            plan.append(((kind * virtual + u) * m + mb, dep, 1.0 if other != s else 0.0, kind * stages + s,
                         chunk_of(action)))  # fmt: skip
        plans.append(plan)
    # overlapped exchanges: each action's receive post, and the message its stage's previous action of its kind sent
    posts: dict[int, int] = _posts(plans, stages, v, group) if overlapped else {}
    sent: dict[int, tuple[int, int]] = {}
    if overlapped:
        receiver = {dep: key for plan in plans for key, dep, cross, _, _ in plan if cross}
        for plan in plans:
            last_of: dict[int, int] = {}
            for key, _, _, slot, _ in plan:
                kind = slot // stages
                before = last_of.get(kind)
                if before is not None and before in receiver:
                    sent[key] = (before, posts.get(receiver[before], -1))
                last_of[kind] = key
    wave = [-1] * (3 * virtual * m)
    waiting: dict[int, list[int]] = {}
    position, current = [0] * stages, [0] * stages
    ready = deque(range(stages))
    ids, prevs, deps, cross, slots, waves, places, chunks = [], [], [], [], [], [], [], []
    while ready:
        s = ready.popleft()
        plan, i, w = plans[s], position[s], current[s]
        while i < len(plan):
            key, dep, x, slot, chunk = plan[i]
            blocked = False
            for need in (dep, sent.get(key, (-1, -1))[1]):
                if need >= 0:
                    arrived = wave[need]
                    if arrived < 0:
                        waiting.setdefault(need, []).append(s)
                        blocked = True
                        break
                    w = max(w, arrived)
            if blocked:
                break
            prevs.append(plan[i - 1][0] if i else -1)
            w += 1
            wave[key] = w
            ids.append(key)
            deps.append(dep)
            cross.append(x)
            slots.append(slot)
            waves.append(w)
            places.append(i)
            chunks.append(chunk)
            i += 1
            if key in waiting:
                ready.extend(waiting.pop(key))
        position[s], current[s] = i, w
    if any(position[s] < len(plans[s]) for s in range(stages)):
        raise ValueError(f"pipeline schedule {schedule!r} deadlocks with {stages} stages and {m} micro-batches")
    n = len(ids)
    order = np.argsort(np.array(waves), kind="stable")
    where = np.full(3 * virtual * m + 1, n, dtype=np.int64)  # id -> place in wave order; id -1 -> n (none)
    where[np.array(ids)[order]] = np.arange(n)
    sorted_waves = np.array(waves)[order]
    bounds = [0, *(np.flatnonzero(np.diff(sorted_waves)) + 1).tolist(), n]
    overlap = None
    if overlapped:
        ordered = np.array(ids)[order].tolist()
        overlap = tuple(where[np.array(column)] for column in (
            [posts.get(k, -1) for k in ordered],
            [sent.get(k, (-1, -1))[0] for k in ordered],
            [sent.get(k, (-1, -1))[1] for k in ordered],
        ))  # fmt: skip
    return _Graph(where[np.array(prevs)[order]], where[np.array(deps)[order]], np.array(cross)[order],
                   np.array(slots)[order], bounds, v, np.array(places, dtype=float)[order],
                   np.array(chunks, dtype=np.int64)[order], overlap)  # fmt: skip


def _replay(forward_s, backward_s, p2p_s, microbatches, schedule, weight_s, virtual_stages, gather_s=0.0,
            synchronous=False, paired=False, host_s=0.0, group=None) -> tuple[float, float]:  # fmt: skip
    """(makespan, total work) by an event replay of the schedule's actions: the definition :class:`_Graph`
    computes faster (tests/sim/test_pipeline_fast.py holds them equal)."""
    stages = len(forward_s)
    _check(forward_s, backward_s, weight_s, schedule)
    weights = list(weight_s) if weight_s is not None else list(backward_s)
    v = chunks_per_stage(schedule, virtual_stages)
    placement = PLACEMENT.get(schedule, "loop")
    last = v * stages - 1
    owner = [stage_of_virtual(u, stages, placement)[0] for u in range(v * stages)]
    cost = {"F": [c / v for c in forward_s], "B": [c / v for c in backward_s], "W": [c / v for c in weights]}
    costs = _order_costs(schedule, forward_s, backward_s, weights)
    schedules = [make_schedule(schedule, stages, microbatches, s, v, group, costs) for s in range(stages)]
    release: dict = {}
    if paired and schedule in _PAIRED:
        release = _released([[(a[0], virtual_stage(s, chunk_of(a), stages, placement), a[1]) for a in actions]
                             for s, actions in enumerate(schedules)], stages, v, group)  # fmt: skip
    # each stage's actions with what each waits for: (kind, virtual stage, micro-batch, dependency, p2p after it)
    plans = []
    for s in range(stages):
        plan = []
        for action in schedules[s]:
            kind, mb = action[0], action[1]
            u = virtual_stage(s, chunk_of(action), stages, placement)
            dep, other = None, s
            if kind == "F" and u > 0:
                dep, other = ("F", u - 1, mb), owner[u - 1]
                if other != s:
                    dep = release.get(dep, dep)
            elif kind == "B":
                dep, other = (("F", u, mb), s) if u == last else (("B", u + 1, mb), owner[u + 1])
            plan.append((kind, (kind, u, mb), dep, other != s, cost[kind][s]))
        plans.append(plan)
    # with synchronous messages, the actions whose output another stage waits for hold their stage for the send
    sending: dict = {}
    for plan in plans:
        for _, _, dep, crosses, _ in plan:
            if crosses and dep is not None:
                sending[dep] = sending.get(dep, 0) + 1
    # Each action starts when its stage is free and its input has arrived; a stage runs its actions in order until
    # one waits for an action not yet timed, and resumes when that action is timed (any such order gives the same
    # times: each depends only on its stage's previous action and its own input).
    done: dict[tuple[str, int, int], float] = {}
    waiting: dict[tuple[str, int, int], list[int]] = {}
    position, free = [0] * stages, [0.0] * stages
    ready_stages = deque(range(stages))
    work = 0.0
    while ready_stages:
        s = ready_stages.popleft()
        plan, i, t = plans[s], position[s], free[s]
        while i < len(plan):
            kind, key, dep, crosses, took = plan[i]
            t = max(t, (i + 1) * host_s) if host_s else t
            if dep is not None:
                arrived = done.get(dep)
                if arrived is None:
                    waiting.setdefault(dep, []).append(s)
                    break
                delay = 0.0 if synchronous or not crosses else p2p_s + gather_s
                t = max(t, arrived + delay)
            work += took
            if synchronous:
                took = took + sending.get(key, 0) * p2p_s + (gather_s if crosses else 0.0)
            t += took
            done[key] = t
            i += 1
            if key in waiting:
                ready_stages.extend(waiting.pop(key))
        position[s], free[s] = i, t
    if any(position[s] < len(plans[s]) for s in range(stages)):
        raise ValueError(
            f"pipeline schedule {schedule!r} deadlocks with {stages} stages and {microbatches} micro-batches"
        )
    return max(free), work
