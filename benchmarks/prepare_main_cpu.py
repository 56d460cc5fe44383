"""The main process's CPU seconds on the trained tokenizer's per-chunk path with no-op workers
(`prepare_ceiling_bench.py --trained`'s pieces side only, least of 3, on a corpus and its first
quarter), for A/B comparisons of two checkouts or of chunk sizes, run back to back.

Usage: nice python benchmarks/prepare_main_cpu.py CHECKOUT CORPUS.txt [BLOCKS_PER_CHUNK]
(CHECKOUT: the repository root whose code is measured; BLOCKS_PER_CHUNK sets
`pool.RAW_GROUP_BY_REFERENCE`, default the checkout's own.)
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

root = Path(sys.argv[1]).resolve()
sys.path[:0] = [str(root / "benchmarks"), str(root)]

import prepare_ceiling_bench as bench  # noqa: E402

from mspretrain.config.schema import PrepareConfig  # noqa: E402
from mspretrain.prepare import pool  # noqa: E402


def main() -> None:
    corpus = Path(sys.argv[2])
    if len(sys.argv) > 3:
        pool.RAW_GROUP_BY_REFERENCE = int(sys.argv[3])
    tmp = Path(tempfile.mkdtemp(prefix="prepare_main_cpu_"))
    try:
        size = corpus.stat().st_size
        with open(corpus, "rb") as f:
            head = f.read(size // 4)
        quarter = tmp / "quarter.txt"
        quarter.write_bytes(head[: head.rfind(b"\n") + 1])
        bench._TEXTS["on"] = True
        cfg = replace(PrepareConfig(), doc_per_line=True, tokenizer_sample_chars=300_000, vocab_size=4000)
        cpu, docs = bench.noop_run(corpus, None, tmp / "n", cfg, 2, True, 3)
        cpu_q, docs_q = bench.noop_run(quarter, None, tmp / "n", cfg, 2, True, 3)
        print(f"{root.name}, {pool.RAW_GROUP_BY_REFERENCE} blocks a chunk: main process {cpu:.3f} CPU s whole, {cpu_q:.3f} s "
              f"the quarter; marginal {(docs - docs_q) / (cpu - cpu_q) / 1e6:.2f} M docs/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
