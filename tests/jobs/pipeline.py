"""Jobs for tests/parallel/test_pipeline_parallel.py: pipelined training against the unsplit model on one process.

Every rank builds the same model from a seed and keeps an untouched copy as the reference: the whole batch
through the whole model on this one process, plain autograd, plain SGD. The pipelined stage must end up with
the same loss, gradients and parameters as the reference's layers it holds.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.parallel import pipeline_parallel
from dtrain.parallel.pipeline_parallel import PipelineParallel, PipelineStage
from dtrain.parallel.pipeline_parallel_communications import DeviceClock
from dtrain.parallel.pipeline_schedules import Timeline, interleaved_one_f_one_b, validate_schedule
from dtrain.testing.pool import group_of
from tests.jobs import graphs

BATCH = 16
LR = 0.1


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 5), nn.Tanh(),
        nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 7), nn.Tanh(), nn.Linear(7, 3),
    )  # fmt: skip


def _reshaping(seed: int) -> nn.Sequential:
    """Stages that change width and rank: (B, 4, 3) -> (B, 4, 10) -> (B, 40) -> (B, 7) -> (B, 2)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 10), nn.GELU(), nn.Flatten(), nn.Linear(40, 7), nn.Tanh(), nn.Linear(7, 2),
    )  # fmt: skip


MODELS = {"mlp": (_mlp, (6,), 3), "reshaping": (_reshaping, (4, 3), 2)}


def _data(model: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, in_shape, out_width = MODELS[model]
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, *in_shape, generator=g), torch.randn(BATCH, out_width, generator=g)


def _sgd_step(params: list[torch.Tensor]) -> None:
    """Plain SGD, then zero the gradients (torch.optim refuses a stage without parameters)."""
    with torch.no_grad():
        for q in params:
            q -= LR * q.grad
            q.grad = None


