"""Tensor (intra-operator) parallelism after Megatron-LM (Shoeybi et al. 2019).

A linear layer ``Y = X A`` is split either by the columns of ``A`` (each rank computes ``Y_i = X A_i``: a
:class:`ColumnParallelLinear`) or by its rows, with ``X`` split by columns to match (each rank computes a
partial ``X_i A_i`` and the partials are summed: a :class:`RowParallelLinear`). Column then row gives an MLP
with one all-reduce forward and one backward (Megatron eq. 3-4, figure 3a); attention heads split the same way
(figure 3b). The embedding table and the output classifier split by vocabulary (section 3, "input embedding"
and the fused parallel cross-entropy), for an output layer over a vocabulary or set of classes too large for
one device. The communication lives in :mod:`dtrain.parallel.tensor_parallel_communications`.

Weights are stored as in :class:`torch.nn.Linear`, (out_features, in_features): a column split of ``A`` is a
split of the weight's rows. ``init_from=`` copies this rank's shard of a full single-device module (its dtype and
device too). Every sharded parameter carries the attribute ``tensor_parallel_dim`` (the dim it is split on);
a parameter without it is replicated over the group. A vocabulary that does not divide by the group size is
padded (:func:`padded_vocab_size`) with rows no token uses, as Megatron-LM's ``make_vocab_size_divisible_by``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.parallel import tensor_parallel_communications as tpc
from dtrain.parallel.weight_gradients import linear

__all__ = [
    "ColumnParallelLinear",
    "VocabParallelLMHead",
    "padded_vocab_size",
    "RowParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]


def _divide(size: int, world: int, what: str) -> int:
    if size % world:
        raise ValueError(f"{what}={size} does not divide evenly by the tensor-parallel group size {world}")
    return size // world


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp_size``; refused where a rank would hold only padding."""
    padded = -(-vocab_size // tp_size) * tp_size
    if padded - vocab_size >= padded // tp_size:
        raise ValueError(
            f"vocab_size={vocab_size} over tp={tp_size} ranks would leave a rank with padding only; "
            f"use a tp of at most {max(1, int(vocab_size**0.5))} or a larger vocabulary"
        )
    return padded


def _mark(param: nn.Parameter, dim: int) -> nn.Parameter:
    """``param`` tagged as split over the tensor-parallel group along ``dim``."""
    param.tensor_parallel_dim = dim
    return param


def _like(module: nn.Module | None) -> dict:
    """dtype and device of ``module``'s weight (empty: the defaults), for the shard built from it."""
    if module is None:
        return {}
    return {"dtype": module.weight.dtype, "device": module.weight.device}


def _check_shape(full: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(full.shape) != shape:
        raise ValueError(f"init_from: {what} has shape {tuple(full.shape)}, expected {shape}")


class _ParallelLinear(nn.Module):
    """Shared state of the two linear layers: the group, the shard and its initialisation.

    Their weight gradient needs only local tensors: a :class:`~dtrain.parallel.weight_gradients.WeightGradStore`
    set as ``weight_grad_store`` may defer it (zero-bubble pipeline schedules).
    """

    weight_grad_store = None

    def __init__(
        self, in_features: int, out_features: int, group, algorithm: str, dim: int, init_from: nn.Linear | None
    ) -> None:
        super().__init__()
        self.group, self.algorithm = group, algorithm
        self.tp_size, self.tp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.shard_dim = dim  # 0: rows of the weight (column parallel), 1: its columns (row parallel)
        shape = [out_features, in_features]
        shape[dim] = _divide(shape[dim], self.tp_size, ("out_features", "in_features")[dim])
        # The full layer's nn.Linear bound, so a shard is distributed like its part of a full layer; Megatron
        # starts every bias at zero.
        bound = 1.0 / math.sqrt(in_features)
        self.weight = _mark(nn.Parameter(torch.empty(shape, **_like(init_from)).uniform_(-bound, bound)), dim)

    def _load(self, full: nn.Linear, bias: nn.Parameter | None) -> None:
        _check_shape(full.weight, (self.out_features, self.in_features), "weight")
        with torch.no_grad():
            n = self.weight.shape[self.shard_dim]
            self.weight.copy_(full.weight.narrow(self.shard_dim, self.tp_rank * n, n))
            if bias is not None:
                if full.bias is None:
                    raise ValueError("init_from has no bias but this layer has one")
                b = full.bias if self.shard_dim == 1 else full.bias.narrow(0, self.tp_rank * n, n)
                bias.copy_(b)


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A + b`` with ``A``'s columns (the weight's rows) split over ``group`` (Megatron eq. 3).

    The input passes through ``f`` (gradient all-reduced); each rank computes its (..., out / tp) slice of
    ``Y``, which is all-gathered to (..., out) when ``gather_output``. With ``reduce_input_grad=False`` the
    layer leaves ``f`` to its caller: several column-parallel layers reading one input (q, k and v; gate and
    up) then share one ``f`` on that input, one all-reduce of the summed gradient instead of one a layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group=None,
        *,
        bias: bool = True,
        gather_output: bool = False,
        reduce_input_grad: bool = True,
        algorithm: str = "auto",
        init_from: nn.Linear | None = None,
    ) -> None:
        super().__init__(in_features, out_features, group, algorithm, 0, init_from)
        self.gather_output, self.reduce_input_grad = gather_output, reduce_input_grad
        self.bias = _mark(nn.Parameter(torch.zeros(self.weight.shape[0], **_like(init_from))), 0) if bias else None
        if init_from is not None:
            self._load(init_from, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce_input_grad:
            x = tpc.copy_to_tensor_parallel_region(x, self.group, self.algorithm)
        y = linear(x, self.weight, self.bias, self.weight_grad_store)  # (..., out / tp)
        if self.gather_output:
            y = tpc.gather_from_tensor_parallel_region(y, self.group, self.algorithm)  # (..., out)
        return y


class RowParallelLinear(_ParallelLinear):
    """``Y = X A + b`` with ``A``'s rows (the weight's columns) and ``X``'s columns split over ``group``.

    Each rank computes the partial product ``X_i A_i``; ``g`` sums them (Megatron eq. 4) and the bias is
    added once, after the sum. With ``input_is_parallel=False`` a replicated input is split here first.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group=None,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        algorithm: str = "auto",
        init_from: nn.Linear | None = None,
    ) -> None:
        super().__init__(in_features, out_features, group, algorithm, 1, init_from)
        self.input_is_parallel = input_is_parallel
        self.bias = nn.Parameter(torch.zeros(out_features, **_like(init_from))) if bias else None
        if init_from is not None:
            self._load(init_from, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = tpc.scatter_to_tensor_parallel_region(x, self.group, self.algorithm)  # (..., in / tp)
        partial = linear(x, self.weight, None, self.weight_grad_store)  # (..., out), this rank's share of the sum
        y = tpc.reduce_from_tensor_parallel_region(partial, self.group, self.algorithm)
        return y + self.bias if self.bias is not None else y


class ParallelMLP(nn.Module):
    """``GeLU(X A) B``: ``A`` column-parallel, ``B`` row-parallel, so GeLU runs on local shards with no
    communication between them (Megatron eq. 3, figure 3a): one all-reduce forward (``g``), one backward (``f``).

    ``init_from`` is the single-device pair (first linear, second linear).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        group=None,
        *,
        algorithm: str = "auto",
        init_from: tuple[nn.Linear, nn.Linear] | None = None,
    ) -> None:
        super().__init__()
        fc_in, fc_out = init_from if init_from is not None else (None, None)
        self.fc_in = ColumnParallelLinear(dim, hidden_dim, group, algorithm=algorithm, init_from=fc_in)
        self.fc_out = RowParallelLinear(hidden_dim, dim, group, algorithm=algorithm, init_from=fc_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))  # (..., dim) -> (..., hidden / tp) -> (..., dim)


