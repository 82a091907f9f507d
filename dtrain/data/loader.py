"""Prepared token shards (:mod:`dtrain.data.prepare`) as read-only memory maps, and packed training batches.

:class:`PackedBatches` follows the packing of GPT-style pretraining (Brown et al. 2020, "Language Models are
Few-Shot Learners", section 2.3: documents joined by an end-of-text token and cut into full-length
sequences): a split's tokens, shards concatenated, are cut into windows of ``seq_len + 1`` tokens every
``seq_len`` tokens (a window's inputs are its first ``seq_len`` tokens, its targets the last ``seq_len``).
Epoch ``e`` visits the windows in a permutation drawn from a generator seeded by ``(seed, e)``; the epochs'
orders, one after the other, make one endless sequence of samples, and the global batch of step ``s`` is
samples ``[s * B, (s + 1) * B)``. A position in that sequence (a sample count) is all a checkpoint needs, so
a run resumes where it stopped even with another batch size or data-parallel width.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from dtrain.data.prepare import FORMAT, SPLITS, VERSION

__all__ = ["PackedBatches", "TokenDataset"]

_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_file_name(name) -> bool:
    """A file of the dataset's own folder: a name, not a path."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


def _check_meta(meta: dict, meta_path: Path) -> None:
    """ValueError naming ``meta_path`` and the key where what training reads of it is missing or of a wrong kind:
    the vocabulary, the end-of-text id, the fingerprints (a resume is held against them), each split's documents and
    each shard's file (a name in the dataset's folder) and tokens."""
    vocab = meta.get("vocab_size")
    if not _is_count(vocab) or vocab < 1:
        raise ValueError(f"{meta_path}: vocab_size: must be a positive integer, got {vocab!r}")
    eos = meta.get("eos_id")
    if not _is_count(eos) or eos >= vocab:
        raise ValueError(f"{meta_path}: eos_id: must be a token id below vocab_size {vocab}, got {eos!r}")
    for key in ("fingerprint", "tokenizer_fingerprint"):
        if not isinstance(meta.get(key), str):
            raise ValueError(f"{meta_path}: {key}: must be a string, got {meta.get(key)!r}")
    if not _is_file_name(meta.get("tokenizer", "tokenizer.json")):
        raise ValueError(f"{meta_path}: tokenizer: must be a file name, got {meta['tokenizer']!r}")
    splits = meta.get("splits")
    for split in SPLITS:
        entry = splits.get(split) if isinstance(splits, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            raise ValueError(f"{meta_path}: splits: {split}: must be an object with a list of shards")
        if not _is_count(entry.get("documents")):
            documents = entry.get("documents")
            raise ValueError(f"{meta_path}: splits: {split}: documents: must be a count, got {documents!r}")
        for shard in entry["shards"]:
            name = shard.get("file") if isinstance(shard, dict) else None
            if not _is_file_name(name):
                raise ValueError(f"{meta_path}: splits: {split}: shards: file must be a file name, got {name!r}")
            if not _is_count(shard.get("tokens")):
                raise ValueError(
                    f"{meta_path}: splits: {split}: {name}: tokens: must be a count, got {shard.get('tokens')!r}"
                )


class TokenDataset:
    """A prepared dataset folder, its shards opened read-only as ``numpy.memmap``.

    ``meta.json`` is checked first (format, version, dtype, every shard present with the size its token count
    implies); a problem is a one-line ``ValueError`` naming the file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"{self.path} is not a prepared dataset: no meta.json (make one with dtrain data prepare)")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{meta_path}: unreadable ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path}: not a {FORMAT} dataset description")
        if meta.get("version") != VERSION:
            raise ValueError(f"{meta_path}: format version {meta.get('version')!r}, this dtrain reads {VERSION}")
        if meta.get("dtype") not in _DTYPES:
            raise ValueError(f"{meta_path}: dtype {meta.get('dtype')!r}, expected one of {', '.join(_DTYPES)}")
        _check_meta(meta, meta_path)
        self.meta = meta
        self.dtype = _DTYPES[meta["dtype"]]
        self._shards: dict[str, list[np.memmap]] = {}
        self._starts: dict[str, np.ndarray] = {}
        try:
            for split in SPLITS:
                maps, starts = [], [0]
                for shard in meta["splits"][split]["shards"]:
                    file = self.path / shard["file"]
                    expected = int(shard["tokens"]) * self.dtype.itemsize
                    if not file.is_file():
                        raise ValueError(f"{file}: missing (listed in {meta_path})")
                    if file.stat().st_size != expected:
                        raise ValueError(
                            f"{file}: {file.stat().st_size} bytes, {meta_path} says {shard['tokens']} tokens "
                            f"({expected} bytes)"
                        )
                    if expected:
                        maps.append(np.memmap(file, dtype=self.dtype, mode="r"))
                        starts.append(starts[-1] + int(shard["tokens"]))
                self._shards[split] = maps
                self._starts[split] = np.asarray(starts, dtype=np.int64)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{meta_path}: malformed, missing or bad {exc}") from None

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.meta.get("tokenizer", "tokenizer.json")

    @property
    def fingerprint(self) -> str:
        """sha256 over the tokenizer's fingerprint and every token written: equal for equal datasets."""
        return self.meta["fingerprint"]

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.meta["tokenizer_fingerprint"]

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")

    def num_tokens(self, split: str = "train") -> int:
        self._check_split(split)
        return int(self._starts[split][-1])

    def num_documents(self, split: str = "train") -> int:
        self._check_split(split)
        return int(self.meta["splits"][split]["documents"])

    def tokens(self, split: str, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the split's stream (shards concatenated), as a new array."""
        self._check_split(split)
        starts, maps = self._starts[split], self._shards[split]
        if start < 0 or length < 0 or start + length > starts[-1]:
            raise ValueError(f"tokens [{start}, {start + length}) outside the {split} split's {starts[-1]} tokens")
        shard = int(np.searchsorted(starts, start, side="right")) - 1
        offset = start - int(starts[shard]) if maps else 0
        if maps and offset + length <= len(maps[shard]):
            return np.array(maps[shard][offset : offset + length])
        parts, left = [], length
        while left:
            piece = maps[shard][offset : offset + left]
            parts.append(piece)
            left -= len(piece)
            shard, offset = shard + 1, 0
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def eval_batches(self, *, seq_len: int, n: int, batch_size: int, split: str = "val"):
        """The first ``n`` batches of ``split`` in order, unshuffled: the same every call (see
        :meth:`PackedBatches.eval_batches`)."""
        batches = PackedBatches(self, split, seq_len=seq_len, batch_size=batch_size, shuffle=False)
        return batches.eval_batches(n, batch_size, split)

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.path)!r}, train={self.num_tokens('train')} tokens, "
            f"val={self.num_tokens('val')} tokens, vocab_size={self.vocab_size})"
        )


