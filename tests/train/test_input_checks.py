"""``dtrain train`` and ``dtrain export`` on damaged or mismatched input: a checkpoint whose file is missing,
truncated or damaged in place, a checkpoint of another dataset, weights whose safetensors header or tensor shapes
are wrong. Each ends in one line on stderr naming the flag and the file, exit status 2, nothing on stdout; what
the launching process can check it checks before any rank starts, and what only a rank can find (a file damaged
in place) stops the ranks once, unrestarted.

The checkpoints are copies of tests/train/conftest.py's run (2 ranks at dp 2, checkpoints at steps 2 and 4); the
processes that read them are ``python -m dtrain`` subprocesses where ranks start or the command's own exit matters,
and ``dtrain.cli.main.main`` in this process (no rank may start) elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from dtrain.cli.main import build_parser, main
from dtrain.testing.command import run_command
from dtrain.train import loop
from dtrain.train.checkpoint import checkpoint_dir
from dtrain.train.config import from_arguments

# the checkpointed run's shape: float32, sequences of 32 tokens, the tiny Llama on the default dataset
RUN = ["--seq-len", "32", "--batch-size", "8", "--precision", "float32", "--no-tensorboard", "--no-export"]
LAST = 4  # the run's last checkpoint, the one --resume and export read


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank would start."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(loop, "run_ranks", refuse)


@pytest.fixture
def run_copy(dp2_run, tmp_path) -> Path:
    """A copy of the run's output directory, to damage."""
    out = tmp_path / "run"
    shutil.copytree(dp2_run[0], out)
    return out


def _refused(capsys, argv: list[str]) -> str:
    """``dtrain ARGV`` in this process, which must end with status 2 and one line on stderr: that line."""
    assert main(argv) == 2
    printed = capsys.readouterr()
    assert not printed.out and printed.err.count("\n") == 1, printed
    return printed.err.removesuffix("\n")


def _damage(directory: Path, how: str) -> str:
    """Damage checkpoint ``directory`` as ``how`` says; the start of the one line that names it."""
    shard, index = directory / "__0_0.distcp", directory / ".metadata"
    if how == "truncated":
        size = shard.stat().st_size
        os.truncate(shard, size // 2)
        return f"{shard}: {size // 2} bytes, but {index} lists {size}: the file is truncated"
    if how == "deleted":
        shard.unlink()
        return f"{shard}: missing (listed in {index})"
    index.write_bytes(b"\x80\x04not a pickle")
    return f"{index}: not a readable checkpoint index"


@pytest.mark.parametrize("how", ["truncated", "deleted", "index"])
def test_resume_from_a_checkpoint_with_a_missing_truncated_or_unreadable_file_fails_before_any_rank_starts(
    run_copy, capsys, no_ranks, how
):
    named = _damage(checkpoint_dir(run_copy, LAST), how)
    said = _refused(capsys, ["train", "--out", str(run_copy), *RUN, "--steps", "6", "--resume"])
    assert said.startswith(f"dtrain: error: --resume: {named}"), said


def test_a_checkpoint_file_damaged_in_place_stops_the_ranks_in_one_line_without_a_restart(run_copy, capsys):
    directory = checkpoint_dir(run_copy, LAST)
    shard = directory / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # zeros: every size still as .metadata lists it
    argv = ["train", "--out", str(run_copy), "--nproc", "2", "--dp", "2", *RUN, "--steps", "6", "--resume"]
    status, stdout = run_command([*argv, "--max-restarts", "2"])
    stderr = capsys.readouterr().err
    assert status == 2, stdout + stderr
    lines = stderr.splitlines()
    said = f"dtrain: error: {directory}: a file of the checkpoint cannot be read"
    assert len(lines) == 1 and lines[0].startswith(said), stderr
    assert "restart" not in stdout + stderr  # bad input: the agent did not start the ranks again


@pytest.mark.parametrize("how", ["truncated", "deleted", "index", "in place"])
def test_export_of_a_damaged_checkpoint_is_one_line_naming_the_file(run_copy, tmp_path, capsys, how):
    directory = checkpoint_dir(run_copy, LAST)
    if how == "in place":
        shard = directory / "__0_0.distcp"
        shard.write_bytes(bytes(shard.stat().st_size))
        named = f"{directory}: a file of the checkpoint cannot be read, it is damaged"
    else:
        named = _damage(directory, how)
    said = _refused(capsys, ["export", str(run_copy), "--out", str(tmp_path / "hf")])
    assert said.startswith(f"dtrain export: {named}"), said
    assert not (tmp_path / "hf").exists()


@pytest.fixture
def other_dataset(run_copy, tmp_path) -> Path:
    """A dataset of other texts, with the tokenizer the checkpointed run trained with."""
    from dtrain.data.prepare import prepare
    from dtrain.data.tokenizer import Tokenizer

    meta = json.loads((checkpoint_dir(run_copy, LAST) / "meta.json").read_text())
    docs = [f"document {i}: the quick brown fox jumps over {i} lazy dogs, again and again." * 4 for i in range(60)]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    prepare([tmp_path / "docs.jsonl"], Tokenizer.load(meta["tokenizer"]), tmp_path / "other", val_fraction=0.1)
    return tmp_path / "other"


@pytest.mark.parametrize("recorded", ["in meta.json", "with the data position"])
def test_resume_on_another_dataset_fails_before_any_rank_starts(run_copy, other_dataset, capsys, no_ranks, recorded):
    meta_file = checkpoint_dir(run_copy, LAST) / "meta.json"
    meta = json.loads(meta_file.read_text())
    if recorded != "in meta.json":  # a checkpoint whose meta.json does not record it: DCP's data entry tells
        meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k not in ("dataset", "data_fingerprint")}))
    flags = ["--out", str(run_copy), *RUN, "--steps", "6", "--resume"]
    said = _refused(capsys, ["train", *flags, "--dataset", str(other_dataset)])
    where = f"{run_copy}/checkpoints"
    trained_on = f" ({meta['dataset']})" if recorded == "in meta.json" else ""
    assert said.startswith(
        f"dtrain: error: --dataset: the checkpoint under {where} was trained on another dataset{trained_on} than "
        f"this run's ({other_dataset})"
    ), said
    # the dataset it was trained on passes
    config = from_arguments(build_parser().parse_args(["train", *flags, "--dataset", meta["dataset"]]))
    assert loop.check_run(config, 1).first_step == LAST


