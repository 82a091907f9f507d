"""Hybrid (3-D) parallelism: tensor parallel inside a layer, pipeline over layers, data parallel over replicas.

The composition of Megatron-LM's PTD-P (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 2.3), and the one ``dtrain train`` runs. On a
:class:`~dtrain.parallel.grid.RankGrid`:

- ``tp > 1``: the single-device ``nn.Sequential`` is turned into its tensor-parallel twin over ``grid.tp_group``:
  :func:`~dtrain.parallel.parallelize.tensor_parallelize` for a model whose parts declare
  ``tensor_parallel_plan`` (:mod:`dtrain.models`), or the ``tensor_parallel`` function the caller passes
  (:func:`tensor_parallel_blocks` for a stack of MLP blocks). Its layers' outputs are whole on every
  tensor-parallel rank (the row-parallel all-reduce), so it is still an ``nn.Sequential`` that the pipeline cuts
  and data parallelism wraps unchanged;
- ``pp > 1``: the layers are cut into stages over ``grid.pp_group`` by :class:`~dtrain.parallel.
  pipeline_parallel.PipelineParallel` (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019; interleaved
  1F1B, Narayanan et al. 2021), ``m`` micro-batches a step; pipeline groups join ranks of equal ``tp_rank``.
  After the pipelined backward, each stage's gradients are averaged over ``grid.dp_group`` with one all-reduce
  of the flattened gradients (or ZeRO's reduction). A parameter shared by layers on two stages (a tied
  embedding: the table on the first stage, the LM head on the last) is kept by both; after backward its two
  gradients are summed over the ranks of equal (dp, tp) coordinates holding it, Megatron-LM's embedding group,
  so both copies take the same update;
- ``pp == 1``: the model is wrapped in :class:`~dtrain.parallel.data_parallel.DataParallel` over
  ``grid.dp_group`` (gradients averaged bucket by bucket while backward runs), or its optimizer is a
  :class:`~dtrain.parallel.zero.ZeroOptimizer` over it (``zero_stage`` 1 or 2; Rajbhandari et al. 2020);
- ``zero_stage=3`` (any ``pp``): each layer of this rank's stage is a unit of
  :class:`~dtrain.parallel.fsdp.FullyShardedDataParallel` over ``grid.dp_group`` (or hybrid sharding within
  blocks of ``shard_size`` dp ranks), which holds the float32 shards of the tp-local parameters, gathers a layer
  only while it computes and is the optimizer;
- each replica (``grid.dp_group``) trains on its equal shard of the global batch (:func:`~dtrain.parallel.
  data_parallel.split_batch`), in ``accumulation`` chunks a step, and the reported loss is the replicas' mean
  losses averaged: the loss of the whole global batch.

The gradient norm is that of the whole model (:mod:`dtrain.parallel.gradients`), so clipping and the fp16
loss-scale overflow check act as on one device. With equal shards and a loss that averages over the batch, one
step equals one process training the unsplit model on the whole global batch (``tests/parallel/`` checks every
layout against that, float32).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dtrain import comm
from dtrain.models import dropout as dropouts
from dtrain.parallel import gradients, step_graph
from dtrain.parallel.data_parallel import DataParallel, broadcast_algorithm, broadcast_parameters, split_batch
from dtrain.parallel.fsdp import FullyShardedDataParallel, hybrid_shard_groups
from dtrain.parallel.grid import RankGrid
from dtrain.parallel.parallelize import tensor_parallelize
from dtrain.parallel.pipeline_parallel import LossFn, PipelineParallel, partition_layers
from dtrain.parallel.pipeline_schedules import PLACEMENT, SPLIT_BACKWARD, chunks_per_stage, stage_of_virtual
from dtrain.parallel.step_graph import GraphedStep
from dtrain.parallel.tensor_parallel import ParallelMLP
from dtrain.parallel.zero import ZeroOptimizer

__all__ = ["HybridParallel", "OptimizerFactory", "TensorParallelize", "tensor_parallel_blocks"]

#: builds the optimizer from this rank's named parameters (names as in the whole model's ``named_parameters``),
#: so that it can make parameter groups by name and dimension (no weight decay on norms and biases)
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
TensorParallelize = Callable[[nn.Sequential, object], nn.Sequential]  # (single-device model, tp_group) -> twin


def _mlp_pair(block: nn.Module, index: int) -> tuple[nn.Linear, nn.Linear]:
    """The (first, second) linears of a ``Sequential(Linear(d, h), GELU(), Linear(h, d))`` block, or ValueError."""
    kinds = [type(layer).__name__ for layer in block] if isinstance(block, nn.Sequential) else [type(block).__name__]
    ok = (
        kinds == ["Linear", "GELU", "Linear"]
        and block[1].approximate == "none"  # ParallelMLP applies the exact GELU
        and block[0].in_features == block[2].out_features
        and block[0].out_features == block[2].in_features
        and block[0].bias is not None
        and block[2].bias is not None
    )
    if not ok:
        raise ValueError(
            f"block {index} is {kinds}; each block must be Sequential(Linear(d, h), GELU(), Linear(h, d)) with "
            "biases and the exact GELU, the single-device form of a ParallelMLP"
        )
    return block[0], block[2]


def tensor_parallel_blocks(blocks: Sequence[nn.Module], tp_group, *, algorithm: str = "auto") -> nn.Sequential:
    """Each single-device MLP block as a :class:`ParallelMLP` over ``tp_group`` holding this rank's shard of it.

    Nothing is communicated: every rank copies its slice of the weights (``init_from``), so the blocks must be
    the same on every rank (built from one seed). A frozen weight or bias (``requires_grad=False``) stays frozen in
    its shard.
    """
    pairs = [_mlp_pair(block, i) for i, block in enumerate(blocks)]
    if not pairs:
        raise ValueError("tensor_parallel_blocks: no blocks given; a model needs at least one block")
    parallel = []
    for fc_in, fc_out in pairs:
        mlp = ParallelMLP(
            fc_in.in_features, fc_in.out_features, tp_group, algorithm=algorithm, init_from=(fc_in, fc_out)
        )
        for shard, full in ((mlp.fc_in, fc_in), (mlp.fc_out, fc_out)):
            for name, param in shard.named_parameters(recurse=False):
                param.requires_grad_(getattr(full, name).requires_grad)
        parallel.append(mlp)
    return nn.Sequential(*parallel)


class HybridParallel:
    """Trains ``model`` (an ``nn.Sequential``) with ``grid.dims.dp`` x ``pp`` x ``tp`` parallelism; this rank
    holds its shard (``tp``) of its stage's layers (``pp``) of one replica (``dp``).

    ``model`` is the single-device model, identical on every rank (built from one seed). With ``tp > 1`` it is
    split by ``tensor_parallel(model, grid.tp_group)``, by default :func:`~dtrain.parallel.parallelize.
    tensor_parallelize` (logits left split by vocabulary: use :func:`~dtrain.parallel.parallelize.causal_lm_loss`).
    ``optimizer`` builds the optimizer from this rank's ``(name, parameter)`` pairs. ``device`` (optional) is
    where the model and each batch go. ``schedule``, ``num_microbatches``, ``virtual_stages``, ``microbatch_group``
    (interleaved 1F1B's), ``schedule_costs`` (one micro-batch's forward, input-gradient and weight-gradient cost that
    ZB-V's order is built for, :class:`~dtrain.parallel.pipeline_parallel.PipelineParallel`) and ``balance``
    ("layers", "params" or "flops") are the pipeline's (``pp > 1`` only).
    ``algorithm`` is the gradient all-reduce's (``dtrain.comm.algorithms("all_reduce")``); the initial parameter
    broadcast uses the same name where broadcast has it, else ``"auto"``. Replicas start from dp rank 0's
    parameters and buffers, frozen parameters included, under every ZeRO stage. ``dp_exchange`` is
    :class:`~dtrain.parallel.data_parallel.DataParallel`'s ``exchange`` (``pp == 1`` and ``zero_stage == 0``):
    "collective", or "copy-engine" on one host.

    ``zero_stage`` 1 or 2 shards the optimizer state (and with 2 the gradients) over the dp group
    (:class:`~dtrain.parallel.zero.ZeroOptimizer`, built from the optimizer the factory returns: its class and
    param groups); 3 the parameters too (:class:`~dtrain.parallel.fsdp.FullyShardedDataParallel`, each layer of
    the stage a unit, the same optimizer class and groups over the shards; :attr:`optimizer` is it). Under
    stage 3 ``shard_size`` (a divisor of dp; default dp) shards within blocks of that many dp ranks and
    replicates across them (hybrid sharding), and a bf16 ``autocast_dtype`` also makes bf16 the dtype the
    layers are gathered and computed in (float32 shards). ``autocast_dtype`` runs forward and loss under
    ``torch.autocast`` on the model's device type; ``pipeline_graphs`` replays the pipeline's micro-batches as CUDA
    graphs (:class:`~dtrain.parallel.pipeline_parallel.PipelineParallel` ``graphs=True``), or with "step" each
    stage's whole step as one, and ``pipeline_transport`` is its ``transport``;
    ``reduce_dtype`` is the dtype gradients are averaged in. ``step_graph`` records each step as one CUDA graph
    from the third on and replays it (:mod:`dtrain.parallel.step_graph`): for ``pp == 1`` the forward, loss and
    backward of every accumulation chunk with DataParallel's reductions inside (:attr:`graphed`; the norm,
    clipping, loss average and optimizer step run eagerly after it), for ``pp > 1`` each stage's step
    (``pipeline_graphs="step"``); refused with ``tp > 1``, ZeRO-2 and 3, and off GPUs. ``accumulation`` splits
    each replica's rows into that many chunks, one forward and backward each (the pipeline runs once per chunk),
    with one gradient reduction and one optimizer step. ``overlap_optimizer`` (dp > 1, pp = 1, no ZeRO) steps the
    optimizer inside the last chunk's backward (:meth:`DataParallel.overlap_optimizer`: every bucket's parameters
    but the last's while the last bucket is averaged), so :meth:`train_step` takes no ``max_grad_norm`` and no
    ``loss_scaler``; with ``step_graph`` the optimizer's step is recorded too, which needs an optimizer built
    capturable with a tensor learning rate (torch's schedulers, and :func:`dtrain.train.optim.set_lr`, fill it in
    place). ``grad_accumulation_fusion`` (``pp > 1`` with ZeRO 0 or 1, whose gradients are reduced after the step)
    adds each linear layer's weight gradient into ``.grad`` inside its GEMM from a stage's second micro-batch on
    (:class:`~dtrain.parallel.pipeline_parallel.PipelineParallel`'s; "auto", the default: every call where each
    stage's step is recorded, eagerly where a layer's product is large enough to pay for its Python autograd
    function's host time); turn it off for a model that ``torch.compile`` traces. Where pipeline stages share a
    parameter (a tied embedding), every process of the world must construct this object (it makes process groups), as
    :meth:`RankGrid.build` requires.

    After each :meth:`train_step`: :attr:`last_grad_norm` (the whole model's gradient norm before clipping,
    unscaled), :attr:`step_skipped` (an fp16 overflow skipped the optimizer step) and :attr:`timings`, its phases
    in seconds: ``compute_s`` (forward and backward; for ``pp == 1`` with the overlapped gradient all-reduce),
    ``comm_s`` (gradient averaging for ``pp > 1``, the norm and the loss average) and ``optimizer_s``.
    """

    def __init__(
        self,
        model: nn.Sequential,
        grid: RankGrid,
        optimizer: OptimizerFactory,
        *,
        tensor_parallel: TensorParallelize | None = None,
        num_microbatches: int = 1,
        schedule: str = "1f1b",
        pipeline_graphs: bool | str = False,
        pipeline_transport: str = "auto",
        virtual_stages: int = 1,
        microbatch_group: int | None = None,
        algorithm: str = "auto",
        device: torch.device | None = None,
        zero_stage: int = 0,
        autocast_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        dp_exchange: str = "collective",
        accumulation: int = 1,
        balance: str = "layers",
        shard_size: int | None = None,
        step_graph: bool = False,
        overlap_optimizer: bool = False,
        grad_accumulation_fusion: bool | str = "auto",
        schedule_costs: tuple[float, float, float] | None = None,
    ) -> None:
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        if shard_size is not None and zero_stage != 3:
            raise ValueError(f"shard_size={shard_size!r} shards parameters: it needs zero_stage=3, got {zero_stage}")
        if not isinstance(accumulation, int) or isinstance(accumulation, bool) or accumulation < 1:
            raise ValueError(f"accumulation must be a positive int, got {accumulation!r}")
        if balance not in ("layers", "params", "flops"):
            raise ValueError(f"balance must be 'layers', 'params' or 'flops', got {balance!r}")
        if grad_accumulation_fusion not in (False, True, "auto"):
            raise ValueError(
                f"grad_accumulation_fusion must be False, True or 'auto', got {grad_accumulation_fusion!r}"
            )
        if grad_accumulation_fusion is True and (grid.dims.pp == 1 or zero_stage >= 2):
            raise ValueError(
                "grad_accumulation_fusion=True adds a pipeline stage's micro-batch weight gradients inside their "
                f"products: it needs pp > 1 and zero_stage 0 or 1 (got pp {grid.dims.pp}, zero_stage {zero_stage})"
            )
        if pipeline_graphs and grid.dims.pp == 1:
            raise ValueError(
                f"pipeline_graphs={pipeline_graphs!r} replays a pipeline's micro-batches; pp is 1 (step_graph=True "
                "records the step of pp = 1)"
            )
        if step_graph:
            refused = [
                (grid.dims.tp > 1, "tp > 1 (its collectives run inside each forward)"),
                (zero_stage >= 2, f"zero_stage={zero_stage} (its reductions run inside the backward)"),
                (grid.dims.pp > 1 and pipeline_graphs not in (False, "step"), "pipeline_graphs (one or the other)"),
            ]
            reason = next((why for bad, why in refused if bad), None)
            if reason is not None:
                raise ValueError(f"step_graph=True does not run with {reason}")
            pipeline_graphs = "step" if grid.dims.pp > 1 else pipeline_graphs
        if dp_exchange != "collective" and (grid.dims.pp > 1 or zero_stage or grid.dims.dp == 1):
            raise ValueError(
                f"dp_exchange={dp_exchange!r} is DataParallel's: it needs dp > 1, pp = 1 and zero_stage = 0 (got dp "
                f"{grid.dims.dp}, pp {grid.dims.pp}, zero_stage {zero_stage})"
            )
        if overlap_optimizer and (grid.dims.pp > 1 or zero_stage or grid.dims.dp == 1):
            raise ValueError(
                "overlap_optimizer=True steps DataParallel's optimizer inside backward: it needs dp > 1, pp = 1 and "
                f"zero_stage = 0 (got dp {grid.dims.dp}, pp {grid.dims.pp}, zero_stage {zero_stage})"
            )
        if microbatch_group is not None and grid.dims.pp == 1:
            raise ValueError(f"microbatch_group={microbatch_group!r} groups a pipeline's micro-batches; pp is 1")
        if zero_stage in (2, 3) and grid.dims.pp > 1 and schedule in SPLIT_BACKWARD:
            raise ValueError(
                f"zero_stage={zero_stage} reduces gradients during backward; schedule {schedule!r} defers the weight "
                "gradients to W, after the reduction"
            )
        self.grid, self.algorithm, self.device = grid, algorithm, device
        self.zero_stage, self.accumulation, self.reduce_dtype = zero_stage, accumulation, reduce_dtype
        self.autocast_dtype, self.shard_size = autocast_dtype, shard_size
        dims = grid.dims
        # The single-device model's export names (a tied weight once, under its first name), shapes and dtypes.
        self._export: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        seen: set[int] = set()
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                self._export[name] = (tuple(t.shape), t.dtype)
        if dims.tp > 1:
            if tensor_parallel is None:
                if not any(getattr(m, "tensor_parallel_plan", None) for m in model.modules()):
                    raise ValueError(
                        f"HybridParallel: tp={dims.tp} needs tensor_parallel, the model's tensor-parallel form, or "
                        "a model whose parts declare tensor_parallel_plan"
                    )
                tensor_parallel = lambda m, g: tensor_parallelize(m, g, algorithm=algorithm)  # noqa: E731
            model = tensor_parallel(model, grid.tp_group)
        if device is not None:
            model = model.to(device)
        p = dims.pp
        v, placement = chunks_per_stage(schedule, virtual_stages), PLACEMENT.get(schedule, "loop")
        stage_of = [stage_of_virtual(u, p, placement)[0] for u in range(v * p)]
        cuts = partition_layers(model, v * p, balance=balance, stage_of=stage_of) if p > 1 else [range(len(model))]
        self._stage_of_layer = {
            layer: stage_of_virtual(u, p, placement)[0] for u, cut in enumerate(cuts) for layer in cut
        }
        if p > 1:  # every rank holds the whole model here: each finds a stage with nothing to train alike
            idle = _idle_stages(model, self._stage_of_layer, p)
            if idle:
                raise ValueError(
                    f"HybridParallel: pipeline stage(s) {idle} of {p} hold no parameter that requires grad, so their "
                    "optimizer would have nothing to step; freeze fewer layers there, or use fewer stages"
                )
        self.pipeline: PipelineParallel | None = None
        if p > 1:
            self.pipeline = PipelineParallel(
                model,
                grid.pp_group,
                num_microbatches=num_microbatches,
                schedule=schedule,
                virtual_stages=virtual_stages,
                microbatch_group=microbatch_group,
                schedule_costs=schedule_costs,
                grad_group=grid.pp_grad_group,
                balance=balance,
                graphs=pipeline_graphs,
                transport=pipeline_transport,
                # ZeRO-2 and 3 reduce gradients from their hooks during backward, which the fusion bypasses
                grad_accumulation_fusion=grad_accumulation_fusion if zero_stage in (0, 1) else False,
            )
            self.module: nn.Module = self.pipeline.stage
        else:
            self.module = model
        local = set(self.layer_indices)
        self._local_state = {
            name: t for name, t in model.state_dict(keep_vars=True).items() if _layer_of(name) in local
        }
        named, seen = [], set()
        for name, param in model.named_parameters(remove_duplicate=False):
            if _layer_of(name) in local and param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                named.append((name, param))
        self.named_params: list[tuple[str, nn.Parameter]] = named
        self.params = [param for _, param in named]
        self._tied = self._tie_groups(model)  # (parameter, group) of every copy this rank sums with other stages
        self._not_counted = {id(param) for param, _, owner in self._tied if not owner}
        if zero_stage and p > 1 and zero_stage == 2 and self._tied:
            raise ValueError(
                "zero_stage=2 with pp>1 and a parameter tied across stages is not supported: ZeRO-2 reduces the "
                "gradients during backward, before the stages' copies are summed; use zero_stage=1 or untie"
            )
        del model
        self._forward: nn.Module = self.module
        if zero_stage and dims.dp > 1:
            # ZeRO starts the parameters it shards from dp rank 0's; the stage's frozen parameters and buffers too
            rest = [q for q in self.module.parameters() if not q.requires_grad] + list(self.module.buffers())
            if rest:
                broadcast_parameters(rest, 0, grid.dp_group, algorithm=broadcast_algorithm(algorithm))
        if zero_stage == 3:
            self.optimizer = self._fully_sharded(optimizer(self.named_params))
        elif zero_stage:
            self.optimizer = self._zero_optimizer(optimizer(self.named_params))
        else:
            if p == 1 and dims.dp > 1:
                extra = {"reduce_dtype": reduce_dtype} if reduce_dtype is not None else {}
                self._forward = DataParallel(
                    self.module, grid.dp_group, algorithm=algorithm, exchange=dp_exchange, **extra
                )
            elif dims.dp > 1:  # DataParallel does the same for pp == 1
                broadcast_parameters(
                    [*self.module.parameters(), *self.module.buffers()],
                    0,
                    grid.dp_group,
                    algorithm=broadcast_algorithm(algorithm),
                )
            self.optimizer = optimizer(self.named_params)
        self.overlap_optimizer = overlap_optimizer
        if overlap_optimizer:
            if step_graph:
                _check_capturable(self.optimizer)
            assert isinstance(self._forward, DataParallel)
            self._forward.overlap_optimizer(self.optimizer)
        self._autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if autocast_dtype is not None:
            kind = next((q.device.type for q in self.params), "cpu") if device is None else torch.device(device).type
            self._autocast = lambda: torch.autocast(kind, dtype=autocast_dtype)
        self.timings: dict[str, float] = {}
        self._last_grad_norm: torch.Tensor | float = float("nan")
        self.step_skipped = False
        # pp == 1: forward, loss, backward and the overlapped gradient all-reduces recorded as one CUDA graph (the
        # pipeline records its own step)
        self.graphed: GraphedStep | None = None
        self._graphed_loss_fn: LossFn | None = None
        if step_graph and p == 1:
            where = torch.device(device) if device is not None else self.params[0].device
            if where.type != "cuda":
                raise ValueError(f"step_graph=True records CUDA graphs; the step would run on {where.type}")
            self.graphed = GraphedStep(
                self._forward_backward,
                self.params,
                where,
                label="step_graph",
                hint="call forget_step_graph() on every rank first",
            )

    def _zero_optimizer(self, made: torch.optim.Optimizer) -> ZeroOptimizer:
        """A ZeroOptimizer over the dp group with ``made``'s class and param groups (``made`` is dropped)."""
        cls = type(made)
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        groups = [{k: v for k, v in g.items() if k == "params" or k in accepted} for g in made.param_groups]
        extra = {"reduce_dtype": self.reduce_dtype} if self.reduce_dtype is not None else {}
        common = {"stage": self.zero_stage, "algorithm": self.algorithm, **extra}
        if len(groups) == 1:
            hyper = {k: v for k, v in groups[0].items() if k != "params"}
            return ZeroOptimizer(groups[0]["params"], cls, self.grid.dp_group, **common, **hyper)
        return ZeroOptimizer(groups, cls, self.grid.dp_group, **common)

    def _fully_sharded(self, made: torch.optim.Optimizer) -> FullyShardedDataParallel:
        """ZeRO-3 of this rank's stage, each of its layers a unit, with ``made``'s class and param groups (``made``
        is dropped). Where ``shard_size`` cuts the dp group, every process of the default group must construct
        the HybridParallel (groups are made; off the grid, call :func:`~dtrain.parallel.fsdp.hybrid_shard_groups`)."""
        grid = self.grid
        shard, replicate = grid.dp_group, None
        if self.shard_size is not None and self.shard_size != grid.dims.dp:
            shard, replicate = hybrid_shard_groups(grid.dims, self.shard_size, grid.base_ranks)
        cls = type(made)
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        groups = [{k: v for k, v in g.items() if k == "params" or k in accepted} for g in made.param_groups]
        chunks = self.pipeline.chunks if self.pipeline is not None else None
        units = [layer for chunk in chunks for layer in chunk.layers] if chunks else list(self.module)
        bf16 = self.autocast_dtype == torch.bfloat16
        return FullyShardedDataParallel(
            self.module,
            units,
            shard,
            groups,
            cls,
            replicate_group=replicate,
            separate=[param for param, _, _ in self._tied],
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=self.reduce_dtype,
            algorithm=self.algorithm,
        )

    def _tie_groups(self, model: nn.Sequential) -> list[tuple[nn.Parameter, object, bool]]:
        """For every parameter shared by layers on different stages: (this rank's copy, the group of the ranks
        of this rank's dp and tp coordinates that hold it, whether this rank's copy is the counted one (the
        first stage's)). Every rank makes every group, in one order (torch.distributed's rule)."""
        layers_of: dict[int, list[int]] = {}
        first: dict[int, nn.Parameter] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            layers_of.setdefault(id(param), []).append(_layer_of(name))
            first.setdefault(id(param), param)
        dims, grid = self.grid.dims, self.grid
        mine = []
        for key, layers in layers_of.items():
            stages = sorted({self._stage_of_layer[layer] for layer in layers})
            if len(stages) < 2:
                continue
            if len(stages) == dims.pp:
                group = grid.pp_group
            else:
                group = None
                for d in range(dims.dp):
                    for t in range(dims.tp):
                        ranks = [grid.base_ranks[dims.rank(d, s, t)] for s in stages]
                        made = dist.new_group(ranks)
                        if (d, t) == (grid.dp_rank, grid.tp_rank):
                            group = made
            if grid.pp_rank in stages:
                owner = self._stage_of_layer[min(layers)] == grid.pp_rank
                mine.append((first[key], group, owner))
        return mine

    @property
    def layer_indices(self) -> list[int]:
        """Indices (in the whole model) of the layers this rank holds: its stage's, or all of them."""
        if self.pipeline is None:
            return list(range(len(self.module)))
        return [i for chunk in self.pipeline.chunks for i in chunk.layer_range]

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: its tensor-parallel shards of its stage's layers."""
        return self.module.parameters()

    def train_step(
        self,
        batch: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        *,
        local: bool = False,
        max_grad_norm: float | None = None,
        loss_scaler=None,
    ) -> torch.Tensor:
        """One optimizer step on the global ``batch`` and ``targets`` (the same on every rank of the grid), or with
        ``local`` on this replica's rows (the global batch being the replicas' rows in dp-rank order).

        The replica's rows are split into ``accumulation`` chunks (the pipeline splits each into micro-batches).
        ``max_grad_norm`` clips the whole model's gradient norm (as ``torch.nn.utils.clip_grad_norm_``).
        ``loss_scaler`` (fp16; ``.scale``, ``.update(found_inf)``) scales the loss before backward; a non-finite
        gradient norm skips the optimizer step. Returns the loss of the whole global batch, detached, on every
        rank.
        """
        dp, k = self.grid.dims.dp, self.accumulation
        if dp > 1 and not local:
            batch, targets = split_batch((batch, targets), self.grid.dp_group)  # (B / dp, ...) each
        if self.device is not None:
            batch, targets = batch.to(self.device), targets.to(self.device)
        if batch.shape[0] % k:
            raise ValueError(f"accumulation={k} does not divide this replica's {batch.shape[0]} rows")
        if self.overlap_optimizer and (max_grad_norm is not None or loss_scaler is not None):
            what = "max_grad_norm" if max_grad_norm is not None else "loss_scaler"
            raise ValueError(
                f"overlap_optimizer: the optimizer steps inside backward, before the whole gradient is known; "
                f"{what} needs it first (pass none)"
            )
        scale = float(loss_scaler.scale) if loss_scaler is not None else 1.0
        factor = scale / k
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float32, device=batch.device)
        if self.pipeline is not None:
            replica = self.grid.dp_rank * batch.shape[0]  # this replica's first row in the global batch
            for i, (x, y) in enumerate(zip(batch.chunk(k), targets.chunk(k), strict=True)):
                with dropouts.rows(replica + i * x.shape[0]):
                    scaled = self.pipeline.train_step(
                        x, y, lambda out, t: loss_fn(out, t) * factor, forward_context=self._autocast
                    )
                total += scaled.float() / factor
        elif self.graphed is not None:
            if loss_scaler is not None:
                raise ValueError("step_graph: a loss scaler's scale changes between steps; the recording holds one")
            if self._graphed_loss_fn is not None and loss_fn is not self._graphed_loss_fn:
                raise ValueError(
                    "step_graph: the step was recorded with another loss function; call forget_step_graph() on "
                    "every rank first"
                )
            self.graphed.check(batch, targets)
            self._graphed_loss_fn = loss_fn
            total = self.graphed(batch, targets)
        else:
            total = self._forward_backward(batch, targets, loss_fn=loss_fn, factor=factor)
        computed = time.perf_counter()
        loss = total / k
        if self.pipeline is not None and dp > 1 and not self.zero_stage:
            gradients.average_flat(
                self.params, self.grid.dp_group, algorithm=self.algorithm, reduce_dtype=self.reduce_dtype
            )
        self._sum_tied()
        norm = self._grad_norm() / scale  # 0-d, on the device: read back only where a decision needs it
        if dp > 1:
            comm.all_reduce(loss, op="avg", group=self.grid.dp_group, algorithm=self.algorithm)
        communicated = time.perf_counter()
        self._last_grad_norm = norm
        self.step_skipped = loss_scaler is not None and not math.isfinite(norm.item())
        if self.step_skipped:
            loss_scaler.update(True)
        else:
            if max_grad_norm is not None or scale != 1.0:
                # clip_grad_norm_'s factor, min(1, max / (norm + 1e-6)), kept on the device
                coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0) if max_grad_norm is not None else 1.0
                coef = coef / scale
                if self.zero_stage:
                    self.optimizer.scale_grads(coef)
                else:
                    gradients.scale_grads(self.params, coef)
            if not (self.overlap_optimizer and self.graphed is not None):  # a replay stepped it, running no Python
                self.optimizer.step()  # with overlap_optimizer: stepped inside backward, this checks that it was
            if loss_scaler is not None:
                loss_scaler.update(False)
        end = time.perf_counter()
        self.timings = {
            "compute_s": computed - start,
            "comm_s": communicated - computed,
            "optimizer_s": end - communicated,
        }
        return loss

    def _forward_backward(
        self,
        batch: torch.Tensor,
        targets: torch.Tensor,
        *,
        loss_fn: LossFn | None = None,
        factor: float | None = None,
        recording: bool = False,
    ) -> torch.Tensor:
        """Forward, loss and backward of this replica's rows in ``accumulation`` chunks (``pp == 1``), the gradient
        all-reduce overlapped with the last backward; returns the sum of the chunks' losses (float32, on the
        device). ``factor`` multiplies each chunk's loss before its backward (the loss scale over ``accumulation``;
        None: 1 / accumulation). ``recording``: the step is being recorded as a graph, autocast runs with its cast
        cache off."""
        loss_fn = loss_fn if loss_fn is not None else self._graphed_loss_fn
        k = self.accumulation
        factor = 1.0 / k if factor is None else factor  # the loss scale over k (no scale: 1 / k)
        context = self._autocast
        if recording:
            probe = self.params[0] if self.params else None
            context = lambda: step_graph.uncached_within(self._autocast, probe)  # noqa: E731
        total = torch.zeros((), dtype=torch.float32, device=batch.device)
        replica = self.grid.dp_rank * batch.shape[0]  # this replica's first row in the global batch
        for i, (x, y) in enumerate(zip(batch.chunk(k), targets.chunk(k), strict=True)):
            sync = i == k - 1 or not isinstance(self._forward, DataParallel)
            with contextlib.nullcontext() if sync else self._forward.no_sync(), dropouts.rows(replica + i * x.shape[0]):
                with context():
                    loss = loss_fn(self._forward(x), y)
                (loss * factor).backward()  # DataParallel averages over dp here, overlapped with backward
            total += loss.detach().float()
        return total

    def forget_step_graph(self) -> None:
        """Drop the recorded step (``step_graph``): the next two steps run eagerly, the third is recorded again
        (a batch of another shape, another loss function). Every rank must call it at the same step."""
        if self.graphed is not None:
            self.graphed.forget()
            self._graphed_loss_fn = None
        if self.pipeline is not None:
            self.pipeline.forget_shapes()

    @torch.no_grad()
    def evaluate(
        self, batch: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, *, local: bool = False
    ) -> torch.Tensor:
        """The loss of the global ``batch`` without training (as :meth:`train_step` computes it, in the same
        precision and through the same pipeline, without autograd, every module in eval mode: no dropout);
        ``local`` as in :meth:`train_step`. Returns the loss of the whole global batch on every rank."""
        with _eval_mode(self._modules()):
            return self._evaluate(batch, targets, loss_fn, local=local)

    def _modules(self) -> list[nn.Module]:
        """The modules this rank runs: its pipeline stage's chunks, or its model."""
        return list(self.pipeline.chunks) if self.pipeline is not None else [self.module]

    def _evaluate(self, batch: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, *, local: bool) -> torch.Tensor:
        dp = self.grid.dims.dp
        if dp > 1 and not local:
            batch, targets = split_batch((batch, targets), self.grid.dp_group)
        if self.device is not None:
            batch, targets = batch.to(self.device), targets.to(self.device)
        if self.pipeline is not None:
            loss = self.pipeline.train_step(batch, targets, loss_fn, forward_context=self._autocast, forward_only=True)
        else:
            with self._autocast():
                loss = loss_fn(self.module(batch), targets)
        loss = loss.detach().float().clone()
        if dp > 1:
            comm.all_reduce(loss, op="avg", group=self.grid.dp_group, algorithm=self.algorithm)
        return loss

    def _sum_tied(self) -> None:
        """Each tied parameter's gradient summed over the stages holding a copy (Megatron's embedding group)."""
        for param, group, _ in self._tied:
            if self.zero_stage == 3:
                self.optimizer.all_reduce_gradient(param, group)
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            comm.all_reduce(param.grad, op="sum", group=group, algorithm=self.algorithm)

    def _weight_of(self, param: nn.Parameter) -> float:
        """1 / (how many ranks of this replica hold ``param``'s gradient): 1/tp where replicated over tp, 0 for the
        copy of a tied parameter that another stage counts."""
        if id(param) in self._not_counted:
            return 0.0
        tp = self.grid.dims.tp
        return 1.0 if tp == 1 or hasattr(param, "tensor_parallel_dim") else 1.0 / tp

    @property
    def last_grad_norm(self) -> float:
        """The whole model's gradient norm of the last step, before clipping, unscaled (reading it waits for the
        device)."""
        return float(self._last_grad_norm)

    def _grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm (0-d float32 on the device): this rank's weighted squares, summed over
        the grid."""
        dp = self.grid.dims.dp
        if self.zero_stage:  # each dp rank holds a distinct chunk of the averaged gradient
            square = self.optimizer.grad_square_sum(self._weight_of).float()
        else:  # every dp rank holds the same averaged gradient
            square = gradients.grad_square_sum(self.params, lambda q: self._weight_of(q) / dp)
        grid = self.grid
        gradients.sum_over_groups(square, [grid.tp_group, grid.pp_group, grid.dp_group])
        return square.sqrt()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The single-device model's state dict (its names, vocabulary padding removed, a tied weight once under
        its first name) on grid rank 0, None elsewhere. Collective: every rank of the grid calls it.

        Tensor-parallel shards are all-gathered along ``tensor_parallel_dim`` on their stage; the owning stage's
        tp/dp rank 0 sends each tensor to grid rank 0. Under ``zero_stage=3`` each stage first gathers its
        float32 shards over dp.
        """
        grid, dims = self.grid, self.grid.dims
        whole: dict[int, torch.Tensor] = {}  # id(parameter) -> its whole tp-local value (ZeRO-3)
        if self.zero_stage == 3:
            gathered = self.optimizer.full_parameters()
            whole = {id(q): gathered[n] for n, q in self.module.named_parameters() if n in gathered}
        root = grid.base_ranks[0]
        me = dist.get_rank()
        out: dict[str, torch.Tensor] | None = {} if grid.rank == 0 else None
        for name, (shape, dtype) in self._export.items():
            stage = self._stage_of_layer[_layer_of(name)]
            owner = grid.base_ranks[dims.rank(0, stage, 0)]
            tensor = None
            if grid.pp_rank == stage:
                if name not in self._local_state:
                    raise ValueError(
                        f"full_state_dict: {name!r} is not in the parallel model (renamed by tensor_parallel)"
                    )
                tensor = whole.get(id(self._local_state[name]), self._local_state[name]).detach()
                dim = getattr(self._local_state[name], "tensor_parallel_dim", None)
                if dim is not None and dims.tp > 1:
                    tensor = _all_gather_dim(tensor, dim, grid.tp_group).narrow(dim, 0, shape[dim])
            if owner == root:
                if me == root:
                    out[name] = tensor.cpu().clone()
            elif me == owner:
                dist.send(tensor.contiguous(), root)
            elif me == root:
                received = torch.empty(shape, dtype=dtype, device=self.params[0].device if self.params else None)
                dist.recv(received, owner)
                out[name] = received.cpu()
        return out


