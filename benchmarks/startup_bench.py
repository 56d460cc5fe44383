"""Time to the first step and peak host memory per rank of `mspretrain train` on 2 msrun CPU ranks,
before and after issue 30's start-up changes, with the extrapolation to 7B x 8 ranks.

The data dir is a small prepared one whose train shard is replaced by a large synthetic one (random
ids below the vocabulary, written with the same ShardWriter as `prepare`), so the largest-id check
has real bytes to read. Three runs, each `mspretrain launch --nproc 2 -- train ... max_steps=1`:

    before    the code at --before (default /work/main: every rank, and msrun's scheduler, scans
              every shard), data dir without `max_token_id` (what that code's prepare wrote)
    old-data  this tree, the same data dir without the key: rank 0 alone scans
    after     this tree, data dir with `max_token_id` (what this tree's prepare writes): no scan

Per run: wall time from launch to the first metrics record (step 1), and each worker's and the
scheduler's peak RSS (VmHWM from /proc, polled every 0.1 s while the job runs; shard pages read by
the scan count there, as they do on a real node). Model initialisation on CPU puts the weights in
host memory because host memory is the device there; on Ascend each weight goes to HBM as it is
drawn (model/llama.py `_normal`), which this CPU box cannot show: the 7B lines below say what each
design holds on the host, from the parameter sizes.

    nice python benchmarks/startup_bench.py                       # 120M-parameter model, 600 MB shard
    python benchmarks/startup_bench.py --dim 256 --layers 2 --tokens 20e6   # smoke
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_bench, beside this file
from memory_bench import _vmhwm  # noqa: E402  (one reader of a process's peak RSS for both benches)

GiB = 1024**3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(work: Path, tokens: int) -> tuple[Path, Path]:
    """(data dir with max_token_id, the same without it): a prepared tiny dir, its train shard replaced."""
    from mspretrain import config as cfgmod
    from mspretrain.data.prepare import prepare
    from mspretrain.data.shards import ShardWriter
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


def run_once(code: Path, data: Path, work: Path, name: str, model_args: list[str]) -> dict:
    run = work / f"run-{name}"
    env = {**os.environ, "PYTHONPATH": str(code), "GLOG_v": "3"}
    cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", "2", "--master-port", str(_free_port()),
           "--log-dir", str(work / f"msrun-{name}"), "--", "train", "--config", str(ROOT / "configs" / "tiny.toml"),
           "--data", str(data), "--run", str(run), "train.max_steps=1", "eval.every=0", "device.target=cpu",
           "checkpoint.every=0", "schedule.warmup_steps=0", *model_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    peaks: dict[str, int] = {}
    first_step = None
    try:
        while proc.poll() is None and time.perf_counter() - t0 < 900:
            for pid in _children(proc.pid):
                role = _role(pid)
                if role:
                    peaks[role] = max(peaks.get(role, 0), _vmhwm(pid))
            if first_step is None and (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip():
                first_step = time.perf_counter() - t0
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    if proc.returncode != 0:
        logs = "".join(p.read_text(errors="replace")[-1500:] for p in sorted((work / f"msrun-{name}").glob("worker_*.log")))
        raise SystemExit(f"{name}: train failed ({proc.returncode}): {logs}")
    return {"first_step_s": first_step, "total_s": time.perf_counter() - t0, "peak_rss": peaks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="/work/main", help="source tree of the code before the change")
    ap.add_argument("--dim", type=int, default=1280)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=float, default=300e6, help="tokens in the synthetic train shard (uint16: 2 bytes each)")
    args = ap.parse_args()
    from mspretrain.config import ModelConfig, resolve_model
    from mspretrain.model.presets import param_count, param_shapes, preset

    model_args = [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.dim // 64}",
                  "model.n_kv_heads=0", "model.ffn_dim=0", "train.global_batch=4", "train.micro_batch=2", "data.seq_len=64"]
    params = param_count(resolve_model(ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64), vocab_size=512))
    with tempfile.TemporaryDirectory(prefix="startup_bench_") as tmp:
        work = Path(tmp)
        new, old = make_data(work, int(args.tokens))
        shard_gb = (new / "train.bin").stat().st_size / GiB
        print(f"model {params / 1e6:.0f} M parameters ({params * 4 / GiB:.2f} GiB fp32); train shard {shard_gb:.2f} GiB; 2 msrun CPU ranks")
        results = {"before": run_once(Path(args.before), old, work, "before", model_args),
                   "old-data": run_once(ROOT, old, work, "old-data", model_args),
                   "after": run_once(ROOT, new, work, "after", model_args)}
    for name, r in results.items():
        peaks = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(r["peak_rss"].items()))
        print(f"{name:<9} first step {r['first_step_s']:.1f} s (exit {r['total_s']:.1f} s); peak RSS GiB: {peaks}")
    b, a = results["before"], results["after"]
    ranks = lambda r: [v for k, v in r["peak_rss"].items() if k.startswith("rank")]
    print(f"ratio after/before: first step {a['first_step_s'] / b['first_step_s']:.2f}, "
          f"largest rank RSS {max(ranks(a)) / max(ranks(b)):.2f}, "
          f"all processes {sum(a['peak_rss'].values()) / sum(b['peak_rss'].values()):.2f}")
    # 7B x 8 ranks on one node, from the sizes (the Ascend side cannot run here)
    shapes = param_shapes(resolve_model(preset("llama2-7b")))
    sizes = [int(np.prod(s)) for _, s in shapes]
    p7 = sum(sizes)
    print(f"7B x 8 ranks, host memory for initialisation: before 8 x {p7 * 4 / GiB:.1f} = {8 * p7 * 4 / GiB:.0f} GiB "
          f"(every rank builds the fp32 model on the host); after 8 x {max(sizes) * 4 / GiB:.2f} = {8 * max(sizes) * 4 / GiB:.1f} GiB "
          f"(one parameter at a time on its way to HBM), against one fp32 model = {p7 * 4 / GiB:.1f} GiB")
    data7 = 120e9 * 2 / GiB
    print(f"7B x 8 ranks, largest-id check at 120 B uint16 tokens ({data7:.0f} GiB): before 9 x {data7:.0f} GiB read "
          f"(8 ranks + the scheduler) before init; after 0 (recorded at prepare), or 1 x on rank 0 for an old data dir")


if __name__ == "__main__":
    main()
