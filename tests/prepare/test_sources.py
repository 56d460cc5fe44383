"""Input discovery and readers: encodings (GBK / GB18030 / UTF-8-BOM twins of a UTF-8 file),
compression, document splitting, bad files as counted skips, bounded memory."""
from __future__ import annotations

import gzip
import json
import re
import tracemalloc
from pathlib import Path

import pytest
import zstandard

from mspretrain.errors import UserError
from mspretrain.prepare import rawlines, sources, textdocs
from mspretrain.prepare.sources import SourceStats, discover, iter_documents, iter_file

DOCS = ["静夜思\n床前明月光，疑是地上霜。\n举头望明月，低头思故乡。",
        "今天天气很好，我们去公园散步。\n看到很多人在放风筝，孩子们笑得很开心。",
        "数据准备：清洗、去重、分词，然后写成二进制分片。"]


def read(path: Path, **kw) -> tuple[list[str], SourceStats, list[str]]:
    stats, warnings = SourceStats(), []
    docs = list(iter_file(path, stats=stats, warn=warnings.append, **kw))
    return [d.rstrip("\n") for d in docs], stats, warnings


def write_txt(path: Path, docs: list[str], encoding: str = "utf-8") -> Path:
    path.write_bytes(("\n\n".join(docs) + "\n").encode(encoding))
    return path


@pytest.mark.parametrize("encoding,label", [("utf-8-sig", "utf-8-bom"), ("gbk", "gbk"), ("gb18030", "gbk"), ("utf-16", "utf-16")])
def test_encoding_twins_give_the_same_documents(tmp_path, encoding, label):
    utf8, _, _ = read(write_txt(tmp_path / "a.txt", DOCS))
    twin, stats, warnings = read(write_txt(tmp_path / "b.txt", DOCS, encoding))
    assert twin == utf8 == DOCS
    assert stats.by_encoding == {label: 1} and stats.bytes_dropped == 0 and not warnings


def test_gb18030_beyond_gbk(tmp_path):
    docs = ["𠮷野家的牛肉饭，€5。", "生僻字：𪚥𠀀，还有欧元符号€。"] + DOCS
    utf8, _, _ = read(write_txt(tmp_path / "a.txt", docs))
    twin, stats, _ = read(write_txt(tmp_path / "b.txt", docs, "gb18030"))
    assert twin == utf8 == docs and stats.by_encoding == {"gb18030": 1}


def test_undecodable_bytes_are_counted_and_dropped(tmp_path):
    raw = ("\n\n".join(DOCS * 20)).encode("utf-8")
    bad = raw[:100] + b"\xff\xfe" + raw[100:] + b"\x80"
    (tmp_path / "bad.txt").write_bytes(bad)
    docs, stats, warnings = read(tmp_path / "bad.txt")
    assert stats.bytes_dropped == 3 and stats.by_encoding == {"utf-8": 1}
    assert "".join(docs).replace("\n", "") == raw.decode().replace("\n", "")
    assert any("3 undecodable bytes" in w for w in warnings)


def test_blank_line_blocks_and_doc_per_line(tmp_path):
    p = write_txt(tmp_path / "a.txt", DOCS)
    assert read(p)[0] == DOCS
    lines = read(p, doc_per_line=True)[0]
    assert lines == [ln for d in DOCS for ln in d.split("\n")]
    (tmp_path / "crlf.txt").write_bytes("第一段\r\n还是第一段\r\n\r\n   \r\n第二段".encode())
    assert read(tmp_path / "crlf.txt")[0] == ["第一段\n还是第一段", "第二段"]


