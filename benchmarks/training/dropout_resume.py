"""A model with dropout trained four ways by ``dtrain train`` on this GPU: straight through, resumed from its
checkpoint halfway, with full activation recomputation, and each step recorded and replayed as one CUDA graph
(``--step-graph``); each step's loss.

The model is a small GPT-2 (4 layers of width 256, 4 heads, a vocabulary of 4,096, sequences of 256) with every
dropout at 0.1 (embedding, attention probabilities, both residual branches), bf16, batch 16, 8 steps, a checkpoint
every 4, on the default dataset. :mod:`dtrain.models.dropout` draws each step's masks from the run's seed and the
step, so the resumed run's steps 5 to 8 and the recomputed and recorded runs' every step should equal the straight
run's, with no generator state saved or restored (a recorded step reads the step's key from the device at each
replay).

    python benchmarks/training/dropout_resume.py --out benchmarks/results/dropout_resume-h200x1.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dtrain.models import preset
from dtrain.models.hf import save_config
from dtrain.train.checkpoint import checkpoint_dir

STEPS = 8


def _train(out: Path, flags: list[str]) -> None:
    command = [sys.executable, "-m", "dtrain", "train", "--nproc", "1", "--out", str(out), *flags]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"dropout_resume.py: {' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dropout_resume.py: needs a CUDA GPU")
    work = Path(tempfile.mkdtemp(prefix="dropout_resume-"))
    shape = dataclasses.replace(
        preset("gpt2", "124m"),
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_inner=1024,
        n_positions=256,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        vocab_size=4096,
    )
    save_config(shape, work / "shape")
    flags = ["--model", "gpt2", "--model-config", str(work / "shape" / "config.json"), "--seq-len", "256"]
    flags += ["--batch-size", "16", "--tokenizer-vocab", "4096", "--checkpoint-every", "4", "--precision", "bf16"]
    flags += ["--steps", str(STEPS), "--no-export"]
    _train(work / "straight", flags)
    _train(work / "recomputed", [*flags, "--activation-checkpointing", "full"])
    _train(work / "recorded", [*flags, "--step-graph"])
    shutil.copytree(work / "straight", work / "resumed")
    shutil.rmtree(checkpoint_dir(work / "resumed", STEPS))
    _train(work / "resumed", [*flags, "--resume"])
    device = torch.cuda.get_device_name()
    runs = {name: _losses(work / name) for name in ("straight", "resumed", "recomputed", "recorded")}
    with open(args.out, "w") as out:
        for name, losses in runs.items():
            for step, loss in sorted(losses.items()):
                row = {"run": name, "step": step, "loss": loss, "device": device, "torch_version": torch.__version__}
                out.write(json.dumps(row) + "\n")
    straight = runs["straight"]
    resumed = max(abs(runs["resumed"][s] - straight[s]) for s in range(5, STEPS + 1))
    print(f"resumed, steps 5-{STEPS}: max |loss - straight| {resumed}")
    for name in ("recomputed", "recorded"):
        print(f"{name}: max |loss - straight| {max(abs(runs[name][s] - straight[s]) for s in straight)}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
