"""The ``dtrain`` command line run by the calling process, for tests that need a command's result but not a new
interpreter: ``dtrain.cli.main.main`` with the same checks, launcher and ranks as ``python -m dtrain``, its ranks
forked from this process's fork server, so no interpreter start, torch import or teardown a run."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["run_command", "train_in_process"]

#: What a rank of a launch, or a fault injection, leaves in an environment: never the launching process's.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DTRAIN_KILL_AT")


def run_command(argv: Sequence[str]) -> tuple[int, str]:
    """``dtrain ARGV`` in this process, without a rank's variables: (exit status, what it printed on stdout). The
    environment is as it was before afterwards (the command sets defaults such as ``OMP_NUM_THREADS``)."""
    from dtrain.cli.main import main

    saved, printed = dict(os.environ), io.StringIO()
    try:
        for name in _RANK_VARIABLES:
            os.environ.pop(name, None)
        with contextlib.redirect_stdout(printed):
            status = main(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return status, printed.getvalue()


def train_in_process(out: Path, *flags: str) -> str:
    """``dtrain train --out OUT FLAGS`` by :func:`run_command`; the launching process's stdout, whose first line
    says what starts and a later one the final loss (the progress line is rank 0's, on the fork server's stdout).
    AssertionError with the output if the command fails or does not say both."""
    status, stdout = run_command(["train", "--out", str(out), *flags])
    lines = stdout.splitlines()
    if status != 0 or not lines or not lines[0].startswith("dtrain train: training "):
        raise AssertionError(f"dtrain train exited {status}:\n{stdout}")
    if not any(line.startswith("dtrain train: ") and "steps, final loss" in line for line in lines[1:]):
        raise AssertionError(f"dtrain train did not report its final loss:\n{stdout}")
    return stdout
