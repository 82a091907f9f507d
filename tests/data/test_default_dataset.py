"""dtrain.data.default: the pydoc dataset is built once, reused, rebuilt when damaged, and safe to race."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.data.default import default_dataset, pydoc_documents
from dtrain.data.loader import PackedBatches, TokenDataset
from dtrain.data.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, Path]:
    cache = tmp_path_factory.mktemp("cache")
    folder, tokenizer_path = default_dataset(cache, 300)
    return cache, folder, tokenizer_path


def test_the_pydoc_dataset_holds_every_topic(built):
    cache, folder, tokenizer_path = built
    assert folder == cache / "pydoc-bpe-300" and tokenizer_path == folder / "tokenizer.json"
    dataset = TokenDataset(folder)
    tokenizer = Tokenizer.load(tokenizer_path)
    documents = pydoc_documents()
    assert dataset.vocab_size == tokenizer.vocab_size == 300
    assert dataset.num_documents("train") + dataset.num_documents("val") == len(documents) > 50
    assert dataset.num_documents("val") >= 2
    encoded = sum(len(ids) + 1 for ids in tokenizer.encode_batch(documents))
    assert dataset.num_tokens("train") + dataset.num_tokens("val") == encoded
    x, y = PackedBatches(dataset, "train", seq_len=32, batch_size=4, seed=0).batch(0)
    assert x.shape == (4, 32) and int(x.max()) < 300
    assert sorted(p.name for p in cache.iterdir()) == ["pydoc-bpe-300"]  # no temporary folders left


def test_a_second_call_reuses_the_dataset_and_a_damaged_one_is_rebuilt(built):
    cache, folder, _ = built
    meta = folder / "meta.json"
    stamp = (meta.stat().st_ino, meta.stat().st_mtime_ns)
    fingerprint = TokenDataset(folder).fingerprint
    assert default_dataset(cache, 300)[0] == folder
    assert (meta.stat().st_ino, meta.stat().st_mtime_ns) == stamp
    (folder / "train-00000.bin").write_bytes(b"\0\0")
    default_dataset(cache, 300)
    assert TokenDataset(folder).fingerprint == fingerprint
    assert sorted(p.name for p in cache.iterdir()) == ["pydoc-bpe-300"]


def test_processes_racing_to_build_agree_and_leave_one_copy(built, tmp_path):
    _, folder, _ = built
    code = (
        "import sys; from dtrain.data.default import default_dataset; from dtrain.data.loader import TokenDataset;"
        "print(TokenDataset(default_dataset(sys.argv[1], 300)[0]).fingerprint)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    racers = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outputs = [r.communicate(timeout=60)[0].strip() for r in racers]
    assert [r.returncode for r in racers] == [0, 0]
    # other processes train the same tokenizer and write the same tokens
    assert outputs == [TokenDataset(folder).fingerprint] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pydoc-bpe-300"]
