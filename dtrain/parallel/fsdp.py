"""Fully sharded data parallelism (ZeRO stage 3): parameters, gradients and optimizer state sharded over dp.

After Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC20,
section 5.3, "P_os+g+p") and PyTorch FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully
Sharded Data Parallel", VLDB, sections 3 and 4):

- the model is cut into **units** (a transformer block, the embedding, the head: the modules given). Each unit's
  parameters are flattened into one padded vector (a multiple of the shard group's size N) and every rank keeps
  only its 1/N chunk of it, in float32 (the **shard**); the optimizer is an ordinary torch optimizer over pieces
  of the shards (one Parameter per model parameter's overlap with the chunk, in that parameter's param group);
- the module's own parameters stay registered (names, shapes, ``tensor_parallel_dim``) but are views of the
  unit's full buffer, in ``param_dtype``, whose storage exists only while the unit computes (FSDP's
  ``FlatParameter`` trick: the storage is resized to zero and back, so the tensors autograd saved see the
  regathered values). While a unit is freed its parameters' data are a placeholder of their shape, dtype and
  device whose every element reads as NaN and which refuses writes (one element broadcast), never the freed
  storage, which a kernel would read out of bounds;
- a unit's forward pre-hook all-gathers its parameters and issues the next unit's all-gather (prefetch); its
  forward hook frees them and hooks the unit's outputs, whose gradient hook regathers the unit before its
  backward and prefetches the previous unit (FSDP's backward prefetch, section 3.3.2);
- when every gradient of a unit has been accumulated (post-accumulate-grad hooks), the full gradients are packed
  into one padded vector, reduce-scattered (summed in ``reduce_dtype``, averaged), added to the float32 gradient
  shard (so micro-batches accumulate) and released with the unit's parameters. Units go out in reverse order on
  every rank (the same collectives in the same order); with ``algorithm="native"`` the all-gathers and
  reduce-scatters are the backend's asynchronous calls, overlapped with compute, waited for at the end of
  backward;
- hybrid sharding (FSDP's HYBRID_SHARD, section 3.2.2; ZeRO++'s hierarchical partitioning): shard within
  ``group`` (e.g. one node), replicate across ``replicate_group``; the gradient shards are averaged over the
  replicas with one all-reduce before the step.

The step updates the float32 shards only; the next forward gathers them. With equal batches per rank and a loss
that averages over the batch, a step equals one process on the global batch (``tests/parallel/test_fsdp.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain import comm
from dtrain.comm import native
from dtrain.parallel.data_parallel_communications import group_size
from dtrain.parallel.zero import MemoryReport, ZeroMemoryReport

__all__ = ["FullyShardedDataParallel", "ParameterShard", "ShardedMemoryReport", "hybrid_shard_groups"]


def _eager(fn: Callable) -> Callable:
    """``fn`` left out of any torch.compile trace (run as plain Python between the compiled graphs)."""
    return torch._dynamo.disable(fn, recursive=True)


@dataclass(frozen=True, kw_only=True)
class ShardedMemoryReport(ZeroMemoryReport):
    """:class:`~dtrain.parallel.zero.ZeroMemoryReport` (``stage`` 3) and how many bytes of full parameters were
    gathered at once: the most since the last :meth:`FullyShardedDataParallel.reset_peak` (``gathered_peak_nbytes``)
    against the largest unit's full parameters (``largest_unit_nbytes``, in ``param_dtype``)."""

    gathered_peak_nbytes: int
    largest_unit_nbytes: int


@dataclass
class ParameterShard:
    """This rank's piece of one parameter: elements ``[start, end)`` of its flattened tp-local tensor (``shape``).

    ``shard`` is the float32 master copy of those elements (a view of the rank's flat shard, updated in place by
    the step); ``optimizer_state`` maps each per-element state of the optimizer (e.g. ``exp_avg``) to its tensor
    over the same elements and keeps the scalar ones (``step``); empty before the first step. ``param_group`` is
    the index of the parameter's group in ``param_groups``. A rank whose chunk misses the parameter has
    ``start == end`` and an empty ``shard``.
    """

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    shard: torch.Tensor
    optimizer_state: dict[str, Any]
    param_group: int


