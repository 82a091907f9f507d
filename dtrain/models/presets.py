"""Named model shapes, from a CPU-test size to published 1B and 8B shapes.

``preset(family, name, vocab_size=...)`` returns a config; the vocabulary of a preset trained from scratch is the
tokenizer's, so ``vocab_size`` overrides the preset's where given. The published shapes are those of the
Hugging Face ``config.json`` files of Llama 3.2 1B, Llama 3.1 8B (Grattafiori et al. 2024) and GPT-2 (Radford
et al. 2019).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtrain.models.config import GPT2Config, LlamaConfig, ModelConfig

__all__ = ["PRESETS", "preset", "preset_names"]

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _llama(**fields: Any) -> Callable[[], LlamaConfig]:
    return lambda: LlamaConfig(**fields)


def _gpt2(**fields: Any) -> Callable[[], GPT2Config]:
    return lambda: GPT2Config(**fields)


PRESETS: dict[str, dict[str, Callable[[], ModelConfig]]] = {
    "llama": {
        # seconds on a CPU: the tests' and the first README run's size (~0.2 M parameters besides the vocabulary)
        "tiny": _llama(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        ),
        # a GPT-2-small-sized Llama: 12 x 768, 12 heads (4 key-value heads), 2048 context (~110 M with a
        # 32k vocabulary)
        "125m": _llama(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        ),
        # Llama 3.2 1B: 16 x 2048, 32 heads, 8 key-value heads, tied embeddings (1.24 B parameters)
        "1b": _llama(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
            tie_word_embeddings=True,
        ),
        # Llama 3.1 8B: 32 x 4096, 32 heads, 8 key-value heads, untied (8.03 B parameters)
        "8b": _llama(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
        ),
    },
    "gpt2": {
        "tiny": _gpt2(vocab_size=512, n_positions=256, n_embd=64, n_layer=4, n_head=4),
        "124m": _gpt2(),  # GPT-2 small
        "355m": _gpt2(n_embd=1024, n_layer=24, n_head=16),  # GPT-2 medium
    },
}


def preset_names(family: str | None = None) -> list[str]:
    """``family/name`` of every preset (of one family where given)."""
    return [f"{f}/{n}" for f, names in PRESETS.items() if family in (None, f) for n in names]


def preset(family: str, name: str, *, vocab_size: int | None = None, **overrides: Any) -> ModelConfig:
    """The config of preset ``name`` of ``family`` ("llama" or "gpt2"), with ``vocab_size`` and ``overrides``
    applied (validated again). ValueError naming the known presets for an unknown one."""
    if family not in PRESETS:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(PRESETS)}")
    if name not in PRESETS[family]:
        raise ValueError(f"no preset {name!r} for {family}; known: {', '.join(PRESETS[family])}")
    base = PRESETS[family][name]()
    fields = {k: v for k, v in vars(base).items()}
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    return type(base)(**{**fields, **overrides})