def _qkv_rank_major(qkv: nn.Linear, world: int) -> nn.Linear:
    """``qkv`` with its output rows reordered from [q | k | v] to rank-major [q_r k_r v_r for each rank r]."""
    out, dim = qkv.weight.shape
    reordered = nn.Linear(dim, out, bias=qkv.bias is not None)
    with torch.no_grad():
        reordered.weight.copy_(qkv.weight.view(3, world, -1, dim).transpose(0, 1).reshape(out, dim))
        if qkv.bias is not None:
            reordered.bias.copy_(qkv.bias.view(3, world, -1).transpose(0, 1).reshape(out))
    return reordered


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with the heads split over ``group`` (Megatron figure 3b).

    The QKV projection is column-parallel (each rank gets the q, k and v of its ``n_heads / tp`` heads), the
    attention of those heads is local, and the output projection is row-parallel. ``init_from`` is the
    single-device pair (qkv ``Linear(dim, 3 * dim)`` with outputs [q | k | v], heads contiguous in each;
    output ``Linear(dim, dim)``).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        group=None,
        *,
        bias: bool = True,
        algorithm: str = "auto",
        init_from: tuple[nn.Linear, nn.Linear] | None = None,
    ) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} does not divide evenly by n_heads={n_heads}")
        world = dist.get_world_size(group)
        self.local_heads = _divide(n_heads, world, "n_heads")
        self.head_dim = dim // n_heads
        qkv, proj = init_from if init_from is not None else (None, None)
        if qkv is not None:
            _check_shape(qkv.weight, (3 * dim, dim), "qkv weight")
            qkv = _qkv_rank_major(qkv, world)
        kw = {"bias": bias, "algorithm": algorithm}
        self.qkv = ColumnParallelLinear(dim, 3 * dim, group, init_from=qkv, **kw)
        self.proj = RowParallelLinear(dim, dim, group, init_from=proj, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        qkv = self.qkv(x).view(B, T, 3, self.local_heads, self.head_dim)  # (B, T, 3, H / tp, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H / tp, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H / tp, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim)  # (B, T, C / tp)
        return self.proj(y)  # (B, T, C)


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary range: rank r holds rows [r V / tp, (r + 1) V / tp).

    Each rank looks up the tokens it owns, writes zeros for the others, and ``g`` sums the ranks' outputs
    (Megatron section 3, input embedding). ``init_from`` may have fewer rows than ``num_embeddings`` (a padded
    vocabulary): the rows past its end start at zero, and no token looks them up.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group=None,
        *,
        algorithm: str = "auto",
        init_from: nn.Embedding | None = None,
    ) -> None:
        super().__init__()
        self.group, self.algorithm = group, algorithm
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = _divide(num_embeddings, world, "num_embeddings")
        self.vocab_start, self.vocab_end = rank * rows, (rank + 1) * rows
        self.weight = _mark(nn.Parameter(torch.randn(rows, embedding_dim, **_like(init_from))), 0)
        if init_from is not None:
            _copy_vocab_rows(self.weight, init_from.weight, num_embeddings, self.vocab_start, "embedding weight")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        foreign = (tokens < self.vocab_start) | (tokens >= self.vocab_end)  # (...)
        local = (tokens - self.vocab_start).masked_fill(foreign, 0)
        out = F.embedding(local, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)  # (..., E)
        return tpc.reduce_from_tensor_parallel_region(out, self.group, self.algorithm)


