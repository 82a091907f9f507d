"""benchmarks/training/llama.py on 2 Gloo ranks with the tiny preset: the dtrain and DDP variants train the same
weights on the same batches (so their losses agree) and each leaves its record in --out.

torchrun's agent runs in this process (``torch.distributed.run.main``, what ``python -m torch.distributed.run``
calls); the two ranks are processes of the script, as under the command."""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed import run as torchrun

ROOT = Path(__file__).resolve().parents[2]


def test_the_llama_benchmark_trains_dtrain_and_ddp_alike_and_records_both(tmp_path, monkeypatch, capfd):
    out = tmp_path / "llama.jsonl"
    argv = ["--nproc-per-node", "2", str(ROOT / "benchmarks" / "training" / "llama.py")]
    argv += ["--preset", "tiny", "--seq-len", "32", "--batch-per-gpu", "2", "--steps", "2", "--warmup", "1"]
    argv += ["--variants", "dtrain,ddp", "--out", str(out)]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(ROOT)
    torchrun.main(argv)  # raises ChildFailedError, with each failed rank's exit status, if a rank fails
    stdout = capfd.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in records] == ["dtrain", "ddp"]
    assert all(r["gpus"] == 2 and r["tokens_per_s"] > 0 and r["mfu"] is None for r in records)
    dtrain, ddp = records
    assert abs(dtrain["loss"] - ddp["loss"]) < 1e-2 * ddp["loss"]  # bf16 autocast on both sides
    assert "1.000x DDP" in stdout, stdout
