"""Jobs for tests/train/test_train_tp.py: a GPT block and a whole GPT against their tensor-parallel twins.

Every rank builds the single-device module from a seed, converts a copy with
:func:`~dtrain.train.tensor_parallel_gpt.tensor_parallel_gpt`, runs both forward and backward on the same input and
lists every mismatch; sharded gradients are compared with this rank's slice of the reference's.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.parallel.tensor_parallel import vocab_parallel_cross_entropy
from dtrain.testing.pool import group_of
from dtrain.train.models import build_model
from dtrain.train.tensor_parallel_gpt import TensorParallelBlock, padded_vocab_size, tensor_parallel_gpt

RTOL, ATOL = 1e-5, 1e-6
VOCAB, BLOCK, HEADS, WIDTH = 40, 16, 4, 32


def _compare(problems: list[str], name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        problems.append(f"{name}: max abs error {(got - want).abs().max().item():.3g}")


def _gpt(vocab: int = VOCAB) -> nn.Sequential:
    torch.manual_seed(0)
    return build_model("gpt", vocab_size=vocab, block_size=BLOCK, n_layer=2, n_head=HEADS, n_embd=WIDTH)


def _block_shards(block: nn.Module, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The gradients of a single-device block as TensorParallelBlock rank ``rank`` holds them, by parameter name."""
    qkv, proj, fc_in, fc_out = block.attn.qkv, block.attn.proj, block.mlp[0], block.mlp[2]
    return {
        "ln_1.weight": block.ln_1.weight.grad,
        "ln_1.bias": block.ln_1.bias.grad,
        # the heads of rank r: rows r of each of q, k and v, in that order
        "attn.qkv.weight": qkv.weight.grad.view(3, tp, -1, WIDTH)[:, rank].reshape(-1, WIDTH),
        "attn.qkv.bias": qkv.bias.grad.view(3, tp, -1)[:, rank].reshape(-1),
        "attn.proj.weight": proj.weight.grad.chunk(tp, 1)[rank],
        "attn.proj.bias": proj.bias.grad,
        "ln_2.weight": block.ln_2.weight.grad,
        "ln_2.bias": block.ln_2.bias.grad,
        "mlp.fc_in.weight": fc_in.weight.grad.chunk(tp, 0)[rank],
        "mlp.fc_in.bias": fc_in.bias.grad.chunk(tp, 0)[rank],
        "mlp.fc_out.weight": fc_out.weight.grad.chunk(tp, 1)[rank],
        "mlp.fc_out.bias": fc_out.bias.grad,
    }


def block_equivalence(tp: int) -> list[str]:
    """A GPT block and its TensorParallelBlock over the first ``tp`` ranks: output, input gradient, parameter
    gradients."""
    group = group_of(tp)
    block = _gpt()[1]
    parallel = TensorParallelBlock(copy.deepcopy(block), group)
    torch.manual_seed(1)
    x = torch.randn(3, BLOCK, WIDTH)  # (B, T, C), the same on every rank
    upstream = torch.randn(3, BLOCK, WIDTH)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_tp = block(x_ref), parallel(x_tp)
    (y_ref * upstream).sum().backward()
    (y_tp * upstream).sum().backward()
    problems: list[str] = []
    _compare(problems, "output", y_tp, y_ref)
    _compare(problems, "input grad", x_tp.grad, x_ref.grad)
    want = _block_shards(block, tp, dist.get_rank(group))
    got = dict(parallel.named_parameters())
    if sorted(got) != sorted(want):
        problems.append(f"parameters {sorted(got)}, expected {sorted(want)}")
    for name in sorted(set(got) & set(want)):
        _compare(problems, f"{name} grad", got[name].grad, want[name])
    return problems


def gpt_equivalence(tp: int, vocab: int = VOCAB, gather_logits: bool = True) -> list[str]:
    """A whole GPT of ``vocab`` tokens and its tensor-parallel twin: logits, loss (``F.cross_entropy`` on gathered
    logits, or :func:`vocab_parallel_cross_entropy` on the slices), and the gradients of the embedding and head:
    the vocabulary-split tables against this rank's rows of the reference's, the rest whole."""
    group = group_of(tp)
    rank = dist.get_rank(group)
    model = _gpt(vocab)
    parallel = tensor_parallel_gpt(copy.deepcopy(model), group, gather_logits=gather_logits)
    torch.manual_seed(1)
    idx = torch.randint(0, vocab, (2, BLOCK))  # (B, T)
    targets = torch.randint(0, vocab, (2, BLOCK))
    logits = model(idx)  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    tp_logits = parallel(idx)  # (B, T, V) or (B, T, V_padded / tp)
    if gather_logits:
        tp_loss = F.cross_entropy(tp_logits.reshape(-1, vocab), targets.reshape(-1))
    else:
        tp_loss = vocab_parallel_cross_entropy(tp_logits, targets, group)
    tp_loss.backward()
    problems: list[str] = []
    rows = padded_vocab_size(vocab, tp) // tp
    mine = slice(rank * rows, min((rank + 1) * rows, vocab))
    if gather_logits:
        _compare(problems, "logits", tp_logits, logits)
    else:
        real = mine.stop - mine.start
        _compare(problems, "logits slice", tp_logits[..., :real], logits[..., mine])
        if not torch.isneginf(tp_logits[..., real:]).all():
            problems.append("padding logits are not -inf")
    _compare(problems, "loss", tp_loss, loss)
    embedding, head = parallel[0], parallel[-1]
    for name, got, full in (
        ("token embedding grad", embedding.token.weight.grad, model[0].token.weight.grad),
        ("lm_head grad", head.lm_head.weight.grad, model[-1].lm_head.weight.grad),
    ):
        _compare(problems, name, got[: mine.stop - mine.start], full[mine])
        if got[mine.stop - mine.start :].count_nonzero():
            problems.append(f"{name}: padding rows got a gradient")
    _compare(problems, "position embedding grad", embedding.position.weight.grad, model[0].position.weight.grad)
    for name in ("weight", "bias"):
        _compare(problems, f"ln_f.{name} grad", getattr(head.ln_f, name).grad, getattr(model[-1].ln_f, name).grad)
    if len(parallel) != len(model):
        problems.append(f"{len(parallel)} layers, expected {len(model)}")
    return problems
