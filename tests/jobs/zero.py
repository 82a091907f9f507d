"""Jobs for tests/parallel/test_zero.py: ZeRO with several buckets against one process, and what it allocates.

The model, batches, reference and training loop are tests/jobs/data_parallel.py's: each rank trains its shard of the
global batch with :class:`ZeroOptimizer` from a rank-dependent seed (rank 0's weights must win) and, on the
same rank, the one-process reference on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtrain.parallel.data_parallel import split_batch
from dtrain.parallel.zero import ZeroOptimizer
from dtrain.testing.pool import group_of
from tests.jobs.data_parallel import LEARNING_RATES, STEPS, _global_batch, _model, _result, _train

BUCKET_BYTES = 256  # the MLP's 484 float32 parameters fall into 3 buckets


def _zero(world: int, stage: int, optimizer: str, algorithm: str) -> tuple[torch.nn.Module, ZeroOptimizer]:
    group = group_of(world)
    model = _model(dist.get_rank(group) * 7 + 3 if dist.get_rank(group) else 0)
    classes = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    extra = {"sgd": {"momentum": 0.9}, "adam": {}, "adamw": {"weight_decay": 0.1}}[optimizer]
    opt = ZeroOptimizer(
        model.parameters(),
        classes[optimizer],
        group,
        stage=stage,
        algorithm=algorithm,
        bucket_bytes=BUCKET_BYTES,
        lr=LEARNING_RATES[optimizer],
        **extra,
    )
    return model, opt


def train(world: int, stage: int, optimizer: str, algorithm: str, micro_batches: int = 1) -> dict:
    """STEPS steps of ``micro_batches`` backward passes each: losses and parameters, with the reference's."""
    model, opt = _zero(world, stage, optimizer, algorithm)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    losses = _train(step, model, group_of(world), STEPS, micro_batches)
    return _result(losses, model, optimizer, STEPS, buckets=len(opt.buckets))


class _NewStorage(TorchDispatchMode):
    """Records the bytes of every tensor storage an op creates (outputs that alias no input)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


def allocations(world: int, stage: int) -> dict:
    """One step: what backward leaves in param.grad, and the largest buffer allocated during step()."""
    model, opt = _zero(world, stage, "adamw", "ring")
    group = group_of(world)
    x, y = split_batch(_global_batch(0), group)
    launches_mid_backward = []

    def watch(module, inputs, output) -> None:  # the first layer's output gradient: later layers' are done
        output.register_hook(lambda grad: launches_mid_backward.append(_launches(opt)))

    model[0].register_forward_hook(watch)
    F.mse_loss(model(x), y).backward()
    full_grads_after_backward = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
    with _NewStorage() as probe:
        opt.step()
    return {
        "flat_nbytes": opt.flat.numel() * opt.flat.element_size(),
        "largest_step_allocation": max(probe.nbytes, default=0),
        "full_grads_after_backward": full_grads_after_backward,
        "launches_mid_backward": launches_mid_backward[0],
        "buckets": len(opt.buckets),
        "memory": opt.memory_report(),
    }


def _launches(opt: ZeroOptimizer) -> int:
    return opt.reducer.launches if opt.stage == 2 else 0


def _skipping_forward(model: torch.nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    """Odd steps skip the middle Linear(16, 16) and its Tanh: their parameters get no gradient."""
    layers = list(model) if step % 2 == 0 else [model[0], model[1], model[4]]
    for layer in layers:
        x = layer(x)
    return x  # (B, 4)


def unused_parameters(world: int, stage: int, steps: int = 6) -> dict:
    """A layer unused in some steps gets no gradient in them, on every rank, and is not stepped (SGD's momentum
    leaves it alone), as on one process."""
    model, opt = _zero(world, stage, "sgd", "auto")
    group = group_of(world)
    losses = []
    for step in range(steps):
        x, y = split_batch(_global_batch(step), group)
        loss = F.mse_loss(_skipping_forward(model, x, step), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / world)
    ref = _model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LEARNING_RATES["sgd"], momentum=0.9)
    ref_losses = []
    for step in range(steps):
        x, y = _global_batch(step)
        loss = F.mse_loss(_skipping_forward(ref, x, step), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "params": flat,
        "ref_params": ref_flat,
        "buckets": len(opt.buckets),
    }


class _Unused(torch.nn.Module):
    """Linear(16, 16) and Tanh, beside a parameter its forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.spare = torch.nn.Parameter(torch.ones(5))  # 5 elements: not a multiple of 2 or 4 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def _unused_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), _Unused(), torch.nn.Linear(16, 4))


