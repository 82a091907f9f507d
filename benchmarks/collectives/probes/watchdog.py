"""Usage: python benchmarks/collectives/probe.py watchdog

Probe: host microseconds of the watchdog's per-call work on one GPU (no process group needed).

Times, while the GPU is kept busy (torch.cuda._sleep) so recorded events stay pending as in training: the
current-stream look-up, making a CUDA event object, recording a new event, re-recording an event made and
recorded before, recording through a cached stream object, the capture check, and
``dtrain.comm.peer.watchdog.watch`` itself (with its thread running).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from dtrain.comm.peer import watchdog


def per_call_us(fn, n=2000) -> float:
    for _ in range(min(50, n // 4)):
        fn()
    torch.cuda._sleep(1 << 40 >> 10)  # ~ a second or more of GPU time ahead of the host
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    made = [torch.cuda.Event() for _ in range(4096)]
    side = torch.cuda.Stream()
    for e in made:
        e.record(side)  # creates the CUDA event now
    torch.cuda.synchronize()
    spare = iter(made)
    stream = torch.cuda.current_stream()
    base = torch._C._CudaEventBase.record
    record = watchdog._recorder(dev)
    rows = {
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch.cuda.Event() object": lambda: torch.cuda.Event(),
        "new Event + record()": lambda: torch.cuda.Event().record(),
        "made-ahead event .record()": lambda: next(spare).record(),
        "made-ahead, cached stream, base record": lambda: base(next(spare), stream),
        "is_current_stream_capturing()": lambda: torch.cuda.is_current_stream_capturing(),
        "dtrain's recorder (cached stream object)": lambda: record(next(spare)),
        "watchdog.watch, 200 calls (thread running)": lambda: watchdog.watch(dev, timedelta(seconds=600), lambda: "x"),
    }
    for name, fn in rows.items():
        n = 1000 if "made-ahead" in name or "recorder" in name else 200 if "200 calls" in name else 2000
        print(f"{name:42s} {per_call_us(fn, n):7.2f} us", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
