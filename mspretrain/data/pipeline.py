"""`prepare`'s pipeline: input files in, shards and a tokenizer in a work dir out.

Read (main process, streaming) -> clean + hash [+ MinHash] [+ tokenize] (worker processes,
chunks of ~256 K characters, `workers.py`) -> dedup + split + write (main process, input order,
`sink.py`). One-document-per-line files in UTF-8 / GB18030 reach the workers as undecoded blocks
of whole lines (`sources.RawLines`): the main process then only reads bytes, dedups and writes,
and stays off the critical path (it used to decode, split and pickle every document).

Work is cut into chunks in input order and the results are consumed in that order (`pool.py`),
so the output is byte-identical whatever the number of workers.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from mspretrain.config import PrepareConfig
from mspretrain.data import clean, dedup, sources
from mspretrain.data.diskdedup import ChunkSpool, DiskDedup
from mspretrain.data.origin import RECORD, OriginWriter, origin_name, read_records
from mspretrain.data.pool import batched, chunks, ordered, start_pool
from mspretrain.data.publish import build_manifest
from mspretrain.data.shards import ShardWriter, token_dtype
from mspretrain.data.sink import Sink
from mspretrain.data.spool import Spool
from mspretrain.data.tokenizer import Tokenizer, train_sentencepiece
from mspretrain.data.workers import clean_chunk, init_worker, tokenize_chunk
from mspretrain.errors import UserError
from mspretrain.paths import SPLITS


def progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                dynamic_ncols=True, leave=False)


def chunks_with_origin(batches: Iterable[list[str] | sources.RawLines]) -> Iterator[tuple[list[str], np.ndarray] | sources.RawLines]:
    """`pool.chunks(batches)`, each chunk of documents paired with its documents' origin records
    (a `RawLines` chunk carries its own). `chunks` builds plain lists, so the records of the
    batches it reads wait here, in order, until the chunk holding their documents comes out."""
    pending: deque[np.ndarray] = deque()

    def noted() -> Iterator[list[str] | sources.RawLines]:
        for b in batches:
            if not isinstance(b, sources.RawLines):
                pending.append(b.origin)
            yield b

    for chunk in chunks(noted()):
        if isinstance(chunk, sources.RawLines):
            yield chunk
            continue
        n, parts = len(chunk), []
        while n:
            head = pending[0]
            if head.size <= n:
                parts.append(pending.popleft())
                n -= head.size
            else:
                parts.append(head[:n])
                pending[0] = head[n:]
                n = 0
        yield chunk, np.concatenate(parts) if parts else np.zeros(0, dtype=RECORD)


def run(paths: list[Path], names: list[str], work: Path, cfg: PrepareConfig, given: Tokenizer | None, workers: int, progress: bool,
        log: Callable[[str], None], warn: Callable[[str], None], stats: sources.SourceStats, ray=None) -> dict:
    """Read, clean, dedup, split, [train the tokenizer,] tokenize and write the shards into
    `work`; returns the manifest (without the keys that depend on prepare's arguments).

    With a given tokenizer, one pass: workers clean and tokenize. Otherwise pass 1 cleans and
    spools the kept documents (and keeps a bounded, uniform sample to train the tokenizer on),
    and pass 2 tokenizes the spool. `ray`: a `raypool.RayCluster` that runs the chunks instead of
    local worker processes (`workers` is then its CPU count).
    """
    in_flight = 2 * workers + 1
    t0 = time.time()
    total_bytes = sum(p.stat().st_size for p in paths)
    log(f"reading {len(paths)} file{'s' * (len(paths) != 1)} ({total_bytes / 1e6:,.1f} MB) with {workers} worker{'s' * (workers != 1)}")
    if given is not None:
        tok_path = given.save_to(work)
        tok = replace(given, path=tok_path)  # the same model: no second parse (serial time before the workers start)
    dtype = token_dtype(given.vocab_size) if given is not None else token_dtype(cfg.vocab_size)
    writers = {s: ShardWriter(work / s, dtype) for s in SPLITS}
    spools = None if given is not None else {s: Spool(work / f"{s}.spool") for s in SPLITS}
    origins = {s: OriginWriter(work / origin_name(s)) for s in SPLITS}
    sink = Sink(cfg, writers if given is not None else spools, 0 if given is not None else cfg.tokenizer_sample_chars, origins)
    # Dedup state on disk (`diskdedup`): ~24 bytes per document for exact keys, ~16 per LSH band.
    dd = DiskDedup(work / "dedup.tmp", total_bytes, cfg.near_dedup, cfg.near_dedup_threshold)
    spool = ChunkSpool(work / "pass1.tmp")
    bar = progress_bar(progress, total_bytes, "clean" if given is None else "clean+tokenize")
    lsh = (dd.bands, dd.rows, *dedup._permutations(cfg.seed, dedup.NUM_PERM)) if cfg.near_dedup else None
    pool = start_pool(workers, init_worker, (cfg, str(tok_path) if given is not None else None, dtype.name, lsh), warm_up=clean.warm_up, ray=ray)
    try:
        docs = sources.iter_batches(paths, doc_per_line=cfg.doc_per_line, text_field=cfg.text_field,
                                    stats=stats, warn=warn, progress=bar.update if bar else None, raw=True, names=names)
        for result in ordered(pool, clean_chunk, chunks_with_origin(docs), in_flight):
            if result["raw"] is not None:
                sources.count_raw(stats, *result["raw"])
            dd.add(result["keys"], result.pop("bands"))
            spool.add(result)
        spool.close()
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    sources.report_raw_files(stats, warn)
    t1 = time.time()
    dd.resolve(ray.map if ray is not None else map)  # with Ray, each partition is a task
    log(f"dedup: {dd.n:,} cleaned documents decided on disk ({time.time() - t1:.1f} s)")
    done = 0
    for result in spool.read():  # pass 1's results again, now with their fate known
        n = len(result["chars"])
        sink.take(result, *dd.dropped(done, done + n))
        done += n
    shutil.rmtree(dd.root, ignore_errors=True)
    warnings = sink.finish()
    for o in origins.values():
        o.close()
    for w in warnings:
        warn(w)
    if sink.docs["train"] + sink.docs["valid"] == 0 and stats.files == 0:
        # nothing was read at all: the reason is in the skips, not in the fields or the filters
        why = ", ".join(f"{v} {k}" for k, v in sorted(stats.skipped.items()))
        raise UserError(f"no documents left: all {len(paths)} input file{'s' * (len(paths) != 1)} were skipped ({why})",
                        "the warnings above say why for each file; prepare reads UTF-8 / GB18030 text (.txt, .jsonl, optionally .gz / .zst)")
    if sink.docs["train"] + sink.docs["valid"] == 0:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(sink.dropped.items())) or "none"
        raise UserError(f"no documents left: {sink.docs_in} read, all dropped (dropped: {dropped})",
                        "check the inputs (--text-field for .jsonl, --doc-per-line for .txt), or relax prepare.min_chars and the filters")
    kept = sink.docs["train"] + sink.docs["valid"]
    log(f"kept {kept:,} of {sink.docs_in:,} documents ({sink.chars['train'] + sink.chars['valid']:,} characters, "
        f"{time.time() - t0:.1f} s)")

    tok_info: dict = {"trained": given is None}
    if given is None:
        for s in spools.values():
            s.close()
        sample = sink.sample_texts()
        n_chars = sum(map(len, sample))
        log(f"training a SentencePiece BPE tokenizer (vocab {cfg.vocab_size:,}) on {n_chars:,} characters")
        trained, tok_warnings = train_sentencepiece(sample, work, cfg.vocab_size, character_coverage=cfg.character_coverage,
                                                    num_threads=min(workers, len(os.sched_getaffinity(0))), seed=cfg.seed)
        del sample
        log(f"trained the tokenizer ({time.time() - t0:.1f} s)")
        for w in tok_warnings:
            warn(w)
        tok_path, tok = trained.path, trained
        tok_info.update(sample_characters=n_chars, character_coverage=cfg.character_coverage, warnings=tok_warnings)
        if token_dtype(tok.vocab_size) != dtype:
            raise AssertionError("trained vocab does not fit the planned token dtype")
        bar = progress_bar(progress, sum(s.path.stat().st_size for s in spools.values()), "tokenize")
        pool = start_pool(workers, init_worker, (cfg, str(tok_path), dtype.name), warm_up=clean.warm_up, ray=ray)
        try:
            for split in SPLITS:
                texts = batched(spools[split].read(bar.update if bar else None))
                files = read_records(origins[split].path)["file"]  # the spooled documents' input files, in order
                done = 0
                for flat, lengths, fallback in ordered(pool, tokenize_chunk, chunks(texts), in_flight):
                    writers[split].add_flat(flat, lengths)
                    sink.per_file.add(files[done: done + lengths.size], documents=np.zeros(lengths.size),
                                      tokens=lengths.astype(np.int64) - 1, byte_fallback=fallback)
                    done += lengths.size
        finally:
            if pool is not None:
                pool.terminate()
            if bar is not None:
                bar.close()
        for s in spools.values():
            s.path.unlink()
    else:
        tok_info["source"] = str(given.path)
    for w in writers.values():
        w.finalize(fsync=False)  # prepare fsyncs every file of the data dir at once, before publishing
    manifest = build_manifest(work, cfg, stats, sink, tok, tok_info, dtype)
    # the largest id per shard, counted while writing: `train` checks it against the vocabulary
    # instead of reading every shard (data/manifest.py, check_data_dir)
    manifest["max_token_id"] = {s: w.max_token for s, w in writers.items()}
    return manifest
