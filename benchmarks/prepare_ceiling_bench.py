"""The serial ceiling of `prepare`'s main process: workers that do nothing, so the main process's
own work (reading the input, the dedup spill and decisions, the spool, the sink's writes) sets the
pace; then the same corpus with the real workers, one of them, for the per-worker rate.

Model: with W workers the run goes at min(W x per-worker rate, main-process ceiling); the main
process stops being the bottleneck below W = ceiling / per-worker rate.

Two ways of moving a chunk's documents, in the same session:
- "through main" (`pipeline.LOCAL_PIECES = False`, what `--ray` and a trained tokenizer still do,
  and every run did before): the tokens come back to the main process, which spools, masks and
  writes them;
- "pieces" (the default with a given tokenizer and local workers): the workers keep them in files
  and copy their pieces into the outputs; the main process handles per-chunk counts and keys.
Main-process CPU seconds (its threads included, the workers and other children not) on the whole
corpus and on its first quarter give the ceiling and its marginal rate (fixed start-up left out).

`--trained`: the default command's path instead (no `--tokenizer`: pass 1 keeps the cleaned texts,
the replay draws the tokenizer sample, a tokenizer is trained on it, the encode stage tokenizes).
"through main" then sends every text through the main process three times (pass 1's results, the
replay's `Sink.take` into train/valid.spool, pass 2's reading of the spools); "pieces" keeps the
texts in pass 1's chunk files, draws the sample from (u, characters) by reference and encodes per
chunk in the workers. The no-op worker returns the block's lines as the texts, and the no-op encoder
100 tokens per document; the tokenizer is really trained, on a sample of `--sample-chars`
(the same in every run, so the marginal rate leaves it out).

The no-op worker answers each block of raw lines with what a real worker returns for it (one
document per line, 16 random key bytes, 9 band keys with --near, 100 tokens per document),
computed with a few numpy calls and no per-document Python.

`--format jsonl` writes the corpus as {"text": line} records first, `--compress gz|zst` compresses
it (gzip level 6, zstd level 3), so the same documents are measured as a .jsonl, .txt.gz or
.jsonl.zst input. The no-op worker then answers a block of .jsonl lines by reference like a block
of text lines (no JSON parsed: a no-op), documents that the main process parsed with their
count, and a compressed file (read whole by a worker on the per-chunk path) by running the real
reader in the worker (decompression, and JSON parsing for .jsonl.*: what the worker must do to
cut the file into chunks) and the no-op on each chunk.

Usage: nice python benchmarks/prepare_ceiling_bench.py CORPUS.txt [--near] [--workers 2] [--trained]
       [--format txt|jsonl] [--compress none|gz|zst]
(CORPUS: one document per line, e.g. a corpus that prepare_scale_bench.py --keep left behind,
or any .txt file; a tokenizer with a vocabulary of at least 1,000 is trained on its start.)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mspretrain.config.schema import PrepareConfig  # noqa: E402
from mspretrain.data.origin import RECORD  # noqa: E402
from mspretrain.data.tokenizer import Tokenizer, train_sentencepiece  # noqa: E402
from mspretrain.prepare import pipeline, sources, stage_encode, stage_read  # noqa: E402
from mspretrain.prepare import workers as worker_mod  # noqa: E402
from mspretrain.prepare.prepare import prepare  # noqa: E402
from mspretrain.prepare.results import ChunkResult  # noqa: E402

TOKENS_PER_DOC = 100
_NEAR = {"on": False}
_TEXTS = {"on": False}  # --trained: the no-op worker returns texts (no tokenizer yet), not tokens


def noop_chunk(work) -> dict:
    """What `workers.clean_chunk` returns for a chunk, without cleaning, hashing or encoding."""
    if not isinstance(work, sources.RawLines):
        return _noop_docs(work)
    blocks = [replace(work, rest=None), *(work.rest or [])]
    keys, origins, chars, texts = [], [], [], []
    for block in blocks:
        block = block.load()  # a reference to a block is read here, as a real worker reads it
        buf = np.frombuffer(block.data, dtype=np.uint8)
        ends = np.flatnonzero(buf == 10)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.uint64)
        origin = np.zeros(ends.size, dtype=RECORD)
        origin["file"], origin["offset"] = block.file, starts + np.uint64(block.offset)
        origins.append(origin)
        chars.append((ends - starts.astype(np.int64)).astype(np.int64) // 3)
        keys.append(np.random.default_rng(block.offset).bytes(16 * ends.size))
        if _TEXTS["on"]:
            texts += bytes(block.data).decode("utf-8", "replace").split("\n")[: ends.size]
    n = sum(o.size for o in origins)
    rng = np.random.default_rng(work.offset)
    if _TEXTS["on"]:
        return ChunkResult(**{"docs_in": n, "chars_in": sum(b.size or len(b.data) for b in blocks) // 3, "changed": {}, "dropped": {},
                "keys": b"".join(keys), "chars": np.fromiter(map(len, texts), dtype=np.int64, count=n), "u": rng.random((n, 2)),
                "bands": rng.integers(0, 2**63, size=(n, 9), dtype=np.uint64) if _NEAR["on"] else None,
                "raw": (work.file, n, 0, 0), "origin": np.concatenate(origins), "texts": texts})
    return ChunkResult(**{"docs_in": n, "chars_in": sum(b.size or len(b.data) for b in blocks) // 3, "changed": {}, "dropped": {},
            "keys": b"".join(keys), "chars": np.concatenate(chars), "u": rng.random((n, 2)),
            "bands": rng.integers(0, 2**63, size=(n, 9), dtype=np.uint64) if _NEAR["on"] else None,
            "raw": (work.file, n, 0, 0), "origin": np.concatenate(origins),
            "tokens": np.ones(n * TOKENS_PER_DOC, dtype=np.uint16), "lengths": np.full(n, TOKENS_PER_DOC, dtype=np.int32),
            "fallback": np.zeros(n, dtype=np.int64)})


def _noop_docs(work) -> dict:
    """The no-op answer for documents the main process (or a worker reading a compressed file) decoded."""
    docs, origin = work if isinstance(work, tuple) else (work, None)
    n = len(docs)
    rng = np.random.default_rng(n)
    if origin is None:
        origin = np.zeros(n, dtype=RECORD)
    out = {"docs_in": n, "chars_in": sum(map(len, docs)), "changed": {}, "dropped": {},
           "keys": rng.bytes(16 * n), "chars": np.fromiter(map(len, docs), dtype=np.int64, count=n), "u": rng.random((n, 2)),
           "bands": rng.integers(0, 2**63, size=(n, 9), dtype=np.uint64) if _NEAR["on"] else None,
           "raw": None, "origin": origin}
    if _TEXTS["on"]:
        out["texts"] = list(docs)
    else:
        out.update(tokens=np.ones(n * TOKENS_PER_DOC, dtype=np.uint16), lengths=np.full(n, TOKENS_PER_DOC, dtype=np.int32),
                   fallback=np.zeros(n, dtype=np.int64))
    return ChunkResult(**out)


def as_input(src: Path, tmp: Path, fmt: str, compress: str) -> Path:
    """The corpus as the input kind measured: .txt as is, or .jsonl, optionally .gz / .zst."""
    if fmt == "txt" and compress == "none":
        return src
    out = tmp / (src.stem + "." + fmt + ("" if compress == "none" else "." + compress))
    if compress == "gz":
        import gzip

        sink = gzip.open(out, "wb", compresslevel=6)
    elif compress == "zst":
        import zstandard

        sink = zstandard.ZstdCompressor(level=3).stream_writer(open(out, "wb"))
    else:
        sink = open(out, "wb")
    with open(src, encoding="utf-8") as f, sink:
        buf = []
        for line in f:
            buf.append((json.dumps({"text": line.rstrip("\n")}, ensure_ascii=False) + "\n") if fmt == "jsonl" else line)
            if len(buf) >= 65536:
                sink.write("".join(buf).encode())
                buf = []
        sink.write("".join(buf).encode())
    return out


def noop_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """`workers._encode` without encoding: 100 tokens per document."""
    return np.ones(len(texts) * TOKENS_PER_DOC, dtype=np.uint16), np.full(len(texts), TOKENS_PER_DOC, dtype=np.int32)


def noop_tokenize_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`workers.tokenize_chunk` (pass 2 through the main process) without encoding."""
    flat, lengths = noop_encode(texts)
    return flat, lengths, np.zeros(len(texts), dtype=np.int64)


