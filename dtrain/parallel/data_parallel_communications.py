"""Where data parallelism talks to the network: gradient buckets, their averaging all-reduce, broadcasts.

Gradients are packed into **buckets** (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB, section 3.2.3): parameters are taken in reverse registration order, the order in
which backward roughly produces their gradients, and cut into buckets of about ``bucket_bytes`` each. A
bucket owns one flat contiguous buffer; when every gradient of a bucket has been accumulated, the gradients
are copied into the buffer and one averaging all-reduce runs on it while backward goes on computing earlier
layers' gradients (section 3.2.3's overlap): the backend's own, asynchronous, where the algorithm is (or
``auto`` resolves to) ``native``, with NCCL's average folded into the reduction (``ReduceOp.AVG``). Buckets
are launched strictly in index order, so every rank issues the same collectives in the same order (section
3.2.3, "all-reduce order must be the same"). After the first pass the buckets are cut again in the order
gradients were observed to become ready (rank 0's order, broadcast), the first one small (DDP's
``first_bucket_bytes_cap``), and gradients become views into the buckets, as DDP does (:class:`GradientReducer`).

Our own algorithms (``ring``, ...) are synchronous, so for them "launch" runs the all-reduce inside the
autograd hook: the structure (when a bucket goes out, in what order, one flat message per bucket) is DDP's.
Horovod's tensor fusion (Sergeev and Del Balso 2018, "Horovod: fast and easy distributed deep learning in
TensorFlow", section 4) is the same idea, reused here by :class:`~dtrain.parallel.data_parallel.DistributedOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm.ir.schedule import Collective

#: How :class:`GradientReducer` averages its buckets: by ``algorithm``'s all-reduce, or moved by copy engines.
EXCHANGES = ("collective", "copy-engine")

__all__ = [
    "EXCHANGES",
    "Bucket",
    "GradientReducer",
    "build_buckets",
    "broadcast_algorithm",
    "broadcast_tensors",
    "cut_buckets",
    "broadcast_optimizer_state",
    "group_size",
    "comm_device_copy",
]


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel together, and the flat buffer they travel in.

    ``views[i]`` is ``params[i]``'s slice of ``buffer``, shaped like the parameter; ``pending`` holds the
    parameters whose gradient has not been accumulated yet in this backward pass. The buffer ends in one *flag* a
    parameter (``flags``): 1 where this rank holds a gradient for it, 0 where it holds none; averaged with the
    gradients, a flag is 0 only where no rank of the group has a gradient for the parameter, which then keeps no
    gradient, as on one process (``missing``: the parameters this rank had no gradient for, in this pass).
    """

    params: list[torch.nn.Parameter]
    buffer: torch.Tensor = field(repr=False)  # (numel + len(params),) one dtype, one device
    views: list[torch.Tensor] = field(repr=False)  # views[i]: buffer slice shaped like params[i]
    pending: set[int] = field(default_factory=set, repr=False)  # id() of parameters not ready yet
    missing: list[int] = field(default_factory=list, repr=False)  # indices of params without a gradient here

    @property
    def flags(self) -> torch.Tensor:
        return self.buffer[self.buffer.numel() - len(self.params) :]

    @property
    def nbytes(self) -> int:
        """The gradients' bytes (the flags left out)."""
        return (self.buffer.numel() - len(self.params)) * self.buffer.element_size()

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}


def build_buckets(
    params: Iterable[torch.nn.Parameter], bucket_bytes: int, first_bucket_bytes: int | None = None
) -> list[Bucket]:
    """Cut ``params`` (taken in reverse order) into buckets that close at ``bucket_bytes``, one dtype and device
    each (the first at ``first_bucket_bytes``, see :func:`cut_buckets`).

    Reverse registration order is the first guess at the order backward produces gradients (Li et al. 2020,
    section 3.2.3); :class:`GradientReducer` replaces it with the observed order after the first pass.
    """
    return cut_buckets(list(reversed([p for p in params if p.requires_grad])), bucket_bytes, first_bucket_bytes)


