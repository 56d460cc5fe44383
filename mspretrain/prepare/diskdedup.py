"""Exact and near dedup with their state on disk: memory set by buffer sizes, not by the corpus.

Design choices:
- Pass 1 only records, per cleaned document (numbered in input order: `idx`), its 128-bit exact
  key and, with near dedup, its LSH band keys; the decisions are taken after pass 1, and pass 1's
  chunk results wait in a spool (`results.ChunkSpool`) until they are known.
- Records are spilled into `parts` files by the top bits of their key (`Partitions`): every
  record with a given key lands in the same file, in input order (appends are ordered, and the
  split into files is a stable sort). Each file is sorted on its own in memory; their number
  grows with the input's size, so each stays about `PART_BYTES` whatever the corpus.
- Exact: in a file sorted by key (stable), every record after the first of its key is a
  duplicate: the first occurrence in input order is kept, as before.
- Near: the same decisions as datasketch's `MinHashLSH` used greedily in input order (query,
  then insert if kept), which `prepare` did in memory until now: a document that exact dedup
  kept is a near duplicate when it shares a band bucket with an earlier document that was kept.
  Band buckets with two or more members (over the exact-kept documents) are found per file; only
  their members (idx, bucket) are held, so memory follows the number of near-duplicate
  candidates, not the corpus. The greedy pass over them, in input order, claims the buckets of
  each kept document. Candidates are not verified with Jaccard (as before): the manifest says so.
- A band key is a 64-bit hash of the band's `rows` uint32 MinHash values and the band's number
  (datasketch compares the values' bytes): two different bands of 128-bit content collide with
  probability 2^-64, which we accept.
- Decisions are bitmaps, one bit per cleaned document (125 MB per billion documents).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from mspretrain.fsutil import atomic_writer, cut_back
from mspretrain.prepare import dedup
from mspretrain.prepare.tasks import PlaceRecords

PART_BYTES = 64 << 20  # target size of one partition file (sorted in memory, ~3x this at once)
BUFFER_BYTES = 16 << 20  # records buffered in memory before they are spread over the files

EXACT = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("idx", "<u8")])
BAND = np.dtype([("key", "<u8"), ("idx", "<u8")])


def part_count(expected_bytes: float) -> int:
    """A power of two of files, so that each holds about PART_BYTES (1 to 4,096)."""
    n = 1
    while n < 4096 and expected_bytes / n > PART_BYTES:
        n *= 2
    return n


class Partitions:
    """Structured records spilled to `parts` files in `root` by the top bits of their first field."""

    def __init__(self, root: Path, name: str, dtype: np.dtype, parts: int) -> None:
        self.root, self.name, self.dtype, self.parts = root, name, dtype, parts
        self.shift = np.uint64(64 - (parts.bit_length() - 1))
        self._buf: list[np.ndarray] = []
        self.ends = np.zeros(parts, dtype=np.int64)  # bytes per file, as `reserve` hands places out
        self._buffered = 0
        self.records = 0
        self.touched: set[int] = set()  # files appended to since `sizes` (what a commit must fsync)

    def path(self, i: int) -> Path:
        return self.root / f"{self.name}.{i:04d}"

    def part_of(self, first: np.ndarray) -> np.ndarray:
        """The file number (uint16) of records with this first field."""
        return (first >> self.shift).astype(np.uint16) if self.parts > 1 else np.zeros(first.size, dtype=np.uint16)

    def add(self, recs: np.ndarray) -> None:
        if not recs.size:
            return
        self._buf.append(recs)
        self._buffered += recs.nbytes
        self.records += recs.size
        if self._buffered >= BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        recs = np.concatenate(self._buf)
        self._buf, self._buffered = [], 0
        # uint16 file numbers: numpy's stable sort is a radix sort for them
        part = self.part_of(recs[recs.dtype.names[0]])
        order = np.argsort(part, kind="stable")  # stable: input order within each file
        recs, part = recs[order], part[order]
        bounds = np.searchsorted(part, np.arange(self.parts + 1))
        for i in np.flatnonzero(bounds[1:] > bounds[:-1]).tolist():
            self.touched.add(i)
            with open(self.path(i), "ab") as f:
                recs[bounds[i]: bounds[i + 1]].tofile(f)

    def read(self, remove: bool = True) -> Iterator[np.ndarray]:
        """Each file's records (input order), one file at a time; files are removed once read
        unless `remove` is False (`prepare` keeps them until the decisions are on disk, so that
        a kill while they are taken can take them again)."""
        self.flush()
        for i in range(self.parts):
            p = self.path(i)
            if p.exists():
                recs = np.fromfile(p, dtype=self.dtype)
                if remove:
                    p.unlink()
                yield recs

    def sizes(self) -> dict[str, int]:
        """After `flush`: the byte length of each file (what a resume truncates them back to)."""
        return {self.path(i).name: self.path(i).stat().st_size for i in range(self.parts) if self.path(i).exists()}

    def restore(self, sizes: dict[str, int], records: int) -> None:
        """Back to a committed state: files cut to `sizes`, files written after it removed."""
        for i in range(self.parts):
            p = self.path(i)
            if p.name in sizes:
                cut_back(p, sizes[p.name])
            else:
                p.unlink(missing_ok=True)
        self._buf, self._buffered, self.records = [], 0, records
        self.ends = np.array([sizes.get(self.path(i).name, 0) for i in range(self.parts)], dtype=np.int64)

    def reserve(self, counts: np.ndarray) -> list[tuple[str, int, int, int]]:
        """Places for one chunk's records, grouped by file (`group`) with `counts` per file, after
        the records reserved before: (file, byte offset, first record, end record) for each file
        it touches. A worker writes them there (`place_records`); prepare's commit waits for it."""
        at = self.ends.copy()
        self.ends += counts.astype(np.int64) * self.dtype.itemsize
        bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
        out = []
        for i in np.flatnonzero(counts).tolist():
            self.touched.add(i)
            out.append((str(self.path(i)), int(at[i]), bounds[i], bounds[i + 1]))
        self.records += int(bounds[-1])
        return out

    def existing(self) -> list[str]:
        """The files that exist, in order (what `read` would read)."""
        self.flush()
        return [str(self.path(i)) for i in range(self.parts) if self.path(i).exists()]


