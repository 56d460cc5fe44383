"""One-document-per-line and .jsonl files as blocks of whole lines, not decoded yet (`RawLines`).

For prepare's local workers, uncompressed one-document-per-line and .jsonl files come as
references to blocks of whole lines (decoded and parsed where they are read: `decode_raw`), so
prepare's main process only finds where blocks end. A compressed file is read here in blocks by
whoever decompresses it; a damaged stream keeps the whole lines before the damage. A line with no
end for too long switches the rest of its file to the decoding reader of `prepare/textdocs.py`.
"""
from __future__ import annotations

import codecs
import io
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from mspretrain.prepare import textdocs
from mspretrain.prepare.filecounts import FileCounts, SourceStats, counting_into
from mspretrain.prepare.sniff import read_errors
from mspretrain.prepare.textdocs import (
    Docs,
    LineStarts,
    batched,
    break_ends,
    docs_of,
    jsonl_docs,
    jsonl_record,
    line_doc_batches,
    origin_records,
    whole_lines_docs,
    with_origin,
)

# Codecs in which the byte b"\n" is only ever a newline (never part of a multi-byte character),
# so a file can be cut into blocks of whole lines before it is decoded.
RAW_CODECS = ("utf-8", "utf-8-sig", "gb18030")
RAW_READ_BYTES = 3 << 18  # bytes per read of a file passed on as `RawLines` (~260 K Chinese characters)


@dataclass
class RawLines:
    """Whole lines of a one-document-per-line file, not decoded yet.

    `prepare` hands these to its worker processes, so its main process only reads bytes: it
    used to decode, split and pickle every document (~1 CPU s per 50 MB, serial). Cutting after
    a b"\n" keeps decoding exact (undecodable bytes and \r\n pairs never straddle a cut) and
    keeps the documents those of the `readline` loop."""

    data: bytes | None  # None: a reference, `size` bytes of the file `path` at `offset` (`load`)
    codec: str
    file: int  # index into `SourceStats.per_file`
    offset: int = 0  # where `data` starts in the (decompressed) file: the origin of its documents
    path: str | None = None
    size: int = 0
    rest: list["RawLines"] | None = None  # blocks of the same file that follow, decoded with it (`pool.chunks`)
    jsonl: str | None = None  # a .jsonl file's block: the records' text field (`_jsonl_line_docs`); None: a document per line

    def load(self) -> "RawLines":
        """The block with its bytes: a reference (an uncompressed file read by local workers,
        `iter_file_batches(by_reference=True)`) is read here, in the worker, not by prepare's main
        process, which then only finds where blocks end (a few KB per block)."""
        if self.data is not None:
            return self
        with open(self.path, "rb") as f:
            data = os.pread(f.fileno(), self.size, self.offset)
        if len(data) != self.size:
            raise OSError(f"{self.path}: {len(data)} bytes at {self.offset}, expected {self.size} (did the file change?)")
        return replace(self, data=data, path=None, size=0)


# What decoding a block counts, besides its documents: `decode_raw` returns them in this order,
# `count_raw` adds them to the file's `FileCounts`.
RAW_COUNTS = ("bytes_dropped", "split_long", "surrogates_dropped", "jsonl_broken", "jsonl_no_field", "jsonl_too_long")


def decode_raw(block: RawLines) -> tuple[Docs, tuple[int, ...]]:
    """(documents, their counts in RAW_COUNTS order: undecodable bytes dropped, documents cut at
    MAX_DOC_CHARS, and for a .jsonl block its lost escapes and skipped lines) of a block; the
    documents carry their origin (the byte offset of each one's first byte, or of its record's
    line, in the file)."""
    if block.rest:  # each block decoded on its own, as if it were a chunk of its own
        parts = [decode_raw(b) for b in (replace(block, rest=None), *block.rest)]
        return (docs_of([d for p in parts for d in p[0]], np.concatenate([p[0].origin for p in parts])),
                tuple(map(sum, zip(*(p[1] for p in parts)))))
    block = block.load()
    # counted here, for the caller to add to the file's counts (`count_raw`): the block may be
    # decoded in another process, or while the main process reads another file
    with counting_into(FileCounts("")) as counts:
        text = block.data.decode(block.codec, errors="mspretrain.drop")
    if "\r" in text:  # universal newlines, as TextIOWrapper(newline=None) reads them
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    where: list[tuple[int, int]] = []
    if block.jsonl is not None:
        docs = _jsonl_line_docs(text, block.jsonl, counts, where)
    else:
        docs = whole_lines_docs(text, counts, where)
    return (docs_of(docs, origin_records(block.file, _raw_offsets(block, text, where))),
            tuple(getattr(counts, k) for k in RAW_COUNTS))


