"""Checkpoint averaging against the last checkpoint and a short linear decay (issue 53, item 5).

On the demo corpus (chinese-poetry from npm, the quick demo's 12,000 poems) a small model
(configs/tiny.toml's shape: dim 64, 2 layers; vocab 7,100 as the quick demo) trains with a
warm-up and then a constant learning rate, a checkpoint every `--every` steps. For each seed it
scores four models of the same training budget (`--steps`):
  last     the last checkpoint of the constant-lr run;
  avg-N    `mspretrain average RUN --last N` of that run (uniform);
  ema      the EMA of the weights that run kept (train.ema_decay, `--ema-decay`), at its last step
           (`mspretrain average RUN --last 1 --from-ema`);
  decay    the run's newest checkpoint at or before steps - decay_steps, resumed with a linear
           decay to 0 over the last `--decay-steps` steps (schedule.kind=wsd: before the decay its
           lr is the constant run's, so those steps are the constant run's, bit for bit on CPU),
           i.e. the same steps and tokens as `last`.
Each is scored by valid perplexity (`mspretrain eval --json`, the whole valid split) and by
`eval --choices` accuracy on a poetry cloze from held-out poems of the corpus (`cloze_file`):
title and first half-line as context, the true second half against three of the same length.

Also `--ema-cost`: the host-side cost of train.ema_decay's update (train/ema.py, numpy, float32)
per element, against a plain copy of the same bytes, extrapolated to a 7B model.

    python benchmarks/average_bench.py --out /tmp/avg-bench            # two seeds, ~6 min of CPU
    python benchmarks/average_bench.py --ema-cost
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def cli(*argv: object) -> str:
    """`mspretrain ARGV` in a subprocess (each command its own MindSpore process, as a user runs it)."""
    p = subprocess.run([sys.executable, "-m", "mspretrain.cli", *map(str, argv)], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"mspretrain {' '.join(map(str, argv))} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout


def cloze_file(full: Path, used: int, out: Path, n: int, seed: int = 0) -> Path:
    """Multiple-choice items from poems of the full demo corpus that the `used`-poem subset left out
    (the subset takes lines i * total // used; the line after each is held out): the title and the
    first half of the first verse line as context, its true second half against three second
    halves of the same length from other held-out poems (length gives nothing away)."""
    lines = full.read_text(encoding="utf-8").splitlines()
    taken = {i * len(lines) // used for i in range(used)}
    pairs = []
    for i in sorted(taken):
        if i + 1 < len(lines) and i + 1 not in taken:
            poem = json.loads(lines[i + 1])["text"].split("\n")
            verse = next((ln for ln in poem[1:] if "，" in ln), None)
            if poem and verse:
                a, _, b = verse.partition("，")
                if 4 <= len(a) <= 9 and len(b) >= 4:
                    pairs.append((f"{poem[0]}\n{a}，", b))
    rng = np.random.default_rng(seed)
    items = []
    for k in rng.permutation(len(pairs)):
        ctx, right = pairs[k]
        same = [b for j, (_, b) in enumerate(pairs) if j != k and len(b) == len(right) and b != right]
        if len(same) < 3:
            continue
        choices = [right, *(same[j] for j in rng.choice(len(same), 3, replace=False))]
        order = rng.permutation(4)
        items.append({"context": ctx, "choices": [choices[j] for j in order], "label": int(np.flatnonzero(order == 0)[0])})
        if len(items) == n:
            break
    out.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
    return out


def score(ckpt: Path, data: Path, choices: Path) -> dict:
    ppl = json.loads(cli("eval", ckpt, "--data", data, "--json").strip().splitlines()[-1])
    acc = json.loads(cli("eval", ckpt, "--choices", choices, "--json").strip().splitlines()[-1])
    return {"ppl": ppl["ppl"], "acc": acc["acc"], "acc_norm": acc["acc_norm"], "items": acc["count"]}


def one_seed(work: Path, data: Path, choices: Path, seed: int, a: argparse.Namespace) -> dict:
    run = work / f"const-s{seed}"
    common = ["--config", TINY, "--data", data, "--quiet", f"train.seed={seed}", f"train.max_steps={a.steps}",
              f"schedule.warmup_steps={a.warmup}", f"optim.lr={a.lr}", f"train.global_batch={a.batch}", "data.seq_len=64",
              "eval.at_end=false", "eval.every=0", f"checkpoint.every={a.every}", "checkpoint.keep_last=1000", "prepare.vocab_size=7100"]
    t0 = time.perf_counter()
    cli("train", *common, "--run", run, "schedule.kind=constant", f"train.ema_decay={a.ema_decay}")
    t_train = time.perf_counter() - t0
    last = run / "checkpoints" / f"step_{a.steps:06d}"
    avg = work / f"avg{a.last}-s{seed}"
    cli("average", run, "--last", a.last, "--out", avg, "--quiet")
    ema = work / f"ema-s{seed}"
    cli("average", run, "--last", 1, "--from-ema", "--out", ema, "--quiet")  # the run's own EMA at the last step
    # the decay branch: the constant run as it was at steps - decay_steps, resumed with WSD's linear decay
    start = a.steps - a.decay_steps
    branch = work / f"decay-s{seed}"
    shutil.copytree(run, branch, ignore=lambda d, names: [n for n in names if n.startswith("step_") and int(n[5:11]) > start])
    (branch / "metrics.jsonl").unlink(missing_ok=True)
    cli("train", *common, "--run", branch, "schedule.kind=wsd", f"schedule.decay_fraction={a.decay_steps / a.steps}",
        "schedule.min_lr_ratio=0", "--allow-config-change")
    decay = branch / "checkpoints" / f"step_{a.steps:06d}"
    out = {"seed": seed, "train_s": round(t_train, 1)}
    for name, ck in (("last", last), (f"avg{a.last}", avg), ("ema", ema), ("decay", decay)):
        out[name] = score(ck, data, choices)
        print(f"seed {seed} {name:>6}: {out[name]}", flush=True)
    return out


def ema_cost(n: int = 1 << 26) -> None:
    """Seconds per element of the EMA update against a copy of the same bytes; a 7B-shaped estimate."""
    from mspretrain.train.ema import WeightEMA

    class P:  # a parameter as the EMA sees it: name, shape, asnumpy()
        def __init__(self, x: np.ndarray) -> None:
            self.x, self.shape, self.name = x, x.shape, "w"

        def asnumpy(self) -> np.ndarray:
            return self.x

    w = np.random.default_rng(0).normal(size=n).astype(np.float32)
    ema = WeightEMA(0.999, [P(w)], keys=["w"], file_name="ema.safetensors", shapes=None, wanted={})
    ema.update()  # the first one copies
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        ema.update()
    t_ema = (time.perf_counter() - t0) / reps
    dst = np.empty_like(w)
    np.copyto(dst, w)  # its pages touched first, as the EMA's are by its first update
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, w)
    t_copy = (time.perf_counter() - t0) / reps
    per = t_ema / n
    print(f"EMA update of {n:,} fp32 elements: {t_ema * 1e3:.1f} ms ({per * 1e9:.2f} ns/element), "
          f"{t_ema / t_copy:.1f}x a copy of the same bytes ({t_copy * 1e3:.1f} ms)")
    for params, ranks in ((6.74e9, 1), (6.74e9, 8)):
        print(f"  7B-shaped ({params / 1e9:.2f} B parameters) on {ranks} rank(s) (ZeRO-3 slices when > 1): "
              f"{per * params / ranks:.2f} s per step on this host, one thread; memory {4 * params / ranks / 2**30:.1f} GiB fp32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/average-bench")
    ap.add_argument("--poems", type=int, default=12_000, help="poems of the demo corpus to train on (the quick demo's)")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--last", type=int, default=4)
    ap.add_argument("--decay-steps", type=int, default=120)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ema-decay", type=float, default=0.99, help="train.ema_decay of the constant-lr run")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--ema-cost", action="store_true")
    a = ap.parse_args()
    if a.ema_cost:
        ema_cost()
        return
    work = Path(a.out)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    from mspretrain.demo.corpus import poetry_corpus

    corpus = poetry_corpus(max_docs=a.poems, log=lambda s: print(s, flush=True))
    full = poetry_corpus(log=lambda s: None)
    data = work / "data"
    t0 = time.perf_counter()
    cli("prepare", corpus, "--out", data, "--config", TINY, "prepare.vocab_size=7100", "--quiet")
    print(f"corpus {corpus}; prepared in {time.perf_counter() - t0:.0f} s", flush=True)
    choices = cloze_file(full, a.poems, work / "cloze.jsonl", a.items)
    t0 = time.perf_counter()
    results = [one_seed(work, data, choices, int(s), a) for s in a.seeds.split(",")]
    print(f"\n{a.steps} steps (warm-up {a.warmup}, constant lr {a.lr}), checkpoint every {a.every}, "
          f"avg of the last {a.last}, decay over the last {a.decay_steps}; {time.perf_counter() - t0:.0f} s wall")
    print(f"{'model':>8} " + " ".join(f"{'seed ' + str(r['seed']) + ' ppl':>12} {'acc':>6} {'acc_n':>6}" for r in results))
    for name in ("last", f"avg{a.last}", "ema", "decay"):
        print(f"{name:>8} " + " ".join(f"{r[name]['ppl']:>12.3f} {r[name]['acc']:>6.3f} {r[name]['acc_norm']:>6.3f}" for r in results))
    base = {r["seed"]: r["last"]["ppl"] for r in results}
    print("perplexity ratio to `last`: " + "; ".join(
        f"seed {r['seed']}: avg {r[f'avg{a.last}']['ppl'] / base[r['seed']]:.4f}, ema {r['ema']['ppl'] / base[r['seed']]:.4f}, "
        f"decay {r['decay']['ppl'] / base[r['seed']]:.4f}"
        for r in results))
    (work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
