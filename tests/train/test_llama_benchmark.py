"""benchmarks/training/llama.py on 2 Gloo ranks with the tiny preset: the dtrain and DDP variants train the same
weights on the same batches (so their losses agree) and each leaves its record in --out.

torch's elastic agent runs in this process (``elastic_launch``, what torchrun runs) with a c10d rendezvous on
loopback; each of the two ranks runs the script's ``main()`` with the command's arguments (tests/jobs/scripts.py)
in a process forked from this process's fork server, which imported torch once."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dtrain.workers import start_fork_server
from tests.jobs.scripts import script_main

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_llama_benchmark_trains_dtrain_and_ddp_alike_and_records_both(tmp_path, monkeypatch):
    out = tmp_path / "llama.jsonl"
    argv = ["--preset", "tiny", "--seq-len", "32", "--batch-per-gpu", "2", "--steps", "2", "--warmup", "1"]
    argv += ["--variants", "dtrain,ddp", "--out", str(out)]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    start_fork_server(2)  # the server the test pool forks from, if it runs already
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        run_id=f"llama-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=0.1,
        local_addr="127.0.0.1",
        start_method="forkserver",
    )
    # raises ChildFailedError, with each failed rank's exit status, if a rank fails
    printed = elastic_launch(config, script_main)(str(ROOT / "benchmarks" / "training" / "llama.py"), argv)
    stdout = printed[0]  # rank 0 prints the table
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in records] == ["dtrain", "ddp"]
    assert all(r["gpus"] == 2 and r["tokens_per_s"] > 0 and r["mfu"] is None for r in records)
    dtrain, ddp = records
    assert abs(dtrain["loss"] - ddp["loss"]) < 1e-2 * ddp["loss"]  # bf16 autocast on both sides
    assert "1.000x DDP" in stdout, stdout
