"""MoE train step (issue 52): ours against our dense model of the same active size, against
transformers' Qwen3MoeForCausalLM under PyTorch eager, and the routing's share of our step.

One process, one run, the same thread count for both frameworks (MindSpore's `threads_num` as
`mspretrain train` sets it on CPU, and `torch.set_num_threads`), the same token batch for every side.
Sides, all forward + backward + global-norm clipping at 1.0 + AdamW (0.9/0.95, eps 1e-8, weight
decay 0.1, none on norms):

- `moe`: our trainer's `mspretrain.step.step.TrainStep` (jit) on a `qwen3_moe` Decoder: router,
  dropless counting-sort dispatch into expert blocks, batched SwiGLU, combine (model/moe.py), plus
  transformers' load-balancing loss (router_aux_loss_coef 0.001) and the per-layer routing stats.
- `dense`: the same step on a `qwen3` Decoder of the same ACTIVE size: same dim, layers, heads,
  vocabulary, and a SwiGLU of ffn = K x moe_ffn_dim (the FLOPs a token's K experts cost).
- `fixed`: the `moe` model with the routing taken out (this script's `FixedMoE`, swapped in by
  class; model/moe.py is not changed): assignment j of the N*K (token-major) goes to expert
  j // (N*K/E), so the experts' SwiGLU is one BatchMatMul over the stacked weights (E, N*K/E, D)
  with no router, no sort, no gathers of rows or of weights, no block padding, and an unweighted
  sum over the K copies as the combine. Its stats are zeros (the balance loss is still computed on
  them). The routing's share of the `moe` step is (moe - fixed) / moe: router + top-k + sort +
  dispatch (row gathers, per-block weight gathers, padding rows) + weighted combine, forward and
  backward (and the router's AdamW update, which is tiny).
- `hf`: transformers' `Qwen3MoeForCausalLM` (built from a local Qwen3MoeConfig with random
  weights; nothing is downloaded), its default attention and experts implementation (printed;
  transformers 5.25 picks `grouped_mm`, torch._grouped_mm, also on CPU), and `hf_eager` the same
  model with `experts_implementation="eager"` (its Python loop over the experts hit); both
  `output_router_logits=True` so its step pays its load-balancing loss as ours does,
  `F.cross_entropy` on fp32 logits, `clip_grad_norm_`, `torch.optim.AdamW` (foreach).

Rounds rotate the order of the sides so a change in the machine's load hits all of them; the
median per-round ratio is reported, and the ratio of the best rounds (least disturbed). Each side's
step is timed by wall clock and by the process's CPU time (`timed`), ratios by both: on a box
shared with other jobs the wall time mostly measures the waits for a core. On a box
oversubscribed by other processes PyTorch's OpenMP threads can collapse (5-10x slower steps at 2
threads than at 1, seen at load ~8-10 on 2 cores) while MindSpore's do not: compare at
`--threads 1` there too before reading the transformers ratio (docs/benchmarks.md). With
`--profile DIR` MindSpore's profiler also runs over a few `moe` steps and prints the top op types.

    python benchmarks/moe_bench.py    # dim 256, 4 layers (4/2 heads), 8 experts top-2 of ffn 256, seq 256, batch 4, 3 rounds
    python benchmarks/moe_bench.py --experts 16 --batch 8 --rounds 5 --profile /tmp/moeprof
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor, ops  # noqa: E402

from benchmarks.train_bench import profile_ours as profile_ops  # noqa: E402  MindSpore's op table, the same reading
from mspretrain.config.schema import ModelConfig, OptimConfig, resolve_model  # noqa: E402
from mspretrain.device import DeviceInfo, setup_mindspore  # noqa: E402
from mspretrain.model.decoder import Decoder  # noqa: E402
from mspretrain.model.moe import MoE, swiglu  # noqa: E402
from mspretrain.step.step import TrainStep  # noqa: E402


class FixedMoE(MoE):
    """MoE with a fixed, balanced assignment and no routing work (see the module docstring)."""

    def construct(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, D = x.shape
        N, E, K, F = B * T, self.experts, self.top_k, self.ffn
        A = N * K
        xa = ops.broadcast_to(x.reshape(N, 1, D), (N, K, D)).reshape(E, A // E, D)
        y = swiglu(self.bmm_t, xa, self.w13.weight, self.w2.weight, F).reshape(N, K, D).sum(1)  # the MoE's SwiGLU form
        return y.reshape(B, T, D), ops.zeros((2, E), ms.float32)


def configs(args: argparse.Namespace) -> dict[str, ModelConfig]:
    """The MoE shape (Qwen3-30B-A3B's proportions scaled down) and its dense twin of the same active size."""
    moe = resolve_model(ModelConfig(
        family="qwen3_moe", dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
        qk_norm=True, vocab_size=args.vocab, max_seq_len=args.seq, ffn_dim=args.experts_per_token * args.moe_ffn,
        num_experts=args.experts, experts_per_token=args.experts_per_token, moe_ffn_dim=args.moe_ffn,
        norm_topk_prob=True, router_aux_loss_coef=0.001, norm_eps=1e-6))
    dense = replace(moe, family="qwen3", num_experts=0, moe_ffn_dim=0, ffn_dim=args.experts_per_token * args.moe_ffn)
    return {"moe": moe, "dense": dense}


def ours_step(cfg: ModelConfig, data: np.ndarray, fixed: bool = False):
    model = Decoder(cfg, seed=0)
    if fixed:
        for _, cell in model.cells_and_names():
            if type(cell) is MoE:
                cell.__class__ = FixedMoE
    step = TrainStep(model, OptimConfig(lr=1e-4), global_tokens=data.shape[0] * (data.shape[1] - 1), jit=True)
    n = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    return (lambda: step.run([(data, None, None)], lr=1e-4, scale=1.0).loss), n


def hf_step(cfg: ModelConfig, data: np.ndarray, experts: str | None = None):
    import torch
    import transformers

    torch.manual_seed(0)
    extra = {"experts_implementation": experts} if experts else {}  # None: transformers' own choice
    hc = transformers.Qwen3MoeConfig(**extra,
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_size,
        intermediate_size=cfg.ffn_dim, moe_intermediate_size=cfg.moe_ffn_dim, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token, norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=True,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings)
    model = transformers.Qwen3MoeForCausalLM(hc).train()
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    x, y = torch.tensor(data[:, :-1]).long(), torch.tensor(data[:, 1:]).long()

    def step() -> float:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1))
        loss = loss + cfg.router_aux_loss_coef * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    info = {"attn_implementation": getattr(hc, "_attn_implementation", None),
            "experts_implementation": getattr(hc, "_experts_implementation", None),
            "transformers": transformers.__version__, "torch": torch.__version__}
    return step, sum(p.numel() for p in model.parameters()), info


