"""Hostile inputs to prepare, the quality filters and decontamination: nothing of the user's
is replaced (quality --out, prepare's hidden names), one prepare per --out, a publish killed
between its two renames finished by the same command, hostile files (journal, models, eval sets,
manifests) refused in one line in bounded memory and time, the decontamination rule (short items,
labelled options), and assertions that a slip in any of these would fail.

Every refusal: exit 2, one `error:` line and one `hint:` line, no traceback, and the files as they
were (`tree` before and after)."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from mspretrain.cli import main
from tests.conftest import ROOT, make_poems
from tests.helpers.cli import assert_refusal, cli

PREP = ["--doc-per-line", "--vocab-size", "400", "--workers", "1", "--quiet", "prepare.valid_fraction=0.05"]
CEVAL = sorted((ROOT / "mspretrain" / "eval" / "data").glob("zh_ceval_*.csv"))


def tree(d: Path) -> dict[str, bytes | str]:
    """Every entry under `d` (hidden ones too): a file's bytes, else what it is."""
    out: dict[str, bytes | str] = {}
    for p in sorted(d.rglob("*")):
        key = str(p.relative_to(d))
        if p.is_symlink():
            out[key] = "link -> " + os.readlink(p)
        elif p.is_fifo():
            out[key] = "fifo"
        elif p.is_file():
            out[key] = p.read_bytes()
        else:
            out[key] = "dir"
    return out


def refused(capsys, *argv: object, needle: str = "") -> str:
    code, _, err = cli(capsys, *argv)
    assert_refusal(code, err, needle)
    return err


def lines(docs: list[str]) -> str:
    return "\n".join(d.replace("\n", "，") for d in docs) + "\n"


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    """Good (poems) and bad (Latin junk) one-per-line files for `quality train`."""
    d = tmp_path_factory.mktemp("labels")
    (d / "pos.txt").write_text(lines(make_poems(160, seed=3)), encoding="utf-8")
    rng = np.random.default_rng(4)
    junk = ["".join(rng.choice(list("abcdefghijklmnop 0123456789"), 40)) for _ in range(160)]
    (d / "neg.txt").write_text(lines(junk), encoding="utf-8")
    return d


def train(d: Path, out: Path, *extra: str) -> list[str]:
    return ["quality", "train", "--positive", str(d / "pos.txt"), "--negative", str(d / "neg.txt"), "--doc-per-line",
            "--out", str(out), "--quiet", *extra]


# ----------------------------------------------------------------------------- quality --out

def test_quality_out_creates_its_parents_and_replaces_only_its_own_model(labelled, tmp_path, capsys):
    """`--out models/x.npz` works when models/ does not exist (operators §14);
    a second run replaces its own model and checksum."""
    out = tmp_path / "models" / "sub" / "q.npz"
    code, stdout, err = cli(capsys, *train(labelled, out))
    assert code == 0, err
    assert out.is_file() and out.with_name("q.npz.sha256").is_file() and "use it with prepare.quality_model=" in stdout
    code, _, err = cli(capsys, *train(labelled, out))  # its own output: replaced
    assert code == 0, err
    lm = tmp_path / "lms" / "lm.npz"
    code, _, err = cli(capsys, "quality", "lm", labelled / "pos.txt", "--doc-per-line", "--out", lm, "--quiet")
    assert code == 0 and lm.is_file(), err


@pytest.mark.parametrize("case", ["positive", "negative-hardlink", "sha256-is-input", "foreign-npz", "foreign-sidecar", "directory",
                                  "fifo", "symlink-to-input", "other-kind", "dev-zero", "parent-is-a-file"])
def test_quality_out_never_replaces_an_input_or_a_file_it_did_not_write(labelled, tmp_path, capsys, case):
    """The label file did become a zip, and a user's X.npz.sha256 was
    replaced. Every variant is refused in one line and every file stays as it was."""
    d = tmp_path / "w"
    d.mkdir()
    for name in ("pos.txt", "neg.txt"):
        (d / name).write_bytes((labelled / name).read_bytes())
    out = d / "q.npz"
    if case == "positive":
        out = d / "pos.txt"
    elif case == "negative-hardlink":
        os.link(d / "neg.txt", d / "neg-link.npz")
        out = d / "neg-link.npz"
    elif case == "sha256-is-input":
        os.link(d / "pos.txt", d / "q.npz.sha256")  # the checksum file beside --out is an input
    elif case == "foreign-npz":
        buf = io.BytesIO()
        np.savez(buf, weights=np.arange(4.0))
        out.write_bytes(buf.getvalue())
    elif case == "foreign-sidecar":
        (d / "q.npz.sha256").write_text("my notes\n", encoding="utf-8")
    elif case == "directory":
        out.mkdir()
        (out / "keep").write_text("x", encoding="utf-8")
    elif case == "fifo":
        os.mkfifo(out)
    elif case == "symlink-to-input":
        out.symlink_to(d / "pos.txt")
    elif case == "other-kind":
        assert main(["quality", "lm", str(d / "pos.txt"), "--doc-per-line", "--out", str(out), "--quiet"]) == 0
    elif case == "dev-zero":
        out.symlink_to("/dev/zero")
    elif case == "parent-is-a-file":
        (d / "models").write_text("a file", encoding="utf-8")
        out = d / "models" / "q.npz"
    before = tree(d)
    t0 = time.monotonic()
    refused(capsys, *train(d, out))
    assert tree(d) == before and time.monotonic() - t0 < 60


def test_quality_lm_refuses_its_input_as_out(labelled, tmp_path, capsys):
    ref = tmp_path / "ref.txt"
    ref.write_bytes((labelled / "pos.txt").read_bytes())
    before = tree(tmp_path)
    refused(capsys, "quality", "lm", ref, "--doc-per-line", "--out", ref, needle="input")
    refused(capsys, "quality", "lm", tmp_path, "--doc-per-line", "--out", ref, needle="input")  # found through a dir
    assert tree(tmp_path) == before


