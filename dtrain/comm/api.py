"""The public collectives: torch.distributed-like functions that run our own algorithms.

Every call checks its arguments on this rank before a byte is sent, lays the tensors out as the schedule's
flat work buffer (see :mod:`dtrain.comm.schedule`), runs the schedule through the torch.distributed
point-to-point transport, and copies the result back where it belongs. ``algorithm="native"`` hands the call
to torch.distributed; ``algorithm="auto"`` asks the cost model for the fastest of ours.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.distributed as dist

from dtrain.comm import algorithms as registry
from dtrain.comm import arguments, native, peer, persistent
from dtrain.comm.arguments import check_algorithm, check_op, check_pair, check_root, check_tensor, group_info
from dtrain.comm.runtime import round_timeout, run_schedule
from dtrain.comm.schedule import Collective
from dtrain.comm.transport import transport_for

__all__ = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "scan",
    "barrier",
    "algorithms",
    "set_local_size",
    "SUPPORTED_DTYPES",
    "OPS",
]

OPS = arguments.OPS
SUPPORTED_DTYPES = arguments.SUPPORTED_DTYPES
set_local_size = arguments.set_local_size


def algorithms(collective: str) -> list[str]:
    """Names ``algorithm=`` accepts for ``collective``: "auto", "native", then ours."""
    return registry.accepted(collective)


# ----------------------------------------------------------------------------------------------- running


def _resolve(coll: Collective, algorithm: str, world: int, nbytes: int, device: torch.device, local_size, group):
    if algorithm != "auto":
        return algorithm
    usable = local_size if local_size and world % local_size == 0 and 1 < local_size < world else None
    kind = device.type + ("-peer" if transport_name(group, device) == "peer" else "")
    return _auto(coll, nbytes, world, kind, usable)


@lru_cache(maxsize=4096)
def _auto(coll: Collective, nbytes: int, world: int, kind: str, local_size: int | None) -> str:
    """The cost model's choice, kept: pricing every candidate costs tens of microseconds of host time a call,
    as much as a small collective itself on a GPU (the parameters are read once per process anyway)."""
    from dtrain.comm import cost

    candidates = [a for a in registry.names(coll) if local_size or not registry.needs_local_size(a)]
    return cost.choose(coll, nbytes, world, _params(kind), candidates=candidates, local_size=local_size)


@lru_cache(maxsize=4)
def _params(device_type: str):
    """The calibrated cost parameters for this device type, or the defaults (read once per process)."""
    from dtrain.comm import cost

    return cost.load_params(device=device_type)


def _pipeline(coll: Collective, algorithm: str, world: int, nbytes: int, device: torch.device) -> int:
    """Pieces for a pipelined chain (ring broadcast and reduce), from the cost model's optimum."""
    if algorithm != "ring" or coll not in (Collective.BROADCAST, Collective.REDUCE):
        return 1
    from dtrain.comm import cost

    return cost.optimal_pipeline(nbytes, world, _params(device.type).intra)


def _run(coll, algorithm, work, group, op="sum", root=None, local_size=None) -> None:
    world = dist.get_world_size(group)
    nbytes = work.numel() * work.element_size()
    pipeline = _pipeline(coll, algorithm, world, nbytes, work.device)
    schedule = registry.build(
        coll,
        algorithm,
        world,
        root=root,
        pipeline=pipeline,
        local_size=local_size if registry.needs_local_size(algorithm) else None,
    )
    if transport_name(group, work.device) == "peer":
        push = peer.push_mode(schedule, nbytes)  # push form: two banks of the buffer's size in every window
        run = peer.run_push if push else peer.run_pull
        window = peer.window_for(group, work.device, nbytes * (2 if push else 1))
        timeout = round_timeout()
        if not work.is_cuda or timeout is not None:
            run(schedule, work, window, op, timeout=timeout)
            return
        key = (schedule, push, work.data_ptr(), work.numel(), work.dtype, op, window.generation)
        persistent.run(key, lambda: run(schedule, work, window, op), work.device, owner=work)
        return
    run_schedule(schedule, work, transport_for(group), op, lanes=_lanes(schedule, work))


def transport_name(group, device: torch.device) -> str:
    """The transport our algorithms run on for ``group`` on ``device``: ``DTRAIN_COMM_TRANSPORT``, or "auto".

    "p2p": torch.distributed point-to-point messages (Gloo, NCCL), for any placement. "peer": ranks read
    each other's memory (:mod:`dtrain.comm.peer`), for a group whose ranks share one host. "auto" is "p2p"
    for now: the peer transport is the faster one on 4 H200s and trains there, but on CUDA a missing peer is
    only reported by its device barrier giving up, with an error that cannot name the round, and torch 2.11
    cannot rendezvous a group's window after a window of a subgroup that leaves some of its ranks out
    (:mod:`dtrain.comm.peer` refuses that), so it is asked for by name. A collective decision: every rank of
    the group must reach the same answer (set the variable alike on every rank).
    """
    name = os.environ.get("DTRAIN_COMM_TRANSPORT", "auto") or "auto"
    if name not in ("auto", "p2p", "peer"):
        raise ValueError(f"DTRAIN_COMM_TRANSPORT must be auto, p2p or peer, got {name!r}")
    return "p2p" if name == "auto" else name