def _copy_vocab_rows(shard: torch.Tensor, full: torch.Tensor, padded: int, start: int, what: str) -> None:
    """This rank's rows [start, start + rows) of ``full`` (V, C) into ``shard``; rows at or past V are zero."""
    vocab, dim = full.shape
    if vocab > padded or dim != shard.shape[1] or padded - vocab >= shard.shape[0]:
        raise ValueError(f"init_from: {what} has shape {tuple(full.shape)}, expected ({padded}, {shard.shape[1]})")
    with torch.no_grad():
        shard.zero_()
        real = max(0, min(shard.shape[0], vocab - start))
        shard[:real].copy_(full[start : start + real])


class VocabParallelLMHead(nn.Module):
    """The output layer ``logits = X W^T`` with ``W`` (V, C) split by vocabulary over ``group``: rank r computes
    the logits of classes [r V_pad / tp, (r + 1) V_pad / tp) (column parallel, Megatron section 3).

    ``vocab_size`` real classes, padded to ``num_embeddings`` (a multiple of the group size). With
    ``gather_output`` the output is the whole (..., vocab_size) logits; else this rank's (..., V_pad / tp) slice,
    padding classes at ``-inf`` (no probability, no gradient), for :func:`vocab_parallel_cross_entropy`.
    ``weight`` has the layout of :class:`VocabParallelEmbedding`'s, so a tied embedding's shard can be it.
    """

    weight_grad_store = None  # as the linears': the weight gradient may be deferred

    def __init__(
        self,
        embedding_dim: int,
        vocab_size: int,
        num_embeddings: int,
        group=None,
        *,
        gather_output: bool = False,
        algorithm: str = "auto",
        init_from: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        if init_from is not None and init_from.bias is not None:
            raise ValueError("VocabParallelLMHead: init_from has a bias; an LM head has none")
        self.group, self.algorithm, self.gather_output = group, algorithm, gather_output
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = _divide(num_embeddings, world, "num_embeddings")
        self.vocab_size, self.vocab_start = vocab_size, rank * rows
        self.padding_here = rows - max(0, min(rows, vocab_size - rank * rows))  # the padding is the last ranks' tail
        bound = 1.0 / math.sqrt(embedding_dim)
        weight = torch.empty(rows, embedding_dim, **_like(init_from)).uniform_(-bound, bound)
        self.weight = _mark(nn.Parameter(weight), 0)
        if init_from is not None:
            _copy_vocab_rows(self.weight, init_from.weight, num_embeddings, self.vocab_start, "LM head weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = tpc.copy_to_tensor_parallel_region(x, self.group, self.algorithm)
        logits = linear(x, self.weight, None, self.weight_grad_store)  # (..., V_pad / tp)
        if self.gather_output:
            whole = tpc.gather_from_tensor_parallel_region(logits, self.group, self.algorithm)
            return whole[..., : self.vocab_size]  # (..., V)
        if not self.padding_here:
            return logits
        real = logits.shape[-1] - self.padding_here
        return F.pad(logits[..., :real], (0, self.padding_here), value=float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, never gathering them (Megatron section 3).

    Three all-reduces of (N,) values: the max (for a stable softmax), the sum of exponentials, and the target's
    logit (contributed by the rank that owns the target). The gradient is softmax shard minus one-hot shard.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, algorithm: str) -> torch.Tensor:
        rows = logits.shape[-1]
        start = dist.get_rank(group) * rows
        x = logits.detach().reshape(-1, rows).to(torch.promote_types(logits.dtype, torch.float32))  # (N, V / tp)
        t = target.reshape(-1)  # (N,)
        x = x - tpc.all_reduce(x.amax(-1), group, algorithm, op="max").unsqueeze(-1)
        foreign = (t < start) | (t >= start + rows)
        local_t = (t - start).masked_fill(foreign, 0)
        picked = x.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(foreign, 0.0)  # (N,)
        picked = tpc.all_reduce(picked, group, algorithm)
        exp = x.exp()
        sum_exp = tpc.all_reduce(exp.sum(-1), group, algorithm)  # (N,)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, foreign)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return (sum_exp.log() - picked).view(target.shape).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_t, foreign = ctx.saved_tensors
        g = softmax.clone()  # (N, V / tp)
        g[torch.arange(g.shape[0]), local_t] -= (~foreign).to(g.dtype)
        g *= grad.reshape(-1, 1).to(g.dtype)
        return g.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, group=None, *, algorithm: str = "auto", reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of (..., V / tp) logit shards (rank r holds classes [r V / tp, (r + 1) V / tp)) against
    (...) integer targets in [0, V): as ``F.cross_entropy`` on the gathered logits, without gathering them.

    ``reduction`` is "mean", "sum" or "none" (per-token losses of shape ``target.shape``).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits shard {tuple(logits_shard.shape)} does not match target {tuple(target.shape)}")
    losses = _VocabParallelCrossEntropy.apply(logits_shard, target, group, algorithm)
    if reduction == "none":
        return losses
    return losses.mean() if reduction == "mean" else losses.sum()
