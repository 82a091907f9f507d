"""Pipeline schedules as data: per stage, the ordered list of forward ("F", mb) and backward ("B", mb) actions.

The schedules, all synchronous (one optimizer step per batch, gradients exact):

- **GPipe** (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
  NeurIPS 2019): every stage runs the forwards of all ``m`` micro-batches, then all the backwards. Each stage
  holds the activations of all ``m`` micro-batches at the peak.
- **1F1B** / PipeDream-Flush (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
  Training", SOSP 2019; "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021; and "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.1): stage ``s``
  of ``p`` warms up with ``min(p - 1 - s, m)`` forwards, then alternates one forward and one backward, then
  cools down with the remaining backwards. Same bubble as GPipe, but at most ``p - s`` micro-batches in flight.

- **Interleaved 1F1B** (Megatron-LM paper, section 2.2.2): the model is cut into ``v * p`` chunks (virtual
  stages) and rank ``s`` holds chunks ``s, s + p, ..., s + (v - 1) p``; its actions carry the chunk
  (:class:`ChunkAction`). Forwards go through the chunks in groups of ``g`` micro-batches (``p`` by default),
  backwards through the chunks in reverse; the warm-up is ``2 (p - 1 - s) + (v - 1) g`` forwards.

GPipe and 1F1B have the bubble fraction ``(p - 1) / (m + p - 1)`` of idle over total time (GPipe paper section
2.3, Megatron-LM equation 1 in its ``(p-1)/m`` form relative to ideal); interleaving divides the bubble by ``v``:
``(p - 1) / (v m)`` relative to ideal, ``(p - 1) / (v m + p - 1)`` of the total. :func:`simulate` replays
schedules with unit costs and :func:`draw_schedule` draws them; :func:`bubble_fraction` measures a recorded
:class:`Timeline`. Pure Python: no torch, no processes.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "Action",
    "ChunkAction",
    "PLACEMENT",
    "ScheduleFn",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "Timeline",
    "TimelineEvent",
    "apply_device_times",
    "bubble_fraction",
    "check_microbatch_group",
    "chunks_per_stage",
    "cut_sizes",
    "draw_schedule",
    "gpipe",
    "interleaved_one_f_one_b",
    "interleaved_warmup",
    "make_schedule",
    "one_f_one_b",
    "simulate",
    "simulated_bubble",
    "stage_of_virtual",
    "theoretical_bubble",
    "timelines_clock",
    "validate_schedule",
    "virtual_stage",
    "zb_h1",
    "zb_v",
    "zb_v_weights",
]


class Action(NamedTuple):
    """One step of a stage: ``kind`` "F" (forward) or "B" (backward) of micro-batch ``microbatch``.

    A NamedTuple, so it equals the plain tuple ``("F", 3)``.
    """

    kind: str
    microbatch: int


class ChunkAction(NamedTuple):
    """An action of an interleaved schedule: ``kind`` "F" or "B" of ``microbatch`` on this rank's model ``chunk``.

    Chunk ``c`` of rank ``s`` of ``p`` is virtual stage ``c * p + s``.
    """

    kind: str
    microbatch: int
    chunk: int


ScheduleFn = Callable[[int, int, int], list[Action] | list[ChunkAction]]


def chunk_of(action: tuple) -> int:
    """The model chunk an action runs on (0 for the two-field actions of non-interleaved schedules)."""
    return action[2] if len(action) > 2 else 0


def _check_sizes(num_stages: int, num_microbatches: int, stage: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {num_stages} and {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """GPipe (Huang et al. 2019): all forwards in micro-batch order, then all backwards in the same order."""
    _check_sizes(num_stages, num_microbatches, stage)
    mbs = range(num_microbatches)
    return [Action("F", mb) for mb in mbs] + [Action("B", mb) for mb in mbs]


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """1F1B / PipeDream-Flush (Narayanan et al. 2019, 2021): warm-up, one-forward-one-backward, cool-down."""
    _check_sizes(num_stages, num_microbatches, stage)
    warmup = min(num_stages - 1 - stage, num_microbatches)
    actions = [Action("F", mb) for mb in range(warmup)]
    steady = num_microbatches - warmup
    for i in range(steady):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", mb) for mb in range(steady, num_microbatches)]
    return actions


def interleaved_one_f_one_b(
    num_stages: int, num_microbatches: int, stage: int, virtual_stages: int = 2, group: int | None = None
) -> list[ChunkAction]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2) with ``virtual_stages`` chunks per rank.

    Micro-batches go through the chunks in groups of ``group`` (``g``, default ``p``, Megatron-LM's): the k-th
    forward of every rank is micro-batch ``(k // (g v)) g + k % g`` on chunk ``(k // g) % v``; the k-th backward
    the same micro-batch on chunk ``v - 1 - (k // g) % v``. Rank ``s`` warms up with
    ``min(2 (p - 1 - s) + (v - 1) g, m v)`` forwards, then alternates, then cools down. ``m`` must be a multiple
    of ``g``, and ``g`` a multiple of ``p`` no larger than ``m``.

    With ``g = p`` the first rank's forward of chunk 1 for micro-batch 0 comes right after the last rank's forward
    of chunk 0 for it: no slack, so every message from the last rank back to the first (and every gradient the
    other way) lies on the critical path. A larger group leaves ``g - p`` forwards of slack there, which hides the
    messages' time, for ``(v - 1)(g - p)`` more chunks' activations held in the warm-up (Megatron-Core's
    ``microbatch_group_size_per_vp_stage``; ``g = m`` is the breadth-first schedule of Lamy-Poirier 2023,
    "Breadth-First Pipeline Parallelism", MLSys). The bubble with free messages is the same for every ``g``.
    """
    _check_sizes(num_stages, num_microbatches, stage)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a positive int, got {v!r}")
    g = check_microbatch_group(p, m, group)

    def at(k: int, kind: str) -> ChunkAction:
        batch, i = divmod(k, g * v)
        chunk = i // g
        return ChunkAction(kind, batch * g + i % g, chunk if kind == "F" else v - 1 - chunk)

    total = m * v
    warmup = interleaved_warmup(p, stage, v, total, g)
    actions = [at(k, "F") for k in range(warmup)]
    for i in range(total - warmup):
        actions += [at(warmup + i, "F"), at(i, "B")]
    actions += [at(k, "B") for k in range(total - warmup, total)]
    return actions


