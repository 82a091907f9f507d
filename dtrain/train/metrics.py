"""Metrics of ``dtrain train``: one JSON line per record, TensorBoard scalars, and model FLOPs utilisation.

MFU (Chowdhery et al. 2022, PaLM, appendix B) is the model FLOPs a second the run achieves over the devices'
peak: ``tokens_per_s * flops_per_token / (world_size * peak)``, with ``flops_per_token`` from
:func:`dtrain.models.train_flops_per_token` and the peak the device's dense bf16 tensor rate from its datasheet
(:data:`PEAK_BF16_FLOPS`). It is undefined on CPUs (no datasheet peak): None.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PEAK_BF16_FLOPS",
    "MetricsWriter",
    "describe_plan_score",
    "mfu",
    "peak_flops",
    "peak_memory_bytes",
    "plan_score",
    "reset_peak_memory",
]

# Dense (no sparsity) bf16 tensor-core FLOP/s by device name, from NVIDIA's datasheets: H100 SXM5 989.4 T,
# H100 PCIe 756 T, H100 NVL 835 T, H200 (SXM) 989.4 T, A100 312 T. Matched by substring, most specific first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("A100", 312e12),
)


def peak_flops(device: torch.device | str) -> float | None:
    """The dense bf16 peak FLOP/s of ``device`` (None on a CPU or an unlisted GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def mfu(tokens_per_s: float, flops_per_token: float, world_size: int, device: torch.device | str) -> float | None:
    """Model FLOPs utilisation of ``world_size`` devices like ``device`` processing ``tokens_per_s`` in all."""
    peak = peak_flops(device)
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (world_size * peak)


def peak_memory_bytes(device: torch.device | str) -> int | None:
    """The most memory torch allocated on ``device`` since the last :func:`reset_peak_memory` (None on a CPU)."""
    device = torch.device(device)
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class MetricsWriter:
    """Appends each record to ``<out_dir>/metrics.jsonl`` (flushed per record) and, with ``tensorboard``, writes
    its numeric fields as TensorBoard scalars under ``<out_dir>/tensorboard/``: ``train/<key>``, and a record's
    ``eval_loss`` as ``eval/loss``, at ``record["step"]``. ``resume`` appends to an existing metrics file.

    ``first_step`` is the step the run continues from (0 for a fresh run): TensorBoard hides the scalars that
    earlier event files in the directory hold past it (a run that died after its last checkpoint, or an earlier
    run in the same directory), so each step shows the values of the run that continued."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool, resume: bool = False, first_step: int = 0) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._file = open(self.out / "metrics.jsonl", "a" if resume else "w")  # noqa: SIM115 (closed in close())
        self._board = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=first_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._board is None:
            return
        step = int(record.get("step", 0))
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not math.isfinite(value):
                continue
            tag = "eval/loss" if key == "eval_loss" else f"train/{key}"
            self._board.add_scalar(tag, value, step)
        self._board.flush()

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: steps of a run left out of its measured step time: the first steps compile, allocate and warm the caches
WARMUP_STEPS = 3


def plan_score(
    records: Sequence[dict[str, Any]], config, *, peak_memory_gib: float | None = None
) -> dict[str, Any] | None:
    """The plan's prediction (``config.plan`` of a :class:`~dtrain.train.config.TrainConfig`) beside this run's
    measurement: the median step time over the steps after the first :data:`WARMUP_STEPS` (all of them in a
    shorter run) and the peak device memory, ``peak_memory_gib`` where given (the training loop gives the most
    of any rank), else the largest of ``records`` (None on a CPU), with their ratios to the prediction
    (measured / predicted). None without a ``[plan]``."""
    predicted = config.plan
    if not predicted.step_s or not records:
        return None
    timed = records[WARMUP_STEPS:] if len(records) > WARMUP_STEPS else records
    measured = statistics.median(r["step_s"] for r in timed)
    peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
    memory = peak_memory_gib if peak_memory_gib is not None else (max(peaks) if peaks else None)
    return {
        "plan_layout": predicted.layout,
        "plan_topology": predicted.topology,
        "plan_step_s": predicted.step_s,
        "plan_measured_step_s": measured,
        "plan_step_ratio": measured / predicted.step_s,
        "plan_memory_gib": predicted.memory_gib,
        "plan_measured_memory_gib": memory,
        "plan_memory_ratio": None if memory is None or not predicted.memory_gib else memory / predicted.memory_gib,
        "plan_steps_timed": len(timed),
    }


def describe_plan_score(result: dict[str, Any]) -> str:
    """One line of :func:`plan_score`'s result."""
    text = (
        f"plan ({result['plan_layout']} on {result['plan_topology']}): predicted {result['plan_step_s']:.4g} s a "
        f"step, measured {result['plan_measured_step_s']:.4g} s ({result['plan_step_ratio']:.2f}x)"
    )
    if result["plan_measured_memory_gib"] is not None:
        text += (
            f"; memory predicted {result['plan_memory_gib']:.1f} GiB, measured "
            f"{result['plan_measured_memory_gib']:.1f} GiB ({result['plan_memory_ratio']:.2f}x)"
        )
    return text
