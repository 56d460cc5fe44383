"""Megatron indexed-dataset shards (`.bin` + `.idx`), byte-compatible with Megatron-LM.

Layout of `PREFIX.idx` (all little-endian):
    b"MMIDIDX\\x00\\x00"   magic (9 bytes)
    <Q  version = 1
    <B  dtype code (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16)
    <Q  sequence count S
    <Q  document-index count D
    int32[S]  sequence lengths (tokens)
    int64[S]  byte pointers of each sequence into PREFIX.bin
    int64[D]  document indices: [0, 1, ..., S] (one sequence per document here)
`PREFIX.bin` holds the token arrays back to back, no header.

Design choices: the writer streams tokens straight to disk (memory stays bounded by the
lengths array); both files are written under a `.tmp` name and renamed only by `finalize`,
so a crash mid-write never leaves a finished-looking shard. The reader memory-maps both files
and never copies tokens.
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from mspretrain.errors import UserError
from mspretrain.fsutil import cut_back, fsync_path
from mspretrain.paths import SPLITS, DataPaths

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 (2 bytes per token) whenever the vocabulary fits, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)



class ShardWriter:
    """Appends one document (a token array) at a time; `finalize()` publishes the pair."""

    def __init__(self, prefix: str | Path, dtype: np.dtype | type, state: dict | None = None) -> None:
        """A new shard pair, or (`state`, from `state()`) the one being written, cut back to that
        state: `prepare` resumes its writers after a kill this way."""
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no Megatron code")
        self._bin_tmp = self.prefix.with_name(self.prefix.name + ".bin.tmp")
        self._idx_tmp = self.prefix.with_name(self.prefix.name + ".idx.tmp")
        # Lengths go to a side file (int32), not memory: `finalize` streams the index from it,
        # so a writer's memory does not grow with the document count (4-40 bytes per document did).
        self._len_tmp = self.prefix.with_name(self.prefix.name + ".len.tmp")
        self.tokens = 0
        self.documents = 0
        # the largest token id written (-1: none), for the manifest's `max_token_id`: `train` then
        # checks the ids against the vocabulary without reading the shards (data/manifest.py)
        self.max_token = -1
        if state is None:
            self._bin = open(self._bin_tmp, "wb")
            self._len = open(self._len_tmp, "wb")
            return
        self.tokens, self.documents, self.max_token = state["tokens"], state["documents"], state["max_token"]
        for path, size in ((self._bin_tmp, self.tokens * self.dtype.itemsize), (self._len_tmp, self.documents * 4)):
            cut_back(path, size)  # a torn tail written after the state was taken
        self._bin = open(self._bin_tmp, "ab")
        self._len = open(self._len_tmp, "ab")

    def state(self) -> dict:
        """Flush; the counts that `ShardWriter(prefix, dtype, state)` resumes from."""
        self._bin.flush()
        self._len.flush()
        return {"tokens": self.tokens, "documents": self.documents, "max_token": self.max_token}

    def files(self) -> list[Path]:
        return [self._bin_tmp, self._len_tmp]

    def close(self) -> None:
        """Close the files, not finalized (`finish_resumed` reopens them from a state)."""
        self._bin.close()
        self._len.close()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _check_range(self, tokens: np.ndarray) -> None:
        # A silent wrap-around (id 70000 stored as uint16) would corrupt the data unnoticed.
        if tokens.size and tokens.dtype != self.dtype and tokens.dtype.kind in "iu":
            lo, hi = int(np.min(tokens)), int(np.max(tokens))
            if lo < np.iinfo(self.dtype).min or hi > np.iinfo(self.dtype).max:
                raise ValueError(f"token id {lo if lo < 0 else hi} does not fit {self.dtype}")

    def add(self, tokens: np.ndarray | list[int]) -> None:
        src = np.asarray(tokens)
        self._check_range(src)
        arr = src.astype(self.dtype, copy=False)
        self._bin.write(arr.tobytes(order="C"))
        if arr.size:
            self.max_token = max(self.max_token, int(arr.max()))
        self._len.write(np.array([arr.size], dtype=np.int32).tobytes())
        self.tokens += int(arr.size)
        self.documents += 1

    def add_many(self, docs: list[np.ndarray]) -> None:
        """Write several documents with one `write` call."""
        if not docs:
            return
        arrs = [np.asarray(d) for d in docs]
        self.add_flat(np.concatenate(arrs), np.array([a.size for a in arrs], dtype=np.int32))

    def reserve(self, token_bytes: int, length_bytes: int, max_token: int) -> tuple[int, int]:
        """Count documents that someone else writes into this writer's files, at the returned
        offsets (tokens in `.bin.tmp`, int32 lengths in `.len.tmp`): `prepare`'s replay has its
        workers copy their pieces there. `seek_end` before writing through this writer again."""
        at = (self.tokens * self.dtype.itemsize, self.documents * 4)
        self.tokens += token_bytes // self.dtype.itemsize
        self.documents += length_bytes // 4
        self.max_token = max(self.max_token, max_token)
        return at

    def seek_end(self) -> None:
        """After `reserve`d pieces were written: write on after them."""
        self._bin.seek(self.tokens * self.dtype.itemsize)
        self._len.seek(self.documents * 4)

    def peek_last(self) -> np.ndarray:
        """Remove the last document from the counts and return its tokens (`prepare` moves it to
        the other split when one would be empty); `max_token` is recomputed over what stays. The
        files keep its bytes until a writer is made from the new `state()` (`finish_resumed` cuts
        them), so that a kill before the commit naming the new counts finds every committed byte."""
        self.state()
        (n,) = np.fromfile(self._len_tmp, dtype=np.int32, count=1, offset=(self.documents - 1) * 4)
        keep = self.tokens - int(n)
        last = np.fromfile(self._bin_tmp, dtype=self.dtype, count=int(n), offset=keep * self.dtype.itemsize)
        self.tokens, self.documents = keep, self.documents - 1
        self.max_token = int(np.memmap(self._bin_tmp, dtype=self.dtype, mode="r", shape=(keep,)).max()) if keep else -1
        return last

    def add_flat(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Write documents given back to back in `tokens`, `lengths[i]` tokens each (the hot
        path of `prepare`: one write, no per-document Python work)."""
        lengths = np.asarray(lengths, dtype=np.int32)
        if int(lengths.sum(dtype=np.int64)) != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        if lengths.size and int(lengths.min()) < 0:
            raise ValueError("negative document length")
        tokens = np.asarray(tokens)
        self._check_range(tokens)
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        if len(tokens):
            self.max_token = max(self.max_token, int(tokens.max()))
        self._len.write(lengths.tobytes())
        self.tokens += len(tokens)
        self.documents += int(lengths.size)

    def finalize(self, fsync: bool = True) -> None:
        """Write the index and rename both files into place. `fsync=False` leaves durability to
        the caller, who must fsync both files before publishing them anywhere (`prepare`
        builds them in a hidden directory and fsyncs all its files at once)."""
        self._bin.flush()
        if fsync:
            os.fsync(self._bin.fileno())
        self._bin.close()
        self._len.close()
        write_index_streamed(self._idx_tmp, self._len_tmp, self.dtype)
        if fsync:
            fsync_path(self._idx_tmp)
        # .bin first: an .idx without its .bin is detectably broken, the reverse could look whole.
        os.replace(self._bin_tmp, Path(str(self.prefix) + ".bin"))
        os.replace(self._idx_tmp, Path(str(self.prefix) + ".idx"))
        self._len_tmp.unlink()  # last: while it exists, a resumed `prepare` finalizes again (`finish_resumed`)

    @classmethod
    def finish_resumed(cls, prefix: str | Path, dtype: np.dtype | type, state: dict, fsync: bool = True) -> "ShardWriter | None":
        """`finalize` of a writer in `state`, after a kill that may have come during an earlier
        `finalize`; returns the writer (None if that finalize had completed)."""
        prefix = Path(prefix)
        bin_path, idx_path = Path(str(prefix) + ".bin"), Path(str(prefix) + ".idx")
        bin_tmp, len_tmp = prefix.with_name(prefix.name + ".bin.tmp"), prefix.with_name(prefix.name + ".len.tmp")
        if not len_tmp.exists() and idx_path.exists():
            return None
        if bin_path.exists() and not bin_tmp.exists():
            os.replace(bin_path, bin_tmp)  # put back what the interrupted finalize had renamed
        idx_path.unlink(missing_ok=True)
        writer = cls(prefix, dtype, state)
        writer.finalize(fsync=fsync)
        return writer

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        if not self._len.closed:
            self._len.close()
        for p in (self._bin_tmp, self._idx_tmp, self._len_tmp):
            p.unlink(missing_ok=True)


