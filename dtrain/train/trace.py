"""Pipeline timelines out: a Chrome trace (chrome://tracing, https://ui.perfetto.dev) and a Gantt chart.

The trace follows the Trace Event Format's complete events (``"ph": "X"``, times in microseconds; Google,
"Trace Event Format", 2016): one process per rank, compute (F/B/W) on thread 0 and messages on thread 1; the
timelines' clock (:attr:`~dtrain.parallel.pipeline_schedules.Timeline.clock`: "host", "device" or "none") is in
each process's name and in ``otherData``. The Gantt chart draws one row per stage and prints the measured bubble
(:func:`bubble_fraction`) and its clock beside the theory ``(p - 1) / (m + p - 1)`` (:func:`theoretical_bubble`);
timelines of clock "none" (a step replayed as one CUDA graph) have no events and no measured bubble.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dtrain.parallel.pipeline_schedules import Timeline, bubble_fraction, theoretical_bubble, timelines_clock

__all__ = ["chrome_trace", "write_chrome_trace", "write_gantt"]

_COMPUTE = ("F", "B", "W")
_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def chrome_trace(timelines: Sequence[Timeline], ranks: Sequence[int]) -> dict:
    """Trace Event Format dict of one step's timelines, ``ranks[i]`` the global rank of ``timelines[i]``."""
    origin = min(t.start_s for t in timelines)
    events = []
    for timeline, rank in zip(timelines, ranks, strict=True):
        name = f"stage {timeline.stage} ({timeline.clock} clock)"
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": name}})
        for e in timeline.events:
            events.append(
                {
                    "name": f"{e.kind}{e.microbatch}" if e.kind in _COMPUTE else f"{e.kind} mb{e.microbatch}",
                    "cat": "compute" if e.kind in _COMPUTE else "comm",
                    "ph": "X",
                    "ts": (e.start_s - origin) * 1e6,
                    "dur": max(e.end_s - e.start_s, 0.0) * 1e6,
                    "pid": rank,
                    "tid": 0 if e.kind in _COMPUTE else 1,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"clock": timelines_clock(timelines)}}


def write_chrome_trace(path: str | Path, timelines: Sequence[Timeline], ranks: Sequence[int]) -> None:
    Path(path).write_text(json.dumps(chrome_trace(timelines, ranks)))


def write_gantt(path: str | Path, timelines: Sequence[Timeline], schedule: str) -> float | None:
    """Draw the stages' F/B/W intervals to a PNG; returns the measured bubble fraction (None where the timelines
    have no times, clock "none")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clock = timelines_clock(timelines)
    measured = bubble_fraction(timelines) if clock != "none" else None
    p, m, v = timelines[0].num_stages, timelines[0].num_microbatches, timelines[0].virtual_stages
    origin = min(t.start_s for t in timelines)
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * p))
    for t in timelines:
        for e in t.events:
            if e.kind not in _COMPUTE:
                continue
            start_ms, width_ms = (e.start_s - origin) * 1e3, (e.end_s - e.start_s) * 1e3
            ax.broken_barh([(start_ms, width_ms)], (t.stage - 0.4, 0.8), facecolors=_COLORS[e.kind], edgecolor="white")
            label = f"{e.kind}{e.microbatch}" + (f".{e.chunk}" if v > 1 else "")
            ax.text(start_ms + width_ms / 2, t.stage, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms since the step began ({clock} clock)")
    if measured is None:
        found = "no action times (the step replayed as one CUDA graph)"
    else:
        found = f"measured bubble {measured:.1%} ({clock} clock)"
    ax.set_title(
        f"{schedule}, p={p}, m={m}"
        + (f", v={v}" if v > 1 else "")
        + f": {found}, theory "
        + ("(p-1)/(vm+p-1)" if v > 1 else "(p-1)/(m+p-1)")
        + f" = {theoretical_bubble(p, m, v):.1%}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return measured