def _lanes(schedule, work: torch.Tensor) -> int:
    """Lanes to cut a schedule into: ``DTRAIN_COMM_LANES``, else 1.

    Lanes overlap one lane's reductions with the next lane's transfers, but halve every message. On 4 H200s
    over NCCL the smaller messages fall into NCCL's slower point-to-point regime and lose more than the
    overlap wins (direct all-reduce of 1 GiB: 0.86x NCCL with one lane, 0.80x with two; docs/benchmarks.md),
    so they are off unless asked for, for links where reductions weigh more.
    """
    override = os.environ.get("DTRAIN_COMM_LANES", "")
    if override.isdigit() and int(override) > 0 and schedule.reduces:
        return int(override)
    return 1


def _flat_work(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A flat contiguous view of ``t``, or a copy when there is none; the flag says it is a copy."""
    if t.is_contiguous():
        return t.view(-1), False
    return t.contiguous().view(-1), True


def _prepare(coll: Collective, algorithm: str, group, work_numel: int, like: torch.Tensor, what: str):
    rank, world = group_info(group, what)
    local_size = check_algorithm(coll, algorithm, world, group, what)
    chosen = _resolve(coll, algorithm, world, work_numel * like.element_size(), like.device, local_size, group)
    return rank, world, chosen, local_size


# ---------------------------------------------------------------------------------------------- the API


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, algorithm: str = "auto") -> torch.Tensor:
    """Reduce ``tensor`` over the group; every rank ends with the result, in place."""
    what = "all_reduce"
    check_tensor(tensor, "tensor", what)
    check_op(op, tensor.dtype, what)
    rank, world, chosen, local = _prepare(Collective.ALL_REDUCE, algorithm, group, tensor.numel(), tensor, what)
    if chosen == "native":
        return native.all_reduce(tensor, op, group)
    work, copied = _flat_work(tensor)
    _run(Collective.ALL_REDUCE, chosen, work, group, op, local_size=local)
    if op == "avg":
        work.div_(world)
    if copied:
        tensor.copy_(work.view(tensor.shape))
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None, algorithm: str = "auto") -> torch.Tensor:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank, in place."""
    what = "broadcast"
    check_tensor(tensor, "tensor", what)
    rank, world, chosen, local = _prepare(Collective.BROADCAST, algorithm, group, tensor.numel(), tensor, what)
    check_root(src, world, "src", what)
    if chosen == "native":
        return native.broadcast(tensor, src, group)
    work, copied = _flat_work(tensor)
    _run(Collective.BROADCAST, chosen, work, group, root=src, local_size=local)
    if copied:
        tensor.copy_(work.view(tensor.shape))
    return tensor


def reduce(tensor: torch.Tensor, dst: int, op: str = "sum", group=None, algorithm: str = "auto") -> torch.Tensor:
    """Reduce ``tensor`` over the group into ``tensor`` of rank ``dst``; other ranks' tensors are untouched."""
    what = "reduce"
    check_tensor(tensor, "tensor", what)
    check_op(op, tensor.dtype, what)
    rank, world, chosen, local = _prepare(Collective.REDUCE, algorithm, group, tensor.numel(), tensor, what)
    check_root(dst, world, "dst", what)
    if chosen == "native":
        return native.reduce(tensor, dst, op, group)
    if rank == dst:
        work, copied = _flat_work(tensor)
    else:  # partial sums pass through non-root ranks: keep the caller's tensor intact
        work, copied = tensor.reshape(-1).clone(), False
    _run(Collective.REDUCE, chosen, work, group, op, root=dst, local_size=local)
    if rank == dst:
        if op == "avg":
            work.div_(world)
        if copied:
            tensor.copy_(work.view(tensor.shape))
    return tensor


def scan(tensor: torch.Tensor, op: str = "sum", group=None, algorithm: str = "auto") -> torch.Tensor:
    """Inclusive prefix reduction over ranks: rank r ends with op(x_0, ..., x_r), in place.

    ``avg`` gives the mean of the prefix, op(x_0..x_r) / (r + 1).
    """
    what = "scan"
    check_tensor(tensor, "tensor", what)
    check_op(op, tensor.dtype, what)
    rank, world, chosen, local = _prepare(Collective.SCAN, algorithm, group, tensor.numel(), tensor, what)
    if chosen == "native":
        return native.scan(tensor, op, group)
    work, copied = _flat_work(tensor)
    _run(Collective.SCAN, chosen, work, group, op, local_size=local)
    if op == "avg":
        work.div_(rank + 1)
    if copied:
        tensor.copy_(work.view(tensor.shape))
    return tensor


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, algorithm: str = "auto") -> torch.Tensor:
    """Every rank's ``input`` concatenated rank-major into every rank's ``output``."""
    what = "all_gather"
    check_tensor(input, "input", what)
    check_tensor(output, "output", what)
    rank, world = group_info(group, what)
    check_pair(output, input, world * input.numel(), what)
    rank, world, chosen, local = _prepare(Collective.ALL_GATHER, algorithm, group, output.numel(), output, what)
    if chosen == "native":
        return native.all_gather(output, input, group)
    work, copied = _flat_work(output)
    m = input.numel()
    work[rank * m : (rank + 1) * m].copy_(input.reshape(-1))
    _run(Collective.ALL_GATHER, chosen, work, group, local_size=local)
    if copied:
        output.copy_(work.view(output.shape))
    return output


