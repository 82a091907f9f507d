"""Models, data, the training loop, metrics and checkpoints (``dtrain train``)."""

from dtrain.train.loop import TrainConfig, train, train_rank, validate_layout
from dtrain.train.models import GPTConfig, MLPConfig, build_model, model_config

__all__ = [
    "GPTConfig",
    "MLPConfig",
    "TrainConfig",
    "build_model",
    "model_config",
    "train",
    "train_rank",
    "validate_layout",
]
