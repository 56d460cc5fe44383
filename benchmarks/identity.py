"""Before/after identity of `prepare` and `train` (issue 50's bar: byte-identical prepare outputs
and bit-identical training, every family, plain, ZeRO-2, ZeRO-3 and tp), through the command line only.

    python benchmarks/identity.py --out after.json
    python benchmarks/identity.py --compare benchmarks/identity_baseline.json   # exit 1 on any difference

Only the CLI contract is used (`python -m mspretrain.cli prepare|quality|train|launch` as
subprocesses, of the tree this file sits in), so the check survives any internal refactor. Nothing
of the project is imported.

What is fingerprinted (one JSON file, one entry per name; `--compare` says same/different per entry):
- `prepare/models`: the quality classifier and n-gram LM that `quality train` / `quality lm` write
  from a corpus generated here (every byte of the .npz and .sha256 files).
- `prepare/RUN`: the sha256 of every file of each data dir `prepare` writes (manifest.json
  included: it names input paths, so `--base` must be the same for two runs compared; the default
  is). The corpus (written deterministically from fixed seeds) has exact and near duplicates across
  files, a .jsonl, HTML, URLs and e-mails, junk that the heuristic filters, the classifier and the
  perplexity band drop, English lines for the language filter, an undecodable line and an empty file,
  and an eval set whose questions quote corpus lines (decontamination). `filters-killed` is
  `filters` killed with SIGKILL in its `dedup resolved` stage (the test-only hooks
  MSPRETRAIN_PREPARE_TEST_POINTS / _KILL of docs/operators.md) then rerun: it must equal `filters`.
- `train/FAMILY/LAYOUT`: a tiny model (2 layers, dim 64, vocab 500, seq 32, global batch 4, 3
  steps, weight decay on) trained on the `filters` data dir. Per run:
  `metrics`: for each step, the exact float repr of loss, grad_norm, lr and (fp16) loss_scale;
  `FILE.safetensors` for each safetensors file of the final checkpoint: the sha256 over its tensors
  in sorted name order, each fed as name, dtype, shape and raw bytes (not the file's bytes: the
  header's JSON key order and metadata may legitimately change), plus a 16-hex digest per tensor so a
  difference names the tensors; `STATE.json`: train_state.json and data_state.json as canonical JSON
  (sorted keys). Other files of the run (train.log, tb/, the manifest with its file hashes) hold times
  or sizes and are not compared.
  Layouts: `plain` (one process), `zero2` (optim.shard_gradients, 2 ranks, 2 micro-batches each and
  embedding/lm_head split into per-rank slices by optim.split_mb), `zero3` (optim.shard_parameters,
  2 ranks) and `tp2` (parallel.tp=2, 2 ranks), for the dense families llama2, llama3 (GQA,
  Llama-3.1 RoPE scaling, tied embeddings), qwen2 (q/k/v bias), qwen3 (QK-norm, explicit head_dim),
  mistral (sliding window 16 < seq 32); the MoE families qwen3_moe and qwen2_moe (shared expert)
  plain only (train refuses ZeRO and tp for them). Extras on llama2: fp16 compute with fp32 masters
  and a static loss scale (plain and zero3), and frozen groups (train.trainable = embeddings, lm_head).
Every 2-rank run goes through `mspretrain launch --nproc 2` (msrun), one job at a time.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
DEFAULT_BASE = Path("/tmp/mspretrain-identity")

# --------------------------------------------------------------------------- processes


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`cmd` in its own session; afterwards every process it left (msrun's workers sit in their own
    groups) is killed by pid, so a timeout or a SIGKILLed run leaves nothing behind."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3",
         "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    for k in [k for k in e if k.startswith("MSPRETRAIN_PREPARE_TEST") or k == "MSPRETRAIN_PREPARE_COMMIT_SECONDS"]:
        if not env or k not in env:
            del e[k]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=ROOT,
                            start_new_session=True)
    kids: list[psutil.Process] = []
    start = time.time()
    try:
        while True:
            try:
                kids = list({p.pid: p for p in kids + psutil.Process(proc.pid).children(recursive=True)}.values())
            except psutil.NoSuchProcess:
                pass
            try:
                stdout, stderr = proc.communicate(timeout=2)
                break
            except subprocess.TimeoutExpired:
                if time.time() - start > timeout:
                    proc.kill()
                    stdout, stderr = proc.communicate()
                    stderr += f"\n(identity.py: killed after {timeout:.0f} s)"
                    break
    finally:
        for p in kids:
            try:
                p.kill()
            except psutil.Error:
                pass
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def cli(*args: str, env: dict[str, str] | None = None, ok: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    p = run([sys.executable, "-m", "mspretrain.cli", *args], env=env, timeout=timeout)
    if ok and p.returncode != 0:
        raise SystemExit(f"identity.py: `mspretrain {' '.join(args)}` exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the corpus (fixed seeds)

CHARS = ("春风明月江南山水花落日夜秋云天地人心来去长空白雪青松流年故乡归路远清香红叶梦中"
         "千里万家门前桥边柳色鸟声寒烟孤舟独坐高楼望断相思无限时光何处见君知我不同一生"
         "西东北上下古今朝暮雨晴寒暖冬夏新旧老少金玉石竹林泉溪湖海波浪星河宫阙城关")


def poems(n: int, seed: int) -> list[str]:
    """Poems of 4 lines of 5 or 7 characters, each character preferring 4 successors (something
    to learn), one line each (the lines joined by commas)."""
    rng = random.Random(seed)
    chars = list(dict.fromkeys(CHARS))
    succ = {c: rng.sample(range(len(chars)), 4) for c in chars}
    out = []
    for i in range(n):
        width = 5 if i % 2 else 7
        c, lines = chars[rng.randrange(len(chars))], []
        for _ in range(4):
            line = []
            for _ in range(width):
                line.append(c)
                c = chars[succ[c][rng.randrange(4)]]
            lines.append("".join(line))
        out.append(f"第{i}首，" + "，".join(lines[:2]) + "。" + "，".join(lines[2:]) + "。")
    return out


def junk(n: int, seed: int) -> list[str]:
    """Documents the filters drop: repeated lines, one repeated 2-gram, English, shouting digits."""
    rng = random.Random(seed)
    words = ["the", "market", "price", "click", "here", "free", "offer", "today", "best", "deal", "buy", "now"]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append("。".join(["点击这里免费领取大奖"] * rng.randrange(4, 9)) + "。")
        elif kind == 1:
            out.append("哈哈" * rng.randrange(15, 40))
        elif kind == 2:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randrange(20, 40))) + ".")
        else:
            out.append("".join(str(rng.randrange(10)) for _ in range(rng.randrange(30, 60))) + "号码热线")
    return out


def near(doc: str, rng: random.Random) -> str:
    """A near duplicate: one character of the body replaced."""
    i = rng.randrange(6, len(doc) - 2)
    return doc[:i] + ("夜" if doc[i] != "夜" else "日") + doc[i + 1:]


def write_corpus(base: Path) -> dict[str, Path]:
    raw, models = base / "raw", base / "models"
    raw.mkdir(parents=True)
    models.mkdir()
    rng = random.Random(7)
    body = poems(700, seed=5)
    bad = junk(80, seed=6)
    for k in range(4):
        docs = body[k * 150:(k + 1) * 150] + body[:5]  # exact duplicates across files
        docs += [near(d, rng) for d in body[k * 150 + 10:k * 150 + 16]]  # near duplicates
        docs += bad[k * 20:(k + 1) * 20]
        rng.shuffle(docs)
        (raw / f"p{k}.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    (raw / "a.jsonl").write_text("\n".join(json.dumps({"text": d}, ensure_ascii=False) for d in body[600:660])
                                 + "\n", encoding="utf-8")
    web = [f"<p>{d}</p> 详见 https://example.com/{i} 或写信 a{i}@example.com &amp; 谢谢" for i, d in enumerate(body[660:700])]
    (raw / "web.txt").write_text("\n".join(web + ["短", "好"]) + "\n", encoding="utf-8")
    (raw / "r.txt").write_bytes("一二三四五六七八九十百千万\n".encode() + b"\xff\xfe\n" + "春眠不觉晓处处闻啼鸟\n".encode())
    (raw / "s.txt").write_bytes(b"")
    # quality models: positive = other poems, negative = junk of the same kinds
    (models / "pos.txt").write_text("\n".join(poems(400, seed=22)) + "\n", encoding="utf-8")
    (models / "neg.txt").write_text("\n".join(junk(200, seed=21)) + "\n", encoding="utf-8")
    # eval set for decontamination: questions quoting 20 characters of some corpus poems
    evals = base / "evals" / "ceval_val.csv"
    evals.parent.mkdir()
    with open(evals, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "question", "A", "B", "C", "D", "answer"])
        for i in range(0, 600, 40):
            w.writerow([i, f"以下哪一句与“{body[i][5:27]}”出自同一首诗？", "春风又绿江南岸", "乙", "丙", "丁", "A"])
    return {"raw": raw, "models": models, "evals": evals}


# --------------------------------------------------------------------------- hashing


def file_digests(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def safetensors_digest(path: Path) -> dict:
    """sha256 over the tensors in sorted name order (name, dtype, shape, raw bytes), read from the
    file's own header, so neither the header's key order nor its metadata count; and 16 hex digits
    per tensor to name what differs."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    whole, per = hashlib.sha256(), {}
    for name in sorted(header):
        t = header[name]
        a, b = t["data_offsets"]
        raw = data[8 + n + a:8 + n + b]
        head = json.dumps([name, t["dtype"], t["shape"]]).encode()
        whole.update(struct.pack("<Q", len(head)) + head + struct.pack("<Q", len(raw)) + raw)
        per[name] = hashlib.sha256(head + raw).hexdigest()[:16]
    return {"sha256": whole.hexdigest(), "tensors": per}


