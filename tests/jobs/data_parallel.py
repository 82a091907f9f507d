"""Jobs for tests/parallel/test_data_parallel.py: train a small MLP data parallel and, on the same rank, without.

Every rank trains the reference itself: one process, one model from seed 0, the whole global batch of each
step, the same optimizer. The distributed run starts each rank from a *different* seed (the wrapper must
broadcast rank 0's weights, and rank 0 uses seed 0) and feeds each rank its shard of the same global batch.
Jobs return tensors; the tests compare them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain import comm
from dtrain.parallel.data_parallel import (
    DataParallel,
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    split_batch,
)
from dtrain.parallel.zero import ZeroOptimizer
from dtrain.testing.pool import group_of

GLOBAL_BATCH = 16
BUCKET_BYTES = 256  # the MLP's 484 float32 parameters (1936 bytes) fall into 3 buckets
FIRST_BUCKET_BYTES = 16  # in the rebuild job: the first bucket takes the head's bias (16 bytes) alone
STEPS = 12
LEARNING_RATES = {"sgd": 0.1, "adam": 0.01, "adamw": 0.01}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)  # (B, 8)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)  # (B, 4)
    return x, y


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATES["sgd"], momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATES["adamw"], weight_decay=0.1)
    return torch.optim.Adam(params, lr=LEARNING_RATES["adam"])


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _reference(optimizer: str, steps: int) -> tuple[list[float], torch.Tensor]:
    model = _model(0)
    opt = _optimizer(optimizer, model.parameters())
    losses = []
    for step in range(steps):
        x, y = _global_batch(step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, _flat(model)


def _train(step_fn: Callable[[], None], forward, group, steps: int, micro_batches: int, no_sync=None):
    """Shard each global batch, run ``micro_batches`` backward passes per step (the first ones in no_sync)."""
    losses = []
    for step in range(steps):
        x, y = split_batch(_global_batch(step), group)
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
            quiet = no_sync is not None and i < micro_batches - 1
            ctx = no_sync() if quiet else contextlib.nullcontext()
            with ctx:
                loss = F.mse_loss(forward(xm), ym) / micro_batches
                loss.backward()
            total += loss.detach()
        step_fn()
        comm.all_reduce(total, op="avg", group=group, algorithm="native")
        losses.append(total.item())
    return losses


def _result(losses, model, optimizer: str, steps: int, **extra) -> dict:
    ref_losses, ref_params = _reference(optimizer, steps)
    return {"losses": losses, "params": _flat(model), "ref_losses": ref_losses, "ref_params": ref_params, **extra}


def data_parallel(
    world: int,
    optimizer: str,
    algorithm: str,
    micro_batches: int = 1,
    steps: int = STEPS,
    overlap: bool = False,
    exchange: str = "collective",
) -> dict:
    """DataParallel + a plain optimizer (with ``overlap``, stepped inside backward); also records bucket launches
    seen while backward is still running."""
    group = group_of(world)
    model = _model(dist.get_rank(group) * 7 + 3 if dist.get_rank(group) else 0)
    before = _flat(model)
    dp = DataParallel(model, group, bucket_bytes=BUCKET_BYTES, algorithm=algorithm, exchange=exchange)
    after = _flat(model)
    seen_mid_backward = []

    in_flight_mid_backward = []

    def spy(module, inputs, output):  # runs before the first layer's weight gradients exist
        if output.requires_grad and not seen_mid_backward:
            output.register_hook(lambda grad: seen_mid_backward.append(dp.reducer.launches))
            output.register_hook(lambda grad: in_flight_mid_backward.append(len(dp.reducer._in_flight)))

    handle = model[0].register_forward_hook(spy)
    opt = _optimizer(optimizer, model.parameters())
    if overlap:
        dp.overlap_optimizer(opt)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    losses = _train(step, dp, group, steps, micro_batches, no_sync=dp.no_sync)
    refused = ""
    if overlap:  # a second step with no backward in between has nothing to step with
        try:
            opt.step()
        except RuntimeError as e:
            refused = str(e)
    handle.remove()
    return _result(
        losses,
        model,
        optimizer,
        steps,
        before=before,
        after=after,
        bucket_count=dp.bucket_count,
        launches=dp.reducer.launches,
        launched_mid_backward=seen_mid_backward[0],
        in_flight_mid_backward=in_flight_mid_backward[0],
        refused=refused,
        copy_engine=dp.reducer._bucket_reduce is not None,
    )


def data_parallel_recorded(world: int, optimizer: str, exchange: str, steps: int = STEPS) -> dict:
    """DataParallel with the optimizer stepped inside backward (``overlap_optimizer``), the whole step (forward,
    loss, backward and so the optimizer) recorded by :class:`~dtrain.parallel.step_graph.GraphedStep` with the
    stand-in graph of :mod:`tests.jobs.graphs`, as on a GPU where the replay runs no Python: the loop calls no
    ``optimizer.step()``."""
    from dtrain.parallel import step_graph
    from tests.jobs import graphs

    group = group_of(world)
    model = _model(dist.get_rank(group) * 7 + 3 if dist.get_rank(group) else 0)
    dp = DataParallel(model, group, bucket_bytes=BUCKET_BYTES, algorithm="ring", exchange=exchange)
    opt = _optimizer(optimizer, model.parameters())
    dp.overlap_optimizer(opt)
    params = list(dp.parameters())

    def forward_backward(x, y, *, recording: bool) -> torch.Tensor:
        loss = F.mse_loss(dp(x), y)
        loss.backward()
        return loss.detach()

    def undo():  # the parameters and the optimizer's state as they were before the recording
        weights = [p.detach().clone() for p in params]
        state = copy.deepcopy(opt.state_dict())

        def put_back() -> None:
            with torch.no_grad():
                for p, w in zip(params, weights, strict=True):
                    p.copy_(w)
            opt.load_state_dict(state)

        return put_back

    losses = []
    owner: list[step_graph.GraphedStep] = []
    with graphs.stand_in(lambda: owner[0].recorded, undo) as seen:
        owner.append(step_graph.GraphedStep(forward_backward, params, torch.device("cpu")))
        for step in range(steps):
            x, y = split_batch(_global_batch(step), group)
            opt.zero_grad(set_to_none=True)
            total = owner[0](x, y).clone()
            comm.all_reduce(total, op="avg", group=group, algorithm="native")
            losses.append(total.item())
    return _result(
        losses,
        model,
        optimizer,
        steps,
        records=seen.records,
        replays=seen.replays,
        copy_engine=dp.reducer._bucket_reduce is not None,
    )


def distributed_optimizer(world: int, optimizer: str, algorithm: str, passes: int = 1, steps: int = STEPS) -> dict:
    """Horovod style: broadcast_parameters, then DistributedOptimizer around a plain optimizer."""
    group = group_of(world)
    model = _model(dist.get_rank(group) * 7 + 3 if dist.get_rank(group) else 0)
    broadcast_parameters(model.state_dict(), 0, group, algorithm=algorithm)
    after = _flat(model)
    opt = DistributedOptimizer(
        _optimizer(optimizer, model.parameters()),
        model.named_parameters(),
        group,
        algorithm=algorithm,
        backward_passes_per_step=passes,
        bucket_bytes=BUCKET_BYTES,
    )

    def step() -> None:
        opt.step()
        opt.zero_grad()

    losses = _train(step, model, group, steps, passes)
    return _result(losses, model, optimizer, steps, after=after, launches=opt.reducer.launches)


def zero(world: int, stage: int, optimizer: str, algorithm: str, steps: int = STEPS) -> dict:
    """ZeroOptimizer around the same optimizer class and settings as the reference."""
    group = group_of(world)
    model = _model(dist.get_rank(group) * 7 + 3 if dist.get_rank(group) else 0)
    if optimizer == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": LEARNING_RATES["sgd"], "momentum": 0.9}
    else:
        cls, kwargs = torch.optim.Adam, {"lr": LEARNING_RATES["adam"]}
    opt = ZeroOptimizer(model.parameters(), cls, group, stage=stage, algorithm=algorithm, **kwargs)
    after = _flat(model)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    losses = _train(step, model, group, steps, 1)
    return _result(losses, model, optimizer, steps, after=after, memory=opt.memory_report())


def optimizer_state_broadcast(world: int) -> dict:
    """Each rank takes one Adam step on its own gradient and its own lr; rank 0's state is then broadcast."""
    group = group_of(world)
    rank = dist.get_rank(group)
    param = nn.Parameter(torch.zeros(5))
    opt = torch.optim.Adam([param], lr=0.1 * (rank + 1))
    param.grad = torch.arange(5.0) + rank
    opt.step()
    broadcast_optimizer_state(opt, 0, group)
    state = opt.state[param]
    return {"lr": opt.param_groups[0]["lr"], "exp_avg": state["exp_avg"].clone(), "step": float(state["step"])}


