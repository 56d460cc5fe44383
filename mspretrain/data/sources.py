"""Input discovery and streaming document readers for `prepare`.

Design choices:
- Inputs are files, directories (walked recursively, hidden entries skipped, sorted) and globs.
  Inside directories only `.txt` / `.jsonl` (optionally `.gz` / `.zst`) are read; a file named
  explicitly is read as text whatever its name. An input that matches nothing is an error: a
  typo must not silently shrink the corpus.
- Everything streams: files are read through an incremental decoder (line by line, or in blocks
  split in C for one document per line), with a cap on how much of one line is held at a time.
  For prepare's local workers, uncompressed one-document-per-line and .jsonl files come as
  references to blocks of whole lines (`RawLines`, decoded and parsed where they are read), and
  a compressed file as one `FileUnit` that a worker reads with the same reader (`read_body`).
  A document longer than `MAX_DOC_CHARS` is cut into pieces (counted) instead of growing
  without bound: pretraining packs documents into windows anyway, so a cut costs one EOS and
  nothing else.
- The encoding is detected per file from its first 64 KiB: a BOM, else strict UTF-8, else
  `charset-normalizer` (GBK/GB2312 are read as GB18030, their superset). Bytes that still do
  not decode are dropped and counted, never fatal. A file that looks binary (known magic
  numbers, many control bytes, or no plausible encoding) is skipped with a warning.
- Every count is per file (`FileCounts`: documents, dropped bytes, cut documents, broken
  records, why a file was skipped); `SourceStats` holds them in reading order and sums them, and
  the manifest lists both, so a loss is traced to its file. Nothing is counted in module state.
- Trade-off: detection reads a file's head twice (once to sniff, once to stream); the sample
  is small, and it keeps the reader a plain `TextIOWrapper` (decoding in C).
"""
from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
import re
import zlib
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from mspretrain.data.origin import RECORD
from mspretrain.errors import UserError

