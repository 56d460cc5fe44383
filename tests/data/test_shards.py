"""Megatron `.bin/.idx` shards: bytes checked against the format written out by hand from the
spec (DESIGN.md, Megatron-LM's `_IndexWriter`), round trip, crash safety, corruption checks."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from mspretrain.data.shards import IndexedDataset, ShardWriter, data_fingerprint, index_bytes, token_dtype
from mspretrain.errors import UserError


def spec_index(lengths: list[int], code: int, itemsize: int) -> bytes:
    """The .idx bytes spelled out field by field from the spec, independently of shards.py."""
    out = b"MMIDIDX\x00\x00"
    out += struct.pack("<Q", 1)  # version
    out += struct.pack("<B", code)  # dtype code
    out += struct.pack("<Q", len(lengths))  # sequence count S
    out += struct.pack("<Q", len(lengths) + 1)  # document-index count D
    out += b"".join(struct.pack("<i", n) for n in lengths)  # int32[S] lengths
    pos = 0
    for n in lengths:  # int64[S] byte offsets into .bin
        out += struct.pack("<q", pos)
        pos += n * itemsize
    out += b"".join(struct.pack("<q", i) for i in range(len(lengths) + 1))  # int64[D] = 0..S
    return out


def test_header_matches_spec_byte_for_byte_uint16(tmp_path):
    docs = [[5, 6, 2], [], [7, 8, 9, 10, 2], [65000, 2]]
    w = ShardWriter(tmp_path / "train", np.uint16)
    w.add(docs[0])
    w.add_many([np.array(docs[1]), np.array(docs[2])])
    w.add_flat(np.array(docs[3], dtype=np.uint16), np.array([2]))
    w.finalize()
    idx = (tmp_path / "train.idx").read_bytes()
    assert idx == spec_index([3, 0, 5, 2], code=8, itemsize=2)
    assert idx[:9] == b"MMIDIDX\x00\x00" and len(idx) == 34 + 4 * 4 + 8 * 4 + 8 * 5
    expected_bin = b"".join(struct.pack("<H", t) for d in docs for t in d)
    assert (tmp_path / "train.bin").read_bytes() == expected_bin
    assert index_bytes(np.array([3, 0, 5, 2]), np.uint16) == idx


def test_header_matches_spec_int32(tmp_path):
    w = ShardWriter(tmp_path / "big", token_dtype(100_000))
    w.add([70000, 1, 99999])
    w.add([2])
    w.finalize()
    assert (tmp_path / "big.idx").read_bytes() == spec_index([3, 1], code=4, itemsize=4)
    assert (tmp_path / "big.bin").read_bytes() == struct.pack("<4i", 70000, 1, 99999, 2)


def test_token_dtype_boundary():
    assert token_dtype(32000) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(151_000) == np.int32


def test_round_trip_and_memmap(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n)).astype(np.uint16) for n in rng.integers(0, 50, size=200)]
    with ShardWriter(tmp_path / "s", np.uint16) as w:
        w.add_many(docs[:100])
        for d in docs[100:]:
            w.add(d)
        w.finalize()
    ds = IndexedDataset(tmp_path / "s")
    assert len(ds) == 200 and ds.n_tokens == sum(d.size for d in docs)
    assert all(np.array_equal(ds[i], d) for i, d in enumerate(docs))
    assert isinstance(ds.tokens, np.memmap)  # read through the page cache, not copied
    assert list(ds.doc_idx) == list(range(201))


def test_empty_shard_round_trip(tmp_path):
    w = ShardWriter(tmp_path / "e", np.uint16)
    w.finalize()
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.n_tokens == 0
    assert (tmp_path / "e.idx").read_bytes() == spec_index([], code=8, itemsize=2)


def test_unfinished_writer_leaves_nothing_finished_looking(tmp_path):
    w = ShardWriter(tmp_path / "x", np.uint16)
    w.add([1, 2, 3])
    # A crash here: only the .tmp name exists, nothing a reader would accept.
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()
    assert (tmp_path / "x.bin.tmp").exists()
    with pytest.raises(UserError, match="missing"):
        IndexedDataset(tmp_path / "x")
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_context_manager_aborts_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "y", np.uint16) as w:
            w.add([1, 2])
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_out_of_range_ids_are_refused(tmp_path):
    w = ShardWriter(tmp_path / "r", np.uint16)
    with pytest.raises(ValueError, match="does not fit"):
        w.add([1, 70000])
    with pytest.raises(ValueError, match="lengths sum"):
        w.add_flat(np.array([1, 2, 3], dtype=np.uint16), np.array([2]))
    w.abort()


def test_corrupt_files_are_user_errors(tmp_path):
    w = ShardWriter(tmp_path / "c", np.uint16)
    w.add([1, 2, 3])
    w.finalize()
    idx = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(idx[:-8])
    with pytest.raises(UserError, match="truncated"):
        IndexedDataset(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(b"NOTMEGA" + idx[7:])
    with pytest.raises(UserError, match="magic"):
        IndexedDataset(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(idx)
    (tmp_path / "c.bin").write_bytes(b"\x00" * 4)
    with pytest.raises(UserError, match="does not match"):
        IndexedDataset(tmp_path / "c")


def test_fingerprint_tracks_index_and_tokenizer(tmp_path):
    for split in ("train", "valid"):
        w = ShardWriter(tmp_path / split, np.uint16)
        w.add([1, 2, 3])
        w.finalize()
    (tmp_path / "tokenizer.model").write_bytes(b"model-a")
    a = data_fingerprint(tmp_path)
    assert a == data_fingerprint(tmp_path) and len(a) == 64
    (tmp_path / "tokenizer.model").write_bytes(b"model-b")
    b = data_fingerprint(tmp_path)
    w = ShardWriter(tmp_path / "valid", np.uint16)
    w.add([1, 2, 3, 4])
    w.finalize()
    assert len({a, b, data_fingerprint(tmp_path)}) == 3
