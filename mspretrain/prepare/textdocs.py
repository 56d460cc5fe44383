"""Documents out of decoded text, and where each one starts in its file.

Everything streams: a file is read through an incremental decoder (line by line, or in blocks
split in C for one document per line), with a cap on how much of one line is held at a time. A
document longer than `MAX_DOC_CHARS` is cut into pieces (counted) instead of growing without
bound: pretraining packs documents into windows anyway, so a cut costs one EOS and nothing else.
Each batch of documents carries its origin (`Docs.origin`: input file, byte offset or row, see
`data/origin.py`).

The limits are read from this module when a reader runs (the raw-block readers of
`prepare/rawlines.py` too), so a test that lowers one lowers it for every reader.
"""
from __future__ import annotations

import io
import json
import re
from typing import Iterable, Iterator

import numpy as np

from mspretrain.data.origin import RECORD
from mspretrain.prepare.filecounts import FileCounts
from mspretrain.prepare.sniff import read_errors

MAX_DOC_CHARS = 1_000_000  # longer documents are cut into pieces of at most this many characters
MAX_JSONL_LINE_CHARS = 16_000_000  # a longer .jsonl record is skipped (it cannot be parsed piecewise)
READ_CHARS = 1 << 16  # characters per read of a line-per-document file
_SURROGATE = re.compile("[\ud800-\udfff]")


# --------------------------------------------------------------------------- where documents start

class Docs(list):
    """A list of documents with `origin`: one `origin.RECORD` (input file index, offset) per
    document, or None (`data/origin.py` says what the offsets mean)."""

    origin: np.ndarray | None = None


def docs_of(docs: list[str], origin: np.ndarray | None) -> Docs:
    out = Docs(docs)
    out.origin = origin
    return out


def origin_records(file: int, offsets) -> np.ndarray:
    rec = np.empty(len(offsets), dtype=RECORD)
    rec["file"] = file
    rec["offset"] = offsets
    return rec


def break_ends(a: np.ndarray, final: bool) -> tuple[np.ndarray, bool]:
    """Where lines start after each line break of the bytes `a` (universal newlines: \r\n, \r,
    \n, as `TextIOWrapper(newline=None)` reads them), relative to `a`, and whether `a` ends with a
    \r whose meaning the next bytes decide (never when `final`)."""
    nl = np.flatnonzero(a == 10)
    if not a.size or not (a == 13).any():
        return nl + 1, False
    cr = np.flatnonzero(a == 13)
    follows = np.append(a[1:], 0)  # the byte after each byte (0 past the end)
    lone = cr[follows[cr] != 10]
    pending = bool(a[-1] == 13) and not final
    if pending:
        lone = lone[:-1]
    return np.union1d(nl + 1, lone + 1), pending


class LineStarts(io.RawIOBase):
    """A byte stream that notes where each line starts as the bytes pass to a `TextIOWrapper`, so
    the line number of a decoded document gives its byte offset. Only the starts not yet asked
    for are kept (`byte_offsets` drops those before the latest asked for): memory is bounded by
    the reader's read-ahead, not by the file."""

    def __init__(self, stream, start: int = 0) -> None:
        self.stream = stream
        self.pos = start  # offset of the next byte
        self.first = 0  # line number of the first start kept
        self.starts: list[np.ndarray] = [np.array([start], dtype=np.int64)]
        self.cr_pending = False
        self.lines = 1  # lines started so far

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.stream.close()
        super().close()

    def readinto(self, b) -> int:
        n = self.stream.readinto(b)
        if n is None:
            return n
        a = np.frombuffer(memoryview(b)[:n], dtype=np.uint8) if n else np.zeros(0, np.uint8)
        got = []
        if self.cr_pending and (n == 0 or a[0] != 10):
            got.append(np.array([self.pos], dtype=np.int64))  # the \r was a line break of its own
        ends, self.cr_pending = break_ends(a, final=n == 0)
        got.append(ends.astype(np.int64) + self.pos)
        new = np.concatenate(got) if len(got) > 1 else got[0]
        if new.size:
            self.starts.append(new)
            self.lines += int(new.size)
        self.pos += n
        return n

    def byte_offsets(self, lines: list[int]) -> np.ndarray:
        """Byte offsets of the starts of these line numbers (ascending, all read already)."""
        if not lines:
            return np.zeros(0, dtype=np.int64)
        known = np.concatenate(self.starts) if len(self.starts) > 1 else self.starts[0]
        idx = np.asarray(lines, dtype=np.int64) - self.first
        out = known[np.minimum(idx, known.size - 1)]  # (a line the bytes do not show: the last start known)
        keep = int(min(idx[-1], known.size - 1))
        self.starts, self.first = [known[keep:]], self.first + keep
        return out