def check_microbatch_group(num_stages: int, num_microbatches: int, group: int | None) -> int:
    """Interleaved 1F1B's micro-batch group (``group``, ``num_stages`` when None), checked: a multiple of the stages
    that divides the micro-batches (ValueError naming what is wrong)."""
    p, m = num_stages, num_microbatches
    g = p if group is None else group
    if not isinstance(g, int) or isinstance(g, bool) or g < p or g % p:
        raise ValueError(f"microbatch_group must be a multiple of the {p} pipeline stages, got {group!r}")
    if m % g:
        raise ValueError(
            f"interleaved 1F1B takes micro-batches in groups of {g}"
            + (f" (the {p} pipeline stages)" if group is None else "")
            + f"; {m} micro-batches is not a multiple of {g}"
        )
    return g


def interleaved_warmup(num_stages: int, stage: int, virtual_stages: int, total: int, group: int | None = None) -> int:
    """Forwards stage ``stage`` runs before its first backward under interleaved 1F1B: ``2 (p - 1 - s) + (v - 1) g``
    (``g`` the micro-batch group, ``p`` when None), at most ``total`` (= m v)."""
    g = num_stages if group is None else group
    return min(2 * (num_stages - 1 - stage) + (virtual_stages - 1) * g, total)


def zb_h1(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, section 3.1): 1F1B with each backward
    split into B (the input gradient, on the critical path) and W (the weight gradient, needed only by the
    optimizer). Stage ``s`` warms up with ``min(p - 1 - s, m)`` forwards as 1F1B does, then runs F, B and, from its
    ``s + 1``-th backward on, the W of its oldest micro-batch awaiting one; the ``s`` W's held back run at the
    end, in the cool-down bubble. At most ``p`` micro-batches are held (forwarded, W not yet run) on any stage,
    1F1B's own most (on its first stage).
    """
    _check_sizes(num_stages, num_microbatches, stage)
    p, m = num_stages, num_microbatches
    warmup = min(p - 1 - stage, m)
    actions = [Action("F", mb) for mb in range(warmup)]
    waiting = 0  # the next micro-batch whose W is due

    def backward(mb: int) -> list[Action]:
        nonlocal waiting
        out = [Action("B", mb)]
        if mb >= stage:
            out.append(Action("W", waiting))
            waiting += 1
        return out

    for i in range(m - warmup):
        actions += [Action("F", warmup + i), *backward(i)]
    for mb in range(m - warmup, m):
        actions += backward(mb)
    actions += [Action("W", mb) for mb in range(waiting, m)]
    return actions


def _list_schedule(
    num_stages: int,
    num_microbatches: int,
    limit: int,
    costs: tuple[float, float, float],
    weights: tuple[float, ...] | None = None,
) -> list[list[ChunkAction]]:
    """Every stage's actions on the V placement, from a greedy list-scheduling simulation.

    Time runs forward; a stage that falls idle takes, of the actions whose inputs have arrived, a B (the
    critical path; the oldest micro-batch first), else an F (the chunk nearer the loss first) while fewer than
    ``limit`` (chunk, micro-batch) pairs are held (forwarded, W not yet run), else the W of its oldest pending B.
    Each chunk runs its F's, B's and W's in micro-batch order. An action of virtual stage ``u`` costs its kind's
    cost times ``weights[u]`` (None: 1). Communication is free.
    """
    p, m = num_stages, num_microbatches
    scale = weights or (1.0,) * (2 * p)
    cost = {kind: [c * w for w in scale] for kind, c in zip("FBW", costs, strict=True)}  # by virtual stage
    last = 2 * p - 1
    next_f, next_b = [0] * (2 * p), [0] * (2 * p)
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (chunk, mb) with B done, W not yet
    held, free = [0] * p, [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    out: list[list[ChunkAction]] = [[] for _ in range(p)]
    remaining = [6 * m] * p
    waiting: set[int] = set()  # stages with nothing to do until another stage acts
    ends: list[float] = []  # every action's end so far, sorted
    queue = [(0.0, s) for s in range(p)]  # (free, stage) of the stages with work and not waiting; stale entries too
    left = 6 * m * p
    while left:
        if not queue:
            raise ValueError(f"zb-v list scheduling is stuck (p={p}, m={m}, limit={limit})")
        t, s = heapq.heappop(queue)
        if t != free[s] or not remaining[s] or s in waiting:
            continue  # the stage moved on since this entry was pushed

        chunks = (s, last - s)  # virtual stages of chunks 0 and 1
        choice = None
        ready_b = []
        for c, u in enumerate(chunks):
            mb = next_b[u]
            if mb < next_f[u]:
                dep = ("F", u, mb) if u == last else ("B", u + 1, mb)
                if dep in done and done[dep] <= t:
                    ready_b.append((mb, c, u))
        if ready_b:
            mb, c, u = min(ready_b)
            choice = ("B", mb, c, u)
        elif held[s] < limit:
            for c in (1, 0):
                u = chunks[c]
                mb = next_f[u]
                if mb < m and (u == 0 or (("F", u - 1, mb) in done and done["F", u - 1, mb] <= t)):
                    choice = ("F", mb, c, u)
                    break
        if choice is None and pending[s]:
            c, mb = pending[s].pop(0)
            choice = ("W", mb, c, chunks[c])
        if choice is None:
            later = bisect.bisect_right(ends, t)  # the first action to end after t, when something may be ready
            if later < len(ends):
                free[s] = ends[later]
                heapq.heappush(queue, (free[s], s))
            else:
                waiting.add(s)
            continue
        for w in waiting:
            heapq.heappush(queue, (free[w], w))
        waiting.clear()
        kind, mb, c, u = choice
        end = t + cost[kind][u]
        done[kind, u, mb] = free[s] = end
        bisect.insort(ends, end)
        out[s].append(ChunkAction(kind, mb, c))
        remaining[s] -= 1
        left -= 1
        if remaining[s]:
            heapq.heappush(queue, (end, s))
        if kind == "F":
            next_f[u] += 1
            held[s] += 1
        elif kind == "B":
            next_b[u] += 1
            pending[s].append((c, mb))
        else:
            held[s] -= 1
    return out


def zb_v_costs(costs: Sequence[float] | None) -> tuple[float, float, float]:
    """ZB-V's (T_F, T_B, T_W) as its order is built with: relative to T_F, each ratio rounded to a tenth (at least
    a tenth), so that costs a little apart give one order; None gives the paper's equal costs. ValueError unless
    three finite numbers, T_F and T_B above 0 and T_W at least 0."""
    if costs is None:
        return (1.0, 1.0, 1.0)
    values = tuple(costs)
    if (
        len(values) != 3
        or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in values)
        or values[0] <= 0
        or values[1] <= 0
        or values[2] < 0
    ):
        raise ValueError(
            f"zb-v costs must be three finite numbers (forward, input gradient, weight gradient), the first two "
            f"above 0, got {costs!r}"
        )
    f, b, w = values
    return (1.0, max(round(b / f, 1), 0.1), max(round(w / f, 1), 0.1))


def zb_v_weights(weights: Sequence[float] | None, num_stages: int) -> tuple[float, ...] | None:
    """ZB-V's cost of each virtual stage's actions (``2p`` of them, in model order) as its order is built with:
    relative to their mean, each rounded to a tenth (at least a tenth); None, or weights all alike, give None
    (equal). ValueError unless ``2p`` finite numbers, none below 0, some above."""
    if weights is None:
        return None
    values = tuple(weights)
    if (
        len(values) != 2 * num_stages
        or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in values)
        or min(values) < 0
        or max(values) <= 0
    ):
        raise ValueError(
            f"zb-v weights must be {2 * num_stages} finite numbers, one a virtual stage, none below 0 and some "
            f"above, got {weights!r}"
        )
    mean = sum(values) / len(values)
    rounded = tuple(max(round(w / mean, 1), 0.1) for w in values)
    return None if len(set(rounded)) == 1 else rounded


@functools.lru_cache(maxsize=64)
def _zb_v_all(
    num_stages: int,
    num_microbatches: int,
    costs: tuple[float, float, float] = (1.0, 1.0, 1.0),
    weights: tuple[float, ...] | None = None,
) -> tuple[tuple[ChunkAction, ...], ...]:
    """Every stage's ZB-V actions for ``costs`` and virtual-stage ``weights``: of the list schedules built with
    them, with these costs and equal weights, and with equal costs, the one whose replay under these costs and
    weights (:func:`simulate`, free communication) ends first; greedy list scheduling is a heuristic, and for some
    costs the order built for others ends sooner, or the greedy choice runs out of activation budget. The order
    built for unequal weights may hold more than 1F1B's ``2p`` (chunk, micro-batch) pairs where the greedy choice
    stalls at ``2p`` (at most ``3p``); it is taken only if it ends sooner."""
    p, m = num_stages, num_microbatches
    best, best_end = None, math.inf
    equal = (1.0, 1.0, 1.0)
    for built_for, built_weights in dict.fromkeys([(costs, weights), (costs, None), (equal, None)]):
        # chunks of unequal weight may stall the greedy order at 1F1B's budget: one pair more at a time, to 3p
        order = None
        for limit in range(2 * p, (3 * p if built_weights else 2 * p) + 1):
            try:
                order = _list_schedule(p, m, limit, built_for, built_weights)
                break
            except ValueError:
                continue
        if order is None:
            continue
        times = simulate(
            order, forward_cost=costs[0], backward_cost=costs[1], weight_cost=costs[2], placement="v", weights=weights
        )
        end = max(e for stage in times for _, e in stage)
        if end < best_end - 1e-12:
            best, best_end = order, end
    if best is None:
        raise ValueError(f"zb-v list scheduling is stuck (p={p}, m={m}, costs={costs}, weights={weights})")
    return tuple(tuple(a) for a in best)


def zb_v(
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 2,
    costs: Sequence[float] | None = None,
    weights: Sequence[float] | None = None,
) -> list[ChunkAction]:
    """ZB-V (Qi et al. 2024, section 6): two model chunks a stage placed in a V, stage ``s`` holding virtual stages
    ``s`` and ``2p - 1 - s`` (so the first stage computes the loss, and the turn at the last stage is local), with
    backward split into B and W as in :func:`zb_h1`.

    The actions come from :func:`_list_schedule` with the activation budget of the paper, 1F1B's peak: ``2p``
    (chunk, micro-batch) pairs of half a stage each. ``costs``: one micro-batch's (T_F, T_B, T_W), in any unit
    (:func:`zb_v_costs`); the order is built for them, as the paper's automatic scheduler builds its order from
    profiled times. None: the paper's equal costs T_F = T_B = T_W, which a transformer's are not (its attention
    has no weight gradient, so T_B exceeds T_F and T_W falls below both), and with unequal costs the equal-cost
    order idles longer. ``weights``: each virtual stage's share of those costs, ``2p`` of them in model order
    (:func:`zb_v_weights`; None: equal), for chunks that differ, as the V's first stage does when it holds the
    embedding's chunk and the output layer's. ``virtual_stages`` must be 2 (the V).
    """
    _check_sizes(num_stages, num_microbatches, stage)
    if virtual_stages != 2:
        raise ValueError(f"zb-v places exactly 2 model chunks on each stage, got virtual_stages={virtual_stages!r}")
    order = _zb_v_all(num_stages, num_microbatches, zb_v_costs(costs), zb_v_weights(weights, num_stages))
    return list(order[stage])


SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_one_f_one_b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
}
#: schedules that split each backward into B (input gradient) and W (weight gradient)
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-v"})
#: how each schedule places model chunks on stages: "loop" (chunk c of stage s is virtual stage c p + s) or "v"
PLACEMENT = {"zb-v": "v"}


def chunks_per_stage(schedule: str, virtual_stages: int = 2) -> int:
    """How many model chunks each stage holds under ``schedule``: ``virtual_stages`` for interleaved 1F1B, 2 for
    ZB-V, else 1."""
    if schedule == "interleaved-1f1b":
        return virtual_stages
    return 2 if schedule == "zb-v" else 1


def make_schedule(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 2,
    microbatch_group: int | None = None,
    costs: Sequence[float] | None = None,
    weights: Sequence[float] | None = None,
) -> list:
    """Stage ``stage``'s actions under the named schedule (``virtual_stages``: interleaved 1F1B's chunks;
    ``microbatch_group``: its micro-batch group, :func:`interleaved_one_f_one_b`; None for the other schedules;
    ``costs``: one micro-batch's (T_F, T_B, T_W) that ZB-V's order is built for and ``weights`` each virtual
    stage's share of them, :func:`zb_v`; the other schedules' orders do not depend on costs and ignore them)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if schedule == "interleaved-1f1b":
        return interleaved_one_f_one_b(num_stages, num_microbatches, stage, virtual_stages, microbatch_group)
    if microbatch_group is not None:
        raise ValueError(f"microbatch_group is interleaved-1f1b's; schedule {schedule!r} takes none")
    if schedule == "zb-v":
        return zb_v(num_stages, num_microbatches, stage, costs=costs, weights=weights)
    return SCHEDULES[schedule](num_stages, num_microbatches, stage)


