"""A token dataset that needs no download: the help texts that ship with Python.

Every topic of ``pydoc_data.topics`` (the texts behind ``help("FOR")``, part of CPython's standard library:
79 topics, about 460 KB of English and Python in 3.11) is one document, in sorted topic order; a byte-level
BPE (:meth:`dtrain.data.tokenizer.Tokenizer.train_bpe`) is trained on them and the documents are prepared
(:func:`dtrain.data.prepare.build`) once into ``<cache_dir>/pydoc-bpe-<vocab_size>``, reused afterwards. Given a
tokenizer (a pretrained model's), the documents are prepared with it instead, into
``<cache_dir>/pydoc-<its fingerprint>``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dtrain.data.loader import TokenDataset
from dtrain.data.prepare import Source, build
from dtrain.data.tokenizer import Tokenizer

__all__ = ["DEFAULT_VAL_FRACTION", "default_dataset", "pydoc_documents"]

DEFAULT_VAL_FRACTION = 0.05  # 4 of the 79 topics


def pydoc_documents() -> list[str]:
    """The text of every ``pydoc_data.topics`` topic, sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def _valid(path: Path) -> bool:
    try:
        dataset = TokenDataset(path)
        return Tokenizer.load(dataset.tokenizer_path).fingerprint == dataset.tokenizer_fingerprint
    except ValueError:
        return False


def default_dataset(
    cache_dir: str | os.PathLike, vocab_size: int = 512, *, tokenizer: Tokenizer | None = None
) -> tuple[Path, Path]:
    """``(dataset folder, tokenizer.json path)`` of the pydoc dataset with a ``vocab_size`` BPE, or tokenized by
    ``tokenizer`` where given, built on first use (about a second). Safe when several processes ask at once: each
    builds in its own temporary folder and renames it into place; the first rename wins and the others discard
    their copy."""
    name = f"pydoc-bpe-{vocab_size}" if tokenizer is None else f"pydoc-{tokenizer.fingerprint[:16]}"
    target = Path(cache_dir) / name
    if not _valid(target):
        documents = pydoc_documents()
        if tokenizer is None:
            tokenizer = Tokenizer.train_bpe(documents, vocab_size)

        def texts() -> Iterator[str]:
            yield from documents

        version = ".".join(map(str, sys.version_info[:3]))
        source = Source(f"pydoc_data.topics (Python {version})", sum(len(d.encode()) for d in documents), texts)
        folder, _ = build([source], tokenizer, target.parent, val_fraction=DEFAULT_VAL_FRACTION, seed=0)
        if _valid(target):  # another process finished first
            shutil.rmtree(folder, ignore_errors=True)
            return target, target / "tokenizer.json"
        if target.exists():  # an invalid leftover (an interrupted copy, a damaged file) is moved aside
            trash = Path(tempfile.mkdtemp(dir=target.parent, prefix=".discard-"))
            with contextlib.suppress(OSError):
                os.rename(target, trash / "dataset")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(folder, target)
        except OSError:  # another process renamed its copy first
            shutil.rmtree(folder, ignore_errors=True)
            if not _valid(target):
                raise
    return target, target / "tokenizer.json"