def _jsonl_line_docs(text: str, text_field: str, counts: FileCounts, where: list[tuple[int, int]]) -> list[str]:
    """What `jsonl_docs` makes of these whole lines (decoded, universal newlines already \n):
    the same records skipped and counted, the same pieces; `where` receives (line index, 0) of
    each document. A line here has at most a few MB (`raw_line_refs` cuts blocks only after a
    newline), so `readline(MAX_JSONL_LINE_CHARS)` would have returned it whole, its "\n" aside."""
    lines = text.split("\n")
    if not lines[-1]:
        lines.pop()  # the text ends with a newline (else the last line is the file's unterminated one)
    docs: list[str] = []
    for i, line in enumerate(lines):
        if len(line) >= textdocs.MAX_JSONL_LINE_CHARS:
            counts.jsonl_too_long += 1
            continue
        pieces = jsonl_record(line, text_field, counts)
        docs.extend(pieces)
        where.extend([(i, 0)] * len(pieces))
    return docs


def _raw_offsets(block: RawLines, text: str, where: list[tuple[int, int]]) -> np.ndarray:
    """Byte offsets in the file of (line index, character offset) positions of a decoded block.
    The bytes \n and \r are line breaks only (RAW_CODECS), so the text's lines are the bytes'
    lines in order; a malformed sequence at the very end of the block may swallow its final
    newline (the text then has a line less, and the others still match)."""
    if not where:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], break_ends(np.frombuffer(block.data, dtype=np.uint8), final=True)[0]]).astype(np.int64)
    line = np.fromiter((i for i, _ in where), dtype=np.int64, count=len(where))
    out = starts[np.minimum(line, starts.size - 1)] + block.offset
    if any(at for _, at in where):  # pieces of lines over MAX_DOC_CHARS: their own first byte
        lines = text.split("\n")
        for k, (i, at) in enumerate(where):
            if at:
                out[k] += len(lines[i][:at].encode(block.codec, errors="replace"))
    return out


def count_raw(stats: SourceStats, file: int, documents: int, *found: int) -> None:
    """Add what decoding a block of `stats.per_file[file]` found (`decode_raw`'s counts, in
    RAW_COUNTS order; fewer of them from a journal written before .jsonl blocks) to that file's counts."""
    add_raw(stats.per_file[file], documents, *found)


def add_raw(counts: FileCounts, documents: int, *found: int) -> None:
    """`count_raw` into `counts`."""
    counts.documents += documents
    for key, n in zip(RAW_COUNTS, found):
        setattr(counts, key, getattr(counts, key) + n)


class _Prefixed(io.RawIOBase):
    """`head`, then the rest of `stream`: a stream to read on from, after bytes already taken."""

    def __init__(self, head: bytes, stream) -> None:
        self.head, self.stream = head, stream

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.head:
            data, self.head = self.head[: len(b)], self.head[len(b):]
        else:
            data = self.stream.read(len(b))
        b[: len(data)] = data
        return len(data)