def timed(step, n: int) -> tuple[float, float]:
    """Seconds per step: wall, and the process's CPU time (all its threads: on a box shared with
    other jobs the wall time counts the waits for a core, the CPU time the work; at one thread the
    CPU time is the wall time the step would take on a core of its own, and MindSpore's idle
    kernel threads, which spin, count against us)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-per-token", type=int, default=2)
    ap.add_argument("--moe-ffn", type=int, default=256, help="one expert's SwiGLU width (dense twin: K x this)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both frameworks (default: all cores)")
    ap.add_argument("--rounds", type=int, default=3, help="rotating measurement rounds per side")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per round")
    ap.add_argument("--hf-experts", default="default,eager",
                    help="transformers sides: comma list of experts implementations (default = transformers' choice; '' = none)")
    ap.add_argument("--profile", metavar="DIR", help="also run MindSpore's profiler on the MoE step and print the top ops")
    ap.add_argument("--json", action="store_true")
    ap.error = lambda msg: (print(f"moe_bench: {msg}", file=sys.stderr), sys.exit(2))  # one line, exit 2
    args = ap.parse_args()
    if min(args.threads, args.rounds, args.steps, args.experts, args.experts_per_token) < 1 or args.experts_per_token > args.experts:
        ap.error("--threads, --rounds, --steps, --experts must be >= 1 and --experts-per-token between 1 and --experts")
    if (args.batch * args.seq * args.experts_per_token) % args.experts:
        ap.error("batch x seq x experts-per-token must be a multiple of --experts (the fixed-assignment variant)")

    import torch

    torch.set_num_threads(args.threads)
    setup_mindspore(DeviceInfo(target="cpu", threads=args.threads, flash_attention=False))
    cfgs = configs(args)
    moe = cfgs["moe"]
    data = np.random.default_rng(1).integers(0, moe.vocab_size, (args.batch, args.seq + 1)).astype(np.int32)
    load = [os.getloadavg()[0]]
    print(f"threads {args.threads}, load average {load[0]:.1f}; dim {moe.dim} L{moe.n_layers} H{moe.n_heads}/{moe.n_kv_heads} "
          f"V{moe.vocab_size} seq {args.seq} batch {args.batch}; MoE {moe.num_experts} experts top-{moe.experts_per_token} "
          f"ffn {moe.moe_ffn_dim}; dense twin ffn {cfgs['dense'].ffn_dim}")
    sides, params, first, compile_s = {}, {}, {}, {}
    for name, build in (("moe", lambda: ours_step(moe, data)), ("dense", lambda: ours_step(cfgs["dense"], data)),
                        ("fixed", lambda: ours_step(moe, data, fixed=True))):
        t0 = time.perf_counter()
        sides[name], params[name] = build()
        first[name] = sides[name]()
        compile_s[name] = time.perf_counter() - t0
        print(f"  built {name}: first step {compile_s[name]:.1f}s", flush=True)
    hf_info = {}
    for impl in filter(None, args.hf_experts.split(",")):
        name = "hf" if impl == "default" else f"hf_{impl}"
        t0 = time.perf_counter()
        sides[name], params[name], hf_info[name] = hf_step(moe, data, None if impl == "default" else impl)
        first[name] = sides[name]()
        compile_s[name] = time.perf_counter() - t0
        print(f"  built {name}: first step {compile_s[name]:.1f}s", flush=True)
    for name in sides:  # one warm step each after the first (allocators, caches)
        sides[name]()
    names = list(sides)
    rounds: list[dict[str, float]] = []
    cpu_rounds: list[dict[str, float]] = []
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        both = {n: timed(sides[n], args.steps) for n in order}
        rounds.append({n: both[n][0] for n in names})
        cpu_rounds.append({n: both[n][1] for n in names})
        print(f"  round {i + 1}: " + ", ".join(f"{n} {rounds[-1][n] * 1e3:.0f} ms (cpu {cpu_rounds[-1][n] * 1e3:.0f})"
                                              for n in names), flush=True)
    load.append(os.getloadavg()[0])
    tok = args.batch * args.seq
    tps = {n: statistics.median(tok / r[n] for r in rounds) for n in names}
    best = {n: tok / min(r[n] for r in rounds) for n in names}

    def ratio(a: str, b: str, rs: list[dict[str, float]] = rounds) -> tuple[float, float]:
        """tokens/s of a over b: median of the per-round ratios, and of the best rounds."""
        return statistics.median(r[b] / r[a] for r in rs), min(r[b] for r in rs) / min(r[a] for r in rs)

    share = statistics.median((r["moe"] - r["fixed"]) / r["moe"] for r in rounds)
    cpu_share = statistics.median((r["moe"] - r["fixed"]) / r["moe"] for r in cpu_rounds)
    res = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "profile")}, "load_average": load,
           "params": params, "first_loss": first, "compile_s": compile_s, "tokens_per_s": tps, "best_tokens_per_s": best,
           "moe_over_dense": ratio("moe", "dense"), "routing_share": share,
           "routing_ms": statistics.median((r["moe"] - r["fixed"]) * 1e3 for r in rounds),
           "rounds_ms": [{n: r[n] * 1e3 for n in names} for r in rounds], "hf": hf_info,
           "cpu_rounds_ms": [{n: r[n] * 1e3 for n in names} for r in cpu_rounds], "cpu_routing_share": cpu_share,
           "cpu_tokens_per_s": {n: statistics.median(tok / r[n] for r in cpu_rounds) for n in names},
           "cpu_moe_over_dense": ratio("moe", "dense", cpu_rounds)}
    print("parameters: " + ", ".join(f"{n} {p:,}" for n, p in params.items()))
    print("first loss: " + ", ".join(f"{n} {v:.4f}" for n, v in first.items()))
    print("first step (compile): " + ", ".join(f"{n} {v:.1f}s" for n, v in compile_s.items()))
    for name, info in hf_info.items():
        print(f"{name}: transformers {info['transformers']}, torch {info['torch']}: attention {info['attn_implementation']}, "
              f"experts {info['experts_implementation']}")
    print(f"tokens/s (median of {args.rounds} rounds): " + ", ".join(f"{n} {tps[n]:,.0f}" for n in names))
    print(f"rounds ms ({'/'.join(names)}): " + ", ".join("/".join(f"{r[n] * 1e3:.0f}" for n in names) for r in rounds))
    print(f"cpu ms per step ({'/'.join(names)}): " + ", ".join("/".join(f"{r[n] * 1e3:.0f}" for n in names) for r in cpu_rounds))
    print("tokens per CPU second (median): " + ", ".join(f"{n} {v:,.0f}" for n, v in res["cpu_tokens_per_s"].items()))
    m, b = res["moe_over_dense"]
    (cm, cb) = res["cpu_moe_over_dense"]
    print(f"(a) MoE / dense of the same active size: {m:.2f}x (best rounds {b:.2f}x); by CPU time {cm:.2f}x ({cb:.2f}x)")
    for name in hf_info:
        res[f"ours_over_{name}"] = ratio("moe", name)
        res[f"cpu_ours_over_{name}"] = ratio("moe", name, cpu_rounds)
        (m, b), (cm, cb) = res[f"ours_over_{name}"], res[f"cpu_ours_over_{name}"]
        print(f"(b) ours / transformers Qwen3MoeForCausalLM (PyTorch eager, experts "
              f"{hf_info[name]['experts_implementation']}): {m:.2f}x (best rounds {b:.2f}x); by CPU time {cm:.2f}x ({cb:.2f}x)")
    print(f"(c) routing's share of our MoE step ((moe - fixed) / moe, median of rounds): {share:.1%} "
          f"({res['routing_ms']:.0f} ms of {statistics.median(r['moe'] for r in rounds) * 1e3:.0f} ms); by CPU time {cpu_share:.1%}")
    print(f"load average: {load[0]:.1f} before, {load[1]:.1f} after the timed rounds")
    if args.profile:
        top = profile_ops(sides["moe"], args.profile)
        res["profile_top_ops"] = top
        print("MindSpore profiler on the MoE step, top op types (ms per step, share of op time):")
        for op, ms_per_step, pct in top:
            print(f"  {op:24s} {ms_per_step:8.1f}  {pct:6.1%}")
    if args.json:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
