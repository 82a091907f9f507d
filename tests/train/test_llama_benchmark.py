"""benchmarks/training/llama.py on 2 Gloo ranks with the tiny preset: the dtrain and DDP variants train the same
weights on the same batches (so their losses agree) and each leaves its record in --out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_llama_benchmark_trains_dtrain_and_ddp_alike_and_records_both(tmp_path):
    out = tmp_path / "llama.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "benchmarks/training/llama.py"]
    command += ["--preset", "tiny", "--seq-len", "32", "--batch-per-gpu", "2", "--steps", "2", "--warmup", "1"]
    command += ["--variants", "dtrain,ddp", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in records] == ["dtrain", "ddp"]
    assert all(r["gpus"] == 2 and r["tokens_per_s"] > 0 and r["mfu"] is None for r in records)
    dtrain, ddp = records
    assert abs(dtrain["loss"] - ddp["loss"]) < 1e-2 * ddp["loss"]  # bf16 autocast on both sides
    assert "1.000x DDP" in done.stdout
