"""Captured collectives: record a collective call once as a CUDA graph, then replay it for a few microseconds.

A schedule of R rounds costs R trips through torch.distributed's NCCL process group on the host, each tens
of microseconds (docs/benchmarks.md measures it); below a few MiB that host time, not the GPUs, sets the
pace. Replaying a CUDA graph of the whole call launches every round's NCCL kernels and reductions at once.
This is MPI-4's persistent collective (``MPI_Allreduce_init`` then ``MPI_Start``) on CUDA graphs.

Rules, as for any CUDA graph: the call is replayed on the same tensors (write new data into them, do not
rebind them), every rank of the group captures the same call in the same order, and the capture happens
once the process group has run at least one collective. On CPU tensors there is nothing to capture and
:func:`capture` raises ``ValueError``. Release captured collectives (:meth:`CapturedCollective.release`, or
drop every reference) before ``destroy_process_group``: a live graph that holds NCCL kernels can keep
``ncclCommDestroy`` waiting (pytorch/pytorch#115388).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dtrain.comm import watchdog

__all__ = ["CapturedCollective", "capture"]


class CapturedCollective:
    """A collective call recorded as a CUDA graph; call the object to run it again."""

    def __init__(self, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
        self._graph = graph
        self._stream = stream

    def release(self) -> None:
        """Free the graph and its memory; the object cannot be replayed afterwards."""
        if self._graph is not None:
            torch.cuda.synchronize()
            self._graph.reset()
            self._graph = None

    def __call__(self) -> None:
        """Replay on the current stream (it waits for earlier work and later work waits for it). A graph runs on
        whichever stream launches it, whatever stream it was captured on: no stream switch, no events."""
        if self._graph is None:
            raise ValueError("this captured collective was released")
        self._graph.replay()


def capture(call: Callable[[], object], device: torch.device | int | None = None, warmup: int = 1):
    """Run ``call`` ``warmup`` times eagerly, then record it as a graph; returns a :class:`CapturedCollective`.

    ``call`` is a closure over the tensors, e.g. ``lambda: comm.all_reduce(x, algorithm="ring")``.
    """
    if not torch.cuda.is_available():
        raise ValueError("capture needs CUDA tensors and a CUDA device; none is available here")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (plans and scratch buffers are made on the first call), got {warmup}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    # thread-local: other threads (the autograd engine's, dtrain's watchdog) may touch CUDA meanwhile
    with watchdog.capturing(), torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        call()
    torch.cuda.synchronize(device)
    return CapturedCollective(graph, stream)
