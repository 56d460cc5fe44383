"""Where each document of a data dir came from: the per-split origin index `prepare` writes.

Layout of `SPLIT.origin` (next to `SPLIT.bin` / `SPLIT.idx`, all little-endian):
    b"MSORIGIN"      magic (8 bytes)
    <I  version = 1
    <I  record size = 12
    then one record per document of the split, in the order of the `.idx` sequences:
    <u4 file    index into the manifest's `input_files` (the files in reading order)
    <u8 offset  where the document starts in that file (see `manifest["origin"]["offsets"]`):
                "byte": byte offset in the file as read (for .gz/.zst: in the decompressed
                        stream) of the document's first line (for .jsonl: of its record's line);
                "row":  0-based line number, for files in an encoding where a byte offset cannot
                        be found without decoding (UTF-16/32)
A document cut out of a line longer than `textdocs.MAX_DOC_CHARS` points at its own first byte
when the line was read as raw blocks (one document per line, UTF-8/GB18030), else at the start
of its line.

Design choices: 12 bytes per document, written in pass 1 by `sink.Sink` as the documents reach
the shards (dedup, cleaning and the split drop and move documents; the index follows), so it
costs no extra pass. Data dirs prepared before the index existed have no `.origin` files:
`read_origin` returns None and `require_origin` says to re-run prepare.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mspretrain.errors import UserError
from mspretrain.fsutil import cut_back

MAGIC = b"MSORIGIN"
VERSION = 1
RECORD = np.dtype([("file", "<u4"), ("offset", "<u8")])  # packed: 12 bytes
HEADER = MAGIC + struct.pack("<II", VERSION, RECORD.itemsize)
MISSING_HINT = "re-run prepare to get document origins"


def origin_name(split: str) -> str:
    return f"{split}.origin"


def origin_path(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / origin_name(split)


class OriginWriter:
    """Appends origin records of one split; `close()` leaves the finished file (prepare writes in
    a hidden work dir and publishes the whole dir at once, so no temporary name is needed here)."""

    def __init__(self, path: Path, records: int | None = None) -> None:
        """A new file, or (`records`) the one being written, cut back to that many records:
        `prepare` resumes its replay after a kill this way (a torn tail goes)."""
        self.path = path
        if records is None:
            self._f = open(path, "wb")
            self._f.write(HEADER)
            self.records = 0
            return
        self._f = open(path, "r+b")
        cut_back(self._f, len(HEADER) + records * RECORD.itemsize)
        self._f.seek(0, os.SEEK_END)
        self.records = records

    def add(self, origin: np.ndarray) -> None:
        if origin.size:
            self._f.write(np.ascontiguousarray(origin, dtype=RECORD).tobytes())
            self.records += int(origin.size)

    def reserve(self, nbytes: int) -> int:
        """Count records someone else writes into this file, at the returned offset (`prepare`'s
        replay workers); `seek_end` before adding through this writer again."""
        at = len(HEADER) + self.records * RECORD.itemsize
        self.records += nbytes // RECORD.itemsize
        return at

    def seek_end(self) -> None:
        self._f.flush()
        self._f.seek(len(HEADER) + self.records * RECORD.itemsize)

    def peek_last(self) -> np.ndarray:
        """Forget the last record and return it, leaving the file's bytes as they are (`prepare`'s
        replay moves it; `cut_to` later, after the commit that names the new count, so that a kill
        in between still finds the committed records on disk)."""
        self._f.flush()
        self.records -= 1
        return np.fromfile(self.path, dtype=RECORD, count=1, offset=len(HEADER) + self.records * RECORD.itemsize)

    def close(self) -> None:
        self._f.close()


def cut_to(path: Path, records: int) -> None:
    """Cut an origin file back to `records` records (idempotent: redone after a kill)."""
    with open(path, "r+b") as f:
        f.truncate(len(HEADER) + records * RECORD.itemsize)


def read_records(path: Path) -> np.ndarray:
    """The records of one `.origin` file (memory-mapped); UserError if it is not one."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(len(HEADER))
    if head != HEADER or (size - len(HEADER)) % RECORD.itemsize:
        raise UserError(f"{path} is not an origin index of this version (bad header or size)", MISSING_HINT)
    if size == len(HEADER):
        return np.zeros(0, dtype=RECORD)
    return np.memmap(path, mode="r", dtype=RECORD, offset=len(HEADER))


