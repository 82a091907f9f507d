"""Models for ``dtrain train``, each an ``nn.Sequential`` so that pipeline parallelism can cut it into stages.

- ``"gpt"``: a decoder-only transformer after nanoGPT (Karpathy, https://github.com/karpathy/nanoGPT,
  ``model.py``): token + position embedding, ``n_layer`` pre-LayerNorm blocks of causal self-attention and a
  4x MLP with GELU, a final LayerNorm and a linear LM head (untied here, so each piece lives on one stage).
  The first layer takes token ids ``(B, T)`` and returns ``(B, T, C)``; the last returns logits ``(B, T, V)``.
- ``"mlp"``: a classifier of ``num_layers`` hidden Linear + GELU layers and a linear output layer.

Configs are typed dataclasses validated on construction; :data:`PRESETS` are plain functions returning one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "MLPConfig", "PRESETS", "build_model", "model_config", "num_layers"]


def _positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of a GPT (nanoGPT's ``GPTConfig``, same field names)."""

    vocab_size: int  # tokens the embedding and the head know
    block_size: int = 64  # longest context, the size of the position embedding
    n_layer: int = 2  # transformer blocks
    n_head: int = 2  # attention heads per block; must divide n_embd
    n_embd: int = 64  # width C of the residual stream
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "block_size", "n_layer", "n_head", "n_embd")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True)
class MLPConfig:
    """Shape of the MLP classifier."""

    in_features: int = 32
    hidden: int = 64
    num_layers: int = 2  # hidden layers
    num_classes: int = 8

    def __post_init__(self) -> None:
        _positive(self, "in_features", "hidden", "num_layers", "num_classes")


class Embedding(nn.Module):
    """Token ids ``(B, T)`` -> token + position embeddings ``(B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.n_embd)
        self.position = nn.Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.block_size = config.block_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)  # (T,)
        return self.dropout(self.token(idx) + self.position(pos))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config.n_embd
        self.ln_1 = nn.LayerNorm(c)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(c)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c), nn.Dropout(config.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class Head(nn.Module):
    """Final LayerNorm and the LM head: ``(B, T, C)`` -> logits ``(B, T, V)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def _init_gpt(model: nn.Sequential, config: GPTConfig) -> None:
    """nanoGPT's initialisation: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 n_layer)."""
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for block in model[1:-1]:
        for proj in (block.attn.proj, block.mlp[2]):
            nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))


def _gpt(config: GPTConfig) -> nn.Sequential:
    model = nn.Sequential(Embedding(config), *(Block(config) for _ in range(config.n_layer)), Head(config))
    _init_gpt(model, config)
    return model


def _mlp(config: MLPConfig) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = config.in_features
    for _ in range(config.num_layers):
        layers.append(nn.Sequential(nn.Linear(width, config.hidden), nn.GELU()))
        width = config.hidden
    layers.append(nn.Linear(width, config.num_classes))
    return nn.Sequential(*layers)


def _gpt_debug(vocab_size: int) -> GPTConfig:
    """Trains on a laptop CPU in well under a minute: 2 blocks of width 64, context 64, ~0.1 M parameters."""
    return GPTConfig(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=64)


def _gpt_small(vocab_size: int) -> GPTConfig:
    """nanoGPT's Shakespeare-char shape: 6 blocks of width 384, 6 heads, context 256 (~10 M parameters)."""
    return GPTConfig(vocab_size=vocab_size, block_size=256, n_layer=6, n_head=6, n_embd=384)


def _mlp_debug(vocab_size: int) -> MLPConfig:
    return MLPConfig()


PRESETS: dict[tuple[str, str], Callable[[int], GPTConfig | MLPConfig]] = {
    ("gpt", "debug"): _gpt_debug,
    ("gpt", "small"): _gpt_small,
    ("mlp", "debug"): _mlp_debug,
}
_CONFIGS = {"gpt": GPTConfig, "mlp": MLPConfig}
_BUILDERS = {"gpt": _gpt, "mlp": _mlp}


def model_config(name: str, preset: str = "debug", *, vocab_size: int = 256, **overrides) -> GPTConfig | MLPConfig:
    """The config of preset ``preset`` of model ``name`` with ``overrides`` applied (validated again)."""
    if (name, preset) not in PRESETS:
        known = ", ".join(p for m, p in PRESETS if m == name) or f"none (models: {', '.join(_CONFIGS)})"
        raise ValueError(f"no preset {preset!r} for model {name!r}; known: {known}")
    base = vars(PRESETS[name, preset](vocab_size))
    return _CONFIGS[name](**{**base, **overrides})


def build_model(name: str, **config) -> nn.Sequential:
    """Build model ``name`` ("gpt" or "mlp") from its config's fields, e.g. ``build_model("gpt", vocab_size=96)``.

    ``config`` may instead be ``config=GPTConfig(...)``. Uses the global torch RNG: seed it first.
    """
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(_CONFIGS)}")
    cfg = config.pop("config", None) or _CONFIGS[name](**config)
    if not isinstance(cfg, _CONFIGS[name]):
        raise ValueError(f"model {name!r} takes a {_CONFIGS[name].__name__}, got {type(cfg).__name__}")
    return _BUILDERS[name](cfg)


def num_layers(name: str, config: GPTConfig | MLPConfig) -> int:
    """Layers of the built ``nn.Sequential``: the most pipeline stages the model can be cut into."""
    if name == "gpt":
        return config.n_layer + 2
    return config.num_layers + 1
