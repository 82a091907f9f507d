"""Parameter and FLOP counts of a model shape, for model FLOPs utilisation (MFU).

Training FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B): ``6 N + 12 L H Q T``, where ``N`` is
the number of parameters that take part in a matrix multiply (every weight except the token and position lookup
tables; the LM head counts even when tied to the token table, since it multiplies), ``L`` the layers, ``H`` the
query heads, ``Q`` the head size and ``T`` the sequence length. ``6 N`` is the forward (2 N) and backward (4 N)
of the weight matmuls; ``12 L H Q T`` the attention scores and their weighted sum, forward and backward, not
halved for the causal mask (as PaLM and torchtitan count). Recomputation is not counted: this is model FLOPs,
not hardware FLOPs.
"""

from __future__ import annotations

from dtrain.models.config import GPT2Config, ModelConfig

__all__ = ["matmul_parameters", "parameter_count", "shape_dims", "train_flops_per_token"]


def shape_dims(config: ModelConfig) -> tuple[int, int, int, int, int, int, int]:
    """(dim, layers, heads, kv heads, head size, mlp hidden, vocab)."""
    if isinstance(config, GPT2Config):
        return (
            config.n_embd,
            config.n_layer,
            config.n_head,
            config.n_head,
            config.n_embd // config.n_head,
            config.n_inner,
            config.vocab_size,
        )
    return (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    )


def matmul_parameters(config: ModelConfig) -> int:
    """Weights that multiply (per token): the blocks' projections and the LM head, biases and norms left out."""
    dim, layers, heads, kv, q, hidden, vocab = shape_dims(config)
    attn = dim * heads * q * 2 + dim * kv * q * 2  # q and o; k and v
    mlp = (2 if isinstance(config, GPT2Config) else 3) * dim * hidden
    return layers * (attn + mlp) + dim * vocab


def parameter_count(config: ModelConfig) -> int:
    """Every parameter of the built model (a tied head counted once), as ``sum(p.numel())`` gives."""
    dim, layers, heads, kv, q, hidden, vocab = shape_dims(config)
    if isinstance(config, GPT2Config):
        attn = dim * heads * q * 2 + dim * kv * q * 2 + heads * q + 2 * kv * q + dim  # with biases
        block = attn + 2 * dim * hidden + hidden + dim + 4 * dim  # mlp with biases, two LayerNorms
        return layers * block + vocab * dim + config.n_positions * dim + 2 * dim
    bias = config.attention_bias
    attn = dim * heads * q * 2 + dim * kv * q * 2 + ((heads * q + 2 * kv * q + dim) if bias else 0)
    mlp = 3 * dim * hidden + ((2 * hidden + dim) if config.mlp_bias else 0)
    block = attn + mlp + 2 * dim
    head = 0 if config.tie_word_embeddings else vocab * dim
    return layers * block + vocab * dim + head + dim


def train_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one token's forward and backward at sequence length ``seq_len`` (PaLM's ``6N + 12LHQT``)."""
    dim, layers, heads, kv, q, hidden, vocab = shape_dims(config)
    return 6.0 * matmul_parameters(config) + 12.0 * layers * heads * q * seq_len


def pass_flops_per_token(config: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """One token's FLOPs in the forward, the input-gradient pass and the weight-gradient pass (the split
    zero-bubble schedules make): every product ``2N`` in each, and attention's score and value products, which hold
    no weights, ``4LHQT`` forward and twice that in the input gradient (their sum is
    :func:`train_flops_per_token`)."""
    dim, layers, heads, kv, q, hidden, vocab = shape_dims(config)
    products = 2.0 * matmul_parameters(config)
    attention = 4.0 * layers * heads * q * seq_len
    return products + attention, products + 2 * attention, products
