"""Memory and time of deciding from a big quality sidecar (issue 39, "bounded memory at 16 M
documents"): the exact thresholds of `prepare.quality_top_fraction` / `ppl_quantiles`
(`rescore.resolve`) and the quality section of `prepare --inspect`, on synthetic sidecars of
N_SMALL and N_BIG records, each measured in a process of its own (peak RSS: `VmHWM` of
/proc/self/status; `ru_maxrss` would carry the parent's peak over `exec`).

Bounded means: the peak does not grow with the number of records (the ratio big / small of the
growth over the process's baseline stays near 1, while the file grows N_BIG / N_SMALL times).
The thresholds are checked against numpy's sort of the same scores (exact, ties included).

    python benchmarks/quality_scale_bench.py [--small 1000000] [--big 8000000]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_sidecar(path: Path, n: int) -> None:
    """n records of made-up scores (some ties: classifier scores rounded to 1/4096), in blocks."""
    import numpy as np

    from mspretrain.prepare.scoring import HEADER, RECORD

    rng = np.random.default_rng(n)
    with open(path, "wb") as f:
        f.write(HEADER)
        for i in range(0, n, 1 << 20):
            m = min(1 << 20, n - i)
            r = np.zeros(m, dtype=RECORD)
            r["file"], r["offset"] = 0, np.arange(i, i + m) * 100
            r["zh"] = rng.random(m, dtype=np.float32)
            r["ppl"] = rng.lognormal(4, 1, m).astype(np.float32)
            r["quality"] = np.round(rng.random(m) * 4096) / 4096
            r["key"] = rng.integers(0, 1 << 62, m)
            f.write(r.tobytes())


def peak_kb() -> int:
    """This process's peak resident set (KB), since its `exec`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # (not Linux)


def child(path: str, what: str) -> None:
    """In its own process: the work, then its peak RSS and time as JSON."""
    import numpy as np

    import mspretrain.prepare.inspect  # noqa: F401  the imports before the baseline: the same for both sizes
    import mspretrain.prepare.rescore  # noqa: F401

    base = peak_kb()
    t = time.perf_counter()
    out: dict = {}
    if what == "resolve":
        from mspretrain.prepare import rescore
        from mspretrain.prepare.quality import Classifier
        from mspretrain.prepare.scoring import QualityStage, ScoreSource

        stage = QualityStage(evals=None, langid=None, min_zh=0.0, lm=None, ppl_min=0.0, ppl_max=0.0,
                             classifier=Classifier(np.zeros(2, dtype=np.float32), 0.0), threshold=0.5, top_fraction=0.3)
        out["threshold"] = rescore.resolve(stage, ScoreSource(path)).threshold
    else:
        from mspretrain.prepare.inspect import quality_lines

        out["lines"] = len(quality_lines(Path(path).parent, {"quality": {}}))
    out["seconds"] = round(time.perf_counter() - t, 2)
    out["rss_growth_mb"] = round((peak_kb() - base) / 1024, 1)
    print(json.dumps(out))


def measure(path: Path, what: str) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", str(path), what], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=1_000_000)
    ap.add_argument("--big", type=int, default=8_000_000)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    import math

    import numpy as np

    from mspretrain.prepare.scoring import SCORES, read_scores

    tmp = Path(tempfile.mkdtemp(prefix="quality_scale_"))
    result: dict = {}
    try:
        for name, n in (("small", args.small), ("big", args.big)):
            d = tmp / name
            d.mkdir()
            write_sidecar(d / SCORES, n)
            q = np.array(read_scores(d / SCORES)["quality"])
            want = float(np.sort(q)[::-1][math.ceil(0.3 * n) - 1])  # the rule: the ceil(f m)-th largest
            del q
            got = measure(d / SCORES, "resolve")
            result[name] = {"records": n, "file_mb": round((d / SCORES).stat().st_size / 2**20, 1), "resolve": got,
                            "threshold_exact": got["threshold"] == want, "inspect": measure(d / SCORES, "inspect")}
            shutil.rmtree(d)
        s, b = result["small"], result["big"]
        result["ratio_big_over_small"] = {"records": round(b["records"] / s["records"], 1),
                                          "resolve_rss_growth": round(b["resolve"]["rss_growth_mb"] / max(s["resolve"]["rss_growth_mb"], 0.1), 2),
                                          "inspect_rss_growth": round(b["inspect"]["rss_growth_mb"] / max(s["inspect"]["rss_growth_mb"], 0.1), 2),
                                          "resolve_seconds": round(b["resolve"]["seconds"] / max(s["resolve"]["seconds"], 0.01), 2)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
