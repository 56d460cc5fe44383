"""`mspretrain prepare` end to end, the path through the main process (`pipeline.LOCAL_PIECES =
False`, what `--ray` takes) against the per-chunk path (the default with local workers), on the
same corpus and command; then a byte comparison of the two data dirs.

Without `--tokenizer` (the default command: a tokenizer is trained) this is the old and the new
path of docs/benchmarks/prepare.md "The default command (a trained tokenizer) on the per-chunk path".
Wall time and CPU (children included) from /usr/bin/time when it is there.

Usage: nice python benchmarks/prepare_paths_bench.py CORPUS.txt [--workers 2] [-- EXTRA PREPARE ARGS]
(CORPUS: one document per line, e.g. `prepare_scale_bench.build_corpus`'s.)
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("import sys\nfrom mspretrain.prepare import pipeline\nfrom mspretrain.cli import main\n"
        "pipeline.LOCAL_PIECES = {}\nsys.exit(main(sys.argv[1:]))\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("extra", nargs="*", help="more prepare arguments (after --)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prepare_paths_"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3"}
    timer = ["/usr/bin/time", "-f", "%e s wall, %U s user, %S s sys (children included)"] if Path("/usr/bin/time").exists() else []
    walls = {}
    try:
        print(f"corpus {args.corpus} ({args.corpus.stat().st_size / 1e6:,.0f} MB), {args.workers} workers, "
              f"load average {os.getloadavg()[0]:.2f}")
        for local in (False, True):
            out = tmp / f"out-{local}"
            t0 = time.time()
            r = subprocess.run([*timer, sys.executable, "-c", CODE.format(local), "prepare", str(args.corpus), "--out", str(out),
                                "--workers", str(args.workers), "--doc-per-line", "--quiet", *args.extra],
                               capture_output=True, text=True, env=env)
            walls[local] = time.time() - t0
            if r.returncode != 0:
                raise SystemExit(f"prepare failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
            print(f"{'per-chunk' if local else 'through main':>12}: {walls[local]:.1f} s wall"
                  + (f" ({r.stderr.strip().splitlines()[-1]})" if timer else ""), flush=True)
        names = sorted(p.name for p in (tmp / "out-True").iterdir())
        differ = [n for n in names if not filecmp.cmp(tmp / "out-True" / n, tmp / "out-False" / n, shallow=False)]
        print(f"data dirs: {len(names)} files, {'all byte-identical' if not differ else 'DIFFERENT: ' + ', '.join(differ)}")
        print(f"wall, through main / per-chunk: {walls[False] / walls[True]:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
