"""The planner: every ``dp x tp x pp x micro-batch`` layout (and ``cp``, context parallelism, where asked for) and
rank placement of a model on a cluster, those that fit device memory, ranked by simulated step time.

Layouts follow the rules the strategies impose (:mod:`dtrain.parallel`): the degrees multiply to the number
of devices used, tensor parallelism divides the attention heads, pipeline parallelism the layers, and every
replica runs a whole number of micro-batches. Each layout is tried under each placement
(:mod:`dtrain.sim.placement`) and each ZeRO stage asked for; memory is checked first (it costs nothing), then
the step is simulated (:mod:`dtrain.sim.step`). A layout that does not fit without activation recomputation
takes the cheapest recomputation that makes it fit, in the order asked for (by default none, then selective,
then full: each keeps less and costs more FLOPs; Korthikanti et al. 2022), so a model that fits only with
recomputation still gets a plan. The search covers these small sets, as in
Megatron-LM's own sweeps (Narayanan et al. 2021, section 3) rather than a cost-model search like Alpa's.

Asked for the ``top`` plans only, the sweep is a branch and bound (Land and Doig 1960): every layout and
placement first gets a lower bound on its step (:func:`dtrain.sim.step.step_lower_bound`: compute, the
tensor-parallel all-reduces and the pipeline bubble with free pipeline messages, no data-parallel time; the
tensor-parallel replays are few, cached and shared with the simulations), and they are simulated in the order of
their bounds until the next bound exceeds the ``top``-th best step simulated so far: every pair left has a step
above that bound, so it ranks after the ``top`` fastest. A pair whose bound is the lowest left is first refined
(``step_lower_bound(..., exact_pipeline=True)``: its pipeline timed exactly with free messages, plus a bound on
the data-parallel collectives from the servers' links out) and goes back in line; it is simulated once its refined
bound is still the lowest. The ``top`` fastest plans and their order are those of the exhaustive sweep.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dtrain.cluster.topology import Topology
from dtrain.parallel.pipeline_schedules import SPLIT_BACKWARD
from dtrain.sim.model import RECOMPUTE, Layout, ModelSpec, flops_per_microbatch, memory_per_device
from dtrain.sim.placement import PLACEMENTS, place
from dtrain.sim.step import StepConfig, StepResult, simulate_step, step_lower_bound, tensor_parallel_s

__all__ = ["Plan", "Sweep", "candidate_layouts", "plan", "sweep"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A layout under a placement and what the simulator says of it."""

    layout: Layout
    placement: str
    result: StepResult
    model_flops_per_step: float
    peak_flops: float

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the step's useful FLOPs over what the devices could do in the step."""
        return self.model_flops_per_step / (self.result.step_s * self.peak_flops)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


#: The (pipeline schedule, chunks a stage) pairs a sweep tries by default: 1F1B, interleaved 1F1B with two chunks,
#: and the zero-bubble ZB-H1 and ZB-V (not with ZeRO-2 or 3, whose reductions would miss their deferred W).
SCHEDULES: tuple[tuple[str, int], ...] = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2))


