"""Does the classifier help a model? Two small models for the same token budget, one on a
junk-polluted corpus as it is and one on the same corpus filtered by `prepare.quality_model`,
two seeds each: valid perplexity on a clean held-out set and `eval --choices` accuracy.

Corpus: tests/prepare/junk.py `held_in` poems mixed with every planted junk kind (--junk per kind).
One tokenizer for all (trained on clean poems, given with --tokenizer), so perplexities compare.
Held-out set: other poems of the same seed. Choices: a poem's header and first line, then its
true second line against three "word salad" lines of the same width (acc measures whether the
model learned the poems' successor structure). Model: configs/tiny.toml, --steps steps of
global batch 8 x seq_len 64 (the same tokens for both corpora).

Usage: nice python benchmarks/quality_train_bench.py [--steps 300] [--seeds 1,2]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.prepare.junk import _POEM_CHARS, KINDS, held_in, junk, mixed  # noqa: E402


def cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "mspretrain.cli", *args], capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "GLOG_v": "3", "PATH": "/usr/bin:/bin"})
    if r.returncode:
        raise SystemExit(f"mspretrain {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def write_lines(path: Path, docs: list[str]) -> None:
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")


def choices(poems: list[str], n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for p in poems[:n]:
        head, rest = p.split("，", 1)
        first, second = rest.split("，")[:2]
        width = len(first)
        wrong = ["".join(_POEM_CHARS[j] for j in rng.integers(len(_POEM_CHARS), size=width)) for _ in range(3)]
        opts = [second.rstrip("。")] + wrong
        order = rng.permutation(4)
        out.append({"context": f"{head}，{first}，", "choices": [opts[i] for i in order], "label": int(np.flatnonzero(order == 0)[0])})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--poems", type=int, default=20000)
    ap.add_argument("--junk", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="1,2")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="quality_train_"))
    try:
        poems, pos = held_in(args.poems + 2000, 102)
        corpus_poems, held = poems[: args.poems], poems[args.poems:]
        write_lines(tmp / "pos.txt", pos)
        write_lines(tmp / "neg.txt", [d for k in KINDS for d in junk(k, 400, 101)])
        write_lines(tmp / "held.txt", held)
        docs, bad = mixed(corpus_poems, args.junk, 102)
        write_lines(tmp / "corpus.txt", docs)
        with open(tmp / "choices.jsonl", "w", encoding="utf-8") as f:
            for item in choices(held, 400, 7):
                f.write(json.dumps(item, ensure_ascii=False) + "\n")
        cli("quality", "train", "--positive", str(tmp / "pos.txt"), "--negative", str(tmp / "neg.txt"), "--doc-per-line",
            "--out", str(tmp / "clf.npz"), "--quiet")
        common = ["--doc-per-line", "--quiet", "--workers", "1"]
        cli("prepare", str(tmp / "pos.txt"), "--out", str(tmp / "tok"), "--vocab-size", "512", *common)
        tok = str(tmp / "tok" / "tokenizer.model")
        cli("prepare", str(tmp / "corpus.txt"), "--out", str(tmp / "unfiltered"), "--tokenizer", tok, *common)
        cli("prepare", str(tmp / "corpus.txt"), "--out", str(tmp / "filtered"), "--tokenizer", tok, *common,
            f"prepare.quality_model={tmp / 'clf.npz'}")
        cli("prepare", str(tmp / "held.txt"), "--out", str(tmp / "held"), "--tokenizer", tok, "--valid-fraction", "0.5", *common)
        result: dict = {"documents": len(docs), "junk_documents": int(bad.sum()), "steps": args.steps, "runs": {}}
        for name in ("unfiltered", "filtered"):
            m = json.loads((tmp / name / "manifest.json").read_text())
            result[f"{name}_train_tokens"] = m["tokens"]["train"]
        for name in ("unfiltered", "filtered"):
            for seed in args.seeds.split(","):
                run = tmp / f"run-{name}-{seed}"
                t = time.perf_counter()
                cli("train", "--config", str(ROOT / "configs" / "tiny.toml"), "--data", str(tmp / name), "--run", str(run), "--quiet",
                    f"train.max_steps={args.steps}", f"train.seed={seed}", "train.global_batch=8", "data.seq_len=64",
                    f"checkpoint.every={args.steps}", "schedule.warmup_steps=10")
                secs = time.perf_counter() - t
                ppl = json.loads(cli("eval", str(run), "--data", str(tmp / "held"), "--split", "valid", "--max-tokens", "0", "--json",
                                     "--quiet"))
                acc = json.loads(cli("eval", str(run), "--choices", str(tmp / "choices.jsonl"), "--json", "--quiet"))
                result["runs"][f"{name} seed {seed}"] = {"valid_ppl": round(ppl["ppl"], 3), "acc": acc["acc"], "acc_norm": acc["acc_norm"],
                                                        "train_s": round(secs, 1)}
                print(json.dumps({f"{name} seed {seed}": result["runs"][f"{name} seed {seed}"]}), flush=True)
        print(json.dumps(result, ensure_ascii=False))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