def timed(corpus: Path, tok: Path | None, out: Path, cfg: PrepareConfig, workers: int) -> tuple[float, float, dict]:
    """(wall s, main-process CPU s, manifest); `tok` None: a tokenizer is trained."""
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.time()
    m = prepare([str(corpus)], out, cfg, tokenizer=str(tok) if tok else None, workers=workers, overwrite=True, log=lambda _: None)
    wall = time.time() - t0
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)
    shutil.rmtree(out, ignore_errors=True)
    return wall, cpu, m


def noop_run(corpus: Path, tok: Path | None, out: Path, cfg: PrepareConfig, workers: int, pieces: bool, repeat: int) -> tuple[float, int]:
    """(least main-process CPU s of `repeat` runs, documents read) with no-op workers (and no-op
    encoding after a trained tokenizer: the workers inherit the patched modules when they fork)."""
    # the stage modules hold the names they call (stage_read: pass 1, stage_encode: pass 2)
    real = stage_read.clean_chunk, pipeline.LOCAL_PIECES, stage_encode.tokenize_chunk, worker_mod._encode
    stage_read.clean_chunk, pipeline.LOCAL_PIECES, stage_encode.tokenize_chunk, worker_mod._encode = (
        noop_chunk, pieces, noop_tokenize_chunk, noop_encode)
    try:
        runs = [timed(corpus, tok, out, cfg, workers) for _ in range(repeat)]
    finally:
        stage_read.clean_chunk, pipeline.LOCAL_PIECES, stage_encode.tokenize_chunk, worker_mod._encode = real
    return min(cpu for _, cpu, _ in runs), runs[0][2]["documents_in"]


