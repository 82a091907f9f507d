"""Data parallelism: every rank holds the whole model, trains on its shard of the global batch, averages gradients.

Two front ends over the same bucketed averaging all-reduce (:mod:`dtrain.parallel.data_parallel_communications`):

- :class:`DataParallel`, a module wrapper after PyTorch DDP (Li et al. 2020, "PyTorch Distributed:
  Experiences on Accelerating Data Parallel Training", VLDB): parameters and buffers broadcast from group rank 0
  at construction, gradients averaged bucket by bucket from autograd hooks while backward runs, ``no_sync()``
  for gradient accumulation without communication;
- :class:`DistributedOptimizer`, an optimizer wrapper after Horovod (Sergeev and Del Balso 2018, "Horovod: fast
  and easy distributed deep learning in TensorFlow"): gradients averaged before the wrapped optimizer's step,
  every ``backward_passes_per_step`` backward passes, with :func:`broadcast_parameters` and
  :func:`broadcast_optimizer_state` to start every rank from the same state.

Either is equivalent to one process training on the global batch when each rank feeds an equal shard
(:func:`split_batch`: a global batch of 64 on 2 ranks is 32 rows each) and the loss is a mean over the batch:
the average of equal shards' mean gradients is the global batch's mean gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.parallel.data_parallel_communications import (
    GradientReducer,
    broadcast_algorithm,
    broadcast_optimizer_state,
    broadcast_tensors,
    group_size,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "DataParallel",
    "DistributedOptimizer",
    "broadcast_algorithm",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "split_batch",
]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb=25 (Li et al. 2020, section 5.2)
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket cap (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)

Batch = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]

# torch.optim's optimizers whose step updates each parameter from its own gradient and state alone
_ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
)


class DataParallel(nn.Module):
    """Wrap ``module`` so that backward leaves in ``param.grad`` the gradient averaged over ``group``.

    At construction every parameter and buffer is overwritten with group rank 0's (so ranks start equal);
    nothing is checked against the other ranks beyond that. ``algorithm`` is the gradient all-reduce's
    (``"auto"``, ``"native"``, ``"ring"``, ... see :func:`dtrain.comm.algorithms`); the initial broadcast uses
    the same name where broadcast has it, else ``"auto"`` (:func:`broadcast_algorithm`). Buckets follow the reverse
    registration order in the first synced backward, then are rebuilt in the order gradients became ready on
    group rank 0, as DDP does after its first iteration; a bucket closes once it holds ``bucket_bytes``, the
    first once it holds ``first_bucket_bytes`` (DDP's 1 MiB ``first_bucket_bytes_cap``: the gradients ready first
    go out at once, None: no other cap), DDP's cut exactly. With ``gradient_as_bucket_view`` (the default) each
    ``param.grad`` is a view into its bucket from the bucket's first launch on (see
    :class:`~dtrain.parallel.data_parallel_communications.GradientReducer`). Buckets whose algorithm is (or
    ``auto`` resolves to) ``native`` are all-reduced asynchronously, overlapping the rest of backward, and waited
    for (on GPUs by the compute stream, not the host) when backward ends. ``reduce_dtype`` averages the
    gradients in another dtype (``torch.bfloat16``: half the bytes of float32 on the wire), None in the
    parameters' own. ``exchange="copy-engine"`` (every rank on one host) moves the buckets' bytes by copy engines
    through peer channels from the second pass on, leaving the SMs to backward but for one summing pass a bucket
    (:class:`~dtrain.comm.peer.bucket_reduce.BucketReduce`); ``"collective"`` (the default) uses ``algorithm``.
    """

    def __init__(
        self,
        module: nn.Module,
        group,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        algorithm: str = "auto",
        gradient_as_bucket_view: bool = True,
        reduce_dtype: torch.dtype | None = None,
        first_bucket_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES,
        exchange: str = "collective",
    ) -> None:
        super().__init__()
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(
                f"DataParallel: {type(module).__name__} has no parameter that requires a gradient; "
                "there is nothing to average, run it without the wrapper"
            )
        self.module = module
        self.group = group
        self.algorithm = algorithm
        self.reducer = GradientReducer(
            params,
            group,
            bucket_bytes=bucket_bytes,
            algorithm=algorithm,
            gradient_as_bucket_view=gradient_as_bucket_view,
            reduce_dtype=reduce_dtype,
            first_bucket_bytes=first_bucket_bytes,
            exchange=exchange,
        )
        broadcast_tensors([*module.parameters(), *module.buffers()], 0, group, algorithm=broadcast_algorithm(algorithm))
        self._sync_enabled = True
        self._sync_this_backward = True
        self._finish_queued = False
        self._optimizer: torch.optim.Optimizer | None = None  # stepped inside backward (overlap_optimizer)
        self._optimizer_step: Callable[..., Any] | None = None
        self._stepped = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # As in DDP, whether the coming backward communicates is decided when the forward runs.
        self._sync_this_backward = self._sync_enabled
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward passes run inside accumulate gradients locally; the next synced backward averages the sum.

        For the mean gradient of k micro-batches, scale each micro-batch's loss by 1/k.
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @property
    def bucket_count(self) -> int:
        return len(self.reducer.buckets)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_this_backward:
            return
        if not self._finish_queued:  # buckets left (unused parameters) go out when the whole backward is done
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self.reducer.mark_ready(param)

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` inside backward, as soon as the gradients are averaged: the parameters of every
        bucket but the last are stepped while the last bucket is still being reduced, then the last bucket's.

        The step is the optimizer's own (its hyperparameters, learning-rate schedule and state as usual), run on
        a subset of its parameters at a time, which gives what one step over all of them gives only for an
        optimizer that updates each parameter from its own gradient and state alone: ``SGD``, ``Adam``, ``AdamW``,
        ``Adamax``, ``Adagrad``, ``Adadelta``, ``NAdam``, ``RAdam`` and ``RMSprop`` of ``torch.optim`` (others
        are refused). Nothing may need every gradient before the step (clipping by the global norm, a loss
        scaler's inf check): run those without the overlap. The overlap is what PyTorch DDP's
        ``_register_fused_optim`` and ``torch.distributed.optim._apply_optimizer_in_backward`` offer.

        The training loop stays as it was: ``optimizer.step()`` after a synchronised backward returns at once (the
        step is done) and raises ``RuntimeError`` when no synchronised backward ran since the last step (after
        backward passes under :meth:`no_sync` alone); ``optimizer.zero_grad()`` works as before.
        """
        if type(optimizer) not in _ELEMENTWISE_OPTIMIZERS:
            names = ", ".join(sorted(c.__name__ for c in _ELEMENTWISE_OPTIMIZERS))
            raise ValueError(
                f"DataParallel.overlap_optimizer: {type(optimizer).__name__} is not an optimizer whose step is "
                f"per parameter; accepted: torch.optim.{{{names}}}"
            )
        if self._optimizer is not None:
            raise ValueError("DataParallel.overlap_optimizer: an optimizer already steps inside backward")
        ours = {id(p) for p in self.module.parameters()}
        if any(id(p) not in ours for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "DataParallel.overlap_optimizer: the optimizer holds a parameter the wrapped module does not have"
            )
        self._optimizer, self._optimizer_step = optimizer, optimizer.step
        optimizer.step = self._step_after_backward  # type: ignore[method-assign]

    def _step_after_backward(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError(
                "DataParallel.overlap_optimizer: the optimizer's step takes no closure (it ran in backward)"
            )
        if not self._stepped:
            raise RuntimeError(
                "optimizer.step(): no synchronised backward ran since the last step, so there is no averaged "
                "gradient to step with (the step runs inside backward, see DataParallel.overlap_optimizer)"
            )
        self._stepped = False

    def _step_some(self, params: list[torch.nn.Parameter]) -> None:
        """The optimizer's own step on ``params`` alone (its parameter groups narrowed for the call)."""
        assert self._optimizer is not None and self._optimizer_step is not None
        keep = {id(p) for p in params}
        groups = self._optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if id(p) in keep]
            self._optimizer_step()
        finally:
            for g, all_params in zip(groups, saved, strict=True):
                g["params"] = all_params

    def _finish_backward(self) -> None:
        self._finish_queued = False
        if self._optimizer is None:
            self.reducer.finish()
            return
        self.reducer.finish(self._step_some)
        self._stepped = True


