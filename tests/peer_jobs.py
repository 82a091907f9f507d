"""Jobs for the peer-memory transport tests: the collective checks of comm_jobs, run with
DTRAIN_COMM_TRANSPORT=peer (windows in /dev/shm, Gloo's monitored barrier between rounds)."""

from __future__ import annotations

import os

from tests import comm_jobs


def _with_peer(fn, *args, **kwargs):
    os.environ["DTRAIN_COMM_TRANSPORT"] = "peer"
    try:
        return fn(*args, **kwargs)
    finally:
        os.environ.pop("DTRAIN_COMM_TRANSPORT", None)


def check_collective(*args, **kwargs):
    return _with_peer(comm_jobs.check_collective, *args, **kwargs)


def check_against_native(*args, **kwargs):
    return _with_peer(comm_jobs.check_against_native, *args, **kwargs)


def missing_peer(*args, **kwargs):
    return _with_peer(comm_jobs.missing_peer, *args, **kwargs)
