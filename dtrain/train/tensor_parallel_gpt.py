"""The GPT of :mod:`dtrain.train.models` with its blocks tensor parallel (Megatron-LM, Shoeybi et al. 2019,
section 3 and figure 3): attention heads and the MLP's hidden units split over ``tp_group``, everything else
replicated.

Each block keeps the single-device form ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``: the attention is a
:class:`~dtrain.parallel.tensor_parallel.ParallelSelfAttention` and the MLP a
:class:`~dtrain.parallel.tensor_parallel.ParallelMLP`, both initialised from the block's weights (``init_from``);
the LayerNorms are copied whole. Both parallel layers end in a row-parallel all-reduce, so a block's output is
whole and the same on every tensor-parallel rank.

The token embedding and the LM head are split over the vocabulary (Megatron section 3, "input embedding" and
the output layer, so that an output layer too large for one device never sits whole on one): a
:class:`~dtrain.parallel.tensor_parallel.VocabParallelEmbedding` looks up the ids a rank owns and sums over the
group, and the head is a column-parallel linear whose output is this rank's slice of the logits. A vocabulary
that does not divide by the group size is padded with rows that no token uses and whose logits are ``-inf``
(Megatron pads the same way, ``make_vocab_size_divisible_by``), so the model computes exactly the unsplit one.
The head either gathers the logits to (B, T, V) (``gather_logits=True``: any loss works, the logits are whole
on every rank) or returns the (B, T, V / tp) slice for
:func:`~dtrain.parallel.tensor_parallel.vocab_parallel_cross_entropy` (``False``: the logits are never whole).
The position embedding and the LayerNorms stay replicated; the column-parallel layers all-reduce the gradient
of their input (Megatron's ``f``), so every replicated parameter gets the whole gradient, identical on every
rank. The result is still an ``nn.Sequential`` of the same length, for pipeline and data parallelism.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.parallel import tensor_parallel_communications as tpc
from dtrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    VocabParallelEmbedding,
)
from dtrain.train.models import Block, Embedding, Head

__all__ = [
    "TensorParallelBlock",
    "VocabParallelGPTEmbedding",
    "VocabParallelHead",
    "padded_vocab_size",
    "tensor_parallel_gpt",
]


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


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp_size``; refused where a rank would hold only padding."""
    padded = -(-vocab_size // tp_size) * tp_size
    if padded - vocab_size >= padded // tp_size:
        raise ValueError(
            f"a vocabulary of {vocab_size} over tp={tp_size} ranks would leave a rank with padding only; "
            f"use a tp of at most {max(1, int(vocab_size**0.5))} or a larger vocabulary"
        )
    return padded


def _padded(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` (V, C) with zero rows appended up to ``rows``."""
    return torch.cat([weight.detach(), weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


class VocabParallelGPTEmbedding(nn.Module):
    """The GPT :class:`~dtrain.train.models.Embedding` with its token table split over the (padded) vocabulary.

    The position table is replicated; the output (B, T, C) is whole on every rank. Dropout must be 0.
    """

    def __init__(self, embedding: Embedding, tp_group, *, algorithm: str = "auto") -> None:
        super().__init__()
        if embedding.dropout.p:
            raise ValueError(f"tensor parallel embeddings support dropout 0 only, got {embedding.dropout.p}")
        vocab, dim = embedding.token.weight.shape
        padded = padded_vocab_size(vocab, dist.get_world_size(tp_group))
        full = nn.Embedding(padded, dim, _weight=_padded(embedding.token.weight, padded))
        self.token = VocabParallelEmbedding(padded, dim, tp_group, algorithm=algorithm, init_from=full)
        self.position = copy.deepcopy(embedding.position)
        self.block_size = embedding.block_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)  # (T,)
        return self.token(idx) + self.position(pos)  # (B, T, C)


class VocabParallelHead(nn.Module):
    """The GPT :class:`~dtrain.train.models.Head`: a replicated final LayerNorm, then the LM head split by
    vocabulary (column parallel, Megatron section 3).

    Returns the whole (B, T, V) logits with ``gather_logits``, else this rank's (B, T, V_padded / tp) slice in
    which padding classes are ``-inf`` (no probability, no gradient).
    """

    def __init__(self, head: Head, tp_group, *, algorithm: str = "auto", gather_logits: bool = True) -> None:
        super().__init__()
        vocab, dim = head.lm_head.weight.shape
        tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        padded = padded_vocab_size(vocab, tp_size)
        full = nn.Linear(dim, padded, bias=False)
        with torch.no_grad():
            full.weight.copy_(_padded(head.lm_head.weight, padded))
        self.ln_f = copy.deepcopy(head.ln_f)
        self.lm_head = ColumnParallelLinear(dim, padded, tp_group, bias=False, algorithm=algorithm, init_from=full)
        self.group, self.algorithm = tp_group, algorithm
        self.vocab_size, self.gather_logits = vocab, gather_logits
        rows = padded // tp_size
        self.padding_here = rows - max(0, min(rows, vocab - tp_rank * rows))  # the padding is the last rank's tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))  # (B, T, V_padded / tp)
        if self.gather_logits:
            return tpc.gather_from_tensor_parallel_region(logits, self.group, self.algorithm)[..., : self.vocab_size]
        if not self.padding_here:
            return logits
        return F.pad(logits[..., : -self.padding_here], (0, self.padding_here), value=float("-inf"))


def tensor_parallel_gpt(
    model: nn.Sequential, tp_group, *, algorithm: str = "auto", gather_logits: bool = True
) -> nn.Sequential:
    """``model`` (a GPT from :func:`~dtrain.train.models.build_model`) with every block replaced by its
    :class:`TensorParallelBlock` over ``tp_group`` and the embedding and head split over the vocabulary.

    With ``gather_logits`` the output is the whole (B, T, V) logits; without, this rank's (B, T, V / tp) slice
    (padded vocabulary, padding at ``-inf``) for :func:`~dtrain.parallel.tensor_parallel.vocab_parallel_cross_entropy`.
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
    return nn.Sequential(
        VocabParallelGPTEmbedding(model[0], tp_group, algorithm=algorithm),
        *(TensorParallelBlock(b, tp_group, algorithm=algorithm) for b in blocks),
        VocabParallelHead(model[-1], tp_group, algorithm=algorithm, gather_logits=gather_logits),
    )