def virtual_stage(stage: int, chunk: int, num_stages: int, placement: str = "loop") -> int:
    """The virtual stage (position in the model) of ``stage``'s ``chunk``: ``chunk p + stage`` on the loop
    placement; ``stage`` or ``2p - 1 - stage`` on the V."""
    if placement == "v":
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def stage_of_virtual(u: int, num_stages: int, placement: str = "loop") -> tuple[int, int]:
    """(stage, chunk) holding virtual stage ``u``; the inverse of :func:`virtual_stage`."""
    p = num_stages
    if placement == "v":
        return (u, 0) if u < p else (2 * p - 1 - u, 1)
    return u % p, u // p


def validate_schedule(actions: Sequence[tuple], num_microbatches: int, virtual_stages: int = 1) -> int:
    """Check one stage's actions; return its peak number of micro-batches held (forwarded, backward not complete).

    Every micro-batch is forwarded exactly once and backward exactly once on each of the stage's
    ``virtual_stages`` chunks, its forward first (a micro-batch on two chunks counts twice). A schedule with
    W actions (split backward) has exactly one W for each B, after it, and holds a micro-batch until its W.
    Raises ValueError naming the first offending action.
    """
    split = any(a[0] == "W" for a in actions)
    forwarded: set[tuple[int, int]] = set()
    backward: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    peak = 0
    for i, action in enumerate(actions):
        kind, mb, chunk = action[0], action[1], chunk_of(action)
        if not 0 <= mb < num_microbatches or kind not in ("F", "B", "W") or not 0 <= chunk < virtual_stages:
            raise ValueError(
                f"action {i} {tuple(action)} is not F/B/W of a micro-batch in 0..{num_microbatches - 1} "
                f"on a chunk in 0..{virtual_stages - 1}"
            )
        key = (chunk, mb)
        if kind == "F":
            if key in forwarded:
                raise ValueError(f"action {i}: micro-batch {mb} forwarded twice")
            forwarded.add(key)
        elif kind == "B":
            if key not in forwarded or key in backward:
                raise ValueError(f"action {i}: backward of micro-batch {mb} before its forward, or twice")
            backward.add(key)
            if not split:
                done.add(key)
        else:
            if key not in backward or key in done:
                raise ValueError(f"action {i}: weight gradient of micro-batch {mb} before its backward, or twice")
            done.add(key)
        peak = max(peak, len(forwarded) - len(done))
    if len(done) != num_microbatches * virtual_stages or len(backward) != len(done):
        raise ValueError(
            f"only {len(done)} of {num_microbatches * virtual_stages} micro-batches went forward and backward"
            + (" (each B needs its W)" if split else "")
        )
    return peak