@pytest.fixture
def weights(tmp_path) -> Path:
    """A Hugging Face directory of the tiny Llama at the default tokenizer's vocabulary."""
    from dtrain.models import build, hf, preset

    shape = preset("llama", "tiny", vocab_size=512)
    return hf.save_pretrained(build(shape), shape, tmp_path / "weights")


def _header(file: Path, header: bytes) -> None:
    """Replace the safetensors header of ``file`` (its length, then its JSON) by ``header``, the data kept."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    file.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + length :])


@pytest.mark.parametrize("how", ["header", "truncated", "shape"])
def test_weights_with_a_bad_header_or_shape_fail_before_any_rank_starts(weights, tmp_path, capsys, no_ranks, how):
    file = weights / "model.safetensors"
    if how == "header":
        _header(file, b'{"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]')
        named = f"{file}: not a readable safetensors file"
    elif how == "truncated":
        os.truncate(file, file.stat().st_size - 100)
        named = f"{file}: not a readable safetensors file"
    else:  # a config of other MLP widths than the stored tensors
        config = json.loads((weights / "config.json").read_text())
        config["intermediate_size"] *= 2
        (weights / "config.json").write_text(json.dumps(config))
        named = f"{file}: model.layers.0.mlp."
    flags = ["--out", str(tmp_path / "run"), *RUN, "--steps", "2", "--weights", str(weights)]
    said = _refused(capsys, ["train", *flags])
    assert said.startswith(f"dtrain: error: --weights: {named}"), said
    assert not (tmp_path / "run").exists()


def test_weights_whose_token_ids_the_export_would_keep_are_checked_before_any_rank_starts(
    weights, tmp_path, capsys, no_ranks
):
    from dtrain.data.default import pydoc_documents
    from dtrain.data.tokenizer import Tokenizer

    Tokenizer.train_bpe(pydoc_documents()[:4], 400).save(weights / "tokenizer.json")
    config = json.loads((weights / "config.json").read_text())
    (weights / "config.json").write_text(json.dumps({**config, "pad_token_id": [3, 512]}))
    flags = ["--out", str(tmp_path / "run"), *RUN, "--steps", "2", "--weights", str(weights)]
    said = _refused(capsys, ["train", *flags])
    assert said.startswith(f"dtrain: error: --weights: {weights}/config.json: pad_token_id must be a token id"), said
    assert not (tmp_path / "run").exists()


def test_whole_weights_pass_the_check_before_the_ranks_start(weights, tmp_path):
    flags = ["--out", str(tmp_path / "run"), *RUN, "--steps", "2", "--weights", str(weights)]
    plan = loop.check_run(from_arguments(build_parser().parse_args(["train", *flags])), 1)
    assert plan.model.vocab_size == 512 and plan.first_step == 0


def test_weights_train_on_text_their_own_tokenizer_tokenized(weights, tmp_path, capsys, no_ranks, monkeypatch):
    from dtrain.data.default import default_dataset, pydoc_documents
    from dtrain.data.tokenizer import Tokenizer

    other, _ = default_dataset(loop.DEFAULT_DATA_CACHE)  # the default dataset, of a BPE trained for it
    monkeypatch.setattr(loop, "DEFAULT_DATA_CACHE", tmp_path / "cache")
    own = Tokenizer.train_bpe(pydoc_documents()[:4], 400)
    own.save(weights / "tokenizer.json")
    flags = ["--out", str(tmp_path / "run"), *RUN, "--steps", "2", "--weights", str(weights)]
    plan = loop.check_run(from_arguments(build_parser().parse_args(["train", *flags])), 1)
    assert Tokenizer.load(plan.tokenizer).fingerprint == own.fingerprint  # the ids the weights were trained on
    said = _refused(capsys, ["train", *flags, "--dataset", str(other)])
    assert said.startswith(
        f"dtrain: error: --dataset: {other} was tokenized by another tokenizer than {weights}/tokenizer.json"
    ), said


def test_evaluation_on_a_dataset_without_a_validation_window_names_eval_every(tmp_path, capsys, no_ranks):
    from dtrain.data.prepare import prepare
    from dtrain.data.tokenizer import Tokenizer

    docs = [f"document {i}: the quick brown fox jumps over {i} lazy dogs." * 4 for i in range(20)]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    tokenizer = Tokenizer.train_bpe(docs, 300)
    prepare([tmp_path / "docs.jsonl"], tokenizer, tmp_path / "data", val_fraction=0.0)  # no validation documents
    flags = ["train", "--out", str(tmp_path / "run"), *RUN, "--dataset", str(tmp_path / "data")]
    said = _refused(capsys, [*flags, "--eval-every", "2"])
    assert said.startswith("dtrain: error: [data] eval_every: the validation split of "), said
    assert "0 val tokens" in said and said.endswith("set it to 0 or use more data"), said
    assert not (tmp_path / "run").exists()
