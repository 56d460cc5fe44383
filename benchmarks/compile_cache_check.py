"""Does MindSpore 2.10's graph compile cache (MS_COMPILER_CACHE_ENABLE / MS_COMPILER_CACHE_PATH)
help the test suite on CPU? Runs one tiny compiled train step in three fresh processes: without the
cache, with an empty cache dir (it is written), and with the warm cache (it is read), and prints
each step's loss, grad norm and first-step time.

    python benchmarks/compile_cache_check.py

Result on the 2-core box (docs/benchmarks.md, "The test suite"): the warm-cache process skips most
of the compilation but returns a wrong step (loss = ln V, grad norm 0: the loaded graph does not see
the parameters' values), and a different graph (another grad_clip) loads the same cache file, which
is named by compile order (compile_cache_0.mindir). So the suite does not use it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys, time
import numpy as np
from mspretrain.config.schema import OptimConfig
from mspretrain.step.step import TrainStep
from tests.step.test_train_step import Bigram
rng = np.random.default_rng(0)
emb = rng.normal(0, 0.5, (50, 16)).astype(np.float32); w = rng.normal(0, 0.5, (16, 50)).astype(np.float32)
b = rng.integers(0, 50, (4, 9)).astype(np.int32)
step = TrainStep(Bigram(emb, w), OptimConfig(lr=1e-2, grad_clip=float(sys.argv[1])), global_tokens=32, jit=True)
t0 = time.time()
r = step.run([(b, None, None)], lr=1e-2, scale=1.0)
print(f"loss {r.loss:.6f}  grad_norm {r.grad_norm:.6f}  first step {time.time() - t0:.2f} s")
"""


def run(clip: float, cache: str | None, script: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_v="3", MS_DEV_HOST_BLOCKING_RUN="1")
    env.pop("MS_COMPILER_CACHE_ENABLE", None)
    if cache:
        env.update(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=cache)
    out = subprocess.run([sys.executable, str(script), str(clip)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return (out.stdout.strip().splitlines() or [out.stderr.strip()[-300:]])[-1]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # a file, not `python -c`: the cache hashes the entry script and the files it imports
        script, cache = Path(tmp) / "child.py", str(Path(tmp) / "cache")
        script.write_text(CHILD, encoding="utf-8")
        print("no cache             ", run(0.0, None, script))
        print("cache written        ", run(0.0, cache, script))
        print("cache read           ", run(0.0, cache, script))
        print("cache read, clip 0.05", run(0.05, cache, script))
        print("no cache, clip 0.05  ", run(0.05, None, script))
        print("cache files:", sorted(str(p.relative_to(cache)) for p in Path(cache).rglob("*") if p.is_file()))


if __name__ == "__main__":
    main()
