"""The dedup stage of prepare (`Dedup`): the exact and near-duplicate decisions over the whole
corpus, from the records pass 1 left in the dedup partitions (`diskdedup.DiskDedup.resolve`)."""
from __future__ import annotations

import time

from mspretrain.prepare.pool import start_pool
from mspretrain.prepare.resume import point
from mspretrain.prepare.stage import Run, Stage
from mspretrain.prepare.workdir import DEDUP
from mspretrain.prepare.workers import init_worker


class Dedup(Stage):
    """Sort every partition of exact keys and LSH band keys, first occurrence in input order
    kept: exact and near dedup are one stage, as their partitions go through one sort each and
    the near decisions skip the exact duplicates. Resumed after a kill: the partitions without a
    saved result are sorted again."""

    name = "dedup"

    def run(self, r: Run, then: str | None) -> None:
        j, dd = r.journal, r.dedup()
        t1 = time.time()
        dd.restore(j.data["pass1"]["dedup"])  # files cut back to the commit (nothing was written after it)
        # with Ray each partition is a task; the records stay until the decisions are on disk, and
        # each partition's result is saved as it comes (`decided`): a kill here sorts again only
        # the partitions that had none
        decided, files = dd.decided_count()
        if decided:
            r.log(f"dedup: resuming, {decided:,} of {files:,} partitions decided")

        def done(name: str) -> None:
            point(f"dedup part {name}")  # after its result file was renamed into place: that is its commit

        if r.ray is not None:
            dd.resolve(r.ray.map, remove=False, decided=done)
        else:  # local workers read and sort the partitions (independent, split by key), if there are a few
            pool = start_pool(r.workers if files - decided > 2 else 1, init_worker, (r.cfg, None, r.dtype.name))
            try:
                dd.resolve(pool.imap if pool is not None else map, remove=False, by_path=True, decided=done)
            finally:
                if pool is not None:
                    pool.terminate()
        point("dedup resolved")
        path = j.state_path("decisions.npy")
        dd.save_decisions(path)
        j.commit(fsync=[path, path.parent], stage=then)
        r.files.remove_later(DEDUP)
        r.log(f"dedup: {dd.n:,} cleaned documents decided on disk ({time.time() - t1:.1f} s)")
