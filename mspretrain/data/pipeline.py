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
sample by reference (`_replay_sample`, `sink.RefSample`) and the tokenizer was trained on the
sample's texts read from the chunk files. `--ray` (whose nodes may not share this disk) takes the
path through the main process; both paths write the same bytes.

Work is cut into chunks in input order and the results are consumed in that order (`pool.py`),
so the output is byte-identical whatever the number of workers.
"""
from __future__ import annotations

import heapq
import io
import os
import pickle
import shutil
import subprocess
import time
from collections import deque
from dataclasses import replace
from functools import partial
from itertools import zip_longest
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from mspretrain.config import PrepareConfig
from mspretrain.data import clean, dedup, sources
from mspretrain.data.diskdedup import ChunkSpool, DiskDedup, place_records
from mspretrain.data.origin import OriginWriter, cut_to, origin_name, read_records
from mspretrain.data.pool import batched, chunks, chunks_with_origin, ordered, start_pool
from mspretrain.data.progress import progress_bar
from mspretrain.data.publish import build_manifest
from mspretrain.data.rescore import attach
from mspretrain.data.results import UnitResult
from mspretrain.data.resume import Journal, point, truncate
from mspretrain.data.scoring import SCORES, QualityStage, ScoreWriter
from mspretrain.data.shards import ShardWriter, token_dtype
from mspretrain.data.sink import RefSample, Sink
from mspretrain.data.spool import Spool, read_spool
from mspretrain.data.tokenizer import Tokenizer, train_sentencepiece
from mspretrain.data.workers import clean_chunk, init_worker, place_piece, read_small, read_texts, replay_chunk, spill_item, tokenize_chunk
from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write
from mspretrain.paths import SPLITS

LOCAL_PIECES = True  # False: every chunk's documents pass through this process, as with --ray (benchmarks compare)
# Compressed files as whole-file units read by a worker (`sources.FileUnit`), on the per-chunk path:
# None = when there are at least as many compressed files as workers (fewer would leave workers
# idle: one worker per file, while this process can feed them all); True / False: always / never.
UNITS: bool | None = None
PIECES = "pass1.pieces"  # pass 1's per-chunk files written by the workers (`workers.spill_chunk`)
REPLAY_PIECES = "replay.pieces"  # the replay's per-chunk shard and origin pieces (`workers.replay_chunk`)


def run(paths: list[Path], names: list[str], work: Path, cfg: PrepareConfig, given: Tokenizer | None, workers: int, progress: bool,
        log: Callable[[str], None], warn: Callable[[str], None], stats: sources.SourceStats, journal: Journal,
        ray=None, quality: QualityStage | None = None) -> dict:
    """Read, clean, dedup, split, [train the tokenizer,] tokenize and write the shards into
    `work`; returns the manifest (without the keys that depend on prepare's arguments).

    With a given tokenizer, one pass: workers clean and tokenize. Otherwise pass 1 cleans, the
    replay keeps a bounded, uniform sample to train the tokenizer on, and the encode stage
    tokenizes the kept documents: from pass 1's chunk files (local workers), or from the spools
    the replay wrote (Ray). `ray`: a `raypool.RayCluster` that runs the chunks instead of
    local worker processes (`workers` is then its CPU count). `quality`: the model-based filters
    (`scoring.py`), run in pass 1's workers after cleaning; their scores go to `scoring.SCORES`.

    Stages, each resumed after a kill from the journal (`resume.py`): "pass1" (from its last
    commit), "dedup" (the partitions without a saved result), "replay" (from its last commit),
    "train" (redone whole), "encode" (from its last commit), "finalize" (redone).
    `journal.stage` says where this call starts.
    """
    t0 = time.time()
    j = journal
    j.units_per_commit = workers  # a commit once each worker finished about one chunk (`Journal.due`)
    removing: list = []  # background removals of scratch dirs (`_remove_later`)
    total_bytes = sum(p.stat().st_size for p in paths)
    if given is not None:
        tok_path = given.save_to(work)
        tok = replace(given, path=tok_path)  # the same model: no second parse (serial time before the workers start)
    dtype = token_dtype(given.vocab_size) if given is not None else token_dtype(cfg.vocab_size)
    # Dedup state on disk (`diskdedup`): ~24 bytes per document for exact keys, ~16 per LSH band.
    dd = (DiskDedup(work / "dedup.tmp", total_bytes, dedup.LshSettings.of(cfg))
          if j.stage in ("pass1", "dedup", "replay") else None)
    spool_path = work / "pass1.tmp"
    if j.stage == "pass1":
        log(f"reading {len(paths)} file{'s' * (len(paths) != 1)} ({total_bytes / 1e6:,.1f} MB) with {workers} worker{'s' * (workers != 1)}"
            + (f", resuming after chunk {j.data['pass1']['chunks']:,}" if "pass1" in j.data else ""))
        _pass1(paths, names, cfg, given is not None and str(tok_path), dtype, dd, spool_path, workers, progress, warn, stats, j, ray,
               quality)
    else:
        log(f"resuming the interrupted prepare at its stage '{j.stage}'")
        saved = _load_state(j, j.data["state"])
        stats.per_file[:], stats.ignored = saved["stats"].per_file, saved["stats"].ignored
        j.warnings[:] = saved["warnings"]
    if j.stage == "dedup":
        t1 = time.time()
        dd.restore(j.data["pass1"]["dedup"])  # files cut back to the commit (nothing was written after it)
        # with Ray each partition is a task; the records stay until the decisions are on disk, and
        # each partition's result is saved as it comes (`decided`): a kill here sorts again only
        # the partitions that had none
        decided, files = dd.decided_count()
        if decided:
            log(f"dedup: resuming, {decided:,} of {files:,} partitions decided")

        def done(name: str) -> None:
            point(f"dedup part {name}")  # after its result file was renamed into place: that is its commit

        if ray is not None:
            dd.resolve(ray.map, remove=False, decided=done)
        else:  # local workers read and sort the partitions (independent, split by key), if there are a few
            pool = start_pool(workers if files - decided > 2 else 1, init_worker, (cfg, None, dtype.name))
            try:
                dd.resolve(pool.imap if pool is not None else map, remove=False, by_path=True, decided=done)
            finally:
                if pool is not None:
                    pool.terminate()
        point("dedup resolved")
        path = j.state_path("decisions.npy")
        dd.save_decisions(path)
        j.commit(fsync=[path, path.parent], stage="replay")
        removing.append(_remove_later(dd.root))
        log(f"dedup: {dd.n:,} cleaned documents decided on disk ({time.time() - t1:.1f} s)")
    if j.stage == "replay":
        dd.load_decisions(j.state_path("decisions.npy"))
        shutil.rmtree(dd.root, ignore_errors=True)
        spool = ChunkSpool(spool_path, j.data["pass1"]["spool_bytes"], j.data["pass1"]["chunks"])
        spool.close()
        sink, writers, origins = _replay(paths, work, cfg, given is not None, dtype, dd, spool, log, warn, stats, j, t0,
                                min(workers, len(os.sched_getaffinity(0))) if j.data["pass1"].get("pieces") else None)
        texts_in_files = given is None and j.data["pass1"].get("pieces")
        if given is not None:
            tok_info = {"trained": False, "source": str(given.path)}
            _save_state(j, "finalize", stats=stats, sink=sink, tok_info=tok_info)
            j.commit(fsync=[*(f for w in writers.values() for f in w.files()), *(work / origin_name(s) for s in SPLITS), j.state_dir],
                     stage="finalize", state="finalize", writers={s: w.state() for s, w in writers.items()},
                     origin_records={s: o.records for s, o in origins.items()})
            for w in writers.values():
                w.close()
        elif texts_in_files:  # pass 1's chunk files and spool stay for the encode stage
            _save_state(j, "train", stats=stats, sink=sink)
            j.commit(fsync=[j.state_dir], stage="train", state="train", moved=list(sink.moved) if sink.moved else None)
        else:
            _save_state(j, "train", stats=stats, sink=sink)
            j.commit(fsync=[*(work / f"{s}.spool" for s in SPLITS), *(work / origin_name(s) for s in SPLITS), j.state_dir],
                     stage="train", state="train", origin_records={s: o.records for s, o in origins.items()})
        j.state_path("replay.log").unlink(missing_ok=True)  # `_replay_take`'s, not needed after the stage's commit
        if not texts_in_files:
            spool_path.unlink(missing_ok=True)
            removing.append(_remove_later(work / PIECES))
    if j.stage == "train":
        sink = _load_state(j, "train")["sink"]
        # the texts of the sample: from pass 1's chunk files, or held by the sink
        sample = _gather_sample(work, sink.sample.members(), _piece_names(work, j)) if isinstance(sink.sample, RefSample) else sink.sample_texts()
        n_chars = sum(map(len, sample))
        log(f"training a SentencePiece BPE tokenizer (vocab {cfg.vocab_size:,}) on {n_chars:,} characters")
        trained, tok_warnings = train_sentencepiece(sample, work, cfg.vocab_size, character_coverage=cfg.character_coverage,
                                                    num_threads=min(workers, len(os.sched_getaffinity(0))), seed=cfg.seed)
        del sample
        sink.sample = []  # not needed again: the later states stay small
        point("trained")
        log(f"trained the tokenizer ({time.time() - t0:.1f} s)")
        for w in tok_warnings:
            warn(w)
        if token_dtype(trained.vocab_size) != dtype:
            raise AssertionError("trained vocab does not fit the planned token dtype")
        tok_info = {"trained": True, "sample_characters": n_chars, "character_coverage": cfg.character_coverage,
                    "warnings": tok_warnings}
        _save_state(j, "encode", stats=stats, sink=sink, tok_info=tok_info)
        j.commit(fsync=[trained.path, j.state_dir, work], stage="encode", state="encode", tokenizer_file=trained.path.name)
    if j.stage == "encode":
        saved = _load_state(j, "encode")
        sink, tok_info = saved["sink"], saved["tok_info"]
        tok = Tokenizer.load(work / j.data["tokenizer_file"])
        if j.data["pass1"].get("pieces"):  # pass 1's chunk files hold the texts: encoded and placed per chunk
            writers, origins = _encode_pieces(work, cfg, tok, dtype, sink, min(workers, len(os.sched_getaffinity(0))), j, total_bytes,
                                            progress)
            _save_state(j, "finalize", stats=stats, sink=sink, tok_info=tok_info)
            j.commit(fsync=[*(f for w in writers.values() for f in w.files()), *(work / origin_name(s) for s in SPLITS), j.state_dir],
                     stage="finalize", state="finalize", writers={s: w.state() for s, w in writers.items()},
                     origin_records={s: o.records for s, o in origins.items()})
            removing.append(_remove_later(work / PIECES))
        else:
            writers = _encode(work, cfg, tok, dtype, sink, workers, progress, j, ray)
            _save_state(j, "finalize", stats=stats, sink=sink, tok_info=tok_info)
            j.commit(fsync=[*(f for w in writers.values() for f in w.files()), j.state_dir],
                     stage="finalize", state="finalize", writers={s: w.state() for s, w in writers.items()})
        for w in writers.values():
            w.close()
        for s in SPLITS:
            (work / f"{s}.spool").unlink(missing_ok=True)
    # "finalize": the index files, then the manifest (redone whole after a kill: it is short)
    for child in removing:
        if child is not None:
            child.wait()
    spool_path.unlink(missing_ok=True)  # (a kill just after the replay's commit left them)
    for name in (PIECES, PIECES + ".trash", REPLAY_PIECES, "dedup.tmp", "dedup.tmp.trash"):
        shutil.rmtree(work / name, ignore_errors=True)
    saved = _load_state(j, "finalize")
    sink, tok_info = saved["sink"], saved["tok_info"]
    if given is None:
        tok = Tokenizer.load(work / j.data["tokenizer_file"])
    for s in SPLITS:
        ShardWriter.finish_resumed(work / s, dtype, j.data["writers"][s], fsync=False)  # prepare fsyncs every file at once
        if "origin_records" in j.data:  # the replay's move left the moved record's bytes (`OriginWriter.peek_last`)
            cut_to(work / origin_name(s), j.data["origin_records"][s])
        point(f"finalized {s}")
    manifest = build_manifest(work, cfg, stats, sink, tok, tok_info, dtype)
    # the largest id per shard, counted while writing: `train` checks it against the vocabulary
    # instead of reading every shard (data/manifest.py, check_data_dir)
    manifest["max_token_id"] = {s: j.data["writers"][s]["max_token"] for s in SPLITS}
    return manifest


def _remove_later(path: Path) -> subprocess.Popen | None:
    """Remove a scratch directory (pass 1's chunk files, the dedup partitions) in a child process
    (`rm -rf`), while prepare goes on: freeing their pages costs the kernel ~0.4 ms per chunk,
    serial time this process no longer spends. Renamed first, so that a kill leaves a name
    `finalize` removes. None: nothing to remove, or removed here."""
    if not path.exists():
        return None
    trash = path.with_name(path.name + ".trash")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    try:
        return subprocess.Popen(["rm", "-rf", "--", str(trash)], stdin=subprocess.DEVNULL)
    except OSError:  # no `rm` here
        shutil.rmtree(trash, ignore_errors=True)
        return None


def _save_state(j: Journal, name: str, *, stats: sources.SourceStats, sink: Sink | None = None, tok_info: dict | None = None) -> None:
    """What the stage `name` starts from, beyond the journal: the source counts, the warnings
    so far, the sink (its writers left out). One file per stage, so that a kill between this
    write and the journal's commit leaves the previous stage's file as it was."""
    outs = origins = None
    if sink is not None:
        outs, origins, sink.outs, sink.origins = sink.outs, sink.origins, None, None
    try:
        data = pickle.dumps({"stats": stats, "warnings": list(j.warnings), "sink": sink, "tok_info": tok_info}, protocol=5)
    finally:
        if sink is not None:
            sink.outs, sink.origins = outs, origins
    atomic_write(j.state_path(f"state-{name}.pkl"), data)


def _load_state(j: Journal, name: str) -> dict:
    return pickle.loads(j.state_path(f"state-{name}.pkl").read_bytes())


def _pass1(paths: list[Path], names: list[str], cfg: PrepareConfig, tok_path: str | bool, dtype: np.dtype, dd: DiskDedup,
           spool_path: Path, workers: int, progress: bool, warn: Callable[[str], None], stats: sources.SourceStats, j: Journal,
           ray=None, quality: QualityStage | None = None) -> None:
    """Read, clean, hash; every result to the chunk spool and the dedup records on disk. After a
    kill, the input is read again from its start (main process only) and the work items up to
    the last commit are not sent to the workers; their per-file counts come from the journal.
    Where the workers read their blocks (`by_reference`), "reading" a skipped chunk is finding its
    blocks' ends: a few KB each; a compressed file is then one work item (`sources.FileUnit`,
    `workers.spill_unit`) whose chunks are the next chunks here, and commits fall between items."""
    done = j.data.get("pass1")
    # With local workers, the workers keep each chunk's documents (tokens with a given tokenizer,
    # else the cleaned texts) in a file of their own and send back only counts and dedup keys
    # (`workers.spill_chunk`). Fixed by the run that started pass 1: its spool holds one kind of
    # record or the other.
    pieces = ray is None and LOCAL_PIECES if done is None else bool(done.get("pieces"))
    # fixed by the run that started pass 1 too (a resume may have another --workers): the work items follow from it
    auto = sum(map(sources.is_compressed, paths)) >= workers
    units = pieces and (auto if UNITS is None else UNITS) if done is None else bool(done.get("units_on"))
    pdir = spool_path.parent / PIECES
    if done is None:  # a new pass 1 (or one killed before its first commit)
        shutil.rmtree(dd.root, ignore_errors=True)
        dd.root.mkdir()
        shutil.rmtree(pdir, ignore_errors=True)
        if pieces:
            pdir.mkdir()
        spool, skip, raw, unit_counts = ChunkSpool(spool_path), 0, {}, {}
        scores = ScoreWriter(spool_path.parent / SCORES) if quality is not None else None
    else:
        scores = ScoreWriter(spool_path.parent / SCORES, done["scores_bytes"]) if quality is not None else None
        dd.restore(done["dedup"])
        # work items: chunks, or compressed files of several chunks each (journals before those: chunks)
        spool, skip = ChunkSpool(spool_path, done["spool_bytes"], done["chunks"]), done.get("items", done["chunks"])
        raw = {int(f): c for f, *c in done["raw"]}
        unit_counts = {int(f): (c, w) for f, c, w in done.get("units", [])}
    items = skip  # work items whose results are in (the skipped ones of a resume too)
    in_order = _InOrder(warn)
    # a .jsonl file read in blocks: its loss warnings where the reader would have given them
    # (`iter_file_batches(hold=...)`), once the work item holding its last block is done
    last_raw: dict[int, bool] = {}  # per file read so far: whether its last batch was a block
    due_after: dict[int, int] = {}  # file held -> the work item after which its counts are complete
    st = {"made": 0, "ready": False}  # work items made (skipped ones too); the journal's counts are in

    placing: deque = deque()  # `place_records` tasks out

    def commit(**fields) -> None:
        while placing:  # every record of the chunks so far in its file
            placing.popleft().get()
        state = dd.state()
        size = spool.flush()
        scored = scores.flush() if scores is not None else None  # the sidecar's length: a resume cuts it back to this
        j.commit(fsync=[spool_path, *dd.touched(), dd.root, spool_path.parent, *([pdir] if pieces else []),
                        *([scores.path] if scores is not None else [])], **fields,
                 background=not fields,  # its fsyncs (every dedup partition file) while pass 1 goes on; the last one waits
                 pass1={"chunks": spool.chunks, "items": items, "spool_bytes": size, "dedup": state,
                        "raw": [[f, *c] for f, c in sorted(raw.items())], "pieces": pieces, "units_on": units,
                        "units": [[f, c, w] for f, (c, w) in sorted(unit_counts.items())], "scores_bytes": scored})

    def todo(work: Iterator) -> Iterator:
        for _ in range(skip):  # read again, not cleaned again (chunk boundaries are a function of the input)
            if next(work, None) is None:
                break
        for f, c in raw.items():
            sources.count_raw(stats, f, *c)
        st["ready"] = True
        settle()
        yield from work

    def made(work: Iterator) -> Iterator:
        for w in work:
            st["made"] += 1
            yield w

    def hold(f: int) -> None:
        in_order.hold(f)
        # its last block is in the next item (`pool.chunks` groups blocks until the next batch), or in one made already
        due_after[f] = st["made"] if last_raw.get(f) else st["made"] - 1
        settle()

    def settle(force: bool = False) -> None:
        for f in [f for f, k in due_after.items() if force or st["ready"] and k < items]:
            del due_after[f]
            msgs: list[str] = []
            sources.warn_counts(stats.per_file[f], cfg.text_field, msgs.append)
            in_order.fill(f, msgs)

    def placed(batches: Iterator) -> Iterator:
        """The batches, each compressed file's place kept in the order of the warnings (its own
        come from its worker); a finished one (resumed) gets its counts and warnings from the journal."""
        for b in batches:
            if isinstance(b, sources.RawLines):
                last_raw[b.file] = True
            elif getattr(b, "origin", None) is not None and len(b):
                last_raw[int(b.origin["file"][0])] = False
            if isinstance(b, sources.FileUnit):
                in_order.hold(b.file)
                if b.file in unit_counts:
                    _apply_counts(stats.per_file[b.file], unit_counts[b.file][0])
                    in_order.fill(b.file, unit_counts[b.file][1])
            yield b

    in_flight = 2 * workers + 1
    bar = progress_bar(progress, sum(p.stat().st_size for p in paths), "clean" if not tok_path else "clean+tokenize")
    lsh = dedup.LshSettings.of(cfg)
    if pieces and ray is not None:  # resumed with --ray after a local start: finish pass 1 locally
        ray, workers = None, min(workers, len(os.sched_getaffinity(0)))
    pool = start_pool(workers, init_worker, (cfg, tok_path or None, dtype.name, lsh, quality), warm_up=clean.warm_up, ray=ray)
    try:
        docs = sources.iter_batches(paths, doc_per_line=cfg.doc_per_line, text_field=cfg.text_field,
                                    stats=stats, warn=in_order, progress=bar.update if bar else None, raw=True, names=names,
                                    by_reference=pieces,  # local workers read their blocks (the same chunks on a resume)
                                    units=units, hold=hold)
        work = todo(made(chunks_with_origin(placed(docs))))
        if quality is not None and quality.source is not None and not pieces:  # Ray's nodes may not share the scores' disk
            work = attach(work, quality.source)
        fn = clean_chunk
        if pieces:
            parts = (dd.exact.parts, dd.near.parts if dd.near is not None else 0)  # the workers group records by file
            work = ((w, str(pdir / f"{i:08d}"), *parts) for i, w in enumerate(work, skip))  # pieces named by item
            fn = partial(spill_item, clean_chunk)
        for item in ordered(pool, fn, work, in_flight):
            if isinstance(item, UnitResult):  # a compressed file, read by a worker (`workers.spill_unit`): its counts and warnings
                _apply_counts(stats.per_file[item.file], item.counts)
                unit_counts[item.file] = (item.counts, item.warnings)
                in_order.fill(item.file, item.warnings)
            for result in item.chunks if isinstance(item, UnitResult) else [item]:
                rec, result.scores = result.scores, None
                if scores is not None:
                    scores.add(rec)  # in input order, as the chunk's documents go to the spool
                if result.raw is not None:
                    sources.count_raw(stats, *result.raw)
                    f, *c = result.raw
                    raw[f] = [a + b for a, b in zip_longest(raw.get(f, ()), c, fillvalue=0)]
                if pieces:  # a worker writes the chunk's dedup records where they go
                    base, *places = dd.reserve(result.n, result.exact_counts, result.band_counts)
                    result.exact_counts = result.band_counts = None
                    task = (str(pdir / f"{result.piece}.dd"), base, places if dd.near is not None else places[:1])
                    if pool is None:
                        place_records(task)
                    else:
                        placing.append(pool.apply_async(place_records, (task,)))
                        while len(placing) > in_flight or (placing and placing[0].ready()):
                            placing.popleft().get()
                else:
                    dd.add(result.keys, result.bands)
                    result.bands = None
                spool.add(result)
                point(f"pass1 chunk {spool.chunks}", lambda: (spool.flush(), dd.state(), scores and scores.flush()))
            items += 1
            settle()
            if j.due():  # between work items only: a resume skips whole items
                commit()
        while placing:  # before the pool goes
            placing.popleft().get()
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    settle(force=True)  # (every item is done)
    in_order.flush()
    sources.report_raw_files(stats, warn, cfg.text_field, jsonl=False)
    _save_state(j, "dedup", stats=stats)
    commit(stage="dedup", state="dedup")
    spool.close()
    if scores is not None:
        scores.close()


class _InOrder:
    """Pass 1's reading warnings, in reading order although a compressed file is read by a
    worker (`sources.FileUnit`): from where it is read (`hold`), the warnings wait until its
    worker's are in (`fill`), so they come as if this process had read it."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.queue: deque = deque()  # warnings, and the file index of each file held
        self.got: dict[int, list[str]] = {}

    def __call__(self, msg: str) -> None:
        if self.queue:
            self.queue.append(msg)
        else:
            self.warn(msg)

    def hold(self, file: int) -> None:
        self.queue.append(file)

    def fill(self, file: int, warnings: list[str]) -> None:
        self.got[file] = warnings
        self.flush()

    def flush(self) -> None:
        while self.queue and (isinstance(self.queue[0], str) or self.queue[0] in self.got):
            head = self.queue.popleft()
            for msg in [head] if isinstance(head, str) else self.got.pop(head):
                self.warn(msg)