@dataclass
class Origin:
    """One split's origin index. `files[i]` is input file i as the user named it (the manifest's
    `input_files[i]["name"]`), `kinds[i]` what offsets into it mean ("byte" or "row"), `kind`
    the one meaning shared by all files, or "mixed"."""

    files: list[str]
    kinds: list[str]
    records: np.ndarray  # RECORD per document of the split

    @property
    def kind(self) -> str:
        used = {k for k in self.kinds if k}  # a skipped file has no kind (and no documents)
        return used.pop() if len(used) == 1 else ("byte" if not used else "mixed")

    def __len__(self) -> int:
        return int(self.records.size)

    def locate(self, doc_ids: np.ndarray) -> list[tuple[str, int]]:
        """(input file as named, offset) of each document id of the split."""
        ids = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"document id out of range 0..{len(self) - 1}")
        rec = self.records[ids]
        return [(self.files[f], o) for f, o in zip(rec["file"].tolist(), rec["offset"].tolist())]

    def kind_of(self, doc_ids: np.ndarray) -> list[str]:
        """What each document's offset means ("byte" or "row")."""
        rec = self.records[np.asarray(doc_ids, dtype=np.int64).reshape(-1)]
        return [self.kinds[f] for f in rec["file"].tolist()]


def read_origin(data_dir: str | Path, split: str = "train") -> Origin | None:
    """The split's origin index, or None when the data dir has none (prepared before it existed).
    A present but damaged index, or one that does not match the split's `.idx`, is a UserError."""
    from mspretrain.data.manifest import read_manifest
    from mspretrain.data.shards import IndexedDataset

    d = Path(data_dir).expanduser()
    path = origin_path(d, split)
    manifest = read_manifest(d, required={})
    info = manifest.get("origin")
    if not path.is_file() or not isinstance(info, dict):
        return None
    entries = manifest.get("input_files")
    kinds = info.get("offsets")
    if not isinstance(entries, list) or not isinstance(kinds, list) or len(kinds) != len(entries):
        raise UserError(f"{d}/manifest.json does not describe the input files of {path.name}", MISSING_HINT)
    records = read_records(path)
    n_docs = len(IndexedDataset(d / split))
    if records.size != n_docs:
        raise UserError(f"{path} holds {records.size} documents but {split}.idx has {n_docs}", MISSING_HINT)
    if records.size and int(records["file"].max()) >= len(entries):
        raise UserError(f"{path} names input file {int(records['file'].max())}, the manifest lists {len(entries)}", MISSING_HINT)
    files = [str(e.get("name", "?")) if isinstance(e, dict) else "?" for e in entries]
    return Origin(files=files, kinds=[str(k) for k in kinds], records=records)


def require_origin(data_dir: str | Path, split: str = "train") -> Origin:
    """`read_origin`, with a data dir that has no index refused in one line."""
    origin = read_origin(data_dir, split)
    if origin is None:
        raise UserError(f"data dir {data_dir} has no document origin index ({origin_name(split)})", MISSING_HINT)
    return origin


def docs_in_window(doc_ends: np.ndarray, seq_len: int, window: int) -> list[tuple[int, int, int]]:
    """The documents packed window `window` overlaps: (doc id, first token index within the
    window, end index within the window (exclusive)). The loader's window i holds tokens
    [i * seq_len, i * seq_len + seq_len + 1) of the split (`data/loader.py`); `doc_ends` is
    `np.cumsum(lengths)` of the split's `.idx` (EOS included in each document's length)."""
    ends = np.asarray(doc_ends, dtype=np.int64)
    lo = window * seq_len
    hi = min(lo + seq_len + 1, int(ends[-1]) if ends.size else 0)
    out = []
    d = int(np.searchsorted(ends, lo, side="right"))  # the first document ending after `lo`
    while d < ends.size and lo < hi:
        start = int(ends[d - 1]) if d else 0
        out.append((d, max(start, lo) - window * seq_len, min(int(ends[d]), hi) - window * seq_len))
        lo = int(ends[d])
        d += 1
    return out