@dataclass(eq=False)
class _Flat:
    """Parameters sharded together: laid out one after another in a vector of ``numel`` elements (padded to a
    multiple of N); this rank holds ``[rank * chunk, (rank + 1) * chunk)``."""

    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    chunk: int
    full: torch.Tensor  # (numel,) param_dtype; its storage is allocated only while gathered
    shard: torch.Tensor = field(repr=False)  # (chunk,) float32: this rank's shard
    grad: torch.Tensor = field(repr=False)  # (chunk,) float32 view of the rank's flat gradient shard
    views: list[torch.Tensor] = field(default_factory=list, repr=False)  # each parameter's view of ``full``
    placeholders: list[torch.Tensor] = field(default_factory=list, repr=False)  # each one's data while freed
    users: list[int] = field(default_factory=list)  # units that compute with it, in order
    gathered: bool = False
    work: Any = None  # an all-gather in flight: (work, source)
    pending: set[int] = field(default_factory=set)  # id() of parameters without this pass's gradient yet

    @property
    def nbytes(self) -> int:
        return self.numel * self.full.element_size()


def hybrid_shard_groups(dims, shard_size: int, base_ranks: Sequence[int] | None = None) -> tuple[object, object] | None:
    """(shard group, replicate group) of this rank for hybrid sharding over the dp groups of the rank grid
    ``dims`` (a :class:`~dtrain.parallel.grid.ParallelDims`) on ``base_ranks`` (default: every rank): each dp group
    is cut into consecutive blocks of ``shard_size`` dp ranks (the shard groups, e.g. one node each); the ranks of
    equal place in their blocks replicate each other. None off the grid. Every process of the default group must
    call it with the same arguments, as :meth:`~dtrain.parallel.grid.RankGrid.build` (it makes process groups)."""
    dp = dims.dp
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or not 1 <= shard_size < dp or dp % shard_size:
        raise ValueError(f"shard_size must be a divisor of dp={dp} smaller than dp, got {shard_size!r}")
    base = tuple(base_ranks) if base_ranks is not None else tuple(range(dist.get_world_size()))
    if len(base) != dims.world_size:
        raise ValueError(f"the grid has {dims.world_size} ranks but {len(base)} base ranks were given")
    blocks, me = dp // shard_size, dist.get_rank()
    mine: dict[str, object] = {}
    for pp_rank in range(dims.pp):
        for tp_rank in range(dims.tp):
            made = [
                ("shard", [dims.rank(b * shard_size + j, pp_rank, tp_rank) for j in range(shard_size)])
                for b in range(blocks)
            ]
            made += [
                ("replicate", [dims.rank(b * shard_size + j, pp_rank, tp_rank) for b in range(blocks)])
                for j in range(shard_size)
            ]
            for kind, ranks in made:
                members = [base[r] for r in ranks]
                group = dist.new_group(members)
                if me in members:
                    mine[kind] = group
    return (mine["shard"], mine["replicate"]) if mine else None


