"""Loader throughput at seq 2,048: ours vs Hugging Face `datasets`, and vs what training consumes.

    python benchmarks/loader_bench.py [--tokens 50000000] [--batch-sizes 8,32] [--hf-python PY]

(a) `mspretrain.data.loader.Loader.next_batch` over a memory-mapped Megatron shard (int32 out).
(b) the common HF path over the same token windows: `datasets.Dataset.from_dict` (in memory,
    the most favourable case for HF), `.shuffle(seed)`, `.with_format("numpy")`,
    `.iter(batch_size=B)`, cast to int32 like ours.
`datasets` needs pyarrow, whose numpy-1.x builds clash with MindSpore's numpy < 2 pin, so the
baseline runs where `datasets` imports: in this process, else in `--hf-python` (default
`.venv-bench/bin/python` if present) as a subprocess of this same script (`--baseline-only`,
which needs only numpy + datasets); otherwise it is skipped with a message.
Timings are the best of `--repeats` runs (the box is shared); ratios compare like with like.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LLAMA2_7B_TOKENS_PER_S_PER_DEVICE = 4800  # MindSpore Transformers' published Llama-2-7B figure (910B)
LLAMA2_7B_DEVICES = 8


def best_rate(fn, batch: int, seconds: float, repeats: int) -> float:
    """Best samples/s over `repeats` timed runs of ~`seconds` each (after a warm-up)."""
    for _ in range(20):
        fn()
    rates = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            for _ in range(50):
                fn()
            n += 50
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        rates.append(n * batch / dt)
    return max(rates)


# ---- the HF baseline (numpy + datasets only: runs in another venv too) -----------------------
def hf_rates(bin_path: str, seq_len: int, batch_sizes: list[int], seconds: float, repeats: int) -> dict:
    import datasets

    flat = np.fromfile(bin_path, dtype=np.uint16)
    n = (flat.size - 1) // seq_len
    windows = np.lib.stride_tricks.as_strided(flat, shape=(n, seq_len + 1), strides=(seq_len * 2, 2))
    ds = datasets.Dataset.from_dict({"input_ids": np.ascontiguousarray(windows)})
    ds = ds.shuffle(seed=0).with_format("numpy")
    out = {"datasets": datasets.__version__, "rates": {}}
    for b in batch_sizes:
        state = {"it": iter(())}

        def step(state: dict = state, b: int = b) -> None:  # bound now: best_rate calls it in this iteration only
            try:
                batch = next(state["it"])
            except StopIteration:  # next epoch
                state["it"] = ds.iter(batch_size=b, drop_last_batch=True)
                batch = next(state["it"])
            batch["input_ids"].astype(np.int32)

        out["rates"][str(b)] = best_rate(step, b, seconds, repeats)
    return out


def run_baseline(args, bin_path: Path) -> dict | None:
    try:
        import datasets  # noqa: F401
        return hf_rates(str(bin_path), args.seq_len, args.batch_sizes, args.seconds, args.repeats)
    except ImportError:
        pass
    py = args.hf_python or (ROOT / ".venv-bench/bin/python")
    if not Path(py).is_file():
        print(f"HF baseline skipped: `datasets` is not importable here and {py} does not exist.\n"
              "  Create it: python -m venv .venv-bench && .venv-bench/bin/pip install 'datasets==5.0.1' 'pyarrow==23.0.1'")
        return None
    cmd = [str(py), __file__, "--baseline-only", str(bin_path), "--seq-len", str(args.seq_len),
           "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--seconds", str(args.seconds),
           "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"HF baseline failed under {py}:\n{proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- our side ----------------------------------------------------------------------------------
def make_data(workdir: Path, name: str, n_tokens: int, seed: int) -> Path:
    from mspretrain.data.shards import ShardWriter

    d = workdir / name
    if (d / "manifest.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, 32000, size=n_tokens, dtype=np.uint16)
    ends = np.cumsum(rng.integers(50, 4000, size=n_tokens // 50))  # documents of 50..4000 tokens
    ends = ends[ends < n_tokens]
    toks[ends - 1] = 2  # EOS closes every document
    w = ShardWriter(d / "train", np.uint16)
    docs = np.split(toks, ends)
    for i in range(0, len(docs), 10_000):
        w.add_many(docs[i : i + 10_000])
    w.finalize()
    manifest = {"fingerprint": f"bench-{name}-{n_tokens}-{seed}", "tokens": {"train": n_tokens}, "vocab_size": 32000,
                "special_ids": {"bos": 1, "eos": 2, "pad": 0, "unk": 3}}
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def our_rates(args, a: Path, b: Path) -> dict:
    from mspretrain.data.loader import Loader

    def make(batch, sources=None, seq_len=args.seq_len, **kw):
        return Loader(sources or [(a, 1.0)], split="train", seq_len=seq_len, batch_size=batch, seed=1, **kw)

    r = {}
    for bs in args.batch_sizes:
        r[f"next_batch B={bs}"] = best_rate(make(bs).next_batch, bs, args.seconds, args.repeats)
    bs = args.batch_sizes[0]
    r[f"reset_attention_at_eos B={bs}"] = best_rate(make(bs, reset_attention_at_eos=True).next_batch, bs,
                                                    args.seconds, args.repeats)
    r[f"mixing 0.7/0.3 B={bs}"] = best_rate(make(bs, [(a, 0.7), (b, 0.3)]).next_batch, bs, args.seconds, args.repeats)
    r[f"int64 tokens B={bs}"] = best_rate(make(bs, token_dtype="int64").next_batch, bs, args.seconds, args.repeats)
    _, demo_seq, _, demo_batch = demo_params()
    r[f"demo shape seq={demo_seq} B={demo_batch}"] = best_rate(make(demo_batch, seq_len=demo_seq).next_batch,
                                                              demo_batch, args.seconds, args.repeats)
    if args.no_mindspore:
        return r
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms

    inline = make(bs)  # what the trainer does: next_batch, then a zero-copy Tensor, in the loop itself
    r[f"next_batch -> ms.Tensor B={bs}"] = best_rate(lambda: ms.Tensor.from_numpy(inline.next_batch().tokens), bs,
                                                     args.seconds, args.repeats)

    class Source:  # random-access source for GeneratorDataset (batches as items, in order)
        def __init__(self) -> None:
            self.loader = make(bs)

        def __getitem__(self, i: int):
            return (self.loader.next_batch().tokens,)

        def __len__(self) -> int:
            return 10**9

    ds = ms.dataset.GeneratorDataset(Source(), column_names=["tokens"], shuffle=False)
    gen = ds.create_tuple_iterator(num_epochs=1, output_numpy=False)
    r[f"GeneratorDataset -> ms.Tensor B={bs}"] = best_rate(lambda: next(gen), bs, args.seconds, args.repeats)
    return r


def matmul_flops(seconds: float = 1.0) -> float:
    """Measured fp32 matmul FLOP/s of this box (an upper bound for any CPU train step)."""
    x = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    x @ x
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x @ x
        n += 1
    return n * 2 * 1024**3 / (time.perf_counter() - t0)


def demo_params() -> tuple[int, int, str, int]:
    """(parameters, seq_len, note, global batch) of configs/demo.toml, vocab from prepare.vocab_size."""
    from mspretrain.config import schema as config

    cfg = config.load(ROOT / "configs/demo.toml")
    m = config.resolve_model(cfg.model, cfg.prepare.vocab_size)
    kv = m.dim * m.n_kv_heads // m.n_heads
    per_layer = 2 * m.dim * m.dim + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim + 2 * m.dim
    n = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.n_layers * per_layer + m.dim
    return n, cfg.data.seq_len, f"dim {m.dim}, {m.n_layers} layers, vocab {m.vocab_size}", cfg.train.global_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=50_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mspretrain-loader-bench")
    p.add_argument("--hf-python", help="python of an env with `datasets` (default .venv-bench/bin/python)")
    p.add_argument("--no-mindspore", action="store_true", help="skip the MindSpore input-pipeline rows")
    p.add_argument("--baseline-only", metavar="BIN", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.baseline_only:
        print(json.dumps(hf_rates(args.baseline_only, args.seq_len, args.batch_sizes, args.seconds, args.repeats)))
        return
    sys.path.insert(0, str(ROOT))
    a = make_data(args.workdir, "a", args.tokens, 0)
    b = make_data(args.workdir, "b", args.tokens // 4, 1)
    print(f"data: {args.tokens:,} tokens, {(args.tokens - 1) // args.seq_len:,} windows of {args.seq_len + 1}, "
          f"numpy {np.__version__}, {os.cpu_count()} CPUs (shared)")
    ours = our_rates(args, a, b)
    hf = run_baseline(args, a / "train.bin")
    print(f"\n{'path':44s} {'samples/s':>12s} {'tokens/s':>14s}")
    for k, v in ours.items():
        print(f"ours: {k:38s} {v:12,.0f} {v * args.seq_len:14,.0f}")
    if hf:
        for bs in args.batch_sizes:
            v = hf["rates"][str(bs)]
            print(f"HF datasets {hf['datasets']}: B={bs:<21d} {v:12,.0f} {v * args.seq_len:14,.0f}   "
                  f"ours / HF = {ours[f'next_batch B={bs}'] / v:.1f}x (target >= 5x)")
    ours_tps = ours[f"next_batch B={args.batch_sizes[0]}"] * args.seq_len
    need_7b = LLAMA2_7B_TOKENS_PER_S_PER_DEVICE * LLAMA2_7B_DEVICES
    print(f"\nllama2-7b consumes ~{need_7b:,} tokens/s on 8x910B ({LLAMA2_7B_TOKENS_PER_S_PER_DEVICE:,} tokens/s/device, "
          f"MindSpore Transformers' published figure); one loader process gives {ours_tps:,.0f} tokens/s = "
          f"{ours_tps / need_7b:,.0f}x the whole node's need (each rank runs its own loader: "
          f"{ours_tps / LLAMA2_7B_TOKENS_PER_S_PER_DEVICE:,.0f}x per device)")
    flops = matmul_flops()
    n, demo_seq, note, demo_batch = demo_params()
    demo_tps = flops / (6 * n)
    loader_demo_tps = ours[f"demo shape seq={demo_seq} B={demo_batch}"] * demo_seq
    print(f"demo ({note}, {n / 1e6:.1f} M params, seq {demo_seq}): measured fp32 matmul peak {flops / 1e9:.0f} GFLOP/s; "
          f"a train step needs >= 6 x params FLOPs/token, so even at 100 % of that peak it consumes "
          f"<= {demo_tps:,.0f} tokens/s; the loader at the demo shape (seq {demo_seq}, batch {demo_batch}) gives "
          f"{loader_demo_tps:,.0f} tokens/s = {loader_demo_tps / demo_tps:,.0f}x that bound")


if __name__ == "__main__":
    main()
