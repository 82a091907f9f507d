"""The parameter server's ``mlp`` task: a dense MLP classifier on synthetic data that needs no download.

Inputs are Gaussian, labelled by a fixed random linear teacher (``argmax(x @ W)``); the batch of step ``s`` is
drawn from a generator seeded by ``(seed, s)``, so every worker draws the same global batch at the same step and
takes its rows, and a resumed run draws what the uninterrupted one would.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ClassificationBatches", "mlp_classifier"]

_STEP_STRIDE = 1_000_003  # a prime: (seed, step) pairs map to distinct generator seeds for steps below it


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * _STEP_STRIDE + step)


def mlp_classifier(*, in_features: int, hidden: int, num_layers: int, num_classes: int) -> nn.Sequential:
    """``num_layers`` hidden ``Linear + GELU`` layers and a linear output layer (uses the global torch RNG)."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(num_layers):
        layers.append(nn.Sequential(nn.Linear(width, hidden), nn.GELU()))
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class ClassificationBatches:
    """``batch(step)`` -> ``(x, labels)``: ``x`` is ``(B, in_features)``, labels ``(B,)`` from a linear teacher."""

    def __init__(self, *, in_features: int, num_classes: int, batch_size: int, seed: int) -> None:
        self.in_features, self.batch_size, self.seed = in_features, batch_size, seed
        self.teacher = torch.randn(in_features, num_classes, generator=_generator(seed, _STEP_STRIDE - 1))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, self.in_features, generator=_generator(self.seed, step))  # (B, F)
        return x, (x @ self.teacher).argmax(dim=1)  # (B,)
