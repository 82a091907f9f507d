"""Preset sizes against the published parameter counts and a built model; FLOPs per token against a hand count."""

from __future__ import annotations

import pytest
import torch

from dtrain.models.config import GPT2Config, LlamaConfig
from dtrain.models.decoder import CausalLM, build
from dtrain.models.flops import matmul_parameters, parameter_count, train_flops_per_token
from dtrain.models.hf import dtrain_shapes
from dtrain.models.presets import preset


def _meta_count(config) -> int:
    with torch.device("meta"):
        model = CausalLM(config)
    return sum(p.numel() for p in model.parameters())  # a tied Parameter once


@pytest.mark.parametrize(
    ("name", "published"),
    [("1b", 1_235_814_400), ("8b", 8_030_261_248)],  # Llama 3.2 1B and Llama 3.1 8B model cards' safetensors sizes
)
def test_llama_presets_have_the_published_sizes(name, published):
    config = preset("llama", name)
    assert parameter_count(config) == published
    assert _meta_count(config) == published


def test_gpt2_small_has_the_published_size():
    assert parameter_count(preset("gpt2", "124m")) == 124_439_808 == _meta_count(preset("gpt2", "124m"))


def test_train_flops_per_token_of_the_tiny_preset_by_hand():
    config = preset("llama", "tiny")  # 4 x 64, 4 heads of 16, 2 kv heads, MLP 176, vocab 512, seq 256
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 176  # q, k, v, o, gate/up/down
    matmul = 4 * per_layer + 64 * 512  # and the (tied) LM head, which multiplies
    assert matmul == matmul_parameters(config) == 217_088
    model = build(config)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linears == matmul  # every nn.Linear weight, the tied head included
    attention = 12 * 4 * 4 * 16 * 256  # 12 L H Q T
    assert train_flops_per_token(config, 256) == 6 * matmul + attention == 2_088_960


@pytest.mark.parametrize(
    "config",
    [
        preset("llama", "tiny"),
        preset("llama", "tiny", tie_word_embeddings=False, attention_bias=True, mlp_bias=True, head_dim=8),
        preset("gpt2", "tiny", n_inner=80),
        GPT2Config(vocab_size=10, n_positions=8, n_embd=12, n_layer=1, n_head=3),
        LlamaConfig(vocab_size=10, hidden_size=12, intermediate_size=20, num_hidden_layers=1, num_attention_heads=3),
    ],
    ids=["llama-tiny", "llama-biases", "gpt2-tiny", "gpt2-one-layer", "llama-one-layer"],
)
def test_checkpoint_shapes_are_the_built_models(config):
    model = build(config)
    assert dtrain_shapes(config) == {name: tuple(p.shape) for name, p in model.named_parameters()}
