"""Model-based quality filtering and decontamination in `prepare`: the classifier from
`mspretrain quality train` drops planted junk, the sidecar keeps every score, a decontaminated
prepare leaves no 13-gram of the eval set in the shards (checked by decoding the shards and
scanning them here, with code of this file's own), kill -9 during scoring resumes byte for byte,
the path through the main process (`--ray`'s) writes the same bytes, and bad models, empty label
sets and thresholds out of range are refused in one line. Re-thresholding from a data dir's scores
(`--scores-from`) and keeping a fraction (a scan first) score nothing twice and write the bytes of
a fresh prepare; word features (jieba) train and score like character n-grams."""
from __future__ import annotations

import csv
import json
import shutil
import signal
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from mspretrain.cli import main
from tests.conftest import make_poems
from tests.helpers.prepare import chosen, files_of, killed_then_rerun, points_of
from tests.helpers.prepare import prepare_subprocess as run
from tests.helpers.ray import ray_cluster
from tests.prepare.junk import KINDS, held_in, junk, mixed

cluster = ray_cluster  # the fixture: a 2-node Ray cluster on 127.0.0.1, started once for this module


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
    from mspretrain.prepare.scoring import REASONS, read_scores

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
    from mspretrain.prepare.inspect import inspect

    text = inspect(tmp_path / "out")
    assert "documents scored (quality.scores)" in text and "quality_threshold=0.9" in text and "e.g." in text


def test_language_and_perplexity_filters_drop_by_their_own_scores(models, tmp_path):
    """Each filter's drops are exactly its score against its threshold (the first reason that
    applies, in the order contaminated, language, perplexity, quality), the foreign kind goes to
    the language filter, and poems sit inside the perplexity band."""
    from mspretrain.prepare.scoring import REASONS, read_scores

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
    from mspretrain.prepare.quality import LangID

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
    from mspretrain.prepare.inspect import inspect

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
    from mspretrain.prepare import quality

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
    assert "positive label set is empty" in refused(["quality", "train", "--positive", str(empty), "--negative", str(models["neg"]),
                                                     "--doc-per-line", "--out", str(tmp_path / "m.npz")], capsys)
    assert "reference set is empty" in refused(["quality", "lm", str(empty), "--doc-per-line", "--out", str(tmp_path / "m.npz")], capsys)
    assert not (tmp_path / "m.npz").exists()


def test_training_is_deterministic(models, tmp_path):
    assert main(["quality", "train", "--positive", str(models["pos"]), "--negative", str(models["neg"]), "--doc-per-line",
                 "--out", str(tmp_path / "again.npz"), "--quiet"]) == 0
    assert (tmp_path / "again.npz").read_bytes() == models["clf"].read_bytes()


@pytest.mark.slow
def test_ray_run_with_every_filter_is_byte_identical_to_the_local_run(cluster, models, raw, tmp_path):
    """A real two-node Ray cluster (tests/prepare/test_prepare_ray.py's): the models go to the node by
    content (py3langid's from the node's own install), and the data dir, sidecar included, is the
    local run's byte for byte."""
    from tests.helpers.ray import run_local, run_prepare, same_files

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

    from mspretrain.prepare import pipeline, pool

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


# ----------------------------------------------------------------------------- re-thresholding and keeping by fraction

@pytest.fixture()
def no_scoring(monkeypatch):
    """Every scorer raises: a prepare that still passes scored nothing."""
    from mspretrain.prepare.decontam import EvalNgrams
    from mspretrain.prepare.quality import CharLM, Classifier, LangID

    def boom(*_a, **_k):
        raise AssertionError("a scorer was called")

    for cls, name in ((Classifier, "score"), (CharLM, "perplexity"), (LangID, "zh_prob"), (EvalNgrams, "hits")):
        monkeypatch.setattr(cls, name, boom)
    return monkeypatch


def prepare_dir(raw: Path, out: Path, *extra: str) -> dict[str, bytes]:
    assert main(["prepare", str(raw), "--out", str(out), "--doc-per-line", "--vocab-size", "400", "--workers", "1", "--quiet",
                 "prepare.valid_fraction=0.05", *extra]) == 0
    return files_of(out)


@pytest.fixture(scope="module")
def scored(models, raw, tmp_path_factory) -> Path:
    """A data dir of `raw` with every filter on, its thresholds loose: the scores to re-threshold."""
    out = tmp_path_factory.mktemp("scored") / "data"
    prepare_dir(raw, out, *filters(models))
    return out


