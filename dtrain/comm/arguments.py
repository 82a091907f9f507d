"""Checks every public collective makes on this rank before a byte is sent, and the node size per group.

Each check raises ``ValueError`` that names the call, the argument, the value and what would be right.
"""

from __future__ import annotations

import contextlib
import operator
import os

import torch
import torch.distributed as dist

from dtrain.comm.ir import algorithms as registry
from dtrain.comm.ir.schedule import Collective
from dtrain.comm.mpi.group import is_mpi_group
from dtrain.comm.p2p.runtime import REDUCE_OPS
from dtrain.comm.state import DEFAULT_LOCAL_SIZE, changed, find_state, group_state

__all__ = [
    "SUPPORTED_DTYPES",
    "OPS",
    "set_local_size",
    "group_info",
    "check_tensor",
    "check_op",
    "op_name",
    "check_root",
    "check_pair",
    "check_written",
    "check_overlap",
    "check_algorithm",
    "writable",
]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8,
                    torch.uint8, torch.bool)  # fmt: skip
OPS = tuple(REDUCE_OPS)


def set_local_size(local_size: int | None, group: dist.ProcessGroup | None = None) -> None:
    """Declare how many consecutive ranks of ``group`` share a node (for hierarchical algorithms).

    For the world group it defaults to torchrun's ``LOCAL_WORLD_SIZE``; ``None`` forgets the setting.
    """
    if local_size is not None and (not isinstance(local_size, int) or local_size < 1):
        raise ValueError(f"local_size must be a positive int or None, got {local_size!r}")
    key = _group_key(group)
    if key is None:  # the default group, which may not exist yet: a process-wide setting
        DEFAULT_LOCAL_SIZE[0] = local_size
    else:
        group_state(key).local_size = local_size
    changed()


def _group_key(group: dist.ProcessGroup | None) -> object:
    return None if group is None or group is dist.group.WORLD else group


def group_info(group: dist.ProcessGroup | None, what: str) -> tuple[int, int]:
    """This rank's rank in ``group`` and the group's size (a process group, None for the default one, or an
    :class:`~dtrain.comm.mpi.MPIGroup`)."""
    if is_mpi_group(group):
        if group.comm is None:
            raise ValueError(f"{what}: this MPIGroup was freed")
        return group.rank, group.size
    if not dist.is_initialized():
        raise ValueError(f"{what}: torch.distributed is not initialized (call init_process_group first)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of the group")
    return rank, dist.get_world_size(group)


def check_tensor(t: object, name: str, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        known = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"{what}: {name} has dtype {t.dtype}; supported: {known}")
    return t


_TORCH_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MAX": "max", "MIN": "min"}


def op_name(op: object) -> object:
    """``op`` as this package names it: torch.distributed's ``ReduceOp.SUM``, ``AVG``, ``PRODUCT``, ``MAX`` and
    ``MIN`` (or their ``RedOpType`` members) become "sum", "avg", "prod", "max" and "min"; anything else is
    returned as it is, for :func:`check_op` to judge."""
    if isinstance(op, str):
        return op
    if isinstance(op, dist.ReduceOp):  # a ReduceOp instance, as ReduceOp.SUM is where pybind makes it one
        op = getattr(op, "op", op)
    name = getattr(op, "name", None)
    if isinstance(op, dist.ReduceOp.RedOpType) and name in _TORCH_OPS:
        return _TORCH_OPS[name]
    return op


def check_op(op: str, dtype: torch.dtype, what: str) -> None:
    if op not in REDUCE_OPS:
        name = getattr(op, "name", None)
        shown = f"ReduceOp.{name}" if isinstance(op, dist.ReduceOp.RedOpType) else repr(op)
        known = f"{', '.join(OPS)} (or ReduceOp.SUM, AVG, PRODUCT, MAX, MIN)"
        raise ValueError(f"{what}: unknown op {shown}; known: {known}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"{what}: op 'avg' needs a floating dtype, got {dtype}")


def check_root(root: int, world: int, name: str, what: str) -> int:
    """``root`` as the int it names: an int, or any integer that says so (a NumPy integer, a one-element integer
    tensor), as torch.distributed takes them; never a bool, a float or text."""
    try:
        index = operator.index(root) if not isinstance(root, bool) else None
    except TypeError:
        index = None
    if index is None:
        raise ValueError(f"{what}: {name}={root!r} is not a rank of the group: an int in 0..{world - 1}")
    if not 0 <= index < world:
        raise ValueError(f"{what}: {name}={root!r} is outside the group's ranks 0..{world - 1}")
    return index


def check_pair(
    out: torch.Tensor, inp: torch.Tensor, out_numel: int, what: str, names: tuple[str, str] = ("output", "input")
) -> None:
    """``out`` and ``inp`` share a dtype and a device, and ``out`` has ``out_numel`` elements; ``names``: what the
    call calls them (the scatter and the reduce-scatter check their input's size against their output's)."""
    first, second = names
    if out.dtype != inp.dtype:
        raise ValueError(f"{what}: {first} dtype {out.dtype} differs from {second} dtype {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"{what}: {first} is on {out.device} but {second} is on {inp.device}")
    if out.numel() != out_numel:
        raise ValueError(f"{what}: {first} has {out.numel()} elements, expected {out_numel}")


def check_written(t: torch.Tensor, name: str, what: str) -> None:
    """``t``, which the call writes, has no two elements in one place: a stride of 0 over more than one element (an
    expanded view) would take several results in one element; refused before a byte is sent, where a copy into it
    after the exchange would fail. Other layouts that overlap themselves are left to torch, as its own ``copy_``
    leaves them (``as_strided`` views: telling takes more than the strides)."""
    if not t.is_contiguous() and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride(), strict=True)):
        raise ValueError(
            f"{what}: {name} has elements that share memory (a stride of 0 over {tuple(t.shape)}, an expanded view); "
            "the result needs a tensor with memory of its own (clone() it)"
        )


