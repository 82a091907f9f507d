"""``algorithm="native"``: the same collectives handed to torch.distributed (NCCL, Gloo, MPI).

torch.distributed has no scan and Gloo has no ``avg``: those are built here from what the backend has
(an all-gather then a local prefix; a sum then a division), so "native" accepts every call the API does.

A group's *wide* communicator (:func:`wide_group`) runs the same NCCL collectives on more CTAs than NCCL gives
itself: what ``auto`` picks (``native_wide``, :mod:`dtrain.comm.cost.rules`) for the large sizes where that
measured faster.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.comm.arguments import writable

__all__ = [
    "WIDE_CTAS",
    "wide_group",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "scan",
    "divide",
]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


#: CTAs of a wide communicator's collectives (NCCL's ``ncclConfig_t`` ``minCTAs`` and ``maxCTAs``; NCCL keeps at
#: most its ``MAXCHANNELS``). On 4 and 2 H100s over NVSwitch (NCCL 2.28, NVLink multicast off), 64 ran all-reduce,
#: all-gather and reduce-scatter from 16 MiB to 1 GiB at 1.02-1.26x the default communicator's speed, 32 at
#: 1.01-1.12x and 16 at 0.87-0.95x (benchmarks/results/probe-nccl-ctas-h100x{4,4-run1,2}.txt; 16 in the run1
#: launch, on 4).
WIDE_CTAS = 64

_WIDE: dict[object, object] = {}  # a group -> its wide communicator, or None where none can be made


def wide_group(group):
    """``group``'s wide communicator: the same ranks, NCCL's collectives on :data:`WIDE_CTAS` CTAs, made at the
    first call that asks (collective over ``group``: every rank asks at the same call, as ``auto``'s agreed choices
    do) and kept. None where none can be made, and the caller runs on ``group``: not an NCCL group, inside a CUDA
    graph capture (made by the next eager call), or a subgroup where torch cannot split one (``split_group`` needs
    the default group bound to a device, ``init_process_group(device_id=...)``; the whole world needs no split).

    The extra communicator holds NCCL's own buffers for its channels on every GPU (from NCCL's first collective on
    it, per algorithm), and its collectives take more SMs from whatever runs beside them: ``DataParallel``'s
    reductions under backward never use it."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    if pg in _WIDE:
        return _WIDE[pg]
    if dist.get_backend(pg) != "nccl":
        _WIDE[pg] = None
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.config.min_ctas = WIDE_CTAS
    options.config.max_ctas = WIDE_CTAS
    ranks = dist.get_process_group_ranks(pg)
    default = c10d._get_default_group()
    wide = None
    if getattr(default, "bound_device_id", None) is not None and hasattr(dist, "split_group"):
        wide = dist.split_group(pg, [ranks], pg_options=options, group_desc="dtrain_wide")
    elif pg is default:
        wide = dist.new_group(ranks, pg_options=options, group_desc="dtrain_wide")
    _WIDE[pg] = wide
    return wide


def _in_place(tensor: torch.Tensor, fn) -> torch.Tensor:
    """Run ``fn`` on a contiguous stand-in for ``tensor`` and copy back if one was needed."""
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    fn(work)
    if work is not tensor:
        with writable(tensor):
            tensor.copy_(work)
    return tensor


def divide(tensor: torch.Tensor, n: int) -> None:
    """``tensor /= n`` in place (an average, after the sum), also where autograd guards ``tensor`` against writes
    in place (it requires grad, or is an inference tensor outside inference mode), as the collective before it
    wrote it: see :func:`dtrain.comm.arguments.writable`."""
    if tensor.requires_grad or tensor.is_inference():
        with writable(tensor):
            tensor.div_(n)
    else:
        tensor.div_(n)


def all_reduce(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    def run(t: torch.Tensor) -> None:
        dist.all_reduce(t, _OPS[op], group=group)
        if op == "avg":
            divide(t, dist.get_world_size(group))

    return _in_place(tensor, run)


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    return _in_place(tensor, lambda t: dist.broadcast(t, _global(group, src), group=group))


def keeps_inputs(tensor: torch.Tensor, group) -> bool:
    """Whether the backend's reduce leaves a non-root rank's tensor as it was, so that it may run on the caller's
    tensor itself: NCCL's does (``ncclReduce`` reads the send buffer and writes the receive buffer on the root
    alone); Gloo's and MPI's may use it as their scratch."""
    from torch.distributed import distributed_c10d as c10d

    if not tensor.is_cuda or not tensor.is_contiguous():  # a stand-in would be copied back over the caller's
        return False
    pg = group if group is not None else c10d._get_default_group()
    try:  # the backend this group runs CUDA tensors on, however the group was made
        return type(pg._get_backend(tensor.device)).__name__ == "ProcessGroupNCCL"
    except (AttributeError, RuntimeError):
        backend = str(dist.get_backend(pg))
        return backend == "nccl" or "cuda:nccl" in backend


def reduce(tensor: torch.Tensor, dst: int, op: str, group) -> torch.Tensor:
    rank = dist.get_rank(group)
    work = tensor.contiguous().clone() if rank != dst and not keeps_inputs(tensor, group) else tensor

    def run(t: torch.Tensor) -> None:
        dist.reduce(t, _global(group, dst), _OPS[op], group=group)
        if op == "avg" and rank == dst:
            divide(t, dist.get_world_size(group))

    _in_place(work, run)
    return tensor


#: torch.distributed's single-tensor all-gather and reduce-scatter (``all_gather_single`` /
#: ``reduce_scatter_single``; ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, deprecated since, in torch
#: before 2.13)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(output: torch.Tensor, input: torch.Tensor, group) -> torch.Tensor:
    return _in_place(output, lambda o: all_gather_single(o.view(-1), input.contiguous().view(-1), group=group))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group) -> torch.Tensor:
    def run(o: torch.Tensor) -> None:
        reduce_scatter_single(o.view(-1), input.contiguous().view(-1), _OPS[op], group=group)
        if op == "avg":
            divide(o, dist.get_world_size(group))

    return _in_place(output, run)


