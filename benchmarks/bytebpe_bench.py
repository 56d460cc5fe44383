"""`prepare --tokenizer` with a byte-level BPE tokenizer.json (Qwen's and Llama-3's kind, encoded by
the `tokenizers` library's batch encoder) beside a SentencePiece BPE (our C encoder), same corpus.

Both tokenizers are trained here on the same sample with the same vocabulary size: the
SentencePiece one with `prepare`'s recipe, the byte-level one with `tokenizers`' BpeTrainer
(ByteLevel pre-tokenizer, as Qwen2's tokenizer.json). Then, alternating, best of --repeat:
(a) the whole `prepare` (read, clean, dedup, split, tokenize in --workers processes, write
shards) with each tokenizer; (b) the encoder alone in this process on every line (SentencePiece
through `Tokenizer._encode_ids`, `tokenizers` through `encode_batch`, its own thread pool).

Usage: python benchmarks/bytebpe_bench.py [--mb 10] [--workers N] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prepare_bench import build_corpus  # noqa: E402
from mspretrain.config.schema import PrepareConfig  # noqa: E402
from mspretrain.data.tokenizer import Tokenizer, train_sentencepiece  # noqa: E402
from mspretrain.prepare.prepare import prepare  # noqa: E402


def byte_level_bpe(lines: list[str], vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       special_tokens=["<|endoftext|>"], show_progress=False))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vocab-size", type=int, default=16000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bytebpe_bench_"))
    try:
        corpus = work / "corpus.txt"
        size, chars, n_lines = build_corpus(corpus, args.mb, 1)
        lines = corpus.read_text(encoding="utf-8").splitlines()
        sample = lines[: len(lines) // 4]
        (work / "sp").mkdir()
        sp, _ = train_sentencepiece(sample, work / "sp", args.vocab_size, num_threads=args.workers)
        bl = Tokenizer.load(byte_level_bpe(sample, args.vocab_size, work / "bl"))
        toks = {"sentencepiece": sp, "byte-level (tokenizers)": bl}
        cfg = PrepareConfig(vocab_size=args.vocab_size, doc_per_line=True, valid_fraction=0.01)
        best: dict[str, dict[str, float]] = {k: {"prepare": 1e9, "encode": 1e9} for k in toks}
        n_tokens: dict[str, int] = {}
        for _ in range(args.repeat):
            for name, tok in toks.items():
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                m = prepare([str(corpus)], out, cfg, tokenizer=str(tok.path), workers=args.workers, log=lambda _: None)
                best[name]["prepare"] = min(best[name]["prepare"], time.perf_counter() - t0)
                n_tokens[name] = int(m["tokens"]["train"]) + int(m["tokens"]["valid"])
                t0 = time.perf_counter()
                tok._encode_ids(lines)
                best[name]["encode"] = min(best[name]["encode"], time.perf_counter() - t0)
        print(f"corpus {size / 1e6:.1f} MB, {chars:,} characters, {n_lines:,} lines; vocab {args.vocab_size}; "
              f"{args.workers} workers; best of {args.repeat}")
        ref = best["sentencepiece"]
        for name, t in best.items():
            print(f"{name:26s} prepare {t['prepare']:6.2f} s ({size / 1e6 / t['prepare']:5.2f} MB/s, x{ref['prepare'] / t['prepare']:.2f})"
                  f"   encode alone {t['encode']:6.2f} s ({size / 1e6 / t['encode']:5.2f} MB/s, x{ref['encode'] / t['encode']:.2f})"
                  f"   {n_tokens[name]:,} tokens")
        print(json.dumps({"best_s": best, "tokens": n_tokens}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
