"""dtrain.data.prepare: text, JSONL and Parquet inputs -> token shards, meta.json, and the refusals."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dtrain.data.prepare import prepare, shard_dtype
from dtrain.data.tokenizer import Tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _document(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 11)) + f" #{i}\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_bpe([_document(i) for i in range(50)], 300)


@pytest.fixture
def inputs(tmp_path) -> tuple[list[Path], list[str]]:
    """A text file, a JSONL file and a Parquet file in a directory, and their documents in reading order."""
    folder = tmp_path / "in"
    folder.mkdir()
    docs = [_document(i) for i in range(60)]
    (folder / "a.txt").write_text(docs[0])
    (folder / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[1:30], 1)) + "\n\n"
    )
    pq.write_table(pa.table({"text": docs[30:], "n": list(range(30, 60))}), folder / "c.parquet")
    (folder / ".hidden").write_text("left out")
    return [folder], docs


def _stream(out: Path, split: str, dtype=np.uint16) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    files = [out / s["file"] for s in meta["splits"][split]["shards"]]
    return np.concatenate([np.fromfile(f, dtype=dtype) for f in files]) if files else np.zeros(0, dtype)


def _val_docs(out: Path, tokenizer: Tokenizer) -> list[str]:
    return [d + "<|endoftext|>" for d in tokenizer.decode(_stream(out, "val")).split("<|endoftext|>")[:-1]]


def test_token_stream_is_the_encoding_of_each_document_then_eos(tokenizer, inputs, tmp_path):
    paths, docs = inputs
    out = tmp_path / "ds"
    info = prepare(paths, tokenizer, out, val_fraction=0.1, shard_tokens=97, seed=3)
    meta = json.loads((out / "meta.json").read_text())
    val_docs = {d.removesuffix("<|endoftext|>") for d in _val_docs(out, tokenizer)}
    assert len(val_docs) == round(0.1 * len(docs)) == info.documents["val"] == meta["splits"]["val"]["documents"]
    train_docs = [d for d in docs if d not in val_docs]
    assert info.documents["train"] == len(train_docs)
    expected = [t for d in train_docs for t in [*tokenizer.encode(d), tokenizer.eos_id]]
    assert _stream(out, "train").tolist() == expected
    assert _stream(out, "val").tolist() == [
        t for d in docs if d in val_docs for t in [*tokenizer.encode(d), tokenizer.eos_id]
    ]
    # shards of at most 97 tokens, their sizes in meta.json; the tokenizer copied beside them
    shards = meta["splits"]["train"]["shards"]
    assert [s["file"] for s in shards] == [f"train-{i:05d}.bin" for i in range(len(shards))]
    assert all(s["tokens"] == 97 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 97
    assert all((out / s["file"]).stat().st_size == 2 * s["tokens"] for s in shards)
    assert sum(s["tokens"] for s in shards) == info.tokens["train"] == len(expected)
    assert Tokenizer.load(out / "tokenizer.json").fingerprint == tokenizer.fingerprint == meta["tokenizer_fingerprint"]
    assert (meta["dtype"], meta["vocab_size"], meta["eos_id"], meta["version"]) == ("uint16", 300, tokenizer.eos_id, 1)
    assert [Path(i["name"]).name for i in meta["inputs"]] == ["a.txt", "b.jsonl", "c.parquet"]
    assert all(i["bytes"] == Path(i["name"]).stat().st_size for i in meta["inputs"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "in"]  # no temporary folder left


def test_the_val_choice_is_seeded_and_whole_documents(tokenizer, inputs, tmp_path):
    paths, _ = inputs
    chosen = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        prepare(paths, tokenizer, tmp_path / name, val_fraction=0.1, seed=seed)
        chosen[name] = _val_docs(tmp_path / name, tokenizer)
    assert chosen["a"] == chosen["b"] != chosen["c"]
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["fingerprint"] == json.loads((tmp_path / "b" / "meta.json").read_text())["fingerprint"]
    assert meta["fingerprint"] != json.loads((tmp_path / "c" / "meta.json").read_text())["fingerprint"]


def test_at_least_one_val_document_and_never_all(tokenizer, tmp_path):
    (tmp_path / "two.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    info = prepare([tmp_path / "two.jsonl"], tokenizer, tmp_path / "a", val_fraction=0.001)
    assert info.documents == {"train": 1, "val": 1}
    info = prepare([tmp_path / "two.jsonl"], tokenizer, tmp_path / "b", val_fraction=0.9)
    assert info.documents == {"train": 1, "val": 1}
    (tmp_path / "one.txt").write_text("only")
    info = prepare([tmp_path / "one.txt"], tokenizer, tmp_path / "c", val_fraction=0.5)
    assert info.documents == {"train": 1, "val": 0} and info.shards["val"] == []


def test_large_vocabularies_use_uint32(tmp_path):
    assert shard_dtype(65536) == np.uint16 and shard_dtype(65537) == np.uint32
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(65537)} | {"<|endoftext|>": 65537}
    backend = Backend(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big = Tokenizer(backend)
    assert big.vocab_size == 65538 and big.eos_id == 65537
    (tmp_path / "doc.txt").write_text("w1 w65536 w7")
    info = prepare([tmp_path / "doc.txt"], big, tmp_path / "ds", val_fraction=0)
    assert info.dtype == "uint32"
    assert _stream(tmp_path / "ds", "train", np.uint32).tolist() == [1, 65536, 7, 65537]


def test_gzipped_jsonl_and_replacing_a_dataset(tokenizer, tmp_path):
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write('{"body": "zipped alpha"}\n{"body": "zipped beta"}\n')
    out = tmp_path / "ds"
    prepare([tmp_path / "d.jsonl.gz"], tokenizer, out, text_key="body", val_fraction=0)
    (tmp_path / "e.txt").write_text("new gamma")
    prepare([tmp_path / "e.txt"], tokenizer, out)  # an existing dataset is replaced
    assert _stream(out, "train").tolist() == [*tokenizer.encode("new gamma"), 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl.gz", "ds", "e.txt"]


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list, str]]:
    """Name -> (inputs, the error's pattern)."""
    (tmp_path / "ok.txt").write_text("fine text")
    (tmp_path / "notjson.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    (tmp_path / "nokey.jsonl").write_text('{"text": "a"}\n\n{"body": "b"}\n')
    (tmp_path / "notstr.jsonl").write_text('{"text": 5}\n')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "a"}\n{"text": "half \\ud800 a pair"}\n')
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "emptydir").mkdir()
    return {
        "missing": ([tmp_path / "ok.txt", tmp_path / "gone.txt"], r"^input .*gone\.txt does not exist$"),
        "not json": ([tmp_path / "ok.txt", tmp_path / "notjson.jsonl"], r"notjson\.jsonl line 2: not JSON"),
        "no key": ([tmp_path / "nokey.jsonl"], r"nokey\.jsonl line 3: no 'text' key"),
        "not a string": ([tmp_path / "notstr.jsonl"], r"notstr\.jsonl line 1: 'text' is a int, not a string"),
        "surrogate": ([tmp_path / "surrogate.jsonl"], r"surrogate\.jsonl line 2: 'text' is not text: .*\\ud800"),
        "no column": ([tmp_path / "nocol.parquet"], r"nocol\.parquet: no column 'text' \(columns: body;"),
        "corrupt parquet": ([tmp_path / "corrupt.parquet"], r"corrupt\.parquet: not a readable Parquet file"),
        "empty": ([tmp_path / "empty.txt"], r"^empty dataset: no text in .*empty\.txt$"),
        "not utf-8": ([tmp_path / "latin1.txt"], r"latin1\.txt: not UTF-8 text"),
        "empty dir": ([tmp_path / "emptydir"], r"input directory .*emptydir holds no files"),
    }


