"""Activation checkpointing (recomputation): keep less of a block's forward for backward, and recompute the rest.

:func:`checkpoint_activations` marks the blocks of a plain :class:`~dtrain.models.decoder.CausalLM` (an
``nn.Sequential`` of ``[Embedding, Block x L, Head]``) before it is parallelised:

- ``"full"``: each block keeps only its input; backward runs its forward again
  (:func:`torch.utils.checkpoint.checkpoint`, non-reentrant, the RNG state restored, and the dropout key and
  first row of :mod:`dtrain.models.dropout`, so dropout draws the same masks; Chen et al. 2016, "Training Deep
  Nets with Sublinear Memory Cost");
- ``"selective"``: recomputation of the chosen blocks only (``layers``), and/or, inside them, of every operation
  but the kinds whose outputs are kept (``ops``; torch's selective activation checkpointing,
  :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`). The default, ``ops=("matmul",)``, keeps
  the outputs of the matrix multiplications and recomputes the attention core and the elementwise operations
  (norms, rotary embeddings, activations): the cheap FLOPs that hold most of a layer's activation bytes, the idea
  of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 5 (which
  recomputes the attention core alone).

Operation kinds (:data:`OP_KINDS`): ``"attention"`` (the fused scaled-dot-product attention kernels),
``"matmul"`` (``mm``, ``addmm``, ``bmm``, ``baddbmm``), ``"norm"`` (fused layer and RMS norms) and
``"elementwise"`` (operators tagged pointwise, copies excepted). A kept operation's output is stored whether or
not plain autograd would store it, so keeping a kind costs memory in proportion to its outputs. Every operation
outside the kept kinds (views, copies, reductions, collectives) and every operation that writes into its input
is recomputed, so a collective inside a block (a tensor-parallel all-reduce) runs again in backward on every
rank of the group, in the same order, like the rest of the forward.

The blocks keep their class, their names and their parameters: only the instance's ``forward`` is wrapped,
calling the class's forward at call time. So :func:`~dtrain.parallel.parallelize.tensor_parallelize` (which
replaces linears inside a block), pipeline stages (which take blocks as they are), ZeRO and data parallelism
(which see the same parameters), checkpoints and the Hugging Face export all work on a checkpointed model
unchanged. Under ``torch.no_grad`` (evaluation) a block runs its plain forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from dtrain.models import dropout as dropouts
from dtrain.parallel.recompute_options import DEFAULT_KEEP, MODES, OP_KINDS, parse_layers

__all__ = [
    "DEFAULT_KEEP",
    "MODES",
    "OP_KINDS",
    "checkpoint_activations",
    "checkpointed_blocks",
    "op_kind",
    "parse_layers",
]


_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_int_mm"}
_NORM = {"native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm", "native_batch_norm", "group_norm"}
_COPIES = {"clone", "copy", "_to_copy", "contiguous"}  # tagged pointwise, but a collective may write into them


def op_kind(func) -> str | None:
    """The kind (one of :data:`OP_KINDS`) of an ATen operator overload, or None for any other operator."""
    name = func._schema.name.split("::")[-1]
    if "scaled_dot_product" in name or name.endswith(("_flash_attention", "_efficient_attention")):
        return "attention"
    if name in _MATMUL:
        return "matmul"
    if name in _NORM:
        return "norm"
    if torch.Tag.pointwise in func.tags and name not in _COPIES:
        return "elementwise"
    return None


def _policy(keep: frozenset[str]) -> Callable:
    """A selective-checkpoint policy keeping the outputs of the kinds in ``keep``, recomputing the rest."""

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func._schema.is_mutable or op_kind(func) not in keep:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def _checkpointed_forward(module: nn.Module, keep: frozenset[str] | None, *args, **kwargs):
    """``module``'s class forward, recomputed in backward (all of it, or all but the kinds in ``keep``)."""
    forward = type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if dropouts.tracked() and args and isinstance(args[0], torch.Tensor):
        # backward recomputes under the key and first row of this forward, not those current then
        forward = functools.partial(_with_dropout_state, forward, dropouts.snapshot(args[0].device))
    if keep is None:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _policy(keep))
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **kwargs)


def _with_dropout_state(forward: Callable, saved: dict, *args, **kwargs):
    with dropouts.restored(saved):
        return forward(*args, **kwargs)


