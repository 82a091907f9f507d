"""dtrain.data.tokenizer: byte-level BPE training, round trips, loading and fingerprints."""

from __future__ import annotations

import json

import pytest

from dtrain.data.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def f(x):\n    return x * 2\n\n\tprint(f(21))\n",
    "Unicode: héllo wörld, 中文字符, emoji 😀🚀, and ‘quotes’.",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.train_bpe(TEXTS * 5, 300)


@pytest.mark.parametrize(
    "text", ["", "plain", "  leading and trailing  ", "never seen: ʕ•ᴥ•ʔ ∑ 𝔘", "tabs\t\tand\r\nnewlines\n\n", *TEXTS]
)
def test_any_text_round_trips(bpe, text):
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


def test_train_bpe_learns_merges_and_has_the_eos_token(bpe):
    assert 256 < bpe.vocab_size <= 300
    assert bpe.eos_id == bpe.backend.token_to_id("<|endoftext|>")
    text = TEXTS[0]
    assert len(bpe.encode(text)) < len(text.encode()) / 2  # merges shorten the byte sequence
    assert bpe.decode([*bpe.encode("a"), bpe.eos_id]) == "a<|endoftext|>"
    assert bpe.encode_batch(TEXTS) == [bpe.encode(t) for t in TEXTS]


def test_train_bpe_is_deterministic_and_depends_on_the_text(bpe):
    again = Tokenizer.train_bpe(TEXTS * 5, 300)
    assert again.to_json() == bpe.to_json()
    assert again.fingerprint == bpe.fingerprint
    other = Tokenizer.train_bpe(["completely different words here"] * 5, 300)
    assert other.fingerprint != bpe.fingerprint


def test_train_bpe_refuses_a_vocabulary_below_the_byte_alphabet():
    with pytest.raises(ValueError, match="vocab_size must be an integer of at least 257"):
        Tokenizer.train_bpe(TEXTS, 200)


def test_save_and_load_keep_the_tokenizer(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]  # no temporary file left
    loaded = Tokenizer.load(path)
    assert loaded.fingerprint == bpe.fingerprint
    assert (loaded.vocab_size, loaded.eos_id) == (bpe.vocab_size, bpe.eos_id)
    for text in TEXTS:
        assert loaded.encode(text) == bpe.encode(text)
    loaded.save(path)  # saving over an existing file, and reformatting the JSON, keep the fingerprint
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4))
    assert Tokenizer.load(path).fingerprint == bpe.fingerprint


def test_eos_is_found_by_name_or_from_tokenizer_config(tmp_path):
    sentencepiece_style = Tokenizer.train_bpe(TEXTS, 270, special_tokens=("<s>", "</s>"))
    assert sentencepiece_style.eos_id == sentencepiece_style.backend.token_to_id("</s>")
    none = Tokenizer.train_bpe(TEXTS, 270, special_tokens=("<pad>",))
    assert none.eos_id is None
    path = tmp_path / "tokenizer.json"
    none.save(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert Tokenizer.load(path).eos_id == none.backend.token_to_id("<pad>")


def test_load_names_a_missing_or_corrupt_file(tmp_path):
    with pytest.raises(ValueError, match=r"^tokenizer file .*nope\.json does not exist$"):
        Tokenizer.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    for text in ("{not json", json.dumps({"model": {"type": "Nonsense"}})):
        bad.write_text(text)
        with pytest.raises(ValueError, match=r"bad\.json is not a valid tokenizer\.json") as info:
            Tokenizer.load(bad)
        assert "\n" not in str(info.value)


def test_the_vocabulary_covers_the_largest_id_where_ids_leave_gaps(bpe, tmp_path):
    """A tokenizer.json whose end-of-text token has an id past its token count: the vocabulary (and so the shards'
    dtype and the model's embedding) reaches that id, and the id is stored as it is."""
    import numpy as np

    from dtrain.data.loader import TokenDataset
    from dtrain.data.prepare import prepare

    raw = json.loads(bpe.backend.to_str())
    eos = bpe.eos_id
    far = 70_000  # past uint16
    raw["model"]["vocab"]["<|endoftext|>"] = far
    for token in raw["added_tokens"]:
        if token["id"] == eos:
            token["id"] = far
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    gapped = Tokenizer.load(tmp_path / "tokenizer.json")
    assert gapped.eos_id == far and gapped.vocab_size == far + 1
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    prepare([tmp_path / "docs.jsonl"], gapped, tmp_path / "data", val_fraction=0.0)
    data = TokenDataset(tmp_path / "data")
    assert data.vocab_size == far + 1 and data.dtype == np.dtype("<u4")
    tokens = data.tokens("train", 0, data.num_tokens("train"))
    assert (tokens == far).sum() == len(TEXTS) and tokens.max() == far
