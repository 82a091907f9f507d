"""dtrain.models.attention_kernel: causal flash attention whose probabilities are dropped by the hash mask inside the
kernel. On a GPU its output and input gradients are the written-out attention's (``Attention._dropped_attention``)
with the same mask, bit for bit in the mask; on the CPU, the decoder's choice between the two."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dtrain.models import attention_kernel
from dtrain.models import dropout as dropouts
from dtrain.models.config import GPT2Config, LlamaConfig
from dtrain.models.decoder import Attention, build
from dtrain.parallel.recompute import checkpoint_activations, op_kind

GPU = torch.cuda.is_available() and attention_kernel.available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and Triton")


@pytest.fixture(autouse=True)
def _untracked():
    yield
    dropouts.untracked()


def _llama(p: float = 0.1, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=97,
        hidden_size=heads * head_dim,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        attention_dropout=p,
    )


def _gpt2(p: float = 0.1) -> GPT2Config:
    return GPT2Config(
        vocab_size=97, n_positions=512, n_embd=64, n_layer=2, n_head=4, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p
    )


# ---------------------------------------------------------------------------------------------------- on the CPU


class _Spy:
    """Stands in for the kernel: records its calls and computes the written-out attention of the module."""

    def __init__(self, module: Attention) -> None:
        self.module, self.calls = module, []

    def __call__(self, q, k, v, p, salt, head_offset):  # noqa: ANN001, ANN204
        self.calls.append((p, salt, head_offset, q.dtype))
        return self.module._dropped_attention(q, k, v)


def test_the_decoder_takes_the_kernel_only_for_tracked_attention_dropout_it_supports(monkeypatch):
    torch.manual_seed(0)
    module = Attention(_llama(0.25))
    module.head_offset = 6
    spy = _Spy(module)
    monkeypatch.setattr(attention_kernel, "supports", lambda q, k, v: True)
    monkeypatch.setattr(attention_kernel, "attention", spy)
    x = torch.randn(2, 9, 64)
    module(x)  # untracked: torch's fused attention and its own dropout
    assert spy.calls == []
    dropouts.set_step(0, 1)
    with dropouts.rows(3):
        got = module(x)
        module.flash_dropout = False
        want = module(x)  # the written-out attention, same key and rows
    assert torch.equal(got, want)
    assert spy.calls == [(0.25, module.attn_dropout.salt, 6, torch.float32)]
    module.flash_dropout = True
    module.eval()
    module(x)  # nothing dropped in eval mode: the fused attention
    module.train()
    module.attn_dropout.p = 0.0
    module(x)
    module.attn_dropout.p = 1.0
    module(x)  # everything dropped: the written-out attention gives zeros
    assert len(spy.calls) == 1


def test_on_the_cpu_the_attention_is_written_out():
    torch.manual_seed(0)
    model = build(_gpt2())
    x = torch.randint(0, 97, (2, 12))
    q = torch.randn(2, 4, 12, 16)
    assert not attention_kernel.supports(q, q, q)
    dropouts.set_step(3, 0)
    kernel_on = model(x)
    for module in model.modules():
        if isinstance(module, Attention):
            module.flash_dropout = False
    assert torch.equal(model(x), kernel_on)


def test_supports_and_refusals():
    meta = torch.empty(2, 4, 8, 64, device="meta")
    kv = torch.empty(2, 2, 8, 64, device="meta")
    assert not attention_kernel.supports(meta, kv, kv)  # not a CUDA device
    with pytest.raises(ValueError, match=r"attention dropout: expected p in \[0, 1\)"):
        attention_kernel.attention(meta, kv, kv, 1.0, torch.tensor(0))


def test_selective_recomputation_counts_the_kernel_as_attention():
    assert op_kind(torch.ops.dtrain.hash_dropout_flash_attention.default) == "attention"
    assert op_kind(torch.ops.dtrain.hash_dropout_flash_attention_backward.default) is None


# ---------------------------------------------------------------------------------------------------- on a GPU


def _written_out(q, k, v, p: float, site: int, head_offset: int) -> torch.Tensor:  # noqa: ANN001
    """The decoder's written-out attention of these inputs, its dropout at site ``site`` and ``head_offset``."""
    module = Attention(_llama(p, heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[-1])).to(q.device)
    module.attn_dropout.site = site
    module.head_offset = head_offset
    return module._dropped_attention(q, k, v)


def _inputs(b, h, h_kv, t, d, dtype, q_zero=False):  # noqa: ANN001, ANN202
    # the queries laid out as the decoder's projections leave them: (B, T, H, D) memory, viewed (B, H, T, D)
    q = torch.randn(b, t, h, d, device="cuda").transpose(1, 2)
    if q_zero:
        q = q * 0
    k = torch.randn(b, h_kv, t, d, device="cuda")
    v = torch.randn(b, h_kv, t, d, device="cuda")
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