def cut_buckets(
    ordered: list[torch.nn.Parameter], bucket_bytes: int, first_bucket_bytes: int | None = None
) -> list[Bucket]:
    """Cut ``ordered`` as given into consecutive buckets, one dtype and device each, as DDP cuts them: a
    parameter joins the open bucket, which closes once it holds ``bucket_bytes`` or more (the reducer's
    ``compute_bucket_assignment_by_size``; Li et al. 2020, section 3.2.3). A bucket thus passes the cap by less
    than its last parameter, and a parameter larger than the cap fills a bucket of its own. The first bucket
    closes at ``first_bucket_bytes`` where that is smaller (None: no other cap): DDP's ``first_bucket_bytes_cap``
    of 1 MiB, so that the gradients ready first go out without waiting for a whole bucket's worth behind them.
    Closing at the cap rather than below it gives DDP's bucket count (14 rather than 18 all-reduces a step
    for a 12-layer GPT of 136M parameters).
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int (bytes), got {bucket_bytes!r}")
    if first_bucket_bytes is not None and (
        not isinstance(first_bucket_bytes, int) or isinstance(first_bucket_bytes, bool) or first_bucket_bytes <= 0
    ):
        raise ValueError(f"first_bucket_bytes must be a positive int (bytes) or None, got {first_bucket_bytes!r}")
    buckets: list[Bucket] = []
    current: list[torch.nn.Parameter] = []
    current_bytes = 0
    for p in ordered:
        if current and (current[0].dtype != p.dtype or current[0].device != p.device):
            buckets.append(_make_bucket(current))
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += p.numel() * p.element_size()
        cap = bucket_bytes if buckets or first_bucket_bytes is None else min(bucket_bytes, first_bucket_bytes)
        if current_bytes >= cap:
            buckets.append(_make_bucket(current))
            current, current_bytes = [], 0
    if current:
        buckets.append(_make_bucket(current))
    return buckets


def _make_bucket(params: list[torch.nn.Parameter]) -> Bucket:
    numel = sum(p.numel() for p in params)
    buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)  # gradients, flags
    views, start = [], 0
    for p in params:
        views.append(buffer[start : start + p.numel()].view_as(p))
        start += p.numel()
    bucket = Bucket(params=params, buffer=buffer, views=views)
    bucket.reset()
    return bucket


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()


class GradientReducer:
    """Averages gradients over ``group`` bucket by bucket, each bucket as soon as all its gradients are ready.

    Call :meth:`mark_ready` from a parameter's post-accumulate-grad hook and :meth:`finish` once the pass is
    over (at the end of backward, or before the optimizer step); ``finish`` reduces buckets still waiting (a
    parameter that got no gradient counts as a zero gradient, as on the ranks that did use it) and rearms.

    Two of DDP's refinements (Li et al. 2020, sections 3.2.3 and 4.2):

    - **bucket rebuild**: the first pass records the order in which gradients became ready; at its end the
      buckets are cut again in group rank 0's order (broadcast, so every rank holds the same buckets), so the
      first bucket fills, and goes out, as early as backward allows;
    - **gradients as bucket views** (``gradient_as_bucket_view``, DDP's option of that name): after a bucket is
      averaged each ``param.grad`` *is* its slice of the bucket, so the next backward accumulates straight
      into the bucket (no copy in) when gradients are zeroed rather than set to None, and nothing is copied
      back out; a gradient autograd created anew is copied in with one fused ``_foreach_copy_``.

    ``reduce_dtype`` (e.g. ``torch.bfloat16`` for float32 gradients) averages each bucket in that dtype: the
    bucket is cast down, all-reduced and cast back, halving the bytes sent at the cost of bf16 rounding in the
    sum (the choice FSDP's ``MixedPrecisionPolicy(reduce_dtype=...)`` offers).

    ``exchange``: ``"collective"`` (the default) averages each bucket with ``algorithm``'s all-reduce;
    ``"copy-engine"`` (every rank on one host) does, from the second pass on, with
    :class:`~dtrain.comm.peer.bucket_reduce.BucketReduce`: the buckets move into its peer window after the first
    pass (and its rebuild), their bytes are moved by copy engines, one summing pass a bucket runs on the SMs,
    asynchronous like ``native`` (the first pass, whose buckets are not final yet, uses ``algorithm``).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        group,
        *,
        bucket_bytes: int,
        algorithm: str,
        gradient_as_bucket_view: bool = True,
        rebuild_buckets: bool = True,
        reduce_dtype: torch.dtype | None = None,
        first_bucket_bytes: int | None = None,
        exchange: str = "collective",
    ) -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
        if exchange == "copy-engine" and reduce_dtype is not None:
            raise ValueError("exchange='copy-engine' averages in the gradients' own dtype; it takes no reduce_dtype")
        self.group = group
        self.exchange = exchange
        self._bucket_reduce = None  # the copy-engine exchange, made once the buckets are final
        self.reduce_dtype = reduce_dtype
        self.algorithm = algorithm
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.buckets = build_buckets(params, bucket_bytes, first_bucket_bytes)
        if exchange == "copy-engine":
            self._check_copy_engine()
        self._params = [p for b in reversed(self.buckets) for p in reversed(b.params)]  # registration order
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._bucket_of = self._locate()
        self._next_launch = 0  # buckets go out in index order on every rank
        self._ready_order: list[int] | None = [] if rebuild_buckets else None  # recorded until the rebuild
        self.launches = 0  # all-reduces issued so far (tests and benchmarks read it)
        self._in_flight: list[tuple[Any, Bucket, torch.Tensor, bool]] = []  # native all-reduces not waited for yet
        self._nccl = dist.get_backend(group) == "nccl"
        self._chosen: dict[tuple[int, torch.dtype], str] = {}  # (bytes, dtype on the wire) -> algorithm

    def _choose(self, wire: torch.Tensor) -> str:
        """The all-reduce algorithm for a bucket on the wire: ``algorithm``, or for "auto" what
        :func:`dtrain.comm.all_reduce` would pick for that size (kept per size; the same on every rank).

        Where that is ``native``, the bucket goes out asynchronously (``async_op=True``) rather than through
        ``comm.all_reduce``, which returns only once the result is ready: on NCCL the compute stream would wait
        for every bucket before backward goes on, and no reduction would overlap backward."""
        if self.algorithm != "auto":
            return self.algorithm
        key = (wire.numel() * wire.element_size(), wire.dtype)
        chosen = self._chosen.get(key)
        if chosen is None:
            from dtrain.comm.api import _prepare  # the same resolution (rules, cost model) comm.all_reduce makes

            chosen = _prepare(Collective.ALL_REDUCE, "auto", self.group, wire.numel(), wire, "DataParallel")[2]
            # NCCL's own call on the group's wide communicator, which takes more SMs from the backward it runs
            # beside: a bucket keeps the group's own, asynchronous
            chosen = self._chosen[key] = "native" if chosen == "native_wide" else chosen
        return chosen

    def _locate(self) -> dict[int, int]:
        return {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}

    @property
    def rebuilt(self) -> bool:
        """Whether the buckets follow the observed gradient order (after the first full pass)."""
        return self._ready_order is None

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """``param.grad`` holds this pass's gradient: launch every bucket that is now complete, in order."""
        b = self._bucket_of.get(id(param))
        if b is None:
            return
        if self._ready_order is not None:
            self._ready_order.append(self._index[id(param)])
        if b < self._next_launch:
            return
        self.buckets[b].pending.discard(id(param))
        while self._next_launch < len(self.buckets) and not self.buckets[self._next_launch].pending:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def finish(self, on_reduced: Callable[[list[torch.nn.Parameter]], None] | None = None) -> None:
        """Reduce every bucket not yet launched (in order), wait for those in flight, then rearm all buckets for
        the next pass.

        ``on_reduced(params)`` is called with parameters whose gradients are averaged: first with every bucket's
        but the one launched last, while that one is still on the wire, then with the last one's. The work it
        queues (an optimizer's step) thus runs while the last reduction, which nothing else could overlap, is in
        flight."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        if on_reduced is None:
            self._wait_all()
        else:
            in_flight, self._in_flight = self._in_flight, []
            last = {id(bucket) for _, bucket, _, _ in in_flight[-1:]}
            self._wait(in_flight[:-1])
            on_reduced([p for b in self.buckets if id(b) not in last for p in b.params])
            self._wait(in_flight[-1:])
            if last:
                on_reduced([p for b in self.buckets if id(b) in last for p in b.params])
        if self._ready_order is not None:
            self._rebuild(self._ready_order)
            self._ready_order = None
        if self.exchange == "copy-engine" and self._bucket_reduce is None:
            self._home_buckets()
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0

    def _rebuild(self, observed: list[int]) -> None:
        """Cut the buckets again in group rank 0's observed order; parameters never seen keep their old place."""
        seen = list(dict.fromkeys(observed))
        seen_set = set(seen)
        unseen = [i for i in (self._index[id(p)] for b in self.buckets for p in b.params) if i not in seen_set]
        order = torch.tensor(seen + unseen, dtype=torch.int64)  # the same length on every rank
        order = comm_device_copy(order, self.group)  # NCCL carries device tensors only
        comm.broadcast(order, 0, group=self.group, algorithm="native")
        old_views = {id(p): v for b in self.buckets for p, v in zip(b.params, b.views, strict=True)}
        self.buckets = cut_buckets(
            [self._params[i] for i in order.tolist()], self.bucket_bytes, self.first_bucket_bytes
        )
        self._bucket_of = self._locate()
        if not self.gradient_as_bucket_view:
            return
        with torch.no_grad():  # move gradients that were views of the old buckets into the new ones
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if p.grad is not None and _is_view(p.grad, old_views[id(p)]):
                        view.copy_(p.grad)
                        p.grad = view

    def _launch(self, bucket: Bucket) -> None:
        with torch.no_grad():
            targets, sources, missing = [], [], []
            bucket.missing = []
            for i, (p, view) in enumerate(zip(bucket.params, bucket.views, strict=True)):
                if p.grad is None:
                    missing.append(view)
                    bucket.missing.append(i)
                elif not _is_view(p.grad, view):
                    targets.append(view)
                    sources.append(p.grad)
            if targets:
                torch._foreach_copy_(targets, sources)
            flags = bucket.flags
            flags.fill_(1.0)
            if missing:
                torch._foreach_zero_(missing)
                flags[bucket.missing] = 0.0
            if self.gradient_as_bucket_view:
                # the gradients autograd made are copied in: let them go now (the copy is queued ahead of any
                # reuse of their memory on this stream), the bucket holds the values from here on
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    p.grad = view
            wire = bucket.buffer
            if self._bucket_reduce is not None:
                index = self._next_launch
                self._bucket_reduce.start(index, wire)
                self._in_flight.append((_Started(self._bucket_reduce, index), bucket, wire, True))
                self.launches += 1
                return
            if self.reduce_dtype is not None and self.reduce_dtype != wire.dtype:
                wire = wire.to(self.reduce_dtype)
            algorithm = self._choose(wire)
            if algorithm == "native":
                # the backend's own all-reduce, asynchronous as DDP's: backward keeps computing on its stream
                # while the bucket is on the wire, and finish() waits (Li et al. 2020, section 3.2.3). NCCL averages
                # inside the all-reduce (ncclAvg, NCCL >= 2.10), so no pass over the gradients is left for after
                # backward; Gloo has no average op and the sums are divided once waited for.
                op = dist.ReduceOp.AVG if self._nccl else dist.ReduceOp.SUM
                work = dist.all_reduce(wire, op, group=self.group, async_op=True)
                self._in_flight.append((work, bucket, wire, self._nccl))
            else:
                comm.all_reduce(wire, op="avg", group=self.group, algorithm=algorithm)
                if wire is not bucket.buffer:
                    bucket.buffer.copy_(wire)
                self._assign(bucket)
        self.launches += 1

    def _check_copy_engine(self) -> None:
        """Refuse, before any gradient moves, what the copy-engine exchange cannot average (a collective call)."""
        from dtrain.comm.peer.channels import channels_available

        kinds = {(b.buffer.dtype, b.buffer.device) for b in self.buckets}
        if len(kinds) != 1:
            raise ValueError(
                "DataParallel(exchange='copy-engine') averages gradients of one dtype on one device; these are "
                + ", ".join(sorted(f"{d} on {v}" for d, v in kinds))
            )
        ((_, device),) = kinds
        if not channels_available(self.group, device):
            raise ValueError(
                "DataParallel(exchange='copy-engine') needs every rank on one host (on GPUs, CUDA symmetric memory "
                "and stream memory operations); use exchange='collective'"
            )

    def _home_buckets(self) -> None:
        """Make the copy-engine exchange of the buckets as they now are (after the first pass, on every rank alike)
        and move the buckets, and the gradients that are views of them, into its peer window."""
        from dtrain.comm.peer.bucket_reduce import BucketReduce

        ((dtype, device),) = {(b.buffer.dtype, b.buffer.device) for b in self.buckets}  # one kind: see __init__
        reduce = BucketReduce(self.group, device, [b.buffer.numel() for b in self.buckets], dtype)
        with torch.no_grad():
            for bucket, home in zip(self.buckets, reduce.buckets, strict=True):
                home.copy_(bucket.buffer)
                views, start = [], 0
                for p, old in zip(bucket.params, bucket.views, strict=True):
                    view = home[start : start + p.numel()].view_as(p)
                    start += p.numel()
                    if p.grad is not None and _is_view(p.grad, old):
                        p.grad = view
                    views.append(view)
                bucket.buffer, bucket.views = home, views
        self._bucket_reduce = reduce

    def _assign(self, bucket: Bucket) -> None:
        """Point (or copy) each parameter's gradient at its averaged slice of ``bucket``; a parameter that no rank
        had a gradient for keeps none (read back only where this rank had none: the other ranks had them all)."""
        unused = set()
        if bucket.missing and not _capturing(bucket.buffer):
            flags = bucket.flags[bucket.missing].tolist()
            unused = {i for i, flag in zip(bucket.missing, flags, strict=True) if flag == 0}
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views, strict=True)):
            if i in unused:
                p.grad = None
            elif self.gradient_as_bucket_view:
                p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def _wait_all(self) -> None:
        """Wait for every native all-reduce in flight (on GPUs the compute stream waits, not the host), divide
        the sums by the group size where the backend summed (as the synchronous path's ``op="avg"`` does) and
        hand out the gradients."""
        in_flight, self._in_flight = self._in_flight, []
        self._wait(in_flight)

    def _wait(self, in_flight: list[tuple[Any, Bucket, torch.Tensor, bool]]) -> None:
        size = group_size(self.group)
        with torch.no_grad():
            for work, bucket, wire, averaged in in_flight:
                work.wait()
                if wire is not bucket.buffer:
                    bucket.buffer.copy_(wire)
                if not averaged:
                    bucket.buffer.div_(size)
                self._assign(bucket)


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s device is recording a CUDA graph (nothing may be read back then)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