def test_jsonl_fields_and_broken_lines(tmp_path):
    lines = [json.dumps({"text": DOCS[0], "id": 1}, ensure_ascii=False), "{broken json", "",
             json.dumps({"content": "别的字段"}, ensure_ascii=False), json.dumps({"text": 42}), json.dumps([1, 2]),
             json.dumps({"text": DOCS[1]}, ensure_ascii=False)]
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    docs, stats, warnings = read(p)
    assert docs == DOCS[:2]
    assert stats.jsonl_broken == 1 and stats.jsonl_no_field == 3
    assert any("1 broken lines" in w and "3 lines without" in w for w in warnings)
    (tmp_path / "s.jsonl").write_text('{"text": "春眠\\ud800不觉晓\\ud83d\\ude00"}\n', encoding="utf-8")
    docs, stats, _ = read(tmp_path / "s.jsonl")  # a lone surrogate escape is dropped, a pair kept
    assert docs == ["春眠不觉晓😀"] and stats.bytes_dropped == 1
    docs, stats, _ = read(p, text_field="content")
    assert docs == ["别的字段"] and stats.jsonl_no_field == 4


def test_compressed_inputs(tmp_path):
    payload = ("\n\n".join(DOCS) + "\n").encode()
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(payload))
    (tmp_path / "b.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    jl = "\n".join(json.dumps({"text": d}, ensure_ascii=False) for d in DOCS).encode()
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jl))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jl))
    for name in ("a.txt.gz", "b.txt.zst", "c.jsonl.gz", "d.jsonl.zst"):
        assert read(tmp_path / name)[0] == DOCS, name
    # A truncated archive keeps what was readable and says so.
    many = "".join(f"第{i}段：{DOCS[i % 3]}\n\n" for i in range(5000)).encode()
    whole = gzip.compress(many)
    (tmp_path / "e.txt.gz").write_bytes(whole[: len(whole) * 2 // 3])
    docs, stats, warnings = read(tmp_path / "e.txt.gz")
    assert 1000 < len(docs) < 5000 and docs[0].startswith("第0段")
    assert stats.skipped["corrupt"] == 1 and any("stopped reading" in w for w in warnings)
    (tmp_path / "f.txt.gz").write_bytes(whole[:50])  # broken before any text
    docs, stats, warnings = read(tmp_path / "f.txt.gz")
    assert docs == [] and stats.skipped["unreadable"] == 1 and "cannot be read" in warnings[0]


def test_bad_files_are_counted_skips(tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 20
    (tmp_path / "image.txt").write_bytes(png)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b"\n\n  \n")
    (tmp_path / "random.txt").write_bytes(bytes((i * 7919 + 13) % 256 for i in range(5000)))
    write_txt(tmp_path / "good.txt", DOCS)
    stats, warnings = SourceStats(), []
    docs = list(iter_documents(discover([str(tmp_path)], stats), stats=stats, warn=warnings.append))
    assert [d.rstrip("\n") for d in docs] == DOCS
    assert stats.skipped == {"binary": 2, "empty": 2} and stats.files == 1
    assert sum("looks binary" in w for w in warnings) == 2 and sum("empty" in w or "no text" in w for w in warnings) == 2


def test_nul_bytes_do_not_make_a_text_file_binary(tmp_path):
    (tmp_path / "nul.txt").write_bytes("春眠\x00不觉晓\x00\n\n夜来风雨声".encode())
    docs, stats, _ = read(tmp_path / "nul.txt")
    assert docs == ["春眠\x00不觉晓\x00", "夜来风雨声"] and stats.files == 1  # the cleaner drops the NULs


def test_long_line_is_cut_with_bounded_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(textdocs, "MAX_DOC_CHARS", 1000)
    line = "".join(DOCS).replace("\n", "") * 60
    (tmp_path / "long.txt").write_text(line, encoding="utf-8")
    for per_line in (False, True):
        docs, stats, _ = read(tmp_path / "long.txt", doc_per_line=per_line)
        assert "".join(docs) == line and max(map(len, docs)) <= 1000
        assert stats.split_long == len(docs) - 1 >= 3
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": line}, ensure_ascii=False), encoding="utf-8")
    docs, stats, _ = read(tmp_path / "long.jsonl")
    assert "".join(docs) == line and max(map(len, docs)) <= 1000 and stats.split_long == len(docs) - 1


def test_memory_stays_bounded(tmp_path):
    p = tmp_path / "big.txt"
    with open(p, "w", encoding="utf-8") as f:
        for i in range(40000):
            f.write(f"第{i}段。" + DOCS[i % 3] + "\n\n")
    size = p.stat().st_size
    tracemalloc.start()
    n = sum(1 for _ in iter_file(p, stats=SourceStats(), warn=lambda _: None))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 40000 and size > 4_000_000 and peak < size / 8


def test_discovery(tmp_path):
    (tmp_path / "sub" / ".hidden").mkdir(parents=True)
    for name in ("b.txt", "a.jsonl", "sub/c.txt.gz", "sub/.hidden/x.txt", "notes.md", "sub/pic.png"):
        (tmp_path / name).write_bytes(b"x")
    stats = SourceStats()
    found = discover([str(tmp_path)], stats)
    assert [p.relative_to(tmp_path.resolve()).as_posix() for p in found] == ["a.jsonl", "b.txt", "sub/c.txt.gz"]
    assert stats.ignored == 2
    assert discover([str(tmp_path / "*.txt"), str(tmp_path / "b.txt")]) == [(tmp_path / "b.txt").resolve()]
    assert discover([str(tmp_path / "notes.md")]) == [(tmp_path / "notes.md").resolve()]  # named explicitly: read
    with pytest.raises(UserError, match="no files match"):
        discover([str(tmp_path / "*.nothing")])
    with pytest.raises(UserError, match="does not exist"):
        discover([str(tmp_path / "missing.txt")])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="holds no .txt"):
        discover([str(tmp_path / "empty_dir")])
    with pytest.raises(UserError, match="no input"):
        discover([])


def _readline_docs(f, stats: sources.FileCounts) -> list[str]:
    """The previous one-document-per-line reader (a readline loop): the reference."""
    out = []
    while line := f.readline(textdocs.MAX_DOC_CHARS):
        if line.strip():
            if not line.endswith("\n") and len(line) >= textdocs.MAX_DOC_CHARS:
                stats.split_long += 1
            out.append(line[:-1] if line.endswith("\n") else line)
    return out


@pytest.mark.parametrize("max_chars,read_chars", [(7, 5), (7, 7), (7, 16), (50, 3), (1000, 64)])
def test_block_line_reader_equals_readline(monkeypatch, max_chars, read_chars):
    # Lines are read in blocks and split in C; documents, cut points and split_long counts must
    # be those of the readline loop, wherever blocks and over-long lines begin and end.
    import io
    import random

    monkeypatch.setattr(textdocs, "MAX_DOC_CHARS", max_chars)
    monkeypatch.setattr(textdocs, "READ_CHARS", read_chars)
    rng = random.Random(max_chars * 100 + read_chars)
    parts = ["春眠不觉晓", "a", " ", "\t", "\u3000", "\n", "\n", "\r\n", "\r", "x" * 6, "y" * 7, "z" * 8, "长" * 15]
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randrange(0, 40)))
        ref_stats, new_stats = sources.FileCounts("ref"), sources.FileCounts("new")
        want = _readline_docs(io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8", newline=None), ref_stats)
        f = io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8", newline=None)
        got = [d for batch in textdocs.line_doc_batches(f, new_stats) for d in batch]
        assert got == want, repr(text)
        assert new_stats.split_long == ref_stats.split_long, repr(text)


def _read_raw(path: Path, stats: SourceStats, warnings: list[str], origins: list | None = None, **kw) -> list[str]:
    """What prepare does with raw=True: decode the RawLines blocks, count, then report.
    `origins` receives each document's origin offset."""
    docs = []
    kw.setdefault("doc_per_line", True)
    for unit in _units_read(sources.iter_file_batches(path, stats=stats, warn=warnings.append, raw=True, **kw), stats, warnings):
        if isinstance(unit, sources.RawLines):
            got, found = sources.decode_raw(unit)
            sources.count_raw(stats, unit.file, len(got), *found)
        else:
            got = unit
        docs.extend(got)
        if origins is not None:
            origins.extend(got.origin["offset"].tolist())
    sources.report_raw_files(stats, warnings.append, kw.get("text_field", "text"))
    return docs


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "gb18030"])
@pytest.mark.parametrize("max_chars,read_bytes", [(7, 5), (7, 16), (40, 3), (1000, 64), (1000, 1 << 16)])
def test_raw_blocks_equal_the_decoding_reader(tmp_path, monkeypatch, encoding, max_chars, read_bytes):
    # prepare's main process cuts one-document-per-line files into undecoded blocks of whole
    # lines; documents, counts and warnings must be those of the decoding reader, with \r\n,
    # lone \r, undecodable bytes, blank and over-long lines anywhere around the cuts.
    import random

    monkeypatch.setattr(textdocs, "MAX_DOC_CHARS", max_chars)
    monkeypatch.setattr(rawlines, "RAW_READ_BYTES", read_bytes)
    rng = random.Random(hash((encoding, max_chars, read_bytes)) & 0xFFFF)
    parts = ["春眠不觉晓", "a", " ", "\t", "\u3000", "\n", "\n", "\r\n", "\r", "x" * 6, "长" * 15, "𠮷"]
    bad = [b"\xff", b"\xe4\xb8", b"\x81"]  # invalid in UTF-8; \x81 alone is a truncated GB18030 lead byte
    for trial in range(60):
        chunks = []
        for _ in range(rng.randrange(0, 40)):
            if rng.random() < 0.05:
                chunks.append(rng.choice(bad))
            else:
                chunks.append(rng.choice(parts).encode("gb18030" if encoding == "gb18030" else "utf-8"))
        body = b"".join(chunks)
        if encoding == "utf-8-sig":
            body = b"\xef\xbb\xbf" + body
        if not body.strip() or b"".join(chunks).startswith((b"\xff", b"\x81")):
            continue
        path = tmp_path / f"t{trial}.txt"
        path.write_bytes(body)
        want_stats, want_warn = SourceStats(), []
        want = list(iter_file(path, doc_per_line=True, stats=want_stats, warn=want_warn.append))
        got_stats, got_warn = SourceStats(), []
        got = _read_raw(path, got_stats, got_warn)
        assert got == want, body
        d = got_stats.to_dict()
        assert d == want_stats.to_dict(), body
        assert got_stats.per_file_dicts() == want_stats.per_file_dicts(), body  # the file's own counts too
        assert sorted(got_warn) == sorted(want_warn), body