METRIC_KEYS = ("loss", "grad_norm", "lr", "loss_scale", "skipped")  # numerics only: no times, rates, memory


def run_fingerprint(run_dir: Path) -> dict:
    out: dict = {}
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        keep = {k: repr(r[k]) for k in METRIC_KEYS if k in r}
        if keep:
            rows.append({"step": r["step"], **keep})
    out["metrics"] = rows
    ckpts = sorted((run_dir / "checkpoints").glob("step_*[0-9]"))
    final = ckpts[-1]
    out["checkpoint"] = final.name
    for f in sorted(final.glob("*.safetensors")):
        out[f.name] = safetensors_digest(f)
    for name in ("train_state.json", "data_state.json"):
        if (final / name).exists():
            out[name] = json.dumps(json.loads((final / name).read_text()), sort_keys=True)
    return out


# --------------------------------------------------------------------------- prepare


def prepare_runs(base: Path, inp: dict[str, Path]) -> dict[str, dict]:
    got: dict[str, dict] = {}
    m = inp["models"]
    t = time.time()
    cli("quality", "train", "--positive", str(m / "pos.txt"), "--negative", str(m / "neg.txt"), "--doc-per-line",
        "--out", str(m / "clf.npz"), "--quiet")
    cli("quality", "lm", str(m / "pos.txt"), "--doc-per-line", "--out", str(m / "lm.npz"), "--quiet")
    got["prepare/models"] = {k: v for k, v in file_digests(m).items() if not k.endswith(".txt")}
    print(f"prepare/models: quality train + lm ({time.time() - t:.0f} s)", flush=True)
    common = ["--doc-per-line", "--valid-fraction", "0.1", "--vocab-size", "500", "--workers", "2", "--quiet",
              "prepare.near_dedup=true", "prepare.min_chars=8", f"prepare.decontam={json.dumps([str(inp['evals'])])}",
              "prepare.min_zh_prob=0.5"]
    runs = {
        "filters": [*common, f"prepare.quality_model={m / 'clf.npz'}", "prepare.quality_threshold=0.5",
                    f"prepare.lm_model={m / 'lm.npz'}", "prepare.ppl_max=1e9"],
        "fraction": [*common, f"prepare.quality_model={m / 'clf.npz'}", "prepare.quality_top_fraction=0.8",
                     f"prepare.lm_model={m / 'lm.npz'}", "prepare.ppl_quantiles=[0.02, 0.95]"],
    }
    out = base / "data"
    for name, args in runs.items():
        t = time.time()
        cli("prepare", str(inp["raw"]), "--out", str(out / name), *args)
        got[f"prepare/{name}"] = file_digests(out / name)
        print(f"prepare/{name}: {len(got[f'prepare/{name}'])} files ({time.time() - t:.0f} s)", flush=True)
    # killed in its dedup stage (SIGKILL at a unit boundary, the test-only hooks), then rerun
    t = time.time()
    pts = cli("prepare", str(inp["raw"]), "--out", str(base / "points"), *runs["filters"],
              env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    points = [ln.split(": ", 1)[1] for ln in pts.stderr.splitlines() if ln.startswith("prepare-point: ")]
    mine = [p for p in points if p.startswith("dedup resolved")] or points
    killed = out / "filters-killed"
    if mine:
        p = cli("prepare", str(inp["raw"]), "--out", str(killed), *runs["filters"], ok=False,
                env={"MSPRETRAIN_PREPARE_TEST_KILL": mine[len(mine) // 2], "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
        if p.returncode != -signal.SIGKILL:
            raise SystemExit(f"identity.py: prepare was not killed at {mine[len(mine) // 2]!r}: exit {p.returncode}\n{p.stderr[-2000:]}")
        cli("prepare", str(inp["raw"]), "--out", str(killed), *runs["filters"])
        got["prepare/filters-killed"] = file_digests(killed)
    else:  # the hooks are gone: say so (a difference against a baseline that has the entry)
        got["prepare/filters-killed"] = {"error": "no prepare-point lines: MSPRETRAIN_PREPARE_TEST_POINTS had no effect"}
    print(f"prepare/filters-killed at {mine[len(mine) // 2] if mine else None!r} ({time.time() - t:.0f} s)"
          + (" = filters" if got["prepare/filters-killed"] == got["prepare/filters"] else " DIFFERS FROM filters"), flush=True)
    return got


# --------------------------------------------------------------------------- train

CONFIG = """# benchmarks/identity.py: the tiny model every identity run trains (written by the script)
[model]
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
max_seq_len = 64
init_std = 0.02

[data]
seq_len = 32

[optim]
lr = 1e-2
weight_decay = 0.1

[schedule]
kind = "cosine"
warmup_steps = 1

[train]
max_steps = 3
global_batch = 4
log_every = 1
seed = 1234

[checkpoint]
every = 3
keep_last = 1

[metrics]
grad_norm_every = 1

[eval]
at_end = false
"""

# model overrides per family (families.py's switches, and a shape that exercises each)
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama2": ("model.family=llama",),
    "llama3": ("model.family=llama", "model.rope_theta=500000", "model.rope_scaling=llama3", "model.rope_factor=8",
               "model.rope_original_max_len=16", "model.tie_embeddings=true"),
    "qwen2": ("model.family=qwen2", "model.qkv_bias=true", "model.rope_theta=1000000"),
    "qwen3": ("model.family=qwen3", "model.qk_norm=true", "model.head_dim=16", "model.tie_embeddings=true"),
    "mistral": ("model.family=mistral", "model.sliding_window=16"),
    "qwen3_moe": ("model.family=qwen3_moe", "model.qk_norm=true", "model.num_experts=4", "model.experts_per_token=2",
                  "model.moe_ffn_dim=32"),
    "qwen2_moe": ("model.family=qwen2_moe", "model.qkv_bias=true", "model.num_experts=4", "model.experts_per_token=2",
                  "model.moe_ffn_dim=32", "model.shared_expert_ffn_dim=64"),
}
LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "plain": (1, ()),
    "zero2": (2, ("optim.shard_gradients=true", "train.micro_batch=1", "optim.split_mb=0.1")),
    "zero3": (2, ("optim.shard_parameters=true",)),
    "tp2": (2, ("parallel.tp=2",)),
}
FP16 = ("precision.dtype=fp16", "precision.param_dtype=compute", "precision.loss_scale=static")
FROZEN = ('train.trainable=["embeddings", "lm_head"]',)


def train_runs() -> list[tuple[str, int, tuple[str, ...]]]:
    """(name, processes, overrides), the 2-process runs of a family after its plain run."""
    out = []
    for fam, over in FAMILIES.items():
        for lay, (n, extra) in LAYOUTS.items():
            if fam.endswith("_moe") and lay != "plain":
                continue
            out.append((f"train/{fam}/{lay}", n, (*over, *extra)))
    out.append(("train/llama2/fp16-plain", 1, (*FAMILIES["llama2"], *FP16)))
    out.append(("train/llama2/fp16-zero3", 2, (*FAMILIES["llama2"], *FP16, *LAYOUTS["zero3"][1])))
    out.append(("train/llama2/frozen-plain", 1, (*FAMILIES["llama2"], *FROZEN)))
    return out


def train_one(base: Path, data: Path, name: str, nproc: int, over: tuple[str, ...]) -> dict:
    run_dir = base / "runs" / name.replace("/", "-")
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["train", "--config", str(base / "identity.toml"), "--data", str(data), "--run", str(run_dir), "--quiet", *over]
    if nproc > 1:
        logs = base / "logs" / run_dir.name
        shutil.rmtree(logs, ignore_errors=True)
        p = cli("launch", "--nproc", str(nproc), "--master-port", str(free_port()), "--log-dir", str(logs), "--", *args, ok=False)
        text = "".join(f.read_text(errors="replace") for f in sorted(logs.glob("worker_*.log")))
    else:
        p = cli(*args, ok=False)
        text = ""
    if p.returncode != 0:  # an entry of its own (a difference against a baseline that trained), the rest goes on
        print(f"{name}: exited {p.returncode}:\n{p.stderr[-2000:]}\n{text[-3000:]}", file=sys.stderr, flush=True)
        errs = [ln for ln in (p.stderr + text).splitlines() if ln.startswith("error:")]
        return {"error": f"exit {p.returncode}: {errs[-1] if errs else 'no error: line'}"}
    return run_fingerprint(run_dir)


# --------------------------------------------------------------------------- main


def compare(got: dict, want: dict) -> list[str]:
    """The names of the entries that differ (or exist on one side only), printing one line each."""
    bad = []
    for name in sorted(set(got) | set(want)):
        if name.startswith("_"):
            continue
        a, b = got.get(name), want.get(name)
        if a == b:
            print(f"same       {name}")
            continue
        bad.append(name)
        if a is None or b is None:
            print(f"DIFFERENT  {name}: only in {'the baseline' if a is None else 'this run'}")
            continue
        what = []
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                x, y = a.get(k), b.get(k)
                if isinstance(x, dict) and isinstance(y, dict) and "tensors" in x and "tensors" in y:
                    ts = sorted(t for t in set(x["tensors"]) | set(y["tensors"]) if x["tensors"].get(t) != y["tensors"].get(t))
                    what.append(f"{k} ({len(ts)} tensors: {', '.join(ts[:6])}{' ...' if len(ts) > 6 else ''})")
                else:
                    what.append(k)
        print(f"DIFFERENT  {name}: {', '.join(what[:12])}{' ...' if len(what) > 12 else ''}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=DEFAULT_BASE,
                    help=f"work dir, emptied first (default {DEFAULT_BASE}; must be the same for runs compared)")
    ap.add_argument("--out", type=Path, help="write the fingerprint here (JSON)")
    ap.add_argument("--compare", type=Path, help="a fingerprint written before: print same/different per entry, exit 1 on any difference")
    ap.add_argument("--only", help="run only the entries whose name contains this (prepare/filters always runs: its data dir is trained on)")
    a = ap.parse_args()
    if not (a.out or a.compare):
        ap.error("give --out FILE and/or --compare BASELINE.json")
    start = time.time()
    base = a.base.resolve()
    shutil.rmtree(base, ignore_errors=True)
    inp = write_corpus(base)
    (base / "identity.toml").write_text(CONFIG, encoding="utf-8")
    got: dict = prepare_runs(base, inp)
    if a.only:
        got = {k: v for k, v in got.items() if a.only in k}
    for name, nproc, over in train_runs():
        if a.only and a.only not in name:
            continue
        t = time.time()
        got[name] = train_one(base, base / "data" / "filters", name, nproc, over)
        print(f"{name}: {got[name]['error'] if 'error' in got[name] else str(len(got[name]['metrics'])) + ' steps'}, "
              f"{sum(k.endswith('.safetensors') for k in got[name])} safetensors files ({time.time() - t:.0f} s)", flush=True)
    print(f"identity: {len(got)} entries in {time.time() - start:.0f} s", flush=True)
    if a.out:
        a.out.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    if a.compare:
        want = json.loads(a.compare.read_text())
        if a.only:
            want = {k: v for k, v in want.items() if a.only in k}
        bad = compare(got, want)
        print(f"compared {len(set(got) | set(want))} entries: " + ("all identical" if not bad else f"{len(bad)} DIFFERENT"))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
