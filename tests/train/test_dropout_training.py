"""``dtrain train`` of a model with dropout: the masks are drawn from the step and each value's place in the global
batch (:mod:`dtrain.models.dropout`), so a run at dp 2 and its resume at dp 1 train as one run."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from dtrain.models import preset
from dtrain.models.hf import save_config
from dtrain.testing.command import train_in_process
from dtrain.train.checkpoint import checkpoint_dir

STEPS = 4
FLAGS = [
    *("--steps", str(STEPS), "--checkpoint-every", "2", "--seq-len", "32", "--batch-size", "8"),
    *("--precision", "float32", "--warmup-steps", "1", "--no-tensorboard", "--no-export"),
]


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dropout_draws_the_same_masks_on_another_layout_after_a_resume(tmp_path):
    """A GPT-2 whose every dropout is 0.1 (embedding, attention probabilities, residual branches), at dp 2 with
    accumulation 2 for four steps; resumed from its checkpoint of step 2 on one process, steps 3 and 4 are the dp
    2 run's. Torch's own dropout would draw other masks on one process than on two."""
    shape = dataclasses.replace(preset("gpt2", "tiny"), resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    save_config(shape, tmp_path / "shape")
    model = ["--model", "gpt2", "--model-config", str(tmp_path / "shape" / "config.json")]
    first = tmp_path / "dp2"
    train_in_process(first, "--nproc", "2", "--dp", "2", "--accumulation", "2", *model, *FLAGS)
    resumed = tmp_path / "dp1"
    shutil.copytree(first, resumed)
    shutil.rmtree(checkpoint_dir(resumed, STEPS))
    train_in_process(resumed, "--nproc", "1", "--dp", "1", *model, *FLAGS, "--resume")
    want, got = _losses(first), _losses(resumed)
    assert len(want) == len(got) == STEPS
    assert got[2:] == [pytest.approx(v, rel=1e-5) for v in want[2:]]
