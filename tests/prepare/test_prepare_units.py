"""`prepare` reading .jsonl files by reference (the workers read, decode and parse their blocks)
and compressed files as whole-file units (a worker decompresses): the data dir must be
byte-identical to the path through the main process (`pipeline.LOCAL_PIECES = False`, what
`--ray` takes): shards, idx, origin files and the manifest (which holds no timestamps)."""
from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest
import zstandard

from mspretrain.config.schema import PrepareConfig
from mspretrain.prepare import pipeline, pool, rawlines, sources
from mspretrain.prepare.prepare import prepare
from tests.conftest import make_poems

CFG = PrepareConfig(vocab_size=500, valid_fraction=0.1, min_chars=4, doc_per_line=True)
QUIET = {"log": lambda _: None}
FILES = ("manifest.json", "tokenizer.model", "train.bin", "train.idx", "train.origin", "valid.bin", "valid.idx", "valid.origin")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    (d / "p.txt").write_text("\n".join(p.replace("\n", "，") for p in make_poems(300, seed=2)) + "\n", encoding="utf-8")
    prepare([str(d / "p.txt")], d / "data", CFG, workers=1, **QUIET)
    return str(d / "data" / "tokenizer.model")


def _jsonl(poems: list[str], k: int) -> str:
    """Records with messy lines between them: broken, without the field, not an object, blank,
    long, \\r\\n endings, a lone surrogate escape."""
    lines = []
    for i, p in enumerate(poems):
        lines.append(json.dumps({"text": p, "id": i}, ensure_ascii=i % 5 == 0))
        if i % 17 == k:
            lines += ["{broken", json.dumps({"body": p}, ensure_ascii=False), "[1, 2]", "", "  ",
                      json.dumps({"text": "长" * 400}, ensure_ascii=False), '{"text": "坏\\ud800掉了的一行字"}']
    return "\r\n".join(lines[: len(lines) // 2]) + "\r\n" + "\n".join(lines[len(lines) // 2:]) + "\n"


def make_inputs(d: Path) -> Path:
    """.jsonl (UTF-8, GB18030), a plain .txt, .txt.gz, .jsonl.zst, a truncated .txt.gz, mixed."""
    d.mkdir()
    poems = [p.replace("\n", "，") for p in make_poems(600, seed=7)]
    (d / "a.jsonl").write_text(_jsonl(poems[:150] + poems[:5], 3), encoding="utf-8")
    (d / "b.jsonl").write_bytes(_jsonl(poems[150:250], 5).encode("gb18030"))
    (d / "c.txt").write_text("\n".join(poems[250:300]) + "\n", encoding="utf-8")
    (d / "d.txt.gz").write_bytes(gzip.compress(("\n".join(poems[300:400] + poems[:3]) + "\n").encode()))
    (d / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(poems[400:480], 2).encode()))
    whole = gzip.compress(("\n".join(poems[480:600] * 20) + "\n").encode())
    (d / "f.txt.gz").write_bytes(whole[: len(whole) // 2])
    (d / "g.jsonl").write_bytes(b'{"body": "x"}\n')  # no documents: a warning with the --text-field hint
    (d / "h.txt").write_bytes(b"")  # warned about while the worker still reads f.txt.gz: the order of warnings holds
    return d


@pytest.mark.parametrize("given", [True, False], ids=["given tokenizer", "trained tokenizer"])
@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_by_reference_and_compressed_units_write_what_the_main_process_path_writes(tokenizer, tmp_path, monkeypatch, workers, given):
    """Also without --tokenizer: the trained tokenizer's replay, sample and encode stage find a
    compressed file's chunks by their piece names (`ITEM.NNNN`); the sample budget is small so
    that its heap pops."""
    d = make_inputs(tmp_path / "in")
    # (only what changes no output is lowered here: workers may be spawned, without these values;
    # too long lines and cut documents are compared in tests/prepare/test_sources.py)
    monkeypatch.setattr(rawlines, "RAW_READ_BYTES", 2048)  # many blocks and chunks
    monkeypatch.setattr(pool, "RAW_GROUP_BY_REFERENCE", 2)
    monkeypatch.setattr(pool, "UNIT_CHUNK_DOCS", 40)  # several chunks per compressed file
    kinds: list[str] = []
    real = sources.iter_batches

    def spy(*a, **kw):
        for b in real(*a, **kw):
            kinds.append("jsonl ref" if isinstance(b, sources.RawLines) and b.jsonl and b.data is None else type(b).__name__)
            if isinstance(b, sources.FileUnit):  # (a worker reads it: its counts are not known here yet)
                assert not stats_of(b).documents
            yield b

    monkeypatch.setattr(sources, "iter_batches", spy)
    stats_of = lambda b: spied_stats[-1].per_file[b.file]  # noqa: E731
    spied_stats: list = []
    real_run = pipeline.run
    monkeypatch.setattr(pipeline, "run", lambda *a, **kw: spied_stats.append(a[9]) or real_run(*a, **kw))
    manifests = {}
    for local in (True, False):
        monkeypatch.setattr(pipeline, "LOCAL_PIECES", local)
        kinds.clear()
        m = prepare([str(d)], tmp_path / str(local), replace(CFG, near_dedup=True, tokenizer_sample_chars=3000),
                    tokenizer=tokenizer if given else None, workers=workers, **QUIET)
        manifests[local] = json.dumps(m, indent=1)
        assert ("jsonl ref" in kinds) == local and (kinds.count("FileUnit") == 3 * local)
    for name in FILES:
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes(), name
    assert manifests[True] == manifests[False]
    m = json.loads(manifests[True])
    per = {f["name"].rsplit("/", 1)[-1]: f for f in m["input_files"]}
    assert per["a.jsonl"]["jsonl_broken"] == per["a.jsonl"]["surrogates_dropped"] == 9
    assert per["b.jsonl"]["encoding"] == "gbk" and per["b.jsonl"]["jsonl_no_field"] == 2 * 6
    assert per["f.txt.gz"]["status"] == "corrupt" and per["g.jsonl"]["documents"] == 0
    w = "\n".join(m["warnings"])
    assert w.index("f.txt.gz: stopped reading after") < w.index("h.txt: empty file")
    assert "g.jsonl: no documents found (is the text in a field other than 'text'?" in w and "a.jsonl: skipped 9 broken lines" in w
    assert m["dropped"].get("exact_dup", 0) > 0 and m["origin"]["offsets"][:2] == ["byte", "byte"]


@pytest.mark.sigkill
def test_kill_in_pass1_over_compressed_units_resumes_byte_identical(tokenizer, tmp_path):
    """SIGKILL inside a compressed file's chunks (its first chunks spooled, not committed: the
    file is read again whole) and later (the finished files are skipped, their counts and
    warnings from the journal), commits after every work item: the same bytes as a run never killed."""
    from tests.helpers.prepare import files_of
    from tests.helpers.prepare import prepare_subprocess as run

    raw = tmp_path / "raw"
    raw.mkdir()
    poems = [p.replace("\n", "，") for p in make_poems(400, seed=9)]
    (raw / "a.jsonl").write_text(_jsonl(poems[:100], 1), encoding="utf-8")
    many = [f"{i}、{poems[i % 400]}" for i in range(40000)]  # 2 chunks (pool.UNIT_CHUNK_DOCS)
    (raw / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(many, 4).encode()))
    (raw / "c.txt.gz").write_bytes(gzip.compress(("\n".join(poems[100:200] + poems[:3]) + "\n").encode()))
    whole = gzip.compress(("\n".join(poems[200:400] * 30) + "\n").encode())
    (raw / "d.txt.gz").write_bytes(whole[: len(whole) // 2])
    (raw / "e.txt").write_bytes(b"")
    extra = ("--tokenizer", tokenizer)
    ref = run(raw, tmp_path / "ref", *extra, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert ref.returncode == 0, ref.stderr
    points = [ln.split(": ", 1)[1] for ln in ref.stderr.splitlines() if ln.startswith("prepare-point: pass1")]
    assert points == [f"pass1 chunk {i}" for i in range(1, 6)]  # a: 1, b: 2-3, c: 4, d: 5
    want = files_of(tmp_path / "ref")
    assert b"d.txt.gz: stopped reading after" in want["manifest.json"]
    for at, first in (("pass1 chunk 3", "pass1 chunk 2"), ("pass1 chunk 5", "pass1 chunk 5")):
        out = tmp_path / at.replace(" ", "_")
        killed = run(raw, out, *extra, env={"MSPRETRAIN_PREPARE_TEST_KILL": at, "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
        assert killed.returncode == -9, killed.stderr
        again = run(raw, out, *extra, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
        assert again.returncode == 0, again.stderr
        resumed = [ln.split(": ", 1)[1] for ln in again.stderr.splitlines() if ln.startswith("prepare-point: pass1")]
        assert resumed[0] == first, resumed  # from the first chunk of the file the kill was in
        assert files_of(out) == want, at


def test_fewer_compressed_files_than_workers_stay_with_the_main_process(tokenizer, tmp_path, monkeypatch):
    """A unit is one worker's: with fewer compressed files than workers the main process reads
    them (`pipeline.UNITS` None); forced on, the same bytes."""
    d = tmp_path / "in"
    d.mkdir()
    poems = [p.replace("\n", "，") for p in make_poems(200, seed=4)]
    (d / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(poems, 6).encode()))
    seen: list[int] = []
    real = sources.iter_batches
    monkeypatch.setattr(sources, "iter_batches", lambda *a, **kw: seen.append(kw["units"]) or real(*a, **kw))
    outs = []
    for units in (None, True):
        monkeypatch.setattr(pipeline, "UNITS", units)
        outs.append(tmp_path / str(units))
        prepare([str(d)], outs[-1], CFG, tokenizer=tokenizer, workers=2, **QUIET)
    assert seen == [False, True]
    for name in FILES:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_a_worker_reading_a_compressed_file_holds_one_chunk_at_a_time(tmp_path, monkeypatch):
    """`workers.spill_unit` streams: its peak memory is about one chunk, not the file."""
    import tracemalloc

    import numpy as np

    from mspretrain.data.origin import RECORD
    from mspretrain.prepare import workers
    from mspretrain.prepare.results import ChunkResult

    def noop(work) -> ChunkResult:  # what `clean_chunk` returns, without the work
        docs, origin = work
        n = len(docs)
        return ChunkResult(docs_in=n, chars_in=0, changed={}, dropped={}, keys=bytes(16 * n), raw=None, origin=np.asarray(origin, dtype=RECORD),
                           tokens=np.ones(n, dtype=np.uint16), lengths=np.ones(n, dtype=np.int32), fallback=np.zeros(n, dtype=np.int64),
                           chars=np.fromiter(map(len, docs), dtype=np.int64, count=n), u=np.zeros((n, 2)))

    text = "".join(json.dumps({"text": f"第{i}段。" + "春眠不觉晓，处处闻啼鸟。" * 8}, ensure_ascii=False) + "\n" for i in range(40000))
    path = tmp_path / "big.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    stats = sources.SourceStats()
    (unit,) = sources.iter_file_batches(path, stats=stats, warn=print, raw=True, units=True)
    monkeypatch.setattr(pool, "UNIT_CHUNK_DOCS", 2000)
    size = len(text.encode())
    tracemalloc.start()
    out = workers.spill_unit(noop, (unit, str(tmp_path / "00000000"), 4, 0))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(out.chunks) == 20 and out.counts["documents"] == 40000 and sum(c.n for c in out.chunks) == 40000
    assert size > 10_000_000 and peak < size / 8, peak


def test_the_chain_of_stages_is_chosen_once_from_the_tokenizer_the_path_and_the_scan():
    """`pipeline.chain`: a plain list of stage objects; the journal's stage names in the order a
    run commits them. With Ray (no pieces) the replay and encode go through the main process,
    the algorithm (the other stages) is the same. A filter keeping a fraction (and no
    `--scores-from`) scores every document first; every chain ends by publishing."""
    from itertools import product

    from mspretrain.prepare.pipeline import chain

    def of(given: bool, pieces: bool, scan: bool = False) -> list[tuple[str, str]]:
        return [(s.name, repr(s)) for s in chain(given, pieces, scan)]

    end = [("finalize", "Finalize"), ("publish", "Publish")]
    assert of(False, True) == [("pass1", "ReadClean"), ("dedup", "Dedup"), ("replay", "ReplaySample"), ("train", "TrainTokenizer"),
                               ("encode", "EncodePieces"), *end]
    assert of(False, False) == [("pass1", "ReadClean"), ("dedup", "Dedup"), ("replay", "ReplayTake(tokens=False)"),
                                ("train", "TrainTokenizer"), ("encode", "EncodeSpools"), *end]
    assert of(True, True) == [("pass1", "ReadClean"), ("dedup", "Dedup"), ("replay", "ReplayPieces"), *end]
    assert of(True, False) == [("pass1", "ReadClean"), ("dedup", "Dedup"), ("replay", "ReplayTake(tokens=True)"), *end]
    for given, pieces in product((False, True), repeat=2):
        assert of(given, pieces, scan=True) == [("scan", "ScoreScan"), *of(given, pieces)]
        names = [n for n, _ in of(given, pieces, scan=True)]
        assert len(set(names)) == len(names)  # the journal's stage names a stage of the chain, one


def test_one_lsh_settings_object_from_the_config():
    from mspretrain.config.schema import PrepareConfig
    from mspretrain.prepare import dedup

    assert dedup.LshSettings.of(PrepareConfig(near_dedup=False)) is None
    lsh = dedup.LshSettings.of(PrepareConfig(near_dedup=True, near_dedup_threshold=0.7, seed=9))
    assert (lsh.bands, lsh.rows) == dedup.lsh_params(0.7) and lsh.seed == 9 and lsh.num_perm == dedup.NUM_PERM
    a, b = dedup._permutations(9, dedup.NUM_PERM)
    assert (lsh.a == a).all() and (lsh.b == b).all()
    texts = ["春眠不觉晓，处处闻啼鸟。夜来风雨声", "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少"]
    want = dedup.band_keys(dedup.signatures(texts, 9, perms=(a, b)), lsh.bands, lsh.rows)
    assert (lsh.band_keys(texts) == want).all()
