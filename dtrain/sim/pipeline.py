"""Timing of one pipeline step with real costs: the stages' actions in the order that
:mod:`dtrain.parallel.pipeline_schedules` gives them (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V), each waiting
for its input from the neighbouring (virtual) stage plus the point-to-point time.

With equal stages and free messages GPipe and 1F1B take ``(m + p - 1)(f + b)``, the bubble ``(p - 1) / (m + p - 1)``
of the GPipe paper (section 2.3); unequal stages (a straggler, a slower device) and message time stretch it.
The zero-bubble schedules (Qi et al. 2024) split each backward into B (input gradient) and W (weight gradient):
give ``weight_s`` and ``backward_s`` is B alone; ZB-H1 then idles ``(p - 1)(f + b - w)`` a stage (section 3.1).
Schedules with several chunks a stage (interleaved 1F1B, ZB-V) split each stage's costs evenly over its chunks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from dtrain.parallel.pipeline_schedules import (
    PLACEMENT,
    SCHEDULES,
    chunk_of,
    chunks_per_stage,
    make_schedule,
    stage_of_virtual,
    virtual_stage,
)

__all__ = ["pipeline_bubble", "pipeline_makespan"]


def pipeline_makespan(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: float,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    weight_s: Sequence[float] | None = None,
    virtual_stages: int = 2,
) -> float:
    """Seconds from the first forward to the last backward; ``forward_s[s]`` / ``backward_s[s]`` are stage
    ``s``'s time for one micro-batch (all its chunks), ``p2p_s`` the time of one activation (or gradient) between
    stages. For ZB-H1 and ZB-V, ``backward_s`` is the input-gradient pass B and ``weight_s`` the weight-gradient
    pass W (none given: W costs as much as B, the paper's T_B = T_W).
    ``virtual_stages``: interleaved 1F1B's chunks a stage."""
    return _run(forward_s, backward_s, p2p_s, microbatches, schedule, weight_s, virtual_stages)[0]


def pipeline_bubble(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: float,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    weight_s: Sequence[float] | None = None,
    virtual_stages: int = 2,
) -> float:
    """The idle share of the step :func:`pipeline_makespan` times: 1 - work / (p x makespan)."""
    span, work = _run(forward_s, backward_s, p2p_s, microbatches, schedule, weight_s, virtual_stages)
    return 1.0 - work / (len(forward_s) * span) if span else 0.0


def _run(forward_s, backward_s, p2p_s, microbatches, schedule, weight_s, virtual_stages) -> tuple[float, float]:
    stages = len(forward_s)
    if stages != len(backward_s) or stages < 1 or (weight_s is not None and len(weight_s) != stages):
        raise ValueError(
            f"need one forward, one backward (and one weight-gradient) time per stage, got {len(forward_s)}, "
            f"{len(backward_s)} and {None if weight_s is None else len(weight_s)}"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    weights = list(weight_s) if weight_s is not None else list(backward_s)
    v = chunks_per_stage(schedule, virtual_stages)
    placement = PLACEMENT.get(schedule, "loop")
    last = v * stages - 1
    owner = [stage_of_virtual(u, stages, placement)[0] for u in range(v * stages)]
    cost = {"F": [c / v for c in forward_s], "B": [c / v for c in backward_s], "W": [c / v for c in weights]}
    # each stage's actions with what each waits for: (kind, virtual stage, micro-batch, dependency, p2p after it)
    plans = []
    for s in range(stages):
        plan = []
        for action in make_schedule(schedule, stages, microbatches, s, v):
            kind, mb = action[0], action[1]
            u = virtual_stage(s, chunk_of(action), stages, placement)
            dep, other = None, s
            if kind == "F" and u > 0:
                dep, other = ("F", u - 1, mb), owner[u - 1]
            elif kind == "B":
                dep, other = (("F", u, mb), s) if u == last else (("B", u + 1, mb), owner[u + 1])
            plan.append((kind, (kind, u, mb), dep, p2p_s if other != s else 0.0, cost[kind][s]))
        plans.append(plan)
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
            kind, key, dep, p2p, took = plan[i]
            if dep is not None:
                arrived = done.get(dep)
                if arrived is None:
                    waiting.setdefault(dep, []).append(s)
                    break
                t = max(t, arrived + p2p)
            t += took
            work += took
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
