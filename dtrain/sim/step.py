"""One training step of a ``dp x tp x pp`` layout simulated on a topology.

What each strategy sends mirrors :mod:`dtrain.parallel`:

- tensor parallel (Megatron-LM's ``f`` and ``g``, tensor_parallel_communications.py): two all-reduces of the
  layer's activation ``b s h`` in every layer's forward and two in its backward, in every tensor-parallel
  group; all groups at once, sharing the network;
- pipeline parallel (pipeline_parallel_communications.py): one activation forward and one gradient backward
  per micro-batch across each stage boundary, point to point between ranks of equal ``tp_rank``; the stages
  run the GPipe or 1F1B order of pipeline_schedules.py (:mod:`dtrain.sim.pipeline`);
- data parallel: an all-reduce of the stage's gradients in every data-parallel group. Without a pipeline
  (``pp == 1``, dtrain.train's DataParallel) it is bucketed and launched from backward hooks, so the buckets
  of the last micro-batch's backward overlap it (DDP's overlap, Li et al. 2020, section 3.2.3); with a
  pipeline (the hybrid's one all-reduce after the ``m`` micro-batches) it is not. With ZeRO (zero.py, which
  flattens the gradients at the step, so never overlapped) stage 1 all-reduces and all-gathers the updated
  shards, stage 2 reduce-scatters and all-gathers, stage 3 (dtrain.parallel.fsdp; the ZeRO paper's 1.5x
  volume) reduce-scatters and all-gathers the weights twice.

Every collective is a ``dtrain.comm`` schedule replayed on the placement (:mod:`dtrain.sim.traffic`).
Activation recomputation (``Layout.recompute``) adds its FLOPs to each backward, and under full recomputation
the forward's two tensor-parallel all-reduces a layer run again (:mod:`dtrain.sim.model`).
Compute is FLOPs over each device's peak times an efficiency; a straggler multiplies a rank's compute. The
step is synchronous: a tensor-parallel group runs at its slowest member, a pipeline at its stages' pace, and
the data-parallel all-reduce waits for the slowest replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dtrain.cluster.topology import Topology
from dtrain.sim.classes import DEFAULT_FLOW_LIMIT
from dtrain.sim.collective import CollectiveResult, SoftwareCost
from dtrain.sim.flows import LinkUsage
from dtrain.sim.model import (
    Layout,
    MemoryUse,
    ModelSpec,
    flops_per_microbatch,
    memory_per_device,
    recompute_flops_per_microbatch,
    tp_all_reduces_per_layer,
)
from dtrain.sim.pipeline import pipeline_makespan
from dtrain.sim.placement import group
from dtrain.sim.traffic import Cache, simulate_traffic

__all__ = ["StepConfig", "StepResult", "simulate_step", "exposed_bucket_s"]

#: Bytes an Adam step reads and writes per parameter it owns: 32-bit master weight, momentum and variance read
#: and written (24), the 16-bit gradient read and the 16-bit weight written (4).
ADAM_BYTES_PER_PARAMETER = 28


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How to simulate: ``efficiency`` of the compute kernels (achieved / peak FLOP/s), the algorithms of the
    tensor- and data-parallel collectives, software costs, the usable share of device memory, whether the
    data-parallel all-reduce overlaps backward where dtrain overlaps it (``overlap_dp``, in buckets of
    ``bucket_bytes``), and stragglers:
    ``slowdown`` fixes a factor on chosen ranks, ``straggler_sigma`` draws every rank's factor from a lognormal
    (median 1) each of ``samples`` steps. ``split_pipeline``: each tensor-parallel rank sends ``1/tp`` of a
    stage's activation and the next stage all-gathers it (Megatron-LM's scatter-gather; see
    :func:`dtrain.sim.traffic.simulate_traffic`); ``flow_limit``: messages a set of concurrent collectives may
    start before it is replayed in lock-step rounds (:func:`dtrain.sim.classes.replay_jobs`; None: never)."""

    efficiency: float = 0.5
    tp_algorithm: str = "ring"
    dp_algorithm: str = "ring"
    cost: SoftwareCost = field(default_factory=SoftwareCost)
    memory_fraction: float = 0.9
    overlap_dp: bool = True
    bucket_bytes: int = 25 * 2**20  # DataParallel's (DDP's) default bucket
    slowdown: dict[int, float] = field(default_factory=dict)
    straggler_sigma: float = 0.0
    samples: int = 16
    seed: int = 0
    split_pipeline: bool = False
    flow_limit: int | None = DEFAULT_FLOW_LIMIT

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if any(not f >= 1 for f in self.slowdown.values()):
            raise ValueError(f"slowdown factors must be >= 1 (a slower rank), got {self.slowdown!r}")
        if self.straggler_sigma < 0 or self.samples < 1:
            raise ValueError(
                f"straggler_sigma must be >= 0 and samples >= 1, got {self.straggler_sigma}, {self.samples}"
            )


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """A simulated step: its time (the median over straggler samples, with the 95th percentile), the parts
    of it, memory per device, and each link's load over the step."""

    step_s: float
    step_p95_s: float
    pipeline_s: float
    compute_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    dp_exposed_s: float
    optimizer_s: float
    bubble: float
    memory: MemoryUse
    memory_limit: float
    tokens_per_s: float
    links: list[LinkUsage] = field(repr=False)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit

    @property
    def bottleneck(self) -> LinkUsage | None:
        return self.links[0] if self.links else None


