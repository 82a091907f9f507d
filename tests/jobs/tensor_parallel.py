"""Jobs the process pool runs for the tensor-parallel tests: each rank builds a single-device reference from a
seed, builds the tensor-parallel module from it (``init_from=``), runs both and lists every mismatch.

Every rank holds the whole reference, so sharded results (outputs, gradients) are compared against this
rank's slice of the reference's; an empty list means the rank agrees everywhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.parallel import tensor_parallel_communications as tpc
from dtrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from dtrain.testing.pool import group_of

RTOL, ATOL = 1e-5, 1e-6


def _compare(problems: list[str], name: str, got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    if got.shape != want.shape:
        problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    elif not torch.allclose(got, want, rtol=RTOL, atol=atol):
        problems.append(f"{name}: max abs error {(got - want).abs().max().item():.3g}")


def _shard(t: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim)[torch.distributed.get_rank(group_of(tp))]


def all_gather_last_dim(tp: int, algorithm: str) -> list[str]:
    """Each rank's (2, 3, k) block lands at its place along the last dim of the gathered tensor."""
    blocks = [torch.arange(24.0).view(2, 3, 4) + 100 * r for r in range(tp)]
    rank = torch.distributed.get_rank(group_of(tp))
    problems: list[str] = []
    _compare(
        problems, "gathered", tpc.all_gather_last_dim(blocks[rank], group_of(tp), algorithm), torch.cat(blocks, -1)
    )
    return problems


def column_linear(tp: int, gather_output: bool, algorithm: str) -> list[str]:
    torch.manual_seed(0)
    ref = nn.Linear(8, 12)
    x, grad_y = torch.randn(3, 5, 8), torch.randn(3, 5, 12)
    layer = ColumnParallelLinear(8, 12, group_of(tp), gather_output=gather_output, algorithm=algorithm, init_from=ref)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_tp = ref(x_ref), layer(x_tp)
    (y_ref * grad_y).sum().backward()
    (y_tp * (grad_y if gather_output else _shard(grad_y, -1, tp))).sum().backward()
    problems: list[str] = []
    _compare(problems, "output", y_tp, y_ref if gather_output else _shard(y_ref, -1, tp))
    _compare(problems, "input grad", x_tp.grad, x_ref.grad)
    _compare(problems, "weight grad", layer.weight.grad, _shard(ref.weight.grad, 0, tp))
    _compare(problems, "bias grad", layer.bias.grad, _shard(ref.bias.grad, 0, tp))
    return problems


def row_linear(tp: int, input_is_parallel: bool, algorithm: str) -> list[str]:
    torch.manual_seed(1)
    ref = nn.Linear(12, 8)
    x, grad_y = torch.randn(3, 5, 12), torch.randn(3, 5, 8)
    layer = RowParallelLinear(
        12, 8, group_of(tp), input_is_parallel=input_is_parallel, algorithm=algorithm, init_from=ref
    )
    x_ref = x.clone().requires_grad_()
    x_tp = (_shard(x, -1, tp) if input_is_parallel else x).clone().requires_grad_()
    y_ref, y_tp = ref(x_ref), layer(x_tp)
    (y_ref * grad_y).sum().backward()
    (y_tp * grad_y).sum().backward()
    problems: list[str] = []
    _compare(problems, "output", y_tp, y_ref)
    _compare(problems, "input grad", x_tp.grad, _shard(x_ref.grad, -1, tp) if input_is_parallel else x_ref.grad)
    _compare(problems, "weight grad", layer.weight.grad, _shard(ref.weight.grad, 1, tp))
    _compare(problems, "bias grad", layer.bias.grad, ref.bias.grad)
    return problems


def mlp(tp: int, algorithm: str) -> list[str]:
    torch.manual_seed(2)
    fc_in, fc_out = nn.Linear(8, 16), nn.Linear(16, 8)
    x, grad_y = torch.randn(4, 8), torch.randn(4, 8)
    layer = ParallelMLP(8, 16, group_of(tp), algorithm=algorithm, init_from=(fc_in, fc_out))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_tp = fc_out(F.gelu(fc_in(x_ref))), layer(x_tp)
    (y_ref * grad_y).sum().backward()
    (y_tp * grad_y).sum().backward()
    problems: list[str] = []
    _compare(problems, "output", y_tp, y_ref)
    _compare(problems, "input grad", x_tp.grad, x_ref.grad)
    _compare(problems, "fc_in weight grad", layer.fc_in.weight.grad, _shard(fc_in.weight.grad, 0, tp))
    _compare(problems, "fc_in bias grad", layer.fc_in.bias.grad, _shard(fc_in.bias.grad, 0, tp))
    _compare(problems, "fc_out weight grad", layer.fc_out.weight.grad, _shard(fc_out.weight.grad, 1, tp))
    _compare(problems, "fc_out bias grad", layer.fc_out.bias.grad, fc_out.bias.grad)
    return problems


