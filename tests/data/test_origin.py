"""The per-document origin index (`data/origin.py`) and the per-file token statistics of
`prepare`'s manifest: every document of the shards is found again in its input file, by reading
that file here at the recorded offset (not through `prepare/sources.py`)."""
from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mspretrain.config.schema import PrepareConfig
from mspretrain.data import origin as origin_mod
from mspretrain.data.origin import docs_in_window, read_origin, require_origin
from mspretrain.data.shards import IndexedDataset
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.errors import UserError
from mspretrain.prepare.clean import Cleaner
from mspretrain.prepare.inspect import inspect
from mspretrain.prepare.prepare import prepare
from tests.conftest import make_poems

CFG = PrepareConfig(vocab_size=500, valid_fraction=0.2, min_chars=4)
QUIET = {"log": lambda _: None}


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """Blank-line separated poems (CRLF in one file, a BOM in another), .jsonl records and a .gz,
    with exact duplicates and too-short documents that cleaning and dedup drop."""
    d = tmp_path_factory.mktemp("raw")
    poems = make_poems(300, seed=7)
    a = poems[:100] + [poems[3], "短", poems[10]] + poems[100:120]
    (d / "a.txt").write_text("\n\n".join(a) + "\n", encoding="utf-8")
    (d / "b.txt").write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n\r\n".join(p.replace("\n", "\r\n") for p in poems[120:170]).encode())
    recs = [{"text": p} for p in poems[170:240]] + [{"text": poems[50]}, {"other": 1}, {"text": "短"}]
    (d / "c.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=i % 2 == 0) for i, r in enumerate(recs)) + "\n", encoding="utf-8")
    (d / "d.txt.gz").write_bytes(gzip.compress("\n\n".join(poems[240:] + [poems[241]]).encode("gb18030")))
    return d


def read_at(path: Path, offset: int, jsonl: bool) -> str:
    """The document starting at `offset` of `path`, read here: a .jsonl record's text, else the
    text up to the next blank line (universal newlines)."""
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    rest = data[offset:]
    if jsonl:
        return json.loads(rest.split(b"\n", 1)[0])["text"]
    enc = "gb18030" if path.name.endswith(".gz") else "utf-8"
    text = rest.decode(enc).replace("\r\n", "\n")
    return text.split("\n\n", 1)[0].rstrip("\n")


def check_every_document(raw: Path, out: Path, cfg: PrepareConfig) -> int:
    tok, cleaner, n = Tokenizer.load(out), Cleaner(cfg), 0
    for split in ("train", "valid"):
        ds, org = IndexedDataset(out / split), read_origin(out, split)
        assert org is not None and len(org) == len(ds) > 0
        where = org.locate(np.arange(len(ds)))
        for i, (name, offset) in enumerate(where):
            text = cleaner(read_at(Path(name), offset, name.endswith(".jsonl")))
            assert text is not None, (split, i, name, offset)
            assert tok.encode(text) + [tok.eos_id] == ds[i].tolist(), (split, i, name, offset)
        # input order is kept and a duplicate keeps its first occurrence: offsets rise per file
        for f in set(org.records["file"].tolist()):
            offs = org.records["offset"][org.records["file"] == f]
            assert np.all(np.diff(offs.astype(np.int64)) > 0)
        n += len(ds)
    return n


@pytest.mark.parametrize("workers", [1, 2])
def test_every_document_is_found_at_its_origin(raw, tmp_path, workers):
    out = tmp_path / "data"
    m = prepare([str(raw)], out, CFG, workers=workers, **QUIET)
    assert m["dropped"]["exact_dup"] == 4 and m["dropped"]["min_chars"] == 2  # the index must skip them
    n = check_every_document(raw, out, CFG)
    assert n == m["documents"]["train"] + m["documents"]["valid"] == 300
    assert m["origin"]["offsets"] == ["byte"] * 4 and set(m["outputs"]) >= {"train.origin", "valid.origin"}
    assert read_origin(out).kind == "byte" and read_origin(out).files == [e["name"] for e in m["input_files"]]
    if workers == 2:  # the index does not depend on the worker count
        one = tmp_path / "one"
        prepare([str(raw)], one, CFG, workers=1, **QUIET)
        for name in ("train.origin", "valid.origin", "manifest.json"):
            assert (one / name).read_bytes() == (out / name).read_bytes(), name


def test_one_document_per_line_raw_blocks(tmp_path):
    """One document per line is read as undecoded blocks in the workers: offsets come from the
    block's bytes (a BOM, CRLF, a .gz, a line split across blocks by a small block size)."""
    poems = [p.replace("\n", " ") for p in make_poems(200, seed=2)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"\xef\xbb\xbf" + "\r\n".join(poems[:80] + ["", poems[7]]).encode())
    (tmp_path / "in" / "b.txt.gz").write_bytes(gzip.compress("\n".join(poems[80:] + ["短"]).encode("gb18030")))
    cfg = replace(CFG, doc_per_line=True)
    out = tmp_path / "data"
    m = prepare([str(tmp_path / "in")], out, cfg, workers=2, **QUIET)
    assert m["dropped"]["exact_dup"] == 1 and m["dropped"]["min_chars"] == 1
    tok = Tokenizer.load(out)
    for split in ("train", "valid"):
        ds, org = IndexedDataset(out / split), read_origin(out, split)
        for i, (name, offset) in enumerate(org.locate(np.arange(len(ds)))):
            data = Path(name).read_bytes()
            data = gzip.decompress(data) if name.endswith(".gz") else data
            line = data[offset:].split(b"\n", 1)[0].rstrip(b"\r").decode("gb18030" if name.endswith(".gz") else "utf-8")
            assert tok.encode(Cleaner(cfg)(line)) + [tok.eos_id] == ds[i].tolist(), (split, i, name, offset)


def test_offsets_of_pieces_of_an_over_long_line(tmp_path, monkeypatch):
    """A line longer than MAX_DOC_CHARS is cut into documents; read as raw blocks, each piece
    points at its own first byte."""
    from mspretrain.prepare import sources, textdocs

    monkeypatch.setattr(textdocs, "MAX_DOC_CHARS", 50)
    text = "".join(p.replace("\n", "") for p in make_poems(6, seed=4))
    p = tmp_path / "long.txt"
    p.write_text("开头一行字\n" + text + "\n", encoding="utf-8")
    stats = sources.SourceStats()
    docs, recs = [], []
    for b in sources.iter_file_batches(p, doc_per_line=True, stats=stats, warn=lambda _: None, raw=True):
        b = sources.decode_raw(b)[0] if isinstance(b, sources.RawLines) else b
        docs += b
        recs += b.origin["offset"].tolist()
    assert len(docs) > 3
    data = p.read_bytes()
    for doc, off in zip(docs, recs):
        assert data[off:].decode("utf-8").startswith(doc)


def test_utf16_offsets_are_line_numbers(tmp_path):
    poems = make_poems(80, seed=5)
    (tmp_path / "u.txt").write_text("\n\n".join(poems), encoding="utf-16")
    out = tmp_path / "data"
    m = prepare([str(tmp_path / "u.txt")], out, CFG, workers=1, **QUIET)
    assert m["origin"]["offsets"] == ["row"]
    org = read_origin(out)
    lines = (tmp_path / "u.txt").read_text(encoding="utf-16").split("\n")
    ds, tok = IndexedDataset(out / "train"), Tokenizer.load(out)
    assert org.kind == "row" and org.kind_of([0]) == ["row"]
    for i, (_, row) in enumerate(org.locate(np.arange(len(ds)))):
        assert tok.decode(ds[i][:-1].tolist()).startswith(lines[row])


def test_a_data_dir_without_an_index(raw, tmp_path):
    out = tmp_path / "data"
    prepare([str(raw / "a.txt")], out, CFG, workers=1, **QUIET)
    m = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    (out / "train.origin").unlink()  # as prepared before the index existed
    assert read_origin(out) is None
    with pytest.raises(UserError, match="no document origin index") as e:
        require_origin(out)
    assert "re-run prepare to get document origins" in e.value.fix
    del m["origin"]
    (out / "manifest.json").write_text(json.dumps(m), encoding="utf-8")
    assert read_origin(out, "valid") is None
    assert "document origins" in inspect(out)


def test_a_damaged_index_is_one_line(raw, tmp_path):
    out = tmp_path / "data"
    prepare([str(raw / "a.txt")], out, CFG, workers=1, **QUIET)
    p = out / "train.origin"
    p.write_bytes(p.read_bytes()[:-12])  # a document short
    with pytest.raises(UserError, match="holds .* documents but train.idx has"):
        read_origin(out)
    p.write_bytes(b"junk" + p.read_bytes())
    with pytest.raises(UserError, match="not an origin index"):
        read_origin(out)


def test_docs_in_window_against_token_by_token():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 12, size=60)
    ends = np.cumsum(lengths)
    doc_of_token = np.repeat(np.arange(lengths.size), lengths)
    for seq_len in (1, 4, 7, 16):
        n_windows = (int(ends[-1]) - 1) // seq_len
        for w in range(n_windows):
            toks = doc_of_token[w * seq_len: w * seq_len + seq_len + 1]
            want = [(int(d), int(np.flatnonzero(toks == d)[0]), int(np.flatnonzero(toks == d)[-1]) + 1)
                    for d in dict.fromkeys(toks.tolist())]
            assert docs_in_window(ends, seq_len, w) == want, (seq_len, w)
    assert docs_in_window(np.array([3]), 4, 0) == [(0, 0, 3)]  # a last, partial window
    assert docs_in_window(np.zeros(0, dtype=np.int64), 4, 0) == []


