"""Timing of one pipeline step with real costs: the stages' forward and backward actions in the order that
:mod:`dtrain.parallel.pipeline_schedules` gives them (GPipe or 1F1B), each waiting for its input from the
neighbouring stage plus the point-to-point time.

With equal stages and free messages this is ``(m + p - 1)(f + b)``, the bubble ``(p - 1) / (m + p - 1)`` of
the GPipe paper (section 2.3); unequal stages (a straggler, a slower device) and message time stretch it.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtrain.parallel.pipeline_schedules import gpipe, one_f_one_b

__all__ = ["pipeline_makespan"]

_SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def pipeline_makespan(
    forward_s: Sequence[float], backward_s: Sequence[float], p2p_s: float, microbatches: int, schedule: str = "1f1b"
) -> float:
    """Seconds from the first forward to the last backward; ``forward_s[s]`` / ``backward_s[s]`` are stage
    ``s``'s time for one micro-batch, ``p2p_s`` the time of one activation (or gradient) between stages."""
    stages = len(forward_s)
    if stages != len(backward_s) or stages < 1:
        raise ValueError(
            f"need one forward and one backward time per stage, got {len(forward_s)} and {len(backward_s)}"
        )
    if schedule not in _SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(_SCHEDULES)}")
    actions = [_SCHEDULES[schedule](stages, microbatches, s) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    position, free = [0] * stages, [0.0] * stages
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for s in range(stages):
            while position[s] < len(actions[s]):
                kind, mb = actions[s][position[s]]
                ready = _ready(kind, s, mb, stages, done, p2p_s)
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = done[(kind, s, mb)] = start + (forward_s[s] if kind == "F" else backward_s[s])
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(
                f"pipeline schedule {schedule!r} deadlocks with {stages} stages and {microbatches} micro-batches"
            )
    return max(free)


def _ready(kind: str, s: int, mb: int, stages: int, done: dict, p2p_s: float) -> float | None:
    """When action (kind, s, mb) may start as far as its input goes, or None if the input is not computed yet."""
    if kind == "F":
        if s == 0:
            return 0.0
        dep = done.get(("F", s - 1, mb))
        return None if dep is None else dep + p2p_s
    if s == stages - 1:
        return done.get(("F", s, mb))
    dep = done.get(("B", s + 1, mb))
    return None if dep is None else dep + p2p_s
