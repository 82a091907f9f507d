"""dtrain.data.loader: memory-mapped shards, packed seeded batches, data-parallel shares, resuming."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dtrain.data.loader import PackedBatches, TokenDataset
from dtrain.data.prepare import prepare
from dtrain.data.tokenizer import Tokenizer

SEQ = 8


def _word_tokenizer(words: int) -> Tokenizer:
    """Word ``w<i>`` is id ``i``; ``<|endoftext|>`` is id ``words``."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({f"w{i}": i for i in range(words)} | {"<|endoftext|>": words}, "w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> TokenDataset:
    """About 1000 train tokens, all different but the eos between documents, in shards of 100 (windows cross
    shard boundaries); about 60 val tokens."""
    folder = tmp_path_factory.mktemp("loader")
    lengths = [5 + i % 17 for i in range(80)]
    ends = np.cumsum(lengths).tolist()
    docs = [" ".join(f"w{k}" for k in range(end - n, end)) for n, end in zip(lengths, ends, strict=True)]
    (folder / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    tokenizer = _word_tokenizer(ends[-1])
    prepare([folder / "docs.jsonl"], tokenizer, folder / "ds", val_fraction=0.05, shard_tokens=100)
    return TokenDataset(folder / "ds")


def _stream(dataset: TokenDataset, split: str) -> np.ndarray:
    return dataset.tokens(split, 0, dataset.num_tokens(split)).astype(np.int64)


def test_the_dataset_reads_its_shards_as_one_stream(dataset):
    meta = dataset.meta
    files = [dataset.path / s["file"] for s in meta["splits"]["train"]["shards"]]
    assert len(files) > 3
    whole = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in files])
    assert dataset.num_tokens("train") == len(whole) == meta["splits"]["train"]["tokens"]
    assert np.array_equal(dataset.tokens("train", 95, 110), whole[95:205])  # spans two boundaries
    words = dataset.num_tokens("train") + dataset.num_tokens("val") - 80  # 80 documents, each ended by eos
    assert dataset.vocab_size == dataset.eos_id + 1 == words + 1
    assert dataset.num_documents("train") + dataset.num_documents("val") == 80
    assert Tokenizer.load(dataset.tokenizer_path).fingerprint == dataset.tokenizer_fingerprint
    assert isinstance(dataset._shards["train"][0], np.memmap) and not dataset._shards["train"][0].flags.writeable
    with pytest.raises(ValueError, match="split must be one of train, val, got 'test'"):
        dataset.num_tokens("test")


def test_windows_are_packed_next_token_pairs_covering_each_epoch(dataset):
    batches = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=4, seed=0)
    stream = _stream(dataset, "train")
    windows = (len(stream) - 1) // SEQ
    assert batches.windows == windows
    steps = -(-2 * windows // 4)  # two epochs and a bit
    rows = torch.cat([batches.batch(s)[0] for s in range(steps)])
    x, y = batches.batch(0)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, SEQ)
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = []
    for row in rows.numpy():  # every row is a window of the stream, starting at a multiple of seq_len
        found = [w for w in range(windows) if np.array_equal(stream[w * SEQ : w * SEQ + SEQ], row)]
        assert found
        starts.append(found[0])
    first, second = starts[:windows], starts[windows : 2 * windows]
    assert sorted(first) == sorted(second) == list(range(windows))  # each epoch visits every window once
    assert first != second and first != sorted(first)  # reshuffled every epoch
    assert starts[2 * windows :] == [batches.window_of(s) for s in range(2 * windows, len(starts))]


def test_same_seed_same_batches_other_seed_other_batches(dataset):
    a = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=4, seed=1)
    b = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=4, seed=1)
    c = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=4, seed=2)
    torch.manual_seed(0)
    np.random.seed(0)
    first = [a.batch(s)[0] for s in range(5)]
    torch.manual_seed(1)  # the global generators play no part
    np.random.seed(1)
    assert all(torch.equal(x, b.batch(s)[0]) for s, x in enumerate(first))
    assert not all(torch.equal(x, c.batch(s)[0]) for s, x in enumerate(first))
    unshuffled = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=4, shuffle=False)
    assert torch.equal(unshuffled.batch(1)[0][0], torch.from_numpy(_stream(dataset, "train")[4 * SEQ : 5 * SEQ]))


