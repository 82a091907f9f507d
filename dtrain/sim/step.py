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
  flattens the gradients at the step, so not overlapped) stage 1 all-reduces and all-gathers the updated
  shards, stage 2 reduce-scatters and all-gathers, stage 3 (dtrain.parallel.fsdp; the ZeRO paper's 1.5x
  volume) reduce-scatters and all-gathers the weights twice. ``StepConfig.overlap_grad_reduce`` instead
  reduces in buckets under the last backward, with or without a pipeline, for ZeRO stages 0 to 2.

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
from dataclasses import dataclass, field, replace

import numpy as np

from dtrain.cluster.topology import Topology, collector_paused
from dtrain.comm.ir.algorithms import names as algorithm_names
from dtrain.comm.ir.schedule import Collective
from dtrain.parallel.pipeline_schedules import SPLIT_BACKWARD, theoretical_bubble
from dtrain.sim.classes import DEFAULT_FLOW_LIMIT
from dtrain.sim.collective import CollectiveResult, Job, SoftwareCost, _rank_rounds_cached
from dtrain.sim.compute import (
    ADAM_BYTES_PER_PARAMETER,
    ATTENTION_KERNELS,
    KERNELS,
    DeviceCompute,
    device_compute,
    layer_ops,
    optimizer_seconds,
    price,
    stage_compute,
)
from dtrain.sim.flows import LinkUsage, usage_rows
from dtrain.sim.model import (
    EAGER,
    EagerForm,
    Layout,
    MemoryUse,
    ModelSpec,
    chunk_flops,
    chunk_shares,
    context_view,
    flops_per_microbatch,
    head_stage,
    memory_per_device,
    recompute_flops_per_microbatch,
    stage_layers,
    stage_parameters,
    tp_all_reduces_per_layer,
)
from dtrain.sim.nccl import small_all_reduce_s
from dtrain.sim.pipeline import pipeline_chunk_edges, pipeline_makespan, pipeline_stage_spans
from dtrain.sim.placement import grid_rank, group
from dtrain.sim.traffic import (
    NCCL_RING,
    Cache,
    _build,
    _group_jobs,
    _groups,
    _padded,
    _replay,
    dp_phase_bytes,
    group_shape,
    simulate_traffic,
)

__all__ = [
    "AMAX_REDUCTIONS",
    "GROUP_ALGORITHMS",
    "StepConfig",
    "StepResult",
    "simulate_step",
    "stage_seconds",
    "exposed_bucket_s",
    "OVERLAP_GRAD_REDUCE_STAGES",
    "chunked_reduction_s",
    "step_lower_bound",
    "data_parallel_lower_bound",
    "pipeline_message_lower_bound",
    "tensor_parallel_s",
    "context_parallel_s",
    "tp_overlap_s",
    "UB_NAMES",
    "UB_OVERLAPS",
    "UB_PIPELINE_SPLITS",
    "UB_STREAMS",
]


