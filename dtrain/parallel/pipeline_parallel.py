"""Inter-operator and pipeline parallelism: an ``nn.Sequential`` cut into stages, one stage per rank of a group.

Inter-operator parallelism places consecutive layers on different devices; pipelining splits each batch into
``m`` micro-batches so the stages work at once (GPipe, Huang et al. 2019; 1F1B / PipeDream-Flush, Narayanan et
al. 2019 and 2021; interleaved 1F1B, Narayanan et al. 2021 section 2.2.2, where each rank holds ``v`` chunks
of the model and the bubble shrinks ``v`` times; ZB-H1 and ZB-V, Qi et al. 2024, which split each backward into
the input gradient B and the weight gradient W, :mod:`dtrain.parallel.weight_gradients`). The schedules are data
(:mod:`dtrain.parallel.pipeline_schedules`); the runner here executes one, talking to its neighbours through
:mod:`dtrain.parallel.pipeline_parallel_communications`.

The loss of each micro-batch is divided by ``m`` and the gradients of all micro-batches accumulate in ``.grad``,
so one :meth:`PipelineParallel.train_step` gives the gradients of one step on the whole batch (for a loss that
averages over the batch, such as ``mse_loss`` or ``cross_entropy`` with their default reduction).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from dtrain import comm
from dtrain.models import dropout as dropouts
from dtrain.parallel import step_graph
from dtrain.parallel.pipeline_parallel_communications import DeviceClock, StageLink
from dtrain.parallel.pipeline_schedules import (
    PLACEMENT,
    SCHEDULES,
    SPLIT_BACKWARD,
    Timeline,
    TimelineEvent,
    chunk_of,
    chunks_per_stage,
    cut_sizes,
    make_schedule,
    stage_of_virtual,
    virtual_stage,
    zb_v_costs,
)
from dtrain.parallel.weight_gradients import EAGER_FUSION_MACS, WeightGradStore

__all__ = ["PipelineParallel", "PipelineStage", "forward_flops_weight", "partition_layers"]

Balance = Literal["layers", "params", "flops"]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def partition_layers(
    sequential: nn.Sequential,
    num_stages: int,
    *,
    balance: Balance = "layers",
    stage_of: Sequence[int] | None = None,
) -> list[range]:
    """Cut ``sequential``'s layers into ``num_stages`` contiguous, non-empty ranges.

    ``balance="layers"``: layer counts differ by at most one (the first stages take the extra ones).
    ``balance="params"``: the largest stage's parameter count is as small as possible (ties broken by the
    largest layer count), the contiguous min-max partition GPipe's partitioner approximates.
    ``balance="flops"``: the same partition of each layer's forward FLOPs per token,
    :func:`forward_flops_weight` (a vocabulary head counts its matmul, an embedding table nothing).

    ``stage_of`` names the pipeline stage that runs each range, where a stage runs several (the chunks of
    interleaved 1F1B, ``u mod p``, and of the V, ``u`` and ``2p - 1 - u``): ``params`` and ``flops`` then balance
    what each *stage* holds, the sum of its ranges (:func:`_balance_stages`), since a stage runs its chunks one
    after another. Under the V the first stage holds both ends of the model, embedding and head.
    """
    n = len(sequential)
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} pipeline stages: more stages than layers")
    if balance == "layers":
        costs = None
    elif balance == "params":
        costs = [sum(p.numel() for p in layer.parameters()) for layer in sequential]
    elif balance == "flops":
        costs = [forward_flops_weight(layer) for layer in sequential]
    else:
        raise ValueError(f"balance must be 'layers', 'params' or 'flops', got {balance!r}")
    sizes = cut_sizes(n, num_stages, costs, stage_of)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def forward_flops_weight(layer: nn.Module) -> int:
    """A rough forward cost of ``layer`` per token: 2 x the weights of its matrix multiplications (every module
    with a 2-d ``weight`` that is not an embedding table: ``nn.Linear`` and the tensor-parallel linears and vocabulary
    head), as in Kaplan et al. 2020's 2N forward FLOPs per token. Lookups (embeddings) and norms count nothing;
    attention's score FLOPs, which grow with the sequence, are left out (the same for every block)."""
    total = 0
    for module in layer.modules():
        weight = getattr(module, "weight", None)
        embedding = isinstance(module, nn.Embedding) or type(module).__name__.endswith("Embedding")
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not embedding:
            total += 2 * weight.numel()
    return total