def test_bad_inputs_are_one_line_errors_that_write_nothing(tokenizer, tmp_path):
    cases = _bad_inputs(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for name, (inputs, pattern) in cases.items():
        with pytest.raises(ValueError, match=pattern) as info:
            prepare(inputs, tokenizer, tmp_path / "out" / "ds")
        assert "\n" not in str(info.value), name
        assert sorted(p.name for p in tmp_path.iterdir()) == before, name


def test_an_existing_folder_that_is_not_a_dataset_is_refused(tokenizer, tmp_path):
    (tmp_path / "ok.txt").write_text("fine text")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"^output .*taken exists and is not a prepared dataset"):
        prepare([tmp_path / "ok.txt"], tokenizer, taken)
    assert [p.name for p in taken.iterdir()] == ["precious.txt"]
    no_eos = Tokenizer.train_bpe(["x"], 257, special_tokens=("<pad>",))
    with pytest.raises(ValueError, match="has no end-of-text token"):
        prepare([tmp_path / "ok.txt"], no_eos, tmp_path / "ds")
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\), got 1.5"):
        prepare([tmp_path / "ok.txt"], tokenizer, tmp_path / "ds", val_fraction=1.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.txt", "taken"]


def test_the_dataset_is_written_with_the_modes_of_the_umask(tokenizer, tmp_path):
    """Others may read a dataset as the umask lets them read any new file: the folder and its tokenizer.json are
    not left private to the owner as temporary files are made."""
    (tmp_path / "doc.txt").write_text(_document(1))
    old = os.umask(0o022)
    try:
        prepare([tmp_path / "doc.txt"], tokenizer, tmp_path / "ds", val_fraction=0)
    finally:
        os.umask(old)
    assert (tmp_path / "ds").stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ds").iterdir()} == dict.fromkeys(
        ["meta.json", "tokenizer.json", "train-00000.bin"], 0o644
    )
