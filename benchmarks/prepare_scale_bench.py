"""`prepare` at scale: wall time, peak RSS and dedup quality against the document count.

The corpus is synthetic and deterministic (seed 0): one document per line, made of "sentences"
of 6-24 characters drawn from a 3,000-character alphabet with a per-character successor bias (so
the tokenizer has structure to learn), 2-30 sentences per document (log-normal, median ~8, about
420 UTF-8 bytes per document like the field report's news text). Planted at known rates, each a
copy of an earlier original document (never of another copy):
- exact duplicates (`--exact-rate`, default 3 %): the same line again;
- near duplicates (`--near-rate`, default 5 %): the line with one character replaced
  (Jaccard of 5-shingles ~0.93 for a median document, above the 0.8 threshold); originals
  shorter than 80 characters are not used as near sources (one edit would move them under it).

For each size it runs `prepare(..., tokenizer=T, workers=W)` with near dedup off and on, in a
child process each (so peak RSS is that run's alone), and prints wall time, peak RSS and PSS of
the whole process tree (the main process plus its workers, summed, sampled every 50 ms), bytes
of RSS per document between consecutive sizes, and recall / precision of the dropped documents
against the planted ones (from the origin index: which input lines reached the shards).

Usage: nice python benchmarks/prepare_scale_bench.py [--sizes 1M,4M,16M] [--workers 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALPHABET = 3000
SUCCESSORS = 6


def _alphabet() -> np.ndarray:
    """3,000 CJK code points from the common block, fixed (no randomness: same on every machine)."""
    return np.arange(0x4E00, 0x4E00 + 3 * ALPHABET, 3, dtype=np.uint32)[:ALPHABET]


def _sentences(rng: np.random.Generator, n: int) -> list[bytes]:
    """n distinct-looking sentences (UTF-8, ending in 。), each a walk over the successor table."""
    alpha = _alphabet()
    succ = rng.integers(0, ALPHABET, size=(ALPHABET, SUCCESSORS))
    lens = rng.integers(6, 25, size=n)
    out = []
    start = rng.integers(0, ALPHABET, size=n)
    picks = rng.integers(0, SUCCESSORS, size=(n, 24))
    for i in range(n):
        c, ids = int(start[i]), []
        for j in range(int(lens[i])):
            ids.append(c)
            c = int(succ[c, picks[i, j]])
        out.append((alpha[ids].tobytes().decode("utf-32-le") + "。").encode("utf-8"))
    return out


WINDOW = 1 << 16  # copies are of one of the last WINDOW originals: the generator's memory stays flat


def build_corpus(path: Path, n_docs: int, exact_rate: float, near_rate: float, seed: int = 0) -> dict[str, np.ndarray]:
    """Write `n_docs` lines; returns the line numbers of the planted copies ("exact", "near")."""
    rng = np.random.default_rng(seed)
    pool = _sentences(rng, 200_000)
    alpha = _alphabet()
    planted: dict[str, list[int]] = {"exact": [], "near": []}
    recent: list[bytes] = []  # ring of recent originals
    recent_long: list[bytes] = []  # ring of recent originals of >= 60 characters (near sources)
    with open(path, "wb", buffering=1 << 22) as f:
        for lo in range(0, n_docs, 1 << 16):  # random numbers in blocks: flat memory
            n = min(1 << 16, n_docs - lo)
            kind = rng.random(n)
            counts = np.clip(np.round(rng.lognormal(np.log(8), 0.6, size=n)), 2, 30).astype(np.int64)
            picks = rng.integers(0, len(pool), size=int(counts.sum())).tolist()
            bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
            src_pick, edit_pick = rng.random(n).tolist(), rng.random(n).tolist()
            edit_char = rng.integers(0, ALPHABET, size=n).tolist()
            out = []
            for j in range(n):
                i = lo + j
                if kind[j] < exact_rate and recent:
                    line = recent[int(src_pick[j] * len(recent))]
                    planted["exact"].append(i)
                elif kind[j] < exact_rate + near_rate and recent_long:
                    text = recent_long[int(src_pick[j] * len(recent_long))].decode("utf-8")
                    pos = int(edit_pick[j] * len(text))
                    if text[pos] == "。":
                        pos -= 1
                    new = chr(int(alpha[edit_char[j]]))
                    if new == text[pos]:
                        new = chr(int(alpha[(edit_char[j] + 1) % ALPHABET]))
                    line = (text[:pos] + new + text[pos + 1:]).encode("utf-8")
                    planted["near"].append(i)
                else:
                    line = b"".join([pool[k] for k in picks[bounds[j]: bounds[j + 1]]])
                    if len(recent) < WINDOW:
                        recent.append(line)
                    else:
                        recent[i % WINDOW] = line
                    if len(line) >= 240:  # >= 80 characters
                        if len(recent_long) < WINDOW:
                            recent_long.append(line)
                        else:
                            recent_long[i % WINDOW] = line
                out.append(line)
            f.write(b"\n".join(out) + b"\n")
    return {k: np.asarray(v, dtype=np.int64) for k, v in planted.items()}


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes, summed over a process and all its descendants (the prepare workers).
    The RSS sum counts pages the forked workers share with the main process once per process;
    PSS splits them, so its sum is what the tree really holds."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    rss = pss = 0
    for q in procs:
        try:
            m = q.memory_full_info()
            rss, pss = rss + m.rss, pss + m.pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return rss, pss


def run_prepare(corpus: Path, tok: Path, out: Path, workers: int, near: bool) -> dict:
    """One `mspretrain prepare` in a child process: wall seconds, peak tree RSS, its manifest."""
    cmd = [sys.executable, "-m", "mspretrain.cli", "prepare", str(corpus), "--doc-per-line", "--tokenizer", str(tok),
           "--out", str(out), "--workers", str(workers), "--quiet", "--overwrite", f"prepare.near_dedup={str(near).lower()}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_v="3")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = peak_pss = 0
    while proc.poll() is None:
        rss, pss = tree_memory(proc.pid)
        peak, peak_pss = max(peak, rss), max(peak_pss, pss)
        time.sleep(0.05)
    wall = time.time() - t0
    output = proc.stdout.read().decode("utf-8", "replace")
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}):\n{output}")
    return {"wall": wall, "peak_rss": peak, "peak_pss": peak_pss, "manifest": json.loads((out / "manifest.json").read_text(encoding="utf-8"))}


def line_starts(path: Path) -> np.ndarray:
    """Byte offset of every line of the corpus (read in 64 MB blocks)."""
    starts, pos = [np.zeros(1, dtype=np.int64)], 0
    with open(path, "rb") as f:
        while block := f.read(64 << 20):
            nl = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)
            starts.append(nl.astype(np.int64) + pos + 1)
            pos += len(block)
    s = np.concatenate(starts)
    return s[s < pos]


def quality(out: Path, starts: np.ndarray, planted: dict[str, np.ndarray]) -> dict:
    """Recall of planted exact / near copies among the dropped lines, precision of the drops."""
    from mspretrain.data.origin import origin_name, read_records

    kept = np.zeros(starts.size, dtype=bool)
    for split in ("train", "valid"):
        rec = read_records(out / origin_name(split))
        kept[np.searchsorted(starts, np.asarray(rec["offset"], dtype=np.int64))] = True
    dropped = ~kept
    planted_any = np.zeros(starts.size, dtype=bool)
    for v in planted.values():
        planted_any[v] = True
    return {"exact_recall": float(dropped[planted["exact"]].mean()) if planted["exact"].size else 1.0,
            "near_recall": float(dropped[planted["near"]].mean()) if planted["near"].size else 1.0,
            "precision": float(planted_any[dropped].mean()) if dropped.any() else 1.0}


def size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * mult)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,4M,16M", help="document counts, comma-separated (K/M suffixes)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--exact-rate", type=float, default=0.03)
    ap.add_argument("--near-rate", type=float, default=0.05)
    ap.add_argument("--modes", default="off,on", help="near dedup off and/or on")
    ap.add_argument("--keep", metavar="DIR", help="keep corpora and outputs here (default: a temp dir, removed)")
    args = ap.parse_args()
    from mspretrain.data.tokenizer import train_sentencepiece

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="prepare_scale_"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 shared cores); workers {args.workers}")
    tok_dir = root / "tok"
    if not (tok_dir / "tokenizer.model").exists():
        sample = root / "sample.txt"
        build_corpus(sample, 20_000, 0.0, 0.0, seed=1)
        tok_dir.mkdir(exist_ok=True)
        train_sentencepiece(sample.read_text(encoding="utf-8").splitlines(), tok_dir, 4000, character_coverage=1.0, num_threads=2, seed=0)
    tok = tok_dir / "tokenizer.model"
    rows = []
    for n in [size(x) for x in args.sizes.split(",")]:
        corpus = root / f"corpus_{n}.txt"
        marks = root / f"planted_{n}_{args.exact_rate}_{args.near_rate}.npz"
        t0 = time.time()
        if args.keep and corpus.exists() and marks.exists():  # the same seed and rates: the same corpus
            planted = dict(np.load(marks))
        else:
            planted = build_corpus(corpus, n, args.exact_rate, args.near_rate)
            np.savez(marks, **planted)
        print(f"{n:,} documents: corpus {corpus.stat().st_size / 1e9:.2f} GB built in {time.time() - t0:.0f} s; "
              f"planted {planted['exact'].size:,} exact, {planted['near'].size:,} near")
        starts = line_starts(corpus)
        for mode in args.modes.split(","):
            out = root / f"out_{n}_{mode}"
            r = run_prepare(corpus, tok, out, args.workers, mode == "on")
            q = quality(out, starts, planted)
            m = r["manifest"]
            row = {"docs": n, "near": mode, "wall_s": round(r["wall"], 1), "docs_per_s": round(n / r["wall"]),
                   "peak_rss_mb": round(r["peak_rss"] / 2**20), "peak_pss_mb": round(r["peak_pss"] / 2**20),
                   "dropped": m["dropped"], "load": round(os.getloadavg()[0], 2), **q}
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            corpus.unlink()
    print("\nsummary")
    for mode in args.modes.split(","):
        rs = [r for r in rows if r["near"] == mode]
        for a, b in zip(rs, rs[1:]):
            for key in ("peak_rss_mb", "peak_pss_mb"):
                slope = (b[key] - a[key]) * 2**20 / (b["docs"] - a["docs"])
                print(f"near {mode}: {key[5:8].upper()} slope {a['docs']:,} -> {b['docs']:,} documents: {slope:.2f} B/doc")
    for n in sorted({r["docs"] for r in rows}):
        on = [r for r in rows if r["docs"] == n and r["near"] == "on"]
        off = [r for r in rows if r["docs"] == n and r["near"] == "off"]
        if on and off:
            print(f"{n:,} documents: near-dedup throughput / exact-only = {off[0]['wall_s'] / on[0]['wall_s']:.2f}x")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