def simulate(
    schedules: Sequence[Sequence[tuple]],
    *,
    forward_cost: float = 1,
    backward_cost: float = 2,
    weight_cost: float = 1,
    p2p_cost: float = 0,
    placement: str = "loop",
    weights: Sequence[float] | None = None,
) -> list[list[tuple[float, float]]]:
    """Replay one schedule per stage with fixed action costs (per chunk) and a fixed time per message.

    On virtual stage ``u`` (:func:`virtual_stage` of the stage and chunk under ``placement``): F(u, mb) waits for
    F(u - 1, mb); B(u, mb) waits for B(u + 1, mb) (the last virtual stage's B follows its own F); W follows its
    B in the stage's order. ``backward_cost`` is a B's cost (the whole backward for schedules without W, the
    input gradient alone for those with), ``weight_cost`` a W's. A dependency on another stage adds ``p2p_cost``
    (one activation or gradient between stages; none between two chunks of one stage); ``weights[u]`` scales the
    actions of virtual stage ``u`` (None: 1). Returns, per stage, the
    (start, end) of each action in schedule order. Raises ValueError on a deadlock.
    """
    p = len(schedules)
    last = p * (1 + max((chunk_of(a) for stage in schedules for a in stage), default=0)) - 1
    if weights is not None and len(weights) != last + 1:
        raise ValueError(f"weights: one a virtual stage, {last + 1} of them, got {len(weights)}")
    scale = weights or (1,) * (last + 1)
    priced = zip("FBW", (forward_cost, backward_cost, weight_cost), strict=True)
    cost = {kind: [c * w for w in scale] for kind, c in priced}
    ends: dict[tuple[str, int, int], float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    free = [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while len(times[s]) < len(schedules[s]):
                action = schedules[s][len(times[s])]
                kind, mb = action[0], action[1]
                u = virtual_stage(s, chunk_of(action), p, placement)
                if kind == "W":
                    dep, other = None, s
                elif kind == "F":
                    dep, other = (None, s) if u == 0 else (("F", u - 1, mb), stage_of_virtual(u - 1, p, placement)[0])
                else:
                    dep, other = (("F", u, mb), s) if u == last else (("B", u + 1, mb), None)
                    if other is None:
                        other = stage_of_virtual(u + 1, p, placement)[0]
                if dep is not None and dep not in ends:
                    break
                ready = ends[dep] + (p2p_cost if other != s else 0) if dep is not None else 0
                start = max(free[s], ready)
                end = start + cost[kind][u]
                ends[(kind, u, mb)] = free[s] = end
                times[s].append((start, end))
                progress = True
    stuck = [s for s in range(p) if len(times[s]) < len(schedules[s])]
    if stuck:
        raise ValueError(
            f"schedules deadlock: stages {stuck} wait forever (stage {stuck[0]} at action "
            f"{schedules[stuck[0]][len(times[stuck[0]])]})"
        )
    return times


def simulated_bubble(times: Sequence[Sequence[tuple[float, float]]]) -> float:
    """Idle over total time of :func:`simulate`'s timing: 1 - busy / (p x makespan)."""
    total = max((end for stage in times for _, end in stage), default=0)
    busy = sum(end - start for stage in times for start, end in stage)
    return 1.0 - busy / (len(times) * total) if total else 0.0


def theoretical_bubble(
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    *,
    schedule: str | None = None,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    weight_cost: float = 1.0,
) -> float:
    """The pipeline bubble as a fraction of the step.

    GPipe, 1F1B, interleaved 1F1B (``schedule`` None or one of them): (p - 1) / (v m + p - 1). With ``v = 1`` it is
    (p - 1) / (m + p - 1) (Huang et al. 2019, section 2.3); interleaved 1F1B divides the bubble time by ``v``
    (Narayanan et al. 2021, section 2.2.2: (p - 1) / (v m) of the ideal).

    ZB-H1: Qi et al. 2024, section 3.1: each stage idles (p - 1)(T_F + T_B - T_W) (against 1F1B's
    (p - 1)(T_F + T_B + T_W)), of a step of m (T_F + T_B + T_W) work, so the fraction is
    (p - 1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - T_W)); with equal costs
    (p - 1) / (3 m + p - 1). T_F, T_B, T_W are ``forward_cost``, ``backward_cost`` (the input gradient) and
    ``weight_cost`` of one micro-batch on one stage.

    ZB-V: the idle share of its own schedule replayed by :func:`simulate` with these costs (halved per chunk) and
    free communication, the makespan the hand construction of the paper (section 6) aims at.
    """
    p, m = num_stages, num_microbatches
    f, b, w = forward_cost, backward_cost, weight_cost
    if schedule == "zb-h1":
        idle = (p - 1) * max(f + b - w, 0.0)
        return idle / (m * (f + b + w) + idle)
    if schedule == "zb-v":
        schedules = [zb_v(p, m, s, costs=(f, b, w)) for s in range(p)]
        times = simulate(schedules, forward_cost=f / 2, backward_cost=b / 2, weight_cost=w / 2, placement="v")
        return simulated_bubble(times)
    return (p - 1) / (virtual_stages * m + p - 1)


def draw_schedule(
    schedules: Sequence[Sequence[tuple]],
    *,
    backward_cost: int = 2,
    weight_cost: int = 1,
    placement: str = "loop",
) -> str:
    """ASCII chart of :func:`simulate`'s timing (unit forwards): a row per stage, a cell per time unit, "." where
    idle. Cells read kind and micro-batch (``F3``), and the chunk for multi-chunk schedules (``F3b`` chunk 1)."""
    times = simulate(schedules, backward_cost=backward_cost, weight_cost=weight_cost, placement=placement)
    total = int(max((end for stage in times for _, end in stage), default=0))
    chunked = any(len(a) > 2 and a[2] for st in schedules for a in st)

    def label(action: tuple) -> str:
        return f"{action[0]}{action[1]}" + ("abcdefgh"[chunk_of(action)] if chunked else "")

    width = max((len(label(a)) for st in schedules for a in st), default=1) + 1
    rows = []
    for s, (actions, spans) in enumerate(zip(schedules, times, strict=True)):
        cells = ["." * (width - 1)] * total
        for action, (start, end) in zip(actions, spans, strict=True):
            for t in range(int(start), int(end)):
                cells[t] = label(action).ljust(width - 1)
        rows.append(f"stage {s} | " + " ".join(cells))
    return "\n".join(rows)


@dataclass
class TimelineEvent:
    """One recorded interval of a rank: an "F"/"B"/"W" action or a "send_forward"/"recv_forward"/... message.

    Times are seconds on the clock of the :class:`Timeline` that holds the event (:attr:`Timeline.clock`). On the
    host clock they are ``time.perf_counter()`` readings around the call, and a send's end is when its completion
    was observed; on the device clock they are when the compute stream began and finished the interval.
    """

    kind: str
    microbatch: int
    start_s: float
    end_s: float
    chunk: int = 0  # the model chunk (interleaved 1F1B; 0 otherwise)


@dataclass
class Timeline:
    """What one rank did in one pipeline step, for measuring the bubble.

    ``clock`` names what the times are. "host": ``time.perf_counter()`` readings around each call, the compute
    itself on the CPU, but only the kernels' launches on a GPU, where the host runs ahead of the device. "device":
    CUDA events on the compute stream (:func:`apply_device_times`), each action from the moment the stream starts
    it (after its wait for the action's received inputs) to the moment it finishes, messages as the compute
    stream's share of them; ``start_s`` is the host clock reading when the stream began the step, so that the
    timelines of ranks on one host line up as on the host clock. "none": the step was replayed as one CUDA graph,
    which leaves no time of its actions; the timeline has no events and no bubble.
    """

    stage: int
    num_stages: int
    num_microbatches: int
    virtual_stages: int = 1  # model chunks per stage (interleaved 1F1B)
    start_s: float = 0.0
    end_s: float = 0.0
    peak_activations: int = 0  # most micro-batches whose activations were held at once
    events: list[TimelineEvent] = field(default_factory=list)
    clock: str = "host"  # "host", "device" or "none" (see above)

    def busy_s(self) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.kind in ("F", "B", "W"))

    def to_json(self) -> dict:
        """The whole timeline as a JSON value (:meth:`from_json` reads it back): how it crosses between ranks."""
        return {
            "stage": self.stage,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "virtual_stages": self.virtual_stages,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "peak_activations": self.peak_activations,
            "clock": self.clock,
            "events": [[e.kind, e.microbatch, e.start_s, e.end_s, e.chunk] for e in self.events],
        }

    @classmethod
    def from_json(cls, value: object) -> Timeline:
        """The timeline :meth:`to_json` gave, every field checked; ``ValueError`` naming the first that is not
        what a timeline holds."""
        if not isinstance(value, dict) or set(value) != _TIMELINE_FIELDS:
            raise ValueError(f"a timeline, not one with the fields {sorted(_TIMELINE_FIELDS)}")
        for key in ("stage", "num_stages", "num_microbatches", "virtual_stages", "peak_activations"):
            if not _is_int(value[key]) or value[key] < 0:
                raise ValueError(f"a timeline whose {key} is not a count: {value[key]!r}")
        for key in ("start_s", "end_s"):
            if not _is_number(value[key]):
                raise ValueError(f"a timeline whose {key} is not a number: {value[key]!r}")
        if value["clock"] not in ("host", "device", "none"):
            raise ValueError(f"a timeline of an unknown clock: {value['clock']!r}")
        if not isinstance(value["events"], list):
            raise ValueError("a timeline whose events are not a list")
        events = []
        for event in value["events"]:
            if not (
                isinstance(event, list)
                and len(event) == 5
                and isinstance(event[0], str)
                and _is_int(event[1])
                and _is_number(event[2])
                and _is_number(event[3])
                and _is_int(event[4])
            ):
                raise ValueError(f"a timeline event that is not [kind, microbatch, start_s, end_s, chunk]: {event!r}")
            events.append(TimelineEvent(event[0], event[1], float(event[2]), float(event[3]), event[4]))
        fields = {k: value[k] for k in _TIMELINE_FIELDS if k != "events"}
        fields["start_s"], fields["end_s"] = float(fields["start_s"]), float(fields["end_s"])
        return cls(**fields, events=events)

    def as_records(self) -> list[dict]:
        """Events as dicts with times relative to the step's start (for JSON lines and plots)."""
        return [
            {
                "stage": self.stage,
                "kind": e.kind,
                "microbatch": e.microbatch,
                "chunk": e.chunk,
                "start_s": e.start_s - self.start_s,
                "end_s": e.end_s - self.start_s,
            }
            for e in self.events
        ]


_TIMELINE_FIELDS = frozenset(
    ("stage", "num_stages", "num_microbatches", "virtual_stages", "start_s", "end_s", "peak_activations", "clock",
     "events")
)  # fmt: skip


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def timelines_clock(timelines: Sequence[Timeline]) -> str:
    """The clock the timelines share (:attr:`Timeline.clock`), or "none" where one of them has no times or
    they were read on different clocks (no bubble can be measured from them)."""
    clocks = {t.clock for t in timelines}
    return clocks.pop() if len(clocks) == 1 else "none"


def bubble_fraction(timeline: Timeline | Sequence[Timeline]) -> float:
    """Idle time over total time: 1 - (time in F/B/W actions) / (span of the step x number of timelines).

    Given the timelines of all stages (clocks comparable: ranks on one host), the span is common to them all,
    from the earliest start to the latest end, which is what (p - 1) / (m + p - 1) predicts. The timelines must
    share a clock, "host" or "device" (:func:`timelines_clock`); on a GPU only the device clock measures the
    bubble.
    """
    timelines = [timeline] if isinstance(timeline, Timeline) else list(timeline)
    if not timelines:
        raise ValueError("bubble_fraction needs at least one timeline")
    clock = timelines_clock(timelines)
    if clock == "none":
        raise ValueError(
            f"bubble_fraction needs timelines on one clock with their actions' times, got clocks "
            f"{sorted({t.clock for t in timelines})}"
        )
    span = max(t.end_s for t in timelines) - min(t.start_s for t in timelines)
    if span <= 0:
        return 0.0
    return 1.0 - sum(t.busy_s() for t in timelines) / (span * len(timelines))


def apply_device_times(
    timeline: Timeline,
    step_start: object,
    step_end: object,
    intervals: Sequence[tuple[TimelineEvent, object, object]],
) -> Timeline:
    """Put device times into ``timeline`` (in place; returns it) and set its clock to "device".

    ``step_start``, ``step_end`` and the two markers of each ``(event, start, end)`` of ``intervals`` are
    completed events of ``torch.cuda.Event(enable_timing=True)`` (or anything with the same
    ``elapsed_time(other)``, the milliseconds from one to the other), recorded on the stream the rank computes
    on. Each event of
    ``intervals`` gets ``timeline.start_s`` plus the seconds from ``step_start`` to its markers, the timeline's
    end that of ``step_end``; ``timeline.start_s`` stays, the host clock reading taken as the stream reached
    ``step_start``. Events of the timeline without markers are dropped, so that it holds device times only.
    """
    origin = timeline.start_s
    timed = []
    for event, start, end in intervals:
        event.start_s = origin + step_start.elapsed_time(start) / 1e3
        event.end_s = origin + step_start.elapsed_time(end) / 1e3
        timed.append(event)
    kept = {id(event) for event in timed}
    timeline.events = [e for e in timeline.events if id(e) in kept]
    timeline.end_s = origin + step_start.elapsed_time(step_end) / 1e3
    timeline.clock = "device"
    return timeline


# ------------------------------------------------------------------------------------- cutting a model


#: the most cuts :func:`cut_sizes` tries one by one to balance stages that hold several ranges; above it, a descent
EXHAUSTIVE_CUTS = 50_000


def cut_sizes(
    n: int, parts: int, costs: Sequence[float] | None = None, stage_of: Sequence[int] | None = None
) -> list[int]:
    """The sizes of ``parts`` contiguous, non-empty ranges that cut ``n`` layers, in order.

    Without ``costs``: sizes differ by at most one, the first ranges taking the extra layers. With ``costs`` (one
    a layer): the largest range's cost is as small as possible, ties broken by the largest size (a dynamic
    program over contiguous partitions, the min-max partition GPipe's partitioner approximates). With
    ``stage_of`` too, naming the pipeline stage that runs each range where a stage runs several (the chunks of
    interleaved 1F1B, ``u mod p``, and of the V, ``u`` and ``2p - 1 - u``), what is balanced is each *stage*'s
    sum, since a stage runs its ranges one after another (:func:`_balance_stages`). Torch-free, so that the
    simulator prices the cut :func:`dtrain.parallel.pipeline_parallel.partition_layers` makes."""
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} ranges: 1 to {n} ranges")
    if costs is None:
        base, extra = divmod(n, parts)
        return [base + (s < extra) for s in range(parts)]
    if len(costs) != n:
        raise ValueError(f"costs name {len(costs)} layers for {n}")
    sizes = _balance_by_cost(list(costs), parts)
    if stage_of is not None:
        if len(stage_of) != parts or min(stage_of) < 0:
            raise ValueError(f"stage_of names {len(stage_of)} stages for {parts} ranges, each >= 0: {list(stage_of)}")
        if len(set(stage_of)) < parts:
            sizes = _balance_stages(list(costs), sizes, list(stage_of))
    return sizes