class PackedBatches:
    """Next-token batches of ``seq_len`` from one split of a :class:`TokenDataset` (see the module docstring).

    ``batch(step, rank, world)`` is rows ``[rank * B / world, (rank + 1) * B / world)`` of step ``step``'s global
    batch as int64 tensors ``x, y`` of shape ``(B / world, seq_len)``, ``y`` one token ahead of ``x``. No global
    random state is touched: the order is a function of ``seed`` alone.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        split: str = "train",
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        dataset._check_split(split)
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        tokens = dataset.num_tokens(split)
        self.windows = (tokens - 1) // seq_len if tokens > seq_len else 0
        if self.windows == 0:
            raise ValueError(
                f"dataset {dataset.path} has {tokens} {split} tokens, too few for one window of seq_len {seq_len} "
                f"(needs {seq_len + 1})"
            )
        self.dataset, self.split, self.seq_len, self.batch_size = dataset, split, seq_len, batch_size
        self.seed, self.shuffle = int(seed), shuffle
        self.samples = 0
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            generator = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._order = (epoch, generator.permutation(self.windows))
        return self._order[1]

    def window_of(self, sample: int) -> int:
        """The window (its start is ``window * seq_len``) that sample ``sample`` of the endless order reads."""
        epoch, index = divmod(sample, self.windows)
        return int(self._epoch_order(epoch)[index]) if self.shuffle else index

    def batch_at(self, sample_offset: int, count: int, rank: int = 0, world: int = 1):
        """This rank's share of samples ``[sample_offset, sample_offset + count)``: ``count / world`` rows."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        if count % world:
            raise ValueError(f"batch of {count} does not split evenly over {world} data-parallel ranks")
        rows = count // world
        first = sample_offset + rank * rows
        block = np.empty((rows, self.seq_len + 1), dtype=np.int64)
        for row in range(rows):
            start = self.window_of(first + row) * self.seq_len
            block[row] = self.dataset.tokens(self.split, start, self.seq_len + 1)
        import torch

        x = torch.from_numpy(np.ascontiguousarray(block[:, :-1]))  # (rows, T)
        y = torch.from_numpy(np.ascontiguousarray(block[:, 1:]))  # (rows, T)
        return x, y

    def batch(self, step: int, rank: int = 0, world: int = 1):
        """Step ``step``'s global batch (samples ``[step * B, (step + 1) * B)``), this rank's rows."""
        return self.batch_at(step * self.batch_size, self.batch_size, rank, world)

    def next_batch(self, rank: int = 0, world: int = 1):
        """The batch at the current position (:attr:`samples`), then the position moves past it."""
        out = self.batch_at(self.samples, self.batch_size, rank, world)
        self.samples += self.batch_size
        return out

    def advance(self, steps: int = 1) -> None:
        """Move the position past ``steps`` batches."""
        self.samples += steps * self.batch_size

    @property
    def epoch(self) -> float:
        return self.samples / self.windows

    def state_dict(self) -> dict:
        return {
            "samples": self.samples,
            "seed": self.seed,
            "fingerprint": self.dataset.fingerprint,
            "seq_len": self.seq_len,
            "split": self.split,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state["samples"]`` in the saved seed's order; the dataset and seq_len must match (the
        batch size may differ)."""
        if state.get("fingerprint") != self.dataset.fingerprint:
            raise ValueError(
                f"the data position was saved for another dataset (fingerprint {str(state.get('fingerprint'))[:12]}"
                f", {self.dataset.path} has {self.dataset.fingerprint[:12]})"
            )
        if state.get("seq_len") != self.seq_len:
            raise ValueError(f"the data position was saved with seq_len {state.get('seq_len')}, now {self.seq_len}")
        self.seed = int(state["seed"])
        self._order = None
        self.samples = int(state["samples"])

    def eval_batches(self, n: int, batch_size: int | None = None, split: str = "val"):
        """The first ``n`` batches of ``split`` (default: the validation split) in window order, unshuffled, each
        ``batch_size`` rows (default: this object's): the same list every call. A split with fewer than
        ``n * batch_size`` windows gives fewer batches, the last possibly short."""
        batch_size = batch_size or self.batch_size
        ordered = PackedBatches(self.dataset, split, seq_len=self.seq_len, batch_size=batch_size, shuffle=False)
        total = min(n * batch_size, ordered.windows)
        return [ordered.batch_at(s, min(batch_size, total - s)) for s in range(0, total, batch_size)]
