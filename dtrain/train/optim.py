"""The optimizer of ``dtrain train``: AdamW with decoupled weight decay (Loshchilov & Hutter 2019) on the weight
matrices only, and the learning-rate schedules.

Weight decay applies to every parameter of two or more dimensions (linear weights and embedding tables) and not
to one-dimensional ones (norm gains, biases), as nanoGPT and torchtitan do: decaying a norm's gain or a bias
toward zero constrains nothing useful and only biases the activations.

Schedules map a 0-based step to a learning rate:

- ``constant``: linear warmup from 0, then the peak;
- ``cosine``: linear warmup, then a half cosine from the peak down to ``min_lr_ratio * lr`` at the last step
  (Loshchilov & Hutter 2017, SGDR, without restarts);
- ``wsd``: warmup-stable-decay (Hu et al. 2024, MiniCPM, section 4): linear warmup, the peak held, then a linear
  decay over the last ``decay_steps`` steps down to ``min_lr_ratio * lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["SCHEDULES", "adamw", "lr_schedule", "param_groups", "set_lr"]

SCHEDULES = ("constant", "cosine", "wsd")


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], *, weight_decay: float) -> list[dict]:
    """Two AdamW groups: ``weight_decay`` on the >= 2-d parameters, none on the rest (norms, biases). A
    parameter reached under two names (tied weights) is listed once; parameters without gradients are left out."""
    decay, no_decay, seen = [], [], set()
    for _, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw(
    named_params: Iterable[tuple[str, nn.Parameter]],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    fused: bool | None = None,
    capturable: bool = False,
) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` of ``named_params``. ``fused`` (torch's single-kernel AdamW) defaults to
    on where every parameter is on a CUDA device. ``capturable``: a step that a CUDA graph can record, its
    learning rate a tensor on the parameters' device (which :func:`set_lr` fills in place, so that a schedule
    reaches the replays)."""
    groups = param_groups(named_params, weight_decay=weight_decay)
    if not groups:
        raise ValueError("adamw: no parameter that requires a gradient was given")
    if fused is None:
        fused = all(p.is_cuda for g in groups for p in g["params"])
    rate: float | torch.Tensor = lr
    if capturable:
        rate = torch.tensor(float(lr), device=groups[0]["params"][0].device)
        for g in groups:
            g["lr"] = rate.clone()  # each group's own: a schedule sets each
    return torch.optim.AdamW(groups, lr=rate, betas=betas, eps=eps, fused=fused or None, capturable=capturable)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every param group of ``optimizer`` (or of a wrapper with ``param_groups``); a
    tensor learning rate (a capturable optimizer's) is filled in place."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _check(name: str, value: float, low: float, high: float | None = None) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ValueError(f"lr_schedule: {name} must be a number {bound}, got {value!r}")


def lr_schedule(
    kind: str,
    *,
    lr: float,
    steps: int,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    min_lr_ratio: float = 0.1,
) -> Callable[[int], float]:
    """The learning rate of each 0-based step of a ``steps``-step run (see the module docstring for the kinds).

    ``decay_steps`` is wsd's final decay (default: 20% of the steps); warmup reaches the peak at step
    ``warmup_steps`` (step ``s < warmup_steps`` gets ``lr * (s + 1) / (warmup_steps + 1)``).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"lr_schedule: kind must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    _check("lr", lr, 0.0)
    _check("steps", steps, 1)
    _check("warmup_steps", warmup_steps, 0, steps)
    _check("min_lr_ratio", min_lr_ratio, 0.0, 1.0)
    if decay_steps is None:
        decay_steps = max(1, round(0.2 * steps))
    _check("decay_steps", decay_steps, 1, steps - warmup_steps if kind == "wsd" else None)
    floor = min_lr_ratio * lr

    def rate(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / (warmup_steps + 1)
        if kind == "constant":
            return lr
        if kind == "cosine":
            span = max(1, steps - 1 - warmup_steps)
            progress = min(1.0, (step - warmup_steps) / span)
            return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))
        decay_start = steps - decay_steps
        if step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return lr - (lr - floor) * progress

    return rate