def _apply_counts(counts: sources.FileCounts, fields: dict) -> None:
    """A compressed file's counts, as its worker found them (`workers.spill_unit`)."""
    for k, v in fields.items():
        setattr(counts, k, v)


def _replay(paths: list[Path], work: Path, cfg: PrepareConfig, tokens: bool, dtype: np.dtype, dd: DiskDedup, spool: ChunkSpool,
            log: Callable[[str], None], warn: Callable[[str], None], stats: sources.SourceStats, j: Journal,
            t0: float, pieces_workers: int | None = None) -> tuple[Sink, dict[str, ShardWriter], dict[str, OriginWriter]]:
    """Pass 1's results again, now with their fate known, to the sink; resumed after a kill from
    the last commit (`_replay_take`, `_replay_pieces`, `_replay_sample`). `pieces_workers`: pass 1
    left its chunks in files (`workers.spill_chunk`); with tokens, this many workers cut them into
    pieces of the outputs; with texts, the outputs wait for the encode stage (`_replay_sample`:
    no writers here, and the sink's `sample` is a `RefSample`, its `moved` the split move)."""
    # the replay commits its progress: resumed, its output files are cut back to the last commit
    at = j.data.get("replay")
    texts_in_files = pieces_workers is not None and not tokens
    writers = {s: ShardWriter(work / s, dtype, at and at["writers"][s]) for s in SPLITS} if tokens else {}
    spools = None if tokens or texts_in_files else {s: Spool(work / f"{s}.spool", at and at["writers"][s]) for s in SPLITS}
    origins = {} if texts_in_files else {s: OriginWriter(work / origin_name(s), at and at["origins"][s]) for s in SPLITS}
    sink = Sink(cfg, writers if tokens else spools, 0 if tokens else cfg.tokenizer_sample_chars, origins)
    if at is not None:
        log(f"resuming the replay after chunk {at['chunks']:,} of {spool.chunks:,}")
    if texts_in_files:
        notes, sink.moved, sink.sample = _replay_sample(work, cfg, dd, spool, sink, j)
    elif pieces_workers is not None:
        notes = _replay_pieces(work, cfg, dtype, dd, spool, sink, writers, origins, pieces_workers, j)
    else:
        notes = _replay_take(spool, sink, dd, writers if tokens else spools, origins, j)
    for w in notes:
        warn(w)
    for o in origins.values():
        o.close()
    if spools is not None:
        for s in spools.values():
            s.close()
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
    return sink, writers, origins


