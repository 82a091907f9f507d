"""Text, JSONL and Parquet files -> token shards on disk, the format :mod:`dtrain.data.loader` reads.

A prepared dataset is a folder:

- ``train-00000.bin``, ``train-00001.bin``, ..., ``val-00000.bin``, ...: token ids, little-endian ``uint16``
  when the vocabulary has at most 65536 ids, else ``uint32``; every document's tokens followed by the
  end-of-text id, documents back to back in input order, a new shard every ``shard_tokens`` tokens (the
  layout of nanoGPT's and llm.c's ``.bin`` token files, https://github.com/karpathy/llm.c).
- ``tokenizer.json``: the tokenizer that made them.
- ``meta.json``: format version, dtype, tokens per shard, documents per split, vocab_size, eos_id, the
  tokenizer's fingerprint, a fingerprint of the tokens, the inputs' names and sizes.

Inputs: ``.jsonl`` / ``.jsonl.gz`` (a document per line, its ``text_key`` field), ``.parquet`` (the
``text_key`` column), any other file is one UTF-8 text document; a directory stands for its files, sorted.
Empty documents are skipped. The validation split is ``val_fraction`` of the documents (at least one when
there are two or more, and never all), chosen by a generator seeded with ``seed``.

Every input is read and checked before anything is written; the dataset is built in a temporary folder
beside ``out_dir`` and renamed into place, so an error leaves nothing behind.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dtrain.data.tokenizer import Tokenizer
from dtrain.files import new_directory

__all__ = [
    "FORMAT",
    "VERSION",
    "PreparedInfo",
    "Source",
    "check_out_dir",
    "has_records",
    "input_files",
    "prepare",
    "shard_dtype",
    "sources_from_paths",
]

FORMAT = "dtrain-tokens"
VERSION = 1
SPLITS = ("train", "val")
_BATCH_CHARS = 4_000_000  # characters tokenised per encode_batch call
_PARQUET_ROWS = 1024


def shard_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab_size <= 65536), else ``uint32``; little-endian."""
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class Source:
    """One input: ``documents()`` yields its non-empty documents; ``count()`` reads it all, checks every
    document and returns how many there are (raising a one-line ``ValueError`` naming the problem)."""

    name: str
    size: int
    documents: Callable[[], Iterator[str]]

    def count(self) -> int:
        return sum(1 for _ in self.documents())


@dataclass(frozen=True)
class PreparedInfo:
    """What :func:`prepare` wrote: the folder, and tokens / documents / shard files per split."""

    out_dir: Path
    dtype: str
    vocab_size: int
    eos_id: int
    tokens: dict[str, int] = field(default_factory=dict)
    documents: dict[str, int] = field(default_factory=dict)
    shards: dict[str, list[str]] = field(default_factory=dict)
    fingerprint: str = ""

    def summary(self) -> str:
        files = sum(len(v) for v in self.shards.values())
        return (
            f"{self.tokens['train'] + self.tokens['val']:,} tokens ({self.tokens['train']:,} train, "
            f"{self.tokens['val']:,} val), {self.documents['train'] + self.documents['val']:,} documents "
            f"({self.documents['train']:,} train, {self.documents['val']:,} val), {files} shards ({self.dtype}) "
            f"in {self.out_dir}"
        )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _text_source(path: Path) -> Source:
    def documents() -> Iterator[str]:
        text = _read_text(path)
        if text:
            yield text

    return Source(str(path), path.stat().st_size, documents)