def gather(output: torch.Tensor | None, input: torch.Tensor, dst: int, group=None, algorithm: str = "auto"):
    """Every rank's ``input`` concatenated rank-major into ``output`` of rank ``dst`` (None elsewhere)."""
    what = "gather"
    check_tensor(input, "input", what)
    rank, world = group_info(group, what)
    check_root(dst, world, "dst", what)
    if rank == dst:
        check_tensor(output, "output", what)
        check_pair(output, input, world * input.numel(), what)
    rank, world, chosen, local = _prepare(Collective.GATHER, algorithm, group, world * input.numel(), input, what)
    if chosen == "native":
        return native.gather(output, input, dst, group)
    m = input.numel()
    if rank == dst:
        work, copied = _flat_work(output)
    else:
        work, copied = torch.empty(world * m, dtype=input.dtype, device=input.device), False
    work[rank * m : (rank + 1) * m].copy_(input.reshape(-1))
    _run(Collective.GATHER, chosen, work, group, root=dst, local_size=local)
    if copied:
        output.copy_(work.view(output.shape))
    return output


def scatter(output: torch.Tensor, input: torch.Tensor | None, src: int, group=None, algorithm: str = "auto"):
    """Block r of ``input`` on rank ``src`` (rank-major, ``world`` equal blocks) into ``output`` of rank r."""
    what = "scatter"
    check_tensor(output, "output", what)
    rank, world = group_info(group, what)
    check_root(src, world, "src", what)
    if rank == src:
        check_tensor(input, "input", what)
        check_pair(input, output, world * output.numel(), what)
    m = output.numel()
    rank, world, chosen, local = _prepare(Collective.SCATTER, algorithm, group, world * m, output, what)
    if chosen == "native":
        return native.scatter(output, input, src, group)
    if rank == src:
        work = input.reshape(-1).clone()
    else:
        work = torch.empty(world * m, dtype=output.dtype, device=output.device)
    _run(Collective.SCATTER, chosen, work, group, root=src, local_size=local)
    output.copy_(work[rank * m : (rank + 1) * m].view(output.shape))
    return output


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None, algorithm: str = "auto"
) -> torch.Tensor:
    """Reduce ``input`` over the group; rank r keeps block r of the result in ``output``."""
    what = "reduce_scatter"
    check_tensor(input, "input", what)
    check_tensor(output, "output", what)
    check_op(op, input.dtype, what)
    rank, world = group_info(group, what)
    check_pair(input, output, world * output.numel(), what)
    coll = Collective.REDUCE_SCATTER
    rank, world, chosen, local = _prepare(coll, algorithm, group, input.numel(), input, what)
    if chosen == "native":
        return native.reduce_scatter(output, input, op, group)
    work = input.reshape(-1).clone()
    _run(coll, chosen, work, group, op, local_size=local)
    m = output.numel()
    mine = work[rank * m : (rank + 1) * m]
    if op == "avg":
        mine.div_(world)
    output.copy_(mine.view(output.shape))
    return output


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None, algorithm: str = "auto") -> torch.Tensor:
    """Block j of rank i's ``input`` lands in block i of rank j's ``output`` (equal blocks, rank-major)."""
    what = "all_to_all"
    check_tensor(input, "input", what)
    check_tensor(output, "output", what)
    rank, world = group_info(group, what)
    check_pair(output, input, input.numel(), what)
    if input.numel() % world:
        raise ValueError(f"all_to_all: input has {input.numel()} elements, not a multiple of the group size {world}")
    coll = Collective.ALL_TO_ALL
    rank, world, chosen, local = _prepare(coll, algorithm, group, input.numel(), input, what)
    if chosen == "native":
        return native.all_to_all(output, input, group)
    work = input.reshape(-1).clone()
    _run(coll, chosen, work, group, local_size=local)
    output.copy_(work.view(output.shape))
    return output


def barrier(group=None) -> None:
    """Return only once every rank of the group has entered the barrier (dissemination algorithm)."""
    rank, world = group_info(group, "barrier")
    token = torch.ones(1, dtype=torch.int32, device=_barrier_device(group))
    _run(Collective.BARRIER, "dissemination", token, group, "max")
    if token.is_cuda:
        torch.cuda.current_stream().synchronize()


def _barrier_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
