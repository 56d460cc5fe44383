"""Time to the first step and peak host memory per rank of `mspretrain train` on 2 msrun CPU ranks,
before and after issue 30's start-up changes, with the extrapolation to 7B x 8 ranks.

The data dir is a small prepared one whose train shard is replaced by a large synthetic one (random
ids below the vocabulary, written with the same ShardWriter as `prepare`), so the largest-id check
has real bytes to read. Three runs, each `mspretrain launch --nproc 2 -- train ... max_steps=1`:

    before    the code at --before (a checkout of the code before issue 30, e.g.
              `git worktree add /work/wt-before a924baa`: every rank, and msrun's scheduler, scans
              every shard), data dir without `max_token_id` (what that code's prepare wrote)
    old-data  this tree, the same data dir without the key: rank 0 alone scans
    after     this tree, data dir with `max_token_id` (what this tree's prepare writes): no scan

Per run, polled every 0.1 s from /proc: the wall time from launch to rank 0's start banner (model
built, optimizer state allocated: the end of initialisation) and to both ranks' step-1 log lines
(the run is then killed: the final eval and checkpoint are not part of start-up); per process (each
rank, msrun's scheduler) VmHWM at the end of initialisation, VmHWM at the end (the peak), and the
peak of RssFile (mapped files: libraries, plus every shard page a largest-id scan touched, which is
how the scan shows which processes read the data).

Model initialisation on CPU puts the weights in host memory because host memory is the device
there: a rank's RSS at the end of initialisation is one fp32 model plus a constant process baseline.
On Ascend each weight goes to HBM as it is drawn (model/decoder.py `_normal`), which this CPU box
cannot show: the 7B lines say what each design holds on the host, from the parameter sizes. The
first step on CPU adds MindSpore's CPU backend's resident term (`mspretrain plan`: "CPU backend
term", about 5.5 bytes per parameter), which is the step's device memory, not initialisation.

    nice python benchmarks/startup_bench.py                       # 120M-parameter model, 600 MB shard
    python benchmarks/startup_bench.py --dim 256 --layers 2 --tokens 20e6   # smoke
    # 1B (1.01 B, dim 2048 x 20): initialisation only; the step of two 1B ranks (~9.5 GB each) does not
    # fit a 24 GB box next to other work. Only the norms train, so no gradients or Adam state exist
    # for the matrices (the model is still built, initialised and stepped in full):
    nice python benchmarks/startup_bench.py --dim 2048 --layers 20 --set 'train.trainable=["norms"]' --stop-after-init
    nice python benchmarks/startup_bench.py --dim 2048 --layers 14 --set 'train.trainable=["norms"]'   # 0.71 B, to step 1

`--init` (issue 38, item 2) times only the model's construction on the Ascend path, in one process
per source tree (this one and --before), on this CPU box: `get_current_device` says Ascend and
`Tensor.to("Ascend")` becomes `to("CPU")`, a real copy into a new buffer as the host-to-device copy
is. Per tree: ns per parameter for the whole build and for the build with the draw replaced by
`np.ones` (what the tree adds to the draw), how many weights `Parameter.__new__` rebuilt through
`asnumpy()` (its rc != 4 branch, mindspore/common/parameter.py l.377-394), and the 7B x 8-rank
extrapolation, (draw + the tree's rest) x parameters. A tree with `InitStreams` (the parallel,
counter-based draw) is built once per `--threads` count (MSPRETRAIN_INIT_THREADS), and its draw
alone is timed at each count too (the ratio is the draw's speed-up on this box); the 7B line
divides the one-thread draw by `--cores-per-rank` (an assumed host, linear scaling assumed):

    git archive HEAD~1 mspretrain | tar -x -C /tmp/before     # the tree before the change
    nice python benchmarks/startup_bench.py --init --before /tmp/before --dim 1024 --layers 8
    python benchmarks/startup_bench.py --init --before /tmp/before --dim 1024 --layers 8 --threads 1,2
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("GLOG_v", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 1024**3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(work: Path, tokens: int) -> tuple[Path, Path]:
    """(data dir with max_token_id, the same without it): a prepared tiny dir, its train shard replaced."""
    from mspretrain.config import schema as cfgmod
    from mspretrain.data.shards import ShardWriter
    from mspretrain.prepare.prepare import prepare
    from tests.conftest import TINY, make_poems

    corpus = work / "poems.txt"
    corpus.write_text("\n\n".join(make_poems(600)) + "\n", encoding="utf-8")
    new = work / "data-new"
    prepare([str(corpus)], new, cfgmod.load(TINY).prepare, workers=1, log=lambda s: None)
    manifest = json.loads((new / "manifest.json").read_text())
    vocab, dtype = manifest["vocab_size"], manifest["token_dtype"]
    rng = np.random.default_rng(0)
    (new / "train.bin").unlink()
    (new / "train.idx").unlink()
    with ShardWriter(new / "train", dtype) as w:
        left = tokens
        while left:
            n = min(left, 1 << 24)
            ids = rng.integers(0, vocab, n).astype(dtype)
            w.add_flat(ids, np.full(n // 4096, 4096, np.int32) if n % 4096 == 0 else np.array([n], np.int32))
            left -= n
        w.finalize()
        top = w.max_token
    manifest["tokens"]["train"] = tokens
    manifest["max_token_id"] = {**manifest.get("max_token_id", {}), "train": top}
    (new / "manifest.json").write_text(json.dumps(manifest, indent=1))
    old = work / "data-old"
    shutil.copytree(new, old)
    del manifest["max_token_id"]
    (old / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return new, old


def _children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(x) for x in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _role(pid: int) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    d = dict(e.split(b"=", 1) for e in env if b"=" in e)
    role = d.get(b"MS_ROLE", b"").decode()
    return "scheduler" if role == "MS_SCHED" else f"rank {d.get(b'RANK_ID', b'?').decode()}" if role == "MS_WORKER" else ""


def _status(pid: int) -> dict[str, int]:
    """VmHWM (peak RSS), VmRSS, RssAnon (allocated: weights, state) and RssFile (mapped files:
    libraries, and the shard pages a largest-id scan touches) of a process, in bytes."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _log_has(path: Path, needle: str) -> bool:
    try:
        return needle in path.read_text(errors="replace")
    except OSError:
        return False


