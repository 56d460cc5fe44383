"""`prepare` end to end on small text the tests write: round trip through the shards, the
manifest, determinism, crash safety, every bad input through the CLI, the demo
corpus builder (without the network)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mspretrain.cli import main
from mspretrain.config.schema import PrepareConfig
from mspretrain.data.shards import IndexedDataset, data_fingerprint
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.demo import corpus
from mspretrain.errors import UserError
from mspretrain.prepare import dedup
from mspretrain.prepare.clean import Cleaner
from mspretrain.prepare.inspect import inspect
from mspretrain.prepare.prepare import prepare
from tests.conftest import make_poems

ROOT = Path(__file__).resolve().parents[2]
CFG = PrepareConfig(vocab_size=500, valid_fraction=0.1, min_chars=4)
QUIET = {"log": lambda _: None}
FILES = ("manifest.json", "tokenizer.model", "train.bin", "train.idx", "train.origin", "valid.bin", "valid.idx", "valid.origin")


def _both_paths(monkeypatch, inputs: list[str], tmp_path: Path, cfg: PrepareConfig, **kw) -> dict:
    """prepare on the per-chunk path and on the path through the main process
    (`pipeline.LOCAL_PIECES`, `--ray`'s): every file of the data dirs and the manifests equal.
    Returns the manifest."""
    from mspretrain.prepare import pipeline

    manifests = {}
    for local in (True, False):
        monkeypatch.setattr(pipeline, "LOCAL_PIECES", local)
        manifests[local] = json.dumps(prepare(inputs, tmp_path / str(local), cfg, **kw, **QUIET))
    for name in FILES:
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes(), name
    assert manifests[True] == manifests[False]
    return json.loads(manifests[True])


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """Poems as .txt (blank-line blocks) and .jsonl, with dirt and duplicates mixed in."""
    d = tmp_path_factory.mktemp("raw")
    poems = make_poems(400, seed=3)
    dirty = [f"<p>{p}</p>" if i % 7 == 0 else p for i, p in enumerate(poems[:200])]
    dirty += [poems[5], poems[6].replace("\n", " \n")]  # exact duplicates (after cleaning)
    (d / "a.txt").write_text("\n\n".join(dirty) + "\n", encoding="utf-8")
    (d / "b.jsonl").write_text("\n".join(json.dumps({"text": p}, ensure_ascii=False) for p in poems[200:]) + "\n", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def prepared(raw, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("out") / "data"
    return out, prepare([str(raw)], out, CFG, workers=2, **QUIET)


def expected_docs(raw: Path, cfg: PrepareConfig) -> dict[str, list[str]]:
    """What prepare should keep, computed here with the cleaner and the split rule."""
    docs = [b for b in (raw / "a.txt").read_text(encoding="utf-8").split("\n\n") if b.strip()]
    docs += [json.loads(x)["text"] for x in (raw / "b.jsonl").read_text(encoding="utf-8").splitlines()]
    c, seen, out = Cleaner(cfg), set(), {"train": [], "valid": []}
    for d in docs:
        t = c(d)
        if t is None or dedup.dedup_key(t) in seen:
            continue
        seen.add(dedup.dedup_key(t))
        out["valid" if dedup.uniforms(dedup.dedup_key(t), cfg.seed)[0] < cfg.valid_fraction else "train"].append(t)
    return out


def decoded(data: Path, split: str) -> list[str]:
    tok, ds = Tokenizer.load(data), IndexedDataset(data / split)
    assert all(int(ds[i][-1]) == tok.eos_id for i in range(len(ds)))  # EOS closes every document
    return [tok.decode(ds[i][:-1].tolist()) for i in range(len(ds))]


def test_round_trip_equals_cleaned_documents(raw, prepared):
    out, m = prepared
    want = expected_docs(raw, CFG)
    got = {s: decoded(out, s) for s in ("train", "valid")}
    assert got == want  # same documents, same order, same split
    assert all("<p>" not in t for t in got["train"] + got["valid"])


def test_small_corpus_gives_the_documents_written_out_here(tmp_path):
    """expected_docs() above reuses the cleaner and dedup key: a bug shared by prepare and its
    reference would pass there. Here every expected document is written out by hand."""
    poems = make_poems(30, seed=1)
    dirty = [
        ("<p>春风又绿江南岸，明月何时照我还。</p>", "春风又绿江南岸，明月何时照我还。"),  # HTML tags go
        ("ＡＢＣ１２３，春眠不觉晓！", "ABC123，春眠不觉晓！"),  # NFKC, full-width punctuation kept
        ("床前明月光，疑是地上霜。\t举头望明月。", "床前明月光，疑是地上霜。 举头望明月。"),  # odd whitespace
        ("短诗", None),  # below min_chars
        (poems[3], None),  # an exact duplicate
        ("两个黄鹂鸣翠柳，一行白鹭上青天。&amp;", "两个黄鹂鸣翠柳，一行白鹭上青天。&"),  # entities unescaped
    ]
    (tmp_path / "t.txt").write_text("\n\n".join(poems + [d for d, _ in dirty]) + "\n", encoding="utf-8")
    m = prepare([str(tmp_path / "t.txt")], tmp_path / "o", replace(CFG, vocab_size=400), workers=1, **QUIET)
    want = poems + [w for _, w in dirty if w is not None]
    got = {s: decoded(tmp_path / "o", s) for s in ("train", "valid")}
    assert sorted(got["train"] + got["valid"]) == sorted(want) and len(got["train"]) + len(got["valid"]) == len(want)
    for split in ("train", "valid"):  # each split keeps the input order
        assert got[split] == [d for d in want if d in got[split]], split
    assert m["documents_in"] == len(poems) + len(dirty)


def test_manifest(raw, prepared):
    out, m = prepared
    assert json.loads((out / "manifest.json").read_text(encoding="utf-8")) == m
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert m["documents_in"] == 402 and m["dropped"] == {"exact_dup": 2}
    assert m["changed"]["strip_html"] == 29 and m["changed"]["normalize_whitespace"] >= 1
    for s in ("train", "valid"):
        ds = IndexedDataset(out / s)
        assert m["tokens"][s] == ds.n_tokens and m["documents"][s] == len(ds) > 0
    assert m["documents"]["train"] + m["documents"]["valid"] == 400
    text_tokens = m["tokens"]["train"] + m["tokens"]["valid"] - 400
    assert m["chars_per_token"] == pytest.approx(m["characters"] / text_tokens, rel=1e-3)
    assert m["vocab_size"] == 500 and m["token_dtype"] == "uint16"
    assert m["special_ids"] == {"unk": 0, "bos": 1, "eos": 2, "pad": 3}
    assert m["fingerprint"] == data_fingerprint(out) and m["tokenizer_sha256"] == Tokenizer.load(out).sha256()
    assert m["files"]["by_encoding"] == {"utf-8": 2} and m["files"]["bytes_dropped"] == 0
    assert m["rules"]["strip_html"] is True and m["split"]["valid_fraction"] == 0.1
    assert (out / "train.bin").stat().st_size == 2 * m["tokens"]["train"]  # 2 bytes per token, no padding
    # per input file, named as the input named them, in reading order; the totals are their sums
    assert m["input_files"] == [
        {"name": f"{raw.as_posix()}/a.txt", "status": "read", "encoding": "utf-8", "bytes": (raw / "a.txt").stat().st_size, "documents": 202},
        {"name": f"{raw.as_posix()}/b.jsonl", "status": "read", "encoding": "utf-8", "bytes": (raw / "b.jsonl").stat().st_size,
         "documents": 200}]
    assert sum(f["documents"] for f in m["input_files"]) == m["files"]["documents"] == m["documents_in"]


def test_manifest_counts_losses_per_input_file_with_relative_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in" / "sub").mkdir(parents=True)
    poems = make_poems(60, seed=4)
    (tmp_path / "in" / "clean.txt").write_text("\n".join(p.replace("\n", "") for p in poems[:30]) + "\n", encoding="utf-8")
    lossy = ("\n".join(p.replace("\n", "") for p in poems[30:]) + "\n").encode() + b"\xff\xff\xff tail line here\n"
    (tmp_path / "in" / "sub" / "lossy.txt").write_bytes(lossy)
    (tmp_path / "in" / "sub" / "empty.txt").write_bytes(b"")
    for workers in (1, 2):  # the blocks of one file are decoded in the workers: the counts must not depend on it
        m = prepare(["in"], f"out{workers}", replace(CFG, doc_per_line=True), workers=workers, **QUIET)
        assert [(f["name"], f["status"], f.get("bytes_dropped", 0), f["documents"]) for f in m["input_files"]] == [
            ("in/clean.txt", "read", 0, 30), ("in/sub/empty.txt", "empty", 0, 0), ("in/sub/lossy.txt", "read", 3, 31)]
        assert m["files"]["bytes_dropped"] == 3 and m["files"]["skipped"] == {"empty": 1}
    assert (tmp_path / "out1" / "manifest.json").read_bytes() == (tmp_path / "out2" / "manifest.json").read_bytes()
    text = inspect(tmp_path / "out1")
    assert "lossy files  2: in/sub/empty.txt: empty; in/sub/lossy.txt: bytes_dropped 3" in text


def test_same_input_same_seed_byte_identical(raw, prepared, tmp_path):
    out, _ = prepared
    again = tmp_path / "again"
    prepare([str(raw)], again, CFG, workers=1, **QUIET)  # also: independent of the worker count
    for name in FILES:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name
    other = tmp_path / "seed"
    m = prepare([str(raw)], other, replace(CFG, seed=99), workers=1, **QUIET)
    assert m["fingerprint"] != json.loads((out / "manifest.json").read_text())["fingerprint"]


def test_given_tokenizer_gives_the_same_shards(raw, prepared, tmp_path):
    out, _ = prepared
    m = prepare([str(raw)], tmp_path / "given", CFG, tokenizer=str(out / "tokenizer.model"), workers=2, **QUIET)
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx", "tokenizer.model"):
        assert (out / name).read_bytes() == (tmp_path / "given" / name).read_bytes(), name
    assert m["tokenizer"]["trained"] is False


def test_encode_flat_equals_per_document_encode(prepared):
    # prepare's workers take SentencePiece's int32 buffers; the ids must be encode()'s plus EOS.
    tok = Tokenizer.load(prepared[0])
    texts = ["床前明月光，疑是地上霜。", "", "abc 123", "春" * 300, "😀𠮷"]
    flat, lengths = tok.encode_flat(texts, tok.eos_id, np.dtype(np.uint16))
    want = [tok.encode(t) + [tok.eos_id] for t in texts]
    assert flat.dtype == np.uint16 and lengths.tolist() == [len(w) for w in want]
    assert flat.tolist() == [i for w in want for i in w]
    empty, no_lengths = tok.encode_flat([], tok.eos_id, np.dtype(np.uint16))
    assert empty.size == 0 and no_lengths.size == 0
    # Without our C encoder (tests/data/test_bpe.py): SentencePiece's C++ buffers (private API,
    # probed at first use) and the public EncodeAsNumpy agree with it.
    buffers = Tokenizer.load(prepared[0])
    buffers._bpe_checked = True
    assert buffers._sp_buffers() is not None  # sentencepiece as pinned: that path is taken
    public = Tokenizer.load(prepared[0])
    public._bpe_checked = public._raw_checked = True
    for other in (buffers, public):
        for got, want in zip(other.encode_flat(texts, tok.eos_id, np.dtype(np.uint16)), (flat, lengths)):
            np.testing.assert_array_equal(got, want)


def test_sentencepiece_encoder_gives_the_same_shards(raw, prepared, tmp_path, monkeypatch):
    # The workers inherit the switch: prepare with SentencePiece's encoder instead of ours.
    monkeypatch.setenv("MSPRETRAIN_BPE", "sentencepiece")
    out, _ = prepared
    prepare([str(raw)], tmp_path / "sp", CFG, tokenizer=str(out / "tokenizer.model"), workers=2, **QUIET)
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert (out / name).read_bytes() == (tmp_path / "sp" / name).read_bytes(), name


def test_hf_tokenizer_json(raw, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(make_poems(400, seed=3), trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    m = prepare([str(raw)], tmp_path / "hf", CFG, tokenizer=str(tmp_path / "tokenizer.json"), workers=2, **QUIET)
    assert m["tokenizer"]["file"] == "tokenizer.json" and m["special_ids"] == {"bos": 1, "eos": 2, "pad": 3, "unk": 0}
    assert m["vocab_size"] == hf.get_vocab_size() and (tmp_path / "hf" / "tokenizer.json").is_file()
    want = expected_docs(raw, CFG)
    assert {s: decoded(tmp_path / "hf", s) for s in ("train", "valid")} == want


def test_progress_bars_show_rate_and_eta(raw, tmp_path, capsys):
    prepare([str(raw)], tmp_path / "p", CFG, workers=1, progress=True, **QUIET)
    bars = [b for b in capsys.readouterr().err.split("\r") if "B/s" in b]
    assert any(b.startswith("clean") for b in bars) and any(b.startswith("tokenize") for b in bars)
    assert all("<" in b for b in bars if "100%" not in b)  # elapsed<remaining


def test_inspect(prepared, capsys):
    out, m = prepared
    text = inspect(out)
    assert f"{m['tokens']['train']:,}" in text and m["fingerprint"] in text
    assert decoded(out, "train")[0][:20] in text
    assert main(["prepare", "--inspect", str(out)]) == 0
    assert "[valid #0" in capsys.readouterr().out


def test_small_vocab_lowers_coverage_with_a_warning(tmp_path):
    rng = np.random.default_rng(0)
    common = [chr(0x4E00 + i) for i in range(60)]
    docs = ["".join(rng.choice(common, 30)) for _ in range(300)] + [chr(0x5E00 + i) * 2 + "。" for i in range(40)]
    (tmp_path / "t.txt").write_text("\n".join(docs), encoding="utf-8")
    cfg = replace(CFG, vocab_size=340, doc_per_line=True, min_chars=1)
    m = prepare([str(tmp_path / "t.txt")], tmp_path / "out", cfg, workers=1, **QUIET)
    assert any("coverage lowered" in w for w in m["warnings"]) and m["tokenizer"]["warnings"]
    assert m["vocab_size"] == 340
    assert decoded(tmp_path / "out", "train")[0] in docs  # rare characters still round-trip (bytes)


def test_near_dedup_option(tmp_path):
    poems = make_poems(180, seed=9)
    base = ["\n".join(poems[i: i + 3]) for i in range(0, 180, 3)]  # ~110 characters each
    near = [p.replace("。", "！", 1) for p in base[:20]]  # one character changed: Jaccard ~0.9
    (tmp_path / "n.txt").write_text("\n\n".join(base + near), encoding="utf-8")
    off = prepare([str(tmp_path / "n.txt")], tmp_path / "off", replace(CFG, vocab_size=400), workers=1, **QUIET)
    on = prepare([str(tmp_path / "n.txt")], tmp_path / "on", replace(CFG, vocab_size=400, near_dedup=True), workers=2, **QUIET)
    assert "near_dup" not in off["dropped"] and off["documents_in"] == 80
    assert on["dropped"]["near_dup"] >= 15 and sum(on["documents"].values()) == 80 - on["dropped"]["near_dup"]


def test_tiny_corpus_still_gets_both_splits(tmp_path):
    (tmp_path / "t.txt").write_text("\n\n".join(make_poems(30, seed=1)), encoding="utf-8")
    m = prepare([str(tmp_path / "t.txt")], tmp_path / "o", replace(CFG, vocab_size=400, valid_fraction=0.001), workers=1, **QUIET)
    assert m["documents"]["valid"] == 1 and m["documents"]["train"] == 29
    assert any("moved the last train document" in w for w in m["warnings"])


# --------------------------------------------------------------------------- crashes and outputs

def test_crash_mid_write_leaves_nothing_finished_looking(raw, tmp_path, monkeypatch):
    from mspretrain.data import shards

    calls = []

    def boom(self, *a, **k):
        calls.append(1)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(shards.ShardWriter, "add_flat", boom)
    monkeypatch.setattr(shards.ShardWriter, "reserve", boom)  # the per-chunk path's writes (`stage_replay.replay_pieces`)
    with pytest.raises(RuntimeError, match="disk on fire"):
        prepare([str(raw)], tmp_path / "data", CFG, workers=2, **QUIET)
    assert calls and list(tmp_path.iterdir()) == []  # no data dir, no .partial left behind


def test_every_file_is_fsynced_before_the_data_dir_is_published(raw, tmp_path, monkeypatch):
    # The shard writers leave durability to prepare, which fsyncs all files at once: a file
    # missing from that batch could be lost by a power cut after the data dir looks finished.
    from mspretrain.prepare import publish as pub

    synced: list[Path] = []
    real_fsync, real_publish = pub.fsync_path, pub.publish
    monkeypatch.setattr(pub, "fsync_path", lambda p: (synced.append(Path(p)), real_fsync(p)))

    def publish(work: Path, out: Path) -> None:
        files = {p for p in work.iterdir()}
        assert files and files <= set(synced) and work in synced  # files and directory, before the rename
        real_publish(work, out)

    monkeypatch.setattr(pub, "publish", publish)  # (the publish stage's call, `stage_publish.Publish`)
    prepare([str(raw)], tmp_path / "data", CFG, workers=1, **QUIET)
    assert (tmp_path / "data" / "manifest.json").is_file()


def test_hard_kill_mid_write_then_rerun(raw, tmp_path):
    # os._exit skips every cleanup handler, like a SIGKILL or a power cut.
    code = ("import os, sys\nfrom mspretrain.data import shards\nfrom mspretrain.cli import main\n"
            "def dying(orig):\n    def die(self, *a, **k):\n        orig(self, *a, **k)\n        os._exit(9)\n    return die\n"
            "shards.ShardWriter.add_flat = dying(shards.ShardWriter.add_flat)\n"
            "shards.ShardWriter.reserve = dying(shards.ShardWriter.reserve)\n"  # the per-chunk path's writes
            "sys.exit(main(sys.argv[1:]))\n")
    args = ["prepare", str(raw), "--out", str(tmp_path / "data"), "--vocab-size", "500", "--workers", "1", "--quiet",
            "prepare.valid_fraction=0.1", "prepare.min_chars=4"]
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 9
    assert not (tmp_path / "data").exists()
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers and not any(p.name in ("manifest.json", "train.bin", "train.idx", "valid.idx", "valid.bin") for p in leftovers)
    assert main(args) == 0  # the same command again resumes and finishes (tests/prepare/test_prepare_resume.py: byte-identical)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert (tmp_path / "data" / "manifest.json").is_file()


def test_existing_output_is_refused_unless_overwrite(raw, prepared, tmp_path, capsys):
    out, m = prepared
    args = ["prepare", str(raw), "--vocab-size", "500", "--quiet", "prepare.valid_fraction=0.1", "prepare.min_chars=4"]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and "Traceback" not in err
    assert json.loads((out / "manifest.json").read_text()) == m  # untouched
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.docx").write_bytes(b"precious")
    assert main([*args, "--out", str(foreign), "--overwrite"]) == 2
    assert "did not write" in capsys.readouterr().err and (foreign / "thesis.docx").exists()
    copy = tmp_path / "copy"
    assert main([*args, "--out", str(copy)]) == 0
    (copy / "train.bin").write_bytes(b"garbage")
    assert main([*args, "--out", str(copy), "--overwrite"]) == 0
    assert (copy / "train.bin").read_bytes() == (out / "train.bin").read_bytes()


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_overwrite_refuses_a_manifest_prepare_did_not_write(raw, tmp_path, capsys):
    # a checkpoint dir has a manifest.json without `outputs`; it was taken for an old
    # prepare's and its manifest and tokenizer replaced.
    ckpt = tmp_path / "run" / "checkpoints" / "step_000010"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"model.safetensors": {"sha256": "ab", "size": 3}}}))
    (ckpt / "tokenizer.model").write_bytes(b"the run's tokenizer")
    (ckpt / "model.safetensors").write_bytes(b"abc")
    before = _tree(tmp_path)
    rc, _, err = run_cli(capsys, raw, "--out", ckpt, "--vocab-size", "500", "--overwrite")
    assert rc == 2 and "manifest.json that prepare did not write" in err
    assert _tree(tmp_path) == before and sorted(p.name for p in ckpt.parent.iterdir()) == ["step_000010"]


def test_a_publish_killed_halfway_is_repaired_by_the_same_command(raw, tmp_path, monkeypatch):
    # the file-by-file publish (a user's file lives in the data dir) removes the old
    # manifest first; a kill after that left a dir that every rerun refused.
    from mspretrain.prepare import publish as pub

    cfg = replace(CFG, valid_fraction=0.2)
    ref = prepare([str(raw)], tmp_path / "ref", cfg, workers=1, **QUIET)
    out = tmp_path / "data"
    prepare([str(raw)], out, CFG, workers=1, **QUIET)
    (out / "notes.txt").write_text("mine")
    real = pub.os.replace
    for kill_at in (2, 4, 9):  # after the journal, mid-way through the files, before the journal goes
        calls = []

        def replace_then_die(a, b, _calls=calls, _at=kill_at):
            _calls.extend([1] if Path(b).parent == out else [])  # the renames into the data dir
            if len(_calls) == _at:
                raise KeyboardInterrupt  # as a kill: nothing after this line runs
            real(a, b)

        monkeypatch.setattr(pub.os, "replace", replace_then_die)
        with pytest.raises(KeyboardInterrupt):
            prepare([str(raw)], out, CFG, workers=1, overwrite=True, **QUIET)
        monkeypatch.setattr(pub.os, "replace", real)
        assert (out / pub.JOURNAL).exists() and not (out / "manifest.json").exists(), (kill_at, sorted(p.name for p in out.iterdir()))
        m = prepare([str(raw)], out, cfg, workers=1, overwrite=True, **QUIET)
        assert m["fingerprint"] == ref["fingerprint"] and (out / "notes.txt").read_text() == "mine"
        assert not (out / pub.JOURNAL).exists()
        for name in ("train.bin", "valid.idx", "tokenizer.model"):
            assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_a_file_name_that_is_not_utf8_is_refused_before_any_work(tmp_path, capsys):
    # a crash after all the work, while writing the manifest
    d = tmp_path / "in"
    d.mkdir()
    bad = os.fsdecode(bytes(d) + b"/\xff\xfenews.txt")
    Path(bad).write_text("\n\n".join(make_poems(50, seed=2)), encoding="utf-8")
    rc, _, err = run_cli(capsys, d, "--out", tmp_path / "out", "--vocab-size", "400")
    assert rc == 2 and "not valid UTF-8" in err and "\\xff\\xfenews.txt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


# --------------------------------------------------------------------------- bad inputs via the CLI

def run_cli(capsys, *args) -> tuple[int, str, str]:
    rc = main(["prepare", *map(str, args), "--quiet"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    return rc, out, err


def test_bad_inputs_fail_in_one_line(raw, tmp_path, capsys):
    out = tmp_path / "o"
    assert run_cli(capsys, tmp_path / "*.txt", "--out", out)[0] == 2  # no files match
    assert run_cli(capsys, tmp_path / "missing.txt", "--out", out)[0] == 2
    (tmp_path / "empty.txt").write_bytes(b"")
    rc, _, err = run_cli(capsys, tmp_path / "empty.txt", "--out", out)
    assert rc == 2 and "no documents left" in err and "empty file" not in err.splitlines()[0]
    (tmp_path / "nofield.jsonl").write_text('{"content": "春眠不觉晓，处处闻啼鸟"}\n{"broken\n', encoding="utf-8")
    rc, stdout, err = run_cli(capsys, tmp_path / "nofield.jsonl", "--out", out)
    assert rc == 2 and "--text-field" in err and "warning:" in stdout
    (tmp_path / "fake.model").write_bytes(b"this is not a sentencepiece model")
    rc, _, err = run_cli(capsys, raw, "--out", out, "--tokenizer", tmp_path / "fake.model")
    assert rc == 2 and "not a SentencePiece model" in err
    (tmp_path / "fake.json").write_text("{}", encoding="utf-8")
    assert run_cli(capsys, raw, "--out", out, "--tokenizer", tmp_path / "fake.json")[0] == 2
    assert run_cli(capsys, raw, "--out", out, "--tokenizer", tmp_path / "nowhere.model")[0] == 2
    assert run_cli(capsys, raw, "--out", out, "--vocab-size", "300")[0] == 2  # too small for the characters
    assert run_cli(capsys, raw, "--out", out, "--vocab-size", "50000")[0] == 2  # more than the text can fill
    assert run_cli(capsys, raw, "--out", out, "--valid-fraction", "1.5")[0] == 2
    assert run_cli(capsys, raw, "--out", out, "--workers", "0")[0] == 2
    assert run_cli(capsys, raw)[0] == 2  # no --out
    assert run_cli(capsys, raw, "--out", out, "prepare.bogus=1")[0] == 2
    assert not out.exists() and not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_messy_inputs_are_counted_skips(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    poems = make_poems(200, seed=5)
    (d / "good.txt").write_text("\n\n".join(poems[:100]), encoding="utf-8")
    (d / "gbk.txt").write_bytes("\n\n".join(poems[100:150]).encode("gbk"))
    (d / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
    (d / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "nul.txt").write_bytes("\n\n".join(poems[150:170]).replace("，", "，\x00").encode())
    lines = [json.dumps({"text": p}, ensure_ascii=False) for p in poems[170:]] + ["{not json", '{"title": "x"}']
    (d / "mixed.jsonl").write_text("\n".join(lines), encoding="utf-8")
    rc, stdout, _ = run_cli(capsys, d, "--out", tmp_path / "o", "--vocab-size", "400", "--valid-fraction", "0.1")
    assert rc == 0 and stdout.count("warning:") >= 3
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    f = m["files"]
    assert f["by_encoding"] == {"utf-8": 3, "gbk": 1} and f["skipped"] == {"binary": 1, "empty": 1} and f["ignored"] == 1
    assert f["jsonl_broken"] == 1 and f["jsonl_no_field"] == 1
    assert m["changed"]["drop_control"] == 20 and sum(m["documents"].values()) == 200
    assert not any("\x00" in t for t in decoded(tmp_path / "o", "train"))


def test_50mb_single_line(tmp_path, prepared, capsys):
    # A minified HTML dump on one line: read in bounded pieces, cleaned, never a traceback.
    unit = '<div class="c"><span>春风又绿江南岸</span></div>'
    with open(tmp_path / "dump.txt", "w", encoding="utf-8") as f:
        for _ in range(50 * 2**20 // (len(unit.encode()) * 1000) + 1):
            f.write(unit * 1000)
    (tmp_path / "ok.txt").write_text("\n\n".join(make_poems(50, seed=2)), encoding="utf-8")
    assert (tmp_path / "dump.txt").stat().st_size >= 50 * 2**20
    rc, stdout, _ = run_cli(capsys, tmp_path / "dump.txt", tmp_path / "ok.txt", "--out", tmp_path / "o",
                            "--tokenizer", prepared[0] / "tokenizer.model")
    assert rc == 0
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["files"]["split_long"] >= 35 and m["documents_in"] >= 85  # ~40 M characters in 1 M pieces
    assert sum(m["dropped"].values()) >= 35 and sum(m["documents"].values()) == 50  # boilerplate gone, poems kept


# --------------------------------------------------------------------------- demo corpus

def _fake_tarball(path: Path) -> None:
    members = {
        "package/dist/quantangshi/poet.tang.0.json": [{"title": "靜夜思", "paragraphs": ["床前明月光，疑是地上霜。", "舉頭望明月，低頭思故鄉。"]}],
        "package/dist/quantangshi/poet.song.0.json": [{"title": "題西林壁", "paragraphs": ["橫看成嶺側成峰，遠近高低各不同。"]}],
        "package/dist/songci/ci.song.0.json": [{"rhythmic": "如夢令", "paragraphs": ["常記溪亭日暮。"]},
                                               {"rhythmic": "空", "paragraphs": []}],
        "package/dist/songci/ci.song.1000.json": [{"rhythmic": "浣溪沙", "content": ["一曲新詞酒一杯。"]}],
        "package/dist/quantangshi/poet.tang.1000.json": [{"title": "二", "para": ["白日依山盡。"]}],
        "package/dist/rank/poet/poet.tang.0.json": [{"title": "排行", "paragraphs": ["不要我。"]}],
        "package/dist/strains/json/poet.tang.0.json": [{"title": "平仄", "paragraphs": ["不要我。"]}],
        "package/dist/quantangshi/error/poet.tang.0.json": [{"title": "錯", "paragraphs": ["不要我。"]}],
        "package/dist/yudingquantangshi/json/poet.tang.0.json": [{"title": "御定", "paragraphs": ["不要我。"]}],
        "package/dist/quantangshi/authors.tang.json": [{"name": "李白", "desc": "詩人"}],
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            raw = json.dumps(data, ensure_ascii=False).encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


def test_poetry_corpus_from_cached_tarball(tmp_path, monkeypatch):
    _fake_tarball(tmp_path / corpus.TARBALL)
    monkeypatch.setattr(corpus.shutil, "which", lambda _: None)  # the network is never needed
    path = corpus.poetry_corpus(tmp_path, log=lambda _: None)
    texts = [json.loads(x)["text"] for x in path.read_text(encoding="utf-8").splitlines()]
    assert texts == ["静夜思\n床前明月光，疑是地上霜。\n举头望明月，低头思故乡。", "二\n白日依山尽。",
                     "题西林壁\n横看成岭侧成峰，远近高低各不同。", "如梦令\n常记溪亭日暮。", "浣溪沙\n一曲新词酒一杯。"]
    sub = corpus.poetry_corpus(tmp_path, max_docs=2, log=lambda _: None)
    assert [json.loads(x)["text"] for x in sub.read_text(encoding="utf-8").splitlines()] == [texts[0], texts[2]]
    assert corpus.poetry_corpus(tmp_path, log=lambda _: None) == path  # cached


def test_poetry_corpus_without_npm(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(corpus.shutil, "which", lambda _: None)
    with pytest.raises(UserError) as e:
        corpus.poetry_corpus(tmp_path / "cache", log=lambda _: None)
    assert "npm is not installed" in e.value.cause and "mspretrain prepare YOUR_TEXT" in e.value.fix
    monkeypatch.setenv("MSPRETRAIN_CACHE", str(tmp_path / "env"))
    assert corpus.default_cache_dir() == tmp_path / "env"


@pytest.mark.parametrize("case", ["chunks", "split move"])
def test_per_chunk_path_writes_what_the_path_through_the_main_process_writes(prepared, tmp_path, monkeypatch, case):
    """With a given tokenizer and local workers, the workers read their blocks, keep their chunks
    in files, place the dedup records and the shard pieces (`pipeline.LOCAL_PIECES`); the path
    through the main process (`--ray`'s) is the reference: the same bytes, the same manifest.
    Small blocks: many chunks, several files, near dedup on; or 5 documents, valid left empty,
    so that the last train document moves (`Sink.finish`, `ShardWriter.peek_last`)."""
    from mspretrain.prepare import pool, rawlines, stage_replay

    out, _ = prepared
    d = tmp_path / "in"
    d.mkdir()
    poems = [p.replace("\n", "，") for p in make_poems(300, seed=11)]
    if case == "chunks":
        for k in range(3):
            (d / f"p{k}.txt").write_text("\n".join(poems[k * 100: (k + 1) * 100] + poems[:5]) + "\n", encoding="utf-8")
        cfg = replace(CFG, doc_per_line=True, near_dedup=True)
    else:
        (d / "p.txt").write_text("\n".join(poems[:5]) + "\n", encoding="utf-8")
        cfg = replace(CFG, doc_per_line=True, valid_fraction=0.001)
    monkeypatch.setattr(rawlines, "RAW_READ_BYTES", 2048)
    monkeypatch.setattr(pool, "RAW_GROUP_BY_REFERENCE", 2)
    calls = []
    real = stage_replay.ReplayPieces.run
    monkeypatch.setattr(stage_replay.ReplayPieces, "run", lambda *a: calls.append(1) or real(*a))
    m = _both_paths(monkeypatch, [str(d)], tmp_path, cfg, tokenizer=str(out / "tokenizer.model"), workers=2)
    assert calls == [1]  # the per-chunk path ran once, the other run went through the main process
    if case == "chunks":
        assert m["dropped"].get("exact_dup", 0) > 0 and m["documents"]["valid"] > 0
    else:
        assert m["documents"] == {"train": 4, "valid": 1}


@pytest.mark.parametrize("near", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_per_chunk_path_with_a_trained_tokenizer_writes_what_the_main_process_path_writes(tmp_path, monkeypatch, near, workers):
    """Without --tokenizer and with local workers, pass 1's chunk files hold the cleaned texts:
    the tokenizer sample is chosen from per-document (u, characters) (`sink.RefSample`), its
    texts gathered from the files, and the workers encode and place each chunk's pieces. The path
    through the main process (`--ray`'s, `pipeline.LOCAL_PIECES = False`) is the reference: the
    same data dir byte for byte (tokenizer included), the same manifest. A 3,000-character
    sample budget, far below the corpus, makes documents leave the sample (the heap's pops), and
    the short documents mixed in fit the room a pop leaves."""
    from mspretrain.prepare import pool, rawlines, stage_replay

    d = tmp_path / "in"
    d.mkdir()
    poems = [p.replace("\n", "，") for p in make_poems(300, seed=12)]
    short = ["春风又绿江南岸", "明月何时照我还", "白日依山尽黄河", "两个黄鹂鸣翠柳"]
    for k in range(3):
        lines = poems[k * 100: (k + 1) * 100] + poems[:5] + [f"{s}{k}{i}" for i, s in enumerate(short * 3)]
        (d / f"p{k}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = replace(CFG, doc_per_line=True, near_dedup=near, tokenizer_sample_chars=3000, vocab_size=400)
    monkeypatch.setattr(rawlines, "RAW_READ_BYTES", 2048)
    monkeypatch.setattr(pool, "RAW_GROUP_BY_REFERENCE", 2)
    calls = []
    real = stage_replay.ReplaySample.run
    monkeypatch.setattr(stage_replay.ReplaySample, "run", lambda *a: calls.append(1) or real(*a))
    m = _both_paths(monkeypatch, [str(d)], tmp_path, cfg, workers=workers)
    assert calls == [1]  # the per-chunk path ran once, the other run went through the main process
    assert m["dropped"].get("exact_dup", 0) > 0 and m["documents"]["valid"] > 0
    assert 2000 < m["tokenizer"]["sample_characters"] <= 3000 < m["characters_by_split"]["train"]


def test_trained_tokenizer_per_chunk_path_moves_the_last_document(tmp_path, monkeypatch):
    """5 documents, valid left empty: the split move (`Sink.finish`) done on the shards in the
    encode stage gives the bytes of the path through the main process."""
    (tmp_path / "p.txt").write_text("\n".join(p.replace("\n", "，") for p in make_poems(5, seed=2)) + "\n", encoding="utf-8")
    cfg = replace(CFG, doc_per_line=True, valid_fraction=0.001)
    m = _both_paths(monkeypatch, [str(tmp_path / "p.txt")], tmp_path, cfg, workers=2)
    assert m["documents"] == {"train": 4, "valid": 1}


@pytest.mark.parametrize("impl", ["c", "python"])
@pytest.mark.parametrize("seed", range(6))
def test_ref_sample_keeps_the_members_sink_sample_keeps(seed, impl, monkeypatch):
    """`sink.RefSample` (per-document u and characters, references instead of texts, the heap
    touched only at events) against `Sink._sample` document by document, on random streams: ties
    in u (the older entry leaves first), short documents that fit the room a pop leaves (some
    exactly), documents alone over the budget, empty ones; fed in random chunk sizes, saved and
    restored midway."""
    from mspretrain.prepare.sink import RefSample, Sink, _c_sample

    if impl == "python":
        monkeypatch.setenv("MSPRETRAIN_SAMPLE", "python")
    elif _c_sample() is None:
        pytest.skip("the optional C extension is not built")
    assert RefSample(1)._fast == (impl == "c")
    rng = np.random.default_rng(seed)
    n, budget = int(rng.integers(2000, 6000)), int(rng.integers(500, 20_000))
    u = rng.random(n)
    if seed % 2:
        u = np.round(u * 50) / 50  # many ties
    chars = rng.integers(20, 300, n)
    short = rng.random(n) < 0.2
    chars[short] = rng.integers(0, 40, int(short.sum()))
    chars[rng.random(n) < 0.005] = budget + 1
    sink = Sink(PrepareConfig(), {}, budget)
    sample = RefSample(budget)
    cuts = np.sort(rng.choice(np.arange(1, n), size=n // 8, replace=False))
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), n]):
        for i in range(lo, hi):
            sink._sample(float(u[i]), "字" * int(chars[i]))
        sample.feed(u[lo:hi], chars[lo:hi], lo // 100, np.arange(lo, hi))
        # the same members after every chunk (order = document number here), not only at the end
        assert sample.members()[:, 1].tolist() == sorted(e[1] for e in sink.sample)
        assert (sample.chars, sample.order) == (sink.sample_chars, sink.order)
        if rng.random() < 0.05:  # a resume: the heap from its saved state
            again = RefSample(budget)
            again.restore(sample.state(), sample.chars, sample.order)
            sample = again
    assert 1 < len(sink.sample) < n and sink.sample_chars <= budget or len(sink.sample) == 1
