"""The GPT of :mod:`dtrain.train.models` with its blocks tensor parallel (Megatron-LM, Shoeybi et al. 2019,
section 3 and figure 3): attention heads and the MLP's hidden units split over ``tp_group``, everything else
replicated.

Each block keeps the single-device form ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``: the attention is a
:class:`~dtrain.parallel.tensor_parallel.ParallelSelfAttention` and the MLP a
:class:`~dtrain.parallel.tensor_parallel.ParallelMLP`, both initialised from the block's weights (``init_from``);
the LayerNorms are copied whole. Both parallel layers end in a row-parallel all-reduce, so a block's output is
whole and the same on every tensor-parallel rank. The embedding and the head stay replicated: they see the same
inputs on every rank, and the column-parallel layers all-reduce the gradient of their input (Megatron's ``f``),
so every replicated parameter gets the whole gradient, identical on every tensor-parallel rank, with no extra
communication. The result is still an ``nn.Sequential`` of the same length, for pipeline and data parallelism.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dtrain.parallel.tensor_parallel import ParallelMLP, ParallelSelfAttention
from dtrain.train.models import Block, Embedding, Head

__all__ = ["TensorParallelBlock", "tensor_parallel_gpt"]


class TensorParallelBlock(nn.Module):
    """A :class:`~dtrain.train.models.Block` with its attention and MLP split over ``tp_group``.

    Holds this rank's shard of ``block`` (which must be the same on every rank of the group); ``block`` itself is
    not kept. Dropout is not supported (the parallel attention has none): ``block`` must have dropout 0.
    """

    def __init__(self, block: Block, tp_group, *, algorithm: str = "auto") -> None:
        super().__init__()
        if not isinstance(block, Block):
            raise ValueError(f"expected a dtrain.train.models.Block, got {type(block).__name__}")
        if block.attn.dropout or block.mlp[3].p:
            raise ValueError(
                f"tensor parallel blocks support dropout 0 only, got attention dropout {block.attn.dropout} and "
                f"MLP dropout {block.mlp[3].p}"
            )
        fc_in, fc_out = block.mlp[0], block.mlp[2]
        dim = fc_in.in_features
        self.ln_1 = copy.deepcopy(block.ln_1)
        self.attn = ParallelSelfAttention(
            dim, block.attn.n_head, tp_group, algorithm=algorithm, init_from=(block.attn.qkv, block.attn.proj)
        )
        self.ln_2 = copy.deepcopy(block.ln_2)
        self.mlp = ParallelMLP(dim, fc_in.out_features, tp_group, algorithm=algorithm, init_from=(fc_in, fc_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C), whole on every tensor-parallel rank
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


def tensor_parallel_gpt(model: nn.Sequential, tp_group, *, algorithm: str = "auto") -> nn.Sequential:
    """``model`` (a GPT from :func:`~dtrain.train.models.build_model`) with every block replaced by its
    :class:`TensorParallelBlock` over ``tp_group``; the embedding and the head are kept (replicated).

    Nothing is communicated: every rank copies its shard of the weights, so ``model`` must be identical on every
    rank of ``tp_group`` (built from one seed).
    """
    kinds = [type(layer).__name__ for layer in model]
    blocks = list(model)[1:-1]
    if (
        len(model) < 3
        or not isinstance(model[0], Embedding)
        or not isinstance(model[-1], Head)
        or not all(isinstance(b, Block) for b in blocks)
    ):
        raise ValueError(f"expected a GPT Sequential(Embedding, Block, ..., Head), got {kinds}")
    return nn.Sequential(model[0], *(TensorParallelBlock(b, tp_group, algorithm=algorithm) for b in blocks), model[-1])