def candidate_layouts(
    model: ModelSpec,
    devices: int,
    global_batch: int,
    *,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    zero_stages: Sequence[int] = (0, 1),
    max_tp: int | None = None,
    schedule: str = "1f1b",
    schedules: Sequence[tuple[str, int]] | None = None,
    attention: str = "unfused",
    sequence_parallel: bool | None = None,
    fp8: bool = False,
    fp8_params: bool = False,
    balances: Sequence[str | None] = (None,),
    context_parallel: Sequence[int] = (1,),
) -> list[Layout]:
    """Every valid layout on ``devices`` devices: tp divides the heads (and is at most ``max_tp``), pp the
    layers (or, counting the input and output embeddings as a layer each, the layers and the two embeddings:
    ``Layout.embedding_layers = 1``, one chunk a stage), and ``global_batch`` splits into whole micro-batches
    per replica. ``schedules``: (schedule, chunks) pairs to try where the pipeline has more than one stage
    (default: ``schedule`` alone); sequence parallelism is on wherever ``tp > 1`` (it moves the same bytes as
    plain tensor parallelism and keeps and computes less, Korthikanti et al. 2022) unless ``sequence_parallel``
    says otherwise; ``attention``: the attention core of every layout (:data:`~dtrain.sim.model.ATTENTION`);
    ``fp8``: every layout's linear layers in 8-bit floating point (``Layout.fp8``; a choice of numerics the search
    does not make on its own), ``fp8_params`` their weights kept in 8 bits too. ``balances``: the pipeline cuts to
    try (:attr:`~dtrain.sim.model.Layout.balance`; None, Megatron-LM's even split, the default; ``"layers"`` and
    ``"flops"``, ``dtrain train``'s cuts, which any layer count allows). ``context_parallel``: the
    context-parallel degrees to try (:attr:`~dtrain.sim.model.Layout.cp`; each above 1 divides the devices a
    stage's tensor-parallel rank has and cuts a sequence into ``2 cp`` equal pieces, and needs ``attention``
    "flash")."""
    if any(cp < 1 for cp in context_parallel) or not context_parallel:
        raise ValueError(f"context_parallel: degrees of 1 or more, got {list(context_parallel)!r}")
    if attention != "flash" and any(cp > 1 for cp in context_parallel):
        raise ValueError("context_parallel above 1 runs flash attention over a ring: it needs attention 'flash'")
    pairs = (
        list(dict.fromkeys(schedules))
        if schedules
        else [(schedule, 2 if schedule == "zb-v" else (2 if "interleaved" in schedule else 1))]
    )
    # a value asked for twice is one choice: every layout once
    micro_batches, zero_stages, balances = (list(dict.fromkeys(c)) for c in (micro_batches, zero_stages, balances))
    layouts = []
    for tp in _divisors(devices):
        if model.heads % tp or (max_tp is not None and tp > max_tp):
            continue
        cuts = [
            (pp, b, cp)
            for pp in _divisors(devices // tp)
            for b in (balances if pp > 1 else [None])
            for cp in sorted(set(context_parallel))
            if (devices // (tp * pp)) % cp == 0 and model.sequence % (2 * cp) == 0
        ]
        for pp, balance, cp in cuts:
            dp = devices // (tp * pp * cp)
            embedding = 0
            units = model.layers + (2 if model.vocab else 0)  # dtrain's layers: embedding, blocks, head
            if balance is not None:
                if units < pp:
                    continue
            elif model.layers % pp:  # the embeddings counted as layers may even the stages out (embedding_layers)
                if not model.vocab or (model.layers + 2) % pp or (model.layers + 2) // pp < 2:
                    continue
                embedding = 1
            for mb in micro_batches:
                if global_batch % (dp * mb):
                    continue
                for zero in zero_stages:
                    if zero and dp * cp == 1:
                        continue  # nothing to shard over
                    for name, chunks in pairs if pp > 1 else [("1f1b", 1)]:
                        m = global_batch // (dp * mb)
                        uneven = units < pp * chunks if balance is not None else model.layers % (pp * chunks)
                        if (
                            (chunks > 1 and (embedding or uneven))
                            or (name == "interleaved-1f1b" and m % pp)
                            or (name in SPLIT_BACKWARD and zero >= 2)  # its reduction would miss the deferred W
                        ):
                            continue
                        sp = tp > 1 and sequence_parallel is not False
                        layouts.append(
                            Layout(dp=dp, cp=cp, tp=tp, pp=pp, micro_batch=mb, global_batch=global_batch,
                                   zero_stage=zero, schedule=name, chunks=chunks, attention=attention,
                                   sequence_parallel=sp, embedding_layers=embedding, fp8=fp8, fp8_params=fp8_params,
                                   balance=balance)
                        )  # fmt: skip
    return layouts


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """What a planner sweep found: the plans simulated, fastest first; how many layouts were left out for memory;
    and how many (layout, placement) pairs were left unsimulated because their lower bound exceeded the
    ``top``-th best step (0 for an exhaustive sweep)."""

    plans: list[Plan]
    too_big: int
    bounded: int
    simulated: int


def plan(
    model: ModelSpec,
    topology: Topology,
    *,
    global_batch: int,
    devices: int | None = None,
    placements: Sequence[str] = PLACEMENTS,
    config: StepConfig | None = None,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    zero_stages: Sequence[int] = (0, 1),
    max_tp: int | None = None,
    recompute: Sequence[str] = RECOMPUTE,
    progress: Callable[[int, int], None] | None = None,
    schedules: Sequence[tuple[str, int]] = SCHEDULES,
    attention: str = "unfused",
    sequence_parallel: bool | None = None,
    fp8: bool = False,
    fp8_params: bool = False,
    top: int | None = None,
    balances: Sequence[str | None] = (None,),
    context_parallel: Sequence[int] = (1,),
) -> tuple[list[Plan], int]:
    """Plans that fit, fastest first, and how many layouts were left out for memory (:func:`sweep`'s plans and
    ``too_big``). With ``top`` set, only the ``top`` first plans are sure to be there, in their exhaustive
    order."""
    found = sweep(
        model, topology, global_batch=global_batch, devices=devices, placements=placements, config=config,
        micro_batches=micro_batches, zero_stages=zero_stages, max_tp=max_tp, recompute=recompute, progress=progress,
        schedules=schedules, attention=attention, sequence_parallel=sequence_parallel, fp8=fp8,
        fp8_params=fp8_params, top=top, balances=balances, context_parallel=context_parallel,
    )  # fmt: skip
    return found.plans, found.too_big


def sweep(
    model: ModelSpec,
    topology: Topology,
    *,
    global_batch: int,
    devices: int | None = None,
    placements: Sequence[str] = PLACEMENTS,
    config: StepConfig | None = None,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    zero_stages: Sequence[int] = (0, 1),
    max_tp: int | None = None,
    recompute: Sequence[str] = RECOMPUTE,
    progress: Callable[[int, int], None] | None = None,
    schedules: Sequence[tuple[str, int]] = SCHEDULES,
    attention: str = "unfused",
    sequence_parallel: bool | None = None,
    fp8: bool = False,
    fp8_params: bool = False,
    top: int | None = None,
    balances: Sequence[str | None] = (None,),
    context_parallel: Sequence[int] = (1,),
) -> Sweep:
    """Every layout that fits, under every placement, simulated and ranked fastest first. Each layout takes the
    first mode of ``recompute`` (activation recomputation, from :data:`~dtrain.sim.model.RECOMPUTE`) under which
    it fits; ``schedules``: the (pipeline schedule, chunks a stage) pairs tried for layouts with a pipeline;
    ``attention``, ``sequence_parallel``, ``fp8``, ``fp8_params``, ``balances`` and ``context_parallel`` as
    :func:`candidate_layouts` takes them.
    ``top``: the plans wanted; pairs whose lower bound shows they rank after the ``top``-th are not simulated
    (module docstring; None: every pair is). ``progress(done, total)`` after each pair, simulated or bounded."""
    if top is not None and top < 1:
        raise ValueError(f"top: plans wanted must be >= 1 or None (every plan), got {top!r}")
    config = config or StepConfig()
    if not recompute or any(mode not in RECOMPUTE for mode in recompute):
        raise ValueError(f"recompute modes {list(recompute)!r}: accepted: {', '.join(RECOMPUTE)} (at least one)")
    devices = devices or len(topology.devices())
    layouts = candidate_layouts(
        model, devices, global_batch, micro_batches=micro_batches, zero_stages=zero_stages, max_tp=max_tp,
        schedules=schedules, attention=attention, sequence_parallel=sequence_parallel, fp8=fp8,
        fp8_params=fp8_params, balances=balances, context_parallel=context_parallel,
    )  # fmt: skip
    if not layouts:
        raise ValueError(
            f"no layout of {model.name} fits the rules on {devices} devices with global batch {global_batch}: "
            f"check that the batch is a multiple of the data-parallel degrees and micro-batch sizes"
        )
    limit = config.memory_fraction * min(d.memory_bytes for d in topology.devices())
    fitting = []
    for lay in layouts:
        for mode in recompute:
            candidate = dataclasses.replace(lay, recompute=mode)
            if memory_per_device(model, candidate, config.kernels, eager=config.eager).total <= limit:
                fitting.append(candidate)
                break
    cache: dict = {}
    work = []
    placed: dict[tuple, tuple[str, ...]] = {}  # a placement depends on the degrees alone
    for lay in fitting:
        seen: set[tuple[str, ...]] = set()
        for how in placements:
            key = (how, lay.dp, lay.cp, lay.pp, lay.tp)
            if key not in placed:
                placed[key] = tuple(place(topology, lay, how))
            devices_used = placed[key]
            if devices_used not in seen:  # on one server every placement is the same: simulate it once
                seen.add(devices_used)
                work.append((lay, how, devices_used))
    if top is not None:  # bounds with the tensor-parallel replay (a few distinct ones: cached), lowest first
        bounds = [
            step_lower_bound(model, lay, topology, used, config,
                             tp_s=tensor_parallel_s(model, lay, topology, used, config, cache=cache))
            for lay, _, used in work
        ]  # fmt: skip
    else:
        bounds = [0.0] * len(work)
    # (bound, name, placement, refined, index): a pair whose bound is the lowest left is first refined (its pipeline
    # timed exactly with free messages) and goes back in line; once refined and still the lowest, it is simulated
    queue = [(bounds[i], lay.describe(), how, top is None, i) for i, (lay, how, _) in enumerate(work)]
    heapq.heapify(queue)
    plans: list[Plan] = []
    best: list[float] = []  # the ``top`` fastest steps so far, sorted
    bounded = 0
    while queue:
        bound, name, how, refined, i = heapq.heappop(queue)
        lay, _, devices_used = work[i]
        if top is not None and len(best) == top and bound > best[-1]:
            bounded = len(queue) + 1  # every pair left has a bound at least this one's
            break
        if not refined:
            tp_s = tensor_parallel_s(model, lay, topology, devices_used, config, cache=cache)
            exact = step_lower_bound(model, lay, topology, devices_used, config, tp_s=tp_s, exact_pipeline=True)
            heapq.heappush(queue, (max(bound, exact), name, how, True, i))
            continue
        result = simulate_step(model, lay, topology, devices_used, config, cache=cache)
        flops = flops_per_microbatch(model, lay) * lay.tp * lay.pp * lay.microbatches * lay.dp * lay.cp
        peak = sum(topology.device(d).peak_flops for d in devices_used)
        plans.append(Plan(layout=lay, placement=how, result=result, model_flops_per_step=flops, peak_flops=peak))
        if top is not None:
            best = sorted([*best, result.step_s])[:top]
        if progress is not None:
            progress(len(plans), len(work))
    if progress is not None and bounded:
        progress(len(work), len(work))
    plans.sort(key=lambda p: (p.result.step_s, p.layout.describe(), p.placement))
    return Sweep(plans=plans, too_big=len(layouts) - len(fitting), bounded=bounded, simulated=len(plans))