def _reference_steps(model: nn.Sequential, name: str, steps: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Losses and, per step, every parameter's gradient of full-batch SGD on one process."""
    losses, grads = [], []
    for step in range(steps):
        batch, targets = _data(name, step)
        loss = F.mse_loss(model(batch), targets)
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        _sgd_step(list(model.parameters()))
    return losses, grads


def _pipeline_steps(pipe: PipelineParallel, name: str, steps: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    losses, grads = [], []
    for step in range(steps):
        batch, targets = _data(name, step)
        losses.append(pipe.train_step(batch, targets, F.mse_loss).item())
        grads.append([p.grad.clone() for p in pipe.parameters()])
        _sgd_step(list(pipe.parameters()))
    return losses, grads


def _max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| beyond the float32 tolerance rtol 1e-5, atol 1e-6 (0 when all are within it)."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        excess = (a - b).abs() - (1e-6 + 1e-5 * b.abs())
        worst = max(worst, excess.max().item() if excess.numel() else 0.0)
    return max(worst, 0.0)


def _fused(pipe: PipelineParallel) -> int:
    """How many weight gradients the pipeline's gradient-accumulation fusion added in place (0 without it)."""
    return pipe.fused_accumulation.fused if pipe.fused_accumulation is not None else 0


def equivalence(
    p: int, m: int, model: str = "mlp", steps: int = 3, balance: str = "layers", fused: bool = False
) -> dict:
    """GPipe and 1F1B against the unsplit reference and each other; returns the worst errors on this rank (and,
    with ``fused``, how many weight gradients each schedule added in place)."""
    group = group_of(p)
    build = MODELS[model][0]
    reference = build(seed=7)
    ref_losses, ref_grads = _reference_steps(reference, model, steps)
    out: dict = {}
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = PipelineParallel(
            build(seed=7),
            group,
            num_microbatches=m,
            schedule=schedule,
            balance=balance,
            grad_accumulation_fusion=fused,
        )
        losses, grads = _pipeline_steps(pipe, model, steps)
        if fused:
            out[f"{schedule}_fused"] = _fused(pipe)
        held = pipe.stage.layer_range
        ref_params = [q.detach() for q in reference[held.start : held.stop].parameters()]
        out[f"{schedule}_loss"] = _max_error([torch.tensor(losses)], [torch.tensor(ref_losses)])
        ref_stage_grads = [g for s in range(steps) for g in _stage_slice(reference, held, ref_grads[s])]
        out[f"{schedule}_grad"] = _max_error([g for s in grads for g in s], ref_stage_grads)
        out[f"{schedule}_param"] = _max_error(list(pipe.parameters()), ref_params)
        runs[schedule] = [q.detach().clone() for q in pipe.parameters()]
    out["schedules_agree"] = _max_error(runs["1f1b"], runs["gpipe"])
    return out


def _stage_slice(model: nn.Sequential, held: range, all_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The entries of ``all_grads`` (one per parameter of ``model``, in order) that belong to layers ``held``."""
    owners = [i for i, layer in enumerate(model) for _ in layer.parameters()]
    return [g for owner, g in zip(owners, all_grads, strict=True) if owner in held]


def too_many_stages() -> str:
    """A 3-layer model on a 4-stage group; returns the error text (nothing is sent)."""
    try:
        PipelineStage(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), group_of(4))
    except ValueError as err:
        return str(err)
    return "no error"


def indivisible_batch() -> str:
    """A batch of 10 into 4 micro-batches on 2 stages raises on every rank; the pipeline still trains after."""
    pipe = PipelineParallel(_mlp(seed=1), group_of(2), num_microbatches=4)
    try:
        pipe.train_step(torch.randn(10, 6), torch.randn(10, 3), F.mse_loss)
    except ValueError as err:
        message = str(err)
    else:
        message = "no error"
    loss = pipe.train_step(torch.randn(8, 6), torch.randn(8, 3), F.mse_loss)
    return f"{message}|{torch.isfinite(loss).item()}"


def timeline(p: int, m: int, schedule: str, link_report: bool = False) -> Timeline | tuple[Timeline, dict]:
    """This rank's timeline of a measured step (after a warm-up step, whose first-call costs are no bubble), and
    with ``link_report`` the stage link's :meth:`~StageLink.step_report` of that step."""
    pipe = PipelineParallel(_mlp(seed=3), group_of(p), num_microbatches=m, schedule=schedule)
    batch, targets = _data("mlp", 0)
    for _ in range(2):
        pipe.train_step(batch, targets, F.mse_loss)
    return (pipe.timeline, pipe.link.step_report()) if link_report else pipe.timeline


class _Mark:
    """A stand-in for a recorded ``torch.cuda.Event`` with timing on: a time in milliseconds on a clock of its own."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: _Mark) -> float:
        return end.ms - self.ms

    def synchronize(self) -> None:
        pass


class _StandInClock(DeviceClock):
    """:class:`DeviceClock` on the CPU: each marker reads the host clock, shifted to an epoch of its own (a
    device's clock starts elsewhere); counts its reads (:meth:`finish`)."""

    finished = 0

    @staticmethod
    def available(device: torch.device) -> bool:
        return True

    def __init__(self, device: torch.device) -> None:
        self.device, self.end, self.intervals = device, None, []
        self.start = self.mark()
        self.start_s = time.perf_counter()

    def mark(self) -> _Mark:
        return _Mark(time.perf_counter() * 1e3 + 5e6)

    def finish(self, timeline: Timeline) -> Timeline:
        _StandInClock.finished += 1
        return super().finish(timeline)


def device_timeline(p: int, m: int, schedule: str) -> tuple[Timeline, Timeline, int]:
    """A step on the host clock, then one with :attr:`PipelineParallel.device_clock` set, its clock a stand-in
    (:class:`_StandInClock`; no GPU here): this rank's two timelines (the second read twice) and how many times
    the stand-in's times were read."""
    pipe = PipelineParallel(_mlp(seed=3), group_of(p), num_microbatches=m, schedule=schedule)
    batch, targets = _data("mlp", 0)
    pipe.train_step(batch, targets, F.mse_loss)
    host = pipe.timeline
    _StandInClock.finished = 0
    pipeline_parallel.DeviceClock = _StandInClock
    try:
        pipe.device_clock = True
        pipe.train_step(batch, targets, F.mse_loss)
        pipe.train_step(batch, targets, F.mse_loss, forward_only=True)  # leaves the training step's timeline
    finally:
        pipeline_parallel.DeviceClock = DeviceClock
    device = pipe.timeline
    assert pipe.timeline is device
    return host, device, _StandInClock.finished


def _chunk_errors(pipe: PipelineParallel, reference: nn.Sequential, ref: tuple, got: tuple, steps: int) -> dict:
    """The worst loss, gradient and parameter errors of ``pipe``'s chunks against the unsplit ``reference``
    (``ref`` and ``got``: the losses and per-step gradients of each)."""
    (ref_losses, ref_grads), (losses, grads) = ref, got
    held = [i for chunk in pipe.chunks for i in chunk.layer_range]
    ref_params = [q.detach() for i in held for q in reference[i].parameters()]
    ref_stage_grads = [g for s in range(steps) for g in _stage_slice(reference, held, ref_grads[s])]
    return {
        "loss": _max_error([torch.tensor(losses)], [torch.tensor(ref_losses)]),
        "grad": _max_error([g for s in grads for g in s], ref_stage_grads),
        "param": _max_error(list(pipe.parameters()), ref_params),
    }


def interleaved(
    p: int,
    m: int,
    v: int,
    steps: int = 3,
    group_size: int | None = None,
    transport: str = "auto",
    fused: bool = False,
) -> dict:
    """Interleaved 1F1B with ``v`` chunks a rank (micro-batches in groups of ``group_size``) against the unsplit
    reference; the worst errors on this rank (and, with ``fused``, how many weight gradients were added in
    place)."""
    group = group_of(p)
    reference = _mlp(seed=7)
    ref = _reference_steps(reference, "mlp", steps)
    pipe = PipelineParallel(
        _mlp(seed=7),
        group,
        num_microbatches=m,
        schedule="interleaved-1f1b",
        virtual_stages=v,
        microbatch_group=group_size,
        transport=transport,
        grad_accumulation_fusion=fused,
    )
    got = _pipeline_steps(pipe, "mlp", steps)
    return {
        **({"fused": _fused(pipe)} if fused else {}),
        **_chunk_errors(pipe, reference, ref, got, steps),
        "chunks": float(len(pipe.chunks) != v),  # 0.0 when this rank holds v chunks
        "peak_activations": float(pipe.timeline.peak_activations != validate_peak(p, m, v, group_size)),
    }


def validate_peak(p: int, m: int, v: int, group_size: int | None = None) -> int:
    """This rank's schedule's own count of (chunk, micro-batch) activations held at its peak."""
    stage = dist.get_rank(group_of(p))
    return validate_schedule(interleaved_one_f_one_b(p, m, stage, v, group_size), m, v)


def zero_bubble(
    p: int, m: int, schedule: str, steps: int = 3, costs: tuple | None = None, balance: str = "layers"
) -> dict:
    """A zero-bubble schedule (B and W split; ``costs``: the (T_F, T_B, T_W) its order is built for; ``balance``
    how the chunks are cut) against the unsplit reference; the worst errors on this rank, and whether its W actions
    ran the deferred weight gradients (none left in the store, every linear's weight among them)."""
    group = group_of(p)
    reference = _mlp(seed=7)
    ref_losses, ref_grads = _reference_steps(reference, "mlp", steps)
    pipe = PipelineParallel(
        _mlp(seed=7), group, num_microbatches=m, schedule=schedule, schedule_costs=costs, balance=balance
    )
    pushed = []
    store = pipe.weight_grads
    original = store.push
    history = []  # per push: whether what waits for W kept its autograd history

    def push(weight, *rest):
        pushed.append(weight)
        kept = original(weight, *rest)
        if kept:
            history.append(any(t.requires_grad for t in store._pending[store._key][-1][2:]))
        return kept

    store.push = push
    losses, grads = _pipeline_steps(pipe, "mlp", steps)
    batch, targets = _data("mlp", 0)
    pipe.train_step(batch, targets, F.mse_loss)  # W's GEMMs must not tie the gradients to the step's autograd graph
    in_graph = any(q.grad is not None and (q.grad.requires_grad or q.grad.grad_fn) for q in pipe.parameters())
    held = [i for chunk in pipe.chunks for i in chunk.layer_range]
    ref_params = [q.detach() for i in held for q in reference[i].parameters()]
    ref_stage_grads = [g for s in range(steps) for g in _stage_slice(reference, held, ref_grads[s])]
    weights = {id(layer.weight) for layer in pipe.stage.modules() if isinstance(layer, nn.Linear)}
    linears = sum(isinstance(reference[i], nn.Linear) for i in held)
    stage = dist.get_rank(group)
    return {
        "loss": _max_error([torch.tensor(losses)], [torch.tensor(ref_losses)]),
        "grad": _max_error([g for s in grads for g in s], ref_stage_grads),
        "param": _max_error(list(pipe.parameters()), ref_params),
        "left_in_store": float(store.pending()),
        "grads_in_autograd_graph": float(in_graph),
        "kept_with_history": float(any(history) or not history),
        "deferred_every_linear": float({id(w) for w in pushed} != weights or linears != len(weights)),
        "w_events": float(sum(e.kind == "W" for e in pipe.timeline.events) != len(pipe.chunks) * m),
        "peak_activations": float(
            pipe.timeline.peak_activations != validate_schedule(pipe.actions, m, len(pipe.chunks))
        ),
        "stage": float(stage),
    }


def graphed(p: int, m: int, schedule: str, v: int = 1, steps: int = 3) -> dict:
    """``graphs=True`` with a stand-in for ``torch.cuda.make_graphed_callables`` (no GPU here): the first step runs
    eagerly and records each (chunk, micro-batch)'s argument shapes, then one capture makes a module per (chunk,
    micro-batch), the last chunk's including the loss, and every later step runs through them. Under a split
    backward the stand-in's replays push no weight gradient: they rewrite, in place, the tensors the captured
    backward pushed, as a B graph's replay does, so W must run on those. Returns the worst
    errors against the unsplit reference on this rank, the (chunk, micro-batch) keys captured, how many captures
    ran and how many forwards went through the captured modules."""
    from dtrain.parallel import pipeline_parallel

    captures, replays, splits = [], [0], []
    pipe, store, cursor = None, None, {}

    class Replayed(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args):
            replays[0] += 1
            return self.module(*args)

    captured: dict = {}  # (chunk, mb) -> what the captured backward (the last of the stand-in's) pushed

    def stand_in(modules, samples, contexts, split=False):
        splits.append(split)
        for module, args, context in zip(modules, samples, contexts, strict=True):
            with context:  # the warm-up forwards and backwards, then the one torch captures
                for _ in range(pipeline_parallel.WARMUP_ITERS + 1):
                    key = store._key if store is not None else None
                    before = store.pending(key) if key is not None else 0
                    out = module(*args)
                    wrt = [a for a in args if a.requires_grad] + list(module.parameters())
                    torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)  # a real output gradient
                    if key is not None:
                        captured[key] = list(store._pending.get(key, [])[before:])
        captures.append(len(modules))
        return tuple(Replayed(module) for module in modules)

    def replay_push(weight, bias, inp, grad):
        # a B graph's replay pushes nothing: it rewrites the tensors its captured backward pushed, in place
        key = store._key
        recorded = captured.get(key) if pipe._graphed is not None else None
        if recorded is None:
            return push(weight, bias, inp, grad)
        at = cursor[key] = cursor.get(key, -1) + 1
        w, b, x, g = recorded[at % len(recorded)]
        assert w is weight and b is bias
        x.copy_(inp)
        g.copy_(grad)
        return True

    real = pipeline_parallel._make_graphed
    pipeline_parallel._make_graphed = stand_in
    try:
        group = group_of(p)
        reference = _mlp(seed=7)
        ref = _reference_steps(reference, "mlp", steps)
        kwargs = {"virtual_stages": v} if schedule == "interleaved-1f1b" else {}
        pipe = PipelineParallel(_mlp(seed=7), group, num_microbatches=m, schedule=schedule, **kwargs)
        pipe.graphs = True  # the constructor asks for a CUDA device
        store = pipe.weight_grads
        if store is not None:
            push, store.push = store.push, replay_push
        got = _pipeline_steps(pipe, "mlp", steps)
    finally:
        pipeline_parallel._make_graphed = real
    return {
        **_chunk_errors(pipe, reference, ref, got, steps),
        "keys": sorted(pipe._graphed),
        "captures": captures,
        "replays": replays[0],
        "split": splits,
        # per (chunk, micro-batch) with deferred weight gradients: how many, and the chunk's linear layers
        "recorded_w": sorted(
            (key, len(entries), sum(isinstance(q, nn.Linear) for q in pipe.chunks[key[0]].modules()))
            for key, entries in pipe._recorded_w.items()
        ),
    }


def step_graphed(p: int, m: int, schedule: str, steps: int = 6, keep_grads: bool = False, fused: bool = False) -> dict:
    """``graphs="step"`` with a stand-in for the CUDA graph (no GPU here; :func:`tests.jobs.graphs.stand_in`),
    on peer channels in /dev/shm: two eager steps, then the step recorded once and replayed. An eager
    forward-only step runs between two replays, and ``keep_grads`` leaves ``.grad`` in place between steps (the
    optimizer steps on the accumulated gradients), so both the replace and the add paths are checked. Returns
    the worst errors against the unsplit reference, how many recordings and replays ran, and the transport in
    use."""
    pipe = None
    with graphs.stand_in(lambda: pipe._step_graph) as seen:
        group = group_of(p)
        reference = _mlp(seed=7)
        losses, grads, evals = [], [], []
        pipe = PipelineParallel(
            _mlp(seed=7),
            group,
            num_microbatches=m,
            schedule=schedule,
            transport="peer",
            grad_accumulation_fusion=fused,
        )
        pipe.graphs = "step"  # the constructor asks for a CUDA device
        ref_losses, ref_grads = [], []
        for step in range(steps):
            batch, targets = _data("mlp", step)
            loss = F.mse_loss(reference(batch), targets)
            loss.backward()
            ref_losses.append(loss.item())
            losses.append(pipe.train_step(batch, targets, F.mse_loss).item())
            ref_grads.append([q.grad.clone() for q in reference.parameters()])
            grads.append([q.grad.clone() for q in pipe.parameters()])
            for params in (list(reference.parameters()), list(pipe.parameters())):
                if keep_grads:  # SGD, then zero the gradients in place (a replay's own gradient stays .grad)
                    with torch.no_grad():
                        for q in params:
                            q -= LR * q.grad
                            q.grad.zero_()
                else:
                    _sgd_step(params)
            if step == 3:
                with torch.no_grad():
                    evals.append(pipe.train_step(batch, targets, F.mse_loss, forward_only=True).item())
                    evals.append(F.mse_loss(reference(batch), targets).item())
        got = (losses, grads)
        errors = _error_and_recovery(pipe, m, steps) if pipe.is_first and pipe.is_last is False else {}
    return {
        **_chunk_errors(pipe, reference, (ref_losses, ref_grads), got, steps),
        **errors,
        "eval": abs(evals[0] - evals[1]),
        "records": seen.records,
        "replays": seen.replays,
        "transport": pipe.link.transport_in_use,
        "fused": _fused(pipe),
        "clock": pipe.timeline.clock,
    }


def _error_and_recovery(pipe: PipelineParallel, m: int, step: int) -> dict:
    """On the first stage of a recorded pipeline: what a batch of another shape says (before anything is sent)."""
    batch, targets = _data("mlp", step)
    try:
        pipe.train_step(batch[: m * 2], None, F.mse_loss)
    except ValueError as err:
        return {"other_shape": str(err)}
    return {"other_shape": "no error"}


def graphs_refused() -> list[str]:
    """``graphs=True`` on a CPU stage: the error, before anything is sent."""
    try:
        PipelineParallel(_mlp(seed=1), group_of(2), num_microbatches=2, graphs=True)
    except ValueError as err:
        said = [str(err)]
    for bad in ({"graphs": "steps"}, {"graphs": "step", "transport": "group"}):
        try:
            PipelineParallel(_mlp(seed=1), group_of(2), num_microbatches=2, **bad)
        except ValueError as err:
            said.append(str(err))
    return said


def graphed_autocast(p: int, m: int, steps: int = 3) -> dict:
    """1F1B with ``graphs=True`` under bf16 autocast (a stand-in capture, as :func:`graphed`) against the same
    pipeline run eagerly under the same autocast: the largest difference of losses and gradients, and what the
    recorded forwards ran under (autocast on, its cast cache off)."""
    from dtrain.parallel import pipeline_parallel

    seen = []

    def stand_in(modules, samples, contexts, split=False):
        for module, args in zip(modules, samples, strict=True):
            hook = module.stage.register_forward_pre_hook(
                lambda *_: seen.append((torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))
            )
            for _ in range(pipeline_parallel.WARMUP_ITERS + 1):
                out = module(*args)
                wrt = [a for a in args if a.requires_grad] + list(module.parameters())
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            hook.remove()
        return modules

    group = group_of(p)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    real = pipeline_parallel._make_graphed
    pipeline_parallel._make_graphed = stand_in
    try:
        graphed = PipelineParallel(_mlp(seed=7), group, num_microbatches=m)
        graphed.graphs = True  # the constructor asks for a CUDA device
        eager = PipelineParallel(_mlp(seed=7), group, num_microbatches=m)
        worst = 0.0
        for step in range(steps):
            batch, targets = _data("mlp", step)
            a = graphed.train_step(batch, targets, F.mse_loss, forward_context=autocast)
            b = eager.train_step(batch, targets, F.mse_loss, forward_context=autocast)
            worst = max(worst, (a - b).abs().item())
            for x, y in zip(graphed.parameters(), eager.parameters(), strict=True):
                worst = max(worst, (x.grad - y.grad).abs().max().item())
            _sgd_step(list(graphed.parameters()))
            _sgd_step(list(eager.parameters()))
    finally:
        pipeline_parallel._make_graphed = real
    return {"worst": worst, "captured": graphed._graphed is not None, "recorded_under": sorted(set(seen))}


def step_graphed_autocast(p: int, m: int, steps: int = 5) -> dict:
    """``graphs="step"`` (the stand-in graph of :func:`step_graphed`) under bf16 autocast against the same
    pipeline run eagerly under the same autocast, both on peer channels: the largest difference of losses and
    gradients, and what the recorded step's forwards ran under (autocast on, its cast cache off)."""
    seen, pipe = [], None
    group = group_of(p)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with graphs.stand_in(lambda: pipe._step_graph) as standing:
        pipe = PipelineParallel(_mlp(seed=7), group, num_microbatches=m, transport="peer")
        pipe.graphs = "step"  # the constructor asks for a CUDA device
        for chunk in pipe.chunks:
            chunk.register_forward_pre_hook(standing.autocast_seen(seen))
        eager = PipelineParallel(_mlp(seed=7), group, num_microbatches=m, transport="peer")
        worst = 0.0
        for step in range(steps):
            batch, targets = _data("mlp", step)
            a = pipe.train_step(batch, targets, F.mse_loss, forward_context=autocast)
            b = eager.train_step(batch, targets, F.mse_loss, forward_context=autocast)
            worst = max(worst, (a - b).abs().item())
            for x, y in zip(pipe.parameters(), eager.parameters(), strict=True):
                worst = max(worst, (x.grad - y.grad).abs().max().item())
            _sgd_step(list(pipe.parameters()))
            _sgd_step(list(eager.parameters()))
    return {"worst": worst, "recorded": pipe._step_graph is not None, "recorded_under": sorted(set(seen))}


def transports_agree(p: int, m: int, schedule: str) -> dict:
    """The same training over the process groups and over peer channels ("peer", and "auto", which picks them on
    one host): the same losses and parameters after a forward-only step between two training steps and a change of
    micro-batch shape (``forget_shapes``, after which the channels open again with new slots)."""
    group = group_of(p)
    v = 2 if schedule == "interleaved-1f1b" else None
    runs, used = {}, {}
    for transport in ("group", "peer", "auto"):
        pipe = PipelineParallel(
            _mlp(seed=7), group, num_microbatches=m, schedule=schedule, virtual_stages=v, transport=transport
        )
        losses = []
        for step in range(5):
            batch, targets = _data("mlp", step)
            if step == 3:  # twice the rows a micro-batch from here on
                pipe.link.forget_shapes()
            if step >= 3:
                batch, targets = torch.cat([batch, batch.flip(0)]), torch.cat([targets, targets.flip(0)])
            if step == 2:
                losses.append(pipe.train_step(batch, targets, F.mse_loss, forward_only=True).item())
                continue
            losses.append(pipe.train_step(batch, targets, F.mse_loss).item())
            _sgd_step(list(pipe.parameters()))
        runs[transport] = (losses, [q.detach().clone() for q in pipe.parameters()])
        used[transport] = pipe.link.transport_in_use
    out = {"used": used}
    for transport in ("peer", "auto"):
        losses, params = runs[transport]
        out[f"{transport}_loss"] = _max_error([torch.tensor(losses)], [torch.tensor(runs["group"][0])])
        out[f"{transport}_param"] = _max_error(params, runs["group"][1])
    return out


def bad_transport() -> str:
    try:
        PipelineParallel(_mlp(seed=1), group_of(2), num_microbatches=2, transport="nccl")
    except ValueError as err:
        return str(err)
    return "no error"