def _replay_take(spool: ChunkSpool, sink: Sink, dd: DiskDedup, outs: dict, origins: dict[str, OriginWriter], j: Journal) -> list[str]:
    """The replay through `Sink.take` (the chunk spool holds whole results: a trained tokenizer,
    or Ray), resumable per chunk. Every `commit_seconds()` the journal's "replay" names the chunks
    taken, where the next starts in the spool, the outputs' lengths and the sink's counters. What
    the sink holds beyond counters, the held-back document of each split and the tokenizer
    sample (up to `prepare.tokenizer_sample_chars`, 20 M characters), goes to an append-only log
    in the state dir instead, so that a commit writes only what changed since the last one: the
    sample's new members (texts), the numbers of those that left, and the held documents."""
    at = j.data.get("replay")
    path = j.state_path("replay.log")
    live: set[int] = set()  # the sample members (their `order`) the log holds as of the last commit
    if at is None:
        skip, docs, offset = 0, 0, 0
        open(path, "wb").close()
    else:
        skip, docs, offset = at["chunks"], at["docs"], at["spool_bytes"]
        _restore_counts(sink, at["sink"])
        sink.sample_chars, sink.order = at["sample_chars"], at["order"]
        truncate(path, at["log_bytes"])  # a torn record after the commit
        members: dict[int, tuple] = {}
        with open(path, "rb") as f:
            while f.tell() < at["log_bytes"]:
                kind, *rec = pickle.load(f)
                if kind == "add":
                    members[rec[1]] = tuple(rec)
                elif kind == "del":
                    members.pop(rec[0])
                else:
                    sink.held, sink.held_origin = rec
        sink.sample = list(members.values())
        heapq.heapify(sink.sample)  # (-u, order) are unique: the same pops as the uninterrupted heap
        live.update(members)
    f_log = open(path, "ab")

    def flush() -> None:  # every buffered byte to the files: before a commit (and a test's kill: the uncommitted tail)
        for o in outs.values():
            o.state()
        for o in origins.values():
            o.seek_end()

    def commit(chunks: int, end: int) -> None:
        now = {e[1]: e for e in sink.sample}
        for o in sorted(live - now.keys()):
            pickle.dump(("del", o), f_log, protocol=5)
        for o in sorted(now.keys() - live):
            pickle.dump(("add", *now[o]), f_log, protocol=5)
        live.clear()
        live.update(now)
        pickle.dump(("held", sink.held, sink.held_origin), f_log, protocol=5)
        f_log.flush()
        flush()  # the origin records too: buffered in this process, they were lost to a kill after the commit
        j.commit(fsync=[path, *(f for o in outs.values() for f in o.files()), *(o.path for o in origins.values())], background=True,
                 replay={"chunks": chunks, "docs": docs, "spool_bytes": end, "log_bytes": f_log.tell(),
                         "writers": {s: o.state() for s, o in outs.items()}, "origins": {s: o.records for s, o in origins.items()},
                         "sink": _counts(sink), "sample_chars": sink.sample_chars, "order": sink.order})

    try:
        for i, (result, end) in enumerate(spool.read_from(offset, skip), skip):
            n = len(result.chars)
            sink.take(result, *dd.dropped(docs, docs + n))
            docs += n
            point(f"replay {i + 1}", flush)
            if j.due():
                commit(i + 1, end)
    finally:
        f_log.close()
    return sink.finish()


