"""What a collective bucket costs in host memory on MindSpore's CPU backend (issue 16, plan term 3).

The real `TrainStep` (its fused graph: gradients, `_reduce`, `_finish`, `_gather`) around a model
that is nothing but parameters: L fp32 vectors of n elements whose "logits" are their sum, so the
forward and backward hold next to nothing and what the step holds beyond its persistent tensors is
the gradients, the update's temporaries and the collective path. Each case is a fresh process
(two msrun workers for world 2); the measure is the growth of VmHWM during the first step call
(which compiles and runs the graph), over the RSS after the TrainStep was built.

Cases, all with the same parameters:
- world 1: the reference, no collective (the same graph without `_reduce`'s and `_gather`'s work);
- world 2, ZeRO-2 (optim.shard_gradients) at several bucket caps, and 0 (one collective per
  parameter: `_reduce` and `_gather` then move each parameter alone, rank buckets of one).

Printed per case: the first call's growth, its excess over the world-1 reference, the largest
bucket's bytes (parallel/layout.py), and excess / bucket: the factor `preflight/plan.py` uses on CPU
(CPU_BUCKET_FACTOR). The world-2 ranks hold half the Adam moments and half the update's
temporaries of world 1, which the excess does not correct for (it makes the factor smaller, not
larger).

    python benchmarks/bucket_memory_bench.py                       # 16 x 16 MB parameters, caps 256,64,32,0
    python benchmarks/bucket_memory_bench.py --params 32x2 --caps 32,0   # 32 parameters of 2 MB: a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_bench, beside this file
MB = 2**20


def _status() -> dict[str, int]:
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def worker(args: argparse.Namespace) -> int:
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, Tensor, nn, ops

    from mspretrain.config import schema as cfgmod
    from mspretrain.config.schema import OptimConfig
    from mspretrain.device import plan_device, setup_mindspore
    from mspretrain.parallel import distributed
    from mspretrain.step.step import TrainStep

    cfg = cfgmod.load(ROOT / "configs" / "tiny.toml", ["device.target=cpu"])
    setup_mindspore(plan_device(cfg))
    world = distributed.init("cpu")
    count, size = args.count, args.numel
    vocab, batch, seq = 8, 1, 4

    class ParamsOnly(nn.Cell):
        """Parameters and nothing else: logits are their sum, so every gradient is a constant."""
        dtype = ms.float32

        def __init__(self) -> None:
            super().__init__()
            self.weights = ms.ParameterTuple([Parameter(Tensor(np.full((size,), 0.01, np.float32)), name=f"layers.{i}.mlp.w2.weight")
                                              for i in range(count)])

        def construct(self, x, positions=None, segments=None):
            total = ops.stack([w.sum() for w in self.weights]).sum()
            return ops.zeros((x.shape[0], x.shape[1], vocab), ms.float32) + total * 1e-6

    model = ParamsOnly()
    step = TrainStep(model, OptimConfig(grad_clip=1.0), global_tokens=batch * seq * world.size, world=world.size,
                     rank=world.rank, shard=world.size > 1, shard_grads=world.size > 1, bucket_mb=args.cap, device="cpu")
    tokens = np.zeros((batch, seq + 1), np.int32)
    open("/proc/self/clear_refs", "w").write("5")
    base = _status()["VmRSS"]
    calls = []
    for _ in range(3):
        open("/proc/self/clear_refs", "w").write("5")
        r = step.run([(tokens, None, None)], lr=1e-4, scale=1.0)
        s = _status()
        calls.append({"peak": s["VmHWM"] - base, "rss": s["VmRSS"] - base})
    red, gat = step.layout.largest_bucket_bytes()
    out = {"rank": world.rank, "world": world.size, "cap_mb": args.cap, "params_bytes": 4 * count * size,
           "largest_bucket": max(red, gat), "buckets": len(step.layout.reduce_rank) + len(step.layout.gather_rank),
           "singletons": len(step.layout.reduce_single) + len(step.layout.gather_single), "calls": calls,
           "loss_finite": bool(r.finite)}
    Path(f"{args.out}.rank{world.rank}.json").write_text(json.dumps(out))
    return 0


def run_case(world: int, cap: float, count: int, numel: int, work: Path) -> dict | None:
    tag = f"w{world}-cap{cap:g}"
    from memory_bench import command  # the same launch (one process, or msrun workers on this host)

    wargs = ["--bench-worker", "--cap", str(cap), "--count", str(count), "--numel", str(numel), "--out", str(work / tag)]
    launch = command(Path(__file__), wargs, world, work / f"logs-{tag}")
    if launch is None:
        print(f"{tag}: skipped, msrun not found next to {sys.executable}")
        return None
    cmd, env = launch
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    files = sorted(work.glob(f"{tag}.rank*.json"))
    if proc.returncode != 0 or len(files) != world:
        print(f"{tag}: FAILED (exit {proc.returncode})\n{(proc.stderr or '')[-1500:]}")
        return None
    res = [json.loads(p.read_text()) for p in files]
    return max(res, key=lambda r: r["calls"][0]["peak"])  # the rank that needed most


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="16x16", help="COUNTxMB: parameters and the MB of each (fp32)")
    ap.add_argument("--caps", default="256,64,32,0", help="bucket caps in MB for the 2-worker runs (0 = per parameter)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bench-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bench_worker:
        return worker(args)
    m = re.fullmatch(r"(\d+)x(\d+(?:\.\d+)?)", args.params)
    try:
        caps = [float(c) for c in args.caps.split(",") if c]
    except ValueError:
        caps = []
    if not m or not caps or any(c < 0 for c in caps):
        print("bucket_memory_bench: --params is COUNTxMB (e.g. 16x16) and --caps a comma list of MB >= 0", file=sys.stderr)
        return 2
    count, numel = int(m.group(1)), int(float(m.group(2)) * MB // 4)
    work = Path(tempfile.mkdtemp(prefix="bucket_memory_bench-"))
    print(f"bucket_memory_bench: {count} fp32 parameters of {numel * 4 / MB:g} MB ({count * numel * 4 / MB:g} MB); "
          f"load {os.getloadavg()[0]:.1f}")
    ref = run_case(1, 0.0, count, numel, work)
    rows = []
    if ref is not None:
        print(f"world 1 (reference)   first call +{ref['calls'][0]['peak'] / MB:7.0f} MB peak, rss +{ref['calls'][0]['rss'] / MB:.0f} MB")
        for cap in caps:
            r = run_case(2, cap, count, numel, work)
            if r is None:
                continue
            peak = r["calls"][0]["peak"]
            excess = peak - ref["calls"][0]["peak"]
            factor = excess / r["largest_bucket"] if r["largest_bucket"] else float("nan")
            rows.append({**r, "excess": excess, "factor": factor})
            print(f"world 2 cap {cap:5g} MB: first call +{peak / MB:7.0f} MB peak (rss +{r['calls'][0]['rss'] / MB:.0f}, "
                  f"later calls peak +{max(c['peak'] for c in r['calls'][1:]) / MB:.0f}); excess over world 1 "
                  f"{excess / MB:+.0f} MB; largest bucket {r['largest_bucket'] / MB:.0f} MB "
                  f"({r['buckets']} buckets, {r['singletons']} single); excess / bucket {factor:.2f}")
    if args.json:
        print(json.dumps({"reference": ref, "rows": rows}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
