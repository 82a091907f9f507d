"""Jobs for tests/parallel/test_recompute.py: a tiny Llama trained by
:class:`~dtrain.parallel.hybrid.HybridParallel` with and without activation checkpointing
(:func:`~dtrain.parallel.recompute.checkpoint_activations`) applied to the plain model before it is split.

Each rank trains the same layout once per checkpointing variant, from the same seed and batches, with SGD
(so equal parameters after a step mean equal gradients), and reports how far each variant's losses and gradient
norms, and on grid rank 0 the whole model's parameters, lie from the run without checkpointing.
"""

from __future__ import annotations

import torch

from dtrain.models import build, preset
from dtrain.parallel.hybrid import HybridParallel
from dtrain.parallel.parallelize import causal_lm_loss
from dtrain.parallel.recompute import checkpoint_activations, checkpointed_blocks
from tests.jobs import parallel as parallel_jobs

SEQ, GLOBAL_BATCH, STEPS, LR = 8, 4, 1, 0.5

#: name -> (mode, keywords of checkpoint_activations)
VARIANTS = {
    "full": ("full", {}),
    "selective-layers": ("selective", {"layers": 2}),
    "selective-ops": ("selective", {"ops": ("matmul",)}),
}


def tiny_model(mode: str = "none", **kwargs) -> torch.nn.Sequential:
    """The tiny Llama preset from seed 0, float32, with ``mode`` applied."""
    torch.manual_seed(0)
    return checkpoint_activations(build(preset("llama", "tiny")), mode, **kwargs)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, preset("llama", "tiny").vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: torch.nn.Sequential, grid, layout: dict) -> tuple[list[float], list[float], list[torch.Tensor], int]:
    hybrid = HybridParallel(model, grid, lambda named: torch.optim.SGD([p for _, p in named], lr=LR), **layout)
    marked = len(checkpointed_blocks(hybrid.module))
    loss_fn = causal_lm_loss(grid.tp_group)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        losses.append(hybrid.train_step(x, y, loss_fn).item())
        norms.append(hybrid.last_grad_norm)
    state = hybrid.full_state_dict() or {}  # the whole model on grid rank 0 (ZeRO-3 shards gathered); {} elsewhere
    return losses, norms, list(state.values()), marked


def equivalence(dp: int, pp: int, tp: int, layout: dict) -> dict | None:
    """Per variant, the largest difference of losses, gradient norms and (grid rank 0) parameters from the run
    without checkpointing, how many tensors of the whole model were compared (``params``), and how many blocks of
    this rank's stage are still checkpointed after the split (None off the grid)."""
    grid = parallel_jobs._grid(dp, pp, tp)  # collective: every process of the pool
    if grid is None:
        return None
    want_losses, want_norms, want_params, _ = _train(tiny_model(), grid, layout)
    out: dict = {"norm": min(want_norms), "params": len(want_params)}
    for name, (mode, kwargs) in VARIANTS.items():
        losses, norms, params, marked = _train(tiny_model(mode, **kwargs), grid, layout)
        out[f"{name}-blocks"] = marked  # checkpointed blocks on this rank's stage, after the split
        out[name] = max(
            max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)),
            max(abs(a - b) for a, b in zip(norms, want_norms, strict=True)),
            max((a - b).abs().max().item() for a, b in zip(params, want_params, strict=True)) if params else 0.0,
        )
    return out
