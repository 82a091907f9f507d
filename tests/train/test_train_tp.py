"""``dtrain train --tp``: the GPT's tensor-parallel blocks against the single-device ones, and real runs through
the command against one process training the unsplit model on the same global batches.

The block and whole-model checks run on Gloo processes of the test pool (jobs in
``tests/jobs/train_tp.py``); the runs are subprocesses of ``python -m dtrain train`` with the debug preset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dtrain.cli.main import main
from dtrain.train.data import TextBatches
from dtrain.train.models import build_model, model_config
from dtrain.train.tensor_parallel_gpt import TensorParallelBlock, padded_vocab_size, tensor_parallel_gpt
from tests.jobs import train_tp as jobs

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def _run(out: Path, *flags: str) -> list[dict]:
    command = [sys.executable, "-m", "dtrain", "train", "--out", str(out), "--batch-size", "8", *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank_losses() -> list[float]:
    """The reference, in this process: the unsplit debug GPT trained on each whole global batch (``dtrain train``'s
    seed, data, AdamW settings and cross-entropy; batch size 8)."""
    data, tokenizer = TextBatches.from_corpus(batch_size=8, block_size=64, seed=0)
    torch.manual_seed(0)
    model = build_model("gpt", config=model_config("gpt", "debug", vocab_size=tokenizer.vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = data.batch(step)
        loss = F.cross_entropy(model(x).reshape(-1, tokenizer.vocab_size), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_tensor_parallel_block_matches_the_single_device_block_forward_and_backward(pool):
    assert pool.run(jobs.block_equivalence, 2, ranks=2) == [[], []]


@pytest.mark.parametrize(
    ("tp", "vocab", "gather_logits"),
    [(2, 40, True), (2, 40, False), (2, 41, False), (4, 41, True), (4, 42, False)],
)
def test_vocab_parallel_gpt_matches_the_single_device_gpt(pool, tp, vocab, gather_logits):
    # 41 and 42 do not divide by the group: the vocabulary is padded, the padding never seen or updated
    assert pool.run(jobs.gpt_equivalence, tp, vocab, gather_logits, ranks=tp) == [[]] * tp


def test_a_vocabulary_that_would_leave_a_rank_only_padding_is_refused():
    assert padded_vocab_size(103, 2) == 104
    with pytest.raises(ValueError, match="a vocabulary of 5 over tp=4 ranks would leave a rank with padding only"):
        padded_vocab_size(5, 4)


def test_tp2_run_matches_one_rank_on_the_global_batch(tmp_path, one_rank_losses):
    records = _run(tmp_path, "--nproc", "2", "--tp", "2", "--steps", str(STEPS))
    assert [r["loss"] for r in records] == pytest.approx(one_rank_losses, rel=1e-5)


def test_dp2_tp2_run_on_four_ranks_matches_one_rank(tmp_path, one_rank_losses):
    records = _run(tmp_path, "--nproc", "4", "--dp", "2", "--tp", "2", "--steps", str(STEPS))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == pytest.approx(one_rank_losses, rel=1e-5)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc", "4", "--tp", "4"], "gpt (debug) has n_head=2, which does not divide by tp"),
        (["--nproc", "2", "--tp", "2", "--model", "mlp"], "supports model 'gpt' only, not 'mlp'"),
    ],
)
def test_tensor_parallel_layouts_the_model_cannot_split_fail_before_any_rank_starts(tmp_path, capsys, flags, message):
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
    assert message in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_conversion_refuses_dropout_and_models_that_are_not_gpts():
    torch.manual_seed(0)
    gpt = build_model("gpt", vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.1)
    with pytest.raises(ValueError, match="dropout 0 only"):
        TensorParallelBlock(gpt[1], tp_group=None)
    with pytest.raises(ValueError, match=r"expected a GPT Sequential\(Embedding, Block, \.\.\., Head\)"):
        tensor_parallel_gpt(build_model("mlp"), tp_group=None)