# One compressed corpus file: read whole by a worker (`pipeline.UNITS`), as with many files; by
# default a file is a unit only when there are at least as many compressed files as workers.
pipeline.UNITS = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--near", action="store_true", help="near dedup on (band keys in the results)")
    ap.add_argument("--workers", type=int, default=2, help="no-op workers")
    ap.add_argument("--repeat", type=int, default=2, help="no-op runs per setting (the least CPU counts)")
    ap.add_argument("--trained", action="store_true", help="no --tokenizer: the default command's path (a tokenizer is trained)")
    ap.add_argument("--sample-chars", type=int, default=300_000, help="with --trained: prepare.tokenizer_sample_chars")
    ap.add_argument("--skip-real", action="store_true", help="leave out the real 1-worker run (the per-worker rate)")
    ap.add_argument("--format", choices=("txt", "jsonl"), default="txt", help="the input as .txt lines or .jsonl records")
    ap.add_argument("--compress", choices=("none", "gz", "zst"), default="none")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prepare_ceiling_"))
    try:
        lines = []
        with open(args.corpus, encoding="utf-8") as f:
            for line in f:
                lines.append(line.rstrip("\n"))
                if len(lines) >= 20_000:
                    break
        trained, _ = train_sentencepiece(lines, tmp, 4000, character_coverage=1.0, num_threads=2, seed=0)
        tok = Tokenizer.load(trained.path).path
        cfg = replace(PrepareConfig(), doc_per_line=True, near_dedup=args.near)
        if args.trained:
            cfg = replace(cfg, vocab_size=4000, tokenizer_sample_chars=args.sample_chars)
            tok = None
        size = args.corpus.stat().st_size
        quarter = tmp / "quarter.txt"
        with open(args.corpus, "rb") as f:
            head = f.read(size // 4)
        quarter.write_bytes(head[: head.rfind(b"\n") + 1])
        (tmp / "full").mkdir()
        corpus = as_input(args.corpus, tmp / "full", args.format, args.compress)
        quarter = as_input(quarter, tmp, args.format, args.compress)
        size = corpus.stat().st_size  # (MB/s: of the input as given, compressed or not)
        print(f"corpus {corpus} ({size / 1e6:,.0f} MB), near dedup {'on' if args.near else 'off'}, "
              f"{args.workers} no-op workers, {'a trained' if args.trained else 'a given'} tokenizer, "
              f"load average {os.getloadavg()[0]:.2f} (2 shared cores)")
        _NEAR["on"], _TEXTS["on"] = args.near, args.trained
        ceiling = {}
        for pieces in (False, True):
            cpu, docs = noop_run(corpus, tok, tmp / "noop", cfg, args.workers, pieces, args.repeat)
            cpu_q, docs_q = noop_run(quarter, tok, tmp / "noop", cfg, args.workers, pieces, args.repeat)
            marginal = (docs - docs_q) / max(cpu - cpu_q, 1e-9)
            mb = (size - quarter.stat().st_size) / max(cpu - cpu_q, 1e-9) / 1e6
            ceiling[pieces] = (docs / cpu, marginal, cpu_q)
            print(f"{'pieces' if pieces else 'through main':>12}: main process {cpu:.2f} CPU s for {docs:,} documents "
                  f"({cpu_q:.2f} s for {docs_q:,}): ceiling {docs / cpu:,.0f} documents/s, {size / cpu / 1e6:,.0f} MB/s; "
                  f"marginal {marginal:,.0f} documents/s, {mb:,.0f} MB/s")
        if args.skip_real:
            print(f"ratio of the ceilings, pieces / through main: whole {ceiling[True][0] / ceiling[False][0]:.1f}x, "
                  f"marginal {ceiling[True][1] / ceiling[False][1]:.1f}x")
            return
        # the per-worker rate on the quarter (the workers' work is per document: the rate holds)
        wall1, cpu1, m1 = timed(quarter, tok, tmp / "real", cfg, 1)
        docs = m1["documents_in"]
        per_worker = docs / max(cpu1 - ceiling[True][2], 1e-9)
        print(f"real, 1 worker in-process (pieces), the quarter: {wall1:.1f} s wall, {cpu1:.1f} CPU s; per-worker rate "
              f"~{per_worker:,.0f} documents/s (its CPU minus the main process's)")
        for pieces in (False, True):
            whole, marginal, _ = ceiling[pieces]
            print(f"model, {'pieces' if pieces else 'through main':>12}: the main process is the bottleneck from "
                  f"W = ceiling / per-worker = {whole / per_worker:.1f} workers ({marginal / per_worker:.1f} at the marginal rate)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
