"""Training throughput: our MindSpore jit train step vs HF transformers LlamaForCausalLM (PyTorch eager)
and vs MindSpore Transformers' LlamaForCausalLM (the incumbent, same MindSpore).

Same config, batch, thread count, machine and run for all sides. For each config it prints tokens/s
of each, the ratios (ours / PyTorch, target >= 0.8; ours / MindSpore Transformers, target >= 1.3 on
tiny-7.5M and >= 1.0 on demo), and MFU against the fp32 matmul peak of this machine measured in the
same run (the better of PyTorch's and MindSpore's 1024^3 GEMM). Rounds interleave the sides so a
change in machine load hits all of them; the median per-round ratio is reported, and the ratio of
the best rounds (least disturbed by other processes).

MindSpore Transformers runs in its own venv (mindformers 2.0.0 needs --no-deps and a stub
`hyper_parallel`; `../shared/peers/mindformers/` builds it: `MFVENV=.venv-mindformers bash
../shared/peers/mindformers/setup.sh`). This script starts that venv's python on itself
(`--mindformers-child`) as a long-lived child and asks it for timed steps between ours and PyTorch's,
so the child is idle while the others run. Its step: `LlamaForCausalLM` (graph mode, its own
cross-entropy), `MFTrainOneStepCell` with clipping at 1.0 and an isfinite overflow check in place of
the Ascend-only float-status ops (the peer README's CPU workarounds), `nn.AdamWeightDecay`
(weight decay 0.1, none on norms). The side is skipped with one line when the venv or the peer dir
is missing (`--mindformers-venv`, `--peer-dir`, or $MINDFORMERS_VENV / $MINDFORMERS_PEER_DIR).

The train step is the same on both sides: forward, mean token NLL (fp32), backward, global-norm
clipping at 1.0, AdamW (beta 0.9/0.95, eps 1e-8, weight decay 0.1, none on norms). Ours is the
trainer's own `mspretrain.step.step.TrainStep` (two jit graphs: accumulate, apply); `--minimal`
swaps in a bare value_and_grad + `nn.AdamWeightDecay` graph (and drops clipping on both sides).
Theirs: HF's default attention (sdpa), `F.cross_entropy` on fp32 logits, `clip_grad_norm_`,
`torch.optim.AdamW` (foreach).

    python benchmarks/train_bench.py                      # tiny-7.5M and demo, three sides
    python benchmarks/train_bench.py --threads 2 --mindformers-venv .venv-mindformers --peer-dir ../shared/peers/mindformers
    python benchmarks/train_bench.py --configs tiny-7.5M --rounds 5
    python benchmarks/train_bench.py --configs tiny-7.5M --profile /tmp/prof   # + MindSpore profiler top ops
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")
ROOT = Path(__file__).resolve().parents[1]


def mindformers_child(spec: dict) -> int:
    """Runs in the MindSpore Transformers venv (not ours): build its Llama train step on `spec`'s
    shape, then serve timing requests from stdin ("N" -> run N steps, reply seconds per step) so
    the parent can interleave it with the other sides. Replies are lines starting with "MFBENCH "
    (mindformers prints to stdout too)."""
    import mindspore as ms
    import mindspore.common.dtype as mstype
    import numpy as np
    from mindspore import Tensor, nn, ops

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(spec["threads"])
    ms.set_seed(0)
    from mindformers import LlamaConfig, LlamaForCausalLM
    from mindformers.wrapper import MFTrainOneStepCell

    B, S, V = spec["batch"], spec["seq"], spec["vocab"]
    cfg = LlamaConfig(batch_size=B, seq_length=S, hidden_size=spec["dim"], num_layers=spec["n_layers"],
                      num_heads=spec["n_heads"], n_kv_heads=spec["n_kv_heads"], vocab_size=V,
                      intermediate_size=spec["ffn_dim"], rms_norm_eps=spec["norm_eps"],
                      compute_dtype="float32", layernorm_compute_type="float32", softmax_compute_type="float32",
                      rotary_dtype="float32", param_init_type="float32", use_past=False, use_flash_attention=False,
                      fine_grain_interleave=1, fused_rms_norm=False, qkv_concat=False, use_rope_slice=True)
    net = LlamaForCausalLM(cfg)
    net.set_train(True)
    params = net.trainable_params()
    decay = [p for p in params if "norm" not in p.name]
    rest = [p for p in params if "norm" in p.name]
    opt = nn.AdamWeightDecay([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
    nonfinite = ops.MultitypeFuncGraph("nonfinite")

    @nonfinite.register("Tensor")
    def _nf(g):
        return ops.logical_not(ops.isfinite(g).all()).astype(mstype.float32)

    class CPUTrainOneStepCell(MFTrainOneStepCell):
        # MindSpore's loss-scale cell checks overflow with Ascend-only NPU(Get|Clear)FloatStatusV2
        # on every non-GPU target; on CPU use isfinite (the peer harness's workaround).
        def start_overflow_check(self, pre_cond, compute_input):
            return Tensor([0] * 8, mstype.int32), compute_input

        def get_overflow_status(self, status, compute_output):
            return ops.AddN()(self.hyper_map(nonfinite, compute_output)) > 0

    cell = CPUTrainOneStepCell(net, opt, use_clip_grad=True, max_grad_norm=1.0)
    cell.set_train(True)
    # the same token ids as the other sides: the model slices (B, S+1) into inputs and labels itself
    x = Tensor(np.asarray(spec["data"], dtype=np.int32))

    def step() -> float:
        return float(cell(x)[0].asnumpy())

    loss = step()  # compiles
    nparams = sum(int(np.prod(p.shape)) for p in params)
    print(f"MFBENCH ready {loss} {nparams}", flush=True)
    for line in sys.stdin:
        n = int(line)
        if n <= 0:
            break
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        print(f"MFBENCH {(time.perf_counter() - t0) / n}", flush=True)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--mindformers-child"]:
    sys.exit(mindformers_child(json.loads(sys.stdin.readline())))

sys.path.insert(0, str(ROOT))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import nn  # noqa: E402

from mspretrain.config.schema import ModelConfig, resolve_model  # noqa: E402
from mspretrain.device import HOST_BLOCKING_ENV, DeviceInfo, setup_mindspore  # noqa: E402
from mspretrain.model.decoder import Decoder  # noqa: E402
from mspretrain.model.loss import token_nll  # noqa: E402
from mspretrain.model.presets import preset  # noqa: E402


def bench_configs() -> dict[str, tuple[ModelConfig, int, int]]:
    """name -> (resolved model config, seq_len, batch). `demo` is configs/demo.toml as shipped."""
    from mspretrain.config import schema as cfgmod

    # ffn 768: the reference shape of issue 16 (MindSpore Transformers' rule rounds to a multiple of 256)
    tiny = resolve_model(ModelConfig(dim=256, n_layers=4, n_heads=4, vocab_size=8000, max_seq_len=256, ffn_dim=768))
    demo_toml = ROOT / "configs" / "demo.toml"
    if demo_toml.is_file():
        c = cfgmod.load(demo_toml)
        demo = (resolve_model(c.model, c.prepare.vocab_size), c.data.seq_len, c.train.global_batch)
    else:
        demo = (resolve_model(preset("demo"), 8000), 128, 16)
    return {"tiny-7.5M": (tiny, 256, 8), "demo": demo}


def matmul_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """6 x (matmul parameters) + 12 x L x T x D (attention scores and values), forward + backward."""
    hd = cfg.dim // cfg.n_heads
    per_layer = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    n = cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim  # + lm_head; the embedding is a gather
    return 6.0 * n + 12.0 * cfg.n_layers * seq * cfg.dim


# --------------------------------------------------------------------------- the two train steps

def ours_step(cfg: ModelConfig, data: np.ndarray, minimal: bool = False):
    """Our step: the trainer's `TrainStep` (jit; clip 1.0, AdamW), or with `minimal` a bare
    value_and_grad + nn.AdamWeightDecay graph (no clipping, no accumulation buffers)."""
    model = Decoder(cfg, seed=0)
    if not minimal:
        from mspretrain.config.schema import OptimConfig
        from mspretrain.step.step import TrainStep

        step = TrainStep(model, OptimConfig(lr=1e-4), global_tokens=data.shape[0] * (data.shape[1] - 1), jit=True)
        return lambda: step.run([(data, None, None)], lr=1e-4, scale=1.0).loss
    decay = [p for p in model.trainable_params() if "norm" not in p.name]
    rest = [p for p in model.trainable_params() if "norm" in p.name]
    opt = nn.AdamWeightDecay([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)

    def loss_fn(tokens, targets):
        nll, _ = token_nll(model(tokens), targets)
        return nll.mean()

    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)

    @ms.jit
    def train_step(tokens, targets):
        loss, grads = grad_fn(tokens, targets)
        opt(grads)
        return loss

    x, y = ms.Tensor(data[:, :-1]), ms.Tensor(data[:, 1:])
    return lambda: float(train_step(x, y).asnumpy())


def torch_step(cfg: ModelConfig, data: np.ndarray, minimal: bool = False):
    import torch
    import transformers

    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings)
    model = transformers.LlamaForCausalLM(hc).train()
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    x, y = torch.tensor(data[:, :-1]).long(), torch.tensor(data[:, 1:]).long()

    def step():
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1))
        loss.backward()
        if not minimal:  # TrainStep clips at 1.0: same work on both sides
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


class MindformersStep:
    """MindSpore Transformers' train step in a child process on its own venv (see the docstring)."""

    def __init__(self, python: Path, stubs: Path, cfg: ModelConfig, data: np.ndarray, threads: int,
                 host_blocking: bool = False) -> None:
        import subprocess
        import tempfile

        spec = {"batch": data.shape[0], "seq": data.shape[1] - 1, "vocab": cfg.vocab_size, "dim": cfg.dim,
                "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "ffn_dim": cfg.ffn_dim,
                "norm_eps": cfg.norm_eps, "threads": threads, "data": data.tolist()}
        env = {**os.environ, "GLOG_v": "3", "PYTHONPATH": str(stubs)}
        # MindSpore Transformers as a user runs it: MindSpore's default host pipeline, unless asked
        # to get the same MS_DEV_HOST_BLOCKING_RUN=1 our CPU set-up uses (--peer-host-blocking)
        env.pop(HOST_BLOCKING_ENV, None)
        if host_blocking:
            env[HOST_BLOCKING_ENV] = "1"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mindformers-child-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(python), str(Path(__file__).resolve()), "--mindformers-child"], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, cwd="/tmp")
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        ready = self._reply()
        self.first_loss, self.params = float(ready[1]), int(ready[2])

    def _reply(self) -> list[str]:
        for line in self.proc.stdout:
            if line.startswith("MFBENCH "):
                return line.split()[1:]
        self.log.seek(0)
        raise RuntimeError(f"the MindSpore Transformers child exited ({self.proc.wait()}): {self.log.read()[-2000:]}")

    def timed(self, n: int) -> float:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return float(self._reply()[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("0\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        os.unlink(self.log.name)


def find_mindformers(venv: str | None, peer_dir: str | None) -> tuple[Path, Path] | str:
    """(peer venv's python, the harness's stubs dir), or why the side is skipped."""
    venv_p = Path(venv or os.environ.get("MINDFORMERS_VENV") or ROOT / ".venv-mindformers").absolute()  # the child runs in /tmp
    peer_p = Path(peer_dir or os.environ.get("MINDFORMERS_PEER_DIR") or ROOT.parent / "shared" / "peers" / "mindformers").absolute()
    python, stubs = venv_p / "bin" / "python", peer_p / "stubs"
    if not python.is_file():
        return (f"no python in the MindSpore Transformers venv {venv_p} (build it: MFVENV={venv_p} bash "
                f"{peer_p / 'setup.sh'}; or pass --mindformers-venv)")
    if not (stubs / "hyper_parallel").is_dir():
        return f"no stubs/hyper_parallel in the peer dir {peer_p} (pass --peer-dir with the CPU harness)"
    return python, stubs


# --------------------------------------------------------------------------- measurement

def timed(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def matmul_peak(n: int = 1024, reps: int = 8) -> dict[str, float]:
    """fp32 GEMM GFLOP/s of PyTorch and of MindSpore (graph mode) on this machine, now."""
    import torch
    from mindspore import ops

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    ta = torch.from_numpy(a)
    ma = ms.Tensor(a)

    @ms.jit
    def mm(x):
        return ops.matmul(x, x)

    out = {}
    for name, fn in (("torch", lambda: ta @ ta), ("mindspore", lambda: mm(ma).asnumpy())):
        fn()
        best = min(timed(fn, reps) for _ in range(3))
        out[name] = 2.0 * n ** 3 / best / 1e9
    return out


def profile_ours(step, out_dir: str, steps: int = 3, top: int = 15) -> list[tuple[str, float, float]]:
    """Run the MindSpore profiler over `steps` steps; (op type, ms per step, share) of the top ops."""
    prof = ms.Profiler(output_path=out_dir)
    for _ in range(steps):
        step()
    prof.analyse()
    files = glob.glob(os.path.join(out_dir, "**", "cpu_op_type_info_*.csv"), recursive=True)
    if not files:
        return []
    rows = list(csv.DictReader(open(files[0])))
    rows.sort(key=lambda r: -float(r["total_compute_time"]))
    return [(r["op_type"], float(r["total_compute_time"]) / steps, float(r["percent"])) for r in rows[:top]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny-7.5M,demo")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both frameworks (default: all cores)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating measurement rounds per framework")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per round")
    ap.add_argument("--profile", metavar="DIR", help="also run the MindSpore profiler on our step and print the top ops")
    ap.add_argument("--minimal", action="store_true", help="bare value_and_grad + AdamW steps on both sides (no clipping)")
    ap.add_argument("--mindformers-venv", metavar="DIR", help="MindSpore Transformers venv (default $MINDFORMERS_VENV or ./.venv-mindformers)")
    ap.add_argument("--peer-dir", metavar="DIR", help="the CPU harness with stubs/ (default $MINDFORMERS_PEER_DIR or ../shared/peers/mindformers)")
    ap.add_argument("--no-mindformers", action="store_true", help="two sides only")
    ap.add_argument("--peer-host-blocking", action="store_true",
                    help=f"give MindSpore Transformers {HOST_BLOCKING_ENV}=1 too (ours sets it on CPU, see mspretrain/device.py)")
    ap.add_argument("--json", action="store_true")
    ap.error = lambda msg: (print(f"train_bench: {msg}", file=sys.stderr), sys.exit(2))  # one line, exit 2
    args = ap.parse_args()
    configs = bench_configs()
    unknown = [c for c in args.configs.split(",") if c not in configs]
    if unknown or args.threads < 1 or args.rounds < 1 or args.steps < 1:
        ap.error(f"unknown --configs {unknown} (choose from {', '.join(configs)})" if unknown
                 else "--threads, --rounds and --steps must be >= 1")
    mf = "--no-mindformers given" if args.no_mindformers else find_mindformers(args.mindformers_venv, args.peer_dir)
    if isinstance(mf, str):
        print(f"MindSpore Transformers side skipped: {mf}")

    import torch

    torch.set_num_threads(args.threads)
    # ours as `mspretrain train` sets MindSpore up on CPU (threads = cores instead of MindSpore's 25,
    # deterministic, MS_DEV_HOST_BLOCKING_RUN=1), before the first MindSpore op of this process
    setup_mindspore(DeviceInfo(target="cpu", threads=args.threads, flash_attention=False))
    load_before = os.getloadavg()[0]
    peaks = matmul_peak()
    print(f"threads {args.threads}, load average {load_before:.1f}; fp32 matmul peak: torch {peaks['torch']:.1f}, "
          f"mindspore {peaks['mindspore']:.1f} GFLOP/s; {HOST_BLOCKING_ENV}: ours {os.environ.get(HOST_BLOCKING_ENV, 'unset')}, "
          f"MindSpore Transformers {'1' if args.peer_host_blocking else 'unset'}")
    results = {"threads": args.threads, "peak_gflops": peaks, "load_average": load_before, "configs": {},
               "ours_host_blocking": os.environ.get(HOST_BLOCKING_ENV), "peer_host_blocking": args.peer_host_blocking}
    for name in args.configs.split(","):
        cfg, seq, batch = configs[name]
        data = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
        t0 = time.perf_counter()
        ours = ours_step(cfg, data, args.minimal)
        loss_ours = ours()
        compile_s = time.perf_counter() - t0
        theirs = torch_step(cfg, data, args.minimal)
        loss_theirs = theirs()
        sides = {"ours": lambda ours=ours: timed(ours, args.steps), "torch": lambda theirs=theirs: timed(theirs, args.steps)}
        mfs = None
        if not isinstance(mf, str):
            if args.minimal:
                print("  (--minimal: MindSpore Transformers' step still clips at 1.0)")
            mfs = MindformersStep(mf[0], mf[1], cfg, data, args.threads, host_blocking=args.peer_host_blocking)
            sides["mindformers"] = lambda mfs=mfs: mfs.timed(args.steps)
        names = list(sides)
        rounds: list[dict[str, float]] = []
        for i in range(args.rounds):
            # rotate the order each round: no side always follows the same one
            order = names[i % len(names):] + names[:i % len(names)]
            rounds.append({n: sides[n]() for n in order})
        if mfs is not None:
            mfs.close()
        tok = batch * seq
        tps = {n: statistics.median(tok / r[n] for r in rounds) for n in names}
        best = {n: tok / min(r[n] for r in rounds) for n in names}
        ratio = {n: statistics.median(r[n] / r["ours"] for r in rounds) for n in names if n != "ours"}
        # Best round of each: the estimate least disturbed by other processes on a shared machine.
        best_ratio = {n: best["ours"] / best[n] for n in ratio}
        fpt = matmul_flops_per_token(cfg, seq)
        res = {"seq": seq, "batch": batch, "ffn_dim": cfg.ffn_dim, "params_matmul_flops_per_token": fpt,
               "compile_s": compile_s, "load_average": os.getloadavg()[0],
               "ours_tokens_per_s": tps["ours"], "torch_tokens_per_s": tps["torch"], "ratio": ratio["torch"],
               "best_round_ratio": best_ratio["torch"], "ours_best_tokens_per_s": best["ours"],
               "torch_best_tokens_per_s": best["torch"],
               "first_loss": {"ours": loss_ours, "torch": loss_theirs},
               "rounds_ms": [{n: r[n] * 1e3 for n in names} for r in rounds]}
        if mfs is not None:
            res.update(mindformers_tokens_per_s=tps["mindformers"], mindformers_best_tokens_per_s=best["mindformers"],
                       ratio_mindformers=ratio["mindformers"], best_round_ratio_mindformers=best_ratio["mindformers"],
                       mindformers_params=mfs.params)
            res["first_loss"]["mindformers"] = mfs.first_loss
        print(f"{name:10s} dim {cfg.dim} L{cfg.n_layers} H{cfg.n_heads}/{cfg.n_kv_heads} ffn {cfg.ffn_dim} V{cfg.vocab_size} "
              f"seq {seq} batch {batch} [compile {compile_s:.1f}s, load {res['load_average']:.1f}]:")
        print(f"  tokens/s (median of {args.rounds} rounds): ours {tps['ours']:,.0f}, PyTorch eager {tps['torch']:,.0f}"
              + (f", MindSpore Transformers {tps['mindformers']:,.0f}" if mfs else ""))
        print(f"  ours / PyTorch eager {ratio['torch']:.2f}x (best rounds {best_ratio['torch']:.2f}x)"
              + (f"; ours / MindSpore Transformers {ratio['mindformers']:.2f}x (best rounds {best_ratio['mindformers']:.2f}x)"
                 if mfs else ""))
        print(f"  rounds ms ({'/'.join(names)}): " + ", ".join("/".join(f"{r[n] * 1e3:.0f}" for n in names) for r in rounds))
        print("  first loss: " + ", ".join(f"{k} {v:.4f}" for k, v in res["first_loss"].items())
              + (f"; parameters: MindSpore Transformers {mfs.params:,}" if mfs else ""))
        for fw, gflops in matmul_peak().items():  # re-measured between configs: the best is the peak
            peaks[fw] = max(peaks[fw], gflops)
        if args.profile:
            top = profile_ours(ours, os.path.join(args.profile, name))
            res["profile_top_ops"] = top
            print("  MindSpore profiler, top ops (ms per step, share of op time):")
            for op, ms_per_step, share in top:
                print(f"    {op:24s} {ms_per_step:8.1f}  {share:6.1%}")
        results["configs"][name] = res
    # MFU against the best GEMM rate seen during the whole run (a busy moment underestimates the peak).
    peak = max(peaks.values())
    for name, res in results["configs"].items():
        fpt = res["params_matmul_flops_per_token"]
        res["ours_mfu"] = res["ours_tokens_per_s"] * fpt / (peak * 1e9)
        res["torch_mfu"] = res["torch_tokens_per_s"] * fpt / (peak * 1e9)
        mf_mfu = ""
        if "mindformers_tokens_per_s" in res:
            res["mindformers_mfu"] = res["mindformers_tokens_per_s"] * fpt / (peak * 1e9)
            mf_mfu = f", MindSpore Transformers {res['mindformers_mfu']:.1%}"
        print(f"{name:10s} MFU vs the run's best fp32 GEMM ({peak:.1f} GFLOP/s): ours {res['ours_mfu']:.1%}, "
              f"PyTorch {res['torch_mfu']:.1%}{mf_mfu}")
    results["peak_gflops"] = peaks
    results["load_average_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
