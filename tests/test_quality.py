"""Model-based quality filtering and decontamination in `prepare` (issue 39): the classifier from
`mspretrain quality train` drops planted junk, the sidecar keeps every score, a decontaminated
prepare leaves no 13-gram of the eval set in the shards (checked by decoding the shards and
scanning them here, with code of this file's own), kill -9 during scoring resumes byte for byte,
the path through the main process (`--ray`'s) writes the same bytes, and bad models, empty label
sets and thresholds out of range are refused in one line."""
from __future__ import annotations

import csv
import json
import signal
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from mspretrain.cli import main
from tests import test_prepare_ray
from tests.conftest import make_poems
from tests.junk import KINDS, held_in, junk, mixed
from tests.test_prepare_resume import chosen, files_of, points_of, run

cluster = test_prepare_ray.cluster  # the fixture: a 2-node Ray cluster on 127.0.0.1, started once for this module


def lines(docs: list[str]) -> str:
    return "\n".join(d.replace("\n", "，") for d in docs) + "\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A classifier trained on poems (positive) and planted junk (negative), documents other than
    the corpora's below (junk of another seed, poems held-in: other poems of the same seed), and a
    character LM of the poems."""
    d = tmp_path_factory.mktemp("models")
    (d / "pos.txt").write_text(lines(held_in(800, 22)[1]), encoding="utf-8")  # held-in: other poems of the corpora's seed
    (d / "neg.txt").write_text(lines([t for k in KINDS for t in junk(k, 100, 21)]), encoding="utf-8")
    assert main(["quality", "train", "--positive", str(d / "pos.txt"), "--negative", str(d / "neg.txt"), "--doc-per-line",
                 "--out", str(d / "clf.npz"), "--quiet"]) == 0
    assert main(["quality", "lm", str(d / "pos.txt"), "--doc-per-line", "--out", str(d / "lm.npz"), "--quiet"]) == 0
    return {"clf": d / "clf.npz", "lm": d / "lm.npz", "pos": d / "pos.txt", "neg": d / "neg.txt"}


def prepare_in_process(corpus: Path, out: Path, *extra: str) -> dict:
    assert main(["prepare", str(corpus), "--out", str(out), "--doc-per-line", "--vocab-size", "400", "--workers", "1", "--quiet",
                 "prepare.valid_fraction=0.05", *extra]) == 0
    return json.loads((out / "manifest.json").read_text(encoding="utf-8"))


def line_starts(path: Path) -> np.ndarray:
    data = path.read_bytes()
    return np.r_[0, np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)[:-1] + 1]


def test_classifier_drops_planted_junk_and_keeps_its_scores(models, tmp_path):
    from mspretrain.data.scoring import REASONS, read_scores

    docs, bad = mixed(held_in(800, 22)[0][:400], 25, 22)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(docs) + "\n", encoding="utf-8")
    m = prepare_in_process(corpus, tmp_path / "out", f"prepare.quality_model={models['clf']}")
    sha = models["clf"].with_name("clf.npz.sha256").read_text().split()[0]
    assert m["quality"]["classifier"] == {"model": str(models["clf"]), "sha256": sha, "threshold": 0.5}
    assert "quality.scores" in m["outputs"]
    r = read_scores(tmp_path / "out" / "quality.scores")
    # every document the rules kept is scored, in input order, by its origin (the line it starts)
    line = np.searchsorted(line_starts(corpus), r["offset"])
    assert np.all(np.diff(line) > 0) and r.size >= 0.95 * len(docs)
    dropped = r["reason"] == REASONS.index("quality")
    assert m["dropped"]["quality"] == int(dropped.sum())
    assert np.array_equal(dropped, r["quality"] < 0.5)
    tp = int((dropped & bad[line]).sum())
    precision, recall = tp / max(int(dropped.sum()), 1), tp / int(bad[line].sum())
    assert precision >= 0.9 and recall >= 0.9, (precision, recall)
    assert m["documents"]["train"] + m["documents"]["valid"] == int((~dropped).sum())
    # prepare --inspect shows the distribution and what other thresholds drop
    from mspretrain.data.inspect import inspect

    text = inspect(tmp_path / "out")
    assert "documents scored (quality.scores)" in text and "quality_threshold=0.9" in text and "e.g." in text


def test_language_and_perplexity_filters_drop_by_their_own_scores(models, tmp_path):
    """Each filter's drops are exactly its score against its threshold (the first reason that
    applies, in the order contaminated, language, perplexity, quality), the foreign kind goes to
    the language filter, and poems sit inside the perplexity band."""
    from mspretrain.data.scoring import REASONS, read_scores

    docs, _ = mixed(held_in(800, 22)[0][:300], 20, 24)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(docs) + "\n", encoding="utf-8")
    m = prepare_in_process(corpus, tmp_path / "out", f"prepare.lm_model={models['lm']}", "prepare.ppl_max=100", "prepare.min_zh_prob=0.5")
    r = read_scores(tmp_path / "out" / "quality.scores")
    k = np.array(docs, dtype=object)[np.searchsorted(line_starts(corpus), r["offset"])]
    lang, ppl = r["reason"] == REASONS.index("language"), r["reason"] == REASONS.index("perplexity")
    assert np.array_equal(lang, r["zh"] < 0.5) and np.array_equal(ppl, ~lang & (r["ppl"] > 100))
    assert np.isnan(r["quality"]).all() and (r["hits"] == 0).all()  # the filters that are off
    foreign = set(junk("foreign", 20, 24))
    assert {d for d in k[lang]} <= foreign and lang.sum() >= 18
    poems = np.array([d.startswith("第") and "首，" in d for d in k])
    salad = set(junk("salad", 20, 24))
    is_salad = np.array([d in salad for d in k])
    assert (r["ppl"][poems & ~is_salad] < 100).all() and (ppl | lang)[~poems].all()
    assert m["dropped"]["language"] == int(lang.sum()) and m["dropped"]["perplexity"] == int(ppl.sum())
    assert m["quality"]["perplexity"]["max"] == 100 and m["quality"]["language"]["model"] == "py3langid 0.2.2"


def test_language_id_decides_mostly_han_text_by_script():
    from mspretrain.data.quality import LangID

    texts = ["春风又绿江南岸，明月何时照我还。", "東京の春は桜がきれいです。", "서울의 봄은 아름답습니다", "The quick brown fox.",
             "第12首，水山花。"]
    lid = LangID()
    assert lid.by_script(texts).tolist() == [True, False, False, False, True]
    p = lid.zh_prob(texts)
    assert p[0] == p[4] == 1.0 and (p[1:4] < 0.5).all()


def norm13(text: str) -> set[str]:
    """This test's own normalisation and 13-grams (as strings): NFKC, lower case, letters and
    digits only."""
    t = "".join(c for c in unicodedata.normalize("NFKC", text).lower() if c.isalnum())
    return {t[i: i + 13] for i in range(len(t) - 12)}


def test_decontaminated_prepare_leaves_no_eval_13gram_in_the_shards(tmp_path):
    from mspretrain.data.shards import IndexedDataset
    from mspretrain.data.tokenizer import Tokenizer

    poems = [p.replace("\n", "，") for p in make_poems(600, seed=23)]
    questions = [f"以下哪一句与“{poems[i][6:30]}”出自同一首诗？" for i in range(0, 40, 4)]
    with open(tmp_path / "ceval_val.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "question", "A", "B", "C", "D", "answer"])
        for i, q in enumerate(questions):
            w.writerow([i, q, "春风又绿江南岸明月何时照我还", "乙", "丙", "丁", "A"])
    # planted copies: verbatim, spaced out, full-width punctuation, inside longer text, and an option
    planted = [questions[0], " ".join(questions[1]), questions[2].replace("，", ",").replace("？", "?"),
               "前言：" + questions[3] + "后记说完了。", "答案是春风又绿江南岸，明月何时照我还。"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(lines(poems[40:] + planted), encoding="utf-8")
    evals = json.dumps([str(tmp_path / "ceval_val.csv")])
    m = prepare_in_process(corpus, tmp_path / "clean", f"prepare.decontam={evals}")
    control = prepare_in_process(corpus, tmp_path / "control")
    assert m["dropped"]["contaminated"] == len(planted) and "contaminated" not in control["dropped"]
    eval_grams: set[str] = set()
    with open(tmp_path / "ceval_val.csv", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            eval_grams |= norm13("\n".join(row[k] for k in ("question", "A", "B", "C", "D")))

    def shard_grams(d: Path) -> set[str]:
        tok = Tokenizer.load(d)
        found: set[str] = set()
        for split in ("train", "valid"):
            ds = IndexedDataset(d / split)
            for i in range(len(ds)):
                found |= norm13(tok.decode(ds[i][:-1].tolist())) & eval_grams
        return found

    assert shard_grams(tmp_path / "control")  # the planted copies are in an undecontaminated prepare
    assert shard_grams(tmp_path / "clean") == set()
    # the dropped documents are listed (sidecar, prepare --inspect)
    from mspretrain.data.inspect import inspect

    assert inspect(tmp_path / "clean").count("  dropped contaminated (") == len(planted)


# ----------------------------------------------------------------------------- resume and the Ray path

@pytest.fixture(scope="module")
def raw(tmp_path_factory, models) -> Path:
    """Several files (a chunk each) of poems mixed with junk."""
    d = tmp_path_factory.mktemp("qraw") / "raw"
    d.mkdir()
    for k in range(4):
        docs, _ = mixed(held_in(800, 22)[0][400 + 100 * k: 500 + 100 * k], 8, 30 + k)
        (d / f"p{k}.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    return d


def filters(models: dict[str, Path]) -> list[str]:
    return [f"prepare.quality_model={models['clf']}", f"prepare.lm_model={models['lm']}", "prepare.ppl_max=1e9",
            "prepare.min_zh_prob=0.2"]


@pytest.mark.sigkill
@pytest.mark.parametrize("stage", ["pass1 chunk", "replay", "encode"])
def test_kill_during_scoring_resumes_byte_identical(models, raw, tmp_path, stage):
    ref = run(raw, tmp_path / "ref", *filters(models), env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert ref.returncode == 0, ref.stderr
    want = files_of(tmp_path / "ref")
    assert "quality.scores" in want and json.loads(want["manifest.json"])["dropped"].get("quality", 0) > 0
    at = chosen(points_of(ref), stage)
    out = tmp_path / "data"
    killed = run(raw, out, *filters(models), env={"MSPRETRAIN_PREPARE_TEST_KILL": at, "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = run(raw, out, *filters(models), workers=1, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert again.returncode == 0, again.stderr
    assert files_of(out) == want
    if stage == "pass1 chunk":  # pass 1 resumed after its last commit, not from the start
        assert "pass1 chunk 1" not in points_of(again)
        # the path through the main process (`--ray`'s) writes the same bytes
        through = run(raw, tmp_path / "through", *filters(models), through_main=True)
        assert through.returncode == 0, through.stderr
        assert files_of(tmp_path / "through") == want


def test_a_changed_model_is_not_resumed(models, raw, tmp_path):
    clf = tmp_path / "clf.npz"
    clf.write_bytes(models["clf"].read_bytes())
    args = [f"prepare.quality_model={clf}"]
    killed = run(raw, tmp_path / "data", *args, env={"MSPRETRAIN_PREPARE_TEST_KILL": "pass1 chunk 2", "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
    assert killed.returncode == -signal.SIGKILL
    # another model under the same name (retrained: its own .sha256 beside it)
    from mspretrain.data import quality

    w = np.zeros(1 << quality.CLASSIFIER_BITS, dtype=np.float32)
    quality.save_classifier(clf, w, 1.0, {})
    again = run(raw, tmp_path / "data", *args)
    assert again.returncode == 2 and "a quality model or eval set" in again.stderr, again.stderr


# ----------------------------------------------------------------------------- one-line refusals

def refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 2, err  # one error line, one hint line
    return err


def test_bad_models_and_thresholds_are_refused_in_one_line_and_nothing_is_written(models, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(lines(make_poems(20)), encoding="utf-8")
    out = tmp_path / "out"
    base = ["prepare", str(corpus), "--out", str(out), "--doc-per-line", "--workers", "1"]
    assert "does not exist" in refused(base + [f"prepare.quality_model={tmp_path / 'none.npz'}"], capsys)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a model")
    assert "corrupt" in refused(base + [f"prepare.quality_model={bad}"], capsys)
    flipped = tmp_path / "flipped.npz"
    data = bytearray(models["clf"].read_bytes())
    data[len(data) // 2] ^= 1
    flipped.write_bytes(bytes(data))
    (tmp_path / "flipped.npz.sha256").write_text(models["clf"].with_name("clf.npz.sha256").read_text())
    assert "corrupt" in refused(base + [f"prepare.quality_model={flipped}"], capsys)
    assert "not a mspretrain-char-lm" in refused(base + [f"prepare.lm_model={models['clf']}", "prepare.ppl_max=100"], capsys)
    assert "outside [0, 1]" in refused(base + [f"prepare.quality_model={models['clf']}", "prepare.quality_threshold=1.5"], capsys)
    assert "outside [0, 1]" in refused(base + ["prepare.min_zh_prob=-0.1"], capsys)
    assert "lm_model is not" in refused(base + ["prepare.ppl_max=100"], capsys)
    assert "does not exist" in refused(base + ['prepare.decontam=["nowhere.csv"]'], capsys)
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    assert "negative label set is empty" in refused(["quality", "train", "--positive", str(models["pos"]), "--negative", str(empty),
                                                     "--doc-per-line", "--out", str(tmp_path / "m.npz")], capsys)
    assert not (tmp_path / "m.npz").exists()


def test_training_is_deterministic(models, tmp_path):
    assert main(["quality", "train", "--positive", str(models["pos"]), "--negative", str(models["neg"]), "--doc-per-line",
                 "--out", str(tmp_path / "again.npz"), "--quiet"]) == 0
    assert (tmp_path / "again.npz").read_bytes() == models["clf"].read_bytes()


@pytest.mark.slow
def test_ray_run_with_every_filter_is_byte_identical_to_the_local_run(cluster, models, raw, tmp_path):
    """A real two-node Ray cluster (tests/test_prepare_ray.py's): the models go to the node by
    content (py3langid's from the node's own install), and the data dir, sidecar included, is the
    local run's byte for byte."""
    from tests.test_prepare_ray import run_local, run_prepare, same_files

    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"context": raw.joinpath("p1.txt").read_text(encoding="utf-8").splitlines()[3], "choices": ["甲", "乙"],
                                 "label": 0}, ensure_ascii=False) + "\n", encoding="utf-8")
    args = ["--doc-per-line", "--vocab-size", "400", *filters(models), f"prepare.decontam={json.dumps([str(evals)])}"]
    run_local(raw, tmp_path / "local", *args)
    m = json.loads((tmp_path / "local" / "manifest.json").read_text())
    assert m["dropped"]["contaminated"] >= 1 and m["dropped"]["quality"] > 0
    run_prepare(raw, tmp_path / "ray", *args, "--ray", cluster)
    same_files(tmp_path / "local", tmp_path / "ray")


def test_a_compressed_file_read_by_a_worker_scores_as_the_plain_file(models, tmp_path, monkeypatch):
    """A .gz file as one work item of several chunks (`workers.spill_unit`): the same sidecar and
    shards as the same text uncompressed."""
    import gzip

    from mspretrain.data import pipeline, pool

    docs, _ = mixed(held_in(800, 22)[0][:400], 25, 25)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "c.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    (tmp_path / "b" / "c.txt.gz").write_bytes(gzip.compress(("\n".join(docs) + "\n").encode()))
    monkeypatch.setattr(pipeline, "UNITS", True)
    monkeypatch.setattr(pool, "UNIT_CHUNK_DOCS", 100)  # several chunks in the unit
    args = ["--doc-per-line", "--vocab-size", "400", "--workers", "2", "--quiet", f"prepare.quality_model={models['clf']}"]
    assert main(["prepare", str(tmp_path / "a" / "c.txt"), "--out", str(tmp_path / "plain"), *args]) == 0
    assert main(["prepare", str(tmp_path / "b" / "c.txt.gz"), "--out", str(tmp_path / "gz"), *args]) == 0
    for name in ("quality.scores", "train.bin", "valid.bin"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "gz" / name).read_bytes(), name
