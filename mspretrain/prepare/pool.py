"""Work for `prepare`'s worker processes, cut into chunks and consumed in input order.

Results are taken in the order the chunks were made, with a bounded number in
flight, so the output is byte-identical whatever the number of workers, and memory stays bounded
whatever the corpus size (`multiprocessing.Pool.imap` would read ahead without limit).
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.pool
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import numpy as np

from mspretrain.data.origin import RECORD
from mspretrain.errors import UserError
from mspretrain.prepare import sources

CHUNK_CHARS = 1 << 18  # characters per unit of work sent to a worker (~3,000 short documents)
CHUNK_DOCS = 4096
# RawLines blocks (~0.8 MB each) per chunk: the main process's cost is per chunk (tasks out,
# results back, a journal entry), so bigger chunks lift its ceiling (docs/benchmarks/prepare.md);
# the blocks are still decoded one by one. References to blocks (local workers read them) cost
# the main process nothing to hold: ~13 MB chunks (~27,000 short documents). Blocks it holds
# (compressed input it reads itself, Ray): ~3 MB, as 2 x workers + 1 chunks are in flight.
RAW_GROUP = 4
RAW_GROUP_BY_REFERENCE = 16
# A compressed file read whole by a worker (`workers.spill_unit`) is cut there into chunks of
# this size instead: each costs the main process the same as any chunk, and the worker holds one
# at a time either way (~12 MB of text, like a chunk of block references).
UNIT_CHUNK_CHARS = 1 << 22
UNIT_CHUNK_DOCS = 1 << 15


def chunks(batches: Iterable[list[str] | sources.RawLines | sources.FileUnit], chars: int | None = None, docs: int | None = None,
           blocks: int | None = None) -> Iterator[list[str] | sources.RawLines | sources.FileUnit]:
    """Lists of documents of about `chars` (CHUNK_CHARS) characters (at most `docs`, CHUNK_DOCS,
    documents); up to `blocks` (RAW_GROUP, or RAW_GROUP_BY_REFERENCE for references)
    consecutive `RawLines` blocks of one file make a chunk of their own (the first carries the
    others in `rest`; the documents before them go first). A `FileUnit` is an item of its own."""
    chunk: list[str] = []
    size = 0
    group: list[sources.RawLines] = []
    most = lambda b: blocks or (RAW_GROUP if b.data is not None else RAW_GROUP_BY_REFERENCE)  # noqa: E731
    max_chars, max_docs = chars or CHUNK_CHARS, docs or CHUNK_DOCS

    def grouped() -> sources.RawLines:
        first = group[0]
        if len(group) > 1:
            first = replace(first, rest=group[1:])
        group.clear()
        return first

    for batch in batches:
        if isinstance(batch, sources.FileUnit):
            if chunk:
                yield chunk
                chunk, size = [], 0
            if group:
                yield grouped()
            yield batch
            continue
        if isinstance(batch, sources.RawLines):
            if chunk:
                yield chunk
                chunk, size = [], 0
            if group and (group[0].file != batch.file or len(group) >= most(group[0])):
                yield grouped()
            group.append(batch)
            continue
        if group:
            yield grouped()
        n = sum(map(len, batch))
        if size + n < max_chars and len(chunk) + len(batch) < max_docs:
            chunk.extend(batch)  # the common case: the whole batch fits
            size += n
            continue
        for item in batch:
            chunk.append(item)
            size += len(item)
            if size >= max_chars or len(chunk) >= max_docs:
                yield chunk
                chunk, size = [], 0
    if group:
        yield grouped()
    if chunk:
        yield chunk


def chunks_with_origin(batches: Iterable[list[str] | sources.RawLines | sources.FileUnit], **sizes) -> Iterator:
    """`chunks(batches, **sizes)`, each chunk of documents paired with its documents' origin records
    (a `RawLines` chunk carries its own, a `FileUnit` is read elsewhere). `chunks` builds plain
    lists, so the records of the batches it reads wait here, in order, until the chunk holding
    their documents comes out."""
    pending: deque[np.ndarray] = deque()

    def noted() -> Iterator[list[str] | sources.RawLines | sources.FileUnit]:
        for b in batches:
            if not isinstance(b, (sources.RawLines, sources.FileUnit)):
                pending.append(b.origin)
            yield b

    for chunk in chunks(noted(), **sizes):
        if isinstance(chunk, (sources.RawLines, sources.FileUnit)):
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


def batched(items: Iterable[str], n: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def ordered(pool, fn: Callable, work: Iterable, in_flight: int) -> Iterator:
    """Results of fn over `work`, in order, with at most `in_flight` items queued (no pool: in this process)."""
    if pool is None:
        yield from map(fn, work)
        return
    pending: deque = deque()
    for item in work:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def start_pool(workers: int, initializer: Callable, initargs: tuple, warm_up: Callable[[], None] | None = None, ray=None):
    """A process pool of `workers`, or None (after running `initializer` here) for one worker.
    The caller terminates it. `warm_up` runs first when the workers fork, for them to inherit.
    `ray`: a `raypool.RayCluster`; the pool's tasks then run on its nodes (`prepare --ray`)."""
    if ray is not None:
        return ray.pool(initializer, initargs)
    if workers <= 1:
        initializer(*initargs)
        return None
    # fork is fast; after MindSpore has started its threads in this process, forking is unsafe.
    method = "spawn" if "mindspore" in sys.modules else "fork"
    if method == "fork" and warm_up is not None:
        warm_up()
    return QuietPool(workers, initializer=initializer, initargs=initargs, context=mp.get_context(method))


