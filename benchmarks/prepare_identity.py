"""Byte-identity harness for `mspretrain prepare` (issue 40, item 1): runs prepare on small
corpora under many configs and prints one sha256 per output file, so a refactor of the pipeline
can be checked against the hashes recorded before it.

    PYTHONPATH=. python benchmarks/prepare_identity.py --base /tmp/prep-id --out before.json
    PYTHONPATH=. python benchmarks/prepare_identity.py --base /tmp/prep-id --compare before.json

Every file of every data dir is hashed, manifest.json included: the manifest holds no timestamps,
but it names the inputs, the tokenizer and model paths, so `--base` must be the same path for the
two runs compared (the corpora and quality models are written there deterministically; the models
are trained once and reused, their bytes are part of the identity). Nothing is excluded: prepare's
log lines (stdout) are not outputs and are not compared.

The runs: a trained tokenizer with exact + near dedup (the resume tests' corpus, local pieces
path), exact dedup only, a given tokenizer, both again through the main process (`--ray`'s path),
one worker, every quality filter + decontamination, keeping a fraction (scan first), re-thresholding
from a data dir's scores (`--scores-from`), and runs killed with SIGKILL in every stage then rerun
(each must equal its uninterrupted run).
A real Ray cluster is not started here (minutes on a small box): the `-main` runs take the
path `--ray` takes (every chunk through the main process), and tests/prepare/test_prepare_ray.py checks
a Ray run against the local one.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import shutil
import signal
import sys
import time
from pathlib import Path

from tests.helpers.prepare import make_corpus, prepare_subprocess
from tests.prepare.junk import KINDS, held_in, junk, mixed

KILLS = ["pass1 chunk", "dedup part", "dedup resolved", "replay", "trained", "encode", "finalized train", "publish"]
GIVEN_KILLS = ["pass1 chunk", "dedup resolved", "replay", "finalized train"]


def digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def lines(docs: list[str]) -> str:
    return "\n".join(d.replace("\n", "，") for d in docs) + "\n"


def setup(base: Path) -> dict[str, Path]:
    """The corpora, the quality models (trained once: reused while they exist) and an eval set."""
    from mspretrain.cli import main

    base.mkdir(parents=True, exist_ok=True)
    raw = base / "raw"
    if not raw.exists():
        make_corpus(raw)
    models = base / "models"
    if not (models / "lm.npz").exists():
        models.mkdir(exist_ok=True)
        (models / "pos.txt").write_text(lines(held_in(800, 22)[1]), encoding="utf-8")
        (models / "neg.txt").write_text(lines([t for k in KINDS for t in junk(k, 100, 21)]), encoding="utf-8")
        assert main(["quality", "train", "--positive", str(models / "pos.txt"), "--negative", str(models / "neg.txt"),
                     "--doc-per-line", "--out", str(models / "clf.npz"), "--quiet"]) == 0
        assert main(["quality", "lm", str(models / "pos.txt"), "--doc-per-line", "--out", str(models / "lm.npz"), "--quiet"]) == 0
    qraw = base / "qraw"
    if not qraw.exists():
        qraw.mkdir()
        poems = held_in(800, 22)[0]
        for k in range(4):
            docs, _ = mixed(poems[400 + 100 * k: 500 + 100 * k], 8, 30 + k)
            (qraw / f"p{k}.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
        with open(base / "ceval_val.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", "question", "A", "B", "C", "D", "answer"])
            for i in range(0, 40, 4):
                w.writerow([i, f"以下哪一句与“{poems[400 + i][6:30]}”出自同一首诗？", "春风又绿江南岸明月何时照我还", "乙", "丙", "丁", "A"])
    return {"raw": raw, "qraw": qraw, "clf": models / "clf.npz", "lm": models / "lm.npz", "evals": base / "ceval_val.csv"}


def runs(base: Path, inp: dict[str, Path]) -> list[tuple[str, Path, tuple, dict]]:
    """(name, input, extra args, prepare_subprocess options); a name ending in `@STAGE` is a run
    killed there and rerun, compared with the run named before the `@`."""
    tok = base / "out" / "trained"  # its tokenizer is the given one of the runs after it
    filters = (f"prepare.quality_model={inp['clf']}", f"prepare.lm_model={inp['lm']}", "prepare.ppl_max=1e9",
               "prepare.min_zh_prob=0.2", f"prepare.decontam={json.dumps([str(inp['evals'])])}", "prepare.near_dedup=false")
    frac = (f"prepare.quality_model={inp['clf']}", "prepare.quality_top_fraction=0.7", f"prepare.lm_model={inp['lm']}",
            "prepare.ppl_quantiles=[0, 0.9]")
    out = [("trained", inp["raw"], (), {}),
           ("trained-1worker", inp["raw"], (), {"workers": 1}),
           ("exact-only", inp["raw"], ("prepare.near_dedup=false",), {}),
           ("given", inp["raw"], ("--tokenizer", str(tok / "tokenizer.model")), {}),
           ("trained-main", inp["raw"], (), {"through_main": True}),
           ("given-main", inp["raw"], ("--tokenizer", str(tok / "tokenizer.model")), {"through_main": True}),
           ("small-sample", inp["raw"], ("prepare.tokenizer_sample_chars=3000", "--valid-fraction", "0.3"), {}),
           ("quality", inp["qraw"], filters, {}),
           ("quality-main", inp["qraw"], filters, {"through_main": True}),
           ("quality-given", inp["qraw"], (*filters, "--tokenizer", str(tok / "tokenizer.model")), {}),
           ("fraction", inp["qraw"], frac, {}),
           ("rescored", inp["qraw"], (*frac[:2], "prepare.quality_top_fraction=0.5", *frac[2:],
                                      "--scores-from", str(base / "out" / "fraction")), {})]
    out += [(f"trained@{k}", inp["raw"], (), {}) for k in KILLS]
    out += [(f"given@{k}", inp["raw"], ("--tokenizer", str(tok / "tokenizer.model")), {}) for k in GIVEN_KILLS]
    out += [("trained-main@replay", inp["raw"], (), {"through_main": True}),
            ("trained-main@encode", inp["raw"], (), {"through_main": True}),
            ("quality@pass1 chunk", inp["qraw"], filters, {}), ("quality@encode", inp["qraw"], filters, {}),
            ("fraction@pass1 chunk", inp["qraw"], frac, {})]
    return out


def run_one(base: Path, name: str, raw: Path, extra: tuple, opts: dict) -> dict[str, str]:
    out = base / "out" / name.replace(" ", "_")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.parent / f".{out.name}.work", ignore_errors=True)
    (out.parent / f".{out.name}.progress.json").unlink(missing_ok=True)
    if "@" in name:
        at_stage = name.split("@", 1)[1]
        ref = prepare_subprocess(raw, base / "points", *extra, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"}, **opts)
        assert ref.returncode == 0, ref.stderr
        shutil.rmtree(base / "points")
        points = [ln.split(": ", 1)[1] for ln in ref.stderr.splitlines() if ln.startswith("prepare-point: ")]
        mine = [p for p in points if p.startswith(at_stage)]
        assert mine, f"{name}: no point {at_stage} in {points}"
        killed = prepare_subprocess(raw, out, *extra, env={"MSPRETRAIN_PREPARE_TEST_KILL": mine[len(mine) // 2],
                                                           "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"}, **opts)
        assert killed.returncode == -signal.SIGKILL, f"{name}: not killed: {killed.returncode} {killed.stderr}"
        opts = {**opts, "workers": 1}
    p = prepare_subprocess(raw, out, *extra, **opts)
    assert p.returncode == 0, f"{name}: {p.stderr}"
    return digest(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=Path("/tmp/prep-identity"))
    ap.add_argument("--out", type=Path, help="write the hashes here (JSON)")
    ap.add_argument("--compare", type=Path, help="compare with hashes written before; exit 1 on any difference")
    ap.add_argument("--only", help="run only the runs whose name contains this")
    a = ap.parse_args()
    inp = setup(a.base)
    got: dict[str, dict[str, str]] = {}
    for name, raw, extra, opts in runs(a.base, inp):
        if a.only and a.only not in name and name != "trained":
            continue
        t = time.time()
        got[name] = run_one(a.base, name, raw, extra, opts)
        ref = name.split("@")[0]
        same = "" if ref == name or got.get(ref) is None else (" = " + ref if got[name] == got[ref] else " DIFFERS FROM " + ref)
        print(f"{name}: {len(got[name])} files ({time.time() - t:.1f} s){same}", flush=True)
        if same.startswith(" DIFFERS"):
            return 1
    if a.out:
        a.out.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    if a.compare:
        want = json.loads(a.compare.read_text())
        bad = [f"{n}/{f}" for n in got for f in sorted(set(got[n]) | set(want.get(n, {}))) if got[n].get(f) != want.get(n, {}).get(f)]
        print(f"compared {sum(map(len, got.values()))} files of {len(got)} runs: "
              + ("all byte-identical" if not bad else f"{len(bad)} differ: {', '.join(bad[:20])}"))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
