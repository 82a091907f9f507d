"""The training loop of ``dtrain train`` and what it needs: the run configuration, the optimizer and schedules,
mixed precision, metrics, checkpoints and pipeline traces. Models live in :mod:`dtrain.models`, data in
:mod:`dtrain.data`.

Names are imported on first use, so that building the command's parser (:mod:`dtrain.train.config`) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TrainConfig", "check_run", "load_config", "train", "train_rank"]

_HOMES = {
    "TrainConfig": "dtrain.train.config",
    "load_config": "dtrain.train.config",
    "check_run": "dtrain.train.loop",
    "train": "dtrain.train.loop",
    "train_rank": "dtrain.train.loop",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dtrain.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