def from_text(mode: str, layers: str = "", keep: str = "") -> tuple[str, dict]:
    """``(mode, keywords)`` of :func:`checkpoint_activations` from the text of ``dtrain train``'s options
    (``activation_checkpointing``, ``recompute_layers``, ``recompute_keep``): ``layers`` as :func:`parse_layers`
    reads it, ``keep`` comma-separated op kinds (empty: the whole block recomputed). The layers and kinds count
    only for ``"selective"``; selective with neither is full recomputation."""
    if mode != "selective":
        return mode, {}
    chosen = parse_layers(layers)
    kinds = [k.strip() for k in keep.split(",") if k.strip()]
    if chosen is None and not kinds:
        return "full", {}
    return mode, {"layers": chosen, "ops": kinds or None}


def chosen_blocks(layers: int | Iterable[int] | None, count: int) -> list[int]:
    """The indices of the blocks ``layers`` picks out of ``count`` (see :func:`checkpoint_activations`);
    ValueError for an index out of range."""
    if layers is None:
        return list(range(count))
    if isinstance(layers, bool) or not isinstance(layers, int | Iterable):
        raise ValueError(f"layers: expected None, an int K (every K-th block) or block indices, got {layers!r}")
    if isinstance(layers, int):
        if layers < 1:
            raise ValueError(f"layers: every K-th block needs K >= 1, got {layers}")
        return list(range(0, count, layers))
    chosen = list(layers)
    for i in chosen:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
            raise ValueError(f"layers: block index {i!r} is not in [0, {count}) (the model has {count} blocks)")
    return sorted(set(chosen))


def _block_modules(model: nn.Module) -> list[nn.Module]:
    if not isinstance(model, nn.Sequential) or len(model) < 3:
        raise ValueError(
            f"checkpoint_activations: expected a CausalLM, an nn.Sequential [Embedding, Block x L, Head], "
            f"got {type(model).__name__}"
        )
    return list(model)[1:-1]


def checkpoint_activations(
    model: nn.Sequential,
    mode: str,
    *,
    layers: int | Sequence[int] | None = None,
    ops: Sequence[str] | None = None,
) -> nn.Sequential:
    """Mark ``model``'s blocks for recomputation in backward (in place; returns ``model``).

    ``mode``: ``"none"`` (nothing changes), ``"full"`` (every block) or ``"selective"``. For ``"selective"``,
    ``layers`` picks the blocks (indices in ``[0, L)``, or an int ``K``: every K-th block; None: every block)
    and ``ops`` the kinds of operation whose outputs are kept inside them, the rest recomputed (names from
    :data:`OP_KINDS`; None: the whole block recomputed). With neither given, ``"selective"`` keeps the matmul
    outputs of every block and recomputes the rest. Apply it to the plain model, before tensor, pipeline or data
    parallelism. ValueError (one line, before changing anything) for an unknown mode, a block index out of range
    or an unknown op kind.
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: accepted: {', '.join(MODES)}")
    if mode != "selective" and (layers is not None or ops is not None):
        raise ValueError(f"activation checkpointing mode {mode!r} takes no layers or ops; use mode 'selective'")
    blocks = _block_modules(model)
    if ops is not None:
        if isinstance(ops, str):
            ops = [ops]
        unknown = [o for o in ops if o not in OP_KINDS]
        if unknown or not ops:
            raise ValueError(f"ops {list(ops)!r}: accepted op kinds to keep: {', '.join(OP_KINDS)} (at least one)")
    if mode == "none":
        return model
    chosen = chosen_blocks(layers, len(blocks))
    keep: frozenset[str] | None = None
    if mode == "selective":
        if ops is not None:
            keep = frozenset(ops)
        elif layers is None:
            keep = frozenset(DEFAULT_KEEP)
    for i in chosen:
        block = blocks[i]
        block.forward = functools.partial(_checkpointed_forward, block, keep)
    return model


def checkpointed_blocks(model: nn.Module) -> dict[str, tuple[str, ...] | None]:
    """``{module name: op kinds kept (None: none, all of it recomputed)}`` of each module :func:`checkpoint_activations`
    marked in ``model``."""
    found = {}
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func is _checkpointed_forward:
            kinds = forward.args[1]
            found[name] = None if kinds is None else tuple(k for k in OP_KINDS if k in kinds)
    return found