class FullyShardedDataParallel:
    """ZeRO-3 over ``group`` of ``module``, cut into ``units`` (modules of ``module``, in forward order); also
    the optimizer: ``optimizer_cls`` over this rank's float32 shards.

    ``params`` is the optimizer's param groups (torch's list of dicts, or a list of parameters): every
    trainable parameter of ``module`` must be in one, and in one of the ``units``; a group's hyper-parameters
    apply to its parameters' pieces; ``optimizer_kwargs`` are the defaults. ``module`` must be the same on every
    rank; it is overwritten with rank 0's values (over ``group``, then ``replicate_group``). ``separate``
    parameters are sharded on their own (a tied weight whose gradient is summed with another stage's copy);
    a parameter used by several units is too, and stays gathered from its first use in a forward until its
    gradient is reduced.

    ``param_dtype`` (default float32, the shards' dtype) is the dtype units compute in; ``reduce_dtype``
    (default ``param_dtype``) the dtype gradients are summed in. ``algorithm`` names the collectives
    (``"native"``: the backend's asynchronous ones, overlapped with compute); ``prefetch`` issues the next
    unit's all-gather before the current unit computes.

    Use it like :class:`~dtrain.parallel.zero.ZeroOptimizer`: forward and ``loss.backward()`` on ``module``
    (several backward passes accumulate), then :meth:`step` and :meth:`zero_grad`; :meth:`grad_square_sum` and
    :meth:`scale_grads` read and scale the averaged gradient shards in between.
    """

    def __init__(
        self,
        module: nn.Module,
        units: Sequence[nn.Module],
        group,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        replicate_group=None,
        separate: Iterable[nn.Parameter] = (),
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        algorithm: str = "auto",
        prefetch: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        units = list(units)
        if not units:
            raise ValueError("FullyShardedDataParallel: no units given; pass the modules to shard one by one")
        self.module, self.units = module, units
        self.group, self.replicate_group = group, replicate_group
        self.world_size, self.rank = group_size(group), dist.get_rank(group)
        self.replicas = 1 if replicate_group is None else group_size(replicate_group)
        self.algorithm, self.prefetch = algorithm, prefetch
        self.param_dtype = param_dtype or torch.float32
        self.reduce_dtype = reduce_dtype or self.param_dtype
        groups = _param_groups(params)
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        name_of: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            name_of.setdefault(id(p), name)
        users: dict[int, list[int]] = {}
        first: dict[int, nn.Parameter] = {}
        for u, unit in enumerate(units):
            for p in unit.parameters():
                if p.requires_grad:
                    users.setdefault(id(p), []).append(u)
                    first.setdefault(id(p), p)
        for pid in first:
            if pid not in group_of:
                raise ValueError(f"FullyShardedDataParallel: parameter {name_of.get(pid)!r} is in no param group")
            if pid not in name_of:
                raise ValueError("FullyShardedDataParallel: a unit's parameter is not a parameter of the module")
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in users:
                raise ValueError(f"FullyShardedDataParallel: parameter {name!r} is in none of the units")
        dtypes = {p.dtype for p in first.values()}
        devices = {p.device for p in first.values()}
        if len(dtypes) != 1 or len(devices) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"FullyShardedDataParallel: parameters must share one floating dtype and device, got "
                f"{sorted(map(str, dtypes | devices))}"
            )
        self.device = next(iter(devices))
        # the flat groups: separate and shared parameters each on their own first, then one per unit
        alone = {id(p) for p in separate} | {pid for pid, us in users.items() if len(us) > 1}
        layout: list[list[nn.Parameter]] = [[first[pid]] for pid in first if pid in alone]
        for unit in units:
            own = [p for p in dict.fromkeys(unit.parameters()) if p.requires_grad and id(p) not in alone]
            if own:
                layout.append(own)
        n = self.world_size
        sizes = [-(-sum(p.numel() for p in ps) // n) for ps in layout]
        self.shard_numel = sum(sizes)
        # each unit's shard is taken (and its full parameters freed) before the next unit's is allocated, so a
        # model built whole on the device never needs its full size and all the shards at once
        empty = torch.empty(0, dtype=torch.float32, device=self.device)
        self._freed_value = torch.full((), float("nan"), dtype=self.param_dtype, device=self.device)
        self.flats: list[_Flat] = []
        for ps, chunk in zip(layout, sizes, strict=True):
            offsets, total = [], 0
            for p in ps:
                offsets.append(total)
                total += p.numel()
            flat = _Flat(
                params=ps,
                names=[name_of[id(p)] for p in ps],
                offsets=offsets,
                numel=chunk * n,
                chunk=chunk,
                full=torch.empty(chunk * n, dtype=self.param_dtype, device=self.device),
                shard=torch.zeros(chunk, dtype=torch.float32, device=self.device),
                grad=empty,
                users=sorted({u for p in ps for u in users[id(p)]}),
            )
            self.flats.append(flat)
            self._adopt(flat)
        self.flat_grad = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
        begin = 0
        for flat in self.flats:
            flat.grad = self.flat_grad[begin : begin + flat.chunk]
            begin += flat.chunk
        self._flats_of = [[f for f in self.flats if u in f.users] for u in range(len(units))]
        self._numel = sum(p.numel() for f in self.flats for p in f.params)
        # prefetch links: consecutive units of one parent (a pipeline's chunks are separate Sequentials)
        parent = {id(child): id(m) for m in module.modules() for child in m.children()}
        self._next = [
            u + 1 if u + 1 < len(units) and parent.get(id(units[u])) == parent.get(id(units[u + 1])) else None
            for u in range(len(units))
        ]
        self._prev = [None] + [u - 1 if self._next[u - 1] == u else None for u in range(1, len(units))]
        # one optimizer parameter per (model parameter, this rank's chunk) overlap, in the parameter's group
        self.pieces: list[tuple[nn.Parameter, nn.Parameter, torch.Tensor]] = []  # (model param, piece, its grad)
        self._piece_of: dict[int, tuple[_Flat, int, int, nn.Parameter | None]] = {}
        per_group: list[list[nn.Parameter]] = [[] for _ in groups]
        for flat in self.flats:
            low = self.rank * flat.chunk
            for p, offset in zip(flat.params, flat.offsets, strict=True):
                lo, hi = max(low, offset), min(low + flat.chunk, offset + p.numel())
                piece = None
                if lo < hi:
                    piece = nn.Parameter(flat.shard[lo - low : hi - low])
                    self.pieces.append((p, piece, flat.grad[lo - low : hi - low]))
                    per_group[group_of[id(p)]].append(piece)
                start = lo - offset if piece is not None else min(max(low - offset, 0), p.numel())
                self._piece_of[id(p)] = (flat, start, hi - offset if piece is not None else start, piece)
        self._group_of = group_of
        torch_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": pieces}
            for g, pieces in zip(groups, per_group, strict=True)
        ]
        self.optimizer = optimizer_cls(torch_groups, **optimizer_kwargs)
        self._in_flight: list[tuple[Any, _Flat, torch.Tensor]] = []  # reduce-scatters not waited for
        self._next_launch = 0  # flats go out in reverse index order
        self._finish_queued = False
        self._replicated = True  # the gradient shards are averaged over the replicas
        self.gathered_nbytes = 0
        self.gathered_peak_nbytes = 0
        self.launches = 0
        self._used: set[int] = set()  # id() of the parameters that had a gradient on this rank since zero_grad
        for flat in self.flats:
            flat.pending = {id(p) for p in flat.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark_ready) for f in self.flats for p in f.params]
        self._flat_of = {id(p): i for i, f in enumerate(self.flats) for p in f.params}
        for u, unit in enumerate(units):
            # the hooks run eagerly around a torch.compile'd unit (Module.compile traces its hooks too): their
            # collectives and storage resizes are no graph's business, and dynamo skips them without retracing
            self._hooks.append(unit.register_forward_pre_hook(_eager(self._pre_forward(u))))
            self._hooks.append(unit.register_forward_hook(_eager(self._post_forward(u))))
        self._hooks.append(module.register_state_dict_post_hook(lambda *a: self._state_dict_hook(*a)))
        self._hooks.append(module.register_load_state_dict_pre_hook(lambda *a: self._load_state_dict_pre_hook(*a)))
        self._hooks.append(module.register_load_state_dict_post_hook(lambda *_: self.reshard()))

    # ------------------------------------------------------------------------------------------ layout

    @torch.no_grad()
    def _adopt(self, flat: _Flat) -> None:
        """Take rank 0's values of the flat group's parameters into this rank's shard; point each parameter at its
        slice of the (freed) full buffer."""
        whole = torch.zeros(flat.numel, dtype=torch.float32, device=self.device)
        for p, offset in zip(flat.params, flat.offsets, strict=True):
            whole[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        comm.broadcast(whole, 0, group=self.group, algorithm=_broadcast_algorithm(self.algorithm))
        if self.replicate_group is not None:
            comm.broadcast(whole, 0, group=self.replicate_group, algorithm=_broadcast_algorithm(self.algorithm))
        flat.shard.copy_(whole[self.rank * flat.chunk : (self.rank + 1) * flat.chunk])
        flat.views = [
            flat.full[o : o + p.numel()].view(p.shape) for p, o in zip(flat.params, flat.offsets, strict=True)
        ]
        flat.placeholders = [self._freed_value.expand(p.shape) for p in flat.params]
        _free(flat.full)
        self._point(flat, flat.placeholders)

    @staticmethod
    def _point(flat: _Flat, tensors: list[torch.Tensor]) -> None:
        """Make each parameter of ``flat`` hold ``tensors`` (its view of the full buffer, or its placeholder).
        ``.data`` keeps the parameter's identity and version counter: autograd's saved parameters see the values
        regathered before their backward."""
        for p, t in zip(flat.params, tensors, strict=True):
            p.data = t

    # ------------------------------------------------------------------------------------------ gathering

    def _gather(self, flat: _Flat, *, wait: bool) -> None:
        """All-gather ``flat``'s full parameters (asynchronously where the algorithm is native and not ``wait``)."""
        if not flat.gathered:
            _alloc(flat.full)
            self._point(flat, flat.views)
            source = flat.shard.to(self.param_dtype)
            target = flat.full.data  # its own version counter: the parameters' saved views stay valid
            if self.algorithm == "native":
                work = _all_gather_single(target, source, group=self.group, async_op=True)
                flat.work = (work, source)
            else:
                comm.all_gather(target, source, group=self.group, algorithm=self.algorithm)
            flat.gathered = True
            self.gathered_nbytes += flat.nbytes
            self.gathered_peak_nbytes = max(self.gathered_peak_nbytes, self.gathered_nbytes)
        if wait and flat.work is not None:
            flat.work[0].wait()
            flat.work = None

    def _free(self, flat: _Flat) -> None:
        if flat.gathered:
            if flat.work is not None:
                flat.work[0].wait()
                flat.work = None
            self._point(flat, flat.placeholders)
            _free(flat.full)
            flat.gathered = False
            self.gathered_nbytes -= flat.nbytes

    def reshard(self) -> None:
        """Free every gathered unit (the step and ``zero_grad`` do)."""
        for flat in self.flats:
            self._free(flat)

    def reset_peak(self) -> None:
        """Start counting :attr:`gathered_peak_nbytes` afresh (from what is gathered now)."""
        self.gathered_peak_nbytes = self.gathered_nbytes

    def _gather_unit(self, u: int, neighbour: int | None) -> None:
        for flat in self._flats_of[u]:
            self._gather(flat, wait=False)
        if self.prefetch and neighbour is not None:
            for flat in self._flats_of[neighbour]:
                self._gather(flat, wait=False)
        for flat in self._flats_of[u]:
            self._gather(flat, wait=True)

    def _pre_forward(self, u: int) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self._gather_unit(u, self._next[u])

        return hook

    def _post_forward(self, u: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            training = torch.is_grad_enabled()
            for flat in self._flats_of[u]:
                # a flat group of several units stays until its gradient is reduced (training) or its last use
                if len(flat.users) == 1 or (not training and u == flat.users[-1]):
                    self._free(flat)
            if training:
                out = next((t for t in _tensors(output) if t.requires_grad), None)
                if out is not None:
                    out.register_hook(self._pre_backward(u))

        return hook

    def _pre_backward(self, u: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if not self._finish_queued:
                self._finish_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._gather_unit(u, self._prev[u])

        return hook

    # ------------------------------------------------------------------------------------------ gradients

    def _mark_ready(self, param: torch.Tensor) -> None:
        """``param.grad`` holds this pass's gradient: reduce-scatter every flat group now complete, in order."""
        if not self._finish_queued:
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        i = self._flat_of[id(param)]
        flat = self.flats[i]
        if len(self.flats) - 1 - i < self._next_launch:
            return
        flat.pending.discard(id(param))
        while self._next_launch < len(self.flats) and not self.flats[-1 - self._next_launch].pending:
            self._launch(self.flats[-1 - self._next_launch])
            self._next_launch += 1

    def _finish(self) -> None:
        """End of a backward pass: reduce what is left (a missing gradient counts as zero), wait for every
        reduce-scatter, free what is still gathered, rearm."""
        self._finish_queued = False
        while self._next_launch < len(self.flats):
            self._launch(self.flats[-1 - self._next_launch])
            self._next_launch += 1
        self._next_launch = 0
        self._wait_reductions()
        for flat in self.flats:
            flat.pending = {id(p) for p in flat.params}
        self.reshard()

    @torch.no_grad()
    def _launch(self, flat: _Flat) -> None:
        work = torch.empty(flat.numel, dtype=self.reduce_dtype, device=self.device)
        views, grads, missing = [], [], []
        for p, offset in zip(flat.params, flat.offsets, strict=True):
            view = work[offset : offset + p.numel()].view(p.shape)
            (missing if p.grad is None else views).append(view)
            if p.grad is not None:
                grads.append(p.grad)
                self._used.add(id(p))
        if grads:
            torch._foreach_copy_(views, grads)
        if missing:
            torch._foreach_zero_(missing)
        work[flat.offsets[-1] + flat.params[-1].numel() :].zero_()
        del views, grads, missing
        for p in flat.params:
            p.grad = None  # only the shard is kept
        self._free(flat)
        out = torch.empty(flat.chunk, dtype=self.reduce_dtype, device=self.device)
        if self.algorithm == "native":
            handle = _reduce_scatter_single(out, work, dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._in_flight.append((handle, flat, out))
            # a reduce-scatter holds a whole unit's gradients until waited for: keep two in flight, as FSDP2
            # does (the older one, launched a unit's backward ago, has usually finished; on NCCL the wait only
            # orders the compute stream after it)
            while len(self._in_flight) > _MAX_REDUCTIONS_IN_FLIGHT:
                older, done, summed = self._in_flight.pop(0)
                older.wait()
                self._accumulate(done, summed)
        else:
            comm.reduce_scatter(out, work, op="sum", group=self.group, algorithm=self.algorithm)
            self._accumulate(flat, out)
        self._replicated = False
        self.launches += 1

    def _accumulate(self, flat: _Flat, summed: torch.Tensor) -> None:
        flat.grad.add_(summed.to(torch.float32), alpha=1.0 / self.world_size)

    def _wait_reductions(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        with torch.no_grad():
            for handle, flat, out in in_flight:
                handle.wait()
                self._accumulate(flat, out)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Wait for the reduce-scatters in flight and average the gradient shards over the replicas (hybrid
        sharding); called by :meth:`step`, :meth:`grad_square_sum`, :meth:`scale_grads`; once a step."""
        self._wait_reductions()
        if not self._replicated and self.replicate_group is not None:
            reduced = self.flat_grad.to(self.reduce_dtype)
            comm.all_reduce(reduced, op="avg", group=self.replicate_group, algorithm=self.algorithm)
            if reduced is not self.flat_grad:
                self.flat_grad.copy_(reduced)
        self._replicated = True

    @torch.no_grad()
    def all_reduce_gradient(self, param: nn.Parameter, group, op: str = "sum") -> None:
        """All-reduce the gradient shard of ``param`` (one of ``separate``) over ``group``, ranks holding the same
        shard of a copy of it (a tied weight on two pipeline stages)."""
        self.reduce_gradients()
        flat = self.flats[self._flat_of[id(param)]]
        if len(flat.params) != 1:
            raise ValueError("all_reduce_gradient: the parameter is not sharded on its own; pass it in separate")
        comm.all_reduce(flat.grad, op=op, group=group, algorithm=self.algorithm)

    @torch.no_grad()
    def grad_square_sum(self, weight_of: Callable[[nn.Parameter], float] | None = None) -> torch.Tensor:
        """Sum over this rank's averaged gradient pieces of ``weight_of(param) * g**2`` (0-d float32), divided by
        the number of replicas: summed over shard and replicate groups (the dp group), with weights 1, it is the
        squared norm of the whole averaged gradient."""
        self.reduce_gradients()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for p, _, grad in self.pieces:
            weight = 1.0 if weight_of is None else weight_of(p)
            if weight:
                total += weight * grad.square().sum()
        return total / self.replicas

    @torch.no_grad()
    def scale_grads(self, coef: float | torch.Tensor) -> None:
        """Multiply this rank's averaged gradient shard by ``coef`` (clipping, or undoing a loss scale)."""
        self.reduce_gradients()
        self.flat_grad.mul_(coef.to(torch.float32) if isinstance(coef, torch.Tensor) else coef)

    # ------------------------------------------------------------------------------------------ optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @torch.no_grad()
    def step(self) -> None:
        """Step the float32 shards with their averaged gradients; the next forward gathers the new values."""
        self.reduce_gradients()
        self.reshard()
        unused = self._globally_unused()
        for p, piece, grad in self.pieces:  # a parameter no rank had a gradient for is left alone, as on one process
            piece.grad = None if id(p) in unused else grad
        self.optimizer.step()

    @torch.no_grad()
    def _globally_unused(self) -> set[int]:
        """id() of the parameters that no rank of the shard and replicate groups had a gradient for since
        :meth:`zero_grad`: one flag a parameter, maximised over the groups, read back only where this rank missed
        one (the other ranks had them all)."""
        params = [p for flat in self.flats for p in flat.params]
        missing = [i for i, p in enumerate(params) if id(p) not in self._used]
        flags = torch.ones(len(params), dtype=torch.float32, device=self.device)
        if missing:
            flags[missing] = 0.0
        for group in (self.group, self.replicate_group):
            if group is not None:
                comm.all_reduce(flags, op="max", group=group, algorithm=self.algorithm)
        if not missing:
            return set()
        return {id(params[i]) for i, flag in zip(missing, flags[missing].tolist(), strict=True) if flag == 0}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation: the gradient shards are zeroed (they are kept, whatever ``set_to_none``)."""
        self._wait_reductions()
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
        self.flat_grad.zero_()
        self._used.clear()
        self._replicated = True

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (a checkpoint of the same layout loads it back)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    # ------------------------------------------------------------------------------------------ inspection

    def shards(self) -> list[ParameterShard]:
        """This rank's piece of every parameter of ``module`` (by its first name in ``module``), in layout order:
        what a sharded checkpoint writes and reads back in place (see :class:`ParameterShard`)."""
        out = []
        for flat in self.flats:
            for p, name in zip(flat.params, flat.names, strict=True):
                _, start, end, piece = self._piece_of[id(p)]
                if piece is None:
                    view, state = flat.shard[:0], {}
                else:
                    view, state = piece.data, dict(self.optimizer.state.get(piece, {}))
                out.append(
                    ParameterShard(
                        name=name,
                        shape=tuple(p.shape),
                        start=start,
                        end=end,
                        shard=view,
                        optimizer_state=state,
                        param_group=self._group_of[id(p)],
                    )
                )
        return out

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of ``module`` whole, float32 (new tensors), by its first name. Collective over the
        shard group."""
        out = {}
        for flat in self.flats:
            whole = torch.empty(flat.numel, dtype=torch.float32, device=self.device)
            comm.all_gather(whole, flat.shard.clone(), group=self.group, algorithm=self.algorithm)
            for p, name, offset in zip(flat.params, flat.names, flat.offsets, strict=True):
                out[name] = whole[offset : offset + p.numel()].view(p.shape).clone()
        return out

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit's parameters gathered (in ``param_dtype``) inside the block, freed after. Collective."""
        for flat in self.flats:
            self._gather(flat, wait=True)
        try:
            yield
        finally:
            self.reshard()

    def _state_dict_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """``module.state_dict()`` holds the whole float32 parameters (gathered: collective over the group, so
        every rank of it calls ``state_dict`` together), a tied weight under each of its names."""
        whole = self.full_parameters()
        first = {id(p): name for f in self.flats for p, name in zip(f.params, f.names, strict=True)}
        for name, q in module.named_parameters(remove_duplicate=False):
            if id(q) in first and prefix + name in state_dict:
                state_dict[prefix + name] = whole[first[id(q)]]

    @torch.no_grad()
    def _load_state_dict_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        """``module.load_state_dict`` writes this rank's shard from the whole parameters given, then gathers so that
        the module's own copy succeeds (freed by the post hook)."""
        for flat in self.flats:
            low = self.rank * flat.chunk
            for p, name, offset in zip(flat.params, flat.names, flat.offsets, strict=True):
                value = state_dict.get(prefix + name)
                if value is None or tuple(value.shape) != tuple(p.shape):
                    continue  # load_state_dict reports it
                lo, hi = max(low, offset), min(low + flat.chunk, offset + p.numel())
                if lo < hi:
                    flat.shard[lo - low : hi - low].copy_(value.reshape(-1)[lo - offset : hi - offset])
            self._free(flat)
            self._gather(flat, wait=True)

    def memory_report(self) -> ShardedMemoryReport:
        """Bytes of parameters (the float32 shard), gradients (the float32 shard) and optimizer state this rank
        holds between steps, against plain data parallel with the same optimizer, and the peak of full
        parameters gathered at once (see :class:`ShardedMemoryReport`)."""
        per_element, other = 0, 0
        for _, piece, _ in self.pieces:
            scalars = 0
            for value in self.optimizer.state.get(piece, {}).values():
                if isinstance(value, torch.Tensor):
                    nbytes = value.numel() * value.element_size()
                    if value.dim() > 0 and value.numel() == piece.numel():
                        per_element += nbytes
                    else:
                        scalars += nbytes
            other = max(other, scalars)
        held = sum(piece.numel() for _, piece, _ in self.pieces) or 1
        return ShardedMemoryReport(
            stage=3,
            world_size=self.world_size,
            zero=MemoryReport(
                parameter_nbytes=self.shard_numel * 4,
                gradient_nbytes=self.flat_grad.numel() * 4,
                optimizer_state_nbytes=per_element + other,
            ),
            data_parallel=MemoryReport(
                parameter_nbytes=self._numel * 4,
                gradient_nbytes=self._numel * 4,
                optimizer_state_nbytes=per_element * self._numel // held + other,
            ),
            gathered_peak_nbytes=self.gathered_peak_nbytes,
            largest_unit_nbytes=max(sum(f.nbytes for f in fs) for fs in self._flats_of),
        )


_all_gather_single, _reduce_scatter_single = native.all_gather_single, native.reduce_scatter_single


_MAX_REDUCTIONS_IN_FLIGHT = 2


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _broadcast_algorithm(algorithm: str) -> str:
    from dtrain.parallel.data_parallel import broadcast_algorithm

    return broadcast_algorithm(algorithm)


def _param_groups(params: Iterable[nn.Parameter] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    given = list(params)
    if given and all(isinstance(g, dict) for g in given):
        out = []
        for i, g in enumerate(given):
            if "params" not in g:
                raise ValueError(f"FullyShardedDataParallel: param group {i} has no 'params'")
            members = g["params"]
            out.append({**g, "params": [members] if isinstance(members, torch.Tensor) else list(members)})
        return out
    if any(isinstance(g, dict) for g in given):
        raise ValueError("FullyShardedDataParallel: give parameters or param-group dicts, not a mix")
    return [{"params": given}]