CASES = [  # dtype, (B, H, H_kv, T, D), p, head_offset, first row
    (torch.float32, (2, 4, 4, 64, 64), 0.1, 0, 0),
    (torch.float32, (2, 4, 2, 127, 64), 0.1, 4, 3),
    (torch.float32, (1, 6, 2, 300, 128), 0.1, 6, 1),
    (torch.float32, (3, 4, 1, 1, 64), 0.1, 0, 2),
    (torch.float32, (1, 4, 2, 200, 128), 0.0, 0, 0),
    (torch.float32, (2, 2, 1, 77, 40), 0.3, 2, 5),
    (torch.bfloat16, (2, 12, 12, 1024, 64), 0.1, 12, 2),
    (torch.bfloat16, (1, 8, 2, 333, 128), 0.1, 8, 7),
    (torch.bfloat16, (2, 4, 4, 17, 64), 0.0, 0, 0),
    (torch.bfloat16, (1, 4, 2, 100, 80), 0.1, 4, 1),
    (torch.float16, (2, 4, 2, 256, 64), 0.1, 4, 0),
    (torch.float16, (1, 4, 1, 129, 128), 0.1, 0, 9),
]


@needs_gpu
@pytest.mark.parametrize(("dtype", "shape", "p", "head_offset", "first"), CASES)
def test_the_kernel_computes_the_written_out_attention_forward_and_backward(dtype, shape, p, head_offset, first):
    """Random inputs, the output and the gradients of q, k and v: in float32 the written-out path's to float32
    rounding; in 16 bits within the written-out 16-bit path's own distance from float32, or 1%."""
    torch.manual_seed(0)
    b, h, h_kv, t, d = shape
    q, k, v = _inputs(b, h, h_kv, t, d, dtype)
    grad = torch.randn(b, h, t, d, device="cuda", dtype=dtype)
    dropouts.set_step(5, 11)
    salt = torch.tensor(dropouts.site_salt(3), dtype=torch.int64, device="cuda")
    with dropouts.rows(first):
        got = attention_kernel.attention(q, k, v, p, salt, head_offset)
        upcast = [x.detach().float().requires_grad_() for x in (q, k, v)]
        ref = _written_out(*upcast, p, 3, head_offset)
        same = _written_out(q, k, v, p, 3, head_offset)
    assert got.shape == (b, h, t, d) and got.dtype == dtype
    # backward after the rows are back at 0 and at another step: drawn from the forward's key and rows
    dropouts.set_step(5, 12)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, upcast, grad.float())
    same_grads = torch.autograd.grad(same, (q, k, v), grad)
    names = ("out", "dq", "dk", "dv")
    for name, a, r, s in zip(names, (got, *got_grads), (ref, *ref_grads), (same, *same_grads), strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a, r, rtol=1e-4, atol=2e-5, msg=name)
        else:
            assert _rel(a, r) <= max(2 * _rel(s, r), 1e-2), (name, _rel(a, r), _rel(s, r))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "head_offset", "first"), [((2, 4, 2, 300, 128), 4, 3), ((1, 3, 1, 129, 64), 5, 0)])