@contextlib.contextmanager
def _eval_mode(roots: Sequence[nn.Module]) -> Iterator[None]:
    """Every module under ``roots`` in eval mode within the block, then each back in the mode it had."""
    modes = [(m, m.training) for root in roots for m in root.modules()]
    for module, _ in modes:
        module.training = False
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _idle_stages(model: nn.Module, stage_of_layer: dict[int, int], stages: int) -> list[int]:
    """The pipeline stages whose layers hold no parameter that requires grad; a tied parameter counts on every
    stage holding a copy of it (the head's copy of a tied embedding trains on the last stage)."""
    trained = {
        stage_of_layer[_layer_of(name)]
        for name, param in model.named_parameters(remove_duplicate=False)
        if param.requires_grad
    }
    return [stage for stage in range(stages) if stage not in trained]


def _layer_of(name: str) -> int:
    """The index in the whole ``nn.Sequential`` of the layer a parameter or buffer name belongs to."""
    return int(name.split(".", 1)[0])


def _all_gather_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated rank-major along ``dim``."""
    world = dist.get_world_size(group)
    inp = tensor.contiguous()
    flat = torch.empty(world * inp.numel(), dtype=inp.dtype, device=inp.device)
    comm.all_gather(flat, inp, group=group)
    return torch.cat(flat.view(world, *inp.shape).unbind(0), dim=dim)


def _check_capturable(optimizer: torch.optim.Optimizer) -> None:
    """A step recorded in a CUDA graph needs the optimizer built for it: ``capturable`` in every param group, and
    a tensor learning rate, which a schedule can fill in place between replays (a float is recorded as it was)."""
    for group in optimizer.param_groups:
        if not group.get("capturable", False):
            raise ValueError(
                "overlap_optimizer with step_graph records the optimizer's step: build the optimizer with "
                "capturable=True"
            )
        if not isinstance(group["lr"], torch.Tensor):
            raise ValueError(
                "overlap_optimizer with step_graph records the optimizer's step: give it lr as a tensor on the "
                "device (a float learning rate would be recorded as it is, and no schedule would reach it)"
            )
