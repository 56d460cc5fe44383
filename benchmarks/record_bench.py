"""Cost of the per-step records (issue 21) against the train step they ride on.

Every step, rank 0 writes a `batches.jsonl` line (`monitor/batch_log.BatchLog`: the global
batch's sample ids from the plan, hashed) and updates the per-source ledger
(`monitor/source_ledger.SourceLedger`). This script times both on the demo corpus's shape
and on a 7B-scale plan (256 samples a step from a 30 M-window corpus, two sources), and times
the train step of the demo model in the same process, and prints the share of a step the records
take. Timings are medians of repeated runs; the shares are what to compare on a noisy box.

    python benchmarks/record_bench.py            # --steps 300 --train-steps 12
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from mspretrain.data.order import SamplePlan  # noqa: E402
from mspretrain.monitor.batch_log import BatchLog  # noqa: E402
from mspretrain.monitor.source_ledger import SourceLedger  # noqa: E402


def time_records(plan: SamplePlan, global_batch: int, steps: int, work: Path) -> float:
    """Median seconds per step of BatchLog + SourceLedger, as the trainer calls them."""
    work.mkdir(parents=True, exist_ok=True)
    log = BatchLog(work, plan=plan, global_batch=global_batch, enabled=True)
    ledger = SourceLedger(plan, world=1, rank=0, micro=global_batch, accum=1, seq_len=2048, every=10)
    pos = [0] * len(plan.windows)
    rows = np.ones(global_batch, dtype=np.float32)
    plan.batch(pos, global_batch)  # the epoch's permutation: once per epoch, not per step
    times = []
    for step in range(1, steps + 1):
        state = {"sources": [{"consumed": c} for c in pos]}
        values = {"lr": 1e-4, "loss_scale": 1.0, "skipped": 0, "_row_nll": rows}
        t0 = time.perf_counter()
        log.post_step(step, state, values)
        ledger.post_step(step, state, values)
        times.append(time.perf_counter() - t0)
        pos = plan.advance(pos, global_batch)
    log.close()
    return statistics.median(times)


def time_train_step(work: Path, steps: int) -> float:
    """Median seconds of a demo-model train step (dim 256, 4 layers, batch 16 x 128) on this box."""
    from mspretrain.config import schema as cfgmod
    from mspretrain.prepare.prepare import prepare
    from mspretrain.train.build import build_trainer
    from tests.conftest import make_poems

    corpus = work / "poems.txt"
    corpus.write_text("\n\n".join(make_poems(3000)) + "\n", encoding="utf-8")
    cfg = cfgmod.load(ROOT / "configs" / "demo.toml", ["prepare.vocab_size=2000", "prepare.t2s=false",
                                                      f"train.max_steps={steps}", "checkpoint.every=0", "eval.every=0",
                                                      "schedule.warmup_steps=1"])
    prepare([str(corpus)], work / "data", cfg.prepare, workers=1, log=lambda s: None)
    trainer = build_trainer(cfg, work / "data", work / "run", log=lambda s: None)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    trainer.close()  # its checkpoints and callbacks (the metrics writer, the heartbeat's thread)
    return statistics.median(times[2:])  # the first steps compile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="record calls to time per shape")
    p.add_argument("--train-steps", type=int, default=12)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        demo = time_records(SamplePlan((32_000,), (1.0,), seed=1), 16, args.steps, work / "a")
        big = time_records(SamplePlan((30_000_000, 3_000_000), (0.9, 0.1), seed=1), 256, args.steps, work / "b")
        step = time_train_step(work, args.train_steps)
    print(f"demo train step (dim 256, 4 layers, 16 x 128 tokens): {step * 1e3:.1f} ms")
    print(f"records, demo shape (16 samples, 1 source):       {demo * 1e6:.0f} us/step = {demo / step:.3%} of the step")
    print(f"records, 7B plan (256 samples, 2 sources, 33 M windows): {big * 1e6:.0f} us/step = "
          f"{big / step:.3%} of the demo step (a 7B step on 8 x 910B takes ~16 s: {big / 16:.5%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