def test_raw_blocks_fall_back_on_a_line_without_end(tmp_path, monkeypatch):
    # A line longer than 4 * MAX_DOC_CHARS bytes switches the rest of the file to the decoding
    # reader, which cuts it into pieces (memory stays bounded).
    monkeypatch.setattr(textdocs, "MAX_DOC_CHARS", 50)
    monkeypatch.setattr(rawlines, "RAW_READ_BYTES", 32)
    text = "短行一\n" + "长" * 500 + "\n短行二\n\n短行三"
    path = tmp_path / "long.txt"
    path.write_text(text, encoding="utf-8")
    want_stats = SourceStats()
    want = list(iter_file(path, doc_per_line=True, stats=want_stats, warn=lambda _: None))
    stats, units = SourceStats(), list(sources.iter_file_batches(path, doc_per_line=True, stats=SourceStats(), warn=lambda _: None, raw=True))
    assert any(isinstance(u, list) for u in units)  # the fallback was taken
    got = _read_raw(path, stats, [])
    assert got == want and stats.split_long == want_stats.split_long == 10 and stats.per_file[0].raw


def test_counts_are_per_file_and_named_as_the_user_named_them(tmp_path, monkeypatch):
    # dropped bytes land on the file that had them, even when another file's blocks are decoded
    # in this process between two reads of it (prepare with one worker does exactly that)
    monkeypatch.setattr(rawlines, "RAW_READ_BYTES", 16)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_bytes("春眠不觉晓\n处处闻啼鸟\n".encode() * 4 + b"\xff\xfe\n")
    (corpus / "sub" / "b.txt").write_bytes("夜来风雨声\n".encode() * 6 + b"bad\x81\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "花落知多少"}) + "\n{broken\n", encoding="utf-8")
    (tmp_path / "d.txt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    named = sources.discover_named(["corpus", "c.jsonl", "*.txt"])
    assert [n for _, n in named] == ["corpus/a.txt", "corpus/sub/b.txt", "c.jsonl", "d.txt"]
    assert [p for p, _ in named] == discover(["corpus", "c.jsonl", "*.txt"]) and all(p.is_absolute() for p, _ in named)
    stats, warnings = SourceStats(), []
    batches = sources.iter_batches([p for p, _ in named], names=[n for _, n in named], doc_per_line=True,
                                   stats=stats, warn=warnings.append, raw=True)
    for unit in batches:
        if isinstance(unit, sources.RawLines):
            got, found = sources.decode_raw(unit)
            sources.count_raw(stats, unit.file, len(got), *found)
    sources.report_raw_files(stats, warnings.append)
    per = {d["name"]: d for d in stats.per_file_dicts()}
    assert per["corpus/a.txt"] == {"name": "corpus/a.txt", "status": "read", "encoding": "utf-8",
                                   "bytes": (corpus / "a.txt").stat().st_size, "documents": 8, "bytes_dropped": 2}
    assert per["corpus/sub/b.txt"]["bytes_dropped"] == 1 and per["corpus/sub/b.txt"]["documents"] == 7
    assert per["c.jsonl"]["documents"] == 1 and per["c.jsonl"]["jsonl_broken"] == 1 and "bytes_dropped" not in per["c.jsonl"]
    assert per["d.txt"] == {"name": "d.txt", "status": "empty", "bytes": 0, "documents": 0}
    # the totals are the sums of the files
    assert stats.bytes_dropped == 3 and stats.documents == 16 and stats.files == 3 and stats.skipped == {"empty": 1}
    assert any("a.txt: 2 undecodable bytes dropped" in w for w in warnings)
    assert any("b.txt: 1 undecodable bytes dropped" in w for w in warnings)


def test_decoding_outside_a_file_counts_nothing_anywhere(tmp_path):
    # the codec error handler only counts for the file whose reader is running
    p = write_txt(tmp_path / "a.txt", ["春眠不觉晓"])
    stats = SourceStats()
    it = sources.iter_file_batches(p, stats=stats, warn=lambda _: None)
    next(it)
    assert b"x\xffy".decode("utf-8", errors="mspretrain.drop") == "xy"  # between two steps of the reader
    list(it)
    assert stats.per_file[0].bytes_dropped == 0


def _units_read(batches, stats: SourceStats, warnings: list[str]):
    """The batches, a compressed file's (`FileUnit`) read here as a worker reads it."""
    for b in batches:
        if isinstance(b, sources.FileUnit):
            yield from b.batches(stats.per_file[b.file], warnings.append)
        else:
            yield b


def _jsonl_bytes(rng, encoding: str) -> bytes:
    """A messy .jsonl file: records, broken lines, lines without the field, non-object JSON,
    blank lines, \r\n and lone \r, undecodable bytes, lone surrogate escapes, long texts."""
    enc = "gb18030" if encoding == "gb18030" else "utf-8"
    texts = ["春眠不觉晓", "a", "长" * 15, "𠮷野家", "x\ny", " ", "处处闻啼鸟" * 3]
    parts = [lambda: json.dumps({"text": rng.choice(texts)}, ensure_ascii=rng.random() < 0.3),
             lambda: json.dumps({"text": rng.choice(texts), "id": 3}, ensure_ascii=False),
             lambda: '{"text": "坏\\ud800掉"}', lambda: "{broken", lambda: json.dumps({"body": "别的"}, ensure_ascii=False),
             lambda: json.dumps({"text": 42}), lambda: "[1, 2]", lambda: '"text"', lambda: "7", lambda: "null",
             lambda: "", lambda: "  \t", lambda: json.dumps({"text": "长" * rng.randrange(20, 130)}, ensure_ascii=False)]
    ends = [b"\n"] * 8 + [b"\r\n", b"\r", b"\n\n"]
    out = []
    for _ in range(rng.randrange(1, 40)):
        line = rng.choice(parts)().encode(enc)
        if rng.random() < 0.05:
            at = rng.randrange(len(line) + 1)
            line = line[:at] + rng.choice([b"\xff", b"\x81"]) + line[at:]
        out.append(line + rng.choice(ends))
    body = b"".join(out)
    if rng.random() < 0.3:
        body = body.rstrip(b"\r\n")  # an unterminated last line
    return (b"\xef\xbb\xbf" if encoding == "utf-8-sig" else b"") + body


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "gb18030"])
@pytest.mark.parametrize("max_chars,read_bytes", [(50, 16), (50, 300), (1000, 1 << 16)])
def test_jsonl_blocks_by_reference_equal_the_decoding_reader(tmp_path, monkeypatch, encoding, max_chars, read_bytes):
    # An uncompressed .jsonl file is cut into blocks of whole lines by reference, parsed where
    # they are decoded: the same documents, origins, counts and warnings as `jsonl_docs`. Small
    # MAX_DOC_CHARS: long texts are cut, and lines without an end within 4 * MAX_DOC_CHARS bytes
    # switch the rest of the file to the reader; small MAX_JSONL_LINE_CHARS: too long lines.
    import random

    monkeypatch.setattr(textdocs, "MAX_DOC_CHARS", max_chars)
    monkeypatch.setattr(textdocs, "MAX_JSONL_LINE_CHARS", 120)
    monkeypatch.setattr(rawlines, "RAW_READ_BYTES", read_bytes)
    rng = random.Random(hash((encoding, max_chars, read_bytes)) & 0xFFFF)
    fell_back = by_ref = 0
    for trial in range(40):
        body = _jsonl_bytes(rng, encoding)
        if re.search(rb"\r[\xff\x81]+\n", body):
            # Known, left alone: a lone \r, undecodable bytes, then \n read as one line break by
            # the decoding reader (the bytes dropped) but as two by its byte-offset tracker: its
            # later origins are off by a line to the end of the file, those of blocks to the end
            # of the block. Documents, counts and warnings still agree.
            continue
        path = tmp_path / f"t{trial}.jsonl"
        path.write_bytes(body)
        want_stats, want_warn, want_org = SourceStats(), [], []
        want = []
        for batch in sources.iter_file_batches(path, stats=want_stats, warn=want_warn.append):
            want.extend(batch)
            want_org.extend(batch.origin["offset"].tolist())
        got_stats, got_warn, got_org = SourceStats(), [], []
        units = list(sources.iter_file_batches(path, stats=SourceStats(), warn=lambda _: None, raw=True, by_reference=True))
        by_ref += any(isinstance(u, sources.RawLines) for u in units)
        fell_back += any(isinstance(u, list) for u in units)
        got = _read_raw(path, got_stats, got_warn, got_org, doc_per_line=False, by_reference=True)
        assert got == want, body
        assert got_org == want_org, body
        assert got_stats.per_file_dicts() == want_stats.per_file_dicts(), body
        assert got_stats.per_file[0].offsets == want_stats.per_file[0].offsets
        assert got_warn == want_warn, body
    assert by_ref
    if max_chars == 50 and read_bytes == 16:
        assert fell_back  # some file had a line of over 200 bytes between two read positions


def test_jsonl_in_blocks_only_by_reference_and_uncompressed(tmp_path):
    # --ray (no references) keeps the reader of the main process; a compressed file with `units`
    # is one `FileUnit`, read whole by a worker, through the same reader.
    jl = ("\n".join(json.dumps({"text": d}, ensure_ascii=False) for d in DOCS) + "\n").encode()
    (tmp_path / "a.jsonl").write_bytes(jl)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(jl))
    (tmp_path / "c.jsonl").write_bytes(jl.decode().encode("utf-16"))
    for name, by_ref, kind in (("a.jsonl", True, sources.RawLines), ("a.jsonl", False, list), ("b.jsonl.gz", True, sources.FileUnit),
                               ("b.jsonl.gz", False, list), ("c.jsonl", True, list)):
        units = list(sources.iter_file_batches(tmp_path / name, stats=SourceStats(), warn=print, raw=True, by_reference=by_ref,
                                               units=by_ref))
        assert all(isinstance(u, kind) for u in units) and (kind is not sources.FileUnit or len(units) == 1), name
        assert _read_raw(tmp_path / name, SourceStats(), [], doc_per_line=False, by_reference=by_ref, units=by_ref) == DOCS
