"""Host share of a train step and the cost of its blocking read (issue 16, "What to build" 4).

`TrainStep.run` calls the compiled step, then reads the loss, the finite flag, the grad norm and
the per-row NLL back with `.asnumpy()` before it returns; the trainer then does its host work
(next batch, metrics, console, per-step records, heartbeat) before it launches the next step.
While the host works the device idles, so the stall this design costs is the share of a step
spent outside the compiled step plus the read itself. This script runs the real trainer
(`build_trainer(...).train()`, the loop of `mspretrain train`) for N steps and measures, per
step after the first (which compiles):

- wall: the time between the starts of two consecutive steps of the loop (the reference);
- call: the compiled step's call until it returns; wait: the first output's `.asnumpy()` right
  after it. On CPU the trainer sets MS_DEV_HOST_BLOCKING_RUN=1 (device.setup_mindspore): the call
  runs the graph and returns with it computed, so the wait is ~0 and the call is the step's
  compute. With MindSpore's host pipeline (Ascend; on CPU `--host-pipeline`) the call returns at
  launch and this read waits for the compute. Either way the wait is the compute, not a cost;
- read: the rest of `TrainStep.run`: the input tensors, the reads of the finished outputs, the result;
- outside: wall - run, broken down by the loop's parts and its callbacks' hooks;
- host_share: as the trainer reports it in metrics.jsonl (1 - time in `run` / wall, per window).

Two configs: `configs/demo.toml` on the quick demo's corpus (the 12,000 poems `mspretrain demo
--quick` fetches, from the cache when it is there; `--corpus` for other text) with the quick
demo's vocabulary (7,100), and `configs/tiny.toml` (the tests' config) on the tests' generated
poems. Times are medians; the shares are sums over the measured steps, and the ratios are what
to compare on a noisy box. Nothing is asserted.

    python benchmarks/host_sync_bench.py                  # --demo-steps 40 --tiny-steps 200
    python benchmarks/host_sync_bench.py --only tiny
    python benchmarks/host_sync_bench.py --only tiny --host-pipeline   # MS_DEV_HOST_BLOCKING_RUN=0: async, as on Ascend
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Clock:
    """Per-step sums of named timers, keyed by the loop's step number."""

    def __init__(self) -> None:
        self.step = 0
        self.t: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.begin: dict[int, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[self.step][name] += time.perf_counter() - t0
        return timed


def instrument(trainer: Any, clock: Clock) -> None:
    """Timers around the loop's parts, every hook of its callbacks and the step's compiled call
    (instance attributes only: nothing in the project is changed)."""
    from mspretrain.monitor.callback import Callback

    step_fn = trainer.step_fn

    class Start(Callback):  # first in the list: its pre_load_batch is the step's start
        def pre_load_batch(self, step: int) -> None:
            clock.step = step
            clock.begin[step] = time.perf_counter()

    def compiled(fn: Callable[..., Any], wait: bool) -> Callable[..., Any]:
        def call(*a: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a)
            t1 = time.perf_counter()
            if wait:  # what `run` reads first: blocks until the step's compute is done
                out[0].asnumpy()
            clock.t[clock.step]["call"] += t1 - t0
            clock.t[clock.step]["wait"] += time.perf_counter() - t1
            return out
        return call

    if step_fn.accum is None:
        step_fn._fused = compiled(step_fn._fused, True)
    else:  # accumulation > 1 (the buffers exist from the start): no wait between micro-batches, as in `run`
        step_fn._accumulate = compiled(step_fn._accumulate, False)
        step_fn._apply = compiled(step_fn._apply, True)
    step_fn.run = clock.wrap("run", step_fn.run)
    for obj, names in ((trainer.loader, ("next_batch", "state")), (trainer.spikes, ("observe",)),
                       (trainer.scaler, ("update",)), (trainer.checkpoints, ("due",))):
        for n in names:
            setattr(obj, n, clock.wrap(f"{type(obj).__name__}.{n}", getattr(obj, n)))
    hooks = ("pre_load_batch", "pre_step", "post_train_batch", "post_step", "log_metrics")
    for c in trainer.callbacks:  # each per-step hook a callback overrides
        for n in hooks:
            if getattr(type(c), n) is not getattr(Callback, n):
                setattr(c, n, clock.wrap(f"{type(c).__name__}.{n}", getattr(c, n)))
    trainer.callbacks.insert(0, Start())


def measure(name: str, cfg_path: Path, data: Path, work: Path, steps: int, overrides: list[str]) -> dict[str, Any]:
    from mspretrain.config import schema as cfgmod
    from mspretrain.train.build import build_trainer

    cfg = cfgmod.load(cfg_path, [f"train.max_steps={steps}", "checkpoint.every=0", "eval.every=0", *overrides])
    run = work / f"run-{name}"
    trainer = build_trainer(cfg, data, run, log=lambda s: None)
    clock = Clock()
    instrument(trainer, clock)
    trainer.train()
    # steps 2 .. N-1: the first compiles; the last has no next start (and runs the final eval and save)
    measured = [s for s in range(2, steps) if s + 1 in clock.begin]
    wall = {s: clock.begin[s + 1] - clock.begin[s] for s in measured}
    t = {s: clock.t[s] for s in measured}
    read = {s: t[s]["run"] - t[s]["call"] - t[s]["wait"] for s in measured}
    total = sum(wall.values())
    outside = total - sum(t[s]["run"] for s in measured)
    parts = defaultdict(float)
    for s in measured:
        for k, v in t[s].items():
            if k not in ("run", "call", "wait"):
                parts[k] += v
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    shares = [r["host_share"] for r in records if "host_share" in r]
    med = lambda xs: statistics.median(xs)
    return {"name": name, "steps": len(measured), "load": os.getloadavg()[0], "tokens_per_step": trainer.tokens_per_step,
            "params": sum(int(p.size) for p in trainer.step_fn.params),
            "wall_ms": med(wall.values()) * 1e3, "call_ms": med(t[s]["call"] for s in measured) * 1e3,
            "wait_ms": med(t[s]["wait"] for s in measured) * 1e3, "read_ms": med(read.values()) * 1e3,
            "outside_ms": med(wall[s] - t[s]["run"] for s in measured) * 1e3,
            "read_share": sum(read.values()) / total,
            "call_share": sum(t[s]["call"] for s in measured) / total, "wait_share": sum(t[s]["wait"] for s in measured) / total,
            "outside_share": outside / total, "host_share_metrics": shares,
            "parts": sorted(((k, v / total, v / len(measured)) for k, v in parts.items()), key=lambda kv: -kv[1]),
            "unattributed_share": (outside - sum(parts.values())) / total}


def report(r: dict[str, Any]) -> None:
    shares = r["host_share_metrics"]
    idle = r["read_share"] + r["outside_share"]
    print(f"\n== {r['name']}: {r['params'] / 1e6:.2f} M parameters, {r['tokens_per_step']:,} tokens/step, "
          f"{r['steps']} measured steps (medians; shares of the measured steps' time), load average {r['load']:.1f} at the end")
    print(f"  step (wall, reference)  {r['wall_ms']:9.2f} ms")
    print(f"  compiled call returns   {r['call_ms']:9.3f} ms = {r['call_share']:.3%}")
    print(f"  first read waits        {r['wait_ms']:9.3f} ms = {r['wait_share']:.3%}   (call + wait: the step's compute)")
    print(f"  read (rest of run)      {r['read_ms']:9.3f} ms = {r['read_share']:.3%}")
    print(f"  outside the step        {r['outside_ms']:9.3f} ms = {r['outside_share']:.3%}")
    print(f"  host between steps      {idle:.3%} (read + outside): the device idles this share; the most that reading "
          "step N's results during step N+1 could hide")
    print("  host_share in metrics.jsonl: " + ", ".join(f"{x:.4f}" for x in shares)
          + (f"  (mean {statistics.mean(shares):.3%})" if shares else ""))
    print("  outside, by component (share, mean per step): "
          + ", ".join(f"{k} {v:.3%} {per * 1e6:,.0f} us" for k, v, per in r["parts"] if v >= 1e-4)
          + f", rest of the loop {r['unattributed_share']:.3%}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--demo-steps", type=int, default=40)
    p.add_argument("--tiny-steps", type=int, default=200)
    p.add_argument("--only", choices=("demo", "tiny"), default=None)
    p.add_argument("--corpus", default=None, help="text for the demo config (default: the quick demo's cached poems)")
    p.add_argument("--host-pipeline", action="store_true",
                   help="MS_DEV_HOST_BLOCKING_RUN=0: MindSpore's asynchronous host pipeline (the Ascend behaviour) on CPU")
    args = p.parse_args()
    if args.host_pipeline:  # before any MindSpore op runs; setup_mindspore keeps a value that is set
        os.environ["MS_DEV_HOST_BLOCKING_RUN"] = "0"
    print(f"MS_DEV_HOST_BLOCKING_RUN={os.environ.get('MS_DEV_HOST_BLOCKING_RUN', '(unset: setup_mindspore sets 1 on CPU)')}, "
          f"load average {os.getloadavg()[0]:.1f}")

    from mspretrain.config import schema as cfgmod
    from mspretrain.prepare.prepare import prepare

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only in (None, "tiny"):
            from tests.conftest import make_poems

            corpus = work / "poems.txt"
            corpus.write_text("\n\n".join(make_poems(1200)) + "\n", encoding="utf-8")
            tiny = ROOT / "configs" / "tiny.toml"
            prepare([str(corpus)], work / "data-tiny", cfgmod.load(tiny).prepare, workers=1, log=lambda s: None)
            results.append(measure("tiny (configs/tiny.toml)", tiny, work / "data-tiny", work, args.tiny_steps, []))
            report(results[-1])
        if args.only in (None, "demo"):
            from mspretrain.demo.corpus import poetry_corpus

            demo = ROOT / "configs" / "demo.toml"
            quick = ["prepare.vocab_size=7100", "eval.max_tokens=8192"]  # `mspretrain demo --quick`
            corpus = Path(args.corpus) if args.corpus else poetry_corpus(max_docs=12_000, log=print)
            t0 = time.perf_counter()
            prepare([str(corpus)], work / "data-demo", cfgmod.load(demo, quick).prepare, log=lambda s: None)
            print(f"(demo data: {corpus.name} prepared in {time.perf_counter() - t0:.0f} s)")
            results.append(measure("demo (configs/demo.toml, quick demo data)", demo, work / "data-demo", work,
                                   args.demo_steps, quick))
            report(results[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
