"""Tensor parallelism for any model whose parts declare their split as data (Megatron-LM, Shoeybi et al. 2019).

A part (a module of the model) names how its children split with the class attribute ``tensor_parallel_plan``,
``{child name: kind}``, and the head counts each rank holds a share of with ``tensor_parallel_heads``
(:mod:`dtrain.models.decoder`'s parts do). :func:`tensor_parallelize` walks the modules and replaces each named
child by this rank's shard of it, copied from the full child (``init_from``), so nothing is communicated while
building: every rank builds the whole model from one seed, then keeps its shard.

- ``"colwise"``: an ``nn.Linear`` becomes a :class:`~dtrain.parallel.tensor_parallel.ColumnParallelLinear`
  (output features, and bias, split; Megatron eq. 3);
- ``"rowwise"``: a :class:`~dtrain.parallel.tensor_parallel.RowParallelLinear` (input features split, the bias
  added once after the sum; eq. 4);
- ``"vocab_embedding"``: an ``nn.Embedding`` becomes a
  :class:`~dtrain.parallel.tensor_parallel.VocabParallelEmbedding` over the vocabulary padded to a multiple of tp
  (:func:`~dtrain.parallel.tensor_parallel.padded_vocab_size`);
- ``"vocab_head"``: the output ``nn.Linear`` becomes a :class:`~dtrain.parallel.tensor_parallel.VocabParallelLMHead`
  split the same way; with ``loss_parallel`` its logits stay split (B, T, V_pad / tp), padding at ``-inf``, for
  :func:`~dtrain.parallel.tensor_parallel.vocab_parallel_cross_entropy` (:func:`causal_lm_loss`); else they are
  gathered to (B, T, V).

A part whose column-parallel children all read its own input unchanged says so with
``tensor_parallel_shared_input = True`` (attention's q, k and v; the MLP's gate and up): its children then leave
the input's gradient to the part, which puts its input through one ``f`` (identity forward, all-reduce of the
gradient backward): backward sums q's, k's and v's input gradients on the rank and all-reduces them once, where a
``f`` a child would all-reduce each (Megatron-LM's fused QKV and MLP input, one all-reduce each). Under autocast
the input is cast to its 16-bit dtype before ``f``, as the part itself casts it once for all its products, so
the all-reduce moves 16-bit gradients.

Attention splits by heads: the q, k and v projections are column-parallel with the heads contiguous, so rank r
holds query heads [r H / tp, (r + 1) H / tp) and key-value heads [r H_kv / tp, (r + 1) H_kv / tp): under
grouped-query attention (Ainslie et al. 2023) exactly the key-value heads its query heads use. A tied embedding
(the head's weight the embedding's Parameter) stays one Parameter: both split by vocabulary rows alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.models.decoder import autocast_input
from dtrain.parallel import tensor_parallel_communications as tpc
from dtrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
)

__all__ = ["KINDS", "causal_lm_loss", "tensor_parallelize", "validate_tensor_parallel"]

KINDS = ("colwise", "rowwise", "vocab_embedding", "vocab_head")
_HEAD_FIELDS = {  # config field of each head count, for messages before any rank starts
    "llama": (("num_attention_heads", "num_key_value_heads"), "intermediate_size"),
    "gpt2": (("n_head",), "n_inner"),
}


def validate_tensor_parallel(config, tp: int) -> None:
    """Raise a one-line ValueError naming the config field and ``tp`` where ``config`` (a LlamaConfig or
    GPT2Config) cannot be split over ``tp`` ranks: a head count or MLP width that ``tp`` does not divide, or a
    vocabulary whose padding would leave a rank only padding. Builds nothing."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    kind = getattr(type(config), "model_type", None)
    if kind not in _HEAD_FIELDS:
        raise ValueError(f"validate_tensor_parallel: expected a LlamaConfig or GPT2Config, got {type(config).__name__}")
    heads, width = _HEAD_FIELDS[kind]
    for name in (*heads, width):
        value = getattr(config, name)
        if value % tp:
            raise ValueError(f"{name}={value} does not divide by tp={tp}; choose a tp that divides it")
    padded_vocab_size(config.vocab_size, tp)


def _plans(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, str]]]:
    return [(name, m, plan) for name, m in model.named_modules() if (plan := getattr(m, "tensor_parallel_plan", None))]


def _check(model: nn.Module, tp: int) -> None:
    """Every declared child exists with the expected type and every declared head count divides by ``tp``."""
    for prefix, module, plan in _plans(model):
        for child_name, kind in plan.items():
            child = getattr(module, child_name, None)
            want = nn.Embedding if kind == "vocab_embedding" else nn.Linear
            if kind not in KINDS:
                accepted = ", ".join(KINDS)
                raise ValueError(f"{prefix}.tensor_parallel_plan[{child_name!r}]={kind!r}; accepted: {accepted}")
            if not isinstance(child, want):
                got = type(child).__name__
                raise ValueError(f"{prefix}.{child_name} is {got}; a {kind} split needs {want.__name__}")
    for prefix, module in model.named_modules():
        counts = {a: getattr(module, a) for a in getattr(module, "tensor_parallel_heads", ())}
        if any(v % tp for v in counts.values()):
            listed = ", ".join(f"{a}={v}" for a, v in counts.items())
            raise ValueError(f"{prefix}: {listed} must each divide by tp={tp}")


