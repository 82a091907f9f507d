"""MPI as a transport for ``dtrain.comm``: pass an :class:`MPIGroup` as ``group=`` to any collective.

Our schedules then run over MPI point-to-point messages (:mod:`dtrain.comm.mpi.transport`) and
``algorithm="native"`` is MPI's own collective on the group's communicator (:mod:`dtrain.comm.mpi.native`).
Needs mpi4py (the ``mpi`` extra) and a launcher that starts the ranks, ``mpirun``. CPU tensors only.
"""

from __future__ import annotations

from dtrain.comm.mpi.group import MPIGroup, is_mpi_group, world

__all__ = ["MPIGroup", "is_mpi_group", "world"]