MAX_DOC_CHARS = 1_000_000  # longer documents are cut into pieces of at most this many characters
MAX_JSONL_LINE_CHARS = 16_000_000  # a longer .jsonl record is skipped (it cannot be parsed piecewise)
SAMPLE_BYTES = 1 << 16
READ_CHARS = 1 << 16  # characters per read of a line-per-document file
TEXT_SUFFIXES = (".txt", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
_MAGIC = (  # file types people leave next to their text
    (b"\x89PNG", "PNG image"), (b"\xff\xd8\xff", "JPEG image"), (b"GIF8", "GIF image"),
    (b"%PDF", "PDF"), (b"PK\x03\x04", "zip archive"), (b"\x7fELF", "executable"),
    (b"\x1f\x8b", "gzip data without a .gz name"), (b"\x28\xb5\x2f\xfd", "zstd data without a .zst name"),
    (b"BZh", "bzip2 data"), (b"\xfd7zXZ", "xz data"), (b"SQLite format", "SQLite database"),
)
_BOMS = ((codecs.BOM_UTF8, "utf-8-sig", "utf-8-bom"), (codecs.BOM_UTF32_LE, "utf-32", "utf-32"),
         (codecs.BOM_UTF32_BE, "utf-32", "utf-32"), (codecs.BOM_UTF16_LE, "utf-16", "utf-16"),
         (codecs.BOM_UTF16_BE, "utf-16", "utf-16"))
_GB_FAMILY = {"gb2312", "gbk", "gb18030", "hz", "cp936", "euc_cn"}
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\f\v\x1b") + b"\x7f"


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
# through a context variable, set only while that file's decoder runs (`_counting_into`).
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
def _counting_into(counts: FileCounts) -> Iterator[FileCounts]:
    token = _COUNTS.set(counts)
    try:
        yield counts
    finally:
        _COUNTS.reset(token)


def _counted(batches: Iterable, counts: FileCounts) -> Iterator:
    """`batches`, with `counts` receiving the dropped bytes of each step of the reader, and only
    of it: between steps the consumer runs (and may decode another file's blocks)."""
    it = iter(batches)
    while True:
        with _counting_into(counts):
            try:
                batch = next(it)
            except StopIteration:
                return
        yield batch


# --------------------------------------------------------------------------- files mixing UTF-8 and GB18030 lines

MIXED_CODEC = "mspretrain-mixed"
MIXED_LABEL = "utf-8+gb18030"  # its label in the manifest
_MIXED_HOLD = 1 << 20  # a line with no end yet is decoded in pieces beyond this: memory stays bounded


def _decode_line(line: bytes, errors: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        pass
    counts = _COUNTS.get() or FileCounts("")
    try:
        text = line.decode("gb18030")
        counts.mixed_gb18030_lines += 1
        return text
    except UnicodeDecodeError:
        counts.mixed_bad_lines += 1
        return line.decode("utf-8", errors=errors)


class _MixedDecoder(codecs.IncrementalDecoder):
    """Each line as UTF-8, else as GB18030, else UTF-8 with the bad bytes dropped (and counted).
    Files concatenated from a GBK source and a UTF-8 one were called binary: no single
    encoding decodes them, but every line has one."""

    def __init__(self, errors: str = "strict") -> None:
        super().__init__(errors)
        self.buf = b""

    def decode(self, input: bytes, final: bool = False) -> str:  # noqa: A002 (codecs' signature)
        data = self.buf + bytes(input)
        cut = len(data) if final else data.rfind(b"\n") + 1
        if not cut and len(data) > _MIXED_HOLD:
            cut = len(data) - 4  # keep a possibly split multi-byte character for the next call
        self.buf = data[cut:]
        return "".join(_decode_line(line, self.errors) for line in data[:cut].splitlines(keepends=True))

    def reset(self) -> None:
        self.buf = b""

    def getstate(self) -> tuple[bytes, int]:
        return self.buf, 0

    def setstate(self, state: tuple[bytes, int]) -> None:
        self.buf = state[0]


def _mixed_search(name: str) -> codecs.CodecInfo | None:
    if name.replace("_", "-") != MIXED_CODEC:
        return None

    def decode(data: bytes, errors: str = "strict") -> tuple[str, int]:
        return _MixedDecoder(errors).decode(data, final=True), len(data)

    return codecs.CodecInfo(name=MIXED_CODEC, encode=codecs.utf_8_encode, decode=decode,
                            incrementaldecoder=_MixedDecoder)


codecs.register(_mixed_search)


def mixed_lines_fit(sample: bytes, complete: bool) -> bool:
    """Whether a head no single encoding decodes is UTF-8 and GB18030 lines: nearly every whole
    line (90 %) decodes strictly one way or the other, and the GB18030 ones read as Chinese."""
    lines = sample.splitlines()
    if not complete and lines:
        lines = lines[:-1]  # the sample may end inside a line
    gb_text, ok, bad = [], 0, 0
    for line in (ln for ln in lines if ln.strip()):
        try:
            line.decode("utf-8")
            ok += 1
            continue
        except UnicodeDecodeError:
            pass
        try:
            gb_text.append(line.decode("gb18030"))
            ok += 1
        except UnicodeDecodeError:
            bad += 1  # a damaged line: dropped bytes when read, counted
    wide = [ch for t in gb_text for ch in t if ord(ch) > 0x7F]
    cjk = sum(1 for ch in wide if "\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef")
    return ok > 0 and bad <= 0.1 * (ok + bad) and bool(wide) and cjk >= 0.8 * len(wide)


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


# --------------------------------------------------------------------------- discovery

def _strip_compression(name: str) -> str:
    low = name.lower()
    for suf in COMPRESSED_SUFFIXES:
        if low.endswith(suf):
            return low[: -len(suf)]
    return low


def is_compressed(path: Path) -> bool:
    return _strip_compression(path.name) != path.name.lower()


def is_jsonl(path: Path) -> bool:
    return _strip_compression(path.name).endswith(JSONL_SUFFIXES)


def _supported(path: Path) -> bool:
    return _strip_compression(path.name).endswith(TEXT_SUFFIXES + JSONL_SUFFIXES)


def discover(inputs: Sequence[str], stats: SourceStats | None = None) -> list[Path]:
    """The files to read, in a deterministic order; `UserError` if an input matches nothing."""
    return [path for path, _ in discover_named(inputs, stats)]


def discover_named(inputs: Sequence[str], stats: SourceStats | None = None) -> list[tuple[Path, str]]:
    """`discover`, each file with the name the manifest gives it: as the user named it (an input
    file as given, a file found under a directory or by a glob joined to it), so the manifest
    holds no absolute path the command line did not."""
    if not inputs:
        raise UserError("no input given", "name files, directories or globs: mspretrain prepare corpus/ --out data/")
    found: list[tuple[Path, str]] = []
    for raw in inputs:
        p = Path(raw).expanduser()
        if p.is_file():
            found.append((p, raw))
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            usable = [f for f in files if _supported(f)]
            if stats is not None:
                stats.ignored += len(files) - len(usable)
            if not usable:
                raise UserError(f"directory {p} holds no .txt or .jsonl files (also .gz/.zst)",
                                "point prepare at your text files, or rename them to .txt / .jsonl")
            found.extend((f, (Path(raw) / f.relative_to(p)).as_posix()) for f in usable)
        elif glob.has_magic(raw):
            matches = _glob(p)
            if not matches:
                raise UserError(f"no files match {raw}", "check the pattern (quote it so the shell does not expand it) or list the files")
            found.extend((m, m.as_posix()) for m in matches)
        else:
            from mspretrain.fsutil import why_not

            raise UserError(f"input {raw} {why_not(p, 'a text file or a directory')}", "check the path; inputs may be files, directories or globs")
    unique: dict[Path, str] = {}
    for f, name in found:
        unique.setdefault(f.resolve(), name)  # a file named twice is read once, under its first name
    return list(unique.items())


def _glob(pattern: Path) -> list[Path]:
    """Files matching `pattern` (`**` included), sorted, without following symlinked directories.

    `glob.glob(recursive=True)` follows directory symlinks, so a link to a parent loops until
    the path is too long (it never returned in 20 s on a two-level loop). pathlib's `**` does not
    descend into symlinks (CPython 3.11 `pathlib._RecursiveWildcardSelector`). Hidden files and
    directories are skipped, as `glob.glob` and directory inputs do.
    """
    parts = pattern.parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root = Path(*parts[:first]) if first else Path(".")
    found = []
    for m in root.glob(str(Path(*parts[first:]))):
        rel = m.relative_to(root).parts
        if m.is_file() and not any(part.startswith(".") for part in rel):
            found.append(m)
    return sorted(found)


# --------------------------------------------------------------------------- opening and sniffing

def _open_binary(path: Path):
    """(decompressed binary stream, raw file object) for the path's compression suffix."""
    raw = open(path, "rb")
    low = path.name.lower()
    try:
        if low.endswith(".gz"):
            return gzip.GzipFile(fileobj=raw, mode="rb"), raw
        if low.endswith((".zst", ".zstd")):
            import zstandard

            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)), raw
    except Exception:
        raw.close()
        raise
    return raw, raw


