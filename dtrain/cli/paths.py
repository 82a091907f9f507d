"""Output paths on the command line: checked before any work starts, written whole or not at all.

:func:`check_file_out` and :func:`check_dir_out` refuse, with a ``ValueError`` naming the flag and the path, an
output that cannot be written: a directory where a file goes (or a file where a directory goes), a regular file on
the path above it, or a directory that does not let this process write. Nothing is made: a probe file is written
and removed in the nearest directory that exists (as ``dtrain train`` checks its ``--out``). :func:`write_atomic`
and :func:`atomic_path` write through a temporary file beside the target, renamed over it only once complete, so
that a failure leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["check_file_out", "check_dir_out", "write_atomic", "atomic_path"]


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _probe(flag: str, path: str | os.PathLike, start: Path) -> None:
    """Write and remove a file in the nearest existing directory at or above ``start``."""
    existing = next(p for p in (start, *start.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory")
    probe = existing / f".dtrain-write-check-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write in {existing} ({_reason(exc)})") from None


def check_file_out(flag: str, path: str | os.PathLike) -> None:
    """Refuse ``path`` as the file ``flag`` writes where it cannot be: a directory or another non-regular file
    (a device, a pipe) is there, or its directory cannot be made or written. Nothing is made."""
    target = Path(os.path.abspath(path))
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory (give a file name)")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag} {path}: not a regular file")
    _probe(flag, path, target.parent)


def check_dir_out(flag: str, path: str | os.PathLike) -> None:
    """Refuse ``path`` as the directory ``flag`` writes in where it cannot be: a file is there or above it, or it
    cannot be made or written. Nothing is made."""
    target = Path(os.path.abspath(path))
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    _probe(flag, path, target)


def _temporary(path: Path) -> Path:
    """A new name beside ``path``, hidden and with the same suffix (writers that pick a format by it keep it)."""
    return path.with_name(f".{path.stem}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed to ``path`` when the block ends, removed if it
    raises. The parent directories are made."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(target)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Replace ``path`` with ``data`` (text is UTF-8), all of it or, on a failure, nothing; the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)
