"""Usage: python benchmarks/training/trace_summary.py TRACE.json [--steps N]

Where a step's device time goes, from a torch.profiler Chrome trace: the span from the first to the last device
event, the time any kernel or copy runs (their union), the compute kernels, the communication kernels (NCCL's,
and dtrain's own Triton and CUDA collective kernels, peer-to-peer copies), the communication that runs while no
compute kernel does (exposed), the copies (every memcpy, peer or local), and the device's idle time. Per step:
each figure divided by ``--steps``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COMM_MARKERS = ("nccl", "exchange_kernel", "one_shot", "two_shot", "multimem", "barrier_kernel", "symm", "ptop")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union ``a`` outside the union ``b`` (both sorted, disjoint)."""
    overlap, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            overlap += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return _length(a) - overlap


def is_comm(name: str) -> bool:
    lower = name.lower()
    return any(m in lower for m in COMM_MARKERS)


def summarize(events: list[dict], steps: int = 1) -> dict:
    """Milliseconds per step: span, busy, compute, comm, comm_exposed, idle, and the top compute kernels."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        raise ValueError("trace: no kernel, memcpy or memset events (was CUDA profiled?)")
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in device]
    comm = _union([s for s, e in zip(spans, device, strict=True) if is_comm(e.get("name", ""))])
    compute = _union([s for s, e in zip(spans, device, strict=True) if not is_comm(e.get("name", ""))])
    copies = _union([s for s, e in zip(spans, device, strict=True) if e.get("cat") == "gpu_memcpy"])
    busy = _union(spans)
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    by_name: dict[str, float] = {}
    for (start, end), e in zip(spans, device, strict=True):
        by_name[e.get("name", "?")] = by_name.get(e.get("name", "?"), 0.0) + end - start
    per = 1e-3 / steps  # microseconds -> milliseconds per step
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "span_ms": span * per,
        "busy_ms": _length(busy) * per,
        "compute_ms": _length(compute) * per,
        "comm_ms": _length(comm) * per,
        "comm_exposed_ms": _minus(comm, compute) * per,
        "copies_ms": _length(copies) * per,
        "idle_ms": (span - _length(busy)) * per,
        "kernels": len(device) / steps,
        "top": [(name[:80], ms * per) for name, ms in top],
    }


def format_summary(name: str, s: dict) -> str:
    lines = [
        f"{name}: span {s['span_ms']:.2f} ms, busy {s['busy_ms']:.2f}, compute {s['compute_ms']:.2f}, "
        f"comm {s['comm_ms']:.2f} (exposed {s['comm_exposed_ms']:.2f}), copies {s.get('copies_ms', 0.0):.2f}, "
        f"idle {s['idle_ms']:.2f}, "
        f"{s['kernels']:.0f} device events a step"
    ]
    lines += [f"    {ms:8.3f} ms  {kernel}" for kernel, ms in s["top"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    events = json.loads(args.trace.read_text())["traceEvents"]
    print(format_summary(args.trace.name, summarize(events, args.steps)))


if __name__ == "__main__":
    main()