def group(recs: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Records in the order of their partition files (of `parts`: by the top bits of their first
    field; stable, so input order within each file) and how many go to each: a worker's share of
    `Partitions.flush`."""
    if parts <= 1:
        return recs, np.array([recs.size], dtype=np.int64)
    part = (recs[recs.dtype.names[0]] >> np.uint64(64 - (parts.bit_length() - 1))).astype(np.uint16)
    return recs[np.argsort(part, kind="stable")], np.bincount(part, minlength=parts)


def chunk_records(keys: bytes, bands: np.ndarray | None, exact_parts: int, band_parts: int) -> tuple:
    """A chunk's `EXACT` and `BAND` records (idx counted from 0 in the chunk), each `group`ed:
    (exact records, counts, band records or None, counts or None). Built by a worker; the main
    process only reserves their places (`DiskDedup.reserve`)."""
    k = np.frombuffer(keys, dtype="<u8").reshape(-1, 2)
    n = k.shape[0]
    recs = np.empty(n, dtype=EXACT)
    recs["k0"], recs["k1"], recs["idx"] = k[:, 0], k[:, 1], np.arange(n, dtype=np.uint64)
    out = group(recs, exact_parts)
    if bands is None:
        return (*out, None, None)
    b = np.empty(bands.size, dtype=BAND)
    b["key"] = bands.reshape(-1)
    b["idx"] = np.repeat(np.arange(n, dtype=np.uint64), bands.shape[1])
    return (*out, *group(b, band_parts))


def place_records(item: PlaceRecords) -> None:
    """Write a chunk's records (`chunk_records`, saved at `path`) at the places the main process
    reserved in the partition files, their idx moved on by `base` (the chunk's first document);
    then remove `path`. Run by a worker: the main process never touches the records."""
    path, base, places = item
    with open(path, "rb") as f:
        arrays = [np.load(f) for _ in places]
    for recs, where in zip(arrays, places):
        if not where:
            continue
        recs["idx"] += np.uint64(base)
        for dst, at, lo, hi in where:
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                data = recs[lo:hi].tobytes()
                while data:
                    w = os.pwrite(fd, data, at)
                    data, at = data[w:], at + w
            finally:
                os.close(fd)
    os.unlink(path)


class Bits:
    """One bit per document: set for the dropped ones."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.bits = np.zeros((n + 7) // 8, dtype=np.uint8)

    def set(self, idx: np.ndarray) -> None:
        idx = np.asarray(idx, dtype=np.int64)
        np.bitwise_or.at(self.bits, idx >> 3, (1 << (idx & 7)).astype(np.uint8))

    def get(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        return ((self.bits[idx >> 3] >> (idx & 7).astype(np.uint8)) & 1).astype(bool)

    def range(self, lo: int, hi: int) -> np.ndarray:
        # the bytes holding lo..hi-1 unpacked (bit i of a byte is document 8 * byte + i), not a
        # gather per document: this runs in the main process once per chunk of the replay
        b = lo >> 3
        return np.unpackbits(self.bits[b:(hi + 7) >> 3], bitorder="little")[lo - 8 * b:hi - 8 * b].view(bool)

    def count(self) -> int:
        return int(np.unpackbits(self.bits).sum())


def _repeated(keys: np.ndarray) -> np.ndarray:
    """Mask of the entries whose key occurs more than once (order kept: the mask is per entry).
    An unstable in-place sort of a copy is the one full-size step; usually few keys repeat."""
    if keys.size < 2:
        return np.zeros(keys.size, dtype=bool)
    s = np.sort(keys)
    rep = s[1:][s[1:] == s[:-1]]
    if not rep.size:
        return np.zeros(keys.size, dtype=bool)
    rep = np.unique(rep)
    # a 1 M-entry table on the low bits first (one gather per key), the binary search on its hits
    table = np.zeros(1 << 20, dtype=bool)
    table[(rep & np.uint64(0xFFFFF)).astype(np.int64)] = True
    mask = table[(keys & np.uint64(0xFFFFF)).astype(np.int64)]
    hits = np.flatnonzero(mask)
    pos = np.minimum(np.searchsorted(rep, keys[hits]), rep.size - 1)
    mask[hits] = rep[pos] == keys[hits]
    return mask


def exact_duplicates(recs: np.ndarray) -> np.ndarray:
    """idx of the exact duplicates in one partition of `EXACT` records (input order within it):
    every record after the first of its key."""
    recs = recs[_repeated(recs["k0"])]  # a fast unstable sort finds the few candidates
    order = np.lexsort((recs["k1"], recs["k0"]))  # stable: input order within a key
    s = recs[order]
    same = (s["k0"][1:] == s["k0"][:-1]) & (s["k1"][1:] == s["k1"][:-1])
    return s["idx"][1:][same]


def shared_buckets(recs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(idx, bucket numbered from 0 here) of the members of the band buckets that two or more
    records of one partition of `BAND` records (exact duplicates removed) share."""
    none = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    recs = recs[_repeated(recs["key"])]
    s = recs[np.argsort(recs["key"], kind="stable")]
    if s.size < 2:
        return none
    new = np.concatenate([[True], s["key"][1:] != s["key"][:-1]])
    bucket = np.cumsum(new) - 1
    size = np.bincount(bucket)
    shared = size[bucket] >= 2
    if not shared.any():
        return none
    _, dense = np.unique(bucket[shared], return_inverse=True)
    return s["idx"][shared].astype(np.int64), dense


def exact_duplicates_in(path: str) -> np.ndarray:
    """`exact_duplicates` of one partition file, read here (a worker)."""
    return exact_duplicates(np.fromfile(path, dtype=EXACT))


def shared_buckets_in(item: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """`shared_buckets` of one partition file of band records, the exact duplicates (the bitmap
    saved at `bits`) left out, as `DiskDedup.resolve` does before it sends a partition out."""
    path, bits = item
    recs = np.fromfile(path, dtype=BAND)
    exact = Bits(0)
    exact.bits = np.load(bits, mmap_mode="r")
    return shared_buckets(recs[~exact.get(recs["idx"])])


class DiskDedup:
    """Collects keys in pass 1 (`add`), then decides (`resolve`); `dropped(lo, hi)` after that."""

    def __init__(self, root: Path, expected_bytes: float, lsh: dedup.LshSettings | None) -> None:
        """`lsh`: near dedup's settings (`dedup.LshSettings.of`), None for exact dedup only."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.n = 0
        self.exact = Partitions(root, "exact", EXACT, part_count(expected_bytes))
        self.bands, self.rows = (lsh.bands, lsh.rows) if lsh is not None else (0, 0)
        near = lsh is not None
        self.near = Partitions(root, "band", BAND, part_count(expected_bytes * max(self.bands, 1) * 0.7)) if near else None
        self.exact_bits: Bits | None = None
        self.near_bits: Bits | None = None

    def reserve(self, n: int, exact_counts: np.ndarray, band_counts: np.ndarray | None) -> tuple[int, list, list]:
        """The next chunk's `n` documents, whose records a worker grouped (`chunk_records`) and
        will write (`place_records`): (their first idx, the exact places, the band places)."""
        base = self.n
        self.n += n
        exact = self.exact.reserve(exact_counts)
        band = self.near.reserve(band_counts) if self.near is not None else []
        return base, exact, band

    def add(self, keys: bytes, bands: np.ndarray | None) -> None:
        """One chunk's cleaned documents, in input order: 16-byte keys, (n, bands) band keys."""
        k = np.frombuffer(keys, dtype="<u8").reshape(-1, 2)
        n = k.shape[0]
        idx = np.arange(self.n, self.n + n, dtype=np.uint64)
        recs = np.empty(n, dtype=EXACT)
        recs["k0"], recs["k1"], recs["idx"] = k[:, 0], k[:, 1], idx
        self.exact.add(recs)
        if self.near is not None:
            b = np.empty(bands.size, dtype=BAND)
            b["key"] = bands.reshape(-1)
            b["idx"] = np.repeat(idx, bands.shape[1])
            self.near.add(b)
        self.n += n

    def resolve(self, map_parts: Callable[[Callable, Iterable], Iterable] = map, remove: bool = True, by_path: bool = False,
                decided: Callable[[str], None] | None = None) -> None:
        """`map_parts(fn, partitions)`: fn's results over the partitions, in order (`map` here, or
        Ray tasks: `raypool.RayCluster.map`); the partitions are independent, split by key.
        `remove=False` keeps the partition files (a resumed prepare redoes this stage from them).
        `by_path`: fn gets the files' paths and reads them itself (local worker processes: the
        sorting is theirs, this process only collects the duplicates' numbers).
        `decided` (with `remove=False`): each partition's result is saved next to its file
        (`result_path`, atomically and fsynced) before `decided(file name)` is called, and a
        partition whose result is saved is not sent out again: a resumed prepare sorts only the
        partitions a kill left undecided. The serial steps after them (bitmaps, the greedy near
        pass over the candidates) are redone: they are linear in the duplicates' count."""
        self.exact_bits = Bits(self.n)

        def exact_item(path: str):
            if by_path:
                return path
            recs = np.fromfile(path, dtype=EXACT)
            if remove:
                os.unlink(path)
            return recs

        for dropped in self._each(map_parts, exact_duplicates_in if by_path else exact_duplicates, self.exact, exact_item, decided):
            self.exact_bits.set(dropped)
        if self.near is None:
            return
        self.near_bits = Bits(self.n)
        members, buckets, next_bucket = [], [], 0
        if by_path:  # the workers filter out the exact duplicates, from the bitmap in a file
            bits = self.root / "exact.bits.npy"
            np.save(bits, self.exact_bits.bits)

        def band_item(path: str):
            if by_path:
                return path, str(bits)
            recs = np.fromfile(path, dtype=BAND)
            if remove:
                os.unlink(path)
            # exact duplicates never reach the LSH: filtered here (a gather), before the partition goes out
            return recs[~self.exact_bits.get(recs["idx"])]

        found = self._each(map_parts, shared_buckets_in if by_path else shared_buckets, self.near, band_item, decided)
        for idx, dense in found:
            if not idx.size:
                continue
            members.append(idx)
            buckets.append((dense + next_bucket).astype(np.uint32 if next_bucket + dense.size < 1 << 32 else np.int64))
            next_bucket += int(dense.max()) + 1
        if not members:
            return
        idx, bucket = np.concatenate(members), np.concatenate(buckets)
        del members, buckets
        order = np.argsort(idx, kind="stable")
        idx, bucket = idx[order], bucket[order]
        starts = np.flatnonzero(np.concatenate([[True], idx[1:] != idx[:-1]]))
        ends = np.append(starts[1:], idx.size)
        claimed = bytearray(next_bucket)
        # In input order: a document is dropped when one of its buckets holds an earlier kept one;
        # a kept document claims all of its buckets (datasketch's query-then-insert). Python
        # lists in blocks: per-element numpy access would be slower, one list of all too big.
        for blo in range(0, starts.size, 1 << 16):
            s0, e0 = starts[blo: blo + (1 << 16)], ends[blo: blo + (1 << 16)]
            base = int(s0[0])
            bucket_list = bucket[base: int(e0[-1])].tolist()
            dropped = []
            for lo, hi in zip((s0 - base).tolist(), (e0 - base).tolist()):
                bs = bucket_list[lo:hi]
                if any(claimed[b] for b in bs):
                    dropped.append(lo + base)
                else:
                    for b in bs:
                        claimed[b] = 1
            if dropped:
                self.near_bits.set(idx[np.asarray(dropped, dtype=np.int64)])

    @staticmethod
    def result_path(part: str | Path) -> Path:
        """Where `resolve(decided=...)` saves the result of the partition file `part`."""
        return Path(str(part) + ".decided")

    def decided_count(self) -> tuple[int, int]:
        """(partitions with a saved result, partitions): what a resumed dedup has left to do."""
        paths = self.exact.existing() + (self.near.existing() if self.near is not None else [])
        return sum(self.result_path(p).exists() for p in paths), len(paths)

    def _each(self, map_parts: Callable, fn: Callable, parts: Partitions, item_of: Callable[[str], object],
              decided: Callable[[str], None] | None) -> Iterator:
        """fn's result for each existing file of `parts`, in order: saved ones read back (with
        `decided`), the others from `map_parts` over the items (`item_of(path)`) of those only."""
        paths = parts.existing()
        todo = [p for p in paths if decided is None or not self.result_path(p).exists()]
        fresh = iter(map_parts(fn, (item_of(p) for p in todo)))
        todo_set = set(todo)
        for p in paths:
            if p not in todo_set:
                with open(self.result_path(p), "rb") as f:
                    arrays = [np.load(f) for _ in range(int(np.load(f)))]
                yield arrays[0] if len(arrays) == 1 else tuple(arrays)
                continue
            result = next(fresh)
            if decided is not None:
                arrays = result if isinstance(result, tuple) else (result,)
                with atomic_writer(self.result_path(p)) as f:  # the partition's commit: whole or absent
                    np.save(f, np.array(len(arrays)))
                    for a in arrays:
                        np.save(f, np.asarray(a))
                decided(Path(p).name)
            yield result

    def state(self) -> dict:
        """Flush the buffered records; what `restore` needs to come back to this point."""
        self.exact.flush()
        parts = {"exact": self.exact.sizes(), "exact_records": self.exact.records}
        if self.near is not None:
            self.near.flush()
            parts.update(band=self.near.sizes(), band_records=self.near.records)
        return {"n": self.n, **parts}

    def touched(self) -> list[Path]:
        """The files appended to since the last call (after `state`: what a commit fsyncs)."""
        out = []
        for parts in (self.exact, self.near):
            if parts is not None:
                out += [parts.path(i) for i in sorted(parts.touched)]
                parts.touched.clear()
        return out

    def restore(self, state: dict) -> None:
        self.n = int(state["n"])
        self.exact.restore(state["exact"], int(state["exact_records"]))
        if self.near is not None:
            self.near.restore(state["band"], int(state["band_records"]))

    def save_decisions(self, path: Path) -> None:
        """The bitmaps `resolve` made, in one file (n/8 bytes each)."""
        near = self.near_bits.bits if self.near_bits is not None else np.zeros(0, dtype=np.uint8)
        with open(path, "wb") as f:
            np.save(f, np.array([self.n, near.size > 0], dtype=np.int64))
            np.save(f, self.exact_bits.bits)
            np.save(f, near)

    def load_decisions(self, path: Path) -> None:
        with open(path, "rb") as f:
            n, has_near = np.load(f).tolist()
            self.n = n
            self.exact_bits = Bits(n)
            self.exact_bits.bits = np.load(f)
            near = np.load(f)
        if has_near:
            self.near_bits = Bits(n)
            self.near_bits.bits = near

    def dropped(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(exact duplicate, near duplicate) masks of documents lo..hi-1."""
        exact = self.exact_bits.range(lo, hi)
        near = self.near_bits.range(lo, hi) if self.near_bits is not None else np.zeros(hi - lo, dtype=bool)
        return exact, near & ~exact