def _jsonl_source(path: Path, text_key: str) -> Source:
    def documents() -> Iterator[str]:
        opener = gzip.open if path.name.endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as exc:
                        raise ValueError(f"{path} line {number}: not JSON ({_first_line(exc)})") from None
                    if not isinstance(record, dict) or text_key not in record:
                        raise ValueError(
                            f"{path} line {number}: no {text_key!r} key (choose the key with text_key, --text-key)"
                        )
                    text = record[text_key]
                    if text is None:
                        continue
                    if not isinstance(text, str):
                        raise ValueError(f"{path} line {number}: {text_key!r} is a {type(text).__name__}, not a string")
                    if not text.isascii():
                        try:
                            text.encode("utf-8")
                        except UnicodeEncodeError as exc:  # JSON's \ud800 escapes: half a pair, no character
                            raise ValueError(
                                f"{path} line {number}: {text_key!r} is not text: {exc.object[exc.start]!r} at "
                                f"{exc.start} is half of a surrogate pair"
                            ) from None
                    if text:
                        yield text
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None
        except (OSError, EOFError) as exc:
            raise ValueError(f"{path}: cannot read: {_first_line(exc)}") from None

    return Source(str(path), path.stat().st_size, documents)


def _parquet_source(path: Path, text_key: str) -> Source:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from None
    if text_key not in schema.names:
        raise ValueError(
            f"{path}: no column {text_key!r} (columns: {', '.join(schema.names)}; choose one with text_key, --text-key)"
        )
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ValueError(f"{path}: column {text_key!r} holds {kind}, not strings")

    def documents() -> Iterator[str]:
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_ROWS, columns=[text_key]):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield text
        except (OSError, pa.ArrowException) as exc:
            raise ValueError(f"{path}: cannot read: {_first_line(exc)}") from None

    return Source(str(path), path.stat().st_size, documents)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(inputs, str | os.PathLike):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )  # hidden files and folders (.git, ...) are left out
            if not found:
                raise ValueError(f"input directory {path} holds no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"input {path} does not exist")
    if not files:
        raise ValueError("no input files given")
    return files


def input_files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Every input file, directories expanded (sorted, hidden files left out); ValueError naming a missing input or
    an empty directory."""
    return _files(inputs)


def has_records(path: Path) -> bool:
    """Whether ``path`` is read as records with a text key or column (JSONL, Parquet) rather than as one text."""
    return path.name.lower().endswith((".jsonl", ".jsonl.gz", ".parquet"))


def sources_from_paths(inputs: Sequence[str | os.PathLike], *, text_key: str = "text") -> list[Source]:
    """The :class:`Source` of every input file (directories expanded, sorted), by file name ending."""
    sources = []
    for path in _files(inputs):
        name = path.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz")):
            sources.append(_jsonl_source(path, text_key))
        elif name.endswith(".parquet"):
            sources.append(_parquet_source(path, text_key))
        else:
            sources.append(_text_source(path))
    return sources


def _is_dataset(path: Path) -> bool:
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def check_out_dir(out: Path) -> None:
    if out.exists() and not (out.is_dir() and (_is_dataset(out) or not any(out.iterdir()))):
        raise ValueError(f"output {out} exists and is not a prepared dataset (choose a new --out or remove it)")


def _val_choice(documents: int, val_fraction: float, seed: int) -> np.ndarray:
    """A boolean mask over the documents: True for the validation split."""
    mask = np.zeros(documents, dtype=bool)
    if documents < 2 or val_fraction == 0:
        return mask
    count = min(max(1, round(documents * val_fraction)), documents - 1)
    mask[np.random.default_rng(seed).choice(documents, size=count, replace=False)] = True
    return mask


class _ShardWriter:
    """Token ids -> ``<split>-NNNNN.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int, digest) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens, self.digest = folder, split, dtype, shard_tokens, digest
        self.shards: list[dict] = []
        self.file = None
        self.documents = 0

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self.file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open()
            take = min(ids.size, self.shard_tokens - self.shards[-1]["tokens"])
            data = ids[:take].astype(self.dtype, copy=False).tobytes()
            self.file.write(data)
            self.digest.update(data)
            self.shards[-1]["tokens"] += take
            ids = ids[take:]

    def _open(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.file = open(self.folder / name, "wb")  # noqa: SIM115 (closed by close())
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)


