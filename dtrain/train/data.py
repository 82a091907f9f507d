"""Training data that needs no download: Python's own help texts, and synthetic classification.

- Text: every topic of ``pydoc_data.topics`` (the texts behind ``help("FOR")``, shipped with CPython; about
  700 KB of English and Python), joined in sorted topic order, tokenised by character with the vocabulary
  (the sorted set of characters) kept beside the ids. Batches are ``(B, T)`` windows ``x`` with next-token
  targets ``y`` (nanoGPT's ``get_batch``), drawn from a generator seeded by ``(seed, step)``: every rank draws
  the same global batch at the same step and data parallel takes its shard
  (:func:`dtrain.parallel.data_parallel.split_batch`); a resumed run draws what the uninterrupted one would.
- Classification: Gaussian inputs labelled by a fixed random linear teacher (``argmax(x @ W)``), drawn the
  same way from ``(seed, step)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CharTokenizer", "ClassificationBatches", "TextBatches", "load_corpus"]

_STEP_STRIDE = 1_000_003  # a prime: (seed, step) pairs map to distinct generator seeds for steps below it


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * _STEP_STRIDE + step)


def load_corpus() -> str:
    """The text of every ``pydoc_data.topics`` topic, in sorted topic order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


@dataclass(frozen=True)
class CharTokenizer:
    """Characters <-> ids; ``vocab`` is the sorted string of known characters (id = position)."""

    vocab: str

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        index = {ch: i for i, ch in enumerate(self.vocab)}
        unknown = sorted(set(text) - index.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {unknown[:10]!r}")
        return torch.tensor([index[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "char", "vocab": self.vocab}))

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        return cls(json.loads(Path(path).read_text())["vocab"])


class TextBatches:
    """``batch(step)`` -> ``(x, y)``, each ``(batch_size, block_size)`` token ids, ``y`` shifted by one."""

    def __init__(self, ids: torch.Tensor, *, batch_size: int, block_size: int, seed: int) -> None:
        if ids.dim() != 1 or ids.numel() <= block_size:
            raise ValueError(f"need a 1-D corpus longer than block_size {block_size}, got shape {tuple(ids.shape)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.ids, self.batch_size, self.block_size, self.seed = ids, batch_size, block_size, seed

    @classmethod
    def from_corpus(cls, *, batch_size: int, block_size: int, seed: int) -> tuple[TextBatches, CharTokenizer]:
        text = load_corpus()
        tokenizer = CharTokenizer.from_text(text)
        return cls(tokenizer.encode(text), batch_size=batch_size, block_size=block_size, seed=seed), tokenizer

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            self.ids.numel() - self.block_size, (self.batch_size,), generator=_generator(self.seed, step)
        )
        offsets = torch.arange(self.block_size)
        x = self.ids[starts[:, None] + offsets]  # (B, T)
        y = self.ids[starts[:, None] + offsets + 1]  # (B, T)
        return x, y


class ClassificationBatches:
    """``batch(step)`` -> ``(x, labels)``: ``x`` is ``(B, in_features)``, labels ``(B,)`` from a linear teacher."""

    def __init__(self, *, in_features: int, num_classes: int, batch_size: int, seed: int) -> None:
        self.in_features, self.batch_size, self.seed = in_features, batch_size, seed
        self.teacher = torch.randn(in_features, num_classes, generator=_generator(seed, _STEP_STRIDE - 1))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, self.in_features, generator=_generator(self.seed, step))  # (B, F)
        return x, (x @ self.teacher).argmax(dim=1)  # (B,)