def optimizer_state_mismatch(world: int) -> str:
    """Only rank 0 has stepped: the state differs, and every rank must say so."""
    group = group_of(world)
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([param])
    if dist.get_rank(group) == 0:
        param.grad = torch.ones(3)
        opt.step()
    try:
        broadcast_optimizer_state(opt, 0, group)
    except ValueError as e:
        return str(e)
    return "no error"


def uneven_split(world: int) -> str:
    try:
        split_batch(torch.zeros(world + 1, 2), group_of(world))
    except ValueError as e:
        return str(e)
    return "no error"


class _OutOfOrder(nn.Module):
    """Registered head first and stem last, so reverse registration order is the opposite of backward's.

    ``swap`` changes which branch forward builds last, hence whose gradients become ready first; the sum is
    the same either way (addition of two floats commutes exactly).
    """

    def __init__(self, seed: int, swap: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.head, self.left, self.right, self.stem = (
            nn.Linear(16, 4),
            nn.Linear(16, 16),
            nn.Linear(16, 16),
            nn.Linear(8, 16),
        )
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))  # (B, 16)
        first, second = (self.right, self.left) if self.swap else (self.left, self.right)
        return self.head(torch.tanh(first(h) + second(h)))  # (B, 4)


def rebuild(world: int, set_to_none: bool, steps: int = 4) -> dict:
    """DataParallel on :class:`_OutOfOrder` (rank 0 unswapped, the others swapped) against one process."""
    group = group_of(world)
    rank = dist.get_rank(group)
    model = _OutOfOrder(rank * 7 + 3 if rank else 0, swap=rank != 0)
    twin = _OutOfOrder(0, swap=rank != 0)  # DDP's copy, from rank 0's weights
    ddp = DistributedDataParallel(twin, process_group=group, bucket_cap_mb=BUCKET_BYTES / 2**20)
    ddp_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    dp = DataParallel(
        model, group, bucket_bytes=BUCKET_BYTES, first_bucket_bytes=FIRST_BUCKET_BYTES, algorithm="native"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    layer_of = {id(p): name.split(".")[0] for name, p in model.named_parameters()}
    launched_mid_backward, bucket_layers, launches_before = [], [], [0]

    def spy(grad: torch.Tensor) -> None:  # the stem's output gradient: every later layer's is done
        launched_mid_backward.append(dp.reducer.launches - launches_before[0])

    def watch(module, inputs, output) -> None:
        output.register_hook(spy)

    model.stem.register_forward_hook(watch)
    losses = []
    for step in range(steps):
        x, y = split_batch(_global_batch(step), group)
        bucket_layers.append([[layer_of[id(p)] for p in b.params] for b in dp.reducer.buckets])
        launches_before[0] = dp.reducer.launches
        loss = F.mse_loss(dp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        total = loss.detach().clone()
        comm.all_reduce(total, op="avg", group=group, algorithm="native")
        losses.append(total.item())
        F.mse_loss(ddp(x), y).backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=set_to_none)
    views = all(
        p.grad is not None and p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
        for b in dp.reducer.buckets
        for p in b.params
    )
    ref = _OutOfOrder(0, swap=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(steps):
        x, y = _global_batch(step)
        loss = F.mse_loss(ref(x), y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    return {
        "losses": losses,
        "params": _flat(model),
        "ref_losses": ref_losses,
        "ref_params": _flat(ref),
        "bucket_layers": bucket_layers,
        "launched_mid_backward": launched_mid_backward,
        "grads_are_bucket_views": views and not set_to_none,
        "ddp_params": _flat(twin),
        "bucket_bytes": [[b.nbytes for b in dp.reducer.buckets]],
    }
