"""Decoder-only language models as plain modules: a Llama-family decoder and GPT-2, built from the same parts.

A model is a :class:`CausalLM`, an ``nn.Sequential`` of ``[Embedding, Block x L, Head]``: token ids ``(B, T)``
in, logits ``(B, T, V)`` out. Being a sequence of layers is what lets pipeline parallelism cut it into stages;
the parts themselves are ordinary modules.

- :class:`Embedding`: the token table (``embed_tokens``) and, for GPT-2, learned positions (``embed_positions``).
- :class:`Block`: pre-norm ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``. Llama uses RMSNorm
  (Zhang & Sennrich 2019) and a SwiGLU MLP (Shazeer 2020, ``down(silu(gate(x)) * up(x))``); GPT-2 LayerNorm and
  ``down(gelu_tanh(up(x)))``.
- :class:`Attention`: separate ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; ``n_kv_heads`` key-value heads
  shared by groups of query heads (grouped-query attention, Ainslie et al. 2023); rotary position embeddings
  (Su et al. 2021) in the rotate-half layout of Hugging Face's Llama for Llama; causal
  ``scaled_dot_product_attention`` (flash kernels on GPUs); with tracked attention dropout, the flash kernel of
  :mod:`dtrain.models.attention_kernel` on GPUs, the attention written out elsewhere.
- :class:`Head`: the final norm and ``lm_head``, tied to ``embed_tokens`` when the config says so (the same
  ``Parameter`` object).

Each part names, as data, how tensor parallelism splits it: ``tensor_parallel_plan`` maps a child linear or
embedding to ``"colwise"``, ``"rowwise"``, ``"vocab_embedding"`` or ``"vocab_head"``,
``tensor_parallel_heads`` lists the head counts that each tensor-parallel rank holds a share of, and
``tensor_parallel_shared_input`` says that every column-parallel child reads the part's input unchanged. The
parallel layer reads these (``dtrain.parallel.parallelize``); a model built from these parts needs no parallel
code.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.models import attention_kernel
from dtrain.models import dropout as dropouts
from dtrain.models.config import GPT2Config, LlamaConfig, ModelConfig
from dtrain.models.dropout import Dropout

__all__ = [
    "Attention",
    "Block",
    "CausalLM",
    "Embedding",
    "GeluMLP",
    "Head",
    "SwiGLU",
    "autocast_input",
    "build",
    "rope_frequencies",
]


def rope_frequencies(config: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies ``theta^(-2i / d)`` (head_dim / 2,), with Llama 3's long-context scaling
    of the low frequencies where ``rope_scaling`` asks for it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq.float()
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)  # long waves slowed by `factor`
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(medium, blended, scaled).float()


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype where autocast is on for its device, else ``x``: a part casts its input once for
    all its products (q, k and v; gate and up), where autocast would cast it once a product, and the products keep
    that one 16-bit copy for backward, whose gradients meet in it."""
    kind = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        if x.dtype != dtype:
            return x.to(dtype)
    return x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Embedding(nn.Module):
    """Token ids ``(B, T)`` -> ``(B, T, C)``: the token table, plus learned positions for GPT-2."""

    tensor_parallel_plan = {"embed_tokens": "vocab_embedding"}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        gpt2 = isinstance(config, GPT2Config)
        dim = config.n_embd if gpt2 else config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, dim)
        self.embed_positions = nn.Embedding(config.n_positions, dim) if gpt2 else None
        self.dropout = Dropout(config.embd_pdrop if gpt2 else 0.0)
        self.max_positions = config.n_positions if gpt2 else config.max_position_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.max_positions:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's {self.max_positions} positions")
        x = self.embed_tokens(ids)  # (B, T, C)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(t, device=ids.device))
        return self.dropout(x)


