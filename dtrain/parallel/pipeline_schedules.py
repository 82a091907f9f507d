"""Pipeline schedules as data: per stage, the ordered list of forward ("F", mb) and backward ("B", mb) actions.

Two schedules, both synchronous (one optimizer step per batch, gradients exact):

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
  (:class:`ChunkAction`). Forwards go through the chunks in groups of ``p`` micro-batches, backwards through
  the chunks in reverse; the warm-up is ``2 (p - 1 - s) + (v - 1) p`` forwards.

GPipe and 1F1B have the bubble fraction ``(p - 1) / (m + p - 1)`` of idle over total time (GPipe paper section
2.3, Megatron-LM equation 1 in its ``(p-1)/m`` form relative to ideal); interleaving divides the bubble by ``v``:
``(p - 1) / (v m)`` relative to ideal, ``(p - 1) / (v m + p - 1)`` of the total. :func:`simulate` replays
schedules with unit costs and :func:`draw_schedule` draws them; :func:`bubble_fraction` measures a recorded
:class:`Timeline`. Pure Python: no torch, no processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "Action",
    "ChunkAction",
    "ScheduleFn",
    "SCHEDULES",
    "Timeline",
    "TimelineEvent",
    "bubble_fraction",
    "draw_schedule",
    "gpipe",
    "interleaved_one_f_one_b",
    "one_f_one_b",
    "simulate",
    "theoretical_bubble",
    "validate_schedule",
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
    num_stages: int, num_microbatches: int, stage: int, virtual_stages: int = 2
) -> list[ChunkAction]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2) with ``virtual_stages`` chunks per rank.

    The k-th forward of every rank is micro-batch ``(k // (p v)) p + k % p`` on chunk ``(k // p) % v``; the k-th
    backward the same micro-batch on chunk ``v - 1 - (k // p) % v``. Rank ``s`` warms up with
    ``min(2 (p - 1 - s) + (v - 1) p, m v)`` forwards, then alternates, then cools down. ``m`` must be a multiple
    of ``p`` (as in Megatron-LM): micro-batches enter in groups of ``p``.
    """
    _check_sizes(num_stages, num_microbatches, stage)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a positive int, got {v!r}")
    if m % p:
        raise ValueError(
            f"interleaved 1F1B takes micro-batches in groups of the {p} pipeline stages; "
            f"{m} micro-batches is not a multiple of {p}"
        )

    def at(k: int, kind: str) -> ChunkAction:
        group, i = divmod(k, p * v)
        chunk = i // p
        return ChunkAction(kind, group * p + i % p, chunk if kind == "F" else v - 1 - chunk)

    total = m * v
    warmup = min(2 * (p - 1 - stage) + (v - 1) * p, total)
    actions = [at(k, "F") for k in range(warmup)]
    for i in range(total - warmup):
        actions += [at(warmup + i, "F"), at(i, "B")]
    actions += [at(k, "B") for k in range(total - warmup, total)]
    return actions


SCHEDULES: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_one_f_one_b,
}


def validate_schedule(actions: Sequence[tuple], num_microbatches: int, virtual_stages: int = 1) -> int:
    """Check one stage's actions; return its peak number of micro-batches in flight (forwarded, not yet backward).

    Every micro-batch is forwarded exactly once and backward exactly once on each of the stage's
    ``virtual_stages`` chunks, its forward first (a micro-batch on two chunks counts twice in flight). Raises
    ValueError naming the first offending action.
    """
    forwarded: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    peak = 0
    for i, action in enumerate(actions):
        kind, mb, chunk = action[0], action[1], chunk_of(action)
        if not 0 <= mb < num_microbatches or kind not in ("F", "B") or not 0 <= chunk < virtual_stages:
            raise ValueError(
                f"action {i} {tuple(action)} is not F/B of a micro-batch in 0..{num_microbatches - 1} "
                f"on a chunk in 0..{virtual_stages - 1}"
            )
        if kind == "F":
            if (chunk, mb) in forwarded:
                raise ValueError(f"action {i}: micro-batch {mb} forwarded twice")
            forwarded.add((chunk, mb))
        else:
            if (chunk, mb) not in forwarded or (chunk, mb) in done:
                raise ValueError(f"action {i}: backward of micro-batch {mb} before its forward, or twice")
            done.add((chunk, mb))
        peak = max(peak, len(forwarded) - len(done))
    if len(done) != num_microbatches * virtual_stages:
        raise ValueError(
            f"only {len(done)} of {num_microbatches * virtual_stages} micro-batches went forward and backward"
        )
    return peak