def run_once(code: Path, data: Path, work: Path, name: str, model_args: list[str], *, stop_after_init: bool = False) -> dict:
    """One `launch --nproc 2 -- train`, stopped (SIGKILL to each process) once both ranks have
    logged step 1: what is measured is the start-up and the first step, not the final eval and
    checkpoint. Per process, polled every 20 ms until the model is built, then every 0.1 s: the peak RSS (VmHWM), the peak of mapped-file
    pages (RssFile: libraries plus any shard pages read by a largest-id scan), and VmHWM at the
    moment rank 0's start banner appears in its log (model built, optimizer state allocated, before
    the first step's compilation): the initialisation's peak. `stop_after_init`: stop there (a model
    whose step does not fit the machine twice can still show its initialisation)."""
    run = work / f"run-{name}"
    logs = work / f"msrun-{name}"
    env = {**os.environ, "PYTHONPATH": str(code), "GLOG_v": "3"}
    cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", "2", "--master-port", str(_free_port()),
           "--log-dir", str(logs), "--", "train", "--config", str(ROOT / "configs" / "tiny.toml"),
           "--data", str(data), "--run", str(run), "train.max_steps=1", "eval.every=0", "device.target=cpu",
           "checkpoint.every=0", "schedule.warmup_steps=0", *model_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    peaks: dict[str, int] = {}
    file_peaks: dict[str, int] = {}
    at_init: dict[str, int] = {}
    init_s = first_step = None
    low_mem = False
    try:
        while proc.poll() is None and time.perf_counter() - t0 < 1800:
            for pid in _children(proc.pid):
                role = _role(pid)
                if role:
                    st = _status(pid)
                    peaks[role] = max(peaks.get(role, 0), st.get("VmHWM", 0))
                    file_peaks[role] = max(file_peaks.get(role, 0), st.get("RssFile", 0))
            if init_s is None and _log_has(logs / "worker_0.log", "; micro-batch "):
                init_s, at_init = time.perf_counter() - t0, {k: v for k, v in peaks.items() if k.startswith("rank")}
                if stop_after_init:
                    break
            if _log_has(logs / "worker_0.log", "step 1/") and _log_has(logs / "worker_1.log", "rank=1 step=1"):
                first_step = time.perf_counter() - t0
                break
            if _available() < MIN_AVAILABLE[0]:  # the box is shared: never push it into the OOM killer
                low_mem = True
                break
            # 20 ms until the model is built: a scan of the shard maps its pages for a fraction of a second
            time.sleep(0.02 if init_s is None else 0.1)
    finally:
        _kill_tree(proc)
    if first_step is None and (init_s is None or not (stop_after_init or low_mem)):
        tail = "".join(p.read_text(errors="replace")[-1500:] for p in sorted(logs.glob("worker_*.log")))
        why = f"stopped: under {MIN_AVAILABLE[0] / GiB:g} GiB of memory available on the machine" if low_mem else f"train failed ({proc.returncode})"
        raise SystemExit(f"{name}: {why}: {tail}")
    low = f"after init: under {MIN_AVAILABLE[0] / GiB:g} GiB available"
    stopped = None if first_step is not None else "after init (--stop-after-init)" if stop_after_init else low
    return {"init_s": init_s, "first_step_s": first_step, "stopped": stopped, "peak_rss": peaks, "peak_file": file_peaks,
            "init_rss": at_init}


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL msrun and every process under it, and wait until they are gone (their memory is
    free before the next run starts). msrun starts its workers with os.setsid (mindspore/parallel/
    cluster/process_entity/_api.py), so they are not in msrun's process group: each by its pid."""
    pids = _children(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
    deadline = time.time() + 60
    while time.time() < deadline and any(Path(f"/proc/{pid}").exists() and _status(pid) for pid in pids):
        time.sleep(0.2)


MIN_AVAILABLE = [3 * GiB]  # set from --min-available-gib


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


INIT_PROBE = r"""
import json, sys, time
import mindspore as ms
import numpy as np
from mindspore import Tensor
from mindspore.common import parameter as P
from mspretrain.config.schema import ModelConfig, resolve_model
try:  # the model class is `Decoder` in model/decoder.py since issue 40; `Llama` in model/llama.py in older trees
    from mspretrain.model import decoder as llama
    Model = llama.Decoder
except (ImportError, AttributeError):
    from mspretrain.model import llama
    Model = llama.Llama
from mspretrain.model.presets import param_count

dim, layers, vocab = (int(a) for a in sys.argv[1:4])
draw = sys.argv[4] == "draw"
to_device = Tensor.to
Tensor.to = lambda self, device, *a, **k: to_device(self, "CPU")  # a real copy, as the H2D one is
class _NPU:
    device_target = "Ascend"
ms.get_current_device = lambda: _NPU()
new_args = P.Parameter._get_parameter_new_args
copies = []
def counted(data, rc, init_param=True):
    if isinstance(data, Tensor) and not data.has_init and rc != 4 and data.size > 4096:  # weights, not norms
        copies.append(data.size)
    return new_args(data, rc, init_param)
P.Parameter._get_parameter_new_args = staticmethod(counted)
class _Ones:  # everything but the draw: arrays written once (their pages touched), no random numbers
    def standard_normal(self, shape, dtype):
        return np.ones(shape, dtype)
if not draw and hasattr(llama, "InitStreams"):  # the counter-based draw (issue 38)
    llama.InitStreams.draw = lambda self, shape, std: np.ones(shape, np.float32)
elif not draw:
    llama.np.random.default_rng = lambda seed: _Ones()  # numpy's module: this process only
cfg = resolve_model(ModelConfig(dim=dim, n_layers=layers, n_heads=dim // 64), vocab_size=vocab)
params = param_count(cfg)
Model(resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=1), vocab_size=64), dtype="fp16", device="ascend")  # warm-up
t = time.perf_counter()
model = Model(cfg, dtype="fp16", device="ascend", seed=0)
build = time.perf_counter() - t
print(json.dumps({"params": params, "ns_per_param": build / params * 1e9, "host_copies": len(copies),
                  "copied_params": sum(copies),
                  "threads": llama.init_threads() if hasattr(llama, "init_threads") else 1}))
"""


def _bare_draw_ns() -> float:
    """numpy's float32 ziggurat on one PCG64 stream, ns per value (the draw before issue 38)."""
    rng, n = np.random.default_rng(0), 1 << 24
    t = time.perf_counter()
    rng.standard_normal(n, dtype=np.float32)
    return (time.perf_counter() - t) / n * 1e9


def _streams_draw_ns(threads: int) -> float | None:
    """This tree's counter-based draw (model/decoder.py InitStreams) of 2^25 values with `threads`
    threads, ns per value (a fresh array, as a weight's: its pages are touched too), or None
    when the tree has no InitStreams."""
    from mspretrain.model import decoder

    if not hasattr(decoder, "InitStreams"):
        return None
    n = 1 << 25
    t = time.perf_counter()
    decoder.InitStreams(0, threads=threads).draw((n,), 0.02)
    return (time.perf_counter() - t) / n * 1e9


def _gil_check() -> tuple[float, float]:
    """Whether the draw releases the GIL, independently of free cores: a pure-Python loop's rate in
    the main thread (iterations/s) while another thread runs one 2^26-value `standard_normal(out=,
    dtype=float32)` fill, and while it runs a pure-Python sum (which holds the GIL but for the
    interpreter's 5 ms switches). A fill that released nothing would leave the loop as starved."""
    import threading

    out = np.empty(1 << 26, np.float32)

    def fill() -> None:
        np.random.Generator(np.random.PCG64(np.random.SeedSequence(0, spawn_key=(0, 0)))).standard_normal(
            out=out, dtype=np.float32)

    rates = []
    for fn in (fill, lambda: sum(range(30_000_000))):
        t, n = threading.Thread(target=fn), 0
        t0 = time.perf_counter()
        t.start()
        while t.is_alive():
            n += 1
        rates.append(n / (time.perf_counter() - t0))
    return rates[0], rates[1]


def init_bench(trees: dict[str, Path], dim: int, layers: int, vocab: int, repeat: int, threads: list[int],
               cores_per_rank: int) -> None:
    """Issue 38, item 2: the model build on the (simulated) Ascend path, per source tree (and per
    thread count where the tree draws in parallel): the whole build, and the build with the draw
    replaced by np.ones (what the tree costs on top of the draw)."""
    from mspretrain.model.presets import param_count, preset

    def model_file(tree: Path) -> Path:  # model/llama.py before issue 40's rename
        new = tree / "mspretrain" / "model" / "decoder.py"
        return new if new.exists() and "class Decoder" in new.read_text() else tree / "mspretrain" / "model" / "llama.py"

    parallel = {name: model_file(tree).read_text().count("class InitStreams") > 0 for name, tree in trees.items()}
    runs = [(name, mode, t) for name in trees for mode, t in
            ([("draw", t) for t in threads] + [("ones", threads[0])] if parallel[name] else [("draw", 1), ("ones", 1)])]
    best: dict[tuple[str, str, int], dict] = {}
    draws: list[float] = []
    streams: dict[int, list[float]] = {t: [] for t in threads}
    for _ in range(repeat):  # alternated, the fastest of each kept: the box is shared, its noise is one-sided
        for name, mode, t in runs:
            env = {**os.environ, "PYTHONPATH": str(trees[name]), "GLOG_v": "3", "MSPRETRAIN_INIT_THREADS": str(t)}
            out = subprocess.run([sys.executable, "-c", INIT_PROBE, str(dim), str(layers), str(vocab), mode],
                                 env=env, cwd=trees[name], capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            if (name, mode, t) not in best or r["ns_per_param"] < best[name, mode, t]["ns_per_param"]:
                best[name, mode, t] = r
        draws.append(_bare_draw_ns())
        for t in threads:
            ns = _streams_draw_ns(t)
            if ns is not None:
                streams[t].append(ns)
    draw = min(draws)
    print(f"bare numpy draw, one PCG64 stream (float32 ziggurat, the draw before issue 38): {draw:.1f} ns per value "
          f"(fastest of {len(draws)})")
    sdraw = {t: min(v) for t, v in streams.items() if v}
    for t, ns in sdraw.items():
        print(f"counter-based draw (InitStreams, 2^20-value blocks), {t} thread(s): {ns:.2f} ns per value"
              + (f", {sdraw[threads[0]] / ns:.2f}x the {threads[0]}-thread rate" if t != threads[0] else ""))
    if sdraw:
        fill, held = _gil_check()
        print(f"GIL: a pure-Python loop in the main thread runs {fill:,.0f} iterations/s while another thread fills "
              f"2^26 normals, {held:,.0f}/s while it runs Python code ({fill / held:.0f}x): the fill releases the GIL")
    rest = {}
    for name, mode, t in runs:
        if mode != "draw":
            continue
        whole, ones = best[name, "draw", t], best[name, "ones", threads[0] if parallel[name] else 1]
        rest[name] = ones["ns_per_param"]
        label = f"{name} ({t} thread{'s' if t > 1 else ''})" if parallel[name] else name
        print(f"{label:<17} {whole['params'] / 1e6:.0f} M parameters: whole build {whole['ns_per_param']:.1f} ns per "
              f"parameter; without the draw {ones['ns_per_param']:.1f} ns (fastest of {repeat} each); weights rebuilt "
              f"from a host copy by Parameter.__new__: {whole['host_copies']} ({whole['copied_params'] / 1e6:.0f} M "
              f"parameters)", flush=True)
        if parallel[name] and t != threads[0]:
            print(f"{'':<17} whole build, {threads[0]} / {t} threads: "
                  f"{best[name, 'draw', threads[0]]['ns_per_param'] / whole['ns_per_param']:.2f}x")
    for model in ("llama2-7b", "qwen2.5-7b"):
        p7 = param_count(preset(model))
        cells = []
        for name, ns in rest.items():
            if parallel[name] and threads[0] in sdraw:
                eff = min(cores_per_rank, 32)
                one = sdraw[threads[0]] * threads[0]  # one thread's ns per value
                cells.append(f"{name} ({one:.1f} / {eff} + {ns:.1f}) ns x {p7 / 1e9:.2f} B = "
                             f"{(one / eff + ns) * p7 / 1e9:.0f} s (assuming {cores_per_rank} host cores per rank "
                             f"and a linear speed-up)")
            else:
                cells.append(f"{name} ({draw:.1f} + {ns:.1f}) ns x {p7 / 1e9:.2f} B = {(draw + ns) * p7 / 1e9:.0f} s")
        print(f"{model}, 8 ranks, each drawing the whole model at once (no rank waits for another): per rank and "
              f"node wall time {'; '.join(cells)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="/work/wt-before", help="source tree of the code before the change")
    ap.add_argument("--dim", type=int, default=1280)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=float, default=300e6, help="tokens in the synthetic train shard (uint16: 2 bytes each)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help='extra train overrides for every run, e.g. train.trainable=["norms"]')
    ap.add_argument("--min-available-gib", type=float, default=3.0,
                    help="stop a run when the machine's available memory falls under this (default 3)")
    ap.add_argument("--runs", default="before,old-data,after", help="which runs, comma-separated")
    ap.add_argument("--stop-after-init", action="store_true",
                    help="stop each run when the model is built (its step does not fit this machine twice)")
    ap.add_argument("--init", action="store_true", help="time only the model build on the simulated Ascend path")
    ap.add_argument("--vocab", type=int, default=32000, help="--init: vocabulary size")
    ap.add_argument("--repeat", type=int, default=3, help="--init: builds per tree, alternated; the fastest is kept")
    ap.add_argument("--threads", default="1,2", help="--init: draw threads to time the parallel draw at (comma-separated)")
    ap.add_argument("--cores-per-rank", type=int, default=24,
                    help="--init: host cores per rank assumed for the 7B line (default 24: 192 cores / 8 ranks)")
    args = ap.parse_args()
    if args.init:
        trees = {"before": Path(args.before), "after": ROOT} if Path(args.before).exists() else {"after": ROOT}
        init_bench(trees, args.dim, args.layers, args.vocab, args.repeat,
                   [int(t) for t in args.threads.split(",")], args.cores_per_rank)
        return
    MIN_AVAILABLE[0] = int(args.min_available_gib * GiB)
    from mspretrain.config.schema import ModelConfig, resolve_model
    from mspretrain.model.presets import param_count, param_shapes, preset

    model_args = [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.dim // 64}",
                  "model.n_kv_heads=0", "model.ffn_dim=0", "train.global_batch=4", "train.micro_batch=2",
                  "data.seq_len=64", *args.set]
    params = param_count(resolve_model(ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64), vocab_size=512))
    model_gib = params * 4 / GiB
    wanted = args.runs.split(",")
    with tempfile.TemporaryDirectory(prefix="startup_bench_") as tmp:
        work = Path(tmp)
        new, old = make_data(work, int(args.tokens))
        shard_gb = (new / "train.bin").stat().st_size / GiB
        print(f"model {params / 1e6:.0f} M parameters ({model_gib:.2f} GiB fp32), dim {args.dim} x {args.layers} layers; "
              f"train shard {shard_gb:.2f} GiB; 2 msrun CPU ranks; {' '.join(args.set) or 'every parameter trained'}", flush=True)
        plan = {"before": (Path(args.before), old), "old-data": (ROOT, old), "after": (ROOT, new)}
        results = {}
        for name in wanted:
            results[name] = run_once(plan[name][0], plan[name][1], work, name, model_args, stop_after_init=args.stop_after_init)
            print(f"  {name}: {json.dumps(results[name])}", flush=True)
    print("run        init  1st step | per process (GiB): RSS at init end / peak RSS / peak mapped-file pages")
    for name, r in results.items():
        cells = []
        for k in sorted(r["peak_rss"]):
            init = f"{r['init_rss'][k] / GiB:.2f}" if k in r["init_rss"] else "-"
            cells.append(f"{k} {init} / {r['peak_rss'][k] / GiB:.2f} / {r['peak_file'][k] / GiB:.2f}")
        init_s = f"{r['init_s']:.0f} s" if r["init_s"] is not None else "-"
        first = f"{r['first_step_s']:4.0f} s" if r["first_step_s"] is not None else "-"
        print(f"{name:<9} {init_s:>6} {first:>8} | {'; '.join(cells)}" + (f"  (stopped {r['stopped']})" if r["stopped"] else ""))
    ranks = lambda r, key: [v for k, v in r[key].items() if k.startswith("rank")]
    if "before" in results and "after" in results and None not in (results["before"]["first_step_s"], results["after"]["first_step_s"]):
        b, a = results["before"], results["after"]
        print(f"ratio after/before: first step {a['first_step_s'] / b['first_step_s']:.2f}, "
              f"largest rank's peak RSS {max(ranks(a, 'peak_rss')) / max(ranks(b, 'peak_rss')):.2f}, "
              f"all processes' peaks {sum(a['peak_rss'].values()) / sum(b['peak_rss'].values()):.2f}")
    for name, r in results.items():
        if r["init_rss"]:
            top = max(ranks(r, "init_rss"))
            print(f"{name}: largest rank's RSS at init end {top / GiB:.2f} GiB = {top / (params * 4):.2f} x one fp32 model "
                  f"({model_gib:.2f} GiB); + {(top - params * 4) / GiB:.2f} GiB that does not scale with the model "
                  f"(Python, MindSpore, tokenizer, loader)")
    # the largest-id scan, seen as mapped shard pages: which processes read the shard
    # (against the same process's smallest peak over the runs: its libraries)
    lib = {k: min(r["peak_file"].get(k, 1 << 62) for r in results.values()) for k in results[wanted[0]]["peak_file"]}
    for name, r in results.items():
        readers = [k for k, v in sorted(r["peak_file"].items()) if v - lib.get(k, v) > 0.5 * shard_gb * GiB]
        print(f"{name}: processes that read the whole {shard_gb:.2f} GiB shard before init: {', '.join(readers) or 'none'}")
    # 7B x 8 ranks on one node, from the sizes (the Ascend side cannot run here)
    shapes = param_shapes(resolve_model(preset("llama2-7b")))
    sizes = [int(np.prod(s)) for _, s in shapes]
    p7 = sum(sizes)
    print(f"7B x 8 ranks, host memory for initialisation: before 8 x {p7 * 4 / GiB:.1f} = {8 * p7 * 4 / GiB:.0f} GiB "
          f"(every rank builds the fp32 model on the host); after 8 x {max(sizes) * 4 / GiB:.2f} = {8 * max(sizes) * 4 / GiB:.1f} GiB "
          f"(one parameter at a time on its way to HBM), against one fp32 model = {p7 * 4 / GiB:.1f} GiB")
    data7 = 120e9 * 2 / GiB
    print(f"7B x 8 ranks, largest-id check at 120 B uint16 tokens ({data7:.0f} GiB): before 9 x {data7:.0f} GiB read "
          f"(8 ranks + the scheduler) before init, {data7 * GiB / 3e9:.0f} s each at 3 GB/s (this box's page-cache rate, "
          f"data/manifest.py), 9 x from one disk at once; after 0 (recorded at prepare), or 1 x on rank 0 for an old data dir")
    ns = _bare_draw_ns()
    print(f"7B x 8 ranks, drawing the weights: {ns:.0f} ns per value here on one thread (every rank draws every "
          f"weight so they stay bit-identical; issue 38 splits each rank's draw over its cores: see --init) = "
          f"{p7 * ns / 1e9:.0f} s per rank for {p7 / 1e9:.2f} B parameters on one thread; {params * ns / 1e9:.0f} s of "
          f"this run's init time for {params / 1e9:.2f} B on one thread")


if __name__ == "__main__":
    main()