def test_rare_characters_have_a_higher_byte_fallback_rate(tmp_path):
    """A tokenizer trained mostly on common text covers its characters; a file of rare
    characters (CJK Extension B, each seen a few times) goes to byte pieces. The given-tokenizer
    path (one pass, counted in the sink) and the trained path (counted in pass 2) agree."""
    rng = np.random.default_rng(1)
    rare = ["".join(chr(0x20000 + int(c)) for c in rng.integers(0, 5000, size=10)) for _ in range(6)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "common.txt").write_text("\n\n".join(make_poems(400, seed=9)), encoding="utf-8")
    (tmp_path / "in" / "rare.txt").write_text("\n\n".join(rare), encoding="utf-8")
    out, cfg = tmp_path / "data", replace(CFG, character_coverage=0.99)
    m = prepare([str(tmp_path / "in")], out, cfg, workers=2, **QUIET)
    common, rare_f = m["input_tokens"]
    assert common["name"].endswith("common.txt") and rare_f["name"].endswith("rare.txt")
    assert rare_f["byte_fallback_rate"] > 0.5 > 0.1 > common["byte_fallback_rate"]
    assert rare_f["chars_per_token"] < common["chars_per_token"]
    assert common["documents"] + rare_f["documents"] == m["documents"]["train"] + m["documents"]["valid"]
    assert common["characters"] + rare_f["characters"] == m["characters"]
    # an independent count: the byte pieces in the shards of each file's documents
    sp = Tokenizer.load(out)._sp
    counts = {0: [0, 0], 1: [0, 0]}
    for split in ("train", "valid"):
        ds, org = IndexedDataset(out / split), read_origin(out, split)
        for i in range(len(ds)):
            ids = ds[i][:-1].tolist()
            c = counts[int(org.records["file"][i])]
            c[0] += sum(sp.IsByte(t) for t in ids)
            c[1] += len(ids)
    for f, entry in enumerate((common, rare_f)):
        assert entry["byte_fallback_tokens"] == counts[f][0] and entry["tokens"] == counts[f][1]
    total = (counts[0][0] + counts[1][0]) / (counts[0][1] + counts[1][1])
    assert m["byte_fallback_rate"] == pytest.approx(total, abs=1e-6)
    again = prepare([str(tmp_path / "in")], tmp_path / "given", cfg, tokenizer=str(out), workers=1, **QUIET)
    assert again["input_tokens"] == m["input_tokens"] and again["byte_fallback_rate"] == m["byte_fallback_rate"]
    text = inspect(out)
    assert "byte fallback" in text and "rare.txt" in text


