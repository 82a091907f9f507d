"""Writing files and folders so that a reader never sees them half made, of the modes the umask gives new ones."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["new_directory", "write_atomically"]


def write_atomically(file: str | os.PathLike, data: bytes | str) -> None:
    """``data`` (text as UTF-8) into a new file beside ``file``, of the mode the umask gives new files, renamed over
    ``file``; nothing is left behind where the write fails."""
    file = Path(file)
    tmp = file.with_name(f".{file.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def new_directory(parent: str | os.PathLike, prefix: str, suffix: str = "") -> Path:
    """A new empty directory in ``parent`` under a name no other has, of the mode the umask gives new directories
    (``tempfile.mkdtemp`` makes them private to the owner, which a folder renamed into place would stay)."""
    while True:
        path = Path(parent) / f"{prefix}{uuid.uuid4().hex[:12]}{suffix}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
