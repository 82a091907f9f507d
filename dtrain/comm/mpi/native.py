"""``algorithm="native"`` on an :class:`~dtrain.comm.mpi.MPIGroup`: MPI's own collectives, buffer-based.

MPI_Allreduce, MPI_Bcast, MPI_Reduce, MPI_Allgather, MPI_Reduce_scatter_block, MPI_Alltoall, MPI_Gather,
MPI_Scatter, MPI_Scan and MPI_Barrier on the group's communicator, with the tensors' memory as numpy views (no
copy, nothing pickled). Data movement carries bytes, so every dtype moves alike; reductions carry typed
elements (float, double, int32, int64), and float16 / bfloat16, which MPI cannot reduce, are reduced in float32
and rounded back. ``avg`` is a sum divided afterwards (by the group size; by ``rank + 1`` for scan).
"""

from __future__ import annotations

import torch

from dtrain.comm.mpi.group import MPIGroup, mpi
from dtrain.comm.mpi.transport import byte_buffer, dense

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
]

_WIDENED = (torch.float16, torch.bfloat16)


def _op(op: str, dtype: torch.dtype):
    """MPI's reduction for ``op`` on tensors of ``dtype``; on booleans (reduced as 0/1 bytes) as torch computes
    it: a sum is true where any is (the maximum), a product where all are (the minimum)."""
    MPI = mpi()
    if dtype == torch.bool:
        op = {"sum": "max", "prod": "min"}.get(op, op)
    return {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]


def _typed(t: torch.Tensor):
    """A contiguous CPU tensor as a typed mpi4py buffer (float32 / float64 / int8 / uint8 / int32 / int64)."""
    MPI = mpi()
    kinds = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T}
    kinds |= {torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T}
    return [dense(t).numpy(), kinds[t.dtype]]


def _contiguous(tensor: torch.Tensor, fn) -> torch.Tensor:
    """Run ``fn`` on a contiguous stand-in for ``tensor`` and copy back if one was needed."""
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    fn(work)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def _reducible(fn, *tensors: torch.Tensor) -> None:
    """Call ``fn`` on tensors MPI can reduce: float16 / bfloat16 widened to float32, booleans as 0/1 bytes (whose
    reduction :func:`_bool_op` gives), and narrowed back into the originals (the last tensor is the result)."""
    if tensors[0].dtype not in (*_WIDENED, torch.bool):
        fn(*tensors)
        return
    wide = [t.to(torch.uint8 if t.dtype == torch.bool else torch.float32) for t in tensors]
    fn(*wide)
    tensors[-1].copy_(wide[-1])


def _alone(input: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``input`` contiguous and not sharing memory with ``output`` (MPI forbids aliased buffers)."""
    flat = input.contiguous()
    if flat.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        flat = flat.clone()
    return flat


def all_reduce(tensor: torch.Tensor, op: str, group: MPIGroup) -> torch.Tensor:
    def run(t: torch.Tensor) -> None:
        _reducible(lambda x: group.comm.Allreduce(mpi().IN_PLACE, _typed(x), _op(op, tensor.dtype)), t)
        if op == "avg":
            t.div_(group.size)

    return _contiguous(tensor, run)


def broadcast(tensor: torch.Tensor, src: int, group: MPIGroup) -> torch.Tensor:
    return _contiguous(tensor, lambda t: group.comm.Bcast(byte_buffer(t), root=src))


def reduce(tensor: torch.Tensor, dst: int, op: str, group: MPIGroup) -> torch.Tensor:
    if group.rank != dst:  # sends only: the caller's tensor stays as it was
        _reducible(lambda x: group.comm.Reduce(_typed(x), None, _op(op, tensor.dtype), root=dst), tensor.contiguous())
        return tensor

    def run(t: torch.Tensor) -> None:
        _reducible(lambda x: group.comm.Reduce(mpi().IN_PLACE, _typed(x), _op(op, tensor.dtype), root=dst), t)
        if op == "avg":
            t.div_(group.size)

    return _contiguous(tensor, run)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: MPIGroup) -> torch.Tensor:
    mine = _alone(input, output)
    return _contiguous(output, lambda o: group.comm.Allgather(byte_buffer(mine), byte_buffer(o)))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group: MPIGroup) -> torch.Tensor:
    source = _alone(input, output)

    def run(o: torch.Tensor) -> None:
        _reducible(lambda i, x: group.comm.Reduce_scatter_block(_typed(i), _typed(x), _op(op, output.dtype)), source, o)
        if op == "avg":
            o.div_(group.size)

    return _contiguous(output, run)


def gather(output: torch.Tensor | None, input: torch.Tensor, dst: int, group: MPIGroup):
    if group.rank != dst:
        group.comm.Gather(byte_buffer(input.contiguous()), None, root=dst)
        return output
    mine = _alone(input, output)
    return _contiguous(output, lambda o: group.comm.Gather(byte_buffer(mine), byte_buffer(o), root=dst))


def scatter(output: torch.Tensor, input: torch.Tensor | None, src: int, group: MPIGroup) -> torch.Tensor:
    if group.rank != src:
        return _contiguous(output, lambda o: group.comm.Scatter(None, byte_buffer(o), root=src))
    blocks = _alone(input, output)
    return _contiguous(output, lambda o: group.comm.Scatter(byte_buffer(blocks), byte_buffer(o), root=src))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: MPIGroup) -> torch.Tensor:
    source = _alone(input, output)
    return _contiguous(output, lambda o: group.comm.Alltoall(byte_buffer(source), byte_buffer(o)))


def scan(tensor: torch.Tensor, op: str, group: MPIGroup) -> torch.Tensor:
    def run(t: torch.Tensor) -> None:
        _reducible(lambda x: group.comm.Scan(mpi().IN_PLACE, _typed(x), _op(op, tensor.dtype)), t)
        if op == "avg":
            t.div_(group.rank + 1)

    return _contiguous(tensor, run)


def barrier(group: MPIGroup) -> None:
    group.comm.Barrier()
