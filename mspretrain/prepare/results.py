"""What a prepare worker sends back for one chunk of pass 1 (`workers.clean_chunk`,
`workers.spill_chunk`) and for one compressed file it read whole (`workers.spill_unit`).

Typed, instead of the dicts they were: the main process spools each `ChunkResult` (pickled,
`ChunkSpool`) until the dedup decisions are known, and the replay reads it back
(`sink.Sink.take`, or only the counts and the piece's name on the pieces path). The per-document
arrays are aligned with the chunk's cleaned documents, in input order."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from mspretrain.fsutil import cut_back


@dataclass
class ChunkResult:
    docs_in: int  # documents read (before cleaning)
    chars_in: int
    changed: dict[str, int]  # what the cleaner changed, per rule
    dropped: dict[str, int]  # what the cleaner and the quality filters dropped, per reason
    raw: tuple | None  # a block of raw lines' counts (`sources.count_raw`: file, then its counts), or None
    origin: np.ndarray | None  # `origin.RECORD` per cleaned document, or None (bare documents)
    chars: np.ndarray | None = None  # characters per cleaned document
    u: np.ndarray | None = None  # (n, 2) split and sample numbers (`dedup.split_numbers`)
    keys: bytes | None = None  # 16-byte dedup key per document (None once a worker wrote them as dedup records)
    bands: np.ndarray | None = None  # (n, bands) LSH band keys with near dedup
    scores: np.ndarray | None = None  # the quality sidecar's records (`scoring.RECORD`), with quality filters
    texts: list[str] | None = None  # the cleaned texts (no tokenizer yet) ...
    tokens: np.ndarray | None = None  # ... or their tokens, EOS after each (a given tokenizer)
    lengths: np.ndarray | None = None  # tokens per document, EOS included
    fallback: np.ndarray | None = None  # byte-fallback tokens per document
    # the pieces path (`workers.spill_chunk`): the arrays above went to the chunk's file
    n: int = 0  # cleaned documents
    exact_counts: np.ndarray | None = None  # dedup records per partition file (`diskdedup.chunk_records`)
    band_counts: np.ndarray | None = None
    has_origin: bool = False
    text_piece: bool = False  # the file holds texts, not tokens
    piece: str | None = None  # the file's name in pass 1's pieces dir


@dataclass
class SplitPiece:
    """One split's section of a replay piece file (`workers.replay_chunk`): [tokens | lengths
    (int32) | origin records] from byte `at`, and what the sink counts for it."""
    at: int  # its first byte in the piece file
    sizes: tuple[int, int, int]  # bytes of the tokens, the lengths, the origin records
    docs: int
    chars: int
    tokens: int
    max_token: int  # -1: no token
    last_chars: int  # characters of its last document (the split move's count, `Sink.count_move`)


@dataclass
class ReplayResult:
    """A chunk cut by `workers.replay_chunk`: its sections per split (only splits with documents)
    and the per-file sums of its kept documents (`sink.FileTally.sums_of`), or None."""
    splits: dict[str, SplitPiece] = field(default_factory=dict)
    per_file: dict | None = None


@dataclass
class UnitResult:
    """A compressed file read by one worker: its chunks' results in order, its `FileCounts`
    fields and what reading it warned."""
    file: int
    chunks: list[ChunkResult] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class ChunkSpool:
    """Pass 1's chunk results (pickled, in order) on disk until the dedup decisions are known."""

    def __init__(self, path: Path, size: int | None = None, chunks: int = 0) -> None:
        """A new spool, or (`size`) one cut back to the `size` bytes holding its first `chunks`."""
        self.path = path
        if size is None:
            self._f = open(path, "wb", buffering=1 << 20)
        else:
            cut_back(path, size)
            self._f = open(path, "ab", buffering=1 << 20)
        self.chunks = chunks

    def add(self, result: ChunkResult) -> None:
        pickle.dump(result, self._f, protocol=5)
        self.chunks += 1

    def flush(self) -> int:
        """Write the buffer out; the spool's length in bytes."""
        self._f.flush()
        return self._f.tell()

    def close(self) -> None:
        self._f.close()

    def read_from(self, offset: int = 0, first: int = 0) -> Iterator[tuple[ChunkResult, int]]:
        """The chunks from number `first` on, which start at byte `offset` (a resumed replay's
        commit), each with the byte offset where it ends (what the next commit records)."""
        with open(self.path, "rb", buffering=1 << 20) as f:
            f.seek(offset)
            for _ in range(first, self.chunks):
                yield pickle.load(f), f.tell()

    def read(self) -> Iterator[ChunkResult]:
        """Every chunk, in order (the spool stays: the stage runner removes it, `workdir.WorkDir`)."""
        with open(self.path, "rb", buffering=1 << 20) as f:
            for _ in range(self.chunks):
                yield pickle.load(f)
