"""The registry of collective algorithms: the family modules fill it with :func:`register`; :func:`build`
looks a builder up and :func:`names` lists what is there."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Protocol

from dtrain.comm.ir.schedule import Collective, Schedule

__all__ = ["Builder", "register", "build", "names", "accepted", "needs_local_size"]


class Builder(Protocol):
    def __call__(self, world_size: int, *, root: int | None, pipeline: int, local_size: int | None) -> Schedule: ...


_REGISTRY: dict[tuple[Collective, str], Builder] = {}
_NEEDS_LOCAL_SIZE: set[str] = set()


def register(collective: Collective, name: str, *, needs_local_size: bool = False) -> Callable[[Builder], Builder]:
    """Decorator: record ``fn`` as the ``name`` algorithm for ``collective``."""

    def wrap(fn: Builder) -> Builder:
        key = (collective, name)
        if key in _REGISTRY:
            raise ValueError(f"algorithm {name!r} for {collective.value} is registered twice")
        _REGISTRY[key] = fn
        if needs_local_size:
            _NEEDS_LOCAL_SIZE.add(name)
        return fn

    return wrap


def names(collective: Collective) -> list[str]:
    """Our own algorithm names for ``collective`` (without "auto" and "native"), in registration order."""
    return [name for (coll, name) in _REGISTRY if coll == collective]


def accepted(collective: str | Collective) -> list[str]:
    """Names that ``algorithm=`` accepts for ``collective``: "auto", "native", then ours."""
    try:
        coll = Collective(collective)
    except ValueError:
        known = ", ".join(c.value for c in Collective)
        raise ValueError(f"unknown collective {collective!r}; known: {known}") from None
    return ["auto", "native", *names(coll)]


def needs_local_size(algorithm: str) -> bool:
    return algorithm in _NEEDS_LOCAL_SIZE


@lru_cache(maxsize=4096)
def build(
    collective: Collective,
    algorithm: str,
    world_size: int,
    *,
    root: int | None = None,
    pipeline: int = 1,
    local_size: int | None = None,
) -> Schedule:
    """The schedule of ``algorithm`` for ``collective`` on ``world_size`` ranks (cached: schedules are immutable).

    ``pipeline`` cuts each block into that many chunks for the algorithms that pipeline (chain broadcast and
    reduce, ring); ``local_size`` is the number of ranks a node holds, for hierarchical algorithms.
    """
    try:
        builder = _REGISTRY[(collective, algorithm)]
    except KeyError:
        known = ", ".join(names(collective)) or "none"
        raise ValueError(f"no algorithm {algorithm!r} for {collective.value}; known: {known}") from None
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if pipeline < 1:
        raise ValueError(f"pipeline must be >= 1, got {pipeline}")
    return builder(world_size, root=root, pipeline=pipeline, local_size=local_size)
