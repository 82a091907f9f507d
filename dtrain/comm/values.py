"""Small values between the ranks of a torch.distributed group, as JSON, never pickled.

``torch.distributed``'s object collectives (``all_gather_object``, ``broadcast_object_list``) pickle what they
send and unpickle what they receive, so a peer's bytes would run as code. Here a value travels as its UTF-8 JSON
text in a ``uint8`` tensor (the lengths first, as ``int64``), and what arrives is parsed with :func:`json.loads`
and handed to the caller's ``check``, which turns it back into the type it expects or raises ``ValueError``.
Only what JSON holds crosses: dicts with string keys, lists, strings, numbers, booleans and None (a tuple
arrives as a list).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["MAX_BYTES", "all_gather_json", "broadcast_json"]

T = TypeVar("T")

#: The most bytes a value may take: a length beyond it (or below 0) is refused before anything is allocated.
MAX_BYTES = 1 << 26


def _checked(n: int, rank: int) -> int:
    if not 0 <= n <= MAX_BYTES:
        raise ValueError(f"rank {rank} announced a value of {n} bytes; a value takes 0 to {MAX_BYTES} bytes")
    return n


def _device(group) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU for NCCL, else the host."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(value: Any) -> bytes:
    try:
        data = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a value sent between ranks must be JSON: {exc}") from None
    if len(data) > MAX_BYTES:
        raise ValueError(f"a value sent between ranks takes at most {MAX_BYTES} bytes, this one {len(data)}")
    return data


def _decode(data: bytes, rank: int, check: Callable[[Any], T]) -> T:
    try:
        value = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"rank {rank} sent a value that is not JSON: {exc}") from None
    try:
        return check(value)
    except ValueError as exc:
        raise ValueError(f"rank {rank} sent {exc}") from None


def all_gather_json(value: Any, check: Callable[[Any], T], group=None) -> list[T]:
    """Every rank's ``value``, in group rank order, each passed through ``check`` (a collective: every rank of
    ``group`` calls it)."""
    device, data = _device(group), _encode(value)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [_checked(int(s.item()), rank) for rank, s in enumerate(sizes)]  # every rank sees the same
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    received = [t[:n].cpu().numpy().tobytes() for t, n in zip(every, lengths, strict=True)]
    return [_decode(data, rank, check) for rank, data in enumerate(received)]


def broadcast_json(value: Any, check: Callable[[Any], T], src: int = 0, group=None) -> T:
    """Global rank ``src``'s ``value`` on every rank of ``group``, passed through ``check`` (``value`` is read on
    ``src`` only; a collective: every rank of ``group`` calls it)."""
    device = _device(group)
    data = _encode(value) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    n = _checked(int(size.item()), src)
    payload = torch.zeros(n, dtype=torch.uint8, device=device)
    if dist.get_rank() == src and n:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if n:
        dist.broadcast(payload, src, group=group)
    return _decode(payload.cpu().numpy().tobytes(), src, check)