def index_bytes(lengths: np.ndarray, dtype: np.dtype | type) -> bytes:
    """The exact bytes of a Megatron `.idx` for these sequence lengths."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    n = int(lengths.size)
    pointers = np.zeros(n, dtype=np.int64)
    if n > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_idx = np.arange(n + 1, dtype=np.int64)
    header = MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF[dtype])
    header += struct.pack("<Q", n) + struct.pack("<Q", n + 1)
    return header + lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes()


def write_index_streamed(path: Path, lengths_path: Path, dtype: np.dtype | type, block: int = 1 << 20) -> None:
    """`write_index` with the lengths read from a file of int32, `block` documents at a time:
    the same bytes, in memory bounded by the block whatever the document count."""
    dtype = np.dtype(dtype)
    n = lengths_path.stat().st_size // 4
    header = MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF[dtype])
    header += struct.pack("<Q", n) + struct.pack("<Q", n + 1)
    with open(path, "wb") as f, open(lengths_path, "rb") as src:
        f.write(header)
        while chunk := src.read(4 * block):  # lengths
            f.write(chunk)
        src.seek(0)
        pos = 0  # byte pointer of the next document
        while chunk := src.read(4 * block):  # pointers: exclusive cumulative sum of lengths * itemsize
            sizes = np.frombuffer(chunk, dtype=np.int32).astype(np.int64) * dtype.itemsize
            ends = np.cumsum(sizes) + pos
            f.write((ends - sizes).tobytes())
            pos = int(ends[-1])
        for lo in range(0, n + 1, block):  # document indices 0..n
            f.write(np.arange(lo, min(lo + block, n + 1), dtype=np.int64).tobytes())


def write_index(path: str | Path, lengths: np.ndarray, dtype: np.dtype | type) -> None:
    with open(path, "wb") as f:
        f.write(index_bytes(lengths, dtype))


def data_fingerprint(data_dir: str | Path) -> str:
    """SHA-256 over the split indices and the tokenizer of a data dir (what `prepare` records).

    The `.idx` files pin every document's length and position and the tokenizer pins the ids,
    so a re-prepared or edited data dir changes the fingerprint; the `.bin` files are not read,
    which keeps this cheap for terabyte corpora.
    """
    paths = DataPaths(data_dir)
    h = hashlib.sha256()
    files = [paths.idx(split) for split in SPLITS] + [paths.tokenizer_model, paths.tokenizer_json]  # this order, always
    for path in (p for p in files if p.is_file()):
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


class IndexedDataset:
    """Read-only view of a `.bin/.idx` pair through `np.memmap` (no copies)."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        idx_path = Path(str(self.prefix) + ".idx")
        bin_path = Path(str(self.prefix) + ".bin")
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise UserError(f"shard file {p} is missing", "run `mspretrain prepare` to (re)create the data dir")
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE or head[: len(MAGIC)] != MAGIC:
            raise UserError(f"{idx_path} is not a Megatron index file (bad magic)", "re-run `mspretrain prepare` for this data dir")
        off = len(MAGIC)
        (version,) = struct.unpack_from("<Q", head, off)
        (code,) = struct.unpack_from("<B", head, off + 8)
        (n_seq,) = struct.unpack_from("<Q", head, off + 9)
        (n_doc,) = struct.unpack_from("<Q", head, off + 17)
        if version != VERSION or code not in DTYPE_CODES:
            raise UserError(f"{idx_path} has version {version} / dtype code {code}, which this reader does not know",
                            "re-run `mspretrain prepare`")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_path.stat().st_size != expected:
            raise UserError(f"{idx_path} is truncated or corrupt ({idx_path.stat().st_size} bytes, expected {expected})",
                            "re-run `mspretrain prepare`")
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=HEADER_SIZE)
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=HEADER_SIZE + 4 * n_seq)
        self.doc_idx = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=HEADER_SIZE + 12 * n_seq)
        n_tokens = int(self.lengths.sum(dtype=np.int64))
        if bin_path.stat().st_size != n_tokens * self.dtype.itemsize:
            raise UserError(f"{bin_path} does not match its index ({bin_path.stat().st_size} bytes for {n_tokens} tokens)",
                            "re-run `mspretrain prepare`")
        # np.memmap refuses empty files; an empty split is a valid (if useless) shard.
        self.tokens = (np.memmap(bin_path, mode="r", dtype=self.dtype) if n_tokens
                       else np.zeros(0, dtype=self.dtype))
        self.n_tokens = n_tokens

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.lengths[i])]