@pytest.mark.parametrize("case", ["same-file", "hard-link", "copy", "dir-holding-both"])
def test_quality_train_refuses_the_same_documents_as_both_classes(labelled, tmp_path, capsys, case):
    """The same file as both classes wrote a meaningless model (held-out recall
    0.02) and said to use it."""
    pos = labelled / "pos.txt"
    neg = pos
    if case == "hard-link":
        os.link(pos, tmp_path / "n.txt")
        neg = tmp_path / "n.txt"
    elif case == "copy":
        (tmp_path / "n.txt").write_bytes(pos.read_bytes())
        neg = tmp_path / "n.txt"
    elif case == "dir-holding-both":
        (tmp_path / "all").mkdir()
        (tmp_path / "all" / "a.txt").write_bytes(pos.read_bytes())
        pos, neg = tmp_path / "all", tmp_path / "all" / "a.txt"
    out = tmp_path / "m.npz"
    refused(capsys, "quality", "train", "--positive", pos, "--negative", neg, "--doc-per-line", "--out", out)
    assert not out.exists() and not out.with_name("m.npz.sha256").exists()


def test_a_model_that_cannot_tell_the_classes_apart_is_not_recommended(tmp_path, capsys):
    """Shuffled labels (poems on both sides, no document shared): written, with a warning, and
    without "use it"."""
    poems = make_poems(600, seed=8)
    side = np.random.default_rng(1).random(len(poems)) < 0.5
    (tmp_path / "a.txt").write_text(lines([p for p, s in zip(poems, side) if s]), encoding="utf-8")
    (tmp_path / "b.txt").write_text(lines([p for p, s in zip(poems, side) if not s]), encoding="utf-8")
    code, out, err = cli(capsys, "quality", "train", "--positive", tmp_path / "a.txt", "--negative", tmp_path / "b.txt",
                         "--doc-per-line", "--holdout", "0.5", "--out", tmp_path / "m.npz", "--quiet")
    assert code == 0, err
    assert "does not tell --positive from --negative" in out and "use it with" not in out


# ----------------------------------------------------------------------------- hostile model files

def _npz(members: dict[str, np.ndarray | bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, a in members.items():
            if isinstance(a, bytes):
                z.writestr(name, a)
            else:
                with z.open(name, "w") as f:
                    np.lib.format.write_array(f, a, allow_pickle=True)
    return buf.getvalue()


def _meta(d: dict) -> np.ndarray:
    return np.frombuffer(json.dumps(d).encode(), dtype=np.uint8)


CLF = {"kind": "mspretrain-quality-classifier", "format": 1, "orders": [1, 2, 3], "bits": 4}


def _bomb(tmp_path: Path) -> Path:
    """A 100 MB member of zeros, a few hundred KB deflated."""
    p = tmp_path / "bomb.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("meta.npy", _npz_member(_meta(CLF)))
        z.writestr("bias.npy", _npz_member(np.array(0.0)))
        with z.open("weights.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (25 << 20,)})
            block = bytes(1 << 20)
            for _ in range(100):
                f.write(block)
    return p


def _npz_member(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a)
    return buf.getvalue()


def _lying_header() -> bytes:
    """weights.npy whose header claims 10^12 floats over 16 bytes of data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (10 ** 12,)})
    return buf.getvalue() + bytes(16)


def _unknown_compression() -> bytes:
    """A well-formed model file whose members name compression method 99 (zipfile: NotImplementedError)."""
    data = bytearray(_npz({"meta.npy": _npz_member(_meta(CLF)), "bias.npy": _npz_member(np.array(0.0)),
                           "weights.npy": _npz_member(np.zeros(16, np.float32))}))
    for signature, field in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):  # local headers, central directory
        at = data.find(signature)
        while at >= 0:
            data[at + field:at + field + 2] = (99).to_bytes(2, "little")
            at = data.find(signature, at + 4)
    return bytes(data)


HOSTILE_MODELS = {
    "lying-header": lambda: _npz({"meta.npy": _npz_member(_meta(CLF)), "bias.npy": _npz_member(np.array(0.0)),
                                  "weights.npy": _lying_header()}),
    "object-dtype": lambda: _npz({"meta": _meta(CLF), "bias": np.array(0.0), "weights": np.array([{"a": 1}], dtype=object)}),
    "deep-meta": lambda: _npz({"meta": np.frombuffer(b"[" * 100_000 + b"]" * 100_000, dtype=np.uint8), "bias": np.array(0.0),
                               "weights": np.zeros(16, np.float32)}),
    "orders-not-a-list": lambda: _npz({"meta": _meta({**CLF, "orders": 5}), "bias": np.array(0.0), "weights": np.zeros(16, np.float32)}),
    "bias-of-three": lambda: _npz({"meta": _meta(CLF), "bias": np.zeros(3), "weights": np.zeros(16, np.float32)}),
    "string-weights": lambda: _npz({"meta": _meta(CLF), "bias": np.array(0.0), "weights": np.array(["a", "b"])}),
    "extra-member": lambda: _npz({"meta": _meta(CLF), "bias": np.array(0.0), "weights": np.zeros(16, np.float32),
                                  "x": np.zeros(1)}),
    "meta-not-utf8": lambda: _npz({"meta": np.frombuffer(b"\xff\xfe{", dtype=np.uint8), "bias": np.array(0.0),
                                   "weights": np.zeros(16, np.float32)}),
    "empty-weights": lambda: _npz({"meta": _meta(CLF), "bias": np.array(0.0), "weights": np.zeros(0, np.float32)}),
    "unknown-compression": _unknown_compression,
}


@pytest.mark.parametrize("case", [*HOSTILE_MODELS, "zip-bomb", "directory", "fifo", "dev-zero", "missing", "sidecar-fifo"])
def test_hostile_quality_model_files_are_one_line_in_bounded_memory(tmp_path, capsys, case):
    """A 2 MB zip bomb passed 1.5 GB; hostile members and heads were
    tracebacks; a directory, FIFO or /dev/zero "did not exist"."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(lines(make_poems(30)), encoding="utf-8")
    model = tmp_path / "m.npz"
    if case in HOSTILE_MODELS:
        model.write_bytes(HOSTILE_MODELS[case]())
    elif case == "zip-bomb":
        model = _bomb(tmp_path)
    elif case == "directory":
        model.mkdir()
    elif case == "fifo":
        os.mkfifo(model)
    elif case == "dev-zero":
        model.symlink_to("/dev/zero")
    elif case == "sidecar-fifo":
        model.write_bytes(HOSTILE_MODELS["bias-of-three"]())
        os.mkfifo(tmp_path / "m.npz.sha256")
    before = tree(tmp_path)
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    err = refused(capsys, "prepare", corpus, "--out", tmp_path / "out", *PREP, f"prepare.quality_model={model}")
    assert time.monotonic() - t0 < 30 and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 300 << 10  # KB
    if case in ("directory", "fifo", "dev-zero"):
        assert "does not exist" not in err and {"directory": "a directory", "fifo": "a FIFO", "dev-zero": "a device"}[case] in err
    assert tree(tmp_path) == before


def test_quality_lm_counts_a_long_reference_in_segments_exactly(monkeypatch):
    """`train_lm` streams (bounded memory: a 300 MB line grew 4 GB): its segments overlap by two
    characters and count the overlap's 1- and 2-grams back, so the counts are the whole texts'."""
    from mspretrain.prepare import quality

    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("春眠不觉晓处闻啼鸟"), n)) for n in (0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 40)]
    whole = quality.train_lm(texts, bits=10)
    monkeypatch.setattr(quality, "LM_SEGMENT", 7)
    cut = quality.train_lm(texts, bits=10)
    assert np.array_equal(whole[0], cut[0]) and whole[1:] == cut[1:]