class PipelineStage(nn.Module):
    """The layers of one pipeline stage: stage ``stage_index`` (this rank's rank in ``group`` by default) of
    ``num_stages`` (``group``'s size by default; ``v`` times it for the chunks of interleaved 1F1B), cut from
    ``sequential`` by :func:`partition_layers` (``stage_of``: the pipeline stage of each of the ``num_stages``
    ranges, for a balance of what each stage holds). The layers are shared, not copied."""

    def __init__(
        self,
        sequential: nn.Sequential,
        group: dist.ProcessGroup,
        *,
        stage_index: int | None = None,
        num_stages: int | None = None,
        balance: Balance = "layers",
        stage_of: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.num_stages = dist.get_world_size(group) if num_stages is None else num_stages
        self.stage_index = dist.get_rank(group) if stage_index is None else stage_index
        if not 0 <= self.stage_index < self.num_stages:
            raise ValueError(f"stage_index {self.stage_index} is outside 0..{self.num_stages - 1}")
        cuts = partition_layers(sequential, self.num_stages, balance=balance, stage_of=stage_of)
        self.layer_range = cuts[self.stage_index]
        # a plain Sequential of the layers, keeping their keys (a subclass such as CausalLM may not slice)
        kept = list(sequential._modules.items())[self.layer_range.start : self.layer_range.stop]
        self.layers = nn.Sequential(OrderedDict(kept))

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class PipelineParallel:
    """Trains ``sequential`` as a pipeline over ``group``: this rank runs its :class:`PipelineStage` (or chunks).

    ``schedule`` is "gpipe", "1f1b", "interleaved-1f1b", "zb-h1" or "zb-v"
    (:data:`~dtrain.parallel.pipeline_schedules.SCHEDULES`). Interleaved 1F1B cuts the model into
    ``virtual_stages * p`` chunks (default ``virtual_stages=2``) and this rank holds chunks ``s, s + p, ...``:
    :attr:`chunks` lists them and :attr:`stage` is an ``nn.ModuleList`` of them (the :class:`PipelineStage`
    itself for the other schedules). ``microbatch_group`` (interleaved 1F1B only; default ``p``) is how many
    micro-batches go through one chunk before the next: a multiple of ``p`` dividing ``num_microbatches``; a larger
    group hides the messages between the last stage and the first behind compute, for more activations held
    (:func:`~dtrain.parallel.pipeline_schedules.interleaved_one_f_one_b`). ZB-V holds 2 chunks, virtual stages ``s``
    and ``2p - 1 - s``; its order is built for ``schedule_costs``, one micro-batch's (T_F, T_B, T_W) on a stage in
    any unit (:func:`~dtrain.parallel.pipeline_schedules.zb_v`), shared among the chunks by their forward FLOPs
    (:func:`forward_flops_weight`: a chunk that holds the output layer costs more); None: equal costs, every chunk
    alike. Under ZB-H1 and ZB-V, :attr:`weight_grads` defers the linear layers' weight gradients from each B to its
    W action. After each :meth:`train_step`, :attr:`timeline` holds what this rank did,
    for :func:`~dtrain.parallel.pipeline_schedules.bubble_fraction`, on the host clock, or on the device clock
    where :attr:`device_clock` is set on a GPU. ``grad_group`` (the same ranks as
    ``group``, another process group) carries the gradients, so that on NCCL the two directions between two
    stages do not queue behind each other (:mod:`~dtrain.parallel.pipeline_parallel_communications`); the rank
    grid makes one (``pp_grad_group``). ``lookahead`` is how many actions ahead a stage posts its receives on the
    process groups (:class:`~dtrain.parallel.pipeline_parallel_communications.StageLink`). ``transport``: "auto"
    (the default) moves the messages of stages of one host (on a GPU, messages of
    :data:`~dtrain.parallel.pipeline_parallel_communications.PEER_FROM_BYTES` or more), from the second step on, to
    peer channels
    (:class:`~dtrain.comm.peer.channels.PeerChannels`: copies through peer memory signalled by stream memory
    operations, which hold no SM while they wait); "peer" insists on them (a ValueError where a stage is on
    another host); "group" keeps the process groups' send and recv. ``in_place`` (default True): where a peer
    channel's ring holds the whole step, the stage computes on each message in its slot and gives the slots back at
    the step's end; False computes on a copy taken out of the slot. ``send_engine``: where a message's copy into a
    peer channel whose ring holds the whole step runs (:data:`~dtrain.comm.peer.channels.ENGINES`): "stream" (a
    copy engine, on a stream of the channel's), "inline" (a copy engine, on the compute stream), "kernel" (an
    elementwise kernel on the compute stream storing over the peer mapping).

    ``grad_accumulation_fusion`` (GPipe, 1F1B, interleaved 1F1B; ZB-H1's and ZB-V's W already does it): from a
    stage's second micro-batch on, each linear layer's weight gradient is added into ``.grad`` by its GEMM
    (:mod:`~dtrain.parallel.weight_gradients`), not made apart and added by a second pass; the gradient's hooks do
    not run for those micro-batches, so the gradients must be reduced after the step (as
    :class:`~dtrain.parallel.hybrid.HybridParallel` does with ZeRO 0 and 1). True: every call; "auto": every call
    under ``graphs="step"``, eagerly the calls whose product has
    :data:`~dtrain.parallel.weight_gradients.EAGER_FUSION_MACS` multiply-adds or more; never under
    ``graphs=True``.

    ``graphs=True`` (CUDA, every schedule, autocast too): the first step runs eagerly and records each (chunk,
    micro-batch)'s argument shapes; the next captures every (chunk, micro-batch)'s forward and backward as CUDA
    graphs of its own (:meth:`_capture`) and later steps replay them, so that a forward or backward costs the host
    one graph launch. Under ZB-H1 and ZB-V the backward graph is B alone: it leaves each linear layer's input and
    output gradient in tensors of its pool, and W runs the weight-gradient GEMMs on them. Memory: every
    micro-batch's activations and temporaries are kept in its own graphs' pool, as many as GPipe holds at once
    whatever the schedule. A step with other shapes runs eagerly.
    """

    def __init__(
        self,
        sequential: nn.Sequential,
        group: dist.ProcessGroup,
        *,
        num_microbatches: int,
        schedule: str = "1f1b",
        balance: Balance = "layers",
        virtual_stages: int | None = None,
        microbatch_group: int | None = None,
        grad_group: dist.ProcessGroup | None = None,
        lookahead: int | None = None,
        transport: str = "auto",
        in_place: bool = True,
        send_engine: str = "stream",
        graphs: bool | str = False,
        grad_accumulation_fusion: bool | str = False,
        schedule_costs: tuple[float, float, float] | None = None,
    ) -> None:
        if grad_accumulation_fusion not in (False, True, "auto"):
            raise ValueError(
                f"grad_accumulation_fusion must be False, True or 'auto', got {grad_accumulation_fusion!r}"
            )
        if graphs not in (False, True, "step"):
            raise ValueError(f"graphs must be False, True or 'step', got {graphs!r}")
        if graphs == "step" and transport == "group":
            raise ValueError("graphs='step' records the stages' messages on peer channels; transport 'group' has none")
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        interleaved = schedule == "interleaved-1f1b"
        v = chunks_per_stage(schedule, 2 if virtual_stages is None else virtual_stages)
        if not isinstance(v, int) or v < 1 or (not interleaved and virtual_stages not in (None, 1, v)):
            raise ValueError(
                f"virtual_stages={virtual_stages!r}: schedule {schedule!r} holds {chunks_per_stage(schedule)} model "
                "chunk(s) a stage; only interleaved-1f1b takes another count (a positive int)"
            )
        if microbatch_group is not None and not interleaved:
            raise ValueError(f"microbatch_group is interleaved-1f1b's; schedule {schedule!r} takes none")
        s, p = dist.get_rank(group), dist.get_world_size(group)
        self.num_stages, self.stage_index, self.virtual_stages = p, s, v
        #: interleaved 1F1B's micro-batch group (None: the stages' count, or another schedule)
        self.microbatch_group = microbatch_group
        self.num_microbatches = num_microbatches
        self.schedule_name = schedule
        self.placement = PLACEMENT.get(schedule, "loop")
        costs = zb_v_costs(schedule_costs)  # checked whatever the schedule
        stage_of = [stage_of_virtual(u, p, self.placement)[0] for u in range(v * p)]
        weights = None
        if schedule == "zb-v" and schedule_costs is not None:  # each chunk's share of the costs, by its FLOPs
            cuts = partition_layers(sequential, v * p, balance=balance, stage_of=stage_of)
            weights = [sum(forward_flops_weight(sequential[i]) for i in cut) for cut in cuts]
            weights = weights if max(weights) > 0 else None
        schedules = [
            make_schedule(schedule, p, num_microbatches, q, v, microbatch_group, costs, weights) for q in range(p)
        ]
        self.actions = schedules[s]
        self.chunks = [
            PipelineStage(
                sequential,
                group,
                stage_index=virtual_stage(s, c, p, self.placement),
                num_stages=v * p,
                balance=balance,
                stage_of=stage_of,
            )
            for c in range(v)
        ]
        self.stage: nn.Module = nn.ModuleList(self.chunks) if v > 1 else self.chunks[0]
        #: the deferred weight gradients of the schedules that split backward into B and W (else None)
        self.weight_grads: WeightGradStore | None = None
        if schedule in SPLIT_BACKWARD:
            self.weight_grads = WeightGradStore()
            for chunk in self.chunks:
                self.weight_grads.attach(chunk)
        #: the other schedules' store that adds each linear layer's weight gradient into ``.grad`` in its GEMM
        #: (``grad_accumulation_fusion``; None without it)
        self.fused_accumulation: WeightGradStore | None = None
        if grad_accumulation_fusion and self.weight_grads is None:
            eager = grad_accumulation_fusion == "auto" and graphs != "step"
            self.fused_accumulation = WeightGradStore(
                accumulate_in_place=graphs is not True, defers=False, min_macs=EAGER_FUSION_MACS if eager else 0
            )
            for chunk in self.chunks:
                self.fused_accumulation.attach(chunk)
        device = next((q.device for q in self.stage.parameters()), torch.device("cpu"))
        self.link = StageLink(
            group,
            s,
            p,
            device,
            virtual_stages=v,
            grad_group=grad_group,
            placement=self.placement,
            lookahead=lookahead,
            transport=transport,
            in_place=in_place,
            send_engine=send_engine,
        )
        self.link.plan(schedules)
        self.group = group
        self._loss_stage = stage_of_virtual(v * p - 1, p, self.placement)[0]
        #: on a GPU, time the training steps' actions and messages on the device (CUDA events on the compute
        #: stream, :class:`~dtrain.parallel.pipeline_parallel_communications.DeviceClock`): :attr:`timeline` then
        #: holds device times (``clock`` "device"). A step so timed starts on a drained stream and pays an event
        #: pair an action; its events are read when :attr:`timeline` is. Set it for the steps whose timeline is
        #: read. On the CPU the timeline is on the host clock either way.
        self.device_clock = False
        self._timeline: Timeline | None = None
        self._clock: DeviceClock | None = None  # the last step's device clock, until its timeline is read
        if graphs and device.type != "cuda":
            raise ValueError(f"graphs={graphs!r} needs the stage's parameters on a CUDA device, not {device}")
        #: False; True: each (chunk, micro-batch)'s forward and backward replay as CUDA graphs; "step": the whole
        #: step does (:meth:`train_step`)
        self.graphs = graphs
        self._step_graph: step_graph.RecordedStep | None = None
        self._steps_run = 0  # training steps run eagerly
        self._step_fallback = False  # "step" fell back to True (the stages stayed on the process groups)
        self._graphed: dict[tuple[int, int], nn.Module] | None = None
        self._shapes: dict[tuple[int, int], tuple] = {}  # (chunk, mb) -> the arguments' shapes of the first step
        # (chunk, mb) -> its B graph's deferred weight gradients: (weight, bias, input, grad_output) in the graph's pool
        self._recorded_w: dict[tuple[int, int], list] = {}

    @property
    def timeline(self) -> Timeline | None:
        """What this rank did in the last training step (None before the first). Where that step was timed on the
        device (:attr:`device_clock`), the first read waits for the step's end on the device and puts the device
        times in. A step replayed as one CUDA graph (``graphs="step"``) leaves a timeline of clock "none": no
        events, no bubble."""
        if self._clock is not None:
            clock, self._clock = self._clock, None
            clock.finish(self._timeline)
        return self._timeline

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.stage.parameters()

    def forget_shapes(self) -> None:
        """Agree the messages' shapes again at the next step, and drop the CUDA graphs recorded for the old ones
        (every stage of the group must call it, before a batch of another shape)."""
        self.link.forget_shapes()
        self._graphed, self._shapes, self._recorded_w = None, {}, {}
        self._step_graph, self._steps_run = None, 0
        if self.graphs is True and self._step_fallback:
            self.graphs = "step"
            self._fuse_accumulation(True)

    def _fuse_accumulation(self, on: bool) -> None:
        """Gradient-accumulation fusion on or off where it was asked for. Off under ``graphs=True``: a backward
        graph captured while ``.grad`` exists would add into that tensor at every replay, whatever ``.grad`` is
        then."""
        if self.fused_accumulation is not None:
            self.fused_accumulation.accumulate_in_place = on

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the model's first layers (and so needs the batch)."""
        return self.chunks[0].is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the model's last layers (and so needs the targets and computes the loss)."""
        return any(chunk.is_last for chunk in self.chunks)

    def train_step(
        self,
        batch: torch.Tensor | None,
        targets: torch.Tensor | None,
        loss_fn: LossFn,
        *,
        forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        forward_only: bool = False,
    ) -> torch.Tensor:
        """One pipelined forward and backward of ``batch``; gradients accumulate into this stage's ``.grad``.

        ``forward_only`` runs the schedule's forward actions alone, without autograd (evaluation): the same
        micro-batches cross the same stages, nothing is kept for a backward, and :attr:`timeline` is left as the
        last training step's.

        ``forward_context`` (optional) makes the context each forward (and loss) runs in, e.g. ``torch.autocast``;
        backward runs outside it. Activations cross stages in the dtype they have (a bf16 tensor as bf16, the
        fp32 residual stream of an autocast model as fp32): the header of each step carries it.

        ``batch`` is needed on the first stage and ``targets`` on the last (others may pass None); both are split
        along dim 0 into ``num_microbatches`` equal micro-batches. Returns the batch's mean loss (the sum of the
        micro-batch losses / m) on every stage of the group. The caller steps and zeroes the optimizer.
        """
        if self.graphs == "step" and not forward_only:
            start = time.perf_counter()
            loss = self._step_graphed(batch, targets, loss_fn, forward_context)
            if loss is not None:
                self._timeline = Timeline(
                    stage=self.stage_index,
                    num_stages=self.num_stages,
                    num_microbatches=self.num_microbatches,
                    virtual_stages=self.virtual_stages,
                    start_s=start,
                    end_s=time.perf_counter(),
                    clock="none",
                )
                self._clock = None
                comm.broadcast(loss, self._loss_stage, group=self.group)
                return loss
        if self.graphs is True and self._graphed is None and self._shapes and not forward_only:
            # at the start of a step, not the end of the first: no autograd graph of an eager step is alive then,
            # whose nodes would tie the capture to the stream the eager step ran on
            self._capture(loss_fn, forward_context)
        loss = self._run_step(batch, targets, loss_fn, forward_context, forward_only)
        if not forward_only:
            self._steps_run += 1
        comm.broadcast(loss, self._loss_stage, group=self.group)
        return loss

    def _run_step(
        self,
        batch: torch.Tensor | None,
        targets: torch.Tensor | None,
        loss_fn: LossFn,
        forward_context: Callable[[], contextlib.AbstractContextManager] | None,
        forward_only: bool,
        capturing: bool = False,
    ) -> torch.Tensor:
        """The step's actions, eagerly (or as they are recorded into the step's graph, ``capturing``); returns
        the loss on the last stage (zero elsewhere), before it is broadcast."""
        m = self.num_microbatches
        inputs = _split(batch, m, "batch") if batch is not None else None
        labels = _split(targets, m, "targets") if targets is not None else None
        if self.is_first and inputs is None:
            raise ValueError("the first pipeline stage needs the batch")
        if self.is_last and labels is None:
            raise ValueError("the last pipeline stage needs the targets")
        timeline = Timeline(
            stage=self.stage_index, num_stages=self.num_stages, num_microbatches=m, virtual_stages=self.virtual_stages
        )
        timed = self.device_clock and not (forward_only or capturing) and DeviceClock.available(self.link.device)
        clock = DeviceClock(self.link.device) if timed else None
        timeline.start_s = clock.start_s if clock is not None else time.perf_counter()
        self.link.begin_step(timeline, forward_only=forward_only, clock=clock)
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (chunk, mb) -> (input, output or loss)
        live: set[tuple[int, int]] = set()  # (chunk, mb) whose activations or deferred weight gradients are kept
        replayed: set[tuple[int, int]] = set()  # (chunk, mb) whose forward and B ran as graphs in this step
        loss = torch.zeros((), device=self.link.device)
        context = forward_context if forward_context is not None else contextlib.nullcontext
        if forward_only:
            base = context
            context = lambda: _both(base(), torch.no_grad())  # noqa: E731
        actions = [a for a in self.actions if a[0] == "F"] if forward_only else self.actions
        store = self.weight_grads
        try:
            for index, action in enumerate(actions):
                kind, mb, chunk = action[0], action[1], chunk_of(action)
                stage = self.chunks[chunk]
                self.link.poll_sends()
                if kind == "F":
                    x = inputs[mb] if stage.is_first else self._recv_input(mb, chunk)
                    start = time.perf_counter()
                    marked = clock.mark() if clock is not None else None  # after the stream's wait for x
                    args = (x, labels[mb]) if stage.is_last else (x,)
                    graphed = self._replay(chunk, mb, args) if not forward_only else None
                    with dropouts.rows(mb * x.shape[0]):  # the micro-batch's first row in the batch
                        if graphed is not None:
                            y = graphed(*args)
                            replayed.add((chunk, mb))
                        else:
                            with context():
                                y = stage(x)
                                if stage.is_last:
                                    y = loss_fn(y, labels[mb]) / m
                    if stage.is_last:
                        loss += y.detach().float()
                    event = TimelineEvent("F", mb, start, time.perf_counter(), chunk=chunk)
                    timeline.events.append(event)
                    if clock is not None:
                        clock.add(event, marked)
                    if not forward_only:
                        held[chunk, mb] = (x, y)
                        live.add((chunk, mb))
                    timeline.peak_activations = max(timeline.peak_activations, len(live))
                    if not stage.is_last:
                        self.link.send_forward(y, mb, chunk)
                elif kind == "B":
                    self._backward(stage, chunk, mb, *held.pop((chunk, mb)), timeline, clock)
                    if store is None:
                        live.discard((chunk, mb))
                else:
                    start = time.perf_counter()
                    marked = clock.mark() if clock is not None else None
                    if (chunk, mb) in replayed:  # the B graph left its layers' inputs and output gradients
                        store.run(self._recorded_w[chunk, mb])
                    else:
                        store.flush((chunk, mb))
                    event = TimelineEvent("W", mb, start, time.perf_counter(), chunk=chunk)
                    timeline.events.append(event)
                    if clock is not None:
                        clock.add(event, marked)
                    live.discard((chunk, mb))
                self.link.prefetch(index)
            self.link.wait_sends()
            if clock is not None:
                clock.stop()  # the stream has waited for the sends
        finally:
            if store is not None:
                store.clear()
        timeline.end_s = time.perf_counter()
        self.link.begin_step(None)
        if not forward_only and not capturing:
            self._timeline, self._clock = timeline, clock
        return loss

    def _step_graphed(
        self,
        batch: torch.Tensor | None,
        targets: torch.Tensor | None,
        loss_fn: LossFn,
        forward_context: Callable[[], contextlib.AbstractContextManager] | None,
    ) -> torch.Tensor | None:
        """The step as a replay of its graph (recorded first where due); None where it runs eagerly: the first
        two steps, or all of them where the stages stayed on the process groups (then ``graphs=True`` takes
        over, from the shapes the eager steps recorded)."""
        if self._step_graph is None:
            if self._steps_run < 2:
                return None
            if self.link.transport_in_use != "peer":
                self.graphs, self._step_fallback = True, True
                self._fuse_accumulation(False)
                return None
            self._step_graph = self._capture_step(batch, targets, loss_fn, forward_context)
        return self._step_graph.replay((batch, targets))

    def _capture_step(
        self,
        batch: torch.Tensor | None,
        targets: torch.Tensor | None,
        loss_fn: LossFn,
        forward_context: Callable[[], contextlib.AbstractContextManager] | None,
    ) -> step_graph.RecordedStep:
        """Record the whole step (:meth:`_run_step`, every action and message of this stage) as one CUDA graph,
        on static copies of ``batch`` and ``targets``, with every ``.grad`` None so that the graph makes the
        gradients afresh; forwards run with autocast's cast cache off (a cast made in the recording would be read
        stale). Nothing runs: the graph's first replay is this step."""
        if self.is_first and batch is None:
            raise ValueError("the first pipeline stage needs the batch")
        if self.is_last and targets is None:
            raise ValueError("the last pipeline stage needs the targets")
        params = [q for q in self.parameters() if q.requires_grad]
        base = forward_context if forward_context is not None else contextlib.nullcontext
        probe = params[0] if params else None
        context = lambda: step_graph.uncached_within(base, probe)  # noqa: E731
        self.link.capturing = True
        try:
            return step_graph.record_step(
                lambda b, t: self._run_step(b, t, loss_fn, context, False, capturing=True),
                [batch if self.is_first else None, targets if self.is_last else None],
                params,
                self.link.device,
                names=("batch", "targets"),
                label="graphs='step'",
                hint="call forget_shapes() on every stage's pipeline first",
            )
        finally:
            self.link.capturing = False

    def _replay(self, chunk: int, mb: int, args: tuple[torch.Tensor, ...]) -> nn.Module | None:
        """The graphed forward of (``chunk``, ``mb``) where one was captured for arguments of these shapes; else
        None (the first step, which runs eagerly and records the shapes, or a batch of another shape)."""
        if not self.graphs:
            return None
        shapes = tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args)
        if self._graphed is None:
            self._shapes[chunk, mb] = shapes
            return None
        return self._graphed.get((chunk, mb)) if self._shapes.get((chunk, mb)) == shapes else None

    def _capture(self, loss_fn: LossFn, forward_context=None) -> None:
        """Record every (chunk, micro-batch)'s forward and backward as CUDA graphs
        (``torch.cuda.make_graphed_callables``), from the shapes the first step recorded. Each micro-batch gets
        graphs of its own, so that the activations of the micro-batches in flight stay apart;
        the last stage's graphs include the loss. Parameters are shared with the eager modules, and their
        gradients accumulate into ``.grad`` as in an eager step. Every later step with the same shapes replays
        them: a forward or backward costs one graph launch of host time instead of one launch per kernel, which
        sets the pace of a pipeline once micro-batches are small."""
        keys = sorted(self._shapes)
        modules, samples = [], []
        for chunk, mb in keys:
            stage = self.chunks[chunk]
            modules.append(
                _Graphable(stage, loss_fn if stage.is_last else None, self.num_microbatches, forward_context)
            )
            samples.append(
                tuple(
                    torch.zeros(shape, dtype=dtype, device=self.link.device).requires_grad_(grad)
                    for shape, dtype, grad in self._shapes[chunk, mb]
                )
            )
        # the step's sends and collectives are done, the watchdogs have seen them finish, no old graph is collected
        store = self.weight_grads
        deferring = [store.deferring(key) if store else contextlib.nullcontext() for key in keys]
        with step_graph.quiet_capture(self.link.device):
            graphed = _make_graphed(tuple(modules), tuple(samples), tuple(deferring), store is not None)
        if store is not None:
            for key in keys:
                self._recorded_w[key] = _captured_entries(store.take(key), key)
        self._graphed = dict(zip(keys, graphed, strict=True))

    def _recv_input(self, mb: int, chunk: int) -> torch.Tensor:
        x = self.link.recv_forward(mb, chunk)
        return x.requires_grad_() if x.is_floating_point() else x

    def _backward(
        self,
        stage: PipelineStage,
        chunk: int,
        mb: int,
        x: torch.Tensor,
        y: torch.Tensor,
        timeline: Timeline,
        clock: DeviceClock | None = None,
    ) -> None:
        # a stage receives a gradient for every floating output it sent, and sends one for every floating input
        # it received, so both ends agree on the messages whether or not autograd needs them
        grad = None
        if not stage.is_last and y.is_floating_point():
            grad = self.link.recv_backward(mb, chunk)
        start = time.perf_counter()
        marked = clock.mark() if clock is not None else None  # after the stream's wait for grad
        if y.requires_grad:
            deferring = self.weight_grads.deferring((chunk, mb)) if self.weight_grads else contextlib.nullcontext()
            with deferring:
                torch.autograd.backward(y, grad)
        event = TimelineEvent("B", mb, start, time.perf_counter(), chunk=chunk)
        timeline.events.append(event)
        if clock is not None:
            clock.add(event, marked)
        if not stage.is_first and x.is_floating_point():
            self.link.send_backward(x.grad if x.grad is not None else torch.zeros_like(x), mb, chunk)


