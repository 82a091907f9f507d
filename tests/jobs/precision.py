"""Jobs for tests/parallel/test_reduce_precision.py: ZeRO with param groups, its gradient norm and scaling, and
gradients averaged in bf16, each against one process on the whole batch.

The model and batches are tests/jobs/data_parallel.py's (an MLP of 484 float32 parameters in 4 buckets of 512
bytes, so parameters straddle the ranks' chunks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtrain import comm
from dtrain.parallel.data_parallel import DataParallel, split_batch
from dtrain.parallel.zero import ZeroOptimizer
from dtrain.testing.pool import group_of
from tests.jobs.data_parallel import BUCKET_BYTES, _flat, _global_batch, _model

STEPS = 4
LR, DECAY = 0.01, 0.1


def _groups(model: torch.nn.Module) -> list[dict]:
    """AdamW groups: weight decay on the matrices, none on the biases."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def zero_groups_norm_and_scaling(world: int, stage: int) -> dict:
    """ZeRO-``stage`` with two AdamW groups; every step the gradient's squared norm is summed over the ranks and
    the gradients halved before the step. The same on one process with torch's AdamW: largest differences."""
    group = group_of(world)
    model = _model(0)
    opt = ZeroOptimizer(_groups(model), torch.optim.AdamW, group, stage=stage, bucket_bytes=BUCKET_BYTES, lr=LR)
    reference = _model(0)
    ref_opt = torch.optim.AdamW(_groups(reference), lr=LR)
    norm_error, weights = 0.0, []
    for step in range(STEPS):
        x, y = _global_batch(step)
        mine_x, mine_y = split_batch((x, y), group)
        F.mse_loss(model(mine_x), mine_y).backward()
        squared = opt.grad_square_sum(lambda p: 1.0)
        comm.all_reduce(squared, group=group)
        opt.scale_grads(0.5)
        opt.step()
        opt.zero_grad()

        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_squared = sum(p.grad.square().sum() for p in reference.parameters())
        for p in reference.parameters():
            p.grad.mul_(0.5)
        ref_opt.step()
        norm_error = max(norm_error, abs(squared.item() - ref_squared.item()) / ref_squared.item())
        weights.append(opt.param_groups[0]["weight_decay"])
    return {
        "norm_error": norm_error,
        "param_error": (_flat(model) - _flat(reference)).abs().max().item(),
        "moved": (_flat(model) - _flat(_model(0))).abs().max().item(),
        "groups": len(opt.param_groups),
        "decays": sorted(g["weight_decay"] for g in opt.param_groups),
        "state": len(opt.state_dict()["state"]),
    }


def weighted_square_sum(world: int) -> dict:
    """grad_square_sum with weight 0 on the biases equals the matrices' squared gradient norm."""
    group = group_of(world)
    model = _model(0)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, group, stage=2, bucket_bytes=BUCKET_BYTES, lr=LR)
    x, y = _global_batch(0)
    mine_x, mine_y = split_batch((x, y), group)
    F.mse_loss(model(mine_x), mine_y).backward()
    squared = opt.grad_square_sum(lambda p: float(p.dim() >= 2))
    comm.all_reduce(squared, group=group)
    reference = _model(0)
    F.mse_loss(reference(x), y).backward()
    expected = sum(p.grad.square().sum() for p in reference.parameters() if p.dim() >= 2)
    return {"got": squared.item(), "expected": expected.item()}


def bf16_reduction(world: int, reduce_dtype: str) -> dict:
    """One backward under DataParallel averaging in ``reduce_dtype``: the largest difference of the gradients
    from one process's full-batch gradients, and whether every rank holds the same gradients."""
    group = group_of(world)
    model = _model(0)
    dtype = {"bf16": torch.bfloat16, "float32": None}[reduce_dtype]
    wrapped = DataParallel(model, group, bucket_bytes=BUCKET_BYTES, reduce_dtype=dtype)
    x, y = _global_batch(0)
    mine_x, mine_y = split_batch((x, y), group)
    F.mse_loss(wrapped(mine_x), mine_y).backward()
    reference = _model(0)
    F.mse_loss(reference(x), y).backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    gathered = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(gathered, got, group=group)
    return {
        "error": (got - want).abs().max().item(),
        "scale": want.abs().max().item(),
        "same_on_every_rank": all(torch.equal(g, gathered[0]) for g in gathered),
        "dtype": str(got.dtype),
    }