def test_rethresholding_from_the_sidecar_scores_nothing_and_equals_a_fresh_prepare(models, raw, scored, tmp_path, no_scoring):
    strict = [f"prepare.quality_model={models['clf']}", "prepare.quality_threshold=0.8", f"prepare.lm_model={models['lm']}",
              "prepare.ppl_max=150", "prepare.min_zh_prob=0.6"]
    alone = [f"prepare.quality_model={models['clf']}", "prepare.quality_threshold=0.3"]  # the other filters off: their scores cleared
    got = {name: prepare_dir(raw, tmp_path / name, "--scores-from", str(scored), *args) for name, args in (("strict", strict), ("alone", alone))}
    no_scoring.undo()
    for name, args in (("strict", strict), ("alone", alone)):
        want = prepare_dir(raw, tmp_path / f"fresh-{name}", *args)
        assert got[name] == want, name
    old = json.loads((scored / "manifest.json").read_text())["dropped"]
    new = json.loads(got["strict"]["manifest.json"])["dropped"]
    assert sum(new.get(k, 0) for k in ("language", "perplexity", "quality")) > sum(old.get(k, 0) for k in ("language", "perplexity", "quality"))


def test_a_source_that_does_not_fit_is_refused_in_one_line(models, raw, scored, tmp_path, capsys):
    base = ["prepare", str(raw), "--out", str(tmp_path / "out"), "--doc-per-line", "--workers", "1", "--scores-from", str(scored)]
    clf = [f"prepare.quality_model={models['clf']}"]
    other = tmp_path / "other.npz"
    from mspretrain.prepare import quality

    quality.save_classifier(other, np.zeros(1 << quality.CLASSIFIER_BITS, dtype=np.float32), 0.0, {})
    assert "another model" in refused(base + [f"prepare.quality_model={other}"], capsys)
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"context": "春风又绿江南岸，明月何时照我还。", "choices": ["甲", "乙"], "label": 0}, ensure_ascii=False) + "\n",
                     encoding="utf-8")
    assert "holds no decontamination" in refused(base + clf + [f"prepare.decontam={json.dumps([str(evals)])}"], capsys)
    assert "no quality filter is on" in refused(base, capsys)
    assert "no quality.scores" in refused(base[:-1] + [str(tmp_path)] + clf, capsys)
    assert "cleaned by other rules" in refused(base + clf + ["prepare.min_chars=3"], capsys)
    # the same file names, other text: found out document by document
    changed = tmp_path / "raw"
    shutil.copytree(raw, changed)
    p = changed / "p1.txt"
    p.write_text(p.read_text(encoding="utf-8").replace("第", "弟", 3), encoding="utf-8")
    assert "hold no record of the document" in refused(["prepare", str(changed)] + base[2:] + clf, capsys)
    # raised in a pool worker: its hint survives the trip back (`ScoresMissing.__reduce__`)
    two = ["prepare", str(changed)] + [a if a != "1" else "2" for a in base[2:]] + clf
    assert "hint: run prepare without --scores-from" in refused(two, capsys)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def kth(v: np.ndarray, k: int, largest: bool) -> float:
    return float(np.sort(v)[::-1][k - 1] if largest else np.sort(v)[k - 1])


def test_keeping_a_fraction_follows_the_stated_rule_and_needs_no_second_scoring(models, raw, scored, tmp_path, no_scoring):
    """`quality_top_fraction` and `ppl_quantiles`, checked against this test's own sort of the
    scores: the band between the floor(lo n)+1-th and the ceil(hi n)-th smallest perplexity of the
    documents the language filter keeps, then the ceil(f m)-th largest classifier score of those
    left, ties kept. From another dir's scores: the bytes of the run that scored (a scan) itself."""
    import math

    from mspretrain.prepare.scoring import REASONS, read_scores

    args = [f"prepare.quality_model={models['clf']}", "prepare.quality_top_fraction=0.6", f"prepare.lm_model={models['lm']}",
            "prepare.ppl_quantiles=[0.1, 0.9]", "prepare.min_zh_prob=0.5"]
    from_dir = prepare_dir(raw, tmp_path / "from", "--scores-from", str(scored), *args)
    no_scoring.undo()
    scanned = prepare_dir(raw, tmp_path / "scan", *args)
    assert from_dir == scanned
    r = np.array(read_scores(tmp_path / "scan" / "quality.scores"))
    lang = r["zh"] >= 0.5
    n = int(lang.sum())
    lo, hi = kth(r["ppl"][lang], math.floor(0.1 * n) + 1, False), kth(r["ppl"][lang], math.ceil(0.9 * n), False)
    band = lang & (r["ppl"] >= lo) & (r["ppl"] <= hi)
    m = int(band.sum())
    t = kth(r["quality"][band], math.ceil(0.6 * m), True)
    m_json = json.loads(scanned["manifest.json"])["quality"]
    assert m_json["perplexity"]["min"] == lo and m_json["perplexity"]["max"] == hi
    assert m_json["classifier"]["threshold"] == t and m_json["classifier"]["top_fraction"] == 0.6
    want = np.where(~lang, REASONS.index("language"), np.where(~band, REASONS.index("perplexity"),
                    np.where(r["quality"] < t, REASONS.index("quality"), 0)))
    assert np.array_equal(r["reason"], want)
    k = math.ceil(0.6 * m)  # at least k kept, and fewer than k strictly better than the last one kept (ties at it all kept)
    assert int((r["reason"] == 0).sum()) >= k and int((band & (r["quality"] > t)).sum()) < k


