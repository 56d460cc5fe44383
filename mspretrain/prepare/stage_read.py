"""Pass 1 of prepare (`ReadClean`): the inputs read in order, cut into chunks, and each chunk
cleaned, scored, hashed [and tokenized] by a worker; the results kept on disk until the dedup
decisions are known (`diskdedup`)."""
from __future__ import annotations

import os
from collections import deque
from functools import partial
from itertools import zip_longest
from typing import Callable, Iterator

from mspretrain.prepare import clean, dedup, sources
from mspretrain.prepare.diskdedup import place_records
from mspretrain.prepare.pool import chunks_with_origin, ordered, start_pool
from mspretrain.prepare.progress import progress_bar
from mspretrain.prepare.rescore import attach
from mspretrain.prepare.results import ChunkResult, ChunkSpool, UnitResult
from mspretrain.prepare.resume import point
from mspretrain.prepare.scoring import SCORES, ScoreWriter
from mspretrain.prepare.stage import Run, Stage
from mspretrain.prepare.tasks import PlaceRecords, SpillTask
from mspretrain.prepare.workdir import DEDUP, PIECES, SPOOL
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
        Pass1(r).run(then)

    def resume(self, r: Run) -> None:
        """After the scan: pass 1 starts from nothing a stage saved (its counts are in its own
        journal entry, and `run` says where it resumes)."""