# ----------------------------------------------------------------------------- decontamination

def _ceval_rows() -> list[dict]:
    rows = []
    for f in CEVAL:
        with open(f, encoding="utf-8") as fh:
            rows += list(csv.DictReader(fh))
    return rows


@pytest.fixture(scope="module")
def ceval():
    from mspretrain.prepare.decontam import EvalNgrams

    return EvalNgrams.build([str(f) for f in CEVAL], 13)


LABELS = [("A. ", "B. ", "C. ", "D. "), ("(A)", "(B)", "(C)", "(D)"), ("A、", "B、", "C、", "D、"), ("Ａ．", "Ｂ．", "Ｃ．", "Ｄ．"),
          ("a) ", "b) ", "c) ", "d) ")]


def test_every_shipped_ceval_question_with_its_option_labels_is_a_hit(ceval):
    """A document holding a shipped C-Eval question with its option labels
    is dropped (the labels broke every 13-gram of a short question), in several label styles; and
    the options alone in order, labelled or not."""
    from mspretrain.prepare.decontam import MIN_WHOLE, normalize

    rows = _ceval_rows()
    assert len(rows) >= 10
    for r in rows:
        plain = "".join(r[k] for k in "ABCD")
        for lab in LABELS:
            opts = "\n".join(f"{lab[i]}{r[k]}" for i, k in enumerate("ABCD"))
            docs = [f"练习题：{r['question']}\n{opts}\n参考答案：{r['answer']}", f"{r['question']}{opts}",
                    f"选项依次为 {opts} 。"] + ([plain + "是四个词。"] if len(normalize(plain)) >= MIN_WHOLE else [])
            assert ceval.hits(docs).all(), (r, lab)


def test_a_document_sharing_only_12_characters_with_an_eval_item_is_kept(ceval):
    """With 12-grams instead of 13 this document would be dropped."""
    from mspretrain.prepare.decontam import EvalNgrams, normalize

    long = max(_ceval_rows(), key=lambda r: len(normalize(r["question"])))
    q = long["question"]
    assert len(normalize(q)) >= 13
    near = "今天的天气很好，我们出去走走。" + q[:12] + "然后回家吃饭，晚上看书。"
    assert len(normalize(q[:12])) == 12
    assert ceval.hits([near]).tolist() == [0]
    assert ceval.hits(["今天" + q + "然后"]).tolist() != [0]  # the whole question: a hit
    # the slip: the same eval set read with 12-grams drops it
    assert EvalNgrams.build([str(f) for f in CEVAL], 12).hits([near]).tolist() != [0]


def test_items_shorter_than_the_ngram_are_matched_whole(tmp_path):
    """A set whose every item was shorter than n was accepted and removed nothing."""
    from mspretrain.prepare.decontam import EvalNgrams

    f = tmp_path / "short.jsonl"
    f.write_text("\n".join(json.dumps({"question": q}, ensure_ascii=False) for q in ("床前明月光照", "春眠不觉晓啊", "一二三四五六七"))
                 + "\n", encoding="utf-8")
    e = EvalNgrams.build([str(f)], 13)
    got = e.hits(["他写道：床前明月光照在地上。", "春眠，不觉晓啊", "一二三四五六", "夜来风雨声花落知多少", "一 二 三 四 五 六 七！"])
    assert (got > 0).tolist() == [True, True, False, False, True]
    c = tmp_path / "opts.csv"  # a short question whose options are short too: question + labelled options whole
    c.write_text("id,question,A,B,C,D,answer\n0,首都是,北京,上海,广州,深圳,A\n", encoding="utf-8")
    e = EvalNgrams.build([str(c)], 13)
    got = e.hits(["首都是 A.北京 B.上海 C.广州 D.深圳", "北京上海广州深圳", "A北京B上海C广州D深圳", "我去过北京和上海", "首都是北京"])
    assert (got > 0).tolist() == [True, True, True, False, False]


