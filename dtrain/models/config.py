"""Model shapes: :class:`LlamaConfig` and :class:`GPT2Config`, each with the field names of its Hugging Face
``transformers`` counterpart, so that a ``config.json`` maps onto it key for key.

A config is validated when it is made: every size positive, the heads dividing the width, the key-value heads
dividing the query heads. ``ConfigError`` carries the key it is about (``key``) so that callers can name the
file or flag it came from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["CONFIGS", "GPT2Config", "LlamaConfig", "ModelConfig", "ModelConfigError", "config_fields"]


class ModelConfigError(ValueError):
    """A bad model field; ``key`` is the field's name."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


def _positive_ints(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelConfigError(name, f"must be a positive int, got {value!r}")


def _positive_numbers(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 < value < math.inf:
            raise ModelConfigError(name, f"must be a finite number > 0, got {value!r}")


def _probability(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 <= value < 1.0:
            raise ModelConfigError(name, f"must be a number in [0, 1), got {value!r}")


def _llama3_scaling(scaling: dict[str, Any]) -> None:
    """Llama 3's scaling divides by ``factor``, by each frequency factor and by their difference: each a finite number,
    ``0 < low_freq_factor < high_freq_factor``, and a positive ``original_max_position_embeddings``."""
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = scaling[key]
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 < value < math.inf:
            raise ModelConfigError("rope_scaling", f"{key} must be a finite number > 0, got {value!r}")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ModelConfigError(
            "rope_scaling",
            f"high_freq_factor {scaling['high_freq_factor']!r} must be greater than low_freq_factor "
            f"{scaling['low_freq_factor']!r}",
        )


@dataclass(kw_only=True)
class LlamaConfig:
    """A Llama-family decoder (Touvron et al. 2023): RMSNorm, rotary position embeddings, SwiGLU MLP,
    grouped-query attention (Ainslie et al. 2023), tied or untied embeddings. Field names and defaults are
    ``transformers.LlamaConfig``'s."""

    model_type: ClassVar[str] = "llama"

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as the query heads (multi-head attention)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None, or {"rope_type": "llama3", "factor": ..., ...}
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _positive_ints(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelConfigError(
                    "num_attention_heads",
                    f"{self.num_attention_heads} does not divide hidden_size {self.hidden_size} (or give head_dim)",
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        _positive_ints(self, "head_dim")
        if self.head_dim % 2:
            raise ModelConfigError("head_dim", f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}",
            )
        if self.hidden_act != "silu":
            raise ModelConfigError("hidden_act", f"the SwiGLU MLP takes 'silu', got {self.hidden_act!r}")
        _probability(self, "attention_dropout")
        _positive_numbers(self, "rms_norm_eps", "rope_theta", "initializer_range")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ModelConfigError("rope_scaling", f"rope_type must be 'llama3' or 'default', got {kind!r}")
            missing = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} - set(
                self.rope_scaling
            )
            if kind == "llama3" and missing:
                raise ModelConfigError("rope_scaling", f"llama3 scaling needs {', '.join(sorted(missing))}")
            if kind == "llama3":
                _llama3_scaling(self.rope_scaling)

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers


@dataclass(kw_only=True)
class GPT2Config:
    """GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm blocks, a 4x GELU (tanh) MLP, the LM head
    tied to the token embedding. Field names and defaults are ``transformers.GPT2Config``'s."""

    model_type: ClassVar[str] = "gpt2"

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # None: 4 * n_embd
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.n_inner is None:
            self.n_inner = 4 * self.n_embd
        _positive_ints(self, "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")
        if self.n_embd % self.n_head:
            raise ModelConfigError("n_head", f"{self.n_head} does not divide n_embd {self.n_embd}")
        if self.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ModelConfigError(
                "activation_function",
                f"must be gelu_new, gelu_pytorch_tanh or gelu, got {self.activation_function!r}",
            )
        _probability(self, "resid_pdrop", "embd_pdrop", "attn_pdrop")
        _positive_numbers(self, "layer_norm_epsilon", "initializer_range")
        if not self.scale_attn_weights:
            raise ModelConfigError("scale_attn_weights", "only the scaled attention (true) is supported")
        if not self.tie_word_embeddings:
            raise ModelConfigError("tie_word_embeddings", "GPT-2 ties its head to the token embedding")

    @property
    def num_layers(self) -> int:
        return self.n_layer


ModelConfig = LlamaConfig | GPT2Config
CONFIGS: dict[str, type[LlamaConfig] | type[GPT2Config]] = {"llama": LlamaConfig, "gpt2": GPT2Config}


def config_fields(kind: type) -> list[str]:
    return [f.name for f in dataclasses.fields(kind)]
