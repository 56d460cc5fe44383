"""Pass 1 of prepare (`ReadClean`): the inputs read in order, cut into chunks, and each chunk
cleaned, scored, hashed [and tokenized] by a worker; the results kept on disk until the dedup
decisions are known (`diskdedup`)."""
from __future__ import annotations

import os
import shutil
from collections import deque
from functools import partial
from itertools import zip_longest
from typing import Callable, Iterator

from mspretrain.prepare import clean, dedup, sources
from mspretrain.prepare.diskdedup import place_records
from mspretrain.prepare.pool import chunks_with_origin, ordered, start_pool
from mspretrain.prepare.progress import progress_bar
from mspretrain.prepare.rescore import attach
from mspretrain.prepare.results import ChunkSpool, UnitResult
from mspretrain.prepare.resume import point
from mspretrain.prepare.scoring import SCORES, ScoreWriter
from mspretrain.prepare.stage import PIECES, Run, Stage
from mspretrain.prepare.workers import clean_chunk, init_worker, spill_item


class ReadClean(Stage):
    """Pass 1: read, clean [+ the quality filters] + hash [+ MinHash] [+ tokenize with a given
    tokenizer], in worker processes per chunk (`workers.clean_chunk`); every result to the chunk
    spool and the dedup records on disk. Reading, cleaning, scoring and hashing are one stage: a
    worker does them on a chunk in one go, and the journal commits whole work items."""

    name = "pass1"

    def run(self, r: Run, then: str | None) -> None:
        j = r.journal
        r.log(f"reading {len(r.paths)} file{'s' * (len(r.paths) != 1)} ({r.total_bytes / 1e6:,.1f} MB) with {r.workers} "
              f"worker{'s' * (r.workers != 1)}" + (f", resuming after chunk {j.data['pass1']['chunks']:,}" if "pass1" in j.data else ""))
        _pass1(r, then)

    def resume(self, r: Run) -> None:
        """After the scan: pass 1 starts from nothing a stage saved (its counts are in its own
        journal entry, and `run` says where it resumes)."""


def _pass1(r: Run, then: str | None) -> None:
    """Read, clean, hash; every result to the chunk spool and the dedup records on disk. After a
    kill, the input is read again from its start (main process only) and the work items up to
    the last commit are not sent to the workers; their per-file counts come from the journal.
    Where the workers read their blocks (`by_reference`), "reading" a skipped chunk is finding its
    blocks' ends: a few KB each; a compressed file is then one work item (`sources.FileUnit`,
    `workers.spill_unit`) whose chunks are the next chunks here, and commits fall between items."""
    paths, names, cfg, dd, spool_path, workers, progress = r.paths, r.names, r.cfg, r.dedup(), r.spool_path, r.workers, r.progress
    warn, stats, j, ray, quality, dtype = r.warn, r.stats, r.journal, r.ray, r.quality, r.dtype
    tok_path = r.given is not None and str(r.tok.path)
    done = j.data.get("pass1")
    # With local workers, the workers keep each chunk's documents (tokens with a given tokenizer,
    # else the cleaned texts) in a file of their own and send back only counts and dedup keys
    # (`workers.spill_chunk`). Fixed by the run that started pass 1: its spool holds one kind of
    # record or the other.
    pieces = r.pieces
    # fixed by the run that started pass 1 too (a resume may have another --workers): the work items follow from it
    auto = sum(map(sources.is_compressed, paths)) >= workers
    units = pieces and (auto if r.units is None else r.units) if done is None else bool(done.get("units_on"))
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
    r.save_state(then)
    commit(stage=then, state=then)
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
