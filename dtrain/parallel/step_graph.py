"""A training step recorded as one CUDA graph and replayed: the host issues a step with one graph launch.

A step that launches a thousand small kernels from Python can leave the GPU waiting on the host, and more so
when several processes share one host's cores (data parallel on every GPU of a server). Recording the whole
step (forward, loss, backward and the gradient reductions its hooks launch) once and replaying it takes the host
off the step's critical path: CUDA graphs (NVIDIA, "CUDA C++ Programming Guide", section "CUDA Graphs"), as
PyTorch exposes them in ``torch.cuda.graph`` and its "whole-network capture" recipe.

:class:`GraphedStep` runs a step function eagerly for its first calls (lazy state, bucket orders and
collectives' choices settle there), records the next call, which is also that step's run, and replays the
recording from then on. The step's inputs are copied into static tensors the recording reads; its loss and
gradients are tensors the recording writes, handed out after each replay as an eager step would leave them
(:class:`RecordedStep`). The recording runs with every ``.grad`` set to None, so the graph makes the gradients
afresh, and with autocast's cast cache off (:func:`uncached_autocast`: a cast cached in the recording would be
read stale in every replay). :mod:`dtrain.parallel.pipeline_parallel` records a pipeline stage's step the same
way.

What a recording needs of the step: the same shapes on every call (another shape is refused, see
:meth:`GraphedStep.forget`), no host synchronization inside it (no ``.item()``, no data-dependent Python
branch), and, across processes, every rank recording on the same call.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["GraphedStep", "RecordedStep", "quiet_capture", "record_step", "uncached_autocast", "uncached_within"]

#: Seconds to let the watchdog threads see the last step's work finished before a capture (they look every 0.1-0.5 s).
WATCHDOG_LOOK_S = 1.0


def new_graph():  # noqa: ANN201
    """A CUDA graph to record a step into (tests on the CPU put a stand-in here)."""
    return torch.cuda.CUDAGraph()


def record(graph, fn: Callable[[], torch.Tensor]) -> torch.Tensor:  # noqa: ANN001
    """Record ``fn``'s work into ``graph`` (``torch.cuda.graph``) and return what it returns (tests on the CPU put a
    stand-in here)."""
    with torch.cuda.graph(graph):
        return fn()


@contextlib.contextmanager
def quiet_capture(device: torch.device) -> Iterator[None]:
    """Around a capture: nothing else in the process touches CUDA in a way that breaks it.

    On a GPU the device is synchronized first and the watchdog threads get :data:`WATCHDOG_LOOK_S` to see the
    last work finished: ProcessGroupNCCL's (which frees finished work's tensors) and dtrain.comm's (which queries
    events) look only every 0.1-0.5 s, and either doing so during a capture in CUDA's global mode breaks it
    (pytorch/pytorch#104487); dtrain.comm's watchdog then looks at nothing until the capture ends. The garbage
    collector is run first and kept off meanwhile: an old CUDA graph collected during a capture is destroyed
    while it runs, which CUDA refuses in its global capture mode."""
    from dtrain.comm.peer import watchdog

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        time.sleep(WATCHDOG_LOOK_S)
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with watchdog.capturing():
            yield
    finally:
        if collecting:
            gc.enable()


def uncached_autocast(x: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """The autocast in force on ``x``'s device again, with its cast cache off (a no-op where none is in force)."""
    if x is None:
        return contextlib.nullcontext()
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)


@contextlib.contextmanager
def uncached_within(
    base: Callable[[], contextlib.AbstractContextManager], probe: torch.Tensor | None
) -> Iterator[None]:
    """``base()``, and within it the autocast it turned on, again with its cast cache off."""
    with base(), uncached_autocast(probe):
        yield


