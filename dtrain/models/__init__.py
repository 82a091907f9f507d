"""Decoder language models as plain modules: Llama-family and GPT-2 shapes (:mod:`dtrain.models.config`),
built from shared parts (:mod:`dtrain.models.decoder`), named presets (:mod:`dtrain.models.presets`), FLOP
counts (:mod:`dtrain.models.flops`), and Hugging Face ``config.json`` / safetensors files
(:mod:`dtrain.models.hf`)."""

from __future__ import annotations

import importlib

from dtrain.models.config import GPT2Config, LlamaConfig, ModelConfig, ModelConfigError
from dtrain.models.flops import parameter_count, train_flops_per_token
from dtrain.models.presets import PRESETS, preset, preset_names

__all__ = [
    "PRESETS",
    "CausalLM",
    "GPT2Config",
    "LlamaConfig",
    "ModelConfig",
    "ModelConfigError",
    "build",
    "parameter_count",
    "preset",
    "preset_names",
    "train_flops_per_token",
]


def __getattr__(name: str):
    # the modules themselves load on first use, so that configurations and presets import without torch
    if name in ("CausalLM", "build"):
        value = getattr(importlib.import_module("dtrain.models.decoder"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtrain.models' has no attribute {name!r}")
