"""Mixed precision for ``dtrain train``: the compute dtype of a precision setting, the autocast context, and a
dynamic loss scale for float16.

Weights and optimizer state stay float32 (the master weights); ``torch.autocast`` runs the matrix multiplies in
bf16 or fp16 (Micikevicius et al. 2018, "Mixed Precision Training"). bf16 has float32's exponent range and needs
no loss scaling; float16 does: the loss is multiplied by a scale before backward so that small gradients do not
flush to zero, the gradients are divided by it before the step, and a step whose gradients overflowed (inf or
NaN anywhere, on any rank) is skipped and the scale halved; after ``growth_interval`` clean steps it doubles
(section 3.2, and ``torch.amp.GradScaler``'s policy).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["PRECISIONS", "DynamicLossScaler", "autocast", "autocast_dtype"]

PRECISIONS = ("auto", "float32", "bf16", "fp16")


def autocast_dtype(precision: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device``: None for float32 (and for ``auto`` on a CPU), bf16 for
    ``bf16`` (and ``auto`` on CUDA), float16 for ``fp16`` (CUDA only)."""
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise ValueError(f"--precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(f"--precision fp16: float16 training needs a CUDA device, this run is on {device.type}")
    return {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast(dtype: torch.dtype | None, device: torch.device | str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type; a no-op context for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


class DynamicLossScaler:
    """The loss scale of float16 training: :attr:`scale` multiplies the loss; :meth:`update` after each step
    halves it (``backoff_factor``) on an overflow and multiplies it by ``growth_factor`` after
    ``growth_interval`` steps in a row without one."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"DynamicLossScaler: init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"DynamicLossScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"DynamicLossScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"DynamicLossScaler: growth_interval must be a positive int, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0
        self.skipped = 0

    def update(self, found_inf: bool) -> None:
        """Record one step: an overflow (the step was skipped) backs the scale off; enough clean ones grow it."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state.get("skipped", 0))