def test_origin_api_shape(raw, tmp_path):
    out = tmp_path / "data"
    prepare([str(raw / "c.jsonl"), str(raw / "a.txt")], out, CFG, workers=1, **QUIET)
    org = read_origin(out)
    got = org.locate(np.array([0, len(org) - 1]))
    assert got[0] == (str(raw / "c.jsonl"), 0) and got[1][0] == str(raw / "a.txt")
    assert all(isinstance(o, int) for _, o in got)
    with pytest.raises(IndexError):
        org.locate(np.array([len(org)]))
    assert origin_mod.origin_path(out, "valid").name == "valid.origin"


def test_a_line_without_end_switches_reader_and_keeps_origins(tmp_path, monkeypatch):
    """A one-per-line file whose first read holds no newline is read by the decoding reader
    (`raw_line_blocks`' fallback): its pieces point at the start of their line."""
    from mspretrain.prepare import sources, textdocs

    monkeypatch.setattr(textdocs, "MAX_DOC_CHARS", 50)
    p = tmp_path / "one.txt"
    p.write_bytes(b"\xef\xbb\xbf" + ("春眠不觉晓处处闻啼鸟" * 30).encode())
    got = [b for b in sources.iter_file_batches(p, doc_per_line=True, stats=sources.SourceStats(), warn=lambda _: None, raw=True)]
    assert len(got) == 1 and not isinstance(got[0], sources.RawLines) and len(got[0]) == 6
    assert got[0].origin["offset"].tolist() == [3] * 6 and got[0].origin["file"].tolist() == [0] * 6


