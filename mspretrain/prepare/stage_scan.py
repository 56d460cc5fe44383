"""The first stage of prepare's pipeline when a quality filter keeps a fraction and no
`--scores-from` is given (`ScoreScan`): every document read, cleaned and scored before pass 1,
because a threshold that keeps the top fraction is known only when the last document is scored
(`rescore.py`). Its result is the quality stage with the fractions turned into thresholds,
deciding from the scan's scores (`Run.quality`)."""
from __future__ import annotations

from typing import Iterator

from mspretrain.prepare import clean, sources
from mspretrain.prepare.pool import chunks_with_origin, ordered, start_pool
from mspretrain.prepare.progress import progress_bar
from mspretrain.prepare.rescore import resolve
from mspretrain.prepare.resume import point
from mspretrain.prepare.scoring import ScoreSource, ScoreWriter
from mspretrain.prepare.stage import Run, Stage
from mspretrain.prepare.workers import init_worker, score_chunk

SCAN = "scan.scores"  # in the state dir: the scan's sidecar


class ScoreScan(Stage):
    """Read, clean and score every document into the state dir's `SCAN` (pass 1's chunks, its
    reading rules; its counts and warnings are pass 1's to give, so none here). Resumed after a
    kill from the journal's "scan": the work items done and the file's length at the last commit."""

    name = "scan"

    def run(self, r: Run, then: str | None) -> None:
        j, cfg, workers, ray = r.journal, r.cfg, r.workers, r.ray
        path = j.state_path(SCAN)
        at = j.data.get("scan")
        # the work items follow from where the blocks are read: fixed by the run that started the scan
        by_reference = (ray is None) if at is None else at["by_reference"]
        if by_reference and ray is not None:  # resumed with --ray after a local start: finish locally
            ray, workers = None, r.local_workers()
        skip = 0 if at is None else at["items"]
        writer = ScoreWriter(path, None if at is None else at["bytes"])
        r.log("scoring every document first (a quality filter keeps a fraction)" + (f", resuming after item {skip:,}" if skip else ""))
        bar = progress_bar(r.progress, r.total_bytes, "score")
        docs = sources.iter_batches(r.paths, doc_per_line=cfg.doc_per_line, text_field=cfg.text_field, stats=sources.SourceStats(),
                                    warn=lambda m: None, progress=bar.update if bar else None, raw=True, names=r.names,
                                    by_reference=by_reference)

        def todo(work: Iterator) -> Iterator:
            for _ in range(skip):
                if next(work, None) is None:
                    break
            yield from work

        def commit(items: int, done: bool = False) -> None:  # the last one: the scan done and pass 1 next, in one step
            j.commit(fsync=[path], background=not done, **({"stage": then} if done else {}),
                     scan={"items": items, "bytes": writer.flush(), "by_reference": by_reference, "done": done})

        pool = start_pool(workers, init_worker, (cfg, None, None, None, r.quality.scoring_only()), warm_up=clean.warm_up, ray=ray)
        items = skip
        try:
            for rec in ordered(pool, score_chunk, todo(chunks_with_origin(docs)), 2 * workers + 1):
                writer.add(rec)
                items += 1
                point(f"scan {items}", writer.flush)
                if j.due():
                    commit(items)
        finally:
            if pool is not None:
                pool.terminate()
            if bar is not None:
                bar.close()
        commit(items, done=True)
        writer.close()
        self.resumed_past(r)  # as on a resume after the scan

    def resumed_past(self, r: Run) -> None:
        """Pass 1 decides from the scan's scores, with the thresholds the fractions resolve to
        (again on a resume after the scan: the manifest names them)."""
        r.quality = resolve(r.quality, ScoreSource(str(r.journal.state_path(SCAN))))