def _replay_pieces(work: Path, cfg: PrepareConfig, dtype: np.dtype, dd: DiskDedup, spool: ChunkSpool, sink: Sink,
                   writers: dict[str, ShardWriter], origins: dict[str, OriginWriter], workers: int, j: Journal,
                   stage: str = "replay", tok_path: str | None = None, moved: tuple[str, str] | None | bool = False,
                   done_chunk: Callable[[int], object] | None = None) -> list[str]:
    """The replay when pass 1's chunks are in files: workers cut each chunk into its kept
    documents' shard and origin pieces (`workers.replay_chunk`); here, per chunk, only the counts
    and each piece's place in the outputs, in order, where a worker copies it (`workers.place_piece`,
    in the kernel). Same bytes as `Sink.take`:
    each split's documents in input order, and at the end the move of `Sink.finish`.

    Resumable: every `commit_seconds()` the journal's "replay" names the chunks done, the writers'
    lengths and the sink's counters (a few hundred bytes: the pieces path holds no documents and
    no tokenizer sample); `_replay` cut the outputs back to them, and the chunks after the commit
    are cut and placed again (pass 1's chunk files stay until the replay's last commit).

    `stage` "encode" (a trained tokenizer's run, its pieces hold texts): the same after training,
    with the workers encoding (`tok_path`); the sink's counts and the `moved` document were
    settled by `_replay_sample` already, so only the per-file tallies are added here."""
    src, dst = work / PIECES, work / REPLAY_PIECES
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    counting = stage == "replay"
    at = j.data.get(stage)
    skip = at["chunks"] if at is not None else 0
    last_chars: dict[str, int] = {}
    if at is not None:
        _restore_counts(sink, at["sink"])
        last_chars.update(at["last_chars"])
    counted: deque = deque()  # per chunk sent out: what `Sink.count` adds when its result is in

    def items() -> Iterator[tuple]:
        done = 0
        for i, meta in enumerate(spool.read(remove=False)):
            n = meta.n
            exact, near = dd.dropped(done, done + n)
            done += n
            if i < skip:  # committed: only its documents' place in the dedup decisions is needed
                continue
            if counting:
                counted.append((meta, exact, near))
            piece = meta.piece or f"{i:08d}"  # (named by work item since compressed files are items of several chunks)
            yield (str(src / piece), str(dst / f"{i:08d}"), exact | near, cfg.valid_fraction, meta.has_origin, dtype,
                   meta.text_piece)

    placing: deque = deque()  # `place_piece` tasks out: each chunk's pieces copied into the outputs

    def drain() -> None:
        while placing:
            placing.popleft().get()

    def commit(chunks: int) -> None:
        drain()  # every piece up to `chunks` in its place before the files are fsynced
        j.commit(fsync=[*(f for w in writers.values() for f in w.files()), *(o.path for o in origins.values())], background=True,
                 **{stage: {"chunks": chunks, "writers": {s: w.state() for s, w in writers.items()},
                         "origins": {s: o.records for s, o in origins.items()}, "last_chars": dict(last_chars),
                         "sink": _counts(sink)}})

    in_flight = 2 * workers + 1
    for o in origins.values():
        o.seek_end()  # the header on disk before the workers write after it
    todo = spool.chunks - skip
    pool = start_pool(workers if todo > 1 else 1, init_worker, (cfg, tok_path, dtype.name))  # one chunk: no pool to start
    try:
        for i, res in enumerate(ordered(pool, replay_chunk, items(), in_flight), skip):
            if counting:
                sink.count(*counted.popleft())  # in chunk order, as `Sink.take` counts, and only what is placed
            if res["per_file"] is not None:
                sink.per_file.merge(res["per_file"])
            copies = []
            for split, p in res["splits"].items():
                if counting:
                    sink.docs[split] += p["docs"]
                    sink.chars[split] += p["chars"]
                n_tok, n_len, n_org = p["sizes"]
                at_bin, at_len = writers[split].reserve(n_tok, n_len, p["max_token"])
                w_bin, w_len = writers[split].files()
                copies += [(str(w_bin), at_bin, p["at"], n_tok), (str(w_len), at_len, p["at"] + n_tok, n_len),
                           (str(origins[split].path), origins[split].reserve(n_org), p["at"] + n_tok + n_len, n_org)]
                last_chars[split] = p["last_chars"]
            task = (str(dst / f"{i:08d}"), copies)
            if pool is None:
                place_piece(task)
            else:
                placing.append(pool.apply_async(place_piece, (task,)))
                while len(placing) > in_flight or (placing and placing[0].ready()):
                    placing.popleft().get()
            if done_chunk is not None:
                done_chunk(i)
            point(f"{stage} {i + 1}", drain)
            if j.due():
                commit(i + 1)
        drain()
    finally:
        if pool is not None:
            pool.terminate()
    for w in (*writers.values(), *origins.values()):
        w.seek_end()
    if counting:
        moved = sink.planned_move()
    if moved:
        # `peek_last` leaves the source's bytes until `finalize` cuts them to the counts of the
        # commit after this, so a kill before that commit resumes from the last one
        a, b = moved
        last = writers[a].peek_last()
        writers[b].add_flat(last, np.array([last.size], dtype=np.int32))
        if origins[a].records:
            origins[b].add(origins[a].peek_last())
        point(f"{stage} moved", lambda: (writers[b].state(), origins[b].seek_end()))  # flushed: the tail a kill leaves
    shutil.rmtree(dst, ignore_errors=True)
    return sink.count_move(moved, last_chars[moved[0]] if moved else 0) if counting else []


