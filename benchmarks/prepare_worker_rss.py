"""One `prepare` worker's peak RSS for one chunk (clean, hash, MinHash, spill to its file), in a
fresh process, for a given chunk size in blocks (`pool.RAW_GROUP_BY_REFERENCE`): what a larger
chunk costs each worker.

Usage: nice python benchmarks/prepare_worker_rss.py CORPUS.txt BLOCKS_PER_CHUNK
"""
from __future__ import annotations

import resource
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mspretrain.config.schema import PrepareConfig  # noqa: E402
from mspretrain.prepare import dedup, pool, sources, workers  # noqa: E402


def main() -> None:
    corpus, blocks = Path(sys.argv[1]), int(sys.argv[2])
    pool.RAW_GROUP_BY_REFERENCE = blocks
    cfg = replace(PrepareConfig(), doc_per_line=True, near_dedup=True)
    workers.init_worker(cfg, None, None, dedup.LshSettings.of(cfg))
    stats = sources.SourceStats()
    it = sources.iter_batches([corpus], doc_per_line=True, stats=stats, warn=lambda m: None, raw=True, by_reference=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    d = tempfile.mkdtemp(prefix="prepare_worker_rss_")
    try:
        for k, chunk in enumerate(pool.chunks_with_origin(it)):
            out = workers.spill_chunk(workers.clean_chunk, (chunk, f"{d}/{k:08d}", 64, 512))
            if k == 1:  # the second chunk: the allocator has seen one already
                break
        it.close()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"{blocks} blocks a chunk: {out['n']:,} documents, worker peak RSS {peak / 1024:.0f} MB "
              f"(after imports {base / 1024:.0f} MB)")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