def _stage_times(
    model: ModelSpec,
    layout: Layout,
    topo: Topology,
    placement: list[str],
    factors: Sequence[float],
    config: StepConfig,
    tp_s: float,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per replica and stage, forward and backward seconds of one micro-batch: compute at the stage's slowest
    tensor-parallel rank (FLOPs split 1:2 between forward and backward, the recomputation's FLOPs added to
    backward), plus two tp all-reduces a layer each way (and two more in backward under full recomputation)."""
    flops = flops_per_microbatch(model, layout) / config.efficiency
    extra = recompute_flops_per_microbatch(model, layout) / config.efficiency
    layers = model.layers // layout.pp
    backward_all_reduces = tp_all_reduces_per_layer(layout) - 2
    forward, backward = [], []
    for d in range(layout.dp):
        fw, bw = [], []
        for p in range(layout.pp):
            ranks = group(layout, "tp", d, p, 0)
            slowest = max(factors[r] / topo.device(placement[r]).peak_flops for r in ranks)
            compute = flops * slowest
            fw.append(compute / 3 + 2 * layers * tp_s)
            bw.append(2 * compute / 3 + extra * slowest + backward_all_reduces * layers * tp_s)
        forward.append(fw)
        backward.append(bw)
    return forward, backward


def exposed_bucket_s(all_reduce_s: float, backward_s: float, gradient_bytes: float, bucket_bytes: int) -> float:
    """Seconds of a bucketed all-reduce left after backward ends: ``B`` equal buckets, bucket ``i`` ready
    ``(i + 1) / B`` of the way through backward, each all-reduced in ``all_reduce_s / B``, one after another
    in order (DataParallel launches them strictly in index order)."""
    buckets = max(1, math.ceil(gradient_bytes / bucket_bytes))
    done = 0.0
    for i in range(buckets):
        done = max(done, (i + 1) / buckets * backward_s) + all_reduce_s / buckets
    return max(0.0, done - backward_s)


def _factors(layout: Layout, config: StepConfig) -> list[list[float]]:
    """Per sampled step, every rank's slowdown factor."""
    fixed = [config.slowdown.get(r, 1.0) for r in range(layout.world_size)]
    if config.straggler_sigma == 0:
        return [fixed]
    rng = np.random.default_rng(config.seed)
    draws = rng.lognormal(0.0, config.straggler_sigma, size=(config.samples, layout.world_size))
    return [[f * x for f, x in zip(fixed, row, strict=True)] for row in draws]


def _step_links(parts: list[tuple[CollectiveResult | None, float]], step_s: float) -> list[LinkUsage]:
    """Each link's bytes over the step (each collective's bytes times its calls a step), busiest first."""
    totals: dict[str, tuple[object, float]] = {}
    for result, calls in parts:
        if result is None:
            continue
        for u in result.links:
            link, nbytes = totals.get(u.link.name, (u.link, 0.0))
            totals[u.link.name] = (link, nbytes + u.nbytes * calls)
    rows = [LinkUsage(link=link, nbytes=n, busy_s=0.0, total_s=step_s) for link, n in totals.values()]
    return sorted(rows, key=lambda u: (-u.utilisation, u.link.name))


def simulate_step(
    model: ModelSpec,
    layout: Layout,
    topology: Topology,
    placement: Sequence[str],
    config: StepConfig | None = None,
    *,
    cache: Cache | None = None,
) -> StepResult:
    """Simulate one synchronous training step of ``model`` under ``layout``, grid rank ``r`` on ``placement[r]``.

    ``cache`` (a dict kept by the caller) reuses collective replays between calls on the same, unchanged
    topology, as a planner's layouts share many of them."""
    config = config or StepConfig()
    layout.check(model)
    placement = list(placement)
    if len(placement) != layout.world_size:
        raise ValueError(f"placement names {len(placement)} devices for a layout of {layout.world_size} ranks")
    if any(r >= layout.world_size for r in config.slowdown):
        raise ValueError(f"slowdown names ranks {sorted(config.slowdown)} outside the {layout.world_size} ranks")
    traffic = simulate_traffic(
        model, layout, topology, placement, tp_algorithm=config.tp_algorithm, dp_algorithm=config.dp_algorithm,
        cost=config.cost, cache=cache, split_pipeline=config.split_pipeline, flow_limit=config.flow_limit,
    )  # fmt: skip
    tp, pp, dp, gather = traffic.tp, traffic.pp, traffic.dp, traffic.pp_gather
    tp_s = tp.time_s if tp else 0.0
    pp_s = (pp.time_s if pp else 0.0) + (gather.time_s if gather else 0.0)
    dp_s = sum(r.time_s for r in dp)
    memory = memory_per_device(model, layout)
    owned = model.parameters / (layout.tp * layout.pp) / (layout.dp if layout.zero_stage else 1)
    optimizer_s = max(owned * ADAM_BYTES_PER_PARAMETER / topology.device(d).memory_bytes_per_s for d in placement)
    m = layout.microbatches
    steps, pipelines, exposed_dp = [], [], []
    for factors in _factors(layout, config):
        forward, backward = _stage_times(model, layout, topology, placement, factors, config, tp_s)
        spans: dict[tuple, float] = {}  # replicas of equal stage times (all, without stragglers) share one makespan
        for f, b in zip(forward, backward, strict=True):
            if (key := (tuple(f), tuple(b))) not in spans:
                spans[key] = pipeline_makespan(f, b, pp_s, m, layout.schedule)
        slowest = max(spans.values())
        pipelines.append(slowest)
        exposed = dp_s
        if config.overlap_dp and layout.pp == 1 and layout.zero_stage == 0 and dp_s > 0:
            grads = model.parameters / layout.tp * model.bytes_per_value
            exposed = exposed_bucket_s(dp_s, max(b[0] for b in backward), grads, config.bucket_bytes)
        exposed_dp.append(exposed)
        steps.append(slowest + exposed + optimizer_s)
    step_s = float(np.median(steps))
    ideal_f, ideal_b = _stage_times(model, layout, topology, placement, [1.0] * layout.world_size, config, 0.0)
    compute_s = m * max(f + b for f, b in zip(ideal_f[0], ideal_b[0], strict=True))
    tp_count = tp_all_reduces_per_layer(layout) * (model.layers // layout.pp) * m
    parts = [(tp, tp_count), (pp, 2 * m), (gather, 2 * m)] + [(r, 1) for r in dp]
    return StepResult(
        step_s=step_s,
        step_p95_s=float(np.percentile(steps, 95)),
        pipeline_s=float(np.median(pipelines)),
        compute_s=compute_s,
        tp_s=tp_count * tp_s,
        pp_s=pp_s,
        dp_s=dp_s,
        dp_exposed_s=float(np.median(exposed_dp)),
        optimizer_s=optimizer_s,
        bubble=(layout.pp - 1) / (m + layout.pp - 1),
        memory=memory,
        memory_limit=config.memory_fraction * min(topology.device(d).memory_bytes for d in placement),
        tokens_per_s=layout.global_batch * model.sequence / step_s,
        links=_step_links(parts, step_s),
    )