class _Started:
    """A bucket on the copy-engine exchange: ``wait`` makes the caller's stream wait for it."""

    __slots__ = ("_reduce", "_index")

    def __init__(self, reduce, index: int) -> None:
        self._reduce, self._index = reduce, index

    def wait(self) -> None:
        self._reduce.wait(self._index)


def reduce_in(buffer: torch.Tensor, dtype: torch.dtype | None, *, group, algorithm: str) -> None:
    """Average ``buffer`` over ``group`` in place, the sum taken in ``dtype`` (None: the buffer's own dtype)."""
    if dtype is None or dtype == buffer.dtype:
        comm.all_reduce(buffer, op="avg", group=group, algorithm=algorithm)
        return
    low = buffer.to(dtype)
    comm.all_reduce(low, op="avg", group=group, algorithm=algorithm)
    buffer.copy_(low)


def broadcast_algorithm(algorithm: str) -> str:
    """The broadcast algorithm to pair with the all-reduce ``algorithm``: the same name where broadcast has it
    (``ring``, ``tree``, ``native``, ...), else ``"auto"`` (``direct``, ``recursive_doubling`` and
    ``halving_doubling`` are all-reduce algorithms only). Names no collective has pass through, to be refused
    by the broadcast itself."""
    if algorithm in comm.algorithms("broadcast") or algorithm not in comm.algorithms("all_reduce"):
        return algorithm
    return "auto"


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int, group, *, algorithm: str = "auto") -> None:
    """Overwrite ``tensors`` in place with group rank ``src``'s values: one flat broadcast per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for (dtype, device), same in by_kind.items():
            flat = torch.cat([t.detach().reshape(-1) for t in same]).to(dtype=dtype, device=device)
            flat = comm_device_copy(flat, group)  # e.g. Adam's step counts live on the CPU, NCCL wants the GPU
            comm.broadcast(flat, src, group=group, algorithm=algorithm)
            start = 0
            for t in same:
                t.copy_(flat[start : start + t.numel()].view_as(t))
                start += t.numel()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, src: int, group, *, algorithm: str = "auto") -> None:
    """Copy group rank ``src``'s optimizer state tensors and numeric hyperparameters to every rank.

    Horovod's ``broadcast_optimizer_state`` (Sergeev and Del Balso 2018). The state must already have the same
    structure everywhere (for lazily built state such as Adam's, broadcast after the first step on all ranks);
    a rank whose state differs from the others' raises ``ValueError`` on every rank, before any state moves.
    """
    tensors = []
    for gi, group_ in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group_["params"]):
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"optimizer state [{gi}][{pi}][{key!r}] is a {type(value).__name__}, not a tensor")
                tensors.append(value)
    shape = torch.tensor([len(tensors), sum(t.numel() for t in tensors)], dtype=torch.int64)
    shape = comm_device_copy(shape, group)
    low, high = shape.clone(), shape.clone()
    comm.all_reduce(low, op="min", group=group, algorithm=algorithm)
    comm.all_reduce(high, op="max", group=group, algorithm=algorithm)
    if not torch.equal(low, high):
        raise ValueError(
            f"broadcast_optimizer_state: ranks hold different optimizer state (tensors, elements) from "
            f"{low.tolist()} to {high.tolist()}; take one step on every rank first so the state exists everywhere"
        )
    numeric = [(g, k) for g in optimizer.param_groups for k in sorted(g) if _is_number(g[k])]
    hyper = torch.tensor([float(g[k]) for g, k in numeric], dtype=torch.float64)
    broadcast_tensors([*tensors, hyper], src, group, algorithm=broadcast_algorithm(algorithm))
    for (g, k), value in zip(numeric, hyper.tolist(), strict=True):
        g[k] = type(g[k])(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def comm_device_copy(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor``, or a copy of it on this rank's GPU when ``group`` runs on NCCL (which carries no CPU tensors)."""
    if tensor.device.type == "cpu" and dist.get_backend(group) == "nccl":
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor


def group_size(group) -> int:
    """Number of ranks in ``group`` (the world when None)."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized (call init_process_group first)")
    return dist.get_world_size(group)