def simulate(
    schedules: Sequence[Sequence[tuple]], *, forward_cost: int = 1, backward_cost: int = 2
) -> list[list[tuple[int, int]]]:
    """Replay one schedule per stage with fixed action costs (per chunk) and free communication.

    On virtual stage ``u = chunk * p + s`` of ``V = v * p``: F(u, mb) waits for F(u - 1, mb); B(u, mb) waits for
    B(u + 1, mb) (the last virtual stage's B follows its own F). Returns, per stage, the (start, end) of each
    action in schedule order. Raises ValueError on a deadlock.
    """
    p = len(schedules)
    last = p * (1 + max((chunk_of(a) for stage in schedules for a in stage), default=0)) - 1
    ends: dict[tuple[str, int, int], int] = {}
    times: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    free = [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while len(times[s]) < len(schedules[s]):
                action = schedules[s][len(times[s])]
                kind, mb, u = action[0], action[1], chunk_of(action) * p + s
                dep = ("F", u - 1, mb) if kind == "F" else ("B", u + 1, mb)
                if (kind == "F" and u == 0) or (kind == "B" and u == last):
                    dep = None
                if dep is not None and dep not in ends:
                    break
                start = max(free[s], ends[dep] if dep is not None else 0)
                end = start + (forward_cost if kind == "F" else backward_cost)
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


def theoretical_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The pipeline bubble as a fraction of the step: (p - 1) / (v m + p - 1).

    With ``v = 1`` it is GPipe's and 1F1B's (p - 1) / (m + p - 1) (Huang et al. 2019, section 2.3); interleaved
    1F1B divides the bubble time by ``v`` (Narayanan et al. 2021, section 2.2.2: (p - 1) / (v m) of the ideal).
    """
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


def draw_schedule(schedules: Sequence[Sequence[tuple[str, int]]], *, backward_cost: int = 2) -> str:
    """ASCII chart of :func:`simulate`'s timing: a row per stage, a cell per time unit, "." where idle."""
    times = simulate(schedules, backward_cost=backward_cost)
    total = max((end for stage in times for _, end in stage), default=0)
    width = len(f"B{max((mb for st in schedules for _, mb in st), default=0)}") + 1
    rows = []
    for s, (actions, spans) in enumerate(zip(schedules, times, strict=True)):
        cells = ["." * (width - 1)] * total
        for (kind, mb), (start, end) in zip(actions, spans, strict=True):
            for t in range(start, end):
                cells[t] = f"{kind}{mb}".ljust(width - 1)
        rows.append(f"stage {s} | " + " ".join(cells))
    return "\n".join(rows)


@dataclass
class TimelineEvent:
    """One recorded interval of a rank: an "F"/"B" action or a "send_forward"/"recv_forward"/... message.

    Times are ``time.perf_counter()`` seconds; a send's end is when its completion was observed.
    """

    kind: str
    microbatch: int
    start_s: float
    end_s: float
    chunk: int = 0  # the model chunk (interleaved 1F1B; 0 otherwise)


@dataclass
class Timeline:
    """What one rank did in one pipeline step, for measuring the bubble."""

    stage: int
    num_stages: int
    num_microbatches: int
    virtual_stages: int = 1  # model chunks per stage (interleaved 1F1B)
    start_s: float = 0.0
    end_s: float = 0.0
    peak_activations: int = 0  # most micro-batches whose activations were held at once
    events: list[TimelineEvent] = field(default_factory=list)

    def busy_s(self) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.kind in ("F", "B"))

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


def bubble_fraction(timeline: Timeline | Sequence[Timeline]) -> float:
    """Idle time over total time: 1 - (time in F/B actions) / (span of the step x number of timelines).

    Given the timelines of all stages (clocks comparable: ranks on one host), the span is common to them all,
    from the earliest start to the latest end, which is what (p - 1) / (m + p - 1) predicts.
    """
    timelines = [timeline] if isinstance(timeline, Timeline) else list(timeline)
    if not timelines:
        raise ValueError("bubble_fraction needs at least one timeline")
    span = max(t.end_s for t in timelines) - min(t.start_s for t in timelines)
    if span <= 0:
        return 0.0
    return 1.0 - sum(t.busy_s() for t in timelines) / (span * len(timelines))