def _reference_attention(x: torch.Tensor, qkv: nn.Linear, proj: nn.Linear, n_heads: int) -> torch.Tensor:
    """Causal multi-head self-attention written out on one device (softmax(q k^T / sqrt(D) + mask) v)."""
    B, T, C = x.shape
    q, k, v = (t.view(B, T, n_heads, C // n_heads).transpose(1, 2) for t in qkv(x).split(C, -1))  # (B, H, T, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(C // n_heads)  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
    return proj(y)


def attention(tp: int, algorithm: str) -> list[str]:
    torch.manual_seed(3)
    dim, n_heads = 16, 4
    qkv, proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
    x, grad_y = torch.randn(2, 6, dim), torch.randn(2, 6, dim)
    layer = ParallelSelfAttention(dim, n_heads, group_of(tp), algorithm=algorithm, init_from=(qkv, proj))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_tp = _reference_attention(x_ref, qkv, proj, n_heads), layer(x_tp)
    (y_ref * grad_y).sum().backward()
    (y_tp * grad_y).sum().backward()
    # this rank's heads: block r of each of q, k and v, stacked
    qkv_grad = torch.cat([_shard(g, 0, tp) for g in qkv.weight.grad.split(dim, 0)], 0)
    problems: list[str] = []
    _compare(problems, "output", y_tp, y_ref, atol=1e-5)
    _compare(problems, "input grad", x_tp.grad, x_ref.grad, atol=1e-5)
    _compare(problems, "qkv weight grad", layer.qkv.weight.grad, qkv_grad, atol=1e-5)
    _compare(problems, "proj weight grad", layer.proj.weight.grad, _shard(proj.weight.grad, 1, tp), atol=1e-5)
    _compare(problems, "proj bias grad", layer.proj.bias.grad, proj.bias.grad, atol=1e-5)
    return problems


def embedding(tp: int, algorithm: str) -> list[str]:
    torch.manual_seed(4)
    ref = nn.Embedding(12, 6)
    tokens, grad_y = torch.randint(0, 12, (3, 7)), torch.randn(3, 7, 6)
    layer = VocabParallelEmbedding(12, 6, group_of(tp), algorithm=algorithm, init_from=ref)
    y_ref, y_tp = ref(tokens), layer(tokens)
    (y_ref * grad_y).sum().backward()
    (y_tp * grad_y).sum().backward()
    problems: list[str] = []
    _compare(problems, "output", y_tp, y_ref)
    _compare(problems, "weight grad", layer.weight.grad, _shard(ref.weight.grad, 0, tp))
    return problems


def cross_entropy(tp: int, algorithm: str) -> list[str]:
    torch.manual_seed(5)
    logits, target = torch.randn(4, 5, 16) * 10, torch.randint(0, 16, (4, 5))
    full = logits.clone().requires_grad_()
    mine = _shard(logits, -1, tp).clone().requires_grad_()
    loss_ref = F.cross_entropy(full.view(-1, 16), target.view(-1))
    loss_tp = vocab_parallel_cross_entropy(mine, target, group_of(tp), algorithm=algorithm)
    loss_ref.backward()
    loss_tp.backward()
    problems: list[str] = []
    _compare(problems, "loss", loss_tp, loss_ref)
    _compare(problems, "logits grad", mine.grad, _shard(full.grad, -1, tp))
    per_token = vocab_parallel_cross_entropy(mine.detach(), target, group_of(tp), algorithm=algorithm, reduction="none")
    _compare(
        problems, "per-token loss", per_token, F.cross_entropy(full.detach().transpose(1, 2), target, reduction="none")
    )
    return problems


def train_classifier(tp: int, algorithm: str, steps: int) -> list[str]:
    """A few SGD steps of MLP + vocabulary-parallel classifier against the same model on one device."""
    torch.manual_seed(6)
    fc_in, fc_out, head = nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, 16)
    x, y = torch.randn(10, 8), torch.randint(0, 16, (10,))
    group = group_of(tp)
    mlp_tp = ParallelMLP(8, 32, group, algorithm=algorithm, init_from=(fc_in, fc_out))
    head_tp = ColumnParallelLinear(8, 16, group, algorithm=algorithm, init_from=head)
    ref_params = [*fc_in.parameters(), *fc_out.parameters(), *head.parameters()]
    tp_params = [*mlp_tp.parameters(), *head_tp.parameters()]
    opt_ref = torch.optim.SGD(ref_params, lr=0.5)
    opt_tp = torch.optim.SGD(tp_params, lr=0.5)
    problems: list[str] = []
    for step in range(steps):
        loss_ref = F.cross_entropy(head(fc_out(F.gelu(fc_in(x)))), y)
        loss_tp = vocab_parallel_cross_entropy(head_tp(mlp_tp(x)), y, group, algorithm=algorithm)
        _compare(problems, f"loss at step {step}", loss_tp, loss_ref)
        for loss, opt in ((loss_ref, opt_ref), (loss_tp, opt_tp)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    shards = [
        (mlp_tp.fc_in.weight, _shard(fc_in.weight, 0, tp)),
        (mlp_tp.fc_in.bias, _shard(fc_in.bias, 0, tp)),
        (mlp_tp.fc_out.weight, _shard(fc_out.weight, 1, tp)),
        (mlp_tp.fc_out.bias, fc_out.bias),
        (head_tp.weight, _shard(head.weight, 0, tp)),
        (head_tp.bias, _shard(head.bias, 0, tp)),
    ]
    for i, (got, want) in enumerate(shards):
        _compare(problems, f"parameter {i} after {steps} steps", got.detach(), want.detach())
    return problems


def bad_sizes(tp: int) -> list[str]:
    """Sizes that do not divide by the group size: each constructor must raise ValueError naming both."""
    group, odd = group_of(tp), 2 * tp + 1
    cases = {
        "column out_features": lambda: ColumnParallelLinear(8, odd, group),
        "row in_features": lambda: RowParallelLinear(odd, 8, group),
        "embedding num_embeddings": lambda: VocabParallelEmbedding(odd, 4, group),
        "attention n_heads": lambda: ParallelSelfAttention(4 * odd, odd, group),
    }
    problems: list[str] = []
    for name, build in cases.items():
        try:
            build()
        except ValueError as e:
            if f"={odd}" not in str(e) or f"size {tp}" not in str(e):
                problems.append(f"{name}: message does not name {odd} and group size {tp}: {e}")
        else:
            problems.append(f"{name}: no ValueError for size {odd} over {tp} ranks")
    return problems