class Damaged(Exception):
    """A read error (a truncated .gz, a corrupt .zst) after `lines`: the whole lines read before it."""

    def __init__(self, lines: RawLines | None, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.lines, self.cause = lines, cause


def _read_salvaging(stream, carry: bytes, codec: str, file: int, offset: int = 0) -> bytes:
    """Up to RAW_READ_BYTES decompressed bytes, one `read1` at a time: `read(n)` of a gzip stream
    that ends early raises and drops the megabytes it had already decompressed, which lost every
    line of a small truncated file. On an error, the whole lines read so far ride on `Damaged`."""
    chunks: list[bytes] = []
    got = 0
    try:
        while got < RAW_READ_BYTES:
            d = stream.read1(RAW_READ_BYTES - got)
            if not d:
                break
            chunks.append(d)
            got += len(d)
    except read_errors() as exc:
        buf = carry + b"".join(chunks)
        cut = buf.rfind(b"\n") + 1
        raise Damaged(RawLines(buf[:cut], codec, file, offset) if cut else None, exc) from exc
    return b"".join(chunks)


def raw_line_blocks(stream, codec: str, file: int, counts: FileCounts) -> Iterator[RawLines | list[str]]:
    """Blocks of whole lines of a one-document-per-line file, as `RawLines`. A line with no end
    after 4 * MAX_DOC_CHARS bytes (at least MAX_DOC_CHARS characters) switches the rest of the
    file to the decoding reader, which cuts it into pieces while memory stays bounded."""
    carry = b""
    base = 0  # where `carry` starts in the (decompressed) file
    if codec == "utf-8-sig":
        head = stream.read(len(codecs.BOM_UTF8))
        carry = head[len(codecs.BOM_UTF8):] if head == codecs.BOM_UTF8 else head
        base = len(head) - len(carry)
        codec = "utf-8"
    while data := _read_salvaging(stream, carry, codec, file, base):
        buf = carry + data
        cut = buf.rfind(b"\n") + 1
        if not cut:
            carry = buf
            if len(carry) >= 4 * textdocs.MAX_DOC_CHARS:
                yield from _long_line_rest(carry, stream, base, codec, file, counts)
                return
            continue
        carry = buf[cut:]
        yield RawLines(buf[:cut], codec, file, base)
        base += cut
    if carry:
        yield RawLines(carry, codec, file, base)


def _long_line_rest(carry: bytes, stream, base: int, codec: str, file: int, counts: FileCounts,
                    jsonl: str | None = None) -> Iterator[list[str]]:
    """The rest of a file from `base` (`carry`, then `stream`) through the decoding reader (of
    records with the text field `jsonl`, if given)."""
    tracker = LineStarts(_Prefixed(carry, stream), base)
    f = io.TextIOWrapper(io.BufferedReader(tracker), encoding=codec, errors="mspretrain.drop", newline=None)
    starts: list[int] = []
    docs = line_doc_batches(f, counts, starts) if jsonl is None else batched(jsonl_docs(f, jsonl, counts, starts))
    yield from with_origin(docs, starts, file, tracker)


def _last_newline(fd: int, lo: int, hi: int, window: int = 1 << 14) -> int:
    """The position just after the last b"\n" in bytes lo..hi-1 of the file, or 0 if none: read
    backwards from hi in windows, so a block's end costs a few KB of reading, not the block."""
    while hi > lo:
        start = max(lo, hi - window)
        at = os.pread(fd, hi - start, start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        hi, window = start, window * 2
    return 0


def raw_line_refs(rawf, path: Path, size: int, codec: str, file: int, counts: FileCounts,
                  jsonl: str | None = None) -> Iterator[RawLines | list[str]]:
    """`raw_line_blocks` of an uncompressed file as references (`RawLines.load`): the same
    blocks, cut at the last b"\n" before the same read positions (RAW_READ_BYTES apart, after a
    utf-8-sig file's first 3 bytes), without reading them. `rawf` is moved to each block's end,
    for the progress bar. `jsonl`: a .jsonl file's blocks (records' text field); a line with no
    end then switches the rest of the file to `jsonl_docs`."""
    fd = rawf.fileno()
    base = pos = 0  # where the next block starts; how far the old reader would have read
    if codec == "utf-8-sig":
        head = os.pread(fd, len(codecs.BOM_UTF8), 0)
        pos = len(head)
        base = len(head) if head == codecs.BOM_UTF8 else 0
        codec = "utf-8"
    while pos < size:
        pos = min(pos + RAW_READ_BYTES, size)
        cut = _last_newline(fd, base, pos)
        if not cut:
            if pos - base >= 4 * textdocs.MAX_DOC_CHARS:  # a line with no end: the decoding reader from here
                rawf.seek(pos)
                yield from _long_line_rest(os.pread(fd, pos - base, base), rawf, base, codec, file, counts, jsonl)
                return
            continue
        rawf.seek(cut)
        yield RawLines(None, codec, file, base, str(path), cut - base, jsonl=jsonl)
        base = cut
    if base < size:
        rawf.seek(size)
        yield RawLines(None, codec, file, base, str(path), size - base, jsonl=jsonl)