@pytest.mark.parametrize("case", ["tiny-items", "deep-json", "fifo", "dev-zero", "empty-dir", "not-utf8", "json-not-object"])
def test_hostile_eval_sets_are_one_line(tmp_path, capsys, case):
    """Deep JSON in a decontamination .jsonl was a traceback; a FIFO or
    /dev/zero "did not exist"; a set of items too short to tell a copy from chance is refused."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(lines(make_poems(30)), encoding="utf-8")
    e = tmp_path / "e.jsonl"
    if case == "tiny-items":
        e.write_text('{"question": "是"}\n{"question": "否"}\n', encoding="utf-8")
    elif case == "deep-json":
        e.write_text("[" * 200_000 + "]" * 200_000 + "\n", encoding="utf-8")
    elif case == "fifo":
        os.mkfifo(e)
    elif case == "dev-zero":
        e.symlink_to("/dev/zero")
    elif case == "empty-dir":
        e = tmp_path / "evals"
        e.mkdir()
    elif case == "not-utf8":
        e.write_bytes(b'{"question": "\xff\xfe"}\n')
    elif case == "json-not-object":
        e.write_text('{"question": "床前明月光疑是地上霜举头望明月"}\n{"question": [1, {\n', encoding="utf-8")
    before = tree(tmp_path)
    err = refused(capsys, "prepare", corpus, "--out", tmp_path / "out", *PREP, f"prepare.decontam={json.dumps([str(e)])}")
    assert "does not exist" not in err
    assert tree(tmp_path) == before


def test_prepare_drops_a_labelled_ceval_copy_and_keeps_the_12_character_near_miss(tmp_path):
    """The bar end to end: prepare with the shipped C-Eval sets drops the document holding a
    question with its labelled options, keeps one sharing 12 characters, and says so in its own
    summary."""
    from mspretrain.prepare.decontam import normalize

    rows = _ceval_rows()
    short = min(rows, key=lambda r: len(r["question"]))
    long = max(rows, key=lambda r: len(normalize(r["question"])))
    twelve = next(long["question"][:k] for k in range(40) if len(normalize(long["question"][:k])) == 12)
    copy = f"{short['question']} A.{short['A']} B.{short['B']} C.{short['C']} D.{short['D']}"
    near = "我读到一句话：" + twelve + "，觉得有意思。"  # 12 characters of a question: kept (with 12-grams: dropped)
    corpus = tmp_path / "c.txt"
    corpus.write_text(lines(make_poems(200, seed=9) + [copy, near]), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "mspretrain.cli", "prepare", str(corpus), "--out", str(tmp_path / "d"),
                           *[a for a in PREP if a != "--quiet"], f"prepare.decontam={json.dumps([str(f) for f in CEVAL])}"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    m = json.loads((tmp_path / "d" / "manifest.json").read_text(encoding="utf-8"))
    assert m["dropped"].get("contaminated") == 1
    assert "quality filters dropped 1 of 202 documents read (decontamination 1)" in proc.stdout, proc.stdout
    from mspretrain.prepare.inspect import inspect

    shown = inspect(tmp_path / "d")
    assert "dropped contaminated" in shown and short["question"][:5] in shown


def test_inspect_shows_a_jsonl_record_as_text(tmp_path):
    """--inspect printed `{"text": "\\u6625...` bytes; now the record's text."""
    from mspretrain.prepare.inspect import jsonl_text

    rec = json.dumps({"id": 3, "text": "春眠不觉晓，\n处处闻啼鸟。"})
    assert jsonl_text(rec) == "春眠不觉晓，\n处处闻啼鸟。"
    assert jsonl_text(json.dumps({"content": "夜来风雨声", "x": "a"}, ensure_ascii=False)) == "夜来风雨声"
    assert jsonl_text(rec[:60]).startswith("春眠不觉")  # a record cut where it was read


# ----------------------------------------------------------------------------- prepare's hidden names, lock and journal

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text(lines(make_poems(150, seed=11)), encoding="utf-8")
    return d / "a.txt"


@pytest.fixture(scope="module")
def published(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pub") / "data"
    assert main(["prepare", str(corpus), "--out", str(out), *PREP]) == 0
    return out


def _copy_data(published: Path, where: Path) -> Path:
    import shutil

    out = where / "data"
    shutil.copytree(published, out)
    return out


def test_a_users_dot_old_dir_is_never_removed(published, corpus, tmp_path, capsys):
    """`prepare --overwrite` removed a user's directory named `.NAME.old`."""
    out = _copy_data(published, tmp_path)
    for variant in ("dir", "file", "link"):
        old = tmp_path / ".data.old"
        if variant == "dir":
            old.mkdir()
            (old / "thesis.tex").write_text("mine", encoding="utf-8")
        elif variant == "file":
            old.write_text("mine", encoding="utf-8")
        else:
            old.symlink_to(corpus.parent)
        before = tree(tmp_path)
        refused(capsys, "prepare", corpus, "--out", out, *PREP, "--overwrite", needle=".data.old")
        assert tree(tmp_path) == before
        if old.is_dir() and not old.is_symlink():
            import shutil

            shutil.rmtree(old)
        else:
            old.unlink()
    assert cli(capsys, "prepare", corpus, "--out", out, *PREP, "--overwrite")[0] == 0  # without it: replaced as before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize("content", ["text", "json-object", "old-journal-shape", "our-format-edited", "fifo", "dev-zero", "deep-json",
                                     "directory"])
