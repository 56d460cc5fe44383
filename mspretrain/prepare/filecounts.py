"""What reading the input files found, per file and in total, for `prepare`'s manifest.

`FileCounts` is one input file's counters (documents, dropped bytes, cut documents, broken
records, why a file was skipped); `SourceStats` holds them in reading order and sums them, so a
loss is traced to its file. Nothing is counted in module state: undecodable bytes reach the
counts of the file being decoded through a context variable (`counting_into`), the one place a
process-wide codec error handler can find them.
"""
from __future__ import annotations

import codecs
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator


@dataclass
class FileCounts:
    """What reading one input file found. The readers fill one per file; `SourceStats` sums them,
    and the manifest lists them (`input_files`), so a file that lost bytes or documents is named."""

    name: str  # the file as the user named it (under the input dir or glob), not resolved
    path: Path | None = None  # where it was read (resolved); named in warnings, not in the manifest
    status: str = "read"  # or why it was skipped: "empty", "unreadable", "binary"; "corrupt" = read in part
    encoding: str = ""  # the label of the encoding it was read in; "" when it was not read
    bytes_in: int = 0  # bytes on disk (compressed size for .gz/.zst)
    documents: int = 0
    bytes_dropped: int = 0  # undecodable bytes the decoder removed
    surrogates_dropped: int = 0  # lone "\udXXX" escapes removed from .jsonl text
    split_long: int = 0  # documents cut at MAX_DOC_CHARS
    jsonl_broken: int = 0
    jsonl_no_field: int = 0
    jsonl_too_long: int = 0
    mixed_gb18030_lines: int = 0  # in a file mixing encodings: lines read as GB18030 ...
    mixed_bad_lines: int = 0  # ... and lines that fit neither (their bad bytes dropped)
    raw: bool = False  # read as `RawLines` blocks, decoded (and counted) by the caller
    offsets: str = ""  # what its documents' origin offsets mean: "byte" or "row" (`data/origin.py`); "" if not read

    _REPORTED = ("documents", "bytes_dropped", "surrogates_dropped", "split_long", "jsonl_broken", "jsonl_no_field",
                 "jsonl_too_long", "mixed_gb18030_lines", "mixed_bad_lines")

    def to_dict(self) -> dict:
        """The manifest's entry: name, status, encoding, bytes, and the counters that are not zero."""
        d: dict = {"name": self.name, "status": self.status}
        if self.encoding:
            d["encoding"] = self.encoding
        d["bytes"] = self.bytes_in
        d.update((k, getattr(self, k)) for k in self._REPORTED if getattr(self, k) or k == "documents")
        return d


# Undecodable bytes are dropped and counted through a named codec error handler. The registry of
# error handlers is process-wide, so the handler finds the counts of the file being decoded
# through a context variable, set only while that file's decoder runs (`counting_into`).
_COUNTS: ContextVar[FileCounts | None] = ContextVar("mspretrain_file_counts", default=None)


def _count_and_drop(exc: UnicodeError) -> tuple[str, int]:
    if isinstance(exc, UnicodeDecodeError):
        counts = _COUNTS.get()
        if counts is not None:
            counts.bytes_dropped += exc.end - exc.start
        return "", exc.end
    raise exc


codecs.register_error("mspretrain.drop", _count_and_drop)


@contextmanager
def counting_into(counts: FileCounts) -> Iterator[FileCounts]:
    token = _COUNTS.set(counts)
    try:
        yield counts
    finally:
        _COUNTS.reset(token)


def counting() -> FileCounts | None:
    """The counts of the file being decoded now (`counting_into`), or None."""
    return _COUNTS.get()


def counted(batches: Iterable, counts: FileCounts) -> Iterator:
    """`batches`, with `counts` receiving the dropped bytes of each step of the reader, and only
    of it: between steps the consumer runs (and may decode another file's blocks)."""
    it = iter(batches)
    while True:
        with counting_into(counts):
            try:
                batch = next(it)
            except StopIteration:
                return
        yield batch


@dataclass
class SourceStats:
    """What the readers saw: one `FileCounts` per input file, and their totals for the manifest."""

    per_file: list[FileCounts] = field(default_factory=list)  # in reading order
    ignored: int = 0  # files in walked directories that are not .txt/.jsonl

    def _sum(self, key: str) -> int:
        return sum(getattr(f, key) for f in self.per_file)

    @property
    def files(self) -> int:
        """Files read (a corrupt one too: read up to its damage)."""
        return sum(1 for f in self.per_file if f.encoding)

    @property
    def by_encoding(self) -> Counter:
        return Counter(f.encoding for f in self.per_file if f.encoding)

    @property
    def skipped(self) -> Counter:  # reason -> files
        return Counter(f.status for f in self.per_file if f.status != "read")

    @property
    def bytes_in(self) -> int:
        return self._sum("bytes_in")

    @property
    def bytes_dropped(self) -> int:
        return self._sum("bytes_dropped") + self._sum("surrogates_dropped")

    @property
    def documents(self) -> int:
        return self._sum("documents")

    @property
    def split_long(self) -> int:
        return self._sum("split_long")

    @property
    def jsonl_broken(self) -> int:
        return self._sum("jsonl_broken")

    @property
    def jsonl_no_field(self) -> int:
        return self._sum("jsonl_no_field")

    @property
    def jsonl_too_long(self) -> int:
        return self._sum("jsonl_too_long")

    def per_file_dicts(self) -> list[dict]:
        return [f.to_dict() for f in self.per_file]

    def to_dict(self) -> dict:
        return {"files": self.files, "by_encoding": dict(sorted(self.by_encoding.items())),
                "skipped": dict(sorted(self.skipped.items())), "ignored": self.ignored,
                "bytes_in": self.bytes_in, "bytes_dropped": self.bytes_dropped,
                "documents": self.documents, "split_long": self.split_long,
                "jsonl_broken": self.jsonl_broken, "jsonl_no_field": self.jsonl_no_field,
                "jsonl_too_long": self.jsonl_too_long}

