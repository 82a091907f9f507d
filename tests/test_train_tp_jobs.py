"""Jobs for tests/test_train_tp.py: a GPT block and a whole GPT against their tensor-parallel twins.

Every rank builds the single-device module from a seed, converts a copy with
:func:`~dtrain.train.tensor_parallel_gpt.tensor_parallel_gpt`, runs both forward and backward on the same input and
lists every mismatch; sharded gradients are compared with this rank's slice of the reference's.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from dtrain.testing.pool import group_of
from dtrain.train.models import build_model
from dtrain.train.tensor_parallel_gpt import TensorParallelBlock, tensor_parallel_gpt

RTOL, ATOL = 1e-5, 1e-6
VOCAB, BLOCK, HEADS, WIDTH = 40, 16, 4, 32


def _compare(problems: list[str], name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        problems.append(f"{name}: max abs error {(got - want).abs().max().item():.3g}")


def _gpt() -> nn.Sequential:
    torch.manual_seed(0)
    return build_model("gpt", vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=HEADS, n_embd=WIDTH)


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


def gpt_equivalence(tp: int) -> list[str]:
    """A whole GPT and its tensor-parallel twin: the logits, the loss and the replicated embedding's and head's
    gradients (whole on every rank)."""
    group = group_of(tp)
    model = _gpt()
    parallel = tensor_parallel_gpt(copy.deepcopy(model), group)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, BLOCK))  # (B, T)
    targets = torch.randint(0, VOCAB, (2, BLOCK))
    problems: list[str] = []
    losses = []
    for m in (model, parallel):
        logits = m(idx)  # (B, T, V)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        losses.append((logits, loss))
    _compare(problems, "logits", losses[1][0], losses[0][0])
    _compare(problems, "loss", losses[1][1], losses[0][1])
    for index in (0, -1):
        replicated = dict(parallel[index].named_parameters())
        for name, p in model[index].named_parameters():
            _compare(problems, f"layer {index} {name} grad", replicated[name].grad, p.grad)
    if len(parallel) != len(model):
        problems.append(f"{len(parallel)} layers, expected {len(model)}")
    return problems
