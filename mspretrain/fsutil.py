"""Durability helpers shared by the writers of shards, data dirs, checkpoints and run files, and the
one way to read a JSON file a person may have edited or truncated."""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from mspretrain.errors import UserError


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | Path, *, text: bool = False, fsync: bool = True) -> Iterator[IO]:
    """A file to write `path` through, in pieces: a reader, or a crash at any moment, sees either
    the old file whole or the new one whole, never a torn one. `text=True` writes UTF-8 text.

    The temporary file lives in the same directory (os.replace is atomic only within one
    filesystem) and is removed if the block raises. `fsync=False` skips both fsyncs: still atomic
    for readers, but not durable across a power cut (for caches, or files the caller fsyncs later)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") if text else os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_path(path.parent)  # makes the rename itself survive a crash


def atomic_write(path: str | Path, data: bytes | str, *, fsync: bool = True) -> None:
    """Replace `path` with `data` atomically (see `atomic_writer`); `str` is written as UTF-8."""
    with atomic_writer(path, fsync=fsync) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else bytes(data))


def read_json(path: str | Path, fix: str) -> Any:
    """The parsed JSON of `path`, or a one-line UserError naming the file (unreadable, not UTF-8,
    not JSON). Whether the file exists, and what the document must hold, is the caller's to say."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not valid JSON (not UTF-8 at byte {e.start})", fix) from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})", fix) from None
    try:
        return json.loads(text)
    except ValueError as e:  # json.JSONDecodeError; its message names the line and column
        raise UserError(f"{path} is not valid JSON ({' '.join(str(e).split())})", fix) from None