class _Graphable(nn.Module):
    """One (chunk, micro-batch)'s forward as a module of its own for ``torch.cuda.make_graphed_callables``, which
    replaces a module's ``forward`` with its graphed one: the chunk itself is shared, its parameters too; on the
    model's last chunk the forward includes the micro-batch's loss (divided by ``m``). ``context`` (the step's
    ``forward_context``, e.g. autocast) is entered around the recorded forward; an autocast in it is recorded with
    its cast cache off, as CUDA graphs need (``torch.cuda.make_graphed_callables``' documentation: a cached cast
    would be made once, in the capture, and then read stale)."""

    def __init__(
        self,
        stage: nn.Module,
        loss_fn: LossFn | None,
        num_microbatches: int,
        context: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        super().__init__()
        self.stage, self.loss_fn, self.m, self.context = stage, loss_fn, num_microbatches, context

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        with self.context() if self.context is not None else contextlib.nullcontext(), step_graph.uncached_autocast(x):
            y = self.stage(x)
            return y if self.loss_fn is None else self.loss_fn(y, target) / self.m


#: Eager forwards and backwards ``torch.cuda.make_graphed_callables`` runs before it captures (its default).
WARMUP_ITERS = 3


def _make_graphed(
    modules: tuple[nn.Module, ...],
    samples: tuple[tuple[torch.Tensor, ...], ...],
    contexts: tuple[contextlib.AbstractContextManager, ...],
    split: bool = False,
) -> tuple:
    """Each module's forward and backward as CUDA graphs with a memory pool of its own, captured within its
    context (tests on the CPU put a stand-in here): ``torch.cuda.make_graphed_callables``, or, where the backward
    is split (``split``: ZB-H1, ZB-V), :class:`_SplitGraphed`. One pool for all would need the graphs replayed in
    the order they were captured (every forward, then every backward in reverse), which a pipeline schedule does
    not do: on an H100, four micro-batches' graphs sharing a pool, replayed forward then backward in micro-batch
    order, gave gradients off by 170 %; a pool each gave the eager gradients exactly."""
    graphed = []
    for module, args, context in zip(modules, samples, contexts, strict=True):
        with context:
            if split:
                graphed.append(_SplitGraphed(module, args))
            else:
                graphed.append(
                    torch.cuda.make_graphed_callables(
                        module, args, num_warmup_iters=WARMUP_ITERS, allow_unused_input=True
                    )
                )
    return tuple(graphed)


class _SplitGraphed:
    """A module's forward and its B (the backward without the deferred weight gradients) as two CUDA graphs,
    replayed through an autograd function as ``torch.cuda.make_graphed_callables`` replays its own; captured within
    the weight-gradient store's deferral, so that B leaves each linear layer's input and output gradient in tensors
    of the graphs' pool for W.

    The difference from ``make_graphed_callables``: B's ``autograd.grad`` asks only for the arguments' gradients and
    the parameters whose gradients B computes, not for the deferred weights. With the deferred weights among its
    inputs, the second (chunk, micro-batch) captured over the same layers failed on an H100 ("dependency created on
    uncaptured work in another stream"); without them, every capture ran and the replays gave the eager gradients.
    ``autograd.backward`` fails there alike (it runs the deferred weights' gradient accumulators), so where nothing
    B computes is asked for (a first stage of linear layers, whose input needs no gradient) B computes the input's
    gradient all the same, one product a micro-batch more, and the replay discards it."""

    def __init__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        params = list(module.parameters())
        deferred = set()
        for sub in module.modules():
            if getattr(sub, "weight_grad_store", None) is not None:
                deferred.update(
                    id(q) for q in (getattr(sub, "weight", None), getattr(sub, "bias", None)) if q is not None
                )
        self.params = tuple(params)
        self.kept = tuple(q for q in params if id(q) not in deferred and q.requires_grad)  # their gradients B makes
        if not any(a.requires_grad for a in args) and not self.kept and args[0].is_floating_point():
            args = (args[0].detach().requires_grad_(), *args[1:])
        self.static_args = args
        wanted = [a for a in args if a.requires_grad] + list(self.kept)
        if not wanted:
            raise ValueError("graphs=True: a zero-bubble chunk with no floating input and only deferred parameters")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up, as make_graphed_callables does: lazy initialisation off the graphs
            for _ in range(WARMUP_ITERS):
                out = module(*args)
                torch.autograd.grad(out, wanted, torch.ones_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool):
            self.static_out = module(*args)
        self.static_grad_out = torch.empty_like(self.static_out)
        with torch.cuda.graph(self.backward_graph, pool=pool):
            grads = list(torch.autograd.grad(self.static_out, wanted, self.static_grad_out, allow_unused=True))
        kept = {id(q) for q in self.kept}
        self.static_arg_grads = tuple(grads.pop(0) if a.requires_grad else None for a in args)
        self.static_param_grads = tuple(grads.pop(0) if id(q) in kept else None for q in params)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return _ReplaySplit.apply(self, len(args), *args, *self.params)


class _ReplaySplit(torch.autograd.Function):
    """Replays a :class:`_SplitGraphed`: the forward graph on the new arguments, and in backward the B graph."""

    @staticmethod
    def forward(ctx, graphed: _SplitGraphed, count: int, *inputs):  # noqa: ANN001
        for static, new in zip(graphed.static_args, inputs[:count], strict=True):
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)
        graphed.forward_graph.replay()
        ctx.graphed = graphed
        return graphed.static_out.detach()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        graphed = ctx.graphed
        if grad.data_ptr() != graphed.static_grad_out.data_ptr():
            graphed.static_grad_out.copy_(grad)
        graphed.backward_graph.replay()
        arg_grads = tuple(
            g.detach() if g is not None and needed else None
            for g, needed in zip(graphed.static_arg_grads, ctx.needs_input_grad[2:], strict=False)
        )
        param_grads = tuple(g.detach() if g is not None else None for g in graphed.static_param_grads)
        return (None, None, *arg_grads, *param_grads)


def _captured_entries(entries: list, key: tuple[int, int]) -> list:
    """Of what a (chunk, micro-batch)'s B pushed to the weight-gradient store during its capture (each warm-up
    backward, then the captured one), the captured backward's entries: the tensors its replays rewrite."""
    runs = WARMUP_ITERS + 1
    if len(entries) % runs:
        raise RuntimeError(
            f"graphs=True: chunk {key[0]}, micro-batch {key[1]} deferred {len(entries)} weight gradients over "
            f"{runs} backwards of its capture, not the same number in each"
        )
    return entries[len(entries) - len(entries) // runs :]


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def _split(tensor: torch.Tensor, num_microbatches: int, name: str) -> tuple[torch.Tensor, ...]:
    size = tensor.shape[0] if tensor.dim() else 0
    if size == 0 or size % num_microbatches:
        raise ValueError(
            f"{name} of {size} samples cannot be split into {num_microbatches} equal micro-batches; "
            f"use a batch size that is a multiple of {num_microbatches}"
        )
    return tensor.chunk(num_microbatches)
