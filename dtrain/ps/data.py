"""A click-through data set with power-law ids, generated offline from a seed, and a model for it.

Each example has ``len(vocab_sizes)`` categorical fields (think user, item, category); field ``f``'s ids follow
a Zipf law with exponent ``zipf`` over its vocabulary (id rank ``k`` drawn with probability proportional to
``k^-zipf``, then mapped through a fixed random permutation, as hashing ids would), which is what makes some
embedding rows hot (the load that hot-key copies, :mod:`dtrain.ps.hotkeys`, spread over servers). The click label
is drawn from a logistic teacher: a hidden weight per id plus a bias, so the task is learnable and its loss falls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ClickData", "zipf_ids"]


def zipf_ids(rng: np.random.Generator, vocab: int, exponent: float, size: int, permutation: np.ndarray) -> np.ndarray:
    """``size`` ids in ``[0, vocab)``: Zipf ranks with ``exponent`` (0 is uniform), permuted."""
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
    ranks = rng.choice(vocab, size=size, p=weights / weights.sum())
    return permutation[ranks].astype(np.int64)


@dataclass(kw_only=True)
class ClickData:
    """``examples`` rows of ids ``(examples, fields)`` (offset so that fields share one table) and labels."""

    vocab_sizes: tuple[int, ...] = (2000, 1000, 50)
    examples: int = 20_000
    zipf: float = 1.1
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.vocab_sizes or min(self.vocab_sizes) < 1 or self.examples < 1 or self.zipf < 0:
            raise ValueError(
                f"ClickData: bad vocab_sizes {self.vocab_sizes}, examples {self.examples} or zipf {self.zipf}"
            )
        rng = np.random.default_rng(self.seed)
        offsets = np.cumsum((0, *self.vocab_sizes[:-1]))
        cols = []
        for size, offset in zip(self.vocab_sizes, offsets, strict=True):
            cols.append(offset + zipf_ids(rng, size, self.zipf, self.examples, rng.permutation(size)))
        self.ids = np.stack(cols, axis=1)  # (N, F)
        teacher = rng.standard_normal(self.total_vocab) * 1.5
        logits = teacher[self.ids].sum(axis=1) - 0.5
        self.labels = (rng.random(self.examples) < 1 / (1 + np.exp(-logits))).astype(np.float32)  # (N,)

    @property
    def total_vocab(self) -> int:
        return int(sum(self.vocab_sizes))

    def batch(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The global batch of ``step``: ids ``(B, F)`` and labels ``(B,)``, cycling through the examples."""
        start = (step * batch_size) % self.examples
        index = (start + np.arange(batch_size)) % self.examples
        return self.ids[index], self.labels[index]
