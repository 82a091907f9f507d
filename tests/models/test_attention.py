"""dtrain.models' attention: the grouped key-value heads read in place compute what copies repeated to every query
head compute, forward and backward."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dtrain.models.decoder import Attention, _rotate_half
from dtrain.models.presets import preset


def _attention() -> Attention:
    torch.manual_seed(0)
    return Attention(preset("llama", "tiny"))  # 4 query heads, 2 key-value heads


def _repeated(attention: Attention, x: torch.Tensor) -> torch.Tensor:
    """The same attention with fresh tables and the key-value heads repeated to every query head."""
    b, t, _ = x.shape
    q = attention.q_proj(x).view(b, t, -1, attention.head_dim).transpose(1, 2)
    k = attention.k_proj(x).view(b, t, -1, attention.head_dim).transpose(1, 2)
    v = attention.v_proj(x).view(b, t, -1, attention.head_dim).transpose(1, 2)
    angles = torch.outer(torch.arange(t, dtype=torch.float32), attention.inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attention.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def test_grouped_heads_read_in_place_compute_what_repeated_copies_compute():
    attention = _attention()
    assert attention.n_kv_heads < attention.n_heads
    reference = copy.deepcopy(attention)
    x = torch.randn(2, 16, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = attention(x), _repeated(reference, x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for (name, p), p_ref in zip(attention.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_every_form_the_attention_benchmark_times_computes_the_block_as_built():
    """benchmarks/gpu/attention_forms.py times a block in forms other than dtrain.models' (the heads repeated, the
    inputs cast a product apart, the rotary tables kept): each gives the block's output under autocast, and its
    forms with the inputs cast apart keep more tensors for backward."""
    import importlib.util
    from dataclasses import replace
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "attention_forms.py"
    spec = importlib.util.spec_from_file_location("attention_forms", path)
    forms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forms)
    config = replace(preset("llama", "tiny"), num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    x = torch.randn(2, 16, config.hidden_size, requires_grad=True)
    outputs, kept = {}, {}
    for form in forms.FORMS:
        block = forms.block_of(config, form, torch.device("cpu"))
        storages: set[int] = set()

        def keep(t: torch.Tensor, storages: set[int] = storages) -> torch.Tensor:
            storages.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            outputs[form] = block(x).float()
        kept[form] = len(storages)
    for form, y in outputs.items():
        torch.testing.assert_close(y, outputs["model"], rtol=0, atol=0, msg=form)
    assert kept["each-call+grouped+each"] > kept["each-call+grouped+shared"] == kept["model"]