def unused_in_hybrid(layouts: dict[str, dict]) -> dict[str, float | None]:
    """Each layout (dp, pp and HybridParallel's keywords) trains 3 steps of a model holding a parameter no
    forward reads, with AdamW (weight decay 0.5) and SGD with momentum: the largest difference of any parameter
    from one process on the global batch, where that parameter gets no gradient and is never stepped (None off
    the grid)."""
    from dtrain.parallel.hybrid import HybridParallel
    from tests.jobs.parallel import _grid

    optimizers = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.5),
        "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1),
    }
    out: dict[str, float | None] = {}
    for name, layout in layouts.items():
        layout = dict(layout)
        dp, pp = layout.pop("dp"), layout.pop("pp", 1)
        grid = _grid(dp, pp, 1)  # every process of the pool: groups are made collectively
        for kind, make in optimizers.items():
            if grid is None:
                out[f"{name} {kind}"] = None
                continue
            factory = lambda named, make=make: make([q for _, q in named])  # noqa: E731
            hybrid = HybridParallel(_unused_model(), grid, factory, **layout)
            ref = _unused_model()
            ref_opt = make(ref.parameters())
            for step in range(3):
                x, y = _global_batch(step)
                hybrid.train_step(x, y, F.mse_loss)
                ref_opt.zero_grad()
                F.mse_loss(ref(x), y).backward()
                ref_opt.step()
            want = dict(ref.named_parameters())
            params = hybrid.optimizer.full_parameters() if layout.get("zero_stage") == 3 else None
            errors = []
            for n, q in hybrid.named_params:
                got = params[n] if params is not None else q.detach()
                errors.append((got - want[n].detach()).abs().max().item())
            out[f"{name} {kind}"] = max(errors)
    return out


class _Scaled(torch.nn.Module):
    """Linear(16, 4) whose output is multiplied by a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)
        self.register_buffer("scale", torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _frozen_model(seed: int) -> torch.nn.Sequential:
    """A frozen Linear(8, 16), Tanh, then :class:`_Scaled`: weights and buffer drawn from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), _Scaled())
    model[0].requires_grad_(False)
    return model


def frozen_and_buffers_from_rank_0(stages: list[int]) -> dict[int, float] | None:
    """dp 2 under each ZeRO stage, the replicas built from different seeds: after 2 steps, the largest difference
    of any parameter or buffer from one process training dp rank 0's model (None off the grid)."""
    from dtrain.parallel.hybrid import HybridParallel
    from tests.jobs.parallel import _grid

    grid = _grid(2, 1, 1)  # every process of the pool: groups are made collectively
    if grid is None:
        return None
    make = lambda named: torch.optim.SGD([q for _, q in named], lr=0.1)  # noqa: E731
    out = {}
    for stage in stages:
        hybrid = HybridParallel(_frozen_model(grid.dp_rank), grid, make, zero_stage=stage)
        ref = _frozen_model(0)
        ref_opt = make(ref.named_parameters())
        for step in range(2):
            x, y = _global_batch(step)
            hybrid.train_step(x, y, F.mse_loss)
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
        got = hybrid.full_state_dict() if stage == 3 else hybrid.module.state_dict()
        got = got if got is not None else {}
        out[stage] = max(
            ((got[n] - t).abs().max().item() for n, t in ref.state_dict().items() if n in got), default=0.0
        )
    return out
