"""Autoregressive sampling from a :class:`~dtrain.models.decoder.CausalLM`.

Each step runs the model on the last ``max_positions`` tokens (the window the model was built for) and picks the
next token from the final position's logits: the argmax at temperature 0 (greedy decoding, as
``transformers``' ``generate(do_sample=False)``), else a sample from ``softmax(logits / temperature)``, restricted
to the ``top_k`` most likely tokens where given (Fan et al. 2018). The whole window is recomputed per token (no
key-value cache): the cost is ``max_new_tokens`` forward passes over at most ``max_positions`` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MAX_SEED", "generate", "max_positions"]


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence ``model`` takes (its config's ``max_position_embeddings`` / ``n_positions``)."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        if hasattr(config, name):
            return int(getattr(config, name))
    return None


#: The largest ``seed``: torch's generators take a signed 64-bit seed.
MAX_SEED = 2**63 - 1


def _check(ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None, seed: int | None) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("ids: expected an int64 tensor of token ids (T,) or (B, T)")
    if ids.dim() not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(f"ids: expected a non-empty (T,) or (B, T) tensor, got shape {tuple(ids.shape)}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature: must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k: must be a positive int or None, got {top_k!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed: must be an int from 0 to 2**63 - 1, got {seed!r}")


def _end_ids(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """``eos_id`` as a tuple of ids (empty: none); ValueError for anything but non-negative ints."""
    ids = () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_id: must be a token id, a sequence of them or None, got {eos_id!r}")
    return ids


def _next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    # in 64 bits (a temperature float32 rounds to 0 stays above it) and shifted so that the largest is 0 (the same
    # softmax): a small temperature then sends the others to -inf rather than every logit to +-inf, whose softmax
    # is NaN
    logits = logits.double()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``ids`` followed by up to ``max_new_tokens`` generated tokens, as one LongTensor of ``ids``' rank ((T,) or
    (B, T)). ``temperature`` 0 is greedy; ``seed`` makes sampling repeatable (a generator of its own, the global
    RNG untouched). ``eos_id``: the end-of-text id, or several (Llama 3's configs name three, any of which ends a
    row, as ``transformers``' ``generate`` takes them); a row that produced one is padded with the first after,
    and generation stops once every row has. The model runs in eval mode under ``torch.inference_mode`` (its mode
    is restored after)."""
    _check(ids, max_new_tokens, temperature, top_k, seed)
    ends = _end_ids(eos_id)
    squeeze = ids.dim() == 1
    out = (ids.unsqueeze(0) if squeeze else ids).long()
    param = next(model.parameters(), None)
    device = param.device if param is not None else out.device
    out = out.to(device)
    window = max_positions(model)
    generator = None
    if seed is not None and temperature != 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    done = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
    training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                context = out if window is None else out[:, -window:]
                token = _next_token(model(context)[:, -1, :], temperature, top_k, generator)  # (B,)
                if ends:
                    token = torch.where(done, torch.full_like(token, ends[0]), token)
                    done |= torch.isin(token, torch.tensor(ends, device=device))
                out = torch.cat([out, token[:, None]], dim=1)
                if ends and bool(done.all()):
                    break
    finally:
        model.train(training)
    return out[0] if squeeze else out