@pytest.mark.parametrize("world", [1, 2, 3, 6])
def test_data_parallel_shares_concatenate_to_the_global_batch(dataset, world):
    batches = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=6, seed=4)
    whole_x, whole_y = batches.batch(7)
    shares = [batches.batch(7, rank, world) for rank in range(world)]
    assert all(x.shape == (6 // world, SEQ) for x, _ in shares)
    assert torch.equal(torch.cat([x for x, _ in shares]), whole_x)
    assert torch.equal(torch.cat([y for _, y in shares]), whole_y)


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(dataset):
    batches = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=6, seed=0)
    with pytest.raises(ValueError, match="batch of 6 does not split evenly over 4 data-parallel ranks"):
        batches.batch(0, 0, 4)


def test_resuming_continues_at_the_same_sample_even_with_another_batch_size(dataset):
    run = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=6, seed=5)
    seen = torch.cat([run.next_batch()[0] for _ in range(30)])  # 180 samples: over an epoch boundary
    assert run.samples == 180 > run.windows
    interrupted = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=6, seed=5)
    interrupted.advance(11)
    state = interrupted.state_dict()
    assert state == {"samples": 66, "seed": 5, "fingerprint": dataset.fingerprint, "seq_len": SEQ, "split": "train"}
    ranks = [PackedBatches(dataset, "train", seq_len=SEQ, batch_size=4, seed=99) for _ in range(2)]
    for batches in ranks:  # one per data-parallel rank; the saved seed wins
        batches.load_state_dict(json.loads(json.dumps(state)))
    rows = [ranks[rank].next_batch(rank, 2)[0] for _ in range(28) for rank in range(2)]
    assert torch.equal(torch.cat(rows), seen[66:178])
    assert ranks[0].samples == ranks[1].samples == 66 + 28 * 4
    resumed = ranks[0]
    with pytest.raises(ValueError, match="saved with seq_len 8, now 16"):
        PackedBatches(dataset, "train", seq_len=16, batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="saved for another dataset"):
        resumed.load_state_dict({**state, "fingerprint": "0" * 64})


def test_eval_batches_are_the_val_split_in_order_every_time(dataset):
    train = PackedBatches(dataset, "train", seq_len=SEQ, batch_size=4, seed=3)
    train.next_batch()
    evals = train.eval_batches(3, batch_size=2)
    again = dataset.eval_batches(seq_len=SEQ, n=3, batch_size=2)
    val = _stream(dataset, "val")
    assert len(evals) == 3
    for i, ((x, y), (x2, y2)) in enumerate(zip(evals, again, strict=True)):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        for r in range(2):
            w = 2 * i + r
            assert torch.equal(x[r], torch.from_numpy(val[w * SEQ : w * SEQ + SEQ]))
            assert torch.equal(y[r], torch.from_numpy(val[w * SEQ + 1 : w * SEQ + SEQ + 1]))
    windows = (len(val) - 1) // SEQ
    short = dataset.eval_batches(seq_len=SEQ, n=100, batch_size=4)
    assert sum(x.shape[0] for x, _ in short) == windows  # a small split gives what it has


def test_too_few_tokens_and_damaged_datasets_are_named(dataset, tmp_path):
    with pytest.raises(ValueError, match=r"^dataset .*ds has \d+ val tokens, too few for one window of seq_len 4096"):
        PackedBatches(dataset, "val", seq_len=4096, batch_size=1)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in dataset.path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert TokenDataset(copy).fingerprint == dataset.fingerprint
    (copy / "train-00001.bin").write_bytes((copy / "train-00001.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"train-00001\.bin: 198 bytes, .*meta\.json says 100 tokens \(200 bytes\)"):
        TokenDataset(copy)
    (copy / "train-00001.bin").unlink()
    with pytest.raises(ValueError, match=r"train-00001\.bin: missing"):
        TokenDataset(copy)
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "version": 9}))
    with pytest.raises(ValueError, match=r"meta\.json: format version 9, this dtrain reads 1"):
        TokenDataset(copy)
    (copy / "meta.json").write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(ValueError, match=r"meta\.json: dtype 'float32', expected one of uint16, uint32"):
        TokenDataset(copy)
    (copy / "meta.json").unlink()
    with pytest.raises(ValueError, match=r"copy is not a prepared dataset: no meta\.json"):
        TokenDataset(copy)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("vocab_size", None),
        ("vocab_size", "512"),
        ("eos_id", None),
        ("eos_id", -1),
        ("fingerprint", None),
        ("tokenizer_fingerprint", 7),
        ("tokens", "many"),
    ],
)
def test_a_meta_json_missing_a_key_or_of_a_wrong_type_is_named(dataset, tmp_path, key, value):
    """What training reads of meta.json (the vocabulary, the end-of-text id, the fingerprints that guard a resume,
    each shard's tokens) is checked when the dataset is opened, not where a rank first reads it."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in dataset.path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    meta = json.loads((copy / "meta.json").read_text())
    if key == "tokens":
        meta["splits"]["train"]["shards"][0]["tokens"] = value
    elif value is None:
        del meta[key]
    else:
        meta[key] = value
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError) as e:
        TokenDataset(copy)
    message = str(e.value)
    assert str(copy / "meta.json") in message and key in message and "\n" not in message, message
