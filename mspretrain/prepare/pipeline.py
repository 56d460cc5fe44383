"""`prepare`'s pipeline: input files in, shards and a tokenizer in a work dir out.

Read (main process, streaming) -> clean + hash [+ MinHash] [+ tokenize] (worker processes,
chunks of ~256 K characters, `workers.py`) -> dedup + split + write (main process, input order,
`sink.py`). One-document-per-line files in UTF-8 / GB18030 reach the workers as undecoded blocks
of whole lines (`sources.RawLines`): the main process then only reads bytes, dedups and writes,
and stays off the critical path (it used to decode, split and pickle every document).

With local workers, the main process does per-chunk work only (its serial ceiling,
docs/benchmarks/prepare.md): the workers read their blocks of uncompressed files themselves
(`RawLines` by reference; of .jsonl files too, parsed there), decompress a compressed file whole
(`sources.FileUnit`, `workers.spill_unit`: its chunks are the next chunks here), keep each
chunk's documents in a file (`PIECES`, named by work item: tokens with a given tokenizer, else the
cleaned texts), write its dedup records where the main process reserved their place
(`diskdedup.place_records`), sort the dedup partitions, and cut and copy each chunk's shard and
origin pieces into the outputs at reserved offsets (`workers.replay_chunk`, `workers.place_piece`):
in the replay with a given tokenizer, else in the encode stage, after the replay drew the tokenizer
sample by reference (`stage_replay.ReplaySample`, `sink.RefSample`) and the tokenizer was trained on the
sample's texts read from the chunk files. `--ray` (whose nodes may not share this disk) takes the
path through the main process; both paths write the same bytes.

Work is cut into chunks in input order and the results are consumed in that order (`pool.py`),
so the output is byte-identical whatever the number of workers.

The stages are objects (`stage.Stage`), one module each (`stage_scan`, `stage_read`,
`stage_dedup`, `stage_replay`, `stage_encode`, `stage_finalize`, `stage_publish`); `chain` picks
them once per run, and `run` starts the chain at the stage the journal names (`resume.py`). The
work dir has one owner, `workdir.WorkDir` (`Run.files`): it names every entry a stage writes,
and only it creates, renames or removes them.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from mspretrain.config.schema import PrepareConfig
from mspretrain.data.shards import token_dtype
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.errors import UserError
from mspretrain.prepare import sources
from mspretrain.prepare.resume import Journal
from mspretrain.prepare.scoring import QualityStage
from mspretrain.prepare.stage import Run, Stage
from mspretrain.prepare.stage_dedup import Dedup
from mspretrain.prepare.stage_encode import EncodePieces, EncodeSpools, TrainTokenizer
from mspretrain.prepare.stage_finalize import Finalize
from mspretrain.prepare.stage_publish import Publish
from mspretrain.prepare.stage_read import ReadClean
from mspretrain.prepare.stage_replay import ReplayPieces, ReplaySample, ReplayTake
from mspretrain.prepare.stage_scan import ScoreScan
from mspretrain.prepare.workdir import WorkDir

LOCAL_PIECES = True  # False: every chunk's documents pass through this process, as with --ray (benchmarks compare)
# Compressed files as whole-file units read by a worker (`sources.FileUnit`), on the per-chunk path:
# None = when there are at least as many compressed files as workers (fewer would leave workers
# idle: one worker per file, while this process can feed them all); True / False: always / never.
UNITS: bool | None = None


def chain(given: bool, pieces: bool, scan: bool = False) -> list[Stage]:
    """The stages of a run, in order. `given`: a tokenizer was given (no training, the replay
    writes the shards); `pieces`: pass 1's chunks in files written by local workers, else every
    chunk through this process (Ray's nodes may not share this disk); `scan`: a quality filter
    keeps a fraction and no other data dir gives the scores, so every document is scored first.
    Both paths write the same bytes; the journal names the stage a run is in, so a resumed run
    takes the same chain."""
    first = [ScoreScan()] if scan else []
    if given:
        return [*first, ReadClean(), Dedup(), ReplayPieces() if pieces else ReplayTake(tokens=True), Finalize(), Publish()]
    return [*first, ReadClean(), Dedup(), ReplaySample() if pieces else ReplayTake(tokens=False), TrainTokenizer(),
            EncodePieces() if pieces else EncodeSpools(), Finalize(), Publish()]


def run(paths: list[Path], names: list[str], work: Path, cfg: PrepareConfig, given: Tokenizer | None, workers: int, progress: bool,
        log: Callable[[str], None], warn: Callable[[str], None], stats: sources.SourceStats, journal: Journal,
        ray=None, quality: QualityStage | None = None, *, out: Path, inputs: list[str], seq_len: int | None = None,
        reference: bytes | None = None) -> dict:
    """[Score every document,] read, clean, dedup, split, [train the tokenizer,] tokenize and
    write the shards and the manifest into `work`, then publish it as `out`; returns the manifest.

    With a given tokenizer, one pass: workers clean and tokenize. Otherwise pass 1 cleans, the
    replay keeps a bounded, uniform sample to train the tokenizer on, and the encode stage
    tokenizes the kept documents: from pass 1's chunk files (local workers), or from the spools
    the replay wrote (Ray). `ray`: a `raypool.RayCluster` that runs the chunks instead of
    local worker processes (`workers` is then its CPU count). `quality`: the model-based filters
    (`scoring.py`), run in pass 1's workers after cleaning; their scores go to `scoring.SCORES`.
    A quality stage that keeps a fraction and has no source yet (`rescore.resolve` gives it one)
    gets the scan first. `inputs`, `seq_len` and `reference` (the bytes of the perplexity model
    of `prepare.lm_reference`) go to the data dir too.

    Each stage is resumed after a kill from the journal (`resume.py`): "scan" (from its last
    commit), "pass1" (from its last commit), "dedup" (the partitions without a saved result),
    "replay" (from its last commit), "train" (redone whole), "encode" (from its last commit),
    "finalize" (redone), "publish" (the finished work dir moved into place). `journal.stage`
    says where this call starts.
    """
    j = journal
    j.units_per_commit = workers  # a commit once each worker finished about one chunk (`Journal.due`)
    done = j.data.get("pass1")
    # fixed by the run that started pass 1: its spool holds one kind of record or the other
    pieces = ray is None and LOCAL_PIECES if done is None else bool(done.get("pieces"))
    stages = chain(given is not None, pieces, scan=quality is not None and quality.by_fraction and quality.source is None)
    order = [s.name for s in stages]
    if j.stage is None:  # a fresh journal: it names the first stage before that stage's work starts
        j.commit(stage=order[0])
    if j.stage not in order:  # (the journal's check sum makes this a version mismatch, never an edit)
        raise UserError(f"{j.path} names the stage {str(j.stage)[:40]!r}, which this run's chain ({', '.join(order)}) does not have",
                        f"delete {j.work} and {j.path} to start over")
    start = order.index(j.stage)
    finished = start == len(stages) - 1  # publish: the work dir is the finished data dir, nothing more goes into it
    tok = None
    if given is not None and not finished:
        tok = replace(given, path=given.save_to(work))  # the same model: no second parse (serial time before the workers start)
    r = Run(paths=paths, names=names, files=WorkDir(work, j), cfg=cfg, given=given, tok=tok,
            dtype=token_dtype(given.vocab_size) if given is not None else token_dtype(cfg.vocab_size), workers=workers,
            progress=progress, log=log, warn=warn, stats=stats, journal=j, ray=ray, quality=quality, pieces=pieces, units=UNITS,
            t0=time.time(), total_bytes=sum(p.stat().st_size for p in paths), out=out, inputs=inputs, seq_len=seq_len,
            reference=reference)
    if start:
        if not finished:
            for s in stages[:start]:
                s.resumed_past(r)
        stages[start].resume(r)
    for k in range(start, len(stages)):
        stages[k].run(r, order[k + 1] if k + 1 < len(stages) else None)
    return r.manifest
