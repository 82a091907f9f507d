"""A thin wrapper over the Hugging Face ``tokenizers`` library (https://huggingface.co/docs/tokenizers).

:meth:`Tokenizer.load` reads any ``tokenizer.json`` (GPT-2, Llama, Mistral, ...); :meth:`Tokenizer.train_bpe`
trains a byte-level BPE the way GPT-2 does (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", section 2.2): text is split by GPT-2's pre-tokenizer regex, mapped to bytes, and merged from a
256-symbol byte alphabet, so every string encodes and decodes back to itself.

Encoding adds no special tokens (no BOS, no template): a document's ids are exactly its text's tokens, and
:mod:`dtrain.data.prepare` appends the end-of-text id itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from dtrain.files import write_atomically

__all__ = ["EOS_TOKENS", "Tokenizer"]

# End-of-text tokens, in the order they are looked for: GPT-2's, SentencePiece's (Llama 2, Mistral), Llama 3's.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _config_eos(path: Path) -> str | None:
    """The ``eos_token`` of a ``tokenizer_config.json`` beside ``path`` (Hugging Face's layout), if any."""
    config = path.with_name("tokenizer_config.json")
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class Tokenizer:
    """Text <-> token ids through a Hugging Face ``tokenizers.Tokenizer``.

    ``eos_token`` names the end-of-text token when it is not one of :data:`EOS_TOKENS` (for example a
    tokenizer's own ``eos_token`` from its ``tokenizer_config.json``); it must be in the vocabulary.
    """

    def __init__(self, backend, *, eos_token: str | None = None, name: str = "tokenizer") -> None:
        self.backend = backend
        self.name = name
        if eos_token is not None and backend.token_to_id(eos_token) is None:
            raise ValueError(f"{name}: eos token {eos_token!r} is not in the vocabulary")
        self.eos_token = eos_token

    @classmethod
    def load(cls, path: str | os.PathLike, *, eos_token: str | None = None) -> Tokenizer:
        """Read a ``tokenizer.json``; a missing or unreadable file is a one-line ``ValueError`` naming it.

        The end-of-text token is ``eos_token`` if given, else the ``eos_token`` of a ``tokenizer_config.json``
        in the same folder, else the first of :data:`EOS_TOKENS` in the vocabulary.
        """
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {path} does not exist")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # the library raises its own Exception type for every parse error
            raise ValueError(f"tokenizer file {path} is not a valid tokenizer.json: {_first_line(exc)}") from None
        if eos_token is None:
            eos_token = _config_eos(path)
            if eos_token is not None and backend.token_to_id(eos_token) is None:
                eos_token = None
        return cls(backend, eos_token=eos_token, name=str(path))

    @classmethod
    def train_bpe(
        cls, texts: Iterable[str], vocab_size: int, *, special_tokens: Sequence[str] = ("<|endoftext|>",)
    ) -> Tokenizer:
        """A byte-level BPE with at most ``vocab_size`` tokens (the 256 bytes, ``special_tokens``, then merges).

        Deterministic: the same texts give the same tokenizer (and :attr:`fingerprint`).
        """
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers, trainers

        special_tokens = list(special_tokens)
        smallest = 256 + len(special_tokens)
        if not isinstance(vocab_size, int) or vocab_size < smallest:
            raise ValueError(
                f"vocab_size must be an integer of at least {smallest} (256 bytes + {len(special_tokens)} special "
                f"tokens), got {vocab_size!r}"
            )
        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=special_tokens,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        return cls(backend, name=f"byte-level BPE ({vocab_size})")

    @property
    def vocab_size(self) -> int:
        """One more than the largest id, added (special) tokens included: the rows of an embedding these ids
        index, and more than the number of tokens where a tokenizer.json leaves ids unused."""
        count = self.backend.get_vocab_size(with_added_tokens=True)
        largest = max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        return max(count, largest + 1)

    @property
    def eos_id(self) -> int | None:
        """The id of the end-of-text token, None when the tokenizer has none."""
        for token in (self.eos_token, *EOS_TOKENS):
            if token is not None:
                found = self.backend.token_to_id(token)
                if found is not None:
                    return found
        return None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text, computed in parallel by the library."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        """The canonical ``tokenizer.json`` text: keys sorted, no whitespace."""
        return json.dumps(json.loads(self.backend.to_str()), sort_keys=True, separators=(",", ":"))

    @property
    def fingerprint(self) -> str:
        """sha256 (hex) of :meth:`to_json`: equal for tokenizers that encode and decode alike."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` atomically (a temporary file in the same folder, then ``os.replace``), of the
        mode the umask gives new files."""
        write_atomically(path, self.backend.to_str(pretty=True))

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