class DistributedOptimizer:
    """Horovod's ``DistributedOptimizer``: average gradients over ``group``, then step ``optimizer``.

    ``params`` names the parameters to average (``model.named_parameters()``, plain parameters, or None for
    every parameter of ``optimizer``). A parameter's gradient joins its bucket once ``backward_passes_per_step``
    backward passes have accumulated into it, and a bucket is all-reduced as soon as it is complete (Horovod's
    hook-driven tensor fusion); :meth:`step` reduces whatever is left and then runs the wrapped step. The
    accumulated gradient is the sum over the passes, as in Horovod: scale the loss by 1/passes for a mean.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]] | None,
        group,
        *,
        algorithm: str = "auto",
        backward_passes_per_step: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        chosen = _parameters(params, owned)
        group_size(group)
        self.optimizer = optimizer
        self.group = group
        self.backward_passes_per_step = backward_passes_per_step
        self.reducer = GradientReducer(chosen, group, bucket_bytes=bucket_bytes, algorithm=algorithm)
        self._passes = {id(p): 0 for p in chosen}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in chosen]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._passes[id(param)] += 1
        if self._passes[id(param)] > self.backward_passes_per_step:
            raise RuntimeError(
                f"a gradient was accumulated {self._passes[id(param)]} times before step(), but "
                f"backward_passes_per_step={self.backward_passes_per_step}; call step() or raise the setting"
            )
        if self._passes[id(param)] == self.backward_passes_per_step:
            self.reducer.mark_ready(param)

    def synchronize(self) -> None:
        """Average every gradient not averaged yet (buckets in order) and start counting passes again."""
        self.reducer.finish()
        self._passes = dict.fromkeys(self._passes, 0)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def _parameters(params, owned: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    if params is None:
        chosen = owned
    else:
        items = list(params)
        names = [item[0] for item in items if isinstance(item, tuple)]
        if len(set(names)) != len(names):
            duplicated = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"DistributedOptimizer: parameter names appear more than once: {duplicated}")
        chosen = [item[1] if isinstance(item, tuple) else item for item in items]
    chosen = [p for p in dict.fromkeys(chosen) if p.requires_grad]  # keep order, drop repeats of a tied weight
    owned_ids = {id(p) for p in owned}
    foreign = [i for i, p in enumerate(chosen) if id(p) not in owned_ids]
    if foreign:
        raise ValueError(f"DistributedOptimizer: parameters at positions {foreign} are not in the wrapped optimizer")
    if not chosen:
        raise ValueError("DistributedOptimizer: no parameter that requires a gradient to average")
    return chosen


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root: int,
    group,
    *,
    algorithm: str = "auto",
) -> None:
    """Overwrite ``params`` (a state_dict, named parameters or tensors) in place with group rank ``root``'s."""
    if isinstance(params, Mapping):
        tensors = list(params.values())
    else:
        tensors = [item[1] if isinstance(item, tuple) else item for item in params]
    broadcast_tensors(tensors, root, group, algorithm=algorithm)


def split_batch(batch: Batch, group) -> Batch:
    """This rank's rows of the global ``batch`` (a tensor or a tuple/list of tensors), split evenly along dim 0.

    Equal shards make data parallel equal to one process on the whole batch; an uneven split raises.
    """
    world = group_size(group)
    rank = dist.get_rank(group)
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    for t in tensors:
        if t.shape[0] % world:
            raise ValueError(
                f"split_batch: the global batch has {t.shape[0]} rows, not a multiple of the group size {world}"
            )
    shards = [t.chunk(world, dim=0)[rank] for t in tensors]
    if isinstance(batch, torch.Tensor):
        return shards[0]
    return type(batch)(shards)