class RecordedStep:
    """A recorded step: its graph, the static inputs it reads, the loss and the gradients it writes.

    ``inputs`` holds a static tensor for each input the step reads (None where this rank takes none, as a middle
    pipeline stage takes no batch); ``names`` names them in errors, which start with ``label`` (the option that
    recorded) and end with ``hint`` (how to record again)."""

    def __init__(
        self,
        graph,  # noqa: ANN001
        inputs: Sequence[torch.Tensor | None],
        loss: torch.Tensor,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        *,
        names: Sequence[str],
        label: str,
        hint: str,
    ) -> None:
        self.graph, self.inputs, self.loss = graph, list(inputs), loss
        self.params, self.grads = list(params), list(grads)
        self.names, self.label, self.hint = list(names), label, hint

    def check(self, inputs: Sequence[torch.Tensor | None]) -> None:
        """``ValueError`` where an input has another shape or dtype than the recording's."""
        for mine, given, name in zip(self.inputs, inputs, self.names, strict=True):
            if mine is None:
                continue
            if given is None or given.shape != mine.shape or given.dtype != mine.dtype:
                got = None if given is None else (tuple(given.shape), given.dtype)
                recorded = (tuple(mine.shape), mine.dtype)
                raise ValueError(
                    f"{self.label}: the step was recorded for a {name} of {recorded}, got {got}; {self.hint}"
                )

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Run the step on ``inputs`` (copied into the static ones); returns its loss, and leaves the gradients in
        ``.grad`` as an eager step would: a ``.grad`` that was None becomes the recording's gradient tensor, any
        other gets it added (copied first where it is the recording's own tensor, still held from the last
        replay, which the replay overwrites)."""
        self.check(inputs)
        for mine, given in zip(self.inputs, inputs, strict=True):
            if mine is not None:
                mine.copy_(given)
        before = []
        for q, g in zip(self.params, self.grads, strict=True):
            held = q.grad
            if g is not None and held is g:
                held = g.clone()
            before.append(held)
        self.graph.replay()
        for q, g, held in zip(self.params, self.grads, before, strict=True):
            if g is None:
                continue
            if held is None:
                q.grad = g
            else:
                held.add_(g)
                q.grad = held
        return self.loss.clone()


def record_step(
    step: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor | None],
    params: Sequence[torch.Tensor],
    device: torch.device,
    *,
    names: Sequence[str],
    label: str,
    hint: str,
) -> RecordedStep:
    """Record ``step(*static_inputs)`` (which returns the loss) as one graph, on static copies of ``inputs``, with
    every ``.grad`` of ``params`` None meanwhile so that the graph makes the gradients afresh (the caller's are
    put back). Nothing runs on a GPU: the graph's first replay is this step."""
    static = [None if t is None else t.detach().clone() for t in inputs]
    saved = [q.grad for q in params]
    for q in params:
        q.grad = None
    graph = new_graph()
    try:
        with quiet_capture(device):
            loss = record(graph, lambda: step(*static))
        grads = [q.grad for q in params]
    finally:
        for q, g in zip(params, saved, strict=True):
            q.grad = g
    return RecordedStep(graph, static, loss, params, grads, names=names, label=label, hint=hint)


class GraphedStep:
    """``step(*inputs, recording=...)`` (forward, loss and backward; returns the loss, detached) run eagerly for
    the first ``eager_steps`` calls, recorded as one CUDA graph on the next, and replayed from then on.

    ``params`` are the parameters whose ``.grad`` the step writes. ``recording`` is True while the step is being
    recorded: its forwards should then run autocast with the cast cache off (:func:`uncached_within`). Every
    rank of a job must record on the same call: give them the same ``eager_steps`` and call them alike.
    """

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        params: Sequence[torch.Tensor],
        device: torch.device,
        *,
        eager_steps: int = 2,
        names: Sequence[str] = ("batch", "targets"),
        label: str = "step graph",
        hint: str = "call forget() on every rank first",
    ) -> None:
        if not isinstance(eager_steps, int) or isinstance(eager_steps, bool) or eager_steps < 1:
            raise ValueError(f"eager_steps must be a positive int, got {eager_steps!r}")
        self.step, self.params, self.device = step, list(params), torch.device(device)
        self.eager_steps, self.names, self.label, self.hint = eager_steps, tuple(names), label, hint
        self.recorded: RecordedStep | None = None
        self.eager_run = 0  # steps run eagerly since the last forget()
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor | None) -> torch.Tensor:
        if self.recorded is not None:
            self.replays += 1
            return self.recorded.replay(inputs)
        if self.eager_run < self.eager_steps:
            self.eager_run += 1
            return self.step(*inputs, recording=False)
        recording = lambda *static: self.step(*static, recording=True)  # noqa: E731
        self.recorded = record_step(
            recording, inputs, self.params, self.device, names=self.names, label=self.label, hint=self.hint
        )
        self.replays += 1
        return self.recorded.replay(inputs)

    def check(self, *inputs: torch.Tensor | None) -> None:
        """``ValueError`` (before anything runs) where the recording exists and ``inputs`` do not fit it."""
        if self.recorded is not None:
            self.recorded.check(inputs)

    def forget(self) -> None:
        """Drop the recording: the next calls run eagerly again, then record anew (a batch of another shape)."""
        self.recorded, self.eager_run = None, 0