def check_overlap(
    whole: torch.Tensor, part: torch.Tensor, block: int, what: str, names: tuple[str, str] = ("output", "input")
) -> bool:
    """Whether ``part`` is block ``block`` of ``whole`` (blocks of ``part``'s size) in memory, an in-place call: an
    all-gather's or a gather's input in its output, a reduce-scatter's or a scatter's output in its input, an
    all-to-all's output its input (block 0 of the same size). ``ValueError`` where the two overlap otherwise, as
    the exchange would read what it has already written. ``names``: what the call calls ``whole`` and ``part``.
    Decided where both are contiguous, from their addresses; overlaps between other layouts are left to the copies
    the calls make of such tensors (torch's own ``copy_`` cannot tell them apart either)."""
    if not (whole.is_contiguous() and part.is_contiguous()) or whole.numel() == 0 or part.numel() == 0:
        return False
    size = whole.element_size()
    start, end = whole.data_ptr(), whole.data_ptr() + whole.numel() * size
    at = part.data_ptr()
    if at >= end or at + part.numel() * size <= start:
        return False
    if at == start + block * part.numel() * size:
        return True
    first, second = names
    alias = f"{first} itself" if whole.numel() == part.numel() else f"{first}'s block {block}"
    raise ValueError(
        f"{what}: {first} and {second} overlap in memory; they may share it only in an in-place call, {second} being "
        f"{alias} (on this rank)"
    )


def writable(*tensors) -> contextlib.AbstractContextManager:
    """Where a call writes into its tensors in place: a context in which autograd lets it, as torch.distributed's
    own calls write such tensors (in C++, where autograd does not look). ``torch.inference_mode()`` where one is an
    inference tensor and inference mode is off; ``torch.no_grad()`` where one requires grad and grad mode is on (a
    parameter, or a view of one: an in-place write would raise, after the exchange began, and a copy from an input
    that requires grad would give the output autograd history); else nothing."""
    grad = inference = False
    for t in tensors:
        if isinstance(t, torch.Tensor):
            grad = grad or t.requires_grad
            inference = inference or t.is_inference()
    if inference and not torch.is_inference_mode_enabled():
        return torch.inference_mode()
    if grad and torch.is_grad_enabled():
        return torch.no_grad()
    return contextlib.nullcontext()


def check_algorithm(coll: Collective, algorithm: str, world: int, group, what: str) -> int | None:
    """The group's node size, once ``algorithm`` is known for ``coll`` (one of ours may name its transport:
    ``"ring@peer"``, ``"ring@p2p"``)."""
    known = registry.accepted(coll)
    name, at, via = str(algorithm).partition("@")
    if at and (name in ("auto", "native") or via not in ("p2p", "peer")):
        raise ValueError(
            f"{what}: unknown algorithm {algorithm!r}; only ours may name a transport, as ALGORITHM@p2p or @peer"
        )
    algorithm = name
    if algorithm not in known:
        raise ValueError(f"{what}: unknown algorithm {algorithm!r}; known: {', '.join(known)}")
    local_size = _local_size(group, world)
    if registry.needs_local_size(algorithm) and (local_size is None or world % local_size):
        raise ValueError(
            f"{what}: algorithm {algorithm!r} needs the node size: set LOCAL_WORLD_SIZE (torchrun does) "
            f"or call comm.set_local_size(n, group) with n dividing the group size {world}; got {local_size}"
        )
    return local_size


def _local_size(group, world: int) -> int | None:
    key = _group_key(group)
    state = None if key is None else find_state(key)
    declared = DEFAULT_LOCAL_SIZE[0] if key is None else state.local_size if state is not None else None
    if declared is not None:
        return declared
    if is_mpi_group(key):
        return key.local_size
    if key is not None and _spans_world_in_order(group, world):
        # A group of every rank in world order (a data-parallel group of a 1-D layout) has the world's nodes.
        return _local_size(None, world)
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if key is None and env and env.isdigit() and int(env) > 0:
        return int(env)
    return None


def _spans_world_in_order(group, world: int) -> bool:
    return world == dist.get_world_size() and dist.get_process_group_ranks(group) == list(range(world))