class QuietPool(mp.pool.Pool):
    """A `multiprocessing.Pool` whose worker-handler thread sleeps while the pool runs.

    CPython's pool (multiprocessing/pool.py, 3.8-3.13) wakes that thread, which polls every worker
    and rebuilds its selector, (1) whenever a result is waiting in the result pipe
    (`Pool._get_sentinels` lists its reader), where it spins until the result thread has read it,
    and (2) whenever the table of outstanding tasks becomes empty (`_PoolCache.__delitem__`). When
    the main process sets the pace (`prepare`'s ceiling: workers faster than it), that is every
    result, four a chunk: a third of the main process's CPU per chunk went there
    (benchmarks/prepare_ceiling_bench.py, docs/benchmarks/prepare.md). Here it waits only for a
    worker's exit (its sentinel: lost workers are still replaced) and for the pool's own state
    changes: (1) is dropped from the sentinels, and for (2) a placeholder entry keeps the table
    from becoming empty while the pool runs; `terminate` removes it first (the pool checks that
    the table is empty if its result thread has gone). Nothing here calls `close`/`join`.
    Checked against CPython 3.11.7's multiprocessing/pool.py (this project's interpreter)."""

    _AWAKE = "mspretrain: never finished"  # not an int, so never a task's job number

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        dict.__setitem__(self._cache, self._AWAKE, None)
        self._started = list(self._pool)

    def _get_sentinels(self) -> list:
        return [self._change_notifier._reader]

    def apply_async(self, *args, **kwargs) -> Watched:
        return Watched(super().apply_async(*args, **kwargs), self)

    def dead(self) -> mp.Process | None:
        """The first worker that was killed or crashed, if any (its task is never done). A worker
        ends on its own with code 0 only when told to (`maxtasksperchild`, which prepare does not use)."""
        return next((p for p in self._started if p.exitcode not in (None, 0)), None)

    def terminate(self) -> None:
        if self.dead() is not None:
            self._abandon()
            return
        dict.pop(self._cache, self._AWAKE, None)  # (dict's own pop: no wake-up notice)
        # CPython's clean-up (`Pool._terminate_pool`) SIGTERMs the workers, then joins the task
        # handler, whose last act puts a sentinel on the result queue: a worker stopped while it
        # was putting a result holds that queue's lock for good, and the join never returns (seen
        # in CI: a prepare refused in pass 1 with results in flight, test_quality.py, hung at
        # `task_handler.join()`). So the clean-up runs in a thread of its own, and past
        # TERMINATE_WAIT_S the workers are killed and the stuck handler threads (daemons) left.
        stopper = threading.Thread(target=mp.pool.Pool.terminate, args=(self,), daemon=True, name="pool-terminate")
        stopper.start()
        stopper.join(TERMINATE_WAIT_S)
        if stopper.is_alive():
            self._kill_workers()

    def _abandon(self) -> None:
        """Stop without `Pool.terminate`, which takes the task queue's lock: a worker killed while
        it held that lock (an idle worker waits holding it) never gives it back, and the pool's
        own clean-up would wait for it forever. The workers are killed, the handler told to stop
        replacing them; its threads are daemons and end with this process."""
        self._terminate.cancel()  # nor at exit
        self._worker_handler._state = mp.pool.TERMINATE  # before the wake-up below: it must see it
        self._change_notifier.put(None)
        self._kill_workers()

    def _kill_workers(self) -> None:
        """The handler told to stop replacing workers, then every live worker killed."""
        self._worker_handler._state = mp.pool.TERMINATE
        for p in list(self._pool):
            if p.exitcode is None:
                p.kill()
                p.join(5)


WATCH_SECONDS = 1.0  # how often a wait for a result looks whether a worker died
TERMINATE_WAIT_S = 20.0  # QuietPool.terminate: CPython's clean-up takes well under a second when it can finish


class WorkerDied(UserError):
    def __init__(self, p: mp.Process) -> None:
        code = p.exitcode or 0
        how = f"was killed by signal {-code}" + (" (SIGKILL: often the kernel's out-of-memory killer)" if code == -9 else "") \
            if code < 0 else f"exited with code {code}"
        super().__init__(f"a prepare worker process (pid {p.pid}) {how}",
                         "run the same command again: it resumes from its last commit; if memory ran out, use fewer --workers")


class Watched:
    """A pool task's result (`ApplyResult`) whose wait ends if a worker dies: CPython's pool
    replaces the worker but never its task, so the wait would last forever."""

    __slots__ = ("_res", "_pool")

    def __init__(self, res: mp.pool.ApplyResult, pool: QuietPool) -> None:
        self._res, self._pool = res, pool

    def ready(self) -> bool:
        return self._res.ready()

    def get(self, timeout: float | None = None):
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._res.get(timeout=WATCH_SECONDS if end is None else max(0.0, min(WATCH_SECONDS, end - time.monotonic())))
            except mp.TimeoutError:
                dead = self._pool.dead()
                if dead is not None:
                    raise WorkerDied(dead) from None
                if end is not None and time.monotonic() >= end:
                    raise