def test_a_users_progress_json_is_never_replaced(corpus, tmp_path, capsys, content):
    """`prepare --out NAME` overwrote and deleted a user's
    `.NAME.progress.json`; a FIFO there hung; deep JSON was a traceback."""
    j = tmp_path / ".data.progress.json"
    if content == "text":
        j.write_text("my progress notes\n", encoding="utf-8")
    elif content == "json-object":
        j.write_text('{"chapter": 3}\n', encoding="utf-8")
    elif content == "old-journal-shape":
        j.write_text('{"version": 2, "fingerprint": {}}\n', encoding="utf-8")
    elif content == "our-format-edited":
        j.write_text('{"format": "mspretrain-prepare-progress", "version": 2, "fingerprint": {}, "stage": "pass1", "check": "0"}\n',
                     encoding="utf-8")
    elif content == "fifo":
        os.mkfifo(j)
    elif content == "dev-zero":
        j.symlink_to("/dev/zero")
    elif content == "deep-json":
        j.write_text("[" * 300_000 + "]" * 300_000, encoding="utf-8")
    else:
        j.mkdir()
    before = tree(tmp_path)
    t0 = time.monotonic()
    refused(capsys, "prepare", corpus, "--out", tmp_path / "data", *PREP)
    assert tree(tmp_path) == before and time.monotonic() - t0 < 60