def gather(output: torch.Tensor | None, input: torch.Tensor, dst: int, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = input.contiguous().view(-1)
    parts = [torch.empty_like(flat) for _ in range(world)] if rank == dst else None
    dist.gather(flat, parts, dst=_global(group, dst), group=group)
    if rank == dst:
        with writable(output):
            output.copy_(torch.cat(parts).view(output.shape))
    return output


def scatter(output: torch.Tensor, input: torch.Tensor | None, src: int, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = list(input.contiguous().view(-1).chunk(world)) if rank == src else None
    return _in_place(output, lambda o: dist.scatter(o.view(-1), parts, src=_global(group, src), group=group))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group) -> torch.Tensor:
    # in place (output is input), Gloo's and NCCL's own would read blocks they have already written: a copy
    flat = input.clone().view(-1) if output.data_ptr() == input.data_ptr() else input.contiguous().view(-1)
    return _in_place(output, lambda o: dist.all_to_all_single(o.view(-1), flat, group=group))


def scan(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = tensor.contiguous().view(-1)
    everyone = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather_single(everyone, flat, group=group)
    rows = everyone.view(world, -1)[: rank + 1]
    if op in ("sum", "avg"):
        result = rows.sum(0, dtype=flat.dtype)
    elif op == "prod":
        result = rows.prod(0, dtype=flat.dtype)
    elif op == "max":
        result = rows.amax(0)
    else:
        result = rows.amin(0)
    if op == "avg":
        result = result / (rank + 1)
    with writable(tensor):
        tensor.copy_(result.view(tensor.shape))
    return tensor


def _global(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def direct(coll: str, group, op: str = "sum", root: int = 0):
    """A function ``run(output, input) -> bool`` that makes the backend's own call for ``coll`` (all_reduce, whose
    tensor is ``output``; all_gather, reduce_scatter, all_to_all; broadcast from group rank ``root``, and reduce into
    it, in place in ``output``: a reduce only where :func:`keeps_inputs` holds) straight through the process
    group's C++ binding, the call torch.distributed's function makes after its checks; None where this torch has
    no such binding. ``run`` answers False, having made no call, inside torch's coalescing manager (where
    torch.distributed queues calls instead).

    What it skips: torch.distributed's per-call Python (the argument and membership checks, the complex-number
    views, the logging and deprecation wrappers), which a group's first call through :mod:`dtrain.comm` has done
    for these arguments (:func:`dtrain.comm.api._keep` keeps the function for calls with the same group,
    collective, sizes, dtypes and device). On H100 hosts that Python is 15-25 us of a small collective's
    host-bound 45-60 us (benchmarks/results/defaults-h100x2.jsonl: ``torch`` against ``native``)."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    coalescing = c10d._world.pg_coalesce_state

    def binding(*names: str):
        return next((getattr(pg, n) for n in names if hasattr(pg, n)), None)

    def options(kind, **fields):
        opts = kind()
        for name, value in fields.items():
            setattr(opts, name, value)
        if hasattr(opts, "asyncOp"):  # a call torch would make with async_op=False
            opts.asyncOp = False
        return opts

    world = pg.size()
    average = op == "avg" and (coll in ("all_reduce", "reduce_scatter") or (coll == "reduce" and pg.rank() == root))
    if coll == "all_reduce":
        call, opts = binding("allreduce"), options(c10d.AllreduceOptions, reduceOp=_OPS[op])

        def issue(o, i):
            return call([o], opts)
    elif coll == "broadcast":
        call, opts = binding("broadcast"), options(c10d.BroadcastOptions, rootRank=root, rootTensor=0)

        def issue(o, i):
            return call([o], opts)
    elif coll == "reduce":
        call = binding("reduce")
        opts = options(c10d.ReduceOptions, reduceOp=_OPS[op], rootRank=root, rootTensor=0)

        def issue(o, i):
            return call([o], opts)
    elif coll == "all_gather":
        call, opts = binding("all_gather_single", "_allgather_base"), options(c10d.AllgatherOptions)

        def issue(o, i):
            return call(o, i, opts)
    elif coll == "reduce_scatter":
        call = binding("reduce_scatter_single", "_reduce_scatter_base")
        opts = options(c10d.ReduceScatterOptions, reduceOp=_OPS[op])

        def issue(o, i):
            return call(o, i, opts)
    elif coll == "all_to_all":
        call, opts = binding("all_to_all_single", "alltoall_base"), options(c10d.AllToAllOptions)

        def issue(o, i):
            return call(o, i, [], [], opts)
    else:
        return None
    if call is None:
        return None

    flat = coll in ("all_gather", "reduce_scatter", "all_to_all")  # the bindings take flat tensors (Gloo's does)

    def run(output: torch.Tensor, input: torch.Tensor) -> bool:
        if coalescing and pg in coalescing:
            return False
        if flat and (output.dim() != 1 or input.dim() != 1):
            work = issue(output.view(-1), input.view(-1))
        else:
            work = issue(output, input)
        if work is not None:
            work.wait()
        if average:
            divide(output, world)
        return True

    return run
