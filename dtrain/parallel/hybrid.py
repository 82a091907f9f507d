"""Hybrid (3-D) parallelism: tensor parallel inside a block, pipeline over blocks, data parallel over replicas.

The composition of Megatron-LM's PTD-P (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 2.3; the seed text's example is two devices per replica split by
operators, two replicas). On a :class:`~dtrain.parallel.grid.RankGrid`:

- every block is a :class:`~dtrain.parallel.tensor_parallel.ParallelMLP` over ``grid.tp_group``, initialised
  from its single-device ``Linear -> GELU -> Linear`` block; its output is whole (the row-parallel all-reduce),
  so the activation a stage sends is the same on every tensor-parallel rank of the stage;
- the blocks are cut into stages over ``grid.pp_group`` by :class:`~dtrain.parallel.pipeline_parallel.
  PipelineParallel` (GPipe or 1F1B, ``m`` micro-batches); pipeline groups join ranks of equal ``tp_rank``, so
  tensor-parallel rank ``t`` of stage ``s`` talks to tensor-parallel rank ``t`` of stage ``s + 1``;
- each replica (``grid.dp_group``) trains on its equal shard of the global batch, and
  :class:`~dtrain.parallel.data_parallel.DistributedOptimizer` averages the gradients over the replicas once
  the ``m`` micro-batches' backward passes have accumulated (``backward_passes_per_step=m``), before the step.

No adapter is needed: tensor-parallel layers are ``nn.Module`` s, so an ``nn.Sequential`` of them is what the
pipeline cuts, and the pipeline's per-micro-batch backward passes are exactly the "passes" the Horovod-style
optimizer counts. With equal shards and a loss that averages over the batch, one step equals one process
training the unsplit blocks on the whole global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from dtrain import comm
from dtrain.parallel.data_parallel import DistributedOptimizer, broadcast_parameters, split_batch
from dtrain.parallel.grid import RankGrid
from dtrain.parallel.pipeline_parallel import LossFn, PipelineParallel
from dtrain.parallel.tensor_parallel import ParallelMLP

__all__ = ["HybridParallel", "tensor_parallel_blocks"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


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
    """Trains a stack of MLP blocks with ``grid.dims.dp`` x ``pp`` x ``tp`` parallelism; this rank holds its shard
    (``tp``) of its stage's blocks (``pp``) of one replica (``dp``).

    ``optimizer`` builds the optimizer from this rank's parameters. ``blocks`` are the single-device blocks,
    identical on every rank (their shards are copied, the modules are not kept). Replicas start from dp rank 0's
    parameters, as after :func:`~dtrain.parallel.data_parallel.broadcast_parameters` in Horovod.
    """

    def __init__(
        self,
        grid: RankGrid,
        blocks: Sequence[nn.Module],
        optimizer: OptimizerFactory,
        *,
        num_microbatches: int,
        schedule: str = "1f1b",
        algorithm: str = "auto",
    ) -> None:
        self.grid = grid
        model = tensor_parallel_blocks(blocks, grid.tp_group, algorithm=algorithm)
        self.pipeline = PipelineParallel(
            model, grid.pp_group, num_microbatches=num_microbatches, schedule=schedule, grad_group=grid.pp_grad_group
        )
        params = list(self.pipeline.parameters())
        self.optimizer: torch.optim.Optimizer | DistributedOptimizer = optimizer(params)
        if grid.dims.dp > 1:  # one replica has nothing to average
            broadcast_parameters(params, 0, grid.dp_group, algorithm=algorithm)
            self.optimizer = DistributedOptimizer(
                self.optimizer, params, grid.dp_group, algorithm=algorithm, backward_passes_per_step=num_microbatches
            )
        self.algorithm = algorithm

    @property
    def block_range(self) -> range:
        """Indices of the blocks this rank's pipeline stage holds."""
        return self.pipeline.stage.layer_range

    @property
    def blocks(self) -> nn.Sequential:
        """This rank's tensor-parallel shards of the blocks in :attr:`block_range`."""
        return self.pipeline.stage.layers

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.pipeline.parameters()

    def train_step(self, batch: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """One optimizer step on the global ``batch`` and ``targets`` (the same on every rank of the grid).

        This replica takes its equal share of the rows; the pipeline splits that into micro-batches. Returns the
        loss of the whole global batch (the replicas' mean losses averaged), on every rank of the grid.
        """
        dp_group = self.grid.dp_group
        if self.grid.dims.dp > 1:
            batch, targets = split_batch((batch, targets), dp_group)  # (B / dp, ...) each
        self.optimizer.zero_grad()
        loss = self.pipeline.train_step(batch, targets, loss_fn)
        self.optimizer.step()
        if self.grid.dims.dp > 1:
            comm.all_reduce(loss, op="avg", group=dp_group, algorithm=self.algorithm)
        return loss
