"""Input discovery and streaming document readers for `prepare`: the entry points
(`iter_batches`, `iter_file_batches`, `FileUnit`) and the warnings about what a file lost.

The parts, by what they read:
- `prepare/discover.py`: which files (inputs are files, directories and globs; a typo is an error);
- `prepare/sniff.py`: what a file is (compression, binary or text, its encoding, or UTF-8 and
  GB18030 lines mixed);
- `prepare/textdocs.py`: documents out of decoded text (blank-line separated, one per line, .jsonl
  records), cut at `MAX_DOC_CHARS`, each with its origin (file, offset);
- `prepare/rawlines.py`: one-document-per-line and .jsonl files as blocks of whole lines for the
  workers (`RawLines`, decoded where they are read);
- `prepare/filecounts.py`: what reading found, per file (`FileCounts`) and in total (`SourceStats`).

Their public names are importable from here too (`sources.RawLines`, `sources.SourceStats`, ...):
prepare's pipeline and workers use this module as the one door to its inputs. Everything streams
and nothing is fatal: problems become counted skips and a warning naming the file.
"""
from __future__ import annotations

import codecs
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from mspretrain.prepare import textdocs
from mspretrain.prepare.discover import discover, discover_named, is_compressed, is_jsonl
from mspretrain.prepare.filecounts import FileCounts, SourceStats, counted
from mspretrain.prepare.rawlines import (
    RAW_CODECS,
    Damaged,
    RawLines,
    add_raw,
    count_raw,
    decode_raw,
    raw_line_blocks,
    raw_line_refs,
)
from mspretrain.prepare.sniff import (
    MIXED_CODEC,
    MIXED_LABEL,
    binary_reason,
    detect_encoding,
    mixed_lines_fit,
    newline_bytes_safe,
    open_binary,
    read_errors,
    read_head,
)
from mspretrain.prepare.textdocs import LineStarts, batched, cut_text, jsonl_docs, line_doc_batches, text_docs, with_origin

# what the rest of `prepare` reads through this module: its own entry points and, from the parts above,
# the names prepare's pipeline and workers read as `sources.NAME`
__all__ = ["FileCounts", "FileUnit", "RawLines", "SourceStats", "add_raw", "count_raw", "cut_text", "decode_raw", "discover",
           "discover_named", "is_compressed", "is_jsonl", "iter_batches", "iter_documents", "iter_file", "iter_file_batches",
           "read_body", "report_raw_files", "warn_counts"]


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
            + [f"{too_long} lines over {textdocs.MAX_JSONL_LINE_CHARS:,} characters"] * bool(too_long)
        warn(f"{path}: skipped {', '.join(parts)}")
    if not counts.documents:
        warn(f"{path}: no documents found" + (f" (is the text in a field other than '{text_field}'? use --text-field)"
                                              if is_jsonl(path) else ""))


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
        sample, complete = read_head(path)
    except read_errors() as exc:
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
    stream, rawf = open_binary(path)
    done = 0
    # .jsonl in blocks only by reference: compressed ones, and with --ray, stay with the reader here
    jsonl = is_jsonl(path)
    refs = by_reference and stream is rawf
    counts.raw = raw and codec in RAW_CODECS and (refs if jsonl else doc_per_line)
    counts.offsets = "byte" if counts.raw or newline_bytes_safe(codec) else "row"
    try:
        if counts.raw and refs:
            batches = raw_line_refs(rawf, path, size, codec, file, counts, text_field if jsonl else None)
        elif counts.raw:
            batches = raw_line_blocks(stream, codec, file, counts)
        else:
            tracker = None
            if counts.offsets == "byte":  # the same bytes reach the decoder; the tracker notes line starts
                bom = codecs.BOM_UTF8 if codec == "utf-8-sig" else b""  # (utf-8-sig: the head starts with the BOM)
                tracker = LineStarts(stream)
                tracker.starts = [np.array([len(bom)], dtype=np.int64)]  # line 0 starts after a BOM
                stream = io.BufferedReader(tracker, 1 << 16)
            f = io.TextIOWrapper(stream, encoding=codec, errors="mspretrain.drop", newline=None)
            starts: list[int] = []
            if jsonl:
                docs = batched(jsonl_docs(f, text_field, counts, starts))
            else:
                docs = line_doc_batches(f, counts, starts) if doc_per_line else batched(text_docs(f, counts, starts))
            batches = with_origin(docs, starts, file, tracker)
        for batch in counted(batches, counts):
            if not isinstance(batch, RawLines):
                counts.documents += len(batch)
            yield batch
            if progress:
                pos = rawf.tell()
                progress(pos - done)
                done = pos
    except (Damaged, *read_errors()) as exc:  # a corrupt .gz/.zst stream fails mid-way: keep what was read
        if isinstance(exc, Damaged):
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
