"""An MPI communicator as a ``dtrain.comm`` group (mpi4py is imported only when a group is made).

:class:`MPIGroup` duplicates the communicator it is given (``MPI_Comm_dup``, as a library should, so that our
messages never match the application's), knows its ranks in ``MPI_COMM_WORLD``, its node size (ranks that share
memory, ``MPI_Comm_split_type`` with ``MPI_COMM_TYPE_SHARED``) and the longest any message may wait.
"""

from __future__ import annotations

import math
from datetime import timedelta
from functools import lru_cache

__all__ = ["MPIGroup", "is_mpi_group", "world", "mpi"]

#: How long a message may wait when neither the group nor ``DTRAIN_COMM_TIMEOUT`` says (torch's Gloo default).
DEFAULT_TIMEOUT = timedelta(minutes=30)


def mpi():
    """mpi4py's ``MPI`` module; ``ValueError`` saying how to install it when it is missing."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ValueError(
            f"dtrain.comm.mpi needs mpi4py and an MPI library: pip install 'dtrain[mpi]' ({err})"
        ) from None
    return MPI


class MPIGroup:
    """A group of MPI processes for ``dtrain.comm``: ``comm.all_reduce(t, group=MPIGroup())``.

    ``comm``: an mpi4py intracommunicator (default ``MPI.COMM_WORLD``), duplicated here, so making a group is a
    collective call of its ranks. ``timeout``: the longest a message of our algorithms may wait before the call
    raises :class:`~dtrain.comm.CommTimeoutError` naming the peer (``DTRAIN_COMM_TIMEOUT``, when set, takes
    precedence). ``local_size``: ranks per node for the hierarchical algorithms; by default the number of
    ranks that share memory, where every node has as many and they are consecutive, else None.
    """

    def __init__(self, comm=None, *, timeout: timedelta | float = DEFAULT_TIMEOUT, local_size: int | None = None):
        MPI = mpi()
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"MPIGroup: timeout must be a positive number of seconds, got {timeout!r}")
        if local_size is not None and (not isinstance(local_size, int) or local_size < 1):
            raise ValueError(f"MPIGroup: local_size must be a positive int or None, got {local_size!r}")
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Intracomm):
            raise ValueError(f"MPIGroup: comm must be an mpi4py Intracomm, got {type(base).__name__}")
        self.comm = base.Dup()
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.timeout = timedelta(seconds=seconds)
        mine = list(range(self.size))
        self._global: list[int] = list(self.comm.Get_group().Translate_ranks(mine, MPI.COMM_WORLD.Get_group()))
        self.local_size: int | None = local_size if local_size is not None else self._node_size()

    def global_rank(self, group_rank: int) -> int:
        """The rank in ``MPI_COMM_WORLD`` of this group's rank ``group_rank``."""
        return self._global[group_rank]

    def _node_size(self) -> int | None:
        import numpy as np

        MPI = mpi()
        shared = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            mine = np.array([shared.Get_size(), shared.Get_rank()], dtype=np.int64)
        finally:
            shared.Free()
        every = np.empty(2 * self.size, dtype=np.int64)
        self.comm.Allgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
        sizes, local_ranks = every[0::2], every[1::2]
        n = int(sizes[0])
        consecutive = all(int(local_ranks[r]) == r % n for r in range(self.size))
        return n if (sizes == n).all() and self.size % n == 0 and consecutive else None

    def free(self) -> None:
        """Free the duplicated communicator (a collective call); the group is unusable afterwards."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def __repr__(self) -> str:
        return f"MPIGroup(rank={self.rank}, size={self.size}, local_size={self.local_size})"


def is_mpi_group(group) -> bool:
    """Whether ``group`` is an :class:`MPIGroup` (never imports mpi4py)."""
    return isinstance(group, MPIGroup)


@lru_cache(maxsize=1)
def world() -> MPIGroup:
    """One :class:`MPIGroup` over ``MPI_COMM_WORLD`` per process, made on first use (collectively)."""
    return MPIGroup()