def test_the_kernels_mask_is_the_dropout_modules_bit_for_bit(shape, head_offset, first, dtype):
    """With q = 0 every probability of row i is 1 / (i + 1), and with v[j] = 2**(j // D) e_(j mod D) each output
    O[i, c] is (1 - p)^-1 / (i + 1) times the sum over kept keys j = c (mod D) of 2**(j // D): the kept bits of
    the row, read back. Likewise dV from dO[i] = (i + 1) 2**(i // D) e_(i mod D) reads back backward's bits."""
    b, h, h_kv, t, d = shape
    p = 0.3
    idx = torch.arange(t, device="cuda")
    q = torch.zeros(b, h, t, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, h_kv, t, d, device="cuda", dtype=dtype)
    v = torch.zeros(b, h_kv, t, d, device="cuda", dtype=dtype)
    v[:, :, idx, idx % d] = 2.0 ** (idx // d).to(dtype)
    v.requires_grad_()
    dropouts.set_step(1, 2)
    salt = torch.tensor(dropouts.site_salt(2), dtype=torch.int64, device="cuda")
    with dropouts.rows(first):
        out = attention_kernel.attention(q, k, v, p, salt, head_offset)
        keep = dropouts.keep_mask((b, h, t, t), p, 2, "cuda", offsets=(0, head_offset))
    keep &= torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
    weight = 2 ** (idx // d)
    if dtype == torch.float32:
        read = torch.round(out.float() * (idx + 1)[:, None] * (1 - p)).long()  # (B, H, T, D)
        want = torch.zeros(b, h, t, d, dtype=torch.long, device="cuda")
        for c in range(d):
            chosen = idx % d == c
            want[..., c] = (keep[..., chosen].long() * weight[chosen]).sum(-1)
        assert torch.equal(read, want)
    grad = torch.zeros(b, h, t, d, device="cuda", dtype=dtype)
    grad[:, :, idx, idx % d] = ((idx + 1) * weight).to(dtype)
    (dv,) = torch.autograd.grad(out, v, grad)
    # dV[kv head, j, c] = (1 - p)^-1 sum over its query heads and kept rows i = c (mod D) of 2**(i // D)
    grouped = keep.view(b, h_kv, h // h_kv, t, t).long()
    read = torch.round(dv.float() * (1 - p)).long()
    want = torch.zeros(b, h_kv, t, d, dtype=torch.long, device="cuda")
    for c in range(d):
        chosen = idx % d == c
        want[..., c] = (grouped[..., chosen, :] * weight[chosen][:, None]).sum((-3, -2))
    if dtype == torch.float32:
        assert torch.equal(read, want)
    else:  # 16-bit outputs: the read-back sums agree to their rounding
        assert ((read - want).abs() <= want.abs() / 64 + 1).all()


@needs_gpu
def test_uniform_probabilities_show_any_wrong_bit_in_every_gradient():
    """q = 0 makes every causal probability at least 1 / T, so one wrongly kept or dropped value would move the
    output and each gradient far beyond float32 rounding; dQ's kernel draws the mask on its own."""
    torch.manual_seed(1)
    q, k, v = _inputs(2, 6, 3, 190, 64, torch.float32, q_zero=True)
    grad = torch.randn(2, 6, 190, 64, device="cuda")
    dropouts.set_step(8, 0)
    salt = torch.tensor(dropouts.site_salt(1), dtype=torch.int64, device="cuda")
    with dropouts.rows(11):
        got = attention_kernel.attention(q, k, v, 0.5, salt, 3)
        want = _written_out(q, k, v, 0.5, 1, 3)
    got_all = (got, *torch.autograd.grad(got, (q, k, v), grad))
    for a, r in zip(got_all, (want, *torch.autograd.grad(want, (q, k, v), grad)), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


@needs_gpu
def test_the_operators_registration_passes_torchs_checks():
    torch.manual_seed(0)
    q, k, v = _inputs(1, 4, 2, 70, 64, torch.float32)
    dropouts.set_step(0, 0)
    seen = dropouts.state(q.device).clone()
    salt = torch.tensor(dropouts.site_salt(1), dtype=torch.int64, device="cuda")
    op = torch.ops.dtrain.hash_dropout_flash_attention.default
    torch.library.opcheck(op, (q, k, v, seen, salt, dropouts.threshold(0.1), 1 / 0.9, 2))


def _set_flash(model: torch.nn.Module, on: bool) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, Attention):
            module.flash_dropout = on
    return model


@needs_gpu
@pytest.mark.parametrize("config", [_gpt2(), _llama(heads=4, kv_heads=2, head_dim=64)], ids=["gpt2", "llama-gqa"])
def test_a_model_on_the_kernel_trains_like_written_out_and_in_pieces_and_recomputed(config):
    """A model with attention dropout 0.1 on the GPU: the kernel's logits and gradients are the written-out
    attention's; the batch in four pieces, each under its rows, gives the whole batch's logits and, with full and
    selective recomputation (the kernel's output kept or recomputed) too, its gradients."""
    torch.manual_seed(0)
    model = build(config, device=torch.device("cuda"))
    x = torch.randint(0, 97, (8, 200), device="cuda")
    dropouts.set_step(4, 2)
    written = _set_flash(copy.deepcopy(model), False)
    want = written(x)
    want.float().pow(2).mean().backward()
    whole = model(x)
    whole.float().pow(2).mean().backward()
    torch.testing.assert_close(whole, want, rtol=1e-4, atol=1e-4)
    for (name, a), b in zip(model.named_parameters(), written.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5, msg=name)
    grads = [p.grad.clone() for p in model.parameters()]
    for mode, keep in (("none", None), ("full", None), ("selective", ["attention"]), ("selective", ["matmul"])):
        net = copy.deepcopy(model)
        net.zero_grad()
        net = checkpoint_activations(net, mode, **({"ops": keep} if keep else {}))
        outs = []
        for i, piece in enumerate(x.chunk(4)):
            with dropouts.rows(2 * i):
                outs.append(net(piece))
        for out in reversed(outs):
            (out.float().pow(2).mean() / 4).backward()
        torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-5, msg=f"{mode} {keep}")
        for got, ref in zip((p.grad for p in net.parameters()), grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6, msg=f"{mode} {keep}")


@needs_gpu
def test_compiled_and_recorded_the_kernel_reads_each_steps_key():
    """A block compiled (aot_eager: the operator's fake and autograd registrations) gives the eager block's
    output and gradients, compiling once for every step; a recorded CUDA graph replays each step's mask."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = build(dataclasses.replace(_gpt2(), n_layer=1), device=torch.device("cuda"))
    block = model[1]
    compiled = copy.deepcopy(block)
    compiled.compile(backend="aot_eager")
    x = torch.randn(4, 100, 64, device="cuda", requires_grad=True)
    for step in range(3):
        dropouts.set_step(2, step)
        with dropouts.rows(4):
            got, want = compiled(x), block(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        (g,) = torch.autograd.grad(got.sum(), x)
        (w,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    attn = block.attn
    with torch.no_grad():
        dropouts.set_step(2, 0)
        attn(x)  # compiled and warmed before the recording
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn(x)
        for step in (5, 6):
            dropouts.set_step(2, step)
            graph.replay()
            assert torch.equal(out, attn(x))
