"""What each torchrun worker on an emulated server runs: ``python -m dtrain.emulate.rank <dtrain args>``.

It checks that torch's rendezvous gave this node the rank the plan placed it at (else the placement being
measured would silently be another one), declares the hierarchy's "node" size when the emulator asks (e.g. a
whole rack, so ``algorithm="hierarchical"`` keeps the heavy traffic under one top-of-rack switch) and then runs
the ``dtrain`` command line as torchrun's ``-m dtrain`` would.
"""

from __future__ import annotations

import os
import sys

from dtrain.env import EMULATE_LOCAL_SIZE, EMULATE_NODE_RANK, EmulateEnv

__all__ = ["main", "NODE_RANK_ENV", "LOCAL_SIZE_ENV"]

#: The node rank the plan gave this namespace's server.
NODE_RANK_ENV = EMULATE_NODE_RANK
#: Ranks per hierarchy level for comm.set_local_size (unset: torchrun's LOCAL_WORLD_SIZE, one server).
LOCAL_SIZE_ENV = EMULATE_LOCAL_SIZE


def main(argv: list[str]) -> int:
    emulated = EmulateEnv.from_env()
    expected, got = emulated.node_rank, os.environ.get("GROUP_RANK")
    if expected is not None and got != str(expected):
        raise RuntimeError(
            f"torch's rendezvous made this server node {got}, the emulation placed it at node {expected}; the "
            f"measured placement would not be the planned one"
        )
    if emulated.local_size is not None:
        from dtrain import comm

        comm.set_local_size(emulated.local_size)
    from dtrain.cli.main import main as dtrain_main

    return dtrain_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