def _batches(sources: Sequence[Source]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for source in sources:
        for text in source.documents():
            batch.append(text)
            chars += len(text)
            if chars >= _BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def build(
    sources: Sequence[Source],
    tokenizer: Tokenizer,
    parent: Path,
    *,
    val_fraction: float = 0.005,
    shard_tokens: int = 100_000_000,
    seed: int = 0,
    extra: dict | None = None,
) -> tuple[Path, dict]:
    """Check every source, then write the dataset into a new temporary folder inside ``parent``; returns the
    folder and its ``meta.json`` contents. The caller renames the folder into place (or removes it)."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be a positive integer, got {shard_tokens!r}")
    eos = tokenizer.eos_id
    if eos is None:
        raise ValueError(f"tokenizer {tokenizer.name} has no end-of-text token (one of <|endoftext|>, </s>, ...)")
    dtype = shard_dtype(tokenizer.vocab_size)
    counts = [source.count() for source in sources]  # reads and checks every input before anything is written
    total = sum(counts)
    if total == 0:
        names = ", ".join(s.name for s in sources[:3]) + (", ..." if len(sources) > 3 else "")
        raise ValueError(f"empty dataset: no text in {names}")
    is_val = _val_choice(total, val_fraction, seed)

    parent.mkdir(parents=True, exist_ok=True)
    folder = new_directory(parent, ".prepare-")
    try:
        writers = {split: _ShardWriter(folder, split, dtype, shard_tokens, hashlib.sha256()) for split in SPLITS}
        index = 0
        eos_array = np.array([eos], dtype=np.int64)
        for texts in _batches(sources):
            for ids in tokenizer.encode_batch(texts):
                writer = writers["val" if is_val[index] else "train"]
                writer.write(np.concatenate([np.asarray(ids, dtype=np.int64), eos_array]))
                writer.documents += 1
                index += 1
        for writer in writers.values():
            writer.close()
        if index != total:
            raise ValueError(f"inputs changed while being read: {total} documents counted, {index} read")
        tokenizer.save(folder / "tokenizer.json")
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": eos,
            "tokenizer": "tokenizer.json",
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "fingerprint": hashlib.sha256(
                ":".join([tokenizer.fingerprint, *(w.digest.hexdigest() for w in writers.values())]).encode()
            ).hexdigest(),
            "splits": {
                split: {"tokens": w.tokens, "documents": w.documents, "shards": w.shards}
                for split, w in writers.items()
            },
            "inputs": [{"name": s.name, "bytes": s.size} for s in sources],
            "val_fraction": val_fraction,
            "seed": seed,
            "shard_tokens": shard_tokens,
            **(extra or {}),
        }
        (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        return folder, meta
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def info_from_meta(out_dir: Path, meta: dict) -> PreparedInfo:
    splits = meta["splits"]
    return PreparedInfo(
        out_dir=out_dir,
        dtype=meta["dtype"],
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        tokens={s: splits[s]["tokens"] for s in SPLITS},
        documents={s: splits[s]["documents"] for s in SPLITS},
        shards={s: [shard["file"] for shard in splits[s]["shards"]] for s in SPLITS},
        fingerprint=meta["fingerprint"],
    )


def prepare(
    inputs: Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    *,
    text_key: str = "text",
    val_fraction: float = 0.005,
    shard_tokens: int = 100_000_000,
    seed: int = 0,
) -> PreparedInfo:
    """Tokenise ``inputs`` into a prepared dataset at ``out_dir`` (see the module docstring).

    ``out_dir`` may be new, an empty folder, or an earlier prepared dataset (replaced); anything else is an
    error. Bad inputs raise a one-line ``ValueError`` naming the file (and line) before anything is written.
    """
    out = Path(out_dir)
    check_out_dir(out)
    sources = sources_from_paths(inputs, text_key=text_key)
    folder, meta = build(
        sources, tokenizer, out.parent, val_fraction=val_fraction, shard_tokens=shard_tokens, seed=seed,
        extra={"text_key": text_key},
    )  # fmt: skip
    try:
        _install(folder, out)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return info_from_meta(out, meta)


def _install(folder: Path, out: Path) -> None:
    """Rename ``folder`` to ``out``; an existing dataset (or empty folder) at ``out`` is moved aside first."""
    if out.exists():
        check_out_dir(out)
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=".replaced-"))
        os.replace(out, old / "dataset")
        os.replace(folder, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(folder, out)