def _replay_sample(work: Path, cfg: PrepareConfig, dd: DiskDedup, spool: ChunkSpool, sink: Sink, j: Journal
                   ) -> tuple[list[str], tuple[str, str] | None, RefSample]:
    """The replay of a trained tokenizer's run when pass 1's chunks are in files (their texts
    stay there until the encode stage): per chunk, the dedup decisions and the split of its
    documents from their per-document arrays (`workers.read_small`: characters and split numbers,
    24 bytes a document), the sink's counts, and the tokenizer sample as references
    (`sink.RefSample`: the same members as `Sink._sample`). Returns the notes of the split move
    (`Sink.finish`'s), the move (done on the shards in the encode stage), and the sample.

    Resumable: every `commit_seconds()` the journal's "replay" names the chunks done, the sink's
    counters and the sample's state, saved to a file of the state dir named by the commit."""
    src = work / PIECES
    at = j.data.get("replay")
    skip = at["chunks"] if at is not None else 0
    last_chars: dict[str, int] = {}
    sample = RefSample(cfg.tokenizer_sample_chars)
    if at is not None:
        _restore_counts(sink, at["sink"])
        last_chars.update(at["last_chars"])
        sample.restore(np.load(j.state_path(at["sample_file"])), at["sample_chars"], at["order"])

    def commit(chunks: int) -> None:
        name = f"sample-{chunks:08d}.npy"
        buf = io.BytesIO()
        np.save(buf, sample.state())
        atomic_write(j.state_path(name), buf.getvalue())  # a new file per commit: the journal names the one it holds
        old = (j.data.get("replay") or {}).get("sample_file")
        j.commit(replay={"chunks": chunks, "sink": _counts(sink), "last_chars": dict(last_chars), "sample_file": name,
                         "sample_chars": sample.chars, "order": sample.order})
        if old and old != name:
            j.state_path(old).unlink(missing_ok=True)

    # here, not in workers: reading 24 bytes a document from the page cache costs this process
    # less than the same arrays pickled through a pool's pipes (measured: docs/benchmarks/prepare.md)
    done = 0
    for i, meta in enumerate(spool.read(remove=False)):
        n = meta.n
        exact, near = dd.dropped(done, done + n)
        done += n
        if i < skip:
            continue
        a = read_small(str(src / meta.piece or f"{i:08d}"), 2)  # chars and u
        sink.count(meta, exact, near)
        kept = np.flatnonzero(~(exact | near)).astype(np.int64)
        in_valid = a["u"][kept, 0] < cfg.valid_fraction
        for split, sel in (("train", kept[~in_valid]), ("valid", kept[in_valid])):
            if sel.size:
                sink.docs[split] += int(sel.size)
                sink.chars[split] += int(a["chars"][sel].sum())
                last_chars[split] = int(a["chars"][sel[-1]])
                if split == "train" and sample.budget:
                    sample.feed(a["u"][sel, 1], a["chars"][sel], i, sel)
        point(f"replay {i + 1}")
        if j.due():
            commit(i + 1)
    moved = sink.planned_move()
    return sink.count_move(moved, last_chars[moved[0]] if moved else 0), moved, sample


