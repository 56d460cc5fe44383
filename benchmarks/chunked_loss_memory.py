"""What the chunked LM-head loss (optim.loss_chunk_tokens, model/loss.py `ChunkedNLL`) saves on
MindSpore's CPU backend, and what it costs in time.

A one-layer fp32 decoder of dim 64 with a large vocabulary, so that the fp32 logits (and the
loss's exp, and their gradients) are most of what a step holds: B x T tokens x V x 4 bytes each.
Each case is a fresh process; the measure is the growth of VmHWM during the first step call
(compile + run) over the RSS after the TrainStep was built, and the median time of 3 more steps.
The reference is chunk 0 (the whole micro-batch's logits at once), run in the same script.

    python benchmarks/chunked_loss_memory.py                       # V 65,536, 2 x 1,024 tokens, chunks 0,256
    python benchmarks/chunked_loss_memory.py --vocab 32768 --chunks 0,128,512
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MB = 2**20


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def one(vocab: int, batch: int, seq: int, chunk: int) -> dict:
    import numpy as np

    from mspretrain.config.schema import ModelConfig, OptimConfig, resolve_model
    from mspretrain.model.decoder import Decoder
    from mspretrain.step.step import TrainStep

    cfg = resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=seq + 1), vocab_size=vocab)
    model = Decoder(cfg, dtype="fp32", seed=0)
    step = TrainStep(model, OptimConfig(lr=1e-4, loss_chunk_tokens=chunk), global_tokens=batch * seq)
    data = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    before = _vm("VmRSS")
    loss = step.run([(data, None, None)], lr=1e-4, scale=1.0).loss
    growth = _vm("VmHWM") - before
    times = []
    for _ in range(3):
        t = time.perf_counter()
        step.run([(data, None, None)], lr=1e-4, scale=1.0)
        times.append(time.perf_counter() - t)
    return {"chunk": chunk, "growth_mb": growth / MB, "step_s": sorted(times)[1], "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--chunks", default="0,256")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.vocab, a.batch, a.seq, a.one)))
        return
    logits_mb = a.batch * a.seq * a.vocab * 4 / MB
    print(f"vocab {a.vocab:,}, {a.batch} x {a.seq} tokens: one fp32 logits tensor is {logits_mb:,.0f} MB")
    rows = []
    for chunk in (int(c) for c in a.chunks.split(",")):
        out = subprocess.run([sys.executable, __file__, "--vocab", str(a.vocab), "--batch", str(a.batch), "--seq", str(a.seq),
                              "--one", str(chunk)], capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ref = rows[0]
    for r in rows:
        print(f"chunk {r['chunk']:>6}: first-call growth {r['growth_mb']:8.0f} MB ({r['growth_mb'] / ref['growth_mb']:.2f} x chunk "
              f"{ref['chunk']}; {r['growth_mb'] / logits_mb:.1f} logits), step {r['step_s']:.3f} s "
              f"({r['step_s'] / ref['step_s']:.2f} x), loss {r['loss']:.6f}")


if __name__ == "__main__":
    main()