#: What a group's collectives may run (:attr:`StepConfig.tp_algorithm`, :attr:`StepConfig.dp_algorithm`): NCCL's
#: rail-aligned rings or a ``dtrain.comm`` all-reduce algorithm.
GROUP_ALGORITHMS = (NCCL_RING, *algorithm_names(Collective.ALL_REDUCE))
#: How Transformer Engine's FP8 amax reduction runs (:attr:`StepConfig.amax_reduction`).
AMAX_REDUCTIONS = ("none", "synchronous")


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How to simulate: compute priced per operation (:mod:`dtrain.sim.compute`; ``curves``: measured efficiency
    curves by device key, default the package's file) or, with ``efficiency`` set, the step's FLOPs at that share
    of each device's peak; ``overlap_tp_backward``: the input-gradient tensor-parallel collective of each
    column-parallel product runs under its weight-gradient product (Megatron-LM's asynchronous all-reduce, or
    reduce-scatter under sequence parallelism); the algorithms of the tensor- and data-parallel collectives
    (``dp_algorithm`` default :data:`dtrain.sim.traffic.NCCL_RING`, NCCL's rail-aligned rings, one a GPU of the
    group on each server), software costs, the usable share of device memory, whether the
    data-parallel all-reduce overlaps backward where dtrain overlaps it (``overlap_dp``, in buckets of
    ``bucket_bytes``), and stragglers:
    ``slowdown`` fixes a factor on chosen ranks, ``straggler_sigma`` draws every rank's factor from a lognormal
    (median 1) each of ``samples`` steps. ``split_pipeline``: each tensor-parallel rank sends ``1/tp`` of a
    stage's activation and the next stage all-gathers it (Megatron-LM's scatter-gather; see
    :func:`dtrain.sim.traffic.simulate_traffic`); ``synchronous_p2p``: each pipeline exchange blocks both stages
    and the gather of a split activation runs on the receiver's compute stream (Megatron-LM's ``_communicate``:
    ``batch_isend_irecv``, wait, ``torch.cuda.synchronize()``; :func:`dtrain.sim.pipeline.pipeline_makespan`),
    otherwise a message only delays its receiver; ``paired_exchanges``: interleaved 1F1B's steady state sends a
    forward's output together with the next backward's gradient, after that backward (Megatron-LM's interleaved
    schedule; :func:`dtrain.sim.pipeline.pipeline_makespan`); ``flow_limit``: messages a set of concurrent
    collectives may start before it is replayed in lock-step rounds (:func:`dtrain.sim.classes.replay_jobs`;
    None: never);
    ``tied_embedding_allreduce``: with a pipeline, the first and last stages all-reduce the gradient of the word
    embedding they share with the output layer after the data-parallel all-reduce (Megatron-LM's
    ``allreduce_word_embedding_grads``; the tied input and output embedding of GPT, Press and Wolf 2017), counted
    in ``dp_exposed_s``; ``optimizer_bytes``: bytes the optimizer step moves per parameter a rank owns (default
    :data:`dtrain.sim.compute.ADAM_BYTES_PER_PARAMETER`, a fused Adam; see
    :data:`dtrain.sim.compute.MEGATRON_FP16_OPTIMIZER_BYTES`); ``gradient_bytes``: bytes a gradient value takes
    in the data-parallel reduction and the tied embedding's all-reduce (default None: the model's
    ``bytes_per_value``; 4 for an optimizer that accumulates and reduces 32-bit gradients, DeepSpeed's
    ``BF16_Optimizer``, or Megatron-LM's ``--accumulate-allreduce-grads-in-fp32``; see
    :func:`dtrain.sim.traffic.dp_phase_bytes`); ``overlap_sharded_dp``: with ZeRO stage 1 and no pipeline, the
    gradients' reduce-scatter runs under backward in buckets and the weights' all-gather under the next forward
    (Megatron-Core's distributed optimizer with ``--overlap-grad-reduce --overlap-param-gather``), priced as
    ``overlap_dp`` prices the all-reduce of the same bytes; ``distributed_optimizer``: ZeRO stage 1 reduce-scatters
    the gradients instead of all-reducing them (Megatron-Core's distributed optimizer; see
    :func:`dtrain.sim.traffic.dp_phase_bytes`); ``overlap_grad_reduce``: Megatron-Core's ``--overlap-grad-reduce``
    with any pipeline (takes the place of ``overlap_dp`` and ``overlap_sharded_dp``; stage 0, 1 or 2 of ZeRO, whose
    reduction is an all-reduce or a reduce-scatter; stage 3's collectives stay after the pipeline): each
    stage's gradient reduction starts during its last micro-batch's backward, the pipeline schedule keeping it
    off (``no_sync``) for the others, bucket by bucket on the first stage and in one bucket on the others, so
    what a stage leaves exposed is what remains after its last backward less the time it waits for the pipeline's
    end (:func:`overlapped_reduction_s`); ``overlap_param_gather``: Megatron-Core's ``--overlap-param-gather``,
    the distributed optimizer's all-gather of the updated weights runs under the next step's first forward of
    each stage, bucket by bucket on the first stage, whole before its first forward on the others; without it the
    all-gather is exposed. ``tp_comm_overlap``: under sequence parallelism, the tensor-parallel all-gathers and
    reduce-scatters run in chunks under the products beside them, as Megatron-Core's ``--tp-comm-overlap`` runs
    them with Transformer Engine's userbuffers (:func:`tp_overlap_s`); ignored for a layout without sequence
    parallelism, which Megatron-Core requires for it. ``overlap_p2p_comm``: interleaved 1F1B's pipeline exchanges
    posted after each action and waited for before the stage's next action of the same kind, so they run under the
    compute between (Megatron-Core's ``overlap_p2p_comm``, on by default with an interleaved schedule; it takes the
    place of ``synchronous_p2p`` and ``paired_exchanges`` there; :func:`dtrain.sim.pipeline.pipeline_makespan`);
    other schedules ignore it, as Megatron-LM's ``validate_args`` turns it off without one. ``kernels``: how the
    layer's element-wise work runs (:data:`dtrain.sim.compute.KERNELS`): ``"fused"``, or ``"megatron-lm"``, the
    kernels of Megatron-LM's layer of 2021-2022 (QKV's bias added apart, the fused causal softmax, the 32-bit
    cross-entropy; :func:`dtrain.sim.compute.layer_ops`), or ``"dtrain"``, dtrain.models' eager layer.
    ``eager`` (``"dtrain"`` kernels only, :class:`dtrain.sim.model.EagerForm`): whether attention and the MLP cast
    their input once and, under tensor parallelism, sum its gradient over the group once a part in 16 bits, as
    dtrain.models' parts do (``tensor_parallel_shared_input``), or each projection its own in 32 bits, as
    :func:`dtrain.parallel.parallelize.tensor_parallelize` runs a model whose parts do not declare it; and whether
    the attention repeats grouped-query keys and values to every head.
    ``grad_accumulation_fusion``: each weight-gradient
    product adds into the 32-bit gradient itself, with no pass of its own (Megatron-LM's
    ``--gradient-accumulation-fusion``, on by default where gradients accumulate in 32 bits: Megatron-Core, and
    Megatron-LM with ``--bf16``). With interleaved 1F1B,
    ``overlap_grad_reduce`` and ``overlap_param_gather`` work per model chunk (:func:`chunked_reduction_s`):
    Megatron-Core keeps one ``DistributedDataParallel`` a chunk, reduces each chunk's gradients once its last
    backward is done and gathers each chunk's weights before its first forward. ``contention``: communication
    overlapped with compute slows the products it runs beside, by what ``dtrain bench overlap`` measured on the
    device (:meth:`dtrain.sim.compute.DeviceCompute.beside_s`; "network" for a data-parallel group spread over
    servers, else "nvlink"): the data-parallel reduction and gather where they run while the stage computes, and
    the tensor-parallel collectives NCCL runs under the weight and input gradients (not Transformer Engine's
    userbuffers pieces, whose kernels are not NCCL's and are not measured). The tensor-parallel part lengthens
    each backward; the data-parallel part, the largest over stages, is added to the step as ``contention_s``.
    False, or a device without a measurement: overlapped communication costs the compute nothing.
    ``ub_sm_margin``: (overlap, multiprocessors) pairs of a ``--tp-comm-overlap-cfg`` file's ``set_sm_margin: 1``
    entries (Transformer Engine's names, :data:`UB_NAMES`): that product runs on the device's multiprocessors less
    the overlap's ``num_sm``, which its communication kernel holds (``transformer_engine/pytorch/module/base.py``,
    ``initialize_ub``; the GEMM's ``sm_count`` target); none by default, as ``initialize_ub``'s own settings.
    ``amax_reduction`` (FP8 layouts, :data:`AMAX_REDUCTIONS`): ``"synchronous"``, Transformer Engine's all-reduce
    of the FP8 tensors' amaxes over the stage's tensor- and data-parallel ranks (Megatron's amax reduction group)
    as each model chunk's forward ends and as its backward ends, waited for on the compute stream: the recipe's
    ``reduce_amax`` with ``NVTE_DP_AMAX_REDUCE_INTERVAL`` at its default of 1 and ``NVTE_ASYNC_AMAX_REDUCTION``
    unset (Transformer Engine release_v0.8: ``fp8_autocast``'s exit and ``_prepare_backward`` call
    ``global_amax_reduction``, ``all_reduce(async_op=False)``), each priced at NCCL's latency for a call of a few
    bytes (:func:`dtrain.sim.nccl.small_all_reduce_s`); ``"none"``, the default: not priced, as where the
    reduction runs over the tensor-parallel ranks alone and asynchronously (``NVTE_DP_AMAX_REDUCE_INTERVAL=0``,
    ``NVTE_ASYNC_AMAX_REDUCTION=1``) or the layers are not FP8. The amax bookkeeping's own small kernels are
    not priced either way. ``attention_kernel``: the fused attention kernel's family
    (:data:`dtrain.sim.compute.ATTENTION_KERNELS`: ``"cudnn"``, ``"fa2"``, ``"fa1"``), priced beside the family
    the device's curves measured (:class:`dtrain.sim.compute.DeviceCompute`); None, the default: that family.

    Megatron-Core r0.8.0 (``megatron/core/distributed/distributed_data_parallel.py``): buckets of
    ``max(40,000,000, 1,000,000 x dp)`` parameters, bucketing off on every pipeline stage but the first ("data-
    parallel communication on these stages is not on the critical path"); a bucket's reduction is launched by
    ``param_and_grad_buffer.py`` once every gradient of the bucket is ready; ``pipeline_parallel/schedules.py``
    enables the gradient sync (``config.grad_sync_func``, ``no_sync_func``) only for the last micro-batch's
    backward.
    """

    efficiency: float | None = None
    tp_algorithm: str = "ring"
    dp_algorithm: str = NCCL_RING
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
    curves: dict | None = field(default=None, compare=False)
    overlap_tp_backward: bool = True
    synchronous_p2p: bool = False
    paired_exchanges: bool = False
    tied_embedding_allreduce: bool = False
    optimizer_bytes: int = ADAM_BYTES_PER_PARAMETER
    gradient_bytes: int | None = None
    overlap_sharded_dp: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    overlap_p2p_comm: bool = False
    kernels: str = "fused"
    eager: EagerForm = EAGER
    grad_accumulation_fusion: bool = False
    contention: bool = True
    ub_sm_margin: tuple[tuple[str, int], ...] = ()
    amax_reduction: str = "none"
    attention_kernel: str | None = None

    def __post_init__(self) -> None:
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1] or None (priced per operation), got {self.efficiency!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if any(not f >= 1 for f in self.slowdown.values()):
            raise ValueError(f"slowdown factors must be >= 1 (a slower rank), got {self.slowdown!r}")
        for name in ("tp_algorithm", "dp_algorithm"):
            if getattr(self, name) not in GROUP_ALGORITHMS:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {', '.join(GROUP_ALGORITHMS)}")
        if self.gradient_bytes is not None and self.gradient_bytes not in (2, 4):
            raise ValueError(f"gradient_bytes must be 2, 4 or None (the model's), got {self.gradient_bytes!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels {self.kernels!r} is not one of {', '.join(KERNELS)}")
        if self.attention_kernel is not None and self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"attention_kernel {self.attention_kernel!r} is not one of {', '.join(ATTENTION_KERNELS)} or None"
            )
        if self.amax_reduction not in AMAX_REDUCTIONS:
            raise ValueError(f"amax_reduction {self.amax_reduction!r} is not one of {', '.join(AMAX_REDUCTIONS)}")
        bad = [name for name, sms in self.ub_sm_margin if name not in UB_NAMES or sms < 0]
        if bad:
            raise ValueError(
                f"ub_sm_margin: {', '.join(map(str, bad))}: each entry is a userbuffers overlap of "
                f"{', '.join(UB_NAMES)} and a count of multiprocessors, 0 or more"
            )
        if self.optimizer_bytes < 1:
            raise ValueError(f"optimizer_bytes must be >= 1 (bytes a parameter), got {self.optimizer_bytes!r}")
        if self.straggler_sigma < 0 or self.samples < 1:
            raise ValueError(
                f"straggler_sigma must be >= 0 and samples >= 1, got {self.straggler_sigma}, {self.samples}"
            )


def _compute(peak_flops: float, memory_bytes_per_s: float, config: StepConfig) -> DeviceCompute:
    """The compute model of a device of that peak and memory rate under ``config``'s curves and attention kernel."""
    return device_compute(
        peak_flops, memory_bytes_per_s, curves=config.curves, attention_kernel=config.attention_kernel
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
    #: the share of the pipeline's span the slowest stage spends idle, as simulated: ``1 - compute_s / pipeline_s``
    bubble: float
    memory: MemoryUse
    memory_limit: float
    tokens_per_s: float
    links: list[LinkUsage] = field(repr=False)
    contention_s: float = 0.0  # compute a step loses to data-parallel communication beside it (StepConfig)
    #: the theory's bubble for this schedule's shape (equal stages, free messages): ``(p - 1) / (v m + p - 1)``, and
    #: for ZB-H1 and ZB-V Qi et al.'s with the stages' mean forward, input- and weight-gradient times
    bubble_theory: float = 0.0
    #: seconds a step's slowest stage waits for FP8 amax reductions (:attr:`StepConfig.amax_reduction`): one after
    #: each model chunk's forward and one after its backward, ``2 m v`` a step; ``bubble`` counts them as idle time
    amax_s: float = 0.0
    #: seconds of one context-parallel ring pass: a micro-batch's keys and values of one layer round every
    #: context-parallel group at once (:func:`context_parallel_s`; 0 without context parallelism)
    cp_s: float = 0.0

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
    cp_s: float = 0.0,
) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Per replica and stage, forward, backward and weight-gradient seconds of one micro-batch at the stage's
    slowest tensor-parallel rank, its tensor- and context-parallel exchanges included (:func:`stage_seconds`). The
    weight gradient is apart only for the schedules that split backward (ZB-H1, ZB-V); otherwise it is 0 and
    inside backward."""
    forward, backward, weight = [], [], []
    costs: dict[tuple, tuple[float, float, float]] = {}
    kinds = [(dev.peak_flops, dev.memory_bytes_per_s) for dev in map(topo.device, placement)]
    if len(set(kinds)) == 1 and all(f == 1.0 for f in factors):  # every replica alike: price one, copy it
        alike = {
            q: stage_seconds(model, layout, q, *kinds[0], config, tp_s, cp_s)
            for q in {_alike(p, layout) for p in range(layout.pp)}
        }
        fw, bw, ww = zip(*(alike[_alike(p, layout)] for p in range(layout.pp)), strict=True)
        return (
            [list(fw) for _ in range(layout.dp)],
            [list(bw) for _ in range(layout.dp)],
            [list(ww) for _ in range(layout.dp)],
        )
    for d in range(layout.dp):
        fw, bw, ww = [], [], []
        for p in range(layout.pp):
            ranks = group(layout, "tp", d, p, 0)
            worst = None
            for r in ranks:
                key = (*kinds[r], _alike(p, layout))
                if key not in costs:
                    costs[key] = stage_seconds(model, layout, key[2], *kinds[r], config, tp_s, cp_s)
                f, b, w = (x * factors[r] for x in costs[key])
                if worst is None or f + b + w > sum(worst):
                    worst = (f, b, w)
            fw.append(worst[0])
            bw.append(worst[1])
            ww.append(worst[2])
        forward.append(fw)
        backward.append(bw)
        weight.append(ww)
    return forward, backward, weight


def _alike(stage: int, layout: Layout) -> int:
    """The stage priced for ``stage``: the first and last stages are their own (embedding, logits and loss), every
    stage between runs the same layers as stage 1 (:func:`dtrain.sim.compute.stage_ops`), but under ``dtrain
    train``'s cut (``layout.balance``), whose stages hold their own block counts."""
    if layout.balance is not None:
        return stage
    return stage if stage in (0, layout.pp - 1) else 1


def stage_seconds(
    model: ModelSpec,
    layout: Layout,
    stage: int,
    peak_flops: float,
    memory_bytes_per_s: float,
    config: StepConfig,
    tp_s: float,
    cp_s: float = 0.0,
) -> tuple[float, float, float]:
    """Forward, backward and weight-gradient seconds of one micro-batch on ``stage`` of a device of
    ``peak_flops`` and ``memory_bytes_per_s``, each with its tensor-parallel collectives of ``tp_s`` a call and,
    for a context-parallel rank's view (:func:`dtrain.sim.model.context_view`), its ring passes of ``cp_s`` a
    layer (:func:`context_parallel_s`): the forward's attention waits at each of the ring's ``cp - 1`` steps for
    the next shard's keys and values, which come while it works on the shard in hand, so a step shows only what
    its share of the pass takes beyond its kernel (``cp_s / (cp - 1)`` against a ``cp``-th of the layer's
    attention); the backward passes keys and values and their gradients, twice the bytes, beside its attention
    kernels the same way; full recomputation runs the forward's pass again (Transformer Engine's
    ``AttnFuncWithCPAndKVP2P``, Megatron-Core's ``cp_comm_type`` "p2p").

    Collectives a layer: two forward (the all-reduces after attention and MLP, or their all-gather and
    reduce-scatter pairs under sequence parallelism), two backward, two more under full recomputation, one more
    forward on the first stage (the vocabulary-parallel embedding's all-reduce). They are on the critical path
    (the next product needs their result), except each backward one where ``overlap_tp_backward``: it runs
    under the weight gradient of QKV or the MLP's first product and only what is longer shows. Under sequence
    parallelism the backward runs other collectives than plain tensor parallelism's (Korthikanti et al. 2022,
    section 4.2.2; Megatron-LM ``tensor_parallel/mappings.py`` and ``layers.py``,
    ``LinearWithGradAccumulationAndAsyncCommunication``): the reduce-scatter after attention and after the MLP
    has an all-gather for its backward, which the row-parallel product's input gradient waits for (on the
    critical path, twice a layer); the all-gather before QKV and the MLP's first product has a reduce-scatter
    for its backward, under the weight gradient as above; and the weight gradient needs the all-gathered input
    again, which is not kept but gathered once more under the input gradient's product (only what is longer
    shows). Each all-gather and reduce-scatter takes half the all-reduce's ``tp_s`` (a ring all-reduce is a
    reduce-scatter then an all-gather). With ``config.tp_comm_overlap`` under sequence parallelism (Megatron-Core's
    ``--tp-comm-overlap``, Transformer Engine's userbuffers) the forward's two all-gathers and two reduce-scatters a
    layer, the recomputed forward's, and the backward's two all-gathers before the row-parallel products' input
    gradients run in chunks under those products (:data:`UB_OVERLAPS`, :func:`tp_overlap_s`), and the backward's
    other collectives under the products beside them as with ``overlap_tp_backward``. With
    ``config.efficiency`` set, compute is the FLOPs of :func:`flops_per_microbatch` at that share of peak, split
    1:2 between forward and backward, recomputation's FLOPs added to backward."""
    layers = stage_layers(model, layout, stage)
    split = layout.schedule in SPLIT_BACKWARD
    recompute_calls = 2 if layout.recompute == "full" else 0
    sequence_parallel = layout.sequence_parallel and layout.tp > 1
    userbuffers = config.tp_comm_overlap and sequence_parallel and tp_s > 0
    if config.efficiency is not None:
        share = layers * layout.pp / model.layers  # the stage's layers over an even split's
        flops = share * flops_per_microbatch(model, layout) / config.efficiency / peak_flops
        extra = share * recompute_flops_per_microbatch(model, layout) / config.efficiency / peak_flops
        forward_tp, backward_tp = 2 * tp_s, (2 + recompute_calls) * tp_s
        if userbuffers:
            overlapped = _flat_overlapped(model, layout, config.efficiency * peak_flops)
            sms = _compute(peak_flops, memory_bytes_per_s, config).sms
            forward_tp, row_tp = _userbuffers_s(overlapped, tp_s, config, sms)
            backward_tp = row_tp + tp_s + (forward_tp if recompute_calls else 0.0)
        b, w = 2 * flops / 3 + extra, 0.0
        if split:
            b, w = flops / 3 + extra, flops / 3
        ring_f, ring_b = _ring_exposed(model, layout, cp_s, lambda op: op.flops / (config.efficiency * peak_flops))
        return flops / 3 + layers * (forward_tp + ring_f), b + layers * (backward_tp + ring_b), w
    forward_s, backward_s, weight_s, wgrads, dgrads, overlapped = _priced(
        model, layout, stage, peak_flops, memory_bytes_per_s, config
    )
    embedding_calls = 1 if stage == 0 and model.vocab and layout.tp > 1 else 0
    forward_tp, row_tp = 2 * tp_s, tp_s
    if userbuffers:
        sms = _compute(peak_flops, memory_bytes_per_s, config).sms
        forward_tp, row_tp = _userbuffers_s(overlapped, tp_s, config, sms)
    forward = forward_s + layers * forward_tp + embedding_calls * tp_s
    overlap = (config.overlap_tp_backward or userbuffers) and not split and tp_s > 0
    hidden = 0.0  # a layer's NCCL collectives that run under its products
    if sequence_parallel:
        half = tp_s / 2
        under_weight = half if not overlap else sum(max(0.0, half - w) for w in wgrads) / max(1, len(wgrads))
        under_input = half if not overlap else sum(max(0.0, half - d) for d in dgrads) / max(1, len(dgrads))
        layer_tp = row_tp + 2 * (under_weight + under_input)
        hidden = 2 * (tp_s - under_weight - under_input)
    else:
        exposed = tp_s
        if overlap:
            exposed = sum(max(0.0, tp_s - w) for w in wgrads) / max(1, len(wgrads))
        calls = 2
        if config.kernels == "dtrain":
            # dtrain.models' attention and MLP each sum their column-parallel projections' input gradient over the
            # group once (tensor_parallel_shared_input), in 16 bits (the input cast once); else each projection its
            # own (q, k, v, and gate and up, or up alone for GPT-2), in 32 bits: twice the 16-bit bytes
            calls = 2 if config.eager.shared_inputs else 2 * (5 if model.gated_mlp else 4)
        layer_tp = calls * exposed
        hidden = calls * (tp_s - exposed)
    if config.contention and not userbuffers and hidden > 0:
        device = _compute(peak_flops, memory_bytes_per_s, config)
        layer_tp += device.beside_s(hidden, "nvlink", fp8=layout.fp8)
    recomputed_tp = (forward_tp if userbuffers else recompute_calls * tp_s) if recompute_calls else 0.0
    device = _compute(peak_flops, memory_bytes_per_s, config)
    ring_f, ring_b = _ring_exposed(model, layout, cp_s, lambda op: price(op, device))
    forward += layers * ring_f
    backward_s += layers * ring_b
    backward = backward_s + (layer_tp + recomputed_tp) * layers
    if split:
        return forward, backward, weight_s
    return forward, backward + weight_s, 0.0


def _ring_exposed(model: ModelSpec, layout: Layout, cp_s: float, seconds) -> tuple[float, float]:
    """Seconds of a layer's forward and backward a context-parallel rank waits for its ring (:func:`stage_seconds`;
    the forward's again in backward under full recomputation): the ring's step ``i`` (``cp_s / (cp - 1)``, twice
    that in backward) runs beside the pass's kernel ``i`` on the shard in hand, the rank's own first, and shows what
    it takes beyond it, for ``i`` from 0 to ``cp - 2`` (``seconds(op)`` prices a kernel)."""
    ring = model.context_shards
    if ring == 1 or cp_s <= 0:
        return 0.0, 0.0
    step = cp_s / (ring - 1)
    kernels = [op for op in layer_ops(model, layout) if op.kind == "attention"]
    exposed = {
        phase: sum(max(0.0, bytes_ * step - seconds(op)) for op in [k for k in kernels if k.phase == phase][:-1])
        for phase, bytes_ in (("F", 1), ("B", 2))
    }
    return exposed["F"], exposed["B"] + (exposed["F"] if layout.recompute == "full" else 0.0)


#: Transformer Engine's userbuffers overlaps under Megatron-Core's ``--tp-comm-overlap``, as ``initialize_ub``
#: sets them up by default (``transformer_engine/pytorch/module/base.py``, ``methods``; Megatron-Core passes no
#: configuration of its own unless ``--tp-comm-overlap-cfg``): (product, phase, method). ``"ring"``: the product's
#: sequence-parallel input (or, in backward, its output gradient) all-gathered as a ring exchange of ``tp``
#: chunks, each chunk's product running while the next chunk comes from the neighbour (``qkv_fprop``,
#: ``fc1_fprop``, ``proj_dgrad``, ``fc2_dgrad``); ``"pipeline"``: the product split into
#: :data:`UB_PIPELINE_SPLITS` chunks, each chunk's output reduce-scattered under the next chunk's product
#: (``proj_fprop``, ``fc2_fprop``). The ``"bulk"`` overlaps (``qkv_dgrad``, ``qkv_wgrad``, ``fc1_dgrad``,
#: ``fc1_wgrad``: the input's all-gather under the input gradient, the input gradient's reduce-scatter under the
#: weight gradient) are the ones Megatron-LM runs without userbuffers too (:func:`stage_seconds`).
UB_OVERLAPS = (
    ("qkv", "F", "ring"),
    ("attention-out", "F", "pipeline"),
    ("mlp-in", "F", "ring"),
    ("mlp-out", "F", "pipeline"),
    ("attention-out", "B", "ring"),
    ("mlp-out", "B", "ring"),
)
#: Transformer Engine's name of each overlap of :data:`UB_OVERLAPS`, in its order (the keys of a
#: ``--tp-comm-overlap-cfg`` file and of :attr:`StepConfig.ub_sm_margin`).
UB_NAMES = ("qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_fprop", "proj_dgrad", "fc2_dgrad")
#: ``num_splits`` of a ``"pipeline"`` overlap in ``initialize_ub``'s defaults.
UB_PIPELINE_SPLITS = 4
#: Compute streams the pieces of an overlapped product take turns on (``_NUM_MAX_UB_STREAMS``).
UB_STREAMS = 3


def tp_overlap_s(
    whole_s: float, alone_s: float, concurrent_s: float, chunks: int, collective_s: float, method: str
) -> float:
    """Seconds a product of ``whole_s`` (unsplit) and its collective of ``collective_s`` (unsplit, on its own) add
    to the product alone when the product runs as ``chunks`` pieces overlapped as Transformer Engine's userbuffers
    overlap them (:data:`UB_OVERLAPS`; the decomposition of Wang et al. 2023, "Overlap Communication with
    Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS). A piece takes ``alone_s`` on
    its own and ``concurrent_s`` of the device's time when :data:`UB_STREAMS` pieces run at once (Transformer
    Engine launches piece ``i`` on compute stream ``i mod 3``, so pieces whose inputs are there share the
    multiprocessors; the device dispatches their tiles in launch order, so they finish in order).

    - ``"ring"`` (all-gather, ``chunks`` = tp; ``comm_gemm_overlap``'s ``split_overlap_ag``): the first piece is
      the rank's own and its product starts at once; each of the ``chunks - 1`` exchanges with the neighbours
      (``collective_s / (chunks - 1)``, a ring step) runs under the products before it, each piece's product
      waiting for its exchange: at least every piece at the concurrent rate, and at least every exchange then the
      last piece alone: ``max(chunks x concurrent_s, (chunks - 1) step + alone_s)``;
    - ``"pipeline"`` (reduce-scatter; ``split_overlap_rs``): the pieces' products need nothing and run at the
      concurrent rate, piece ``i`` done at ``(i + 1) concurrent_s``; each piece's reduce-scatter
      (``collective_s / chunks``) starts when its product is done and the one before it ends, and the last one
      runs after every product.

    With pieces priced in proportion to their rows (``concurrent_s = alone_s = whole_s / chunks``) the result is
    the collective's exposed part: none for a ring whose steps are shorter than a piece's product, the last
    piece's reduce-scatter for a pipeline whose pieces are longer than their reduce-scatters."""
    if chunks < 2:
        raise ValueError(f"tp_overlap_s: chunks must be >= 2, got {chunks}")
    if method == "ring":
        total = max(chunks * concurrent_s, collective_s + alone_s)
    elif method == "pipeline":
        step, total = collective_s / chunks, 0.0
        for i in range(chunks):
            total = max(total, (i + 1) * concurrent_s) + step
    else:
        raise ValueError(f"tp_overlap_s: method must be 'ring' or 'pipeline', got {method!r}")
    return total - whole_s


def _userbuffers_s(
    overlapped: Sequence[tuple[float, float, float, int]], tp_s: float, config: StepConfig, sms: int
) -> tuple[float, float]:
    """A layer's forward seconds beyond its products for its four overlapped collectives, and its backward's for
    the row-parallel products' all-gathers (:data:`UB_OVERLAPS`, each collective half the all-reduce's
    ``tp_s``). A product that ``config.ub_sm_margin`` keeps off some of the device's ``sms`` multiprocessors runs
    its pieces ``sms / (sms - margin)`` times longer; the difference shows as the overlap's."""
    forward = backward = 0.0
    margins = dict(config.ub_sm_margin)
    for name, (_, phase, method), (whole, alone, concurrent, chunks) in zip(
        UB_NAMES, UB_OVERLAPS, overlapped, strict=True
    ):
        slower = sms / max(1, sms - margins.get(name, 0))
        added = tp_overlap_s(whole, slower * alone, slower * concurrent, chunks, tp_s / 2, method)
        if phase == "F":
            forward += added
        else:
            backward += added
    return forward, backward


def _overlapped_ops(model: ModelSpec, layout: Layout) -> list[tuple[object, int]]:
    """Each product of :data:`UB_OVERLAPS` of one layer, with its chunk count."""
    ops = {(op.name, op.phase): op for op in layer_ops(model, layout) if op.kind == "matmul"}
    return [(ops[name, phase], layout.tp if method == "ring" else UB_PIPELINE_SPLITS)
            for name, phase, method in UB_OVERLAPS]  # fmt: skip


def _flat_overlapped(model: ModelSpec, layout: Layout, flops_per_s: float) -> list[tuple[float, float, float, int]]:
    """:data:`UB_OVERLAPS`' products priced at ``flops_per_s``: (whole, alone, concurrent, chunks) seconds."""
    out = []
    for op, n in _overlapped_ops(model, layout):
        whole = op.total_flops / flops_per_s
        out.append((whole, whole / n, whole / n, n))
    return out


#: Priced stages by (model, layout, stage, peak, memory rate, curves' identity): a planner prices each stage of a
#: layout for its bounds and its simulation alike. Each entry keeps its curves, so an identity is never reused.
_PRICED: dict[tuple, tuple[object, tuple]] = {}


def _priced(
    model: ModelSpec, layout: Layout, stage: int, peak_flops: float, memory_bytes_per_s: float, config: StepConfig
) -> tuple[float, float, float, tuple[float, ...], tuple[float, ...], tuple[tuple[float, float, int], ...]]:
    """Forward, backward and weight-gradient compute seconds of one micro-batch of ``stage``
    (:func:`dtrain.sim.compute.stage_compute`), the weight-gradient and input-gradient seconds of the
    column-parallel products of one layer, and for each product of :data:`UB_OVERLAPS` under sequence
    parallelism its seconds whole, one piece's alone (the product on ``1 / chunks`` of its rows, rounded up), one
    piece's share of :data:`UB_STREAMS` pieces at once (priced as one product of their rows), and its pieces."""
    key = (model, layout, stage, peak_flops, memory_bytes_per_s, id(config.curves), config.kernels,
           config.grad_accumulation_fusion, config.eager, config.attention_kernel)  # fmt: skip
    found = _PRICED.get(key)
    if found is not None and found[0] is config.curves:
        return found[1]
    device = _compute(peak_flops, memory_bytes_per_s, config)
    # dtrain train's default (grad_accumulation_fusion "auto") adds a pipeline's weight gradients inside the
    # products from the second micro-batch on, with ZeRO 0 or 1
    fused = config.grad_accumulation_fusion or (
        config.kernels == "dtrain" and layout.pp > 1 and layout.zero_stage in (0, 1)
    )
    work = stage_compute(model, layout, stage, device, config.kernels, fused_accumulation=fused,
                         eager=config.eager)  # fmt: skip
    ops = [op for op in layer_ops(model, layout) if op.name in _COLUMN]
    wgrads = tuple(price(op, device) for op in ops if op.phase == "W")
    dgrads = tuple(price(op, device) for op in ops if op.phase == "B")
    overlapped = ()
    if layout.sequence_parallel and layout.tp > 1:
        pieces = []
        for op, n in _overlapped_ops(model, layout):
            rows, streams = -(-op.m // n), min(UB_STREAMS, n)
            alone = price(replace(op, m=rows), device)
            pieces.append((price(op, device), alone, price(replace(op, m=streams * rows), device) / streams, n))
        overlapped = tuple(pieces)
    if len(_PRICED) > 65536:
        _PRICED.clear()
    _PRICED[key] = (config.curves, (work.forward_s, work.backward_s, work.weight_s, wgrads, dgrads, overlapped))
    return _PRICED[key][1]


#: The column-parallel products whose input gradient's collective can run under their weight gradient.
_COLUMN = ("qkv", "mlp-in")


def _optimizer_s(owned: float, device, config: StepConfig) -> float:
    """A fused Adam step over ``owned`` parameters: at the memory's full rate under a flat ``efficiency``,
    else at its bandwidth efficiency (:func:`dtrain.sim.compute.optimizer_seconds`)."""
    if config.efficiency is not None:
        return owned * config.optimizer_bytes / device.memory_bytes_per_s
    compute = _compute(device.peak_flops, device.memory_bytes_per_s, config)
    return optimizer_seconds(owned, compute, config.optimizer_bytes)


def _optimizer_max(owned: float, topology: Topology, placement: Sequence[str], config: StepConfig) -> float:
    """The slowest device's optimizer step, each kind of device (peak, memory rate) priced once."""
    kinds = {}
    for name in placement:
        device = topology.device(name)
        kinds.setdefault((device.peak_flops, device.memory_bytes_per_s), device)
    return max(_optimizer_s(owned, device, config) for device in kinds.values())


def exposed_bucket_s(all_reduce_s: float, backward_s: float, gradient_bytes: float, bucket_bytes: int) -> float:
    """Seconds of a bucketed all-reduce left after backward ends: ``B`` equal buckets, bucket ``i`` ready
    ``(i + 1) / B`` of the way through backward, each all-reduced in ``all_reduce_s / B``, one after another
    in order (DataParallel launches them strictly in index order).

    The last bucket ends at ``max_i ((i + 1) backward / B + (B - i) all_reduce / B)``, bucket ``i`` being the one
    whose readiness the queue behind it waits on; the term is linear in ``i``, so the first or the last bucket
    gives it, which prices any number of buckets at once."""
    buckets = max(1, math.ceil(gradient_bytes / bucket_bytes))
    done = max(backward_s + all_reduce_s / buckets, backward_s / buckets + all_reduce_s)
    return max(0.0, done - backward_s)


def _factors(layout: Layout, config: StepConfig) -> list[list[float]]:
    """Per sampled step, every rank's slowdown factor."""
    fixed = [config.slowdown.get(r, 1.0) for r in range(layout.world_size)]
    if config.straggler_sigma == 0:
        return [fixed]
    rng = np.random.default_rng(config.seed)
    draws = rng.lognormal(0.0, config.straggler_sigma, size=(config.samples, layout.world_size))
    return [[f * x for f, x in zip(fixed, row, strict=True)] for row in draws]


#: Each replayed collective's links as (names, links, bytes), by the result's identity (the result is kept, so an
#: identity is never reused): a planner's steps share most replays.
_ROWS: dict[int, tuple[CollectiveResult, list[str], list, np.ndarray]] = {}


def _rows(result: CollectiveResult) -> tuple[list[str], list, np.ndarray]:
    found = _ROWS.get(id(result))
    if found is None or found[0] is not result:
        if len(_ROWS) > 64:
            _ROWS.clear()
        rows = result.links
        found = _ROWS[id(result)] = (result, [u.link.name for u in rows], [u.link for u in rows],
                                     np.array([u.nbytes for u in rows], dtype=float))  # fmt: skip
    return found[1], found[2], found[3]


def _step_links(parts: list[tuple[CollectiveResult | None, float]], step_s: float) -> list[LinkUsage]:
    """Each link's bytes over the step (each collective's bytes times its calls a step), busiest first (then by
    name), summed over the collectives in the order given."""
    names: list[str] = []
    links: list = []
    weights = []
    for result, calls in parts:
        if result is None or not result.links:
            continue
        n, lk, nbytes = _rows(result)
        names += n
        links += lk
        weights.append(nbytes * calls)
    if not names:
        return []
    index: dict[str, int] = {}
    ids = np.fromiter((index.setdefault(name, len(index)) for name in names), dtype=np.int64, count=len(names))
    totals = np.bincount(ids, weights=np.concatenate(weights), minlength=len(index))
    first = np.full(len(index), len(names), dtype=np.int64)
    np.minimum.at(first, ids, np.arange(len(names)))
    unique = list(index)
    rates = np.array([links[i].bytes_per_s for i in first.tolist()])
    util = totals / (step_s * rates) if step_s > 0 else np.zeros(len(unique))
    by_name = np.empty(len(unique), dtype=np.int64)
    by_name[np.argsort(np.array(unique), kind="stable")] = np.arange(len(unique))
    order = np.lexsort((by_name, -util))
    return usage_rows(((links[first[i]], float(totals[i]), 0.0) for i in order.tolist()), step_s)


def _check_fp8(topology: Topology, placement: Sequence[str], config: StepConfig) -> None:
    """Raise ``ValueError`` unless every placed device runs FP8 products and compute is priced per operation."""
    if config.efficiency is not None:
        raise ValueError("fp8: each product priced at the FP8 rate needs compute priced per operation (no efficiency)")
    kinds = {}
    for name in placement:
        device = topology.device(name)
        kinds.setdefault((device.peak_flops, device.memory_bytes_per_s), name)
    for (peak, rate), name in kinds.items():
        if not _compute(peak, rate, config).fp8_peak_flops:
            raise ValueError(f"fp8: device {name} has no FP8 products (FP8 needs Hopper or later)")


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
    topology, as a planner's layouts share many of them. Python's cyclic collector is paused meanwhile
    (:func:`dtrain.cluster.topology.collector_paused`): a step on ten thousand GPUs makes about a hundred thousand
    link rows that live on."""
    with collector_paused():
        return _simulate_step(model, layout, topology, placement, config, cache=cache)


def _simulate_step(
    model: ModelSpec,
    layout: Layout,
    topology: Topology,
    placement: Sequence[str],
    config: StepConfig | None,
    *,
    cache: Cache | None,
) -> StepResult:
    config = config or StepConfig()
    layout.check(model)
    model, layout = context_view(model, layout)
    placement = list(placement)
    if len(placement) != layout.world_size:
        raise ValueError(f"placement names {len(placement)} devices for a layout of {layout.world_size} ranks")
    if any(r >= layout.world_size for r in config.slowdown):
        raise ValueError(f"slowdown names ranks {sorted(config.slowdown)} outside the {layout.world_size} ranks")
    if layout.fp8:
        _check_fp8(topology, placement, config)
    traffic = simulate_traffic(
        model, layout, topology, placement, tp_algorithm=config.tp_algorithm, dp_algorithm=config.dp_algorithm,
        cost=config.cost, cache=cache, split_pipeline=config.split_pipeline, flow_limit=config.flow_limit,
        gradient_bytes=config.gradient_bytes, distributed_optimizer=config.distributed_optimizer,
    )  # fmt: skip
    tp, pp, dp, gather = traffic.tp, traffic.pp, traffic.dp, traffic.pp_gather
    tp_s = tp.time_s if tp else 0.0
    send_s, gather_s = (pp.time_s if pp else 0.0), (gather.time_s if gather else 0.0)
    pp_s = send_s + gather_s
    dp_s = sum(r.time_s for r in dp)
    ring = _context_parallel(model, layout, topology, placement, config, cache)
    cp_s = ring.time_s if ring is not None else 0.0
    embedding_s = _embedding_all_reduce_s(model, layout, topology, placement, config, cache)
    memory = memory_per_device(model, layout, config.kernels, eager=config.eager)
    owned = max(stage_parameters(model, layout, s) for s in _edge_stages(layout)) / layout.tp
    owned /= layout.dp if layout.zero_stage else 1
    optimizer_s = _optimizer_max(owned, topology, placement, config)
    m = layout.microbatches
    v, group = layout.chunks, layout.microbatch_group or None
    steps, pipelines, exposed_dp, contention = [], [], [], []
    dp_path, beside_compute = _beside(topology, placement, layout, config)
    spans: dict[tuple, float] = {}
    edges: dict[tuple, list[tuple[float, float]]] = {}
    shares = chunk_shares(model, layout)  # ZB-V's chunks of a stage priced each at its own share
    flops = chunk_flops(model, layout)  # and its order built for their FLOPs, as dtrain train builds it
    amax_s = _amax_s(layout, topology, placement, config)
    for factors in _factors(layout, config):
        forward, backward, weight = _stage_times(model, layout, topology, placement, factors, config, tp_s, cp_s)
        forward, backward = _with_amax(forward, v, amax_s), _with_amax(backward, v, amax_s)
        slowest = 0.0
        for f, b, w in zip(forward, backward, weight, strict=True):
            key = (tuple(f), tuple(b), tuple(w))
            if key not in spans:  # replicas of equal stage times run equal pipelines
                weights = w if layout.schedule in SPLIT_BACKWARD else None
                spans[key] = pipeline_makespan(f, b, send_s, m, layout.schedule, weight_s=weights, virtual_stages=v,
                                               microbatch_group=group, gather_s=gather_s,
                                               synchronous=config.synchronous_p2p,
                                               paired=config.paired_exchanges,
                                               overlapped=config.overlap_p2p_comm, chunk_shares=shares,
                                               order_weights=flops)  # fmt: skip
            slowest = max(slowest, spans[key])
        pipelines.append(slowest)
        exposed = dp_s
        under: list[float] = []  # each stage's data-parallel seconds under its compute
        if _grad_reduce_overlaps(layout, config) and dp_s > 0 and _per_chunk(layout):
            exposed = 0.0
            for f, b, w in zip(forward, backward, weight, strict=True):
                key = (tuple(f), tuple(b), tuple(w), "chunks")
                if key not in edges:
                    edges[key] = pipeline_chunk_edges(f, b, send_s, m, layout.schedule, virtual_stages=v,
                                                      microbatch_group=group, gather_s=gather_s,
                                               synchronous=config.synchronous_p2p,
                                                      paired=config.paired_exchanges,
                                                      overlapped=config.overlap_p2p_comm)  # fmt: skip
                exposed = max(exposed, chunked_reduction_s(model, layout, config, dp, f, edges[key], slowest, under))
        elif _grad_reduce_overlaps(layout, config) and dp_s > 0:
            exposed = 0.0
            for f, b, w in zip(forward, backward, weight, strict=True):
                key = (tuple(f), tuple(b), tuple(w))
                if key not in edges:
                    weights = w if layout.schedule in SPLIT_BACKWARD else None
                    edges[key] = pipeline_stage_spans(f, b, send_s, m, layout.schedule, weight_s=weights,
                                                      virtual_stages=v, microbatch_group=group, gather_s=gather_s,
                                                      synchronous=config.synchronous_p2p,
                                                      paired=config.paired_exchanges,
                                                      overlapped=config.overlap_p2p_comm,
                                                      chunk_shares=shares, order_weights=flops)  # fmt: skip
                exposed = max(
                    exposed, overlapped_reduction_s(model, layout, config, dp, f, b, w, edges[key], slowest, under)
                )
        elif config.overlap_dp and layout.pp == 1 and _dp_overlaps(layout, config) and dp_s > 0:
            grads = model.parameters / layout.tp * (config.gradient_bytes or model.bytes_per_value)
            exposed = exposed_bucket_s(dp_s, max(b[0] + w[0] for b, w in zip(backward, weight, strict=True)), grads,
                                       config.bucket_bytes)  # fmt: skip
            under = [dp_s - exposed]
        lost = 0.0
        if beside_compute is not None:
            lost = max((beside_compute.beside_s(u, dp_path, fp8=layout.fp8) for u in under), default=0.0)
        exposed += embedding_s
        exposed_dp.append(exposed)
        contention.append(lost)
        steps.append(slowest + exposed + lost + optimizer_s)
    step_s = float(np.median(steps))
    pipeline_s = float(np.median(pipelines))
    ideal = _stage_times(model, layout, topology, placement, [1.0] * layout.world_size, config, 0.0)
    compute_s = m * max(f + b + w for f, b, w in zip(ideal[0][0], ideal[1][0], ideal[2][0], strict=True))
    most = max(stage_layers(model, layout, s) for s in _edge_stages(layout) | {min(1, layout.pp - 1)})
    tp_count = tp_all_reduces_per_layer(layout) * most * m
    ring_count = (3 + (layout.recompute == "full")) * most * m  # forward, backward (twice the bytes), recomputed
    parts = [(tp, tp_count), (pp, 2 * m), (gather, 2 * m), (ring, ring_count)] + [(r, 1) for r in dp]
    with np.errstate(invalid="ignore"):  # steps out of range (infinite) give NaN, quietly: callers check the result
        step_p95_s = float(np.percentile(steps, 95))
    return StepResult(
        step_s=step_s,
        step_p95_s=step_p95_s,
        pipeline_s=pipeline_s,
        compute_s=compute_s,
        tp_s=tp_count * tp_s,
        pp_s=pp_s,
        dp_s=dp_s,
        dp_exposed_s=float(np.median(exposed_dp)),
        optimizer_s=optimizer_s,
        bubble=max(0.0, 1.0 - compute_s / pipeline_s) if pipeline_s > 0 else 0.0,
        bubble_theory=_bubble_theory(layout, ideal),
        memory=memory,
        memory_limit=config.memory_fraction * min(topology.device(d).memory_bytes for d in placement),
        tokens_per_s=layout.global_batch * model.sequence / step_s,
        links=_step_links(parts, step_s),
        contention_s=float(np.median(contention)),
        amax_s=2 * m * v * amax_s,
        cp_s=cp_s,
    )


def _amax_s(layout: Layout, topology: Topology, placement: Sequence[str], config: StepConfig) -> float:
    """Seconds of one FP8 amax reduction on the compute stream (:attr:`StepConfig.amax_reduction`), 0 where none
    is priced: NCCL's latency for a few bytes over the tensor- and data-parallel ranks of a stage, on the servers
    that hold them."""
    if config.amax_reduction != "synchronous" or not layout.fp8:
        return 0.0
    ranks = [grid_rank(layout, d, 0, t) for d in range(layout.dp) for t in range(layout.tp)]
    nodes = len({topology.device(placement[r]).server for r in ranks})
    return small_all_reduce_s(len(ranks), nodes)


def _with_amax(times: list[list[float]], chunks: int, amax_s: float) -> list[list[float]]:
    """Per replica and stage, a micro-batch's forward or backward seconds with the FP8 amax reduction that ends
    each of its ``chunks`` model chunks' passes."""
    return [[t + chunks * amax_s for t in row] for row in times] if amax_s else times


def _bubble_theory(layout: Layout, ideal: tuple) -> float:
    """The theory's bubble for the layout's schedule with its stages' mean compute times (``ideal``:
    :func:`_stage_times` with no slowdown) as the costs: ``(p - 1) / (v m + p - 1)`` for GPipe, 1F1B and
    interleaved 1F1B, Qi et al.'s for ZB-H1 and ZB-V (:func:`~dtrain.parallel.pipeline_schedules.theoretical_bubble`:
    ZB-H1's closed form; ZB-V's order replayed with equal stages and free messages, here by the dependency graph
    :func:`~dtrain.sim.pipeline.pipeline_makespan` times, the same floats faster)."""
    p, m = layout.pp, layout.microbatches
    if p == 1:
        return 0.0
    if layout.schedule not in SPLIT_BACKWARD:
        return (p - 1) / (layout.chunks * m + p - 1)
    f, b, w = (sum(times[0]) / p for times in ideal)
    if layout.schedule == "zb-h1":
        return theoretical_bubble(p, m, schedule="zb-h1", forward_cost=f, backward_cost=b, weight_cost=w)
    span = pipeline_makespan([f] * p, [b] * p, 0.0, m, "zb-v", weight_s=[w] * p, order_costs=(f, b, w))
    return 1.0 - m * (f + b + w) / span


def _beside(
    topology: Topology, placement: Sequence[str], layout: Layout, config: StepConfig
) -> tuple[str, DeviceCompute | None]:
    """The way the data-parallel group's collectives go ("network" where the group spans servers, else
    "nvlink") and the device model that prices them beside compute (the first rank's device; None without
    ``config.contention`` or under a flat ``efficiency``: they cost the compute nothing)."""
    ranks = group(layout, "dp", 0, 0, 0)
    path = "network" if len({topology.device(placement[r]).server for r in ranks}) > 1 else "nvlink"
    if not config.contention or config.efficiency is not None:
        return path, None
    device = topology.device(placement[0])
    return path, _compute(device.peak_flops, device.memory_bytes_per_s, config)


#: The ZeRO stages whose gradient reduction ``StepConfig.overlap_grad_reduce`` runs under backward (and whose
#: weights' all-gather ``overlap_param_gather`` runs under the next forward).
OVERLAP_GRAD_REDUCE_STAGES = (0, 1, 2)

#: Megatron-Core's default bucket: ``max(40,000,000, 1,000,000 x dp)`` parameters (StepConfig's docstring).
MCORE_BUCKET_PARAMETERS, MCORE_BUCKET_PER_RANK = 40_000_000, 1_000_000


def overlapped_reduction_s(
    model: ModelSpec,
    layout: Layout,
    config: StepConfig,
    dp: Sequence[CollectiveResult],
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    spans: Sequence[tuple[float, float]],
    makespan: float,
    beside: list[float] | None = None,
) -> float:
    """Seconds the data-parallel phases ``dp`` (:func:`dtrain.sim.traffic.dp_phase_bytes`' order) add to a
    step whose slowest pipeline takes ``makespan`` under ``config.overlap_grad_reduce`` (and
    ``overlap_param_gather``), given a replica's stages' one-micro-batch ``forward``, ``backward`` and ``weight``
    seconds and each stage's (first start, last end) in its pipeline (:func:`pipeline_stage_spans`): stage
    ``s``'s reduction ends at the end of its last backward plus what remains of it (:func:`exposed_bucket_s` over
    that backward on the first stage, all of it on the others, whose one bucket waits for the whole backward); the
    step waits for the latest. The all-gather of the updated weights (the distributed optimizer's) delays the next
    step by what remains of it at each stage's first forward: :func:`exposed_bucket_s` over the first stage's
    forward, and on stage ``s`` all of it less the time before the stage's first forward starts. ``beside``, where
    given, receives each stage's seconds of these collectives that run while the stage computes: the first
    stage's buckets under its last backward and its gather under its first forward, and on the other stages the
    gather once their first forward has started (their reduction starts after their last backward)."""
    phases = dp_phase_bytes(model, layout, config.gradient_bytes, config.distributed_optimizer)
    reduce_s = sum(r.time_s for r, (c, _, _) in zip(dp, phases, strict=True) if c is not Collective.ALL_GATHER)
    gather_s = sum(r.time_s for r, (c, _, _) in zip(dp, phases, strict=True) if c is Collective.ALL_GATHER)
    bucket = max(MCORE_BUCKET_PARAMETERS, MCORE_BUCKET_PER_RANK * layout.dp)
    grad_item = config.gradient_bytes or model.bytes_per_value
    first = stage_parameters(model, layout, 0) / layout.tp
    finish = 0.0
    left = exposed_bucket_s(reduce_s, backward[0] + weight[0], first * grad_item, bucket * grad_item)
    for s, (_, end) in enumerate(spans):
        finish = max(finish, end + (left if s == 0 else reduce_s))
    exposed = max(0.0, finish - makespan)
    under = [reduce_s - left] + [0.0] * (len(spans) - 1)
    if gather_s and config.overlap_param_gather:
        item = model.bytes_per_value
        first_wait = exposed_bucket_s(gather_s, forward[0], first * item, bucket * item)
        wait = max([first_wait] + [gather_s - start for start, _ in spans[1:]])
        exposed += max(0.0, wait)
        under[0] += gather_s - first_wait
        for s, (start, _) in enumerate(spans[1:], 1):
            under[s] += max(0.0, gather_s - start)
    else:
        exposed += gather_s
    if beside is not None:
        beside.extend(under)
    return exposed


def _per_chunk(layout: Layout) -> bool:
    """Whether Megatron-Core keeps a ``DistributedDataParallel`` a model chunk: interleaved 1F1B of 2 or more
    chunks (``megatron/training/training.py``, ``get_model``: one module a virtual pipeline stage)."""
    return layout.schedule == "interleaved-1f1b" and layout.chunks > 1 and layout.pp > 1


def chunked_reduction_s(
    model: ModelSpec,
    layout: Layout,
    config: StepConfig,
    dp: Sequence[CollectiveResult],
    forward: Sequence[float],
    edges: Sequence[tuple[Sequence[float], Sequence[tuple[int, float]]]],
    makespan: float,
    beside: list[float] | None = None,
) -> float:
    """Seconds the data-parallel phases ``dp`` add to an interleaved 1F1B step whose slowest pipeline takes
    ``makespan`` under ``config.overlap_grad_reduce`` (and ``overlap_param_gather``), Megatron-Core r0.8.0's way:
    one ``DistributedDataParallel`` a model chunk (``megatron/training/training.py``, ``get_model``;
    ``disable_bucketing`` for every chunk but the first), each chunk's reduction launched by the schedule's
    ``grad_sync_func`` (``--delay-grad-reduce``, the default: ``start_grad_sync``, every bucket of the chunk at
    once) after the stage's backward that comes ``s`` backwards after the chunk's last one on stage ``s`` (so that
    the stages launch together; ``pipeline_parallel/schedules.py``, ``forward_backward_pipelining_with_interleaving``,
    ``backward_step_helper``), or after the stage's last backward where there is none that late (the chunk of the
    first layers on every stage). The chunks' reductions run one after another in the order launched, on the one
    data-parallel communicator, each taking ``1/v`` of the stage's (the collectives' time in proportion to their
    bytes); the step waits for the latest stage. ``edges``: each stage's chunks' first forward starts and its
    backwards' (chunk, end) in order (:func:`dtrain.sim.pipeline.pipeline_chunk_edges`); ``forward``: the stages'
    forward seconds of one micro-batch.

    The distributed optimizer's all-gather of the updated weights (``overlap_param_gather``; ``distrib_optimizer.py``,
    ``_make_forward_pre_hook`` and ``_finish_param_sync_helper``): the first chunk's bucket is launched at the
    optimizer step's end, and each bucket's wait in its first forward launches the next, so chunk ``c``'s gather
    starts when chunk ``c - 1``'s first forward does (or when the gather before it ends) and chunk ``c``'s first
    forward waits for it; the first stage's first chunk, in buckets, runs under its first forward
    (:func:`exposed_bucket_s`). The step is delayed by the longest such wait; without ``overlap_param_gather`` the
    whole gather shows. ``beside``, where given, receives each stage's seconds of these collectives that run
    while the stage computes: the reductions before its last backward ends, the gathers after its first forward
    starts."""
    phases = dp_phase_bytes(model, layout, config.gradient_bytes, config.distributed_optimizer)
    reduce_s = sum(r.time_s for r, (c, _, _) in zip(dp, phases, strict=True) if c is not Collective.ALL_GATHER)
    gather_s = sum(r.time_s for r, (c, _, _) in zip(dp, phases, strict=True) if c is Collective.ALL_GATHER)
    v = layout.chunks
    finish = 0.0
    under = [0.0] * len(edges)
    for s, (_, backwards) in enumerate(edges):
        last = {chunk: i for i, (chunk, _) in enumerate(backwards)}
        launches = sorted(backwards[min(last[c] + s, len(backwards) - 1)][1] for c in last)
        busy_until = backwards[-1][1] if backwards else 0.0
        done = 0.0
        for launch in launches:
            start = max(done, launch)
            done = start + reduce_s / v
            under[s] += max(0.0, min(done, busy_until) - start)
        finish = max(finish, done)
    exposed = max(0.0, finish - makespan)
    if gather_s and config.overlap_param_gather:
        bucket = max(MCORE_BUCKET_PARAMETERS, MCORE_BUCKET_PER_RANK * layout.dp)
        item = model.bytes_per_value
        first = stage_parameters(model, layout, 0) / layout.tp / v
        piece = gather_s / v
        wait = 0.0
        for s, (firsts, _) in enumerate(edges):
            done = 0.0
            for c, start in enumerate(firsts):
                done = max(done, firsts[c - 1] if c else 0.0) + piece
                late = done - start
                if s == 0 and c == 0:
                    late = exposed_bucket_s(piece, forward[0] / v, first * item, bucket * item)
                    under[s] += piece - late
                else:
                    under[s] += max(0.0, done - max(done - piece, firsts[0]))
                wait = max(wait, late)
        exposed += wait
    else:
        exposed += gather_s
    if beside is not None:
        beside.extend(under)
    return exposed


def _grad_reduce_overlaps(layout: Layout, config: StepConfig) -> bool:
    """Whether ``config.overlap_grad_reduce`` starts the layout's gradient reduction under backward: ZeRO stage 0
    or 1 (an all-reduce, or the distributed optimizer's reduce-scatter) and stage 2 (a reduce-scatter), bucket by
    bucket as Megatron-Core reduces a bucket once its gradients are ready. Stage 3's weight all-gathers of forward
    and backward are priced after the pipeline, its reduce-scatter with them (:data:`OVERLAP_GRAD_REDUCE_STAGES`)."""
    return config.overlap_grad_reduce and layout.zero_stage in OVERLAP_GRAD_REDUCE_STAGES


def _dp_overlaps(layout: Layout, config: StepConfig) -> bool:
    """Whether the data-parallel reduction may run under backward: plain data parallelism, or ZeRO stage 1 with
    ``config.overlap_sharded_dp``."""
    return layout.zero_stage == 0 or (layout.zero_stage == 1 and config.overlap_sharded_dp)


def _edge_stages(layout: Layout) -> set[int]:
    """The stages that may hold the most: the first and the last (the embedding and the output layer), every
    stage where ``dtrain train``'s cut (``layout.balance``) puts blocks unevenly."""
    if layout.balance is not None:
        return set(range(layout.pp))
    return {0, layout.pp - 1, head_stage(layout)}


def _embedding_all_reduce_s(
    model: ModelSpec, layout: Layout, topology: Topology, placement: Sequence[str], config: StepConfig,
    cache: Cache | None,
) -> float:  # fmt: skip
    """Seconds of the tied word embedding's gradient all-reduce between the first and last stage of every
    replica and tensor-parallel rank, all at once (``config.tied_embedding_allreduce``; 0 without a pipeline or a
    vocabulary): ``V h / tp`` values in each group of two."""
    if not config.tied_embedding_allreduce or layout.pp == 1 or not model.vocab or head_stage(layout) == 0:
        return 0.0
    item = config.gradient_bytes or model.bytes_per_value
    nbytes = model.vocab * model.hidden / layout.tp * item
    placement = tuple(placement)
    groups = [[grid_rank(layout, d, 0, t), grid_rank(layout, d, layout.pp - 1, t)]
              for d in range(layout.dp) for t in range(layout.tp)]  # fmt: skip

    def jobs() -> list[Job]:
        return _group_jobs(Collective.ALL_REDUCE, config.dp_algorithm, groups, placement, topology, nbytes, item)

    shape = ("embedding", layout.dp, layout.tp, layout.pp, placement, config.dp_algorithm, nbytes)
    return _replay(jobs, topology, config.cost, item, cache, config.flow_limit, shape).time_s


#: Schedules whose makespan with equal stages and free messages is ``(m + (p - 1) / v)(f + b)``: GPipe and 1F1B
#: (``v = 1``; GPipe paper, section 2.3) and interleaved 1F1B with ``m`` a multiple of ``p`` (Narayanan et al.
#: 2021, section 2.2.2); :func:`dtrain.sim.pipeline.pipeline_makespan` gives exactly this
#: (tests/sim/test_planner_bound.py).
_CLOSED_FORM = ("1f1b", "gpipe", "interleaved-1f1b")
#: A closed form and an event replay may round apart by a few units in the last place: bounds are shaded by this.
_ROUNDING = 1e-9


def _makespan_bound(
    forward: list[float], backward: list[float], weight: list[float], layout: Layout, shares=None
) -> float:
    """At most :func:`pipeline_makespan` of these stage times with any message time: the larger of the busiest
    stage's work (a stage runs its actions one at a time) and the makespan of equal stages at each pass's
    smallest time with free messages (the replay's times are maxima and sums of the costs, so it can only grow
    with any of them): in closed form where :data:`_CLOSED_FORM` has it, else replayed (and kept)."""
    p, m, v = layout.pp, layout.microbatches, layout.chunks
    split = layout.schedule in SPLIT_BACKWARD
    busiest = m * max(f + b + (w if split else 0.0) for f, b, w in zip(forward, backward, weight, strict=True))
    f, b, w = min(forward), min(backward), min(weight)
    if layout.schedule in _CLOSED_FORM and (layout.schedule != "interleaved-1f1b" or m % p == 0):
        equal = (m + (p - 1) / v) * (f + b)
    elif layout.schedule == "zb-v":
        # ZB-V's order is built for the stage times, so a replay at other times may run another order: bound it by
        # what any order must do, stage s's work after its first forward, which waits for s chunks' forwards
        # (the first chunk's forward: half a stage's, or its share of it under ``shares``)
        first = min(fq * pair[0] for fq, pair in zip(forward, shares, strict=True)) if shares else f / 2
        stages = enumerate(zip(forward, backward, weight, strict=True))
        equal = max(s * first + m * (fs + bs + ws) for s, (fs, bs, ws) in stages)
    else:
        key = (layout.schedule, p, m, v, f, b, w if split else None)
        if key not in _EQUAL_SPANS:
            if len(_EQUAL_SPANS) > 4096:
                _EQUAL_SPANS.clear()
            weights = [w] * p if split else None
            _EQUAL_SPANS[key] = pipeline_makespan([f] * p, [b] * p, 0.0, m, layout.schedule, weight_s=weights,
                                                  virtual_stages=v)  # fmt: skip
        equal = _EQUAL_SPANS[key]
    return max(busiest, equal) * (1 - _ROUNDING)


_EQUAL_SPANS: dict[tuple, float] = {}


def tensor_parallel_s(
    model: ModelSpec,
    layout: Layout,
    topology: Topology,
    placement: Sequence[str],
    config: StepConfig | None = None,
    *,
    cache: Cache | None = None,
) -> float:
    """Seconds of one tensor-parallel all-reduce of a layer's activation, every group at once: the replay
    :func:`simulate_step` makes (and, with the same ``cache``, shares with it); 0 without tensor parallelism."""
    config = config or StepConfig()
    model, layout = context_view(model, layout)
    if layout.tp == 1:
        return 0.0
    placement = tuple(placement)
    item = model.bytes_per_value
    activation = layout.micro_batch * model.sequence * model.hidden * item

    def jobs() -> list[Job]:
        return _group_jobs(Collective.ALL_REDUCE, config.tp_algorithm, _groups(layout, "tp"), placement, topology,
                           activation, item)  # fmt: skip

    shape = group_shape(layout, "tp", placement, Collective.ALL_REDUCE, config.tp_algorithm, activation)
    return _replay(jobs, topology, config.cost, item, cache, config.flow_limit, shape).time_s


def context_parallel_s(
    model: ModelSpec,
    layout: Layout,
    topology: Topology,
    placement: Sequence[str],
    config: StepConfig | None = None,
    *,
    cache: Cache | None = None,
) -> float:
    """Seconds of one context-parallel ring pass, every group at once: each rank's keys and values of one layer
    and one micro-batch (``2 b (s / cp) kv d / t`` values) sent round its ``cp`` ranks in ``cp - 1`` steps, as a
    ring all-gather moves them (Liu et al. 2023; Transformer Engine's ``AttnFuncWithCPAndKVP2P``); the replay
    :func:`simulate_step` makes (and, with the same ``cache``, shares with it). 0 without context parallelism."""
    config = config or StepConfig()
    layout.check(model)
    if len(placement) != layout.world_size:
        raise ValueError(f"placement names {len(placement)} devices for a layout of {layout.world_size} ranks")
    model, layout = context_view(model, layout)
    found = _context_parallel(model, layout, topology, tuple(placement), config, cache)
    return found.time_s if found is not None else 0.0


def _context_parallel(
    model: ModelSpec,
    layout: Layout,
    topology: Topology,
    placement: Sequence[str],
    config: StepConfig,
    cache: Cache | None,
) -> CollectiveResult | None:
    """The ring pass of :func:`context_parallel_s` replayed, for a context-parallel rank's ``model`` and
    ``layout`` (:func:`dtrain.sim.model.context_view`): the groups are runs of ``cp`` consecutive data-parallel
    ranks of the view."""
    ring = model.context_shards
    if ring == 1:
        return None
    placement = tuple(placement)
    item = model.bytes_per_value
    head = model.hidden // model.heads
    shard = 2 * layout.micro_batch * model.sequence * model.key_value_heads * head / layout.tp * item
    groups = [
        [grid_rank(layout, d + c, p, t) for c in range(ring)]
        for d in range(0, layout.dp, ring) for p in range(layout.pp) for t in range(layout.tp)
    ]  # fmt: skip

    def jobs() -> list[Job]:
        return _group_jobs(Collective.ALL_GATHER, "ring", groups, placement, topology, ring * shard, item)

    shape = group_shape(layout, "cp", placement, Collective.ALL_GATHER, "ring", ring, ring * shard)
    return _replay(jobs, topology, config.cost, item, cache, config.flow_limit, shape)


#: Each server's links out of it (from a node of the server to a node of no server or another), by topology identity.
_EGRESS: dict[int, tuple[Topology, dict[str, float]]] = {}


def _server_egress(topology: Topology) -> dict[str, float]:
    """Bytes a second each server can send out of itself: the sum of the rates of the links that leave it."""
    found = _EGRESS.get(id(topology))
    if found is None or found[0] is not topology:
        nodes = topology.graph.nodes
        egress: dict[str, float] = {}
        for u, v, link in topology.graph.edges(data="link"):
            server = nodes[u].get("server")
            if server is not None and nodes[v].get("server") != server:
                egress[server] = egress.get(server, 0.0) + link.bytes_per_s
        if len(_EGRESS) > 8:
            _EGRESS.clear()
        found = _EGRESS[id(topology)] = (topology, egress)
    return found[1]


def data_parallel_lower_bound(
    model: ModelSpec, layout: Layout, topology: Topology, placement: Sequence[str], config: StepConfig | None = None
) -> float:
    """Seconds the data-parallel collectives of a step (every ZeRO phase, every group at once) cannot beat: in
    each phase, the bytes the ranks of a server send to ranks on other servers leave it through its links out at
    their rates at most (max-min fair shares never exceed a link's rate), so the phase lasts at least the largest
    such total over the server's rate out. At most :func:`simulate_step`'s ``dp_s``."""
    config = config or StepConfig()
    model, layout = context_view(model, layout)
    if layout.dp == 1:
        return 0.0
    placement = list(placement)
    egress = _server_egress(topology)
    servers = [topology.device(d).server for d in placement]
    groups = _groups(layout, "dp")
    total = 0.0
    for collective, nbytes, item in dp_phase_bytes(model, layout, config.gradient_bytes,
                                                   config.distributed_optimizer):  # fmt: skip
        out: dict[str, float] = {}
        for g in groups:
            schedule = _build(collective, config.dp_algorithm, g, placement, topology)
            for rank, rounds in enumerate(_rank_rounds_cached(schedule, _padded(nbytes, item, len(g)), item)):
                here = servers[g[rank]]
                sent = sum(n for rr in rounds for peer, n in rr.sends.items() if servers[g[peer]] != here)
                if sent:
                    out[here] = out.get(here, 0.0) + sent
        total += max((n / egress[s] for s, n in out.items() if egress.get(s)), default=0.0)
    return total * (1 - _ROUNDING)


def pipeline_message_lower_bound(
    model: ModelSpec, layout: Layout, topology: Topology, placement: Sequence[str], config: StepConfig | None = None
) -> float:
    """Seconds the pipeline's concurrent sends of one micro-batch's activation (every stage boundary of every
    replica at once, :func:`dtrain.sim.traffic.simulate_traffic`'s ``pp``) cannot beat: the bytes a server sends
    to other servers leave it through its links out at their rates at most. At most :func:`simulate_step`'s
    ``pp_s``; 0 without a pipeline or with split sends."""
    config = config or StepConfig()
    model, layout = context_view(model, layout)
    if layout.pp == 1 or (config.split_pipeline and layout.tp > 1):
        return 0.0
    item = model.bytes_per_value
    message = _padded(layout.micro_batch * model.sequence * model.hidden * item, item, 1)
    servers = [topology.device(d).server for d in placement]
    egress = _server_egress(topology)
    out: dict[str, float] = {}
    for d in range(layout.dp):
        for p in range(layout.pp - 1):
            for t in range(layout.tp):
                a, b = servers[grid_rank(layout, d, p, t)], servers[grid_rank(layout, d, p + 1, t)]
                if a != b:
                    out[a] = out.get(a, 0.0) + message
    return max((n / egress[s] for s, n in out.items() if egress.get(s)), default=0.0) * (1 - _ROUNDING)


def step_lower_bound(
    model: ModelSpec,
    layout: Layout,
    topology: Topology,
    placement: Sequence[str],
    config: StepConfig | None = None,
    *,
    tp_s: float = 0.0,
    exact_pipeline: bool = False,
) -> float:
    """A time :func:`simulate_step` cannot beat for this layout and placement, without replaying the pipeline
    sends or the data-parallel collectives: the pipeline of each replica with free messages (bounded below by
    :func:`_makespan_bound`), no data-parallel time, and the optimizer step, the median over the same straggler
    samples. ``tp_s``: the tensor-parallel all-reduce's seconds (:func:`tensor_parallel_s`), or 0 for a bound on
    compute alone. ``exact_pipeline``: each replica's pipeline timed as the simulation times it, each message
    taking :func:`pipeline_message_lower_bound` (:func:`~dtrain.sim.pipeline.pipeline_makespan` only grows with
    the message time), and the data-parallel time where it is not overlapped bounded by
    :func:`data_parallel_lower_bound` (tighter; dearer the first time a pipeline of its
    shape is timed). Exact as a bound: every part of the step grows with the seconds left out (the stage times with
    ``tp_s``, the pipeline with its stage times and message time, the step with its data-parallel time, which is
    at least 0), and a median of smaller samples is smaller."""
    config = config or StepConfig()
    layout.check(model)
    model, layout = context_view(model, layout)
    placement = list(placement)
    owned = max(stage_parameters(model, layout, s) for s in _edge_stages(layout)) / layout.tp
    owned /= layout.dp if layout.zero_stage else 1
    optimizer_s = _optimizer_max(owned, topology, placement, config)
    m, v, group = layout.microbatches, layout.chunks, layout.microbatch_group or None
    overlapped = _grad_reduce_overlaps(layout, config) or (
        config.overlap_dp and layout.pp == 1 and _dp_overlaps(layout, config)
    )
    dp_s = data_parallel_lower_bound(model, layout, topology, placement, config) if exact_pipeline else 0.0
    exposed = 0.0 if overlapped else dp_s
    p2p_s = pipeline_message_lower_bound(model, layout, topology, placement, config) if exact_pipeline else 0.0
    bounds = []
    shares, flops = chunk_shares(model, layout), chunk_flops(model, layout)
    spans: dict[tuple, float] = {}
    amax_s = _amax_s(layout, topology, placement, config)
    for factors in _factors(layout, config):
        forward, backward, weight = _stage_times(model, layout, topology, placement, factors, config, tp_s)
        forward, backward = _with_amax(forward, v, amax_s), _with_amax(backward, v, amax_s)
        slowest = 0.0
        for f, b, w in zip(forward, backward, weight, strict=True):
            key = (tuple(f), tuple(b), tuple(w))
            if key not in spans and exact_pipeline:
                weights = w if layout.schedule in SPLIT_BACKWARD else None
                spans[key] = pipeline_makespan(f, b, p2p_s, m, layout.schedule, weight_s=weights, virtual_stages=v,
                                               microbatch_group=group, synchronous=config.synchronous_p2p,
                                               paired=config.paired_exchanges,
                                               overlapped=config.overlap_p2p_comm, chunk_shares=shares,
                                               order_weights=flops)  # fmt: skip
            elif key not in spans:
                spans[key] = _makespan_bound(f, b, w, layout, shares)
            slowest = max(slowest, spans[key])
        bounds.append(slowest + exposed + optimizer_s)
    return float(np.median(bounds))
