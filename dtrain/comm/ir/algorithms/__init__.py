"""Collective algorithms: each family is a file of pure functions that build a :class:`Schedule`.

``build(collective, algorithm, world_size, ...)`` looks a builder up in the registry (:mod:`.registry`) that the
family modules fill with :func:`register`; ``names(collective)`` lists what is there. Importing this package
loads every family. The public function ``dtrain.comm.algorithms(collective)`` answers with :func:`accepted`.
"""

from __future__ import annotations

from dtrain.comm.ir.algorithms.registry import Builder, accepted, build, names, needs_local_size, register

__all__ = ["Builder", "register", "build", "names", "accepted", "needs_local_size"]


def _load_families() -> None:
    from dtrain.comm.ir.algorithms import (  # noqa: F401  (each module registers its builders on import)
        direct,
        halving_doubling,
        hierarchical,
        recursive_doubling,
        ring,
        scan_barrier,
        star,
        tree,
    )


_load_families()