@pytest.mark.sigkill
def test_kill_during_the_scan_resumes_byte_identical(models, raw, tmp_path):
    args = [*filters(models), "prepare.quality_top_fraction=0.7"]
    ref = run(raw, tmp_path / "ref", *args, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert ref.returncode == 0, ref.stderr
    at = chosen(points_of(ref), "scan")
    again = killed_then_rerun(raw, tmp_path / "data", at, *args)
    assert "scan 1" not in again  # resumed after its last commit
    assert files_of(tmp_path / "data") == files_of(tmp_path / "ref")
    through = run(raw, tmp_path / "through", *args, through_main=True)  # `--ray`'s path: the records go with the work items
    assert through.returncode == 0, through.stderr
    assert files_of(tmp_path / "through") == files_of(tmp_path / "ref")


def test_prepare_counts_the_perplexity_model_from_named_reference_files(models, raw, tmp_path, capsys):
    """`prepare.lm_reference`: the model `quality lm` writes for the same files (byte for byte),
    shipped in the data dir as lm.npz and named there by the manifest, scoring as that model does."""
    ref = [f"prepare.lm_reference={json.dumps([str(models['pos'])])}", "prepare.ppl_quantiles=[0, 0.6]"]
    got = prepare_dir(raw, tmp_path / "ref", *ref)
    want = prepare_dir(raw, tmp_path / "model", f"prepare.lm_model={models['lm']}", "prepare.ppl_quantiles=[0, 0.6]")
    assert got["lm.npz"] == models["lm"].read_bytes()
    for name in ("quality.scores", "train.bin", "valid.bin"):
        assert got[name] == want[name], name
    m = json.loads(got["manifest.json"])
    assert m["quality"]["perplexity"]["model"] == "lm.npz" and "lm.npz" in m["outputs"]
    assert m["quality"]["perplexity"]["sha256"] == json.loads(want["manifest.json"])["quality"]["perplexity"]["sha256"]
    base = ["prepare", str(raw), "--out", str(tmp_path / "out"), "--doc-per-line", "--workers", "1"]
    assert "both given" in refused(base + [f"prepare.lm_model={models['lm']}", ref[0]], capsys)
    # --overwrite of a data dir prepared without a quality filter, holding a file of the user's named like an output
    mine = tmp_path / "model" / "lm.npz"
    mine.write_bytes(b"mine")
    assert "which no earlier prepare wrote" in refused(["prepare", str(raw), "--out", str(tmp_path / "model"), "--doc-per-line",
                                                        "--overwrite", "--workers", "1", ref[0]], capsys)
    assert mine.read_bytes() == b"mine"
    assert "does not exist" in refused(base + ['prepare.lm_reference=["nowhere.txt"]'], capsys)


@pytest.mark.sigkill
def test_kill_during_a_rethreshold_resumes_byte_identical(models, raw, scored, tmp_path):
    """Pass 1 looking its scores up in another dir's sidecar (local workers map the file), killed
    in its middle: the rerun writes the uninterrupted run's bytes."""
    args = ["--scores-from", str(scored), f"prepare.quality_model={models['clf']}", "prepare.quality_threshold=0.7",
            f"prepare.lm_model={models['lm']}", "prepare.ppl_quantiles=[0.05, 0.95]"]
    ref = run(raw, tmp_path / "ref", *args, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert ref.returncode == 0, ref.stderr
    killed_then_rerun(raw, tmp_path / "data", chosen(points_of(ref), "pass1 chunk"), *args)
    assert files_of(tmp_path / "data") == files_of(tmp_path / "ref")


def test_fraction_values_out_of_range_are_refused_in_one_line(models, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(lines(make_poems(20)), encoding="utf-8")
    base = ["prepare", str(corpus), "--out", str(tmp_path / "out"), "--doc-per-line", "--workers", "1", f"prepare.quality_model={models['clf']}"]
    for bad in ("1.5", "-0.1"):
        assert "outside (0, 1]" in refused(base + [f"prepare.quality_top_fraction={bad}"], capsys)
    assert "both given" in refused(base + ["prepare.quality_top_fraction=0.3", "prepare.quality_threshold=0.7"], capsys)
    lm = [f"prepare.lm_model={models['lm']}"]
    for bad in ("[0.5]", "[0.6, 0.2]", "[0, 1]", "[-0.1, 0.5]", "[0.1, 1.5]"):
        assert "is not [lo, hi]" in refused(base + lm + [f"prepare.ppl_quantiles={bad}"], capsys)
    assert "both given" in refused(base + lm + ["prepare.ppl_quantiles=[0, 0.5]", "prepare.ppl_max=100"], capsys)
    assert "lm_model is not" in refused(base + ["prepare.ppl_quantiles=[0, 0.5]"], capsys)
    assert not (tmp_path / "out").exists()


def test_word_features_train_score_and_drop_planted_junk(models, tmp_path):
    """`quality train --features words` (jieba word 1-2-grams): the model file says so, prepare
    scores with the model's own features, and it drops the planted junk (less precisely than
    character n-grams on this corpus)."""
    from mspretrain.prepare.quality import Classifier
    from mspretrain.prepare.scoring import read_scores
    from mspretrain.prepare.words import word_hashes

    _, doc = word_hashes(["春风又绿江南岸", "明月何时照我还"])
    assert doc.tolist().count(0) >= 2  # cut into words, not one string per text
    out = tmp_path / "words.npz"
    assert main(["quality", "train", "--positive", str(models["pos"]), "--negative", str(models["neg"]), "--doc-per-line",
                 "--features", "words", "--out", str(out), "--quiet"]) == 0
    clf = Classifier.load(out)
    assert clf.features == "words" and Classifier.load(models["clf"]).features == "chars"
    docs, bad = mixed(held_in(800, 22)[0][:400], 25, 22)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(docs) + "\n", encoding="utf-8")
    prepare_in_process(corpus, tmp_path / "out", f"prepare.quality_model={out}")
    r = read_scores(tmp_path / "out" / "quality.scores")
    line = np.searchsorted(line_starts(corpus), r["offset"])
    from mspretrain.config.schema import PrepareConfig
    from mspretrain.prepare.clean import Cleaner

    cleaned = [t for t in Cleaner(PrepareConfig()).clean_many(docs) if t is not None]
    assert np.array_equal(r["quality"], clf.score(cleaned))  # the model's own scores of the cleaned documents
    dropped = r["quality"] < 0.5
    tp = int((dropped & bad[line]).sum())
    precision, recall = tp / max(int(dropped.sum()), 1), tp / int(bad[line].sum())
    # a working model, not the bar: jieba's dictionary cuts these made-up poems into odd words
    # (measured 0.865 / 0.958 here, where character n-grams pass 0.9 / 0.9; docs/benchmarks.md)
    assert precision >= 0.8 and recall >= 0.9, (precision, recall)


@pytest.mark.slow
def test_ray_keeps_a_fraction_and_rethresholds_byte_identical(cluster, models, raw, tmp_path):
    """On the two-node cluster: the scan before pass 1 as Ray tasks, and `--scores-from`, whose
    records then travel with each work item (`rescore.attach`), write the local run's bytes."""
    from tests.helpers.ray import run_local, run_prepare, same_files

    common = ["--doc-per-line", "--vocab-size", "400", f"prepare.quality_model={models['clf']}", f"prepare.lm_model={models['lm']}"]
    frac = [*common, "prepare.quality_top_fraction=0.7", "prepare.ppl_quantiles=[0, 0.9]"]
    run_local(raw, tmp_path / "local", *frac)
    run_local(raw, tmp_path / "loose", *common, "prepare.quality_threshold=0.1")  # the scores to re-threshold
    run_prepare(raw, tmp_path / "ray", *frac, "--ray", cluster)
    same_files(tmp_path / "local", tmp_path / "ray")
    run_prepare(raw, tmp_path / "ray-from", *frac, "--scores-from", str(tmp_path / "loose"), "--ray", cluster)
    same_files(tmp_path / "local", tmp_path / "ray-from")
