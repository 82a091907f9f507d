"""A stand-in for the CUDA graph of a recorded step (:mod:`dtrain.parallel.step_graph`), for tests on the CPU.

Within :func:`stand_in`, recording a step runs it (its collectives and messages are real, so every rank runs it
alike) and replaying runs it again, then writes its loss and gradients into the tensors the recording made, as
a graph's replay writes into its pool; the gradients the caller held are put back around it, as the replay leaves
them to :meth:`~dtrain.parallel.step_graph.RecordedStep.replay`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from dtrain.parallel import step_graph


class StandIn:
    """What the stand-in saw: recordings and replays made, and whether a recording is running now."""

    def __init__(self, recorded: Callable[[], step_graph.RecordedStep]) -> None:
        self.recorded = recorded
        self.records = 0
        self.replays = 0
        self.recording = False

    def autocast_seen(self, seen: list) -> Callable[..., None]:
        """A forward pre-hook that appends (autocast on, its cast cache on) to ``seen`` while a step records."""

        def look(*_) -> None:
            if self.recording:
                seen.append((torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))

        return look


@contextlib.contextmanager
def stand_in(
    recorded: Callable[[], step_graph.RecordedStep], undo: Callable[[], Callable[[], None]] | None = None
) -> Iterator[StandIn]:
    """Record and replay steps with the stand-in; ``recorded()`` is the step being replayed (the pipeline's
    ``_step_graph``, a :class:`~dtrain.parallel.step_graph.GraphedStep`'s ``recorded``). ``undo``, for a step that
    changes state outside its loss and gradients (an optimizer stepped inside backward): called before a recording,
    it returns what puts that state back after it, as a capture, which runs nothing, leaves it."""
    seen = StandIn(recorded)

    class Graph:
        fn: Callable[[], torch.Tensor] | None = None

        def replay(self) -> None:
            seen.replays += 1
            done = seen.recorded()
            held = [q.grad for q in done.params]
            for q in done.params:
                q.grad = None
            loss = self.fn()
            for q, g in zip(done.params, done.grads, strict=True):
                if g is not None and g is not q.grad:
                    g.copy_(q.grad)
            done.loss.copy_(loss)
            for q, h in zip(done.params, held, strict=True):
                q.grad = h

    def record(graph: Graph, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        seen.records += 1
        graph.fn = fn
        seen.recording = True
        put_back = undo() if undo is not None else None
        try:
            return fn()
        finally:
            seen.recording = False
            if put_back is not None:
                put_back()

    real = step_graph.new_graph, step_graph.record
    step_graph.new_graph, step_graph.record = Graph, record
    try:
        yield seen
    finally:
        step_graph.new_graph, step_graph.record = real
