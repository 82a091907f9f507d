"""Models, data, the training loop, metrics and checkpoints (``dtrain train``).

Names are imported on first use, so that building the command's parser (:mod:`dtrain.train.config`) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "GPTConfig",
    "MLPConfig",
    "TrainConfig",
    "build_model",
    "check_run",
    "model_config",
    "train",
    "train_rank",
    "validate_layout",
]

_HOMES = {
    "GPTConfig": "dtrain.train.models",
    "MLPConfig": "dtrain.train.models",
    "build_model": "dtrain.train.models",
    "model_config": "dtrain.train.models",
    "TrainConfig": "dtrain.train.config",
    "check_run": "dtrain.train.loop",
    "train": "dtrain.train.loop",
    "train_rank": "dtrain.train.loop",
    "validate_layout": "dtrain.train.loop",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dtrain.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