def _piece_names(work: Path, j: Journal) -> list[str]:
    """The file of each of pass 1's chunks in `PIECES`, in chunk order (named by work item: a
    compressed file's chunks are `ITEM.NNNN`), from the chunk spool."""
    spool = ChunkSpool(work / "pass1.tmp", j.data["pass1"]["spool_bytes"], j.data["pass1"]["chunks"])
    spool.close()
    return [meta.piece or f"{i:08d}" for i, meta in enumerate(spool.read(remove=False))]


def _gather_sample(work: Path, members: np.ndarray, names: list[str]) -> list[str]:
    """The texts of the sample's members ((chunk, index) in input order) from pass 1's chunk
    files (`names`: `_piece_names`), as `Sink.sample_texts` gives them: long documents cut into
    ≤ 4,096-character pieces."""
    texts: list[str] = []
    if not members.size:
        return texts
    bounds = np.flatnonzero(np.diff(members[:, 0])) + 1  # runs of one chunk (input order: ascending)
    for run in np.split(members, bounds):
        texts += read_texts(str(work / PIECES / names[int(run[0, 0])]), run[:, 1])
    return [p for t in texts for p in sources.cut_text(t, 4096)]


def _encode_pieces(work: Path, cfg: PrepareConfig, tok: Tokenizer, dtype: np.dtype, sink: Sink, workers: int, j: Journal,
                   total_bytes: int, progress: bool) -> tuple[dict[str, ShardWriter], dict[str, OriginWriter]]:
    """The encode stage when pass 1's chunk files hold the texts (a trained tokenizer, local
    workers): `_replay_pieces` once more, its workers encoding each chunk's kept documents with
    the trained tokenizer, and the split move `_replay_sample` planned. Resumed from its last
    commit (the journal's "encode"); pass 1's chunk files and spool stay until the stage's end."""
    at = j.data.get("encode")
    dd = DiskDedup(work / "dedup.tmp", total_bytes, dedup.LshSettings.of(cfg))
    dd.load_decisions(j.state_path("decisions.npy"))
    shutil.rmtree(dd.root, ignore_errors=True)
    spool = ChunkSpool(work / "pass1.tmp", j.data["pass1"]["spool_bytes"], j.data["pass1"]["chunks"])
    spool.close()
    writers = {s: ShardWriter(work / s, dtype, at and at["writers"][s]) for s in SPLITS}
    origins = {s: OriginWriter(work / origin_name(s), at and at["origins"][s]) for s in SPLITS}
    moved = tuple(j.data["moved"]) if j.data.get("moved") else None
    files = [work / PIECES / name for name in _piece_names(work, j)]
    sizes = [f.stat().st_size if f.exists() else 0 for f in files]
    bar = progress_bar(progress, sum(sizes), "tokenize")
    if bar is not None and at is not None:
        bar.update(sum(sizes[: at["chunks"]]))
    try:
        _replay_pieces(work, cfg, dtype, dd, spool, sink, writers, origins, workers, j, stage="encode", tok_path=str(tok.path),
                       moved=moved, done_chunk=(lambda i: bar.update(sizes[i])) if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    for o in origins.values():
        o.close()
    return writers, origins


def _counts(sink: Sink) -> dict:
    """The counters of a sink on the pieces path, for the journal (JSON; Counters keep their order)."""
    return {"docs_in": sink.docs_in, "chars_in": sink.chars_in, "changed": list(sink.changed.items()),
            "dropped": list(sink.dropped.items()), "docs": dict(sink.docs), "chars": dict(sink.chars),
            "per_file": {k: v.tolist() for k, v in sink.per_file.sums.items()}}


def _restore_counts(sink: Sink, c: dict) -> None:
    sink.docs_in, sink.chars_in = c["docs_in"], c["chars_in"]
    sink.changed.clear()
    sink.changed.update(dict(c["changed"]))
    sink.dropped.clear()
    sink.dropped.update(dict(c["dropped"]))
    sink.docs.update(c["docs"])
    sink.chars.update(c["chars"])
    sink.per_file.sums = {k: np.asarray(v, dtype=np.int64) for k, v in c["per_file"].items()}


def _encode(work: Path, cfg: PrepareConfig, tok: Tokenizer, dtype: np.dtype, sink: Sink, workers: int, progress: bool,
            j: Journal, ray=None) -> dict[str, ShardWriter]:
    """Pass 2: the spools tokenized into the shard writers, from the last commit on."""
    at = j.data.get("pass2") or {"split": 0, "docs": 0, "writers": None, "per_file": None}
    writers = {s: ShardWriter(work / s, dtype, at["writers"][s] if at["writers"] else None) for s in SPLITS}
    if at["per_file"] is not None:
        sink.per_file.sums = {k: np.asarray(v, dtype=np.int64) for k, v in at["per_file"].items()}

    def commit(split: int, docs: int) -> None:
        states = {s: w.state() for s, w in writers.items()}
        j.commit(fsync=[f for w in writers.values() for f in w.files()], background=True,
                 pass2={"split": split, "docs": docs, "writers": states,
                        "per_file": {k: v.tolist() for k, v in sink.per_file.sums.items()}})

    in_flight = 2 * workers + 1
    spool_paths = {s: work / f"{s}.spool" for s in SPLITS}
    bar = progress_bar(progress, sum(p.stat().st_size for p in spool_paths.values()), "tokenize")
    pool = start_pool(workers, init_worker, (cfg, str(tok.path), dtype.name), warm_up=clean.warm_up, ray=ray)
    try:
        for i, split in enumerate(SPLITS):
            if i < at["split"]:
                continue
            done = at["docs"] if i == at["split"] else 0
            texts = batched(read_spool(spool_paths[split], bar.update if bar else None, skip=done))
            files = read_records(work / origin_name(split))["file"]  # the spooled documents' input files, in order
            for n, (flat, lengths, fallback) in enumerate(ordered(pool, tokenize_chunk, chunks(texts), in_flight), 1):
                writers[split].add_flat(flat, lengths)
                sink.per_file.add(files[done: done + lengths.size], documents=np.zeros(lengths.size),
                                  tokens=lengths.astype(np.int64) - 1, byte_fallback=fallback)
                done += lengths.size
                point(f"encode {split} {n}", writers[split].state)
                if j.due():
                    commit(i, done)
            commit(i + 1, 0)
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    return writers