class Attention(nn.Module):
    """Causal self-attention with ``n_heads`` query heads and ``n_kv_heads`` key-value heads.

    With attention dropout above 0 and tracked (:func:`dtrain.models.dropout.tracked`), the probabilities are
    dropped by the hash of :class:`Dropout`: on a CUDA device with Triton, inside a flash-attention kernel
    (:func:`dtrain.models.attention_kernel.attention`); elsewhere, or with ``flash_dropout`` False, by the
    attention written out (:meth:`_dropped_attention`), whose mask the kernel's equals bit for bit."""

    tensor_parallel_plan = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
    tensor_parallel_shared_input = True  # q, k and v read the input unchanged
    tensor_parallel_heads = ("n_heads", "n_kv_heads")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if isinstance(config, GPT2Config):
            dim, self.n_heads, self.n_kv_heads = config.n_embd, config.n_head, config.n_head
            self.head_dim, bias, out_bias = config.n_embd // config.n_head, True, True
            self.attn_dropout, self.resid_dropout = Dropout(config.attn_pdrop), Dropout(config.resid_pdrop)
            inv_freq = None
        else:
            dim, self.n_heads, self.n_kv_heads = (
                config.hidden_size,
                config.num_attention_heads,
                config.num_key_value_heads,
            )
            self.head_dim, bias = config.head_dim, config.attention_bias
            out_bias = bias
            self.attn_dropout, self.resid_dropout = Dropout(config.attention_dropout), Dropout(0.0)
            inv_freq = rope_frequencies(config)
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=out_bias)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.head_offset = 0  # the model's index of this module's first query head (tensor parallelism sets it)
        self.flash_dropout = True  # tracked attention dropout in the flash kernel where it takes the inputs

    def _rope(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the tables are made anew each forward: a value kept from one forward to the next would make a
        # selective checkpoint's recomputation run other operations than its forward did
        t = q.shape[2]
        angles = torch.outer(torch.arange(t, device=q.device, dtype=torch.float32), self.inv_freq)  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = autocast_input(x)
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        if self.inv_freq is not None:
            q, k = self._rope(q, k)
        p = self.attn_dropout.p if self.training else 0.0
        # grouped-query: each key-value head serves H / H_kv query heads, read in place (no repeated copies)
        grouped = k.shape[1] != q.shape[1]
        if p > 0.0 and dropouts.tracked():
            if p < 1.0 and self.flash_dropout and attention_kernel.supports(q, k, v):
                y = attention_kernel.attention(q, k, v, p, self.attn_dropout.salt, self.head_offset)
            else:
                y = self._dropped_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=grouped)  # (B, H, T, D)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(b, t, -1)))  # (B, T, C)

    def _dropped_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention with the probabilities written out and dropped by :class:`Dropout` (each head's
        mask from its index among the model's heads), as torch's fused kernels cannot take a mask: ``(B, H, T, T)``
        scores in the inputs' dtype, the softmax computed in float32. The CPU's path, and the reference of the
        GPU's flash kernel."""
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        t = q.shape[2]
        scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)  # (B, H, T, T), in q's dtype
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill_(future, float("-inf")), dim=-1, dtype=torch.float32)
        return self.attn_dropout(probs.to(v.dtype), offsets=(0, self.head_offset)) @ v  # (B, H, T, D)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020), Llama's MLP."""

    tensor_parallel_plan = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    tensor_parallel_shared_input = True  # gate and up read the input unchanged

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        dim, hidden, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """``down(gelu(up(x)))``, GPT-2's MLP (the tanh GELU of ``gelu_new``)."""

    tensor_parallel_plan = {"up_proj": "colwise", "down_proj": "rowwise"}
    tensor_parallel_shared_input = True

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.n_embd, config.n_inner)
        self.down_proj = nn.Linear(config.n_inner, config.n_embd)
        self.approximate = "none" if config.activation_function == "gelu" else "tanh"
        self.dropout = Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate)))


def _norm(config: ModelConfig) -> nn.Module:
    if isinstance(config, GPT2Config):
        return nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
    return nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = _norm(config)
        self.attn = Attention(config)
        self.mlp_norm = _norm(config)
        self.mlp = GeluMLP(config) if isinstance(config, GPT2Config) else SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class Head(nn.Module):
    """The final norm and the LM head: ``(B, T, C)`` -> logits ``(B, T, V)``."""

    tensor_parallel_plan = {"lm_head": "vocab_head"}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.n_embd if isinstance(config, GPT2Config) else config.hidden_size
        self.norm = _norm(config)
        self.lm_head = nn.Linear(dim, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class CausalLM(nn.Sequential):
    """``[Embedding, Block x L, Head]``; ``config`` is the shape it was built from. With
    ``tie_word_embeddings`` the head's weight is the embedding's ``Parameter``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(Embedding(config), *(Block(config) for _ in range(config.num_layers)), Head(config))
        self.config = config
        dropouts.number_sites(self)
        if config.tie_word_embeddings:
            self[-1].lm_head.weight = self[0].embed_tokens.weight

    @property
    def tied(self) -> bool:
        return self[-1].lm_head.weight is self[0].embed_tokens.weight

    def reset_parameters(self) -> None:
        """Hugging Face's initialisation: weights N(0, initializer_range), biases 0, norms 1; GPT-2's residual
        output projections scaled by 1/sqrt(2 L) (Radford et al. 2019, section 2.3)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm | nn.RMSNorm):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if isinstance(self.config, GPT2Config):
            for block in list(self)[1:-1]:
                for proj in (block.attn.o_proj, block.mlp.down_proj):
                    nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))


def build(config: ModelConfig, *, device: torch.device | str | None = None) -> CausalLM:
    """A freshly initialised model of shape ``config`` (uses the global torch RNG: seed it first)."""
    if not isinstance(config, LlamaConfig | GPT2Config):
        raise TypeError(f"expected a LlamaConfig or GPT2Config, got {type(config).__name__}")
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = CausalLM(config)
    model.reset_parameters()
    return model