def _sample(path: Path) -> tuple[bytes, bool]:
    """The first SAMPLE_BYTES decompressed bytes, and whether that is the whole file."""
    stream, raw = _open_binary(path)
    chunks: list[bytes] = []
    got = 0
    try:  # read1 by read1: a stream damaged within the sample still shows the bytes before it
        while got <= SAMPLE_BYTES:
            d = stream.read1(SAMPLE_BYTES + 1 - got)
            if not d:
                break
            chunks.append(d)
            got += len(d)
    except _read_errors():
        if not chunks:
            raise
        # the reader meets the damage again, keeps the whole lines before it and warns
    finally:
        stream.close()
        raw.close()
    head = b"".join(chunks)
    return head[:SAMPLE_BYTES], len(head) <= SAMPLE_BYTES


def binary_reason(sample: bytes) -> str | None:
    """Why a file's head looks binary rather than text, or None."""
    for magic, what in _MAGIC:
        if sample.startswith(magic):
            return what
    if sample and not sample.startswith(tuple(b for b, _, _ in _BOMS)):
        ctrl = len(sample) - len(sample.translate(None, _CONTROL_BYTES))
        if ctrl > 0.1 * len(sample):
            return f"{100 * ctrl // len(sample)}% control bytes"
    return None


def detect_encoding(sample: bytes, complete: bool) -> tuple[str, str] | None:
    """(Python codec, label for the manifest), or None when no encoding is plausible."""
    for bom, codec, label in _BOMS:
        if sample.startswith(bom):
            return codec, label
    try:
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=complete)
        return "utf-8", "utf-8"
    except UnicodeDecodeError as exc:
        # A few stray bytes in an otherwise UTF-8 file: read it as UTF-8 and drop them.
        bad = _undecodable(sample, "utf-8")
        if bad <= max(4, len(sample) // 1000) and exc.start > 0:
            return "utf-8", "utf-8"
    from charset_normalizer import from_bytes

    best = from_bytes(sample).best()
    if best is None:
        # charset-normalizer gives up on short GB18030 text with four-byte sequences; for a
        # Chinese toolkit, strict GB18030 that decodes to mostly CJK is a safe second opinion.
        try:
            text = codecs.getincrementaldecoder("gb18030")().decode(sample, final=complete)
        except UnicodeDecodeError:
            return None
        wide = [ch for ch in text if ord(ch) > 0x7F]
        cjk = sum(1 for ch in wide if "\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef" or ch >= "\U00020000")
        return ("gb18030", "gb18030") if wide and cjk >= 0.8 * len(wide) else None
    name = codecs.lookup(best.encoding).name.replace("-", "_")
    if name in _GB_FAMILY or name.startswith("gb"):
        # GB18030 decodes all of GBK/GB2312; the label says what the head actually needed.
        return "gb18030", "gbk" if _undecodable(sample, "gbk", complete) == 0 else "gb18030"
    return best.encoding, name


def _undecodable(sample: bytes, codec: str, complete: bool = False) -> int:
    with _counting_into(FileCounts("")) as counts:
        codecs.getincrementaldecoder(codec)(errors="mspretrain.drop").decode(sample, final=complete)
    return counts.bytes_dropped


# --------------------------------------------------------------------------- where documents start

class Docs(list):
    """A list of documents with `origin`: one `origin.RECORD` (input file index, offset) per
    document, or None (`data/origin.py` says what the offsets mean)."""

    origin: np.ndarray | None = None


def _docs(docs: list[str], origin: np.ndarray | None) -> Docs:
    out = Docs(docs)
    out.origin = origin
    return out


def _records(file: int, offsets) -> np.ndarray:
    rec = np.empty(len(offsets), dtype=RECORD)
    rec["file"] = file
    rec["offset"] = offsets
    return rec


def _break_ends(a: np.ndarray, final: bool) -> tuple[np.ndarray, bool]:
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


def newline_bytes_safe(codec: str) -> bool:
    """Whether the bytes \n and \r in this encoding are only ever line breaks, so lines can be
    found in the undecoded bytes (UTF-8, GB18030 and other ASCII-compatible codecs; not UTF-16/32)."""
    if codec == MIXED_CODEC:
        return True  # UTF-8 and GB18030 lines
    try:
        enc = codecs.getincrementalencoder(codec)()
        enc.encode("a")  # past a BOM the encoder may write first
        return enc.encode("\r\n") == b"\r\n"
    except (LookupError, UnicodeError, TypeError):
        return False


class _LineStarts(io.RawIOBase):
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
        ends, self.cr_pending = _break_ends(a, final=n == 0)
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


def _with_origin(batches: Iterable[list[str]], starts: list[int], file: int,
                 tracker: _LineStarts | None) -> Iterator[Docs]:
    """Doc batches with their origin: `starts` receives the first line number of each document as
    the reader makes it; with a `tracker` line numbers become byte offsets, else they stay rows."""
    for batch in batches:
        n = len(batch)
        lines, starts[:n] = starts[:n], []
        offsets = tracker.byte_offsets(lines) if tracker is not None else lines
        yield _docs(batch, _records(file, offsets))


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


def _text_docs(f: io.TextIOBase, counts: FileCounts, starts: list[int] | None = None) -> Iterator[str]:
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


def _line_doc_batches(f: io.TextIOBase, counts: FileCounts, starts: list[int] | None = None) -> Iterator[list[str]]:
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


def _whole_lines_docs(text: str, counts: FileCounts, where: list[tuple[int, int]] | None = None) -> list[str]:
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
        return (_docs([d for p in parts for d in p[0]], np.concatenate([p[0].origin for p in parts])),
                tuple(map(sum, zip(*(p[1] for p in parts)))))
    block = block.load()
    # counted here, for the caller to add to the file's counts (`count_raw`): the block may be
    # decoded in another process, or while the main process reads another file
    with _counting_into(FileCounts("")) as counts:
        text = block.data.decode(block.codec, errors="mspretrain.drop")
    if "\r" in text:  # universal newlines, as TextIOWrapper(newline=None) reads them
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    where: list[tuple[int, int]] = []
    if block.jsonl is not None:
        docs = _jsonl_line_docs(text, block.jsonl, counts, where)
    else:
        docs = _whole_lines_docs(text, counts, where)
    return (_docs(docs, _records(block.file, _raw_offsets(block, text, where))),
            tuple(getattr(counts, k) for k in RAW_COUNTS))


def _jsonl_line_docs(text: str, text_field: str, counts: FileCounts, where: list[tuple[int, int]]) -> list[str]:
    """What `_jsonl_docs` makes of these whole lines (decoded, universal newlines already \n):
    the same records skipped and counted, the same pieces; `where` receives (line index, 0) of
    each document. A line here has at most a few MB (`_raw_line_refs` cuts blocks only after a
    newline), so `readline(MAX_JSONL_LINE_CHARS)` would have returned it whole, its "\n" aside."""
    lines = text.split("\n")
    if not lines[-1]:
        lines.pop()  # the text ends with a newline (else the last line is the file's unterminated one)
    docs: list[str] = []
    for i, line in enumerate(lines):
        if len(line) >= MAX_JSONL_LINE_CHARS:
            counts.jsonl_too_long += 1
            continue
        pieces = _jsonl_record(line, text_field, counts)
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
    starts = np.concatenate([[0], _break_ends(np.frombuffer(block.data, dtype=np.uint8), final=True)[0]]).astype(np.int64)
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


def report_raw_files(stats: SourceStats, warn: Callable[[str], None], text_field: str = "text", jsonl: bool = True) -> None:
    """The per-file warnings of files read as `RawLines`, once all their blocks are decoded: the
    same as a file read whole gets at its end (`warn_counts`), in the order of the files.
    `jsonl=False`: not of .jsonl files (their warnings were `hold`-en, see `iter_file_batches`)."""
    for counts in stats.per_file:
        if counts.raw and (jsonl or not is_jsonl(counts.path)):
            warn_counts(counts, text_field, warn)


def warn_counts(counts: FileCounts, text_field: str, warn: Callable[[str], None]) -> None:
    """What a file read lost, in one warning per kind."""
    path, dropped = counts.path, counts.bytes_dropped
    if counts.encoding == MIXED_LABEL:
        gb, bad = counts.mixed_gb18030_lines, counts.mixed_bad_lines
        warn(f"{path}: mixes encodings: {gb} lines read as GB18030, the others as UTF-8"
             + (f"; {bad} lines fit neither ({dropped} bytes dropped)" if bad else ""))
    elif dropped:
        warn(f"{path}: {dropped} undecodable bytes dropped (read as {counts.encoding})")
    broken, no_field, too_long = counts.jsonl_broken, counts.jsonl_no_field, counts.jsonl_too_long
    if broken or no_field or too_long:
        parts = [f"{broken} broken lines"] * bool(broken) + [f"{no_field} lines without a string '{text_field}' field"] * bool(no_field) \
            + [f"{too_long} lines over {MAX_JSONL_LINE_CHARS:,} characters"] * bool(too_long)
        warn(f"{path}: skipped {', '.join(parts)}")
    if not counts.documents:
        warn(f"{path}: no documents found" + (f" (is the text in a field other than '{text_field}'? use --text-field)"
                                              if is_jsonl(path) else ""))


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


class _Damaged(Exception):
    """A read error (a truncated .gz, a corrupt .zst) after `lines`: the whole lines read before it."""

    def __init__(self, lines: RawLines | None, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.lines, self.cause = lines, cause


def _read_salvaging(stream, carry: bytes, codec: str, file: int, offset: int = 0) -> bytes:
    """Up to RAW_READ_BYTES decompressed bytes, one `read1` at a time: `read(n)` of a gzip stream
    that ends early raises and drops the megabytes it had already decompressed, which lost every
    line of a small truncated file. On an error, the whole lines read so far ride on `_Damaged`."""
    chunks: list[bytes] = []
    got = 0
    try:
        while got < RAW_READ_BYTES:
            d = stream.read1(RAW_READ_BYTES - got)
            if not d:
                break
            chunks.append(d)
            got += len(d)
    except _read_errors() as exc:
        buf = carry + b"".join(chunks)
        cut = buf.rfind(b"\n") + 1
        raise _Damaged(RawLines(buf[:cut], codec, file, offset) if cut else None, exc) from exc
    return b"".join(chunks)


def _raw_line_blocks(stream, codec: str, file: int, counts: FileCounts) -> Iterator[RawLines | list[str]]:
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
            if len(carry) >= 4 * MAX_DOC_CHARS:
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
    tracker = _LineStarts(_Prefixed(carry, stream), base)
    f = io.TextIOWrapper(io.BufferedReader(tracker), encoding=codec, errors="mspretrain.drop", newline=None)
    starts: list[int] = []
    docs = _line_doc_batches(f, counts, starts) if jsonl is None else _batched(_jsonl_docs(f, jsonl, counts, starts))
    yield from _with_origin(docs, starts, file, tracker)


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


def _raw_line_refs(rawf, path: Path, size: int, codec: str, file: int, counts: FileCounts,
                   jsonl: str | None = None) -> Iterator[RawLines | list[str]]:
    """`_raw_line_blocks` of an uncompressed file as references (`RawLines.load`): the same
    blocks, cut at the last b"\n" before the same read positions (RAW_READ_BYTES apart, after a
    utf-8-sig file's first 3 bytes), without reading them. `rawf` is moved to each block's end,
    for the progress bar. `jsonl`: a .jsonl file's blocks (records' text field); a line with no
    end then switches the rest of the file to `_jsonl_docs`."""
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
            if pos - base >= 4 * MAX_DOC_CHARS:  # a line with no end: the decoding reader from here
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


def _jsonl_docs(f: io.TextIOBase, text_field: str, counts: FileCounts, starts: list[int] | None = None) -> Iterator[str]:
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
        for piece in _jsonl_record(line, text_field, counts):
            note(this)
            yield piece


def _jsonl_record(line: str, text_field: str, counts: FileCounts) -> list[str]:
    """The document pieces of one .jsonl line (none for a blank or unusable one, counted), for
    both readers (`_jsonl_docs`, `_jsonl_line_docs`)."""
    if not line.strip():
        return []
    try:
        record = json.loads(line)
    except ValueError:
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


def _batched(docs: Iterator[str], n: int = 256) -> Iterator[list[str]]:
    """Lists of up to n documents; a read error still delivers the documents before it."""
    batch: list[str] = []
    try:
        for doc in docs:
            batch.append(doc)
            if len(batch) >= n:
                yield batch
                batch = []
    except _read_errors():
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a damaged file raises while being read (a bug elsewhere must still surface)."""
    import zstandard

    return OSError, EOFError, zlib.error, zstandard.ZstdError


def iter_file(path: Path, *, doc_per_line: bool = False, text_field: str = "text",
              stats: SourceStats, warn: Callable[[str], None],
              progress: Callable[[int], None] | None = None) -> Iterator[str]:
    """Documents of one file; problems become counted skips and a warning, never an exception."""
    for batch in iter_file_batches(path, doc_per_line=doc_per_line, text_field=text_field, stats=stats,
                                   warn=warn, progress=progress):
        yield from batch


def iter_file_batches(path: Path, *, doc_per_line: bool = False, text_field: str = "text",
                      stats: SourceStats, warn: Callable[[str], None],
                      progress: Callable[[int], None] | None = None, raw: bool = False,
                      name: str | None = None, by_reference: bool = False,
                      units: bool = False, hold: Callable[[int], None] | None = None) -> Iterator[list[str] | RawLines | FileUnit]:
    """`iter_file` in lists of documents (no per-document Python work for the caller). The file's
    counts go to a new `FileCounts` (named `name`, by default the path) at the end of `stats.per_file`.

    With `raw`, a one-document-per-line file in a RAW_CODECS encoding comes as `RawLines`
    blocks instead: the caller decodes them (`decode_raw`), adds the counts (`count_raw`) and
    finally calls `report_raw_files` for the warnings about those files. `by_reference`: an
    uncompressed one comes as references to its blocks, which whoever decodes them reads; so
    does an uncompressed .jsonl file in a RAW_CODECS encoding (blocks of whole records, parsed
    by whoever decodes them). `units`: a compressed file comes whole, as a `FileUnit` for a worker
    to read (its counts and warnings then come from there). `hold(file)`: called where a .jsonl
    file read in blocks ends, where the reader would have warned about what it lost: the caller
    warns (`warn_counts`) there once its blocks are counted (prepare keeps the order of its
    warnings so); without `hold`, `report_raw_files` warns about it."""
    counts = FileCounts(str(path) if name is None else name, path)
    stats.per_file.append(counts)
    try:
        size = path.stat().st_size
        if size == 0:
            counts.status = "empty"
            warn(f"{path}: empty file, skipped")
            return
        sample, complete = _sample(path)
    except _read_errors() as exc:
        counts.status = "unreadable"
        warn(f"{path}: cannot be read ({type(exc).__name__}: {exc}), skipped")
        return

    def skip(kind: str, why: str) -> None:
        """A file read but not used: counted, warned about, and its bytes shown as done."""
        counts.status = kind
        warn(f"{path}: {why}, skipped")
        counts.bytes_in = size
        if progress:
            progress(size)

    if complete and not sample.strip():
        skip("empty", "no text")
        return
    reason = binary_reason(sample)
    enc = None if reason else detect_encoding(sample, complete)
    if enc is None and not reason and mixed_lines_fit(sample, complete):
        enc = (MIXED_CODEC, MIXED_LABEL)  # decoded line by line (the raw path is for one codec)
    if reason or enc is None:
        skip("binary", f"looks binary ({reason or 'no text encoding fits'})")
        return
    codec, label = enc
    counts.encoding = label
    file = len(stats.per_file) - 1
    if units and is_compressed(path):
        # a compressed file: decompressed in a worker, whole (`FileUnit`); its counts come back from there
        counts.bytes_in = size
        yield FileUnit(str(path), file, codec, size, doc_per_line, text_field, raw)
        if progress:
            progress(size)
        return
    yield from read_body(path, counts, codec, size, file, doc_per_line=doc_per_line, text_field=text_field, raw=raw,
                         by_reference=by_reference, warn=warn, progress=progress)
    if not counts.raw:  # (a file read in blocks is warned about once they are decoded: `report_raw_files`)
        warn_counts(counts, text_field, warn)
    elif hold is not None and is_jsonl(path):
        hold(file)


@dataclass
class FileUnit:
    """A compressed input file as one unit of work: a worker decompresses it, cuts it into chunks
    (`pool.chunks_with_origin` over `read_body`) and cleans them (`workers.spill_unit`); prepare's
    main process only sniffs its head. Local workers only (they read the file)."""

    path: str
    file: int  # index into `SourceStats.per_file`
    codec: str
    size: int  # compressed bytes
    doc_per_line: bool
    text_field: str
    raw: bool

    def batches(self, counts: FileCounts, warn: Callable[[str], None]) -> Iterator[list[str] | RawLines]:
        """What the main process would have read of the file (`read_body`), into `counts`."""
        return read_body(Path(self.path), counts, self.codec, self.size, self.file, doc_per_line=self.doc_per_line,
                         text_field=self.text_field, raw=self.raw, by_reference=False, warn=warn, progress=None)


def read_body(path: Path, counts: FileCounts, codec: str, size: int, file: int, *, doc_per_line: bool, text_field: str,
              raw: bool, by_reference: bool, warn: Callable[[str], None],
              progress: Callable[[int], None] | None) -> Iterator[list[str] | RawLines]:
    """The batches of a file that `iter_file_batches` sniffed (`codec`): a damaged stream keeps
    what was read before the damage (status "corrupt", one warning)."""
    stream, rawf = _open_binary(path)
    done = 0
    # .jsonl in blocks only by reference: compressed ones, and with --ray, stay with the reader here
    jsonl = is_jsonl(path)
    refs = by_reference and stream is rawf
    counts.raw = raw and codec in RAW_CODECS and (refs if jsonl else doc_per_line)
    counts.offsets = "byte" if counts.raw or newline_bytes_safe(codec) else "row"
    try:
        if counts.raw and refs:
            batches = _raw_line_refs(rawf, path, size, codec, file, counts, text_field if jsonl else None)
        elif counts.raw:
            batches = _raw_line_blocks(stream, codec, file, counts)
        else:
            tracker = None
            if counts.offsets == "byte":  # the same bytes reach the decoder; the tracker notes line starts
                bom = codecs.BOM_UTF8 if codec == "utf-8-sig" else b""  # (utf-8-sig: the head starts with the BOM)
                tracker = _LineStarts(stream)
                tracker.starts = [np.array([len(bom)], dtype=np.int64)]  # line 0 starts after a BOM
                stream = io.BufferedReader(tracker, 1 << 16)
            f = io.TextIOWrapper(stream, encoding=codec, errors="mspretrain.drop", newline=None)
            starts: list[int] = []
            if jsonl:
                docs = _batched(_jsonl_docs(f, text_field, counts, starts))
            else:
                docs = _line_doc_batches(f, counts, starts) if doc_per_line else _batched(_text_docs(f, counts, starts))
            batches = _with_origin(docs, starts, file, tracker)
        for batch in _counted(batches, counts):
            if not isinstance(batch, RawLines):
                counts.documents += len(batch)
            yield batch
            if progress:
                pos = rawf.tell()
                progress(pos - done)
                done = pos
    except (_Damaged, *_read_errors()) as exc:  # a corrupt .gz/.zst stream fails mid-way: keep what was read
        if isinstance(exc, _Damaged):
            if exc.lines is not None:
                yield exc.lines  # the whole lines before the damage
            exc = exc.cause
        counts.status = "corrupt"
        read = (f"{rawf.tell():,} of {size:,} bytes (the whole lines before the damage are kept)" if counts.raw
                else f"{counts.documents} documents")
        warn(f"{path}: stopped reading after {read} ({type(exc).__name__}: {exc})")
    finally:
        stream.close()
        rawf.close()
    counts.bytes_in = size
    if progress:
        progress(size - done)


def iter_documents(paths: Sequence[Path], *, doc_per_line: bool = False, text_field: str = "text",
                   stats: SourceStats, warn: Callable[[str], None],
                   progress: Callable[[int], None] | None = None) -> Iterator[str]:
    """Documents of all files, in order."""
    for batch in iter_batches(paths, doc_per_line=doc_per_line, text_field=text_field, stats=stats,
                              warn=warn, progress=progress):
        yield from batch


def iter_batches(paths: Sequence[Path], *, doc_per_line: bool = False, text_field: str = "text",
                 stats: SourceStats, warn: Callable[[str], None],
                 progress: Callable[[int], None] | None = None, raw: bool = False,
                 names: Sequence[str] | None = None, by_reference: bool = False,
                 units: bool = False, hold: Callable[[int], None] | None = None) -> Iterator[list[str] | RawLines | FileUnit]:
    """`iter_documents` in lists of documents (or `RawLines`, see `iter_file_batches`), in order;
    `names` (one per path, see `discover_named`) name the files' counts."""
    for i, path in enumerate(paths):
        yield from iter_file_batches(path, doc_per_line=doc_per_line, text_field=text_field, stats=stats,
                                     warn=warn, progress=progress, raw=raw, name=None if names is None else names[i],
                                     by_reference=by_reference, units=units, hold=hold)