def _balance_by_cost(costs: list[int], num_stages: int) -> list[int]:
    """Stage sizes minimising the (largest cost, largest layer count) over contiguous partitions (dynamic program)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: (worst stage, cut) for the first i layers in k stages
    best: list[dict[int, tuple[tuple[int, int], int]]] = [{0: ((0, 0), 0)}]
    for k in range(1, num_stages + 1):
        row = {}
        for i in range(k, n - (num_stages - k) + 1):
            row[i] = min(
                (max(best[k - 1][j][0], (prefix[i] - prefix[j], i - j)), j) for j in range(k - 1, i) if j in best[k - 1]
            )
        best.append(row)
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = best[k][i][1]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def _balance_stages(costs: list[int], sizes: list[int], stage_of: list[int]) -> list[int]:
    """Range sizes (contiguous, non-empty, in order) whose largest *stage* sum of ``costs`` is as small as
    possible, stage ``stage_of[k]`` running range ``k``; ties go to the smaller sum of squared stage sums, then of
    squared range sums (a micro-batch crosses a stage's ranges one after another: even ones keep the schedule's
    slots even), then of squared range sizes (layers that cost nothing spread evenly), then to the first cut
    found. Every cut is tried where there are at most
    :data:`EXHAUSTIVE_CUTS`; otherwise a steepest descent from ``sizes`` (each range balanced alone) shifts a run
    of adjacent boundaries by one layer at a time, never ending worse than it started."""
    n, k = len(costs), len(sizes)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    stages = max(stage_of) + 1

    def score(bounds: Sequence[int]) -> tuple[int, int, int, int]:
        load, squares, sizes = [0] * stages, 0, 0
        for u in range(k):
            chunk = prefix[bounds[u + 1]] - prefix[bounds[u]]
            load[stage_of[u]] += chunk
            squares += chunk * chunk
            sizes += (bounds[u + 1] - bounds[u]) ** 2
        return max(load), sum(x * x for x in load), squares, sizes

    if math.comb(n - 1, k - 1) <= EXHAUSTIVE_CUTS:
        best = min(((0, *inner, n) for inner in itertools.combinations(range(1, n), k - 1)), key=score)
        return [b - a for a, b in zip(best, best[1:], strict=False)]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    current = score(bounds)
    while True:
        moves = []  # boundaries i..j shifted by a layer: one range gives a layer to another, those between slide
        for i in range(1, k):
            for j in range(i, k):
                for step in (-1, 1):
                    if bounds[i - 1] < bounds[i] + step and bounds[j] + step < bounds[j + 1]:
                        moved = [*bounds[:i], *(b + step for b in bounds[i : j + 1]), *bounds[j + 1 :]]
                        moves.append((score(moved), moved))
        if not moves:
            break
        best_score, best_bounds = min(moves, key=lambda m: m[0])
        if best_score >= current:
            break
        current, bounds = best_score, best_bounds
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