def with_origin(batches: Iterable[list[str]], starts: list[int], file: int,
                tracker: LineStarts | None) -> Iterator[Docs]:
    """Doc batches with their origin: `starts` receives the first line number of each document as
    the reader makes it; with a `tracker` line numbers become byte offsets, else they stay rows."""
    for batch in batches:
        n = len(batch)
        lines, starts[:n] = starts[:n], []
        offsets = tracker.byte_offsets(lines) if tracker is not None else lines
        yield docs_of(batch, origin_records(file, offsets))


# --------------------------------------------------------------------------- reading documents

def cut_text(text: str, limit: int) -> list[str]:
    """Pieces of at most `limit` characters, cut at a newline near the limit when there is one."""
    pieces = []
    while len(text) > limit:
        nl = text.rfind("\n", limit - limit // 10, limit)
        at = nl + 1 if nl >= 0 else limit
        pieces.append(text[:at])
        text = text[at:]
    pieces.append(text)
    return pieces


def _chomp(text: str) -> str:
    """Without its final newline (the document separator, not part of the document)."""
    return text[:-1] if text.endswith("\n") else text


def text_docs(f: io.TextIOBase, counts: FileCounts, starts: list[int] | None = None) -> Iterator[str]:
    """Blank-line separated documents; `starts` receives each one's first line number."""
    buf: list[str] = []
    size = 0
    reads = partial = first = 0  # line numbers: reads so far, less those that continued a line
    note = starts.append if starts is not None else (lambda _: None)
    while True:
        line = f.readline(MAX_DOC_CHARS)
        if not line:
            break
        reads += 1
        if not line.strip():
            if buf:
                note(first)
                yield _chomp("".join(buf))
                buf, size = [], 0
            continue
        if not buf:
            first = reads - 1 - partial
        buf.append(line)
        n = len(line)
        size += n
        if n >= MAX_DOC_CHARS and line[-1] != "\n":
            partial += 1  # a piece of an over-long line: the next read continues it
        if size >= MAX_DOC_CHARS:
            counts.split_long += 1
            note(first)
            yield _chomp("".join(buf))
            buf, size = [], 0
    if buf:
        note(first)
        yield _chomp("".join(buf))


def _line_pieces(line: str, counts: FileCounts, ats: list[int] | None = None) -> list[str]:
    """What `readline(MAX_DOC_CHARS)` calls would make of one line (`line` ends with its newline,
    if it has one): the non-blank pieces, chomped, each full-length unterminated piece counted.
    `ats` receives where each piece starts in `line` (characters)."""
    out = []
    for at in range(0, len(line), MAX_DOC_CHARS):
        piece = line[at: at + MAX_DOC_CHARS]
        if piece.strip():
            if not piece.endswith("\n") and len(piece) >= MAX_DOC_CHARS:
                counts.split_long += 1  # a piece of an over-long line
            out.append(_chomp(piece))
            if ats is not None:
                ats.append(at)
    return out


def _kept_lines(lines: list[str], base: int, starts: list[int] | None) -> list[str]:
    """The non-blank lines; `starts` receives their line numbers (`base` + index)."""
    if starts is None:  # "not blank" is `line.strip()`, without building the copy
        return [line for line in lines if line and not line.isspace()]
    keep = [i for i, line in enumerate(lines) if line and not line.isspace()]
    starts.extend([base + i for i in keep])
    return [lines[i] for i in keep]


def line_doc_batches(f: io.TextIOBase, counts: FileCounts, starts: list[int] | None = None) -> Iterator[list[str]]:
    """One document per non-blank line, a list per block of text read.

    The same documents as a `readline(MAX_DOC_CHARS)` loop (over-long lines cut into pieces at
    the same places), but reading 64 K characters at a time and splitting in C: per-line
    `readline` calls were most of the reading cost of `prepare`. A line still being read is
    cut as soon as it reaches MAX_DOC_CHARS, so memory stays bounded. `starts` receives each
    document's line number (a piece of an over-long line: that of its line)."""
    carry = ""
    line_no = 0  # lines of the file before `carry`
    while True:
        block = f.read(READ_CHARS)
        if not block:
            break
        lines = (carry + block).split("\n")
        carry = lines.pop()  # the unfinished last line
        docs: list[str] = []
        if lines and max(map(len, lines)) >= MAX_DOC_CHARS:
            for i, line in enumerate(lines):
                pieces = _line_pieces(line + "\n", counts)
                docs.extend(pieces)
                if starts is not None:
                    starts.extend([line_no + i] * len(pieces))
        else:  # the common case
            docs = _kept_lines(lines, line_no, starts)
        line_no += len(lines)
        cut = len(carry) - len(carry) % MAX_DOC_CHARS
        if cut:  # whole MAX_DOC_CHARS pieces of a line that has no end yet
            pieces = _line_pieces(carry[:cut], counts)
            docs.extend(pieces)
            if starts is not None:
                starts.extend([line_no] * len(pieces))
            carry = carry[cut:]
        if docs:
            yield docs
    if carry:
        pieces = _line_pieces(carry, counts)
        if starts is not None:
            starts.extend([line_no] * len(pieces))
        yield pieces


def whole_lines_docs(text: str, counts: FileCounts, where: list[tuple[int, int]] | None = None) -> list[str]:
    """The documents of text that starts at a line start and ends after a newline (or at the end
    of the file): what the `readline(MAX_DOC_CHARS)` loop makes of those lines. `where` receives
    (line index, character offset in the line) of each document."""
    lines = text.split("\n")
    last = lines.pop()  # "" when the text ends with a newline, else the file's unterminated last line
    if lines and max(map(len, lines)) >= MAX_DOC_CHARS:
        docs = []
        for i, line in enumerate(lines):
            ats: list[int] = []
            docs.extend(_line_pieces(line + "\n", counts, ats))
            if where is not None:
                where.extend((i, at) for at in ats)
    else:
        starts: list[int] | None = None if where is None else []
        docs = _kept_lines(lines, 0, starts)
        if where is not None:
            where.extend((i, 0) for i in starts)
    if last:
        ats = []
        docs.extend(_line_pieces(last, counts, ats))
        if where is not None:
            where.extend((len(lines), at) for at in ats)
    return docs


def jsonl_docs(f: io.TextIOBase, text_field: str, counts: FileCounts, starts: list[int] | None = None) -> Iterator[str]:
    """The `text_field` of each record; `starts` receives each document's line number."""
    line_no = 0
    note = starts.append if starts is not None else (lambda _: None)
    while True:
        line = f.readline(MAX_JSONL_LINE_CHARS)
        if not line:
            break
        this = line_no
        line_no += 1
        if not line.endswith("\n") and len(line) >= MAX_JSONL_LINE_CHARS:
            counts.jsonl_too_long += 1
            while (rest := f.readline(MAX_JSONL_LINE_CHARS)) and not rest.endswith("\n"):
                pass
            continue
        for piece in jsonl_record(line, text_field, counts):
            note(this)
            yield piece


def jsonl_record(line: str, text_field: str, counts: FileCounts) -> list[str]:
    """The document pieces of one .jsonl line (none for a blank or unusable one, counted), for
    both readers (`jsonl_docs`, `_jsonl_line_docs`)."""
    if not line.strip():
        return []
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # (nested past the stack: `[[[[...` of 100 K brackets is no record either)
        counts.jsonl_broken += 1
        return []
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        counts.jsonl_no_field += 1
        return []
    if "\\u" in line and _SURROGATE.search(text):
        # A "\ud800" escape without its pair: not text, and not encodable as UTF-8.
        text, n = _SURROGATE.subn("", text)
        counts.surrogates_dropped += n
    pieces = cut_text(text, MAX_DOC_CHARS)
    counts.split_long += len(pieces) - 1
    return pieces


def batched(docs: Iterator[str], n: int = 256) -> Iterator[list[str]]:
    """Lists of up to n documents; a read error still delivers the documents before it."""
    batch: list[str] = []
    try:
        for doc in docs:
            batch.append(doc)
            if len(batch) >= n:
                yield batch
                batch = []
    except read_errors():
        if batch:
            yield batch
        raise
    if batch:
        yield batch

