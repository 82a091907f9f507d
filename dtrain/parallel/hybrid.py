"""Hybrid (3-D) parallelism: tensor parallel inside a layer, pipeline over layers, data parallel over replicas.

The composition of Megatron-LM's PTD-P (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 2.3), and the one ``dtrain train`` runs. On a
:class:`~dtrain.parallel.grid.RankGrid`:

- ``tp > 1``: the single-device ``nn.Sequential`` is turned into its tensor-parallel twin over ``grid.tp_group``
  by the ``tensor_parallel`` function the caller passes (:func:`tensor_parallel_blocks` for a stack of MLP
  blocks, :func:`dtrain.train.tensor_parallel_gpt.tensor_parallel_gpt` for the GPT; Megatron-LM, Shoeybi et
  al. 2019). Its layers' outputs are whole on every tensor-parallel rank (the row-parallel all-reduce), so it
  is still an ``nn.Sequential`` that the pipeline cuts and data parallelism wraps unchanged;
- ``pp > 1``: the layers are cut into stages over ``grid.pp_group`` by :class:`~dtrain.parallel.
  pipeline_parallel.PipelineParallel` (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019; interleaved
  1F1B, Narayanan et al. 2021), ``m`` micro-batches a step; pipeline groups join ranks of equal ``tp_rank``,
  so tensor-parallel rank ``t`` of stage ``s`` talks to tensor-parallel rank ``t`` of stage ``s + 1``. After
  the pipelined backward, each stage's gradients are averaged over ``grid.dp_group`` with one all-reduce of
  the flattened gradients;
- ``pp == 1``: the model is wrapped in :class:`~dtrain.parallel.data_parallel.DataParallel` over
  ``grid.dp_group`` (gradients averaged bucket by bucket while backward runs);
- each replica (``grid.dp_group``) trains on its equal shard of the global batch (:func:`~dtrain.parallel.
  data_parallel.split_batch`), and the reported loss is the replicas' mean losses averaged: the loss of the
  whole global batch.

With equal shards and a loss that averages over the batch, one step equals one process training the unsplit
model on the whole global batch (``tests/parallel/test_hybrid.py`` checks every layout against that, float32).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from dtrain import comm
from dtrain.parallel.data_parallel import DataParallel, broadcast_algorithm, broadcast_parameters, split_batch
from dtrain.parallel.grid import RankGrid
from dtrain.parallel.pipeline_parallel import LossFn, PipelineParallel
from dtrain.parallel.tensor_parallel import ParallelMLP

__all__ = ["HybridParallel", "OptimizerFactory", "TensorParallelize", "tensor_parallel_blocks"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
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
    the same on every rank (built from one seed).
    """
    pairs = [_mlp_pair(block, i) for i, block in enumerate(blocks)]
    if not pairs:
        raise ValueError("tensor_parallel_blocks: no blocks given; a model needs at least one block")
    return nn.Sequential(
        *(
            ParallelMLP(fc_in.in_features, fc_in.out_features, tp_group, algorithm=algorithm, init_from=(fc_in, fc_out))
            for fc_in, fc_out in pairs
        )
    )


class HybridParallel:
    """Trains ``model`` (an ``nn.Sequential``) with ``grid.dims.dp`` x ``pp`` x ``tp`` parallelism; this rank
    holds its shard (``tp``) of its stage's layers (``pp``) of one replica (``dp``).

    ``model`` is the single-device model, identical on every rank (built from one seed); ``tensor_parallel``
    turns it into its tensor-parallel twin over ``grid.tp_group`` and is needed when ``tp > 1``. ``optimizer``
    builds the optimizer from this rank's parameters. ``device`` (optional) is where the model and each batch
    go. ``schedule``, ``num_microbatches`` and ``virtual_stages`` are the pipeline's (``pp > 1`` only).
    ``algorithm`` is the gradient all-reduce's (``dtrain.comm.algorithms("all_reduce")``); the initial
    parameter broadcast uses the same name where broadcast has it, else ``"auto"``. Replicas start from dp
    rank 0's parameters.

    After each :meth:`train_step`, :attr:`timings` holds its phases in seconds: ``compute_s`` (forward and
    backward; for ``pp == 1`` with the overlapped gradient all-reduce), ``comm_s`` (the gradient average for
    ``pp > 1`` and the loss average) and ``optimizer_s``.
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
        virtual_stages: int = 1,
        algorithm: str = "auto",
        device: torch.device | None = None,
    ) -> None:
        self.grid, self.algorithm, self.device = grid, algorithm, device
        dims = grid.dims
        if dims.tp > 1:
            if tensor_parallel is None:
                raise ValueError(
                    f"HybridParallel: tp={dims.tp} needs tensor_parallel, the model's tensor-parallel form"
                )
            model = tensor_parallel(model, grid.tp_group)
        if device is not None:
            model = model.to(device)
        self.pipeline: PipelineParallel | None = None
        if dims.pp > 1:
            self.pipeline = PipelineParallel(
                model,
                grid.pp_group,
                num_microbatches=num_microbatches,
                schedule=schedule,
                virtual_stages=virtual_stages,
                grad_group=grid.pp_grad_group,
            )
            self.module: nn.Module = self.pipeline.stage
            self._forward: nn.Module | None = None
            if dims.dp > 1:  # DataParallel does the same for pp == 1
                broadcast_parameters(
                    [*self.module.parameters(), *self.module.buffers()],
                    0,
                    grid.dp_group,
                    algorithm=broadcast_algorithm(algorithm),
                )
        else:
            self.module = model
            self._forward = DataParallel(model, grid.dp_group, algorithm=algorithm) if dims.dp > 1 else model
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params)
        self.timings: dict[str, float] = {}

    @property
    def layer_indices(self) -> list[int]:
        """Indices (in the whole model) of the layers this rank holds: its stage's, or all of them."""
        if self.pipeline is None:
            return list(range(len(self.module)))
        return [i for chunk in self.pipeline.chunks for i in chunk.layer_range]

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: its tensor-parallel shards of its stage's layers."""
        return self.module.parameters()

    def train_step(self, batch: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """One optimizer step on the global ``batch`` and ``targets`` (the same on every rank of the grid).

        This replica takes its equal share of the rows; the pipeline splits that into micro-batches. Returns the
        loss of the whole global batch (the replicas' mean losses averaged), detached, on every rank.
        """
        dp = self.grid.dims.dp
        if dp > 1:
            batch, targets = split_batch((batch, targets), self.grid.dp_group)  # (B / dp, ...) each
        if self.device is not None:
            batch, targets = batch.to(self.device), targets.to(self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            loss = self.pipeline.train_step(batch, targets, loss_fn)
        else:
            loss = loss_fn(self._forward(batch), targets)
            loss.backward()  # DataParallel averages over dp here, overlapped with backward
        computed = time.perf_counter()
        loss = loss.detach().clone()
        if dp > 1:
            if self.pipeline is not None:
                self._average_gradients()
            comm.all_reduce(loss, op="avg", group=self.grid.dp_group, algorithm=self.algorithm)
        communicated = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        self.timings = {
            "compute_s": computed - start,
            "comm_s": communicated - computed,
            "optimizer_s": end - communicated,
        }
        return loss

    def _average_gradients(self) -> None:
        """One all-reduce of this stage's flattened gradients over its dp group (pp > 1)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, op="avg", group=self.grid.dp_group, algorithm=self.algorithm)
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