def test_a_users_publish_journal_does_not_make_a_dir_ours(published, corpus, tmp_path, capsys):
    """A file named like the journal of a file-by-file publish, listing the user's files, must
    not let `--overwrite` delete them (the journal needs prepare's format)."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    (out / ".mspretrain-prepare-publish.json").write_text(json.dumps({"owned": ["notes.txt", "train.bin"]}), encoding="utf-8")
    before = tree(tmp_path)
    refused(capsys, "prepare", corpus, "--out", out, *PREP, "--overwrite")
    assert tree(tmp_path) == before


def _journal(tmp_path: Path, data: dict) -> None:
    """A work dir prepare would call its own, with a journal of `data` (its check sum right)."""
    from mspretrain.prepare import resume

    work = tmp_path / ".data.partial"
    (work / resume.STATE_DIR).mkdir(parents=True)
    (work / resume.STATE_DIR / resume.WORK_MARK).write_text("prepare\n", encoding="utf-8")
    data = {**data, "format": resume.FORMAT}
    (tmp_path / ".data.progress.json").write_text(json.dumps({**data, "check": resume._check(data)}), encoding="utf-8")


@pytest.mark.parametrize("edit", ["negative-offset", "wrong-type", "unknown-stage", "deep"])
def test_an_edited_journal_is_refused_in_one_line(corpus, tmp_path, capsys, edit):
    """Hostile journal content (deep JSON, unknown stage, negative offsets, wrong
    types) was a traceback. A journal changed after prepare wrote it fails its check sum; one whose
    check sum was made to fit still names a stage the chain must have."""
    from mspretrain.prepare import resume

    if edit == "unknown-stage":  # (a check sum that fits: only a forger's; refused by the chain)
        from mspretrain.config.schema import PrepareConfig

        cfg = PrepareConfig(doc_per_line=True, vocab_size=400, valid_fraction=0.05)
        from mspretrain.prepare import sources

        named = sources.discover_named([str(corpus)], sources.SourceStats())
        fp = resume.fingerprint([str(corpus)], [p for p, _ in named], [n for _, n in named], cfg, None, 64)
        _journal(tmp_path, {"version": resume.VERSION, "fingerprint": fp, "stage": "teleport"})
        refused(capsys, "prepare", corpus, "--out", tmp_path / "data", *PREP, needle="teleport")
        return
    _journal(tmp_path, {"version": resume.VERSION, "fingerprint": {}, "stage": "pass1", "pass1": {"chunks": 2, "spool_bytes": 10}})
    j = tmp_path / ".data.progress.json"
    d = json.loads(j.read_text())
    if edit == "negative-offset":
        d["pass1"]["spool_bytes"] = -5
    elif edit == "wrong-type":
        d["pass1"]["chunks"] = ["x"]
    j.write_text(json.dumps(d) if edit != "deep" else "{\"a\":" * 100_000 + "1" + "}" * 100_000, encoding="utf-8")
    before = tree(tmp_path)
    refused(capsys, "prepare", corpus, "--out", tmp_path / "data", *PREP)
    assert tree(tmp_path) == before


def test_a_second_prepare_on_the_same_out_is_refused_while_the_first_runs(corpus, tmp_path, capsys):
    """Two prepares on one --out resumed each other's live work dir and both died.
    The --out is locked as `train` locks a run dir; a foreign lock file of that name is refused."""
    from mspretrain.fsutil import locked_beside

    out = tmp_path / "data"
    with locked_beside(tmp_path / ".data.lock", "prepare", f"--out {out}"):
        before = tree(tmp_path)
        err = refused(capsys, "prepare", corpus, "--out", out, *PREP, needle="in use by PID")
        assert str(os.getpid()) in err and tree(tmp_path) == before
    assert not (tmp_path / ".data.lock").exists()  # the lock goes with its holder
    (tmp_path / ".data.lock").write_text("my lock notes", encoding="utf-8")
    before = tree(tmp_path)
    refused(capsys, "prepare", corpus, "--out", out, *PREP, needle="not a lock file")
    assert tree(tmp_path) == before
    (tmp_path / ".data.lock").unlink()
    assert cli(capsys, "prepare", corpus, "--out", out, *PREP)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_two_prepares_started_together_on_one_out(corpus, tmp_path):
    """Two processes at once: one publishes, the other is refused in one line (or, started after
    the first finished, sees a finished data dir: refused without --overwrite); no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "mspretrain.cli", "prepare", str(corpus), "--out", str(tmp_path / "data"), *PREP]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    res = [(p.wait(600), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in res) == [0, 2], res
    for code, err in res:
        assert "Traceback" not in err
        if code == 2:
            assert_refusal(code, err)
    assert (tmp_path / "data" / "manifest.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


KILL_BETWEEN_RENAMES = """
import os, signal, sys
from mspretrain.prepare import publish
real = os.replace
def replace(src, dst):
    real(src, dst)
    if str(src).endswith('.partial') and not str(dst).endswith('.old'):
        pass
    if str(dst).endswith('.old'):  # the first rename of the swap done: die before the second
        os.kill(os.getpid(), signal.SIGKILL)
publish.os.replace = replace
from mspretrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.sigkill
def test_a_rethreshold_into_its_own_source_killed_between_the_renames_is_finished_by_the_same_command(corpus, tmp_path):
    """`--out D --overwrite --scores-from D` killed between publish's two renames
    left D only under its hidden name, and the same command was then refused."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    d = tmp_path / "d"
    base = ["prepare", str(corpus), *PREP]
    assert main([*base, "--out", str(d), "prepare.min_zh_prob=0.5"]) == 0
    again = [*base, "--out", str(d), "--overwrite", "--scores-from", str(d), "prepare.min_zh_prob=0.99"]
    killed = subprocess.run([sys.executable, "-c", KILL_BETWEEN_RENAMES, *again], capture_output=True, text=True, env=env, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not d.exists() and (tmp_path / ".d.old").is_dir()  # the state the issue names
    rerun = subprocess.run([sys.executable, "-m", "mspretrain.cli", *again], capture_output=True, text=True, env=env, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    fresh = tmp_path / "fresh"
    assert main([*base, "--out", str(fresh), "prepare.min_zh_prob=0.99"]) == 0
    want = {p.name: p.read_bytes() for p in fresh.iterdir()}
    assert {p.name: p.read_bytes() for p in d.iterdir()} == want


# ----------------------------------------------------------------------------- --scores-from

def test_fractions_from_a_source_of_longer_inputs_are_refused(tmp_path, capsys):
    """The source's documents this run does not have (its inputs a prefix of the
    source's) counted in the fraction's threshold, silently. Without a fraction, a prefix is fine
    (each document's scores are looked up)."""
    poems = [p.replace("\n", "，") for p in make_poems(240, seed=12)]
    full, part = tmp_path / "full" / "a.txt", tmp_path / "part" / "a.txt"
    full.parent.mkdir()
    part.parent.mkdir()
    full.write_text(lines(poems), encoding="utf-8")
    part.write_text(lines(poems[:120]), encoding="utf-8")
    ref = tmp_path / "ref.txt"
    ref.write_text(lines(make_poems(100, seed=13)), encoding="utf-8")
    lm = [f"prepare.lm_reference={json.dumps([str(ref)])}"]
    src = tmp_path / "src"
    assert main(["prepare", str(full), "--out", str(src), *PREP, *lm, "prepare.ppl_quantiles=[0.1, 0.9]"]) == 0
    before = tree(tmp_path)
    refused(capsys, "prepare", part, "--out", tmp_path / "x", *PREP, *lm, "prepare.ppl_quantiles=[0.2, 0.8]", "--scores-from", src,
            needle="does not have")
    assert tree(tmp_path) == before
    assert cli(capsys, "prepare", part, "--out", tmp_path / "y", *PREP, *lm, "prepare.ppl_max=1000", "--scores-from", src)[0] == 0


@pytest.mark.parametrize("manifest", ["deep", "fifo", "not-an-object"])
def test_a_hostile_scores_from_manifest_is_one_line(corpus, tmp_path, capsys, manifest):
    src = tmp_path / "src"
    src.mkdir()
    from mspretrain.prepare.scoring import HEADER

    (src / "quality.scores").write_bytes(HEADER)
    m = src / "manifest.json"
    if manifest == "deep":
        m.write_text('{"quality":' * 100_000 + "1" + "}" * 100_000, encoding="utf-8")
    elif manifest == "fifo":
        os.mkfifo(m)
    else:
        m.write_text("[1, 2]", encoding="utf-8")
    before = tree(tmp_path)
    refused(capsys, "prepare", corpus, "--out", tmp_path / "x", *PREP, "prepare.min_zh_prob=0.5", "--scores-from", src)
    assert tree(tmp_path) == before


# ----------------------------------------------------------------------------- the missing assertions

def _stage(**kw):
    from mspretrain.prepare.quality import CharLM, Classifier
    from mspretrain.prepare.scoring import QualityStage

    base = dict(evals=None, langid=None, min_zh=0.0, lm=None, ppl_min=0.0, ppl_max=0.0, classifier=None, threshold=0.5)
    if kw.pop("lm", False):
        base["lm"] = CharLM(np.zeros((3, 4), np.float32), 1.0)
    if kw.pop("clf", False):
        base["classifier"] = Classifier(np.zeros(4, np.float32), 0.0)
    if kw.pop("langid", False):
        base["langid"] = object()
    return QualityStage(**{**base, **kw})


def test_a_score_equal_to_its_threshold_is_kept():
    """`min_zh_prob = 1.0` must keep the documents that are Chinese by script
    (P = 1.0); likewise a classifier score equal to quality_threshold and a perplexity on either
    edge of its band."""
    from mspretrain.prepare.scoring import REASONS, RECORD

    r = np.zeros(4, dtype=RECORD)
    r["zh"] = [1.0, 0.999, 1.0, 1.0]
    r["ppl"] = [50.0, 50.0, 10.0, 100.0]
    r["quality"] = [0.7, 0.7, 0.7, 0.7]
    s = _stage(langid=True, min_zh=1.0, lm=True, ppl_min=10.0, ppl_max=100.0, clf=True, threshold=0.7)
    assert s.decide(r).tolist() == [0, REASONS.index("language"), 0, 0]
    assert s.before_quality(r).tolist() == [True, False, True, True] and s.in_band(r).all()


def _source(tmp_path: Path, ppl: list[float], quality: list[float]):
    from mspretrain.prepare.scoring import RECORD, ScoreSource, ScoreWriter

    r = np.zeros(len(ppl), dtype=RECORD)
    r["offset"] = np.arange(len(ppl))
    r["zh"], r["ppl"], r["quality"] = np.nan, ppl, quality
    w = ScoreWriter(tmp_path / "s.scores")
    w.add(r)
    w.flush()
    w.close()
    return ScoreSource(str(tmp_path / "s.scores"))


def test_fraction_edges_when_the_product_is_whole(tmp_path):
    """`ppl_quantiles` lower edge when lo·n is whole: the floor(lo n)+1-th
    smallest (ceil would give the lo n-th, keeping one more); the top fraction's ceil(f m)-th
    largest when f m is whole."""
    from mspretrain.prepare import rescore

    ppl = [float(v) for v in range(10, 110, 10)]  # 10 documents: 10, 20, ..., 100
    q = [0.05 * k for k in range(10)]
    s = rescore.resolve(_stage(lm=True, ppl_quantiles=(0.2, 0.8)), _source(tmp_path, ppl, q))
    assert (s.ppl_min, s.ppl_max) == (30.0, 80.0)  # floor(2)+1 = 3rd smallest; ceil(8) = 8th smallest
    t = rescore.resolve(_stage(clf=True, top_fraction=0.5), _source(tmp_path, ppl, q))
    assert t.threshold == np.float32(0.05 * 5)  # ceil(5) = 5th largest of 0, .05, ..., .45


def test_the_feature_hashing_is_pinned_by_golden_values():
    """A changed feature hash scored an old model file differently and was
    accepted. These values were computed by the code that wrote the shipped model format (FORMAT 1)."""
    from mspretrain.prepare import quality

    texts = ["春眠不觉晓，处处闻啼鸟。", "The quick brown fox 123", "夜来风雨声"]
    ids, _, _ = quality.features(texts)
    assert ids.size == 111 and ids[:6].tolist() == [558738, 119560, 399553, 20618, 760282, 144319]
    assert hashlib.sha256(np.sort(ids).astype("<i8").tobytes()).hexdigest()[:16] == "3ebe4bdece397fa1"
    w = ((np.arange(1 << 20) * 2654435761) % 1000 / 1000.0 - 0.5).astype(np.float32)
    assert np.allclose(quality.Classifier(w, 0.25).score(texts), [0.541638195514679, 0.5699436664581299, 0.572648823261261], rtol=0, atol=1e-7)
    counts, total, _ = quality.train_lm(["春眠不觉晓处处闻啼鸟夜来风雨声花落知多少"])
    ppl = quality.CharLM(counts, total).perplexity(["春眠不觉晓", "花落知多少风雨"])
    assert np.allclose(ppl, [3.9259393215179443, 6.7586565017700195], rtol=0, atol=1e-5)


def test_a_score_record_offset_past_4_gib_is_written_and_read_back(tmp_path):
    """The record's byte offset in 32 bits went untested. Offsets of 2^32 and
    beyond go through `scoring.apply`, the sidecar and the source lookup unchanged."""
    from mspretrain.data.origin import RECORD as ORIGIN
    from mspretrain.prepare import scoring

    texts = ["春眠不觉晓", "处处闻啼鸟", "夜来风雨声"]
    origin = np.zeros(3, dtype=ORIGIN)
    origin["file"] = 1
    origin["offset"] = [2 ** 32 - 1, 2 ** 32 + 7, 2 ** 40 + 3]
    keys = b"".join(hashlib.blake2b(t.encode(), digest_size=16).digest() for t in texts)
    _, _, rec, _ = scoring.apply(_stage(lm=True), texts, origin, {}, keys)
    w = scoring.ScoreWriter(tmp_path / "q.scores")
    w.add(rec)
    w.flush()
    w.close()
    back = scoring.read_scores(tmp_path / "q.scores")
    assert back["offset"].tolist() == [2 ** 32 - 1, 2 ** 32 + 7, 2 ** 40 + 3]
    src = scoring.ScoreSource(str(tmp_path / "q.scores"))
    assert src.between((1, 2 ** 32), (1, 2 ** 41))["offset"].tolist() == [2 ** 32 + 7, 2 ** 40 + 3]
    got = scoring.lookup(src, origin, np.frombuffer(keys, dtype="<u8")[0::2], None)
    assert got["offset"].tolist() == origin["offset"].tolist()


def test_a_same_size_input_rewritten_with_a_new_mtime_is_not_resumed(corpus, tmp_path):
    """Prepare resume's fingerprint must see a same-size rewrite (its mtime)."""
    from mspretrain.config.schema import PrepareConfig
    from mspretrain.errors import UserError
    from mspretrain.prepare import resume

    f = tmp_path / "a.txt"
    f.write_bytes(corpus.read_bytes())
    cfg = PrepareConfig(doc_per_line=True)
    fp = resume.fingerprint([str(f)], [f], ["a.txt"], cfg, None, None)
    j = resume.Journal(tmp_path / "data")
    assert j.open(fp) == "fresh"
    data = f.read_bytes()
    f.write_bytes(data[::-1][: len(data)])  # other bytes, the same size
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    fp2 = resume.fingerprint([str(f)], [f], ["a.txt"], cfg, None, None)
    assert fp2["files"][0]["size"] == fp["files"][0]["size"]
    assert resume.difference(fp, fp2) == "input file a.txt changed (modification time)"
    with pytest.raises(UserError, match="modification time"):
        resume.Journal(tmp_path / "data").open(fp2)


@pytest.mark.sigkill
def test_a_special_file_planted_in_a_killed_runs_work_dir_is_refused(tmp_path):
    """The journal's class, one level down: a FIFO (or a link to /dev/zero) in place of a work
    file of a killed run would hang the resume or read without end; refused in one line, nothing
    touched."""
    from tests.helpers.prepare import make_corpus, prepare_subprocess

    raw = make_corpus(tmp_path / "raw")
    out = tmp_path / "data"
    killed = prepare_subprocess(raw, out, env={"MSPRETRAIN_PREPARE_TEST_KILL": "pass1 chunk 2", "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    spool = tmp_path / ".data.partial" / "pass1.tmp"
    assert spool.is_file()
    spool.unlink()
    os.mkfifo(spool)
    (tmp_path / ".data.lock").unlink()  # the kill left its lock file (held by no one: taken over by the next run)
    before = tree(tmp_path)
    again = prepare_subprocess(raw, out)
    assert_refusal(again.returncode, again.stderr, "FIFO")
    assert tree(tmp_path) == before


def test_a_users_empty_dot_partial_dir_is_never_removed(corpus, tmp_path, capsys):
    """`.NAME.partial` is prepare's only with its mark inside (it is made under another name and
    renamed with it): a user's dir of that name, even empty, is refused and kept."""
    (tmp_path / ".data.partial").mkdir()
    before = tree(tmp_path)
    refused(capsys, "prepare", corpus, "--out", tmp_path / "data", *PREP, needle=".data.partial")
    assert tree(tmp_path) == before


@pytest.mark.sigkill
def test_a_state_file_changed_after_the_kill_is_never_unpickled(tmp_path):
    """A stage's state (a pickle in the work dir) is unpickled only when its SHA-256 is the one the
    journal's commit recorded: one changed after the kill is refused in one line."""
    from tests.helpers.prepare import make_corpus, prepare_subprocess

    raw = make_corpus(tmp_path / "raw")
    out = tmp_path / "data"
    killed = prepare_subprocess(raw, out, env={"MSPRETRAIN_PREPARE_TEST_KILL": "trained", "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    state = tmp_path / ".data.partial" / ".resume" / "state-train.pkl"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 1
    state.write_bytes(bytes(data))
    (tmp_path / ".data.lock").unlink()
    again = prepare_subprocess(raw, out)
    assert_refusal(again.returncode, again.stderr, "SHA-256")
    assert not out.exists()


def test_a_corpus_jsonl_line_nested_past_the_stack_is_a_broken_record(tmp_path, capsys):
    """Deep JSON in a corpus .jsonl (not only in the journal, a manifest or an eval set) was a
    RecursionError traceback from a worker, in prepare and in quality lm: it is a broken record,
    counted, and the rest is read."""
    f = tmp_path / "deep.jsonl"
    poems = make_poems(40, seed=14)
    f.write_text("\n".join([json.dumps({"text": p}, ensure_ascii=False) for p in poems[:20]] + ["[" * 200_000 + "]" * 200_000]
                           + [json.dumps({"text": p}, ensure_ascii=False) for p in poems[20:]]) + "\n", encoding="utf-8")
    code, _, err = cli(capsys, "prepare", f, "--out", tmp_path / "d", "--vocab-size", "600", "--workers", "1", "--quiet")
    assert code == 0, err
    m = json.loads((tmp_path / "d" / "manifest.json").read_text(encoding="utf-8"))
    assert m["input_files"][0]["jsonl_broken"] == 1 and m["documents_in"] == 40
    code, _, err = cli(capsys, "quality", "lm", f, "--out", tmp_path / "lm.npz", "--quiet")
    assert code == 0, err


def test_filters_that_drop_every_document_are_named_as_the_cause(tmp_path, capsys):
    """A model that dropped everything ended the run with "check the inputs";
    the refusal now names the filter and the setting to relax."""
    rng = np.random.default_rng(5)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "far", "away"]
    f = tmp_path / "en.txt"
    f.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(60)) + "\n", encoding="utf-8")
    before = tree(tmp_path)
    err = refused(capsys, "prepare", f, "--out", tmp_path / "d", *PREP, "prepare.min_zh_prob=0.9", needle="language filter")
    assert "prepare.min_zh_prob" in err and "check the inputs" not in err
    assert tree(tmp_path) == before


def test_a_leftover_old_dir_is_not_put_back_over_a_data_dir_the_user_removed(published, corpus, tmp_path, capsys):
    """`.data.old` of ours (marked) left by a kill after the swap, and `data` removed by the user:
    no journal says a swap was under way, so the old dir is not resurrected; the new prepare
    publishes and removes it."""
    import shutil

    from mspretrain.prepare.publish import OLD_MARK

    shutil.copytree(published, tmp_path / ".data.old")
    (tmp_path / ".data.old" / OLD_MARK).write_bytes(b"")
    code, _, err = cli(capsys, "prepare", corpus, "--out", tmp_path / "data", *PREP, "prepare.valid_fraction=0.2")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["split"]["valid_fraction"] == 0.2


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_the_cache_dirs_character_table_is_read_with_the_guards(tmp_path, monkeypatch, kind):
    """The character table cached under $MSPRETRAIN_CACHE was
    read without the special-file and size guards: a FIFO there hung prepare, a link to /dev/zero
    grew without end. Now it is built instead, and the entry is left as it is."""
    from mspretrain.prepare import clean

    monkeypatch.setenv("MSPRETRAIN_CACHE", str(tmp_path))
    want = clean._cached_table(clean.build_char_table)  # writes the cache file
    (cached,) = tmp_path.glob("char_table-*.bin")
    cached.unlink()
    if kind == "fifo":
        os.mkfifo(cached)
    else:
        cached.symlink_to("/dev/zero")
    t0 = time.monotonic()
    assert np.array_equal(clean._cached_table(clean.build_char_table), want)
    assert time.monotonic() - t0 < 30
    assert cached.is_fifo() if kind == "fifo" else os.readlink(cached) == "/dev/zero"
