"""Peak memory of real train steps, measured, beside what `mspretrain plan` predicts (issue 16).

For each model size and memory mode a fresh process (two msrun workers for the sharded mode)
runs the trainer itself (`Trainer.train()`: the same model, TrainStep, loader and loop as
`mspretrain train`) for a few steps on a small prepared data dir, and measures host memory:

    peak = VmHWM over the steps - VmRSS at the baseline

The baseline is taken after imports, MindSpore set-up, world init and the data manifest, just
before the model is built; VmHWM is reset there (`/proc/self/clear_refs` "5"), and again around
each phase, so the peak of each phase is known too: model built, TrainStep built (buffers,
moments, masters), each accumulate() and apply() call (the first includes graph compilation),
and later steps. MindSpore's memory statistics read 0 on CPU, so resident memory is the measure.

Modes: fp32 (replicated, world 1); fp16 + fp32 masters (`precision.dtype=fp16`,
`precision.param_dtype=compute`, world 1); shard2 (2 msrun workers, `optim.shard_optimizer=true`,
and `optim.shard_gradients=true` when `OptimConfig` has that key); zero3 (2 msrun workers,
`optim.shard_parameters=true`); accum (fp32, world 1, two
micro-batches per step: accumulate() twice and apply() instead of the fused graph). Every run has
device.target=cpu. The planner's number is `make_plan(cfg, devices=N)["memory_bytes"]["peak"]`
(or `["total"]` when it has no peak), which on CPU includes its stated term for MindSpore's CPU
backend (`memory_bytes["cpu_backend"]`); the slopes are also shown without that term.
The verdict is the per-parameter slope between sizes, measured vs planned (target: within 15 %).

    python benchmarks/memory_bench.py                                 # 10m,60m,120m x fp32,fp16,shard2,accum
    python benchmarks/memory_bench.py --sizes 2m,10m --modes fp32 --steps 3   # smoke
    python benchmarks/memory_bench.py --sizes 1024x5 --modes shard2    # a size as DIMxLAYERS
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 1024**3
# name -> (dim, n_layers); heads = dim / 64, ffn by Llama's rule, vocab from the data dir (512).
SIZES = {"2m": (256, 2), "10m": (512, 3), "30m": (768, 4), "60m": (1024, 5), "120m": (1280, 6),
         "250m": (1536, 9)}
MODES = {
    "fp32": (1, ["precision.dtype=fp32"]),
    "fp16": (1, ["precision.dtype=fp16", "precision.param_dtype=compute"]),
    "shard2": (2, ["precision.dtype=fp32", "optim.shard_optimizer=true"]),
    # ZeRO-3 on 2 msrun workers: the weights themselves sliced, gathered in the model's graph
    "zero3": (2, ["precision.dtype=fp32", "optim.shard_parameters=true"]),
    # fp32, world 1, gradient accumulation: 2 micro-batches per step (train.micro_batch = batch / 2),
    # so the step is accumulate() twice and apply() (fp32 accumulation buffers), not the fused graph
    "accum": (1, ["precision.dtype=fp32"]),
}


class BadArgs(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, not argparse's usage block
        raise BadArgs(message)


def parse_size(s: str) -> tuple[int, int]:
    if s in SIZES:
        return SIZES[s]
    m = re.fullmatch(r"(\d+)x(\d+)", s)
    if not m or int(m.group(1)) % 64:
        raise BadArgs(f"--sizes: {s!r} is neither one of {', '.join(SIZES)} nor DIMxLAYERS with DIM a multiple of 64")
    return int(m.group(1)), int(m.group(2))


def has_shard_gradients() -> bool:
    from mspretrain.config.schema import OptimConfig

    return "shard_gradients" in {f.name for f in dataclasses.fields(OptimConfig)}


def overrides(size: tuple[int, int], mode: str, seq: int, batch: int, steps: int, micro: int = 0) -> list[str]:
    dim, layers = size
    world, extra = MODES[mode]
    if mode == "accum" and not micro:
        micro = batch // 2
    out = ["device.target=cpu", f"model.dim={dim}", f"model.n_layers={layers}", f"model.n_heads={dim // 64}", "model.n_kv_heads=0",
           f"model.max_seq_len={seq}", f"data.seq_len={seq}", f"train.global_batch={batch}", f"train.max_steps={steps}",
           "train.log_every=1000", "checkpoint.every=0", "eval.every=0", "schedule.warmup_steps=1", f"train.micro_batch={micro}", *extra]
    if mode == "shard2" and has_shard_gradients():
        out.append("optim.shard_gradients=true")
    return out


# --------------------------------------------------------------------------- in the worker

def _status() -> dict[str, int]:
    """VmRSS and VmHWM in bytes."""
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


class Probe:
    """Phase peaks: `mark(name)` records the VmHWM since the previous mark and resets it."""

    def __init__(self) -> None:
        self.base = 0
        self.phases: list[dict] = []
        self.peak = 0

    def start(self) -> None:
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS (Linux >= 4.0)
        self.base = _status()["VmRSS"]

    def mark(self, name: str) -> None:
        s = _status()
        self.peak = max(self.peak, s["VmHWM"])
        self.phases.append({"phase": name, "hwm": s["VmHWM"] - self.base, "rss": s["VmRSS"] - self.base})
        open("/proc/self/clear_refs", "w").write("5")


def worker(args: argparse.Namespace) -> int:
    import mindspore as ms

    from mspretrain.config import schema as cfgmod
    from mspretrain.step import step as stepmod
    from mspretrain.train.build import build_trainer
    from mspretrain.train.trainer import Trainer

    cfg = cfgmod.load(ROOT / "configs" / "tiny.toml", args.override)
    run_dir = Path(args.run)
    probe = Probe()
    if args.ms_set_memory:  # e.g. "0GB,0.1GB,1024GB,O1": MindSpore's pool knobs (set_memory), to try
        a = args.ms_set_memory.split(",")
        ms.runtime.set_memory(*a)

    # Attribute memory to the points between which it grows (in this process only): the model
    # built, TrainStep built (buffers, moments, masters), and each call of every graph compiled
    # with ms.jit (accumulate, apply, or one fused step; the first call of each includes its
    # compilation), whatever TrainStep's internals are called.
    orig_init = stepmod.TrainStep.__init__
    orig_jit = ms.jit

    def marked(fn, name):
        def call(*a, **k):
            out = fn(*a, **k)
            # Graphs run asynchronously, and synchronize() alone was seen returning before a fused
            # step's graph had finished: read the outputs to host, which waits for the graph.
            ms.runtime.synchronize()
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if hasattr(t, "asnumpy"):
                    t.asnumpy()
            probe.mark(f"step {trainer.step + 1} {name}")
            return out
        return call

    def jit(function=None, *a, **k):
        if function is None:
            return lambda f: jit(f, *a, **k)
        return marked(orig_jit(function, *a, **k), getattr(function, "__name__", "graph"))

    def init(self, *a, **k):
        probe.mark("model built")
        ms.jit = jit
        orig_init(self, *a, **k)
        probe.mark("TrainStep built (buffers, moments, masters)")

    stepmod.TrainStep.__init__ = init
    orig_step = Trainer.train_step

    def train_step(self):
        out = orig_step(self)
        probe.mark(f"step {self.step} end")
        # The final checkpoint save after the last step is not part of the step: stop here.
        if self.step >= self.total_steps:
            result["peak"] = probe.peak - probe.base
            result["rss_end"] = _status()["VmRSS"] - probe.base
            # How much of what is resident is cache rather than live tensors: MindSpore's pool
            # (empty_cache, documented for Ascend only) and glibc's free lists (malloc_trim).
            try:
                ms.runtime.empty_cache()
            except Exception as e:  # noqa: BLE001 - a diagnostic; report and go on
                result["empty_cache_error"] = str(e)[:200]
            result["rss_after_empty_cache"] = _status()["VmRSS"] - probe.base
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            result["rss_after_malloc_trim"] = _status()["VmRSS"] - probe.base
        return out

    Trainer.train_step = train_step
    # the baseline is taken before build_trainer, which makes the model and the step (after the
    # patches above) as well as the device and world setup and the data manifest read
    t0 = time.time()
    probe.start()
    trainer = build_trainer(cfg, args.data, run_dir, log=lambda s: None)
    rank = trainer.world.rank
    result: dict = {"rank": rank, "world": trainer.world.size, "baseline_rss": probe.base}
    trainer.train()
    result["phases"] = probe.phases
    from mspretrain.step.zero3 import gathered  # zero3: a rank holds slices; count the whole model

    whole = {name: int(math.prod(g.shape)) for name, g, _ in gathered(trainer.model)}
    result["params"] = sum(whole.get(p.name, int(p.size)) for p in trainer.model.trainable_params())
    result["seconds"] = time.time() - t0
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- in the parent

def planned(size: tuple[int, int], mode: str, seq: int, batch: int, steps: int, vocab: int, micro: int = 0,
            extra: list[str] | tuple[str, ...] = ()) -> dict:
    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight.plan import make_plan

    world = MODES[mode][0]
    cfg = cfgmod.load(ROOT / "configs" / "tiny.toml", overrides(size, mode, seq, batch, steps, micro) + list(extra) + [f"model.vocab_size={vocab}"])
    # memory does not depend on the budget; 100 steps keep any warm-up shorter than the run
    mem = make_plan(cfg, devices=world, tokens=100 * batch * seq, data_dir=None, tokens_per_s_per_device=None)["memory_bytes"]
    key = "peak" if "peak" in mem else "total"
    # the planner's stated term for MindSpore's CPU backend (device.target = cpu), when it has one
    backend = float(mem.get("cpu_backend", 0))
    return {"bytes": float(mem[key]), "key": key, "backend": backend,
            "parts": {k: float(v) for k, v in mem.items() if isinstance(v, (int, float))}}


def make_data(dest: Path) -> Path:
    """A small data dir (vocab 512) prepared from the tests' synthetic poem corpus."""
    from mspretrain.config import schema as cfgmod
    from mspretrain.prepare.prepare import prepare
    from tests.conftest import make_poems

    if (dest / "manifest.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    corpus = dest.parent / "poems.txt"
    corpus.write_text("\n\n".join(make_poems(1200)) + "\n", encoding="utf-8")
    prepare([str(corpus)], dest, cfgmod.load(ROOT / "configs" / "tiny.toml").prepare, workers=1, log=lambda s: None)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(script: Path, wargs: list[str], world: int, log_dir: Path) -> tuple[list[str], dict[str, str]] | None:
    """The command line and environment that run `script` with `wargs` in one process (world 1)
    or in `world` msrun workers on this host; None when msrun is not next to this interpreter."""
    py = sys.executable
    env = {**os.environ, "GLOG_v": "3"}
    if world == 1:
        return [py, str(script.resolve()), *wargs], env
    msrun = shutil.which("msrun", path=f"{Path(py).parent}:{os.environ.get('PATH', '')}")
    if msrun is None:
        return None
    env["PATH"] = f"{Path(py).parent}:{env.get('PATH', '')}"  # msrun runs `python` from PATH: this one first
    return [msrun, f"--worker_num={world}", f"--local_worker_num={world}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True", str(script.resolve()), *wargs], env


def run_one(size_name: str, mode: str, args: argparse.Namespace, data: Path, work: Path) -> list[dict]:
    size = parse_size(size_name)
    world = MODES[mode][0]
    tag = f"{size_name}-{mode}"
    out = work / tag
    run = work / f"run-{tag}"
    shutil.rmtree(run, ignore_errors=True)
    wargs = ["--bench-worker", "--data", str(data), "--run", str(run), "--out", str(out)]
    if args.ms_set_memory:
        wargs += ["--ms-set-memory", args.ms_set_memory]
    for o in overrides(size, mode, args.seq, args.batch, args.steps, args.micro) + list(args.set):
        wargs += ["--override", o]
    launch = command(Path(__file__), wargs, world, work / f"logs-{tag}")
    if launch is None:
        print(f"{tag}: skipped, msrun not found next to {sys.executable}")
        return []
    cmd, env = launch
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    files = sorted(work.glob(f"{tag}.rank*.json"))
    if proc.returncode != 0 or len(files) != world:
        logs = "".join(p.read_text()[-1500:] for p in sorted((work / f"logs-{tag}").glob("worker_*.log"))) if world > 1 else ""
        print(f"{tag}: FAILED (exit {proc.returncode})\n{(proc.stderr or '')[-2000:]}{logs}")
        return []
    res = [json.loads(p.read_text()) for p in files]
    for p in files:
        p.unlink()
    for r in res:
        r["wall_s"] = time.time() - t0
    return res


def slopes(rows: list[dict]) -> list[dict]:
    out = []
    rows = sorted(rows, key=lambda r: r["params"])
    pairs = list(zip(rows, rows[1:]))
    if len(rows) > 2:
        pairs.append((rows[0], rows[-1]))
    for a, b in pairs:
        dp = b["params"] - a["params"]
        meas = (b["peak"] - a["peak"]) / dp
        plan = (b["plan"] - a["plan"]) / dp
        tensors = plan - (b.get("plan_backend", 0.0) - a.get("plan_backend", 0.0)) / dp
        out.append({"from": a["size"], "to": b["size"], "measured_bytes_per_param": meas,
                    "planned_bytes_per_param": plan, "ratio": meas / plan if plan else float("nan"),
                    # the plan without its CPU-backend term: the tensors the step holds
                    "planned_tensors_bytes_per_param": tensors,
                    "ratio_tensors_only": meas / tensors if tensors else float("nan")})
    return out


def markdown(results: dict[str, list[dict]], summary: dict[str, list[dict]]) -> str:
    """The tables docs/benchmarks/memory.md shows (from the results of one run)."""
    out = ["| mode | params | measured peak | B/param | planned | B/param | TrainStep built | step 1 accumulate(s) / fused | step 1 apply "
           "| after empty_cache / malloc_trim |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, rows in results.items():
        for r in rows:
            ph = {p["phase"]: p["hwm"] for p in r["phases"]}
            built = ph.get("TrainStep built (buffers, moments, masters)", 0.0)
            first = [v for k, v in ph.items() if k.startswith("step 1 ") and not k.endswith(" end")]
            acc, app = (first + [0.0, 0.0])[:2]
            prev = [p["rss"] for p in r["phases"] if p["phase"].startswith("TrainStep built")]
            acc_inc = acc - (prev[0] if prev else 0.0)
            app_inc = app - acc if len(first) > 1 else 0.0
            trim = (f"{r['rss_after_empty_cache'] / GiB:.2f} / {r['rss_after_malloc_trim'] / GiB:.2f}"
                    if "rss_after_malloc_trim" in r else "—")
            out.append(f"| {mode} | {r['params'] / 1e6:.1f} M | {r['peak'] / GiB:.2f} GiB | {r['peak'] / r['params']:.0f} | "
                       f"{r['plan'] / GiB:.2f} GiB ({r['plan_key']}) | {r['plan'] / r['params']:.0f} | "
                       f"+{(built - ph.get('model built', 0.0)) / GiB:.2f} | +{acc_inc / GiB:.2f} | "
                       + (f"+{app_inc / GiB:.2f}" if len(first) > 1 else "—") + f" | {trim} |")
    out += ["", "| mode | sizes | measured B/param | planned B/param (of which CPU backend) | measured / planned "
            "| planned without the backend term | measured / that |", "|---|---|---:|---:|---:|---:|---:|"]
    for mode, rows in summary.items():
        for x in rows:
            tensors = x.get("planned_tensors_bytes_per_param", x["planned_bytes_per_param"])
            out.append(f"| {mode} | {x['from']} → {x['to']} | {x['measured_bytes_per_param']:.1f} | "
                       f"{x['planned_bytes_per_param']:.1f} ({x['planned_bytes_per_param'] - tensors:.1f}) | {x['ratio']:.2f} | "
                       f"{tensors:.1f} | {x.get('ratio_tensors_only', x['ratio']):.2f} |")
    return "\n".join(out)


def _vmhwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def whole_process(sizes: list[str], work: Path) -> int:
    """Issue 30: the whole `mspretrain train` process (start-up, steps, final eval and checkpoint)
    through the CLI with the tiny config's settings (device.target auto), its peak RSS (VmHWM,
    polled) against `mspretrain plan --json`'s `memory_bytes.process_peak` for the same command."""
    data = make_data(work / "data")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3"}
    rows = []
    for s in sizes:
        dim, layers = parse_size(s)
        ov = [f"model.dim={dim}", f"model.n_layers={layers}", f"model.n_heads={max(1, dim // 64)}", "train.max_steps=5"]
        base = ["--config", str(ROOT / "configs" / "tiny.toml"), "--data", str(data)]
        plan = json.loads(subprocess.run([sys.executable, "-m", "mspretrain.cli", "plan", *base, *ov, "--json"], env=env,
                                         capture_output=True, text=True, check=True).stdout)
        proc = subprocess.Popen([sys.executable, "-m", "mspretrain.cli", "train", *base, "--run", str(work / f"whole-{s}"), *ov],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _vmhwm(proc.pid))
            time.sleep(0.05)
        if proc.returncode:
            print(f"{s}: train failed: {proc.stderr.read().decode()[-800:]}", file=sys.stderr)
            return 1
        rows.append({"size": s, "params": plan["params"], "measured": peak, "planned": plan["memory_bytes"]["process_peak"],
                     "target": plan["target"]})
        r = rows[-1]
        print(f"{s:>6} {r['params'] / 1e6:6.1f} M params: whole process peak RSS {peak / GiB:.2f} GiB, plan ({r['target']}) "
              f"{r['planned'] / GiB:.2f} GiB, ratio {r['planned'] / peak:.2f}")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        print(f"{a['size']} -> {b['size']}: measured +{(b['measured'] - a['measured']) / GiB:.2f} GiB, "
              f"planned +{(b['planned'] - a['planned']) / GiB:.2f} GiB, ratio {(b['planned'] - a['planned']) / (b['measured'] - a['measured']):.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10m,60m,120m", help=f"comma list of {', '.join(SIZES)} or DIMxLAYERS")
    ap.add_argument("--modes", default="fp32,fp16,shard2,accum", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over the workers in shard2)")
    ap.add_argument("--micro", type=int, default=0,
                    help="train.micro_batch per rank (0 = no accumulation; 1 with --batch 4 = 4 micro-batches on one rank)")
    ap.add_argument("--work", help="scratch dir (data dir, runs); default: a temp dir, removed at the end")
    ap.add_argument("--ms-set-memory", metavar="INIT,INC,MAX,LEVEL",
                    help="call mindspore.runtime.set_memory(...) in each worker first (an experiment knob)")
    ap.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                    help="a config override for every run, e.g. optim.bucket_mb=64 (repeatable)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--whole-process", metavar="SIZES", help="e.g. 2m,60m: whole `mspretrain train` processes through the CLI "
                                                            "against plan's process_peak (issue 30)")
    ap.add_argument("--replan", metavar="FILE", action="append", default=[],
                    help="no runs: the saved output of earlier --json runs against the planner as it is now (repeatable)")
    ap.add_argument("--markdown", action="store_true", help="also print the tables docs/benchmarks/memory.md shows")
    # worker mode (one size x mode, run by the parent or by msrun)
    ap.add_argument("--bench-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--override", action="append", default=[], help=argparse.SUPPRESS)
    try:
        args = ap.parse_args(argv)
        if args.whole_process:
            work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="memory_bench-"))
            return whole_process([x for x in args.whole_process.split(",") if x], work)
        if args.bench_worker:
            return worker(args)
        if args.replan:
            return replan(args.replan, args.markdown)
        sizes = [s for s in args.sizes.split(",") if s]
        for s in sizes:
            parse_size(s)
        modes = [m for m in args.modes.split(",") if m]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes or not sizes:
            raise BadArgs(f"--modes: unknown {bad} (choose from {', '.join(MODES)})" if bad else "--sizes and --modes must not be empty")
        if args.steps < 2 or args.seq < 8 or args.batch < 2 or args.batch % 2:
            raise BadArgs("--steps >= 2, --seq >= 8 and an even --batch >= 2 are required")
        if args.micro < 0 or (args.micro and (args.batch // 2) % args.micro):
            raise BadArgs("--micro must divide --batch / 2 (the per-rank batch of the 2-worker mode)")
        if args.set:  # a bad override is one line here, not a traceback in every worker
            from mspretrain.config import schema as cfgmod
            from mspretrain.errors import UserError

            try:
                cfgmod.load(ROOT / "configs" / "tiny.toml", args.set)
            except UserError as e:
                raise BadArgs(f"--set: {e}") from None
    except BadArgs as e:
        print(f"memory_bench: {e}", file=sys.stderr)
        return 2

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="memory_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    data = make_data(work / "data")
    vocab = json.loads((data / "manifest.json").read_text())["vocab_size"]
    print(f"memory_bench: seq {args.seq}, global batch {args.batch}, micro-batch {args.micro or 'all'}, {args.steps} steps, vocab {vocab}; "
          f"shard_gradients key {'present' if has_shard_gradients() else 'absent'}; load {os.getloadavg()[0]:.1f}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for mode in modes:
        for s in sizes:
            res = run_one(s, mode, args, data, work)
            if not res:
                continue
            r = max(res, key=lambda r: r["peak"])  # the rank that needed most
            p = planned(parse_size(s), mode, args.seq, args.batch, args.steps, vocab, args.micro, args.set)
            row = {"size": s, "mode": mode, "params": r["params"], "peak": r["peak"], "rss_end": r["rss_end"],
                   "baseline_rss": r["baseline_rss"], "plan": p["bytes"], "plan_key": p["key"], "plan_parts": p["parts"],
                   "plan_backend": p["backend"],
                   "ranks_peak": [x["peak"] for x in res], "phases": r["phases"], "wall_s": r["wall_s"],
                   **{k: r[k] for k in ("rss_after_empty_cache", "rss_after_malloc_trim", "empty_cache_error") if k in r}}
            results[mode].append(row)
            print(f"{mode:7s} {s:>6s} {r['params'] / 1e6:7.1f} M params: measured peak {r['peak'] / GiB:6.2f} GiB "
                  f"({r['peak'] / r['params']:5.1f} B/param), planned {p['key']} {p['bytes'] / GiB:6.2f} GiB "
                  f"({p['bytes'] / r['params']:5.1f} B/param; CPU backend term {p['backend'] / GiB:.2f} GiB); "
                  f"baseline {r['baseline_rss'] / GiB:.2f} GiB; {r['wall_s']:.0f} s", flush=True)
            for ph in r["phases"]:
                print(f"          {ph['phase']:<46s} peak {ph['hwm'] / GiB:6.2f}  rss after {ph['rss'] / GiB:6.2f} GiB")
            if "rss_after_malloc_trim" in r:
                print(f"          after the last step: rss {r['rss_end'] / GiB:.2f}, after ms.runtime.empty_cache() "
                      f"{r['rss_after_empty_cache'] / GiB:.2f}, after malloc_trim(0) {r['rss_after_malloc_trim'] / GiB:.2f} GiB"
                      + (f" (empty_cache: {r['empty_cache_error']})" if "empty_cache_error" in r else ""))
    settings = {"seq": args.seq, "batch": args.batch, "steps": args.steps, "micro": args.micro, "vocab": vocab, "set": args.set}
    summary = report(results, args.markdown)
    if args.json:
        print(json.dumps({"settings": settings, "results": results, "slopes": summary}, indent=1))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(results: dict[str, list[dict]], md: bool) -> dict[str, list[dict]]:
    """Print the per-mode slopes (and the markdown tables); returns the slopes."""
    print("per-parameter slope (bytes/param between sizes), measured vs planned:")
    summary = {}
    for mode, rows in results.items():
        if len(rows) < 2:
            continue
        summary[mode] = slopes(rows)
        for s in summary[mode]:
            ok = abs(s["ratio"] - 1) <= 0.15
            print(f"  {mode:7s} {s['from']:>6s} -> {s['to']:<6s} measured {s['measured_bytes_per_param']:6.1f}, "
                  f"planned {s['planned_bytes_per_param']:6.1f}  ratio {s['ratio']:.2f} {'(within 15 %)' if ok else '(OFF by more than 15 %)'}"
                  f"; without the plan's CPU-backend term: planned {s['planned_tensors_bytes_per_param']:6.1f}, "
                  f"ratio {s['ratio_tensors_only']:.2f}")
    if md:
        print(markdown(results, summary))
    return summary


def replan(files: list[str], md: bool) -> int:
    """The measurements of saved runs (--json output) against the planner as it is now."""
    results: dict[str, list[dict]] = {}
    for f in files:
        text = Path(f).read_text()
        saved = json.JSONDecoder().raw_decode(text[text.index("{\n"):])[0]  # the --json block (anything after it ignored)
        st = saved["settings"]
        for mode, rows in saved["results"].items():
            for r in rows:
                p = planned(parse_size(r["size"]), mode, st["seq"], st["batch"], st["steps"], st["vocab"], st["micro"], st.get("set", []))
                r.update(plan=p["bytes"], plan_key=p["key"], plan_parts=p["parts"], plan_backend=p["backend"])
                results.setdefault(mode, []).append(r)
                print(f"{mode:7s} {r['size']:>6s} {r['params'] / 1e6:7.1f} M params: measured peak {r['peak'] / GiB:6.2f} GiB "
                      f"({r['peak'] / r['params']:5.1f} B/param), planned {p['key']} {p['bytes'] / GiB:6.2f} GiB "
                      f"({p['bytes'] / r['params']:5.1f} B/param; CPU backend term {p['backend'] / GiB:.2f} GiB)")
    report(results, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