def tensor_parallelize(
    model: nn.Sequential, tp_group, *, algorithm: str = "auto", loss_parallel: bool = True
) -> nn.Sequential:
    """``model`` with every child named in a ``tensor_parallel_plan`` replaced by this rank's shard over
    ``tp_group`` and every count in ``tensor_parallel_heads`` divided by the group size (in place; returned).

    ``model`` must be identical on every rank of the group (built from one seed): each rank copies its own
    slice, nothing is communicated. Sharded parameters carry ``tensor_parallel_dim``. With ``loss_parallel``
    the vocabulary head returns this rank's logit slice (B, T, V_pad / tp) for :func:`causal_lm_loss`; else the
    whole (B, T, V). Raises ValueError (before changing anything) where a head count does not divide by tp.
    """
    tp = dist.get_world_size(tp_group)
    _check(model, tp)
    converted: dict[int, nn.Parameter] = {}  # id of a full vocabulary table -> this rank's shard of it
    for _, module, plan in _plans(model):
        shared = bool(getattr(module, "tensor_parallel_shared_input", False)) and "colwise" in plan.values()
        if shared:
            module.register_forward_pre_hook(_SharedInput(tp_group, algorithm))
        for child_name, kind in plan.items():
            child = getattr(module, child_name)
            if kind == "colwise":
                new = ColumnParallelLinear(
                    child.in_features,
                    child.out_features,
                    tp_group,
                    bias=child.bias is not None,
                    reduce_input_grad=not shared,
                    algorithm=algorithm,
                    init_from=child,
                )
            elif kind == "rowwise":
                new = RowParallelLinear(
                    child.in_features,
                    child.out_features,
                    tp_group,
                    bias=child.bias is not None,
                    algorithm=algorithm,
                    init_from=child,
                )
            else:
                new = _vocabulary_part(kind, child, tp_group, algorithm, loss_parallel, converted.get(id(child.weight)))
                converted[id(child.weight)] = new.weight
            for name, param in new.named_parameters(recurse=False):
                param.requires_grad_(getattr(child, name).requires_grad)  # a frozen part stays frozen
            setattr(module, child_name, new)
    rank = dist.get_rank(tp_group)
    for module in model.modules():
        heads = getattr(module, "tensor_parallel_heads", ())
        for attribute in heads:
            setattr(module, attribute, getattr(module, attribute) // tp)
        if heads and hasattr(module, "head_offset"):  # where its heads sit among the model's, for dropout's masks
            module.head_offset = rank * getattr(module, heads[0])
    return model


class _SharedInput:
    """A forward pre-hook: the part's first input cast for autocast (as the part casts it, once) and put through
    ``f``, whose backward all-reduces the gradient its column-parallel children summed on the rank, in the 16 bits
    of the cast under autocast."""

    def __init__(self, group, algorithm: str) -> None:
        self.group, self.algorithm = group, algorithm

    def __call__(self, _module: nn.Module, args: tuple) -> tuple:
        x = autocast_input(args[0])
        return (tpc.copy_to_tensor_parallel_region(x, self.group, self.algorithm), *args[1:])


def _vocabulary_part(
    kind: str, child: nn.Module, group, algorithm: str, loss_parallel: bool, shard: nn.Parameter | None
) -> nn.Module:
    """The vocabulary-split embedding or head of ``child``; ``shard`` (a tied table already split) is reused."""
    vocab, dim = child.weight.shape
    padded = padded_vocab_size(vocab, dist.get_world_size(group))
    source = child if shard is None else None  # a tied table is copied once
    if kind == "vocab_embedding":
        new = VocabParallelEmbedding(padded, dim, group, algorithm=algorithm, init_from=source)
    else:
        new = VocabParallelLMHead(
            dim,
            vocab,
            padded,
            group,
            gather_output=not loss_parallel,
            algorithm=algorithm,
            init_from=source,
        )
    if shard is not None:
        new.weight = shard  # tied: the two parts keep one Parameter
    return new


def causal_lm_loss(
    tp_group=None, *, algorithm: str = "auto", reduction: str = "mean"
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mean next-token cross-entropy of logits (B, T, V) against targets (B, T); with a ``tp_group`` of
    more than one rank, of the vocabulary-split logits (B, T, V_pad / tp) of a ``loss_parallel`` model, never
    gathered (:func:`~dtrain.parallel.tensor_parallel.vocab_parallel_cross_entropy`). ``reduction="none"``
    gives the per-token losses (B, T) instead."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        return lambda logits, targets: vocab_parallel_cross_entropy(
            logits, targets, tp_group, algorithm=algorithm, reduction=reduction
        )
    if reduction == "none":
        return lambda logits, targets: F.cross_entropy(
            logits.flatten(0, -2).float(), targets.flatten(), reduction="none"
        ).view(targets.shape)
    return lambda logits, targets: F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