def test_overwrite_never_replaces_a_foreign_origin_file(raw, tmp_path):
    """A data dir whose manifest does not list train.origin (an older prepare) but holds a file of
    that name: `--overwrite` refuses, as for any output name no manifest lists."""
    out = tmp_path / "data"
    prepare([str(raw / "a.txt")], out, CFG, workers=1, **QUIET)
    m = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    m["outputs"] = [n for n in m["outputs"] if not n.endswith(".origin")]
    (out / "manifest.json").write_text(json.dumps(m), encoding="utf-8")
    (out / "train.origin").write_bytes(b"the user's own file")
    with pytest.raises(UserError, match="holds train.origin, which no earlier prepare wrote"):
        prepare([str(raw / "a.txt")], out, CFG, workers=1, overwrite=True, **QUIET)
    assert (out / "train.origin").read_bytes() == b"the user's own file"


def test_chunks_carry_the_origins_of_their_documents(raw, tmp_path, monkeypatch):
    """`chunks` cuts batches apart (here every 5 documents or 40 characters): each chunk's
    records are its own documents', in order, whatever the cut; then prepare end to end."""
    from mspretrain.prepare import pool, textdocs

    monkeypatch.setattr(pool, "CHUNK_DOCS", 5)
    monkeypatch.setattr(pool, "CHUNK_CHARS", 40)
    rng = np.random.default_rng(3)
    batches, n = [], 0
    for f in range(6):
        k = int(rng.integers(0, 12))
        docs = [f"文{f}-{n + i}" + "字" * int(rng.integers(1, 30)) for i in range(k)]
        batches.append(textdocs.docs_of(docs, textdocs.origin_records(f, np.arange(n, n + k) * 10)))
        n += k
    got_docs, got_rec = [], []
    for chunk, rec in pool.chunks_with_origin(iter(batches)):
        assert len(chunk) == rec.size
        got_docs += chunk
        got_rec.append(rec)
    rec = np.concatenate(got_rec)
    assert got_docs == [d for b in batches for d in b]
    assert rec["offset"].tolist() == [10 * i for i in range(n)]
    assert [int(d.split("-")[0][1:]) for d in got_docs] == rec["file"].tolist()
    out = tmp_path / "data"
    prepare([str(raw)], out, CFG, workers=1, **QUIET)
    assert check_every_document(raw, out, CFG) == 300
