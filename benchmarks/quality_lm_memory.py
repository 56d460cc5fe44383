"""Peak RSS of `mspretrain quality lm` on one endless line (issue 54, item 12): the counts are
streamed in overlapping segments (`quality.train_lm`), so the peak must not grow with the line.

    PYTHONPATH=. python benchmarks/quality_lm_memory.py [--chars 10000000 30000000]

Each size is a one-line .txt of random Han characters (`--doc-per-line`); each `quality lm` runs in
its own process, whose peak RSS (ru_maxrss of the child) is printed with its ratio to the first
(smallest) size, the reference run. Before the fix the peak grew ~72 bytes per character
(722 MB for 10 M characters).
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HAN = "春眠不觉晓处处闻啼鸟夜来风雨声花落知多少床前明月光疑是地上霜举头望山低头思故乡"


def peak_mb(chars: int, d: Path) -> float:
    """Peak RSS (MB) of `quality lm` over one line of `chars` characters, in a child process of a
    child (ru_maxrss of RUSAGE_CHILDREN is the largest of all children: one probe process per size)."""
    text = d / f"line-{chars}.txt"
    rng = random.Random(chars)
    block = "".join(rng.choice(HAN) for _ in range(1_000_000))
    with open(text, "w", encoding="utf-8") as f:
        for _ in range(chars // 1_000_000):
            f.write(block)
        f.write("\n")
    probe = ("import resource, subprocess, sys\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True)\n"
             "assert p.returncode == 0, p.stderr.decode()[-500:]\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n")
    cmd = [sys.executable, "-c", probe, sys.executable, "-m", "mspretrain.cli", "quality", "lm", str(text), "--doc-per-line",
           "--out", str(d / f"lm-{chars}.npz"), "--quiet"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    text.unlink()
    return float(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, nargs="+", default=[10_000_000, 30_000_000])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        peaks = [peak_mb(n, Path(tmp)) for n in sorted(args.chars)]
    for n, p in zip(sorted(args.chars), peaks):
        print(f"{n:>12,} characters on one line: peak RSS {p:7.0f} MB  ({p / peaks[0]:.2f} x the {sorted(args.chars)[0]:,}-character run)")


if __name__ == "__main__":
    main()
