"""Requests per second of our lm-eval model (mspretrain/eval/harness.py) against lm-eval's own `hf`
model on the same checkpoint's `export --format hf` folder (issue 53): the same requests (the
shipped tasks mspretrain_zh_choices: loglikelihood, mspretrain_zh_rolling: loglikelihood_rolling,
mspretrain_zh_gen: greedy generate_until), the same batch size and CPU threads, one process.

A random model of a small real shape (dim 256, 4 layers, 8 heads / 4 KV heads, vocab 2,000,
context 256) in fp32 on CPU. Each backend answers every request type twice: the first pass
includes MindSpore's graph compilation (torch has none), the second is the steady state; the
ratio printed is ours / hf on the second pass (> 1: ours is faster).

    python benchmarks/harness_bench.py                 # batch 8, 2 threads
    python benchmarks/harness_bench.py --batch-size 16 --threads 1
"""
from __future__ import annotations

import argparse
import io
import os
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tokenizer(path: Path, vocab: int) -> Path:
    import sentencepiece as spm

    from mspretrain.eval.harness import SHIPPED_TASKS

    rng = random.Random(0)
    text = (SHIPPED_TASKS.parent / "data" / "zh_generic.jsonl").read_text(encoding="utf-8")
    chars = sorted({c for c in text if "\u4e00" <= c <= "\u9fff"})
    lines = ["".join(rng.choice(chars) for _ in range(rng.randint(4, 40))) for _ in range(3000)] + text.splitlines()
    buf = io.BytesIO()
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=vocab,
                                   character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
                                   num_threads=1, minloglevel=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return path


def requests(names: list[str]) -> dict[str, list]:
    from mspretrain.eval import harness

    tm, built = harness.resolve_tasks(names)
    out: dict[str, list] = {}
    for task in built:
        task.build_all_requests(rank=0, world_size=1)
        for inst in task.instances:
            out.setdefault(inst.request_type, []).append(inst)
    return out


def timed(lm, reqs: dict[str, list]) -> dict[str, tuple[float, float]]:
    res = {}
    for kind, rs in reqs.items():
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            getattr(lm, kind)(rs, disable_tqdm=True) if kind != "generate_until" else lm.generate_until(rs, disable_tqdm=True)
            runs.append(time.perf_counter() - t0)
        res[kind] = (runs[0], runs[1])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM

    from mspretrain.checkpoint.store import write_weights_only_checkpoint
    from mspretrain.cli import main as cli
    from mspretrain.config.schema import Config, DeviceConfig, ModelConfig, resolve_model
    from mspretrain.eval import harness
    from mspretrain.model.decoder import Decoder, state_numpy

    torch.set_num_threads(a.threads)
    root = Path(tempfile.mkdtemp(prefix="harness-bench-"))
    tok = tokenizer(root / "tok" / "tokenizer.model", 2000)
    cfg = resolve_model(ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2000, max_seq_len=256, init_std=0.05))
    ck = root / "ckpt"
    write_weights_only_checkpoint(ck, state_numpy(Decoder(cfg, seed=0)),
                                  replace(Config(), model=cfg, device=DeviceConfig(threads=a.threads)), tokenizer_path=tok)
    assert cli(["export", str(ck), "--format", "hf", "--out", str(root / "hf"), "--quiet"]) == 0
    reqs = requests(["mspretrain_zh_choices", "mspretrain_zh_rolling", "mspretrain_zh_gen"])
    ours = harness.MindSporeLM.from_path(ck, batch_size=a.batch_size)
    hf = HFLM(pretrained=str(root / "hf"), batch_size=a.batch_size, prefix_token_id=2, device="cpu")
    t_ours, t_hf = timed(ours, reqs), timed(hf, reqs)
    print(f"model dim 256, 4 layers, vocab 2000, fp32; batch {a.batch_size}, {a.threads} threads (torch {torch.__version__})")
    print(f"{'request type':24} {'n':>4} {'ours req/s':>11} {'hf req/s':>9} {'ratio':>6}   first pass (ours incl. compile / hf), s")
    for kind, rs in reqs.items():
        (o1, o2), (h1, h2) = t_ours[kind], t_hf[kind]
        print(f"{kind:24} {len(rs):4d} {len(rs) / o2:11.1f} {len(rs) / h2:9.1f} {h2 / o2:6.2f}   {o1:.2f} / {h1:.2f}")


if __name__ == "__main__":
    main()