class Pass1:
    """One run of pass 1: read, clean, hash; every result to the chunk spool and the dedup
    records on disk. After a kill, the input is read again from its start (main process only)
    and the work items up to the last commit are not sent to the workers; their per-file counts
    come from the journal. Where the workers read their blocks (`by_reference`), "reading" a
    skipped chunk is finding its blocks' ends: a few KB each; a compressed file is then one work
    item (`sources.FileUnit`, `workers.spill_unit`) whose chunks are the next chunks here, and
    commits fall between items.

    With local workers (`pieces`), the workers keep each chunk's documents (tokens with a given
    tokenizer, else the cleaned texts) in a file of their own (`workdir.PIECES`) and send back
    only counts and dedup keys (`workers.spill_chunk`); they write the chunk's dedup records
    where this process reserved their place (`diskdedup.place_records`). Fixed by the run that
    started pass 1: its spool holds one kind of record or the other."""

    def __init__(self, r: Run) -> None:
        self.r = r
        self.dd = r.dedup()
        self.spool_path = r.files.path(SPOOL)
        done = r.journal.data.get("pass1")
        self.pieces = r.pieces
        # fixed by the run that started pass 1 too (a resume may have another --workers): the work items follow from it
        auto = sum(map(sources.is_compressed, r.paths)) >= r.workers
        self.units = self.pieces and (auto if r.units is None else r.units) if done is None else bool(done.get("units_on"))
        self.pdir = r.files.path(PIECES)
        scores = r.files.path(SCORES)
        if done is None:  # a new pass 1 (or one killed before its first commit)
            r.files.fresh(DEDUP)
            r.files.fresh(PIECES, make=self.pieces)
            self.spool, self.skip, self.raw, self.unit_counts = ChunkSpool(self.spool_path), 0, {}, {}
            self.scores = ScoreWriter(scores) if r.quality is not None else None
        else:
            self.scores = ScoreWriter(scores, done["scores_bytes"]) if r.quality is not None else None
            self.dd.restore(done["dedup"])
            # work items: chunks, or compressed files of several chunks each (journals before those: chunks)
            self.spool, self.skip = ChunkSpool(self.spool_path, done["spool_bytes"], done["chunks"]), done.get("items", done["chunks"])
            self.raw = {int(f): c for f, *c in done["raw"]}
            self.unit_counts = {int(f): (c, w) for f, c, w in done.get("units", [])}
        self.items = self.skip  # work items whose results are in (the skipped ones of a resume too)
        self.in_order = _InOrder(r.warn)
        # a .jsonl file read in blocks: its loss warnings where the reader would have given them
        # (`iter_file_batches(hold=...)`), once the work item holding its last block is done
        self.last_raw: dict[int, bool] = {}  # per file read so far: whether its last batch was a block
        self.due_after: dict[int, int] = {}  # file held -> the work item after which its counts are complete
        self.made_items = 0  # work items made (skipped ones too)
        self.ready = False  # the journal's counts are in
        self.placing: deque = deque()  # `place_records` tasks out
        self.pool = None
        self.in_flight = 2 * r.workers + 1

    def commit(self, **fields) -> None:
        while self.placing:  # every record of the chunks so far in its file
            self.placing.popleft().get()
        dd, spool, scores = self.dd, self.spool, self.scores
        state = dd.state()
        size = spool.flush()
        scored = scores.flush() if scores is not None else None  # the sidecar's length: a resume cuts it back to this
        self.r.journal.commit(
            fsync=[self.spool_path, *dd.touched(), dd.root, self.spool_path.parent, *([self.pdir] if self.pieces else []),
                   *([scores.path] if scores is not None else [])], **fields,
            background=not fields,  # its fsyncs (every dedup partition file) while pass 1 goes on; the last one waits
            pass1={"chunks": spool.chunks, "items": self.items, "spool_bytes": size, "dedup": state,
                   "raw": [[f, *c] for f, c in sorted(self.raw.items())], "pieces": self.pieces, "units_on": self.units,
                   "units": [[f, c, w] for f, (c, w) in sorted(self.unit_counts.items())], "scores_bytes": scored})

    def todo(self, work: Iterator) -> Iterator:
        """The work items after the last commit (read again, not cleaned again: chunk boundaries
        are a function of the input); the committed ones' raw counts from the journal."""
        for _ in range(self.skip):
            if next(work, None) is None:
                break
        for f, c in self.raw.items():
            sources.count_raw(self.r.stats, f, *c)
        self.ready = True
        self.settle()
        yield from work

    def made(self, work: Iterator) -> Iterator:
        for w in work:
            self.made_items += 1
            yield w

    def hold(self, f: int) -> None:
        """A .jsonl file read in blocks ended: its warnings wait until its counts are complete."""
        self.in_order.hold(f)
        # its last block is in the next item (`pool.chunks` groups blocks until the next batch), or in one made already
        self.due_after[f] = self.made_items if self.last_raw.get(f) else self.made_items - 1
        self.settle()

    def settle(self, force: bool = False) -> None:
        for f in [f for f, k in self.due_after.items() if force or self.ready and k < self.items]:
            del self.due_after[f]
            msgs: list[str] = []
            sources.warn_counts(self.r.stats.per_file[f], self.r.cfg.text_field, msgs.append)
            self.in_order.fill(f, msgs)

    def placed(self, batches: Iterator) -> Iterator:
        """The batches, each compressed file's place kept in the order of the warnings (its own
        come from its worker); a finished one (resumed) gets its counts and warnings from the journal."""
        for b in batches:
            if isinstance(b, sources.RawLines):
                self.last_raw[b.file] = True
            elif getattr(b, "origin", None) is not None and len(b):
                self.last_raw[int(b.origin["file"][0])] = False
            if isinstance(b, sources.FileUnit):
                self.in_order.hold(b.file)
                if b.file in self.unit_counts:
                    _apply_counts(self.r.stats.per_file[b.file], self.unit_counts[b.file][0])
                    self.in_order.fill(b.file, self.unit_counts[b.file][1])
            yield b

    def tasks(self, work: Iterator) -> Iterator[SpillTask]:
        """The work items as the workers' tasks on the pieces path: files named by work item."""
        dd = self.dd
        parts = (dd.exact.parts, dd.near.parts if dd.near is not None else 0)  # the workers group records by file
        for i, w in enumerate(work, self.skip):
            yield SpillTask(w, str(self.pdir / f"{i:08d}"), *parts)

    def take(self, item: ChunkResult | UnitResult) -> None:
        """One work item's results, in input order: to the counts, the sidecar, the dedup
        records and the chunk spool."""
        stats = self.r.stats
        if isinstance(item, UnitResult):  # a compressed file, read by a worker (`workers.spill_unit`): its counts and warnings
            _apply_counts(stats.per_file[item.file], item.counts)
            self.unit_counts[item.file] = (item.counts, item.warnings)
            self.in_order.fill(item.file, item.warnings)
        for result in item.chunks if isinstance(item, UnitResult) else [item]:
            rec, result.scores = result.scores, None
            if self.scores is not None:
                self.scores.add(rec)  # in input order, as the chunk's documents go to the spool
            if result.raw is not None:
                sources.count_raw(stats, *result.raw)
                f, *c = result.raw
                self.raw[f] = [a + b for a, b in zip_longest(self.raw.get(f, ()), c, fillvalue=0)]
            if self.pieces:
                self.place(result)
            else:
                self.dd.add(result.keys, result.bands)
                result.bands = None
            self.spool.add(result)
            point(f"pass1 chunk {self.spool.chunks}", lambda: (self.spool.flush(), self.dd.state(), self.scores and self.scores.flush()))
        self.items += 1
        self.settle()

    def place(self, result: ChunkResult) -> None:
        """The pieces path: a worker writes the chunk's dedup records where they go."""
        dd = self.dd
        base, *places = dd.reserve(result.n, result.exact_counts, result.band_counts)
        result.exact_counts = result.band_counts = None
        task = PlaceRecords(str(self.pdir / f"{result.piece}.dd"), base, places if dd.near is not None else places[:1])
        if self.pool is None:
            place_records(task)
        else:
            self.placing.append(self.pool.apply_async(place_records, (task,)))
            while len(self.placing) > self.in_flight or (self.placing and self.placing[0].ready()):
                self.placing.popleft().get()

    def run(self, then: str | None) -> None:
        r, cfg = self.r, self.r.cfg
        tok_path = r.given is not None and str(r.tok.path)
        bar = progress_bar(r.progress, sum(p.stat().st_size for p in r.paths), "clean" if not tok_path else "clean+tokenize")
        lsh = dedup.LshSettings.of(cfg)
        ray, workers = r.ray, r.workers
        if self.pieces and ray is not None:  # resumed with --ray after a local start: finish pass 1 locally
            ray, workers = None, min(workers, len(os.sched_getaffinity(0)))
        self.pool = start_pool(workers, init_worker, (cfg, tok_path or None, r.dtype.name, lsh, r.quality), warm_up=clean.warm_up, ray=ray)
        try:
            docs = sources.iter_batches(r.paths, doc_per_line=cfg.doc_per_line, text_field=cfg.text_field,
                                        stats=r.stats, warn=self.in_order, progress=bar.update if bar else None, raw=True,
                                        names=r.names,
                                        by_reference=self.pieces,  # local workers read their blocks (the same chunks on a resume)
                                        units=self.units, hold=self.hold)
            work = self.todo(self.made(chunks_with_origin(self.placed(docs))))
            if r.quality is not None and r.quality.source is not None and not self.pieces:  # Ray's nodes may not share the scores' disk
                work = attach(work, r.quality.source)
            fn = clean_chunk
            if self.pieces:
                work = self.tasks(work)
                fn = partial(spill_item, clean_chunk)
            for item in ordered(self.pool, fn, work, self.in_flight):
                self.take(item)
                if r.journal.due():  # between work items only: a resume skips whole items
                    self.commit()
            while self.placing:  # before the pool goes
                self.placing.popleft().get()
        finally:
            if self.pool is not None:
                self.pool.terminate()
            if bar is not None:
                bar.close()
        self.settle(force=True)  # (every item is done)
        self.in_order.flush()
        sources.report_raw_files(r.stats, r.warn, cfg.text_field, jsonl=False)
        r.save_state(then)
        self.commit(stage=then, state=then)
        self.spool.close()
        if self.scores is not None:
            self.scores.close()


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
