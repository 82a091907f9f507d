"""``dtrain data prepare``: the summary line, and bad input as one line on stderr with exit status 2."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from dtrain.cli import data as data_cli
from dtrain.data.loader import TokenDataset
from dtrain.data.tokenizer import Tokenizer


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dtrain")
    data_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.handler is data_cli.run
    return args.handler(args)


@pytest.fixture
def corpus(tmp_path):
    lines = [
        json.dumps({"content": f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 5)}) for i in range(40)
    ]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "docs.jsonl"


def test_prepare_with_a_trained_tokenizer_then_with_a_saved_one(corpus, tmp_path, capsys):
    out = tmp_path / "ds"
    argv = ["data", "prepare", str(corpus), "--out", str(out), "--train-tokenizer", "280", "--text-key", "content"]
    assert _run([*argv, "--val-fraction", "0.1"]) == 0
    line = capsys.readouterr().out.strip()
    dataset = TokenDataset(out)
    total = dataset.num_tokens("train") + dataset.num_tokens("val")
    assert line == (
        f"dtrain data prepare: {total:,} tokens ({dataset.num_tokens('train'):,} train, "
        f"{dataset.num_tokens('val'):,} val), 40 documents (36 train, 4 val), 2 shards (uint16) in {out}"
    )
    assert dataset.vocab_size == 280
    again = tmp_path / "again"
    argv = ["data", "prepare", str(corpus), "--out", str(again), "--tokenizer", str(dataset.tokenizer_path)]
    assert _run([*argv, "--text-key", "content", "--val-fraction", "0.1", "--shard-tokens", "500"]) == 0
    assert TokenDataset(again).tokenizer_fingerprint == Tokenizer.load(dataset.tokenizer_path).fingerprint
    assert TokenDataset(again).num_tokens("train") == dataset.num_tokens("train")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--train-tokenizer", "300"], r"docs\.jsonl line 1: no 'text' key"),
        (["--tokenizer", "missing.json", "--text-key", "content"], r"tokenizer file missing\.json does not exist"),
        (["--train-tokenizer", "100", "--text-key", "content"], r"vocab_size must be an integer of at least 257"),
        (["--train-tokenizer", "300", "--val-fraction", "1"], r"--val-fraction must be in \[0, 1\), got 1\.0"),
    ],
)
def test_bad_input_is_one_line_on_stderr(corpus, tmp_path, capsys, extra, message):
    assert _run(["data", "prepare", str(corpus), "--out", str(tmp_path / "ds"), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("dtrain data prepare: ") and captured.err.count("\n") == 1
    assert re.search(message, captured.err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


def test_an_occupied_out_dir_is_refused_before_any_tokenizer_is_trained(corpus, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    assert _run(["data", "prepare", str(corpus), "--out", str(tmp_path / "notes"), "--train-tokenizer", "300"]) == 2
    assert "notes exists and is not a prepared dataset" in capsys.readouterr().err


def test_a_text_key_with_no_jsonl_or_parquet_input_is_refused(tmp_path, capsys):
    """Text files are read whole: a --text-key beside only them would be ignored (a JSON-lines file named .json
    among them, read as one document)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("plain text")
    (tmp_path / "in" / "b.json").write_text('{"body": "one"}\n{"body": "two"}\n')
    argv = ["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "ds"), "--train-tokenizer", "260"]
    assert _run([*argv, "--text-key", "body"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dtrain data prepare: --text-key body: "), err
    assert ".jsonl" in err and not (tmp_path / "ds").exists()
    assert _run(argv) == 0
