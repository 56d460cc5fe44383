"""Pass 1's kept documents on disk, for pass 2 to tokenize once the tokenizer is trained.

Trade-off: a spool the size of the cleaned text on disk, instead of cleaning twice.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable, Iterator

from mspretrain.fsutil import cut_back


class Spool:
    """Length-prefixed UTF-8 documents on disk, between pass 1 and pass 2."""

    def __init__(self, path: Path, state: dict | None = None) -> None:
        """A new spool, or (`state`, from `state()`) the one being written, cut back to that
        state: `prepare` resumes its replay after a kill this way."""
        self.path = path
        if state is None:
            self._f = open(path, "wb")
            self.documents = 0
            return
        cut_back(path, state["bytes"])  # a torn tail written after the state was taken
        self._f = open(path, "ab")
        self.documents = state["documents"]

    def state(self) -> dict:
        """Flush; what `Spool(path, state)` resumes from."""
        self._f.flush()
        return {"bytes": self._f.tell(), "documents": self.documents}

    def files(self) -> list[Path]:
        return [self.path]

    def add_many(self, texts: list[str]) -> None:
        for t in texts:
            b = t.encode("utf-8")
            self._f.write(struct.pack("<I", len(b)) + b)
        self.documents += len(texts)

    def close(self) -> None:
        self._f.close()

    def read(self, progress: Callable[[int], None] | None, skip: int = 0) -> Iterator[str]:
        return read_spool(self.path, progress, skip)


def read_spool(path: Path, progress: Callable[[int], None] | None, skip: int = 0) -> Iterator[str]:
    """A spool's documents in order, after the first `skip` (stepped over, not decoded: a
    resumed `prepare` starts encoding where its last commit was)."""
    with open(path, "rb") as f:
        for _ in range(skip):
            (n,) = struct.unpack("<I", f.read(4))
            f.seek(n, 1)
            if progress:
                progress(n + 4)
        while head := f.read(4):
            (n,) = struct.unpack("<I", head)
            yield f.read(n).decode("utf-8")
            if progress:
                progress(n + 4)
