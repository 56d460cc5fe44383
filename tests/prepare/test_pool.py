"""`pool.start_pool`'s pool: its worker-handler thread does not wake for every result (spinning
on the result pipe would cost a third of `prepare`'s main-process CPU at its ceiling), and it still
replaces a worker that exits; a killed worker ends the wait for its task."""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.pool

import pytest

from mspretrain.prepare.pool import QuietPool, start_pool


@pytest.fixture
def handler_rounds(monkeypatch) -> list[int]:
    """One entry per round of a pool's worker-handler loop (each round starts with `_maintain_pool`)."""
    rounds: list[int] = []
    real = mp.pool.Pool._maintain_pool  # a staticmethod (CPython 3.11)

    def counted(*args):
        rounds.append(1)
        return real(*args)

    monkeypatch.setattr(mp.pool.Pool, "_maintain_pool", staticmethod(counted))
    return rounds


def _results(pool, n: int) -> None:
    for i in range(n):  # one at a time: the table of outstanding tasks empties after each
        assert pool.apply_async(abs, (-i,)).get(timeout=120) == i  # a stalled pool fails, not hangs


def test_the_worker_handler_sleeps_while_results_come_back(handler_rounds):
    # (CPython's own pool, forked where MindSpore is not loaded, woke 2,646 times for these 200
    # results when this was written; it is not run here: after MindSpore has started its threads
    # in a pytest worker, a forked pool can deadlock.)
    pool = start_pool(2, int, ())
    try:
        assert isinstance(pool, QuietPool)
        _results(pool, 5)  # the workers are up
        before = len(handler_rounds)
        _results(pool, 200)
        woke = len(handler_rounds) - before
    finally:
        pool.terminate()
    assert woke <= 2, woke


def test_a_worker_that_exits_is_still_replaced():
    """The handler still wakes for a worker's exit: here each worker exits after one task
    (`maxtasksperchild`), so without its replacement the pool would stall. (A worker is not
    SIGKILLed: one that holds the task queue's lock at that moment stalls any CPython pool.)"""
    pool = QuietPool(2, maxtasksperchild=1, context=mp.get_context("spawn"))
    try:
        _results(pool, 12)
    finally:
        pool.terminate()


def test_a_killed_worker_ends_the_wait_for_its_task_and_terminate_returns():
    """CPython's pool replaces a killed worker and waits for its task forever; here the wait ends
    in `WorkerDied` (prepare's one-line error). Both workers are killed, so one of them held the
    task queue's lock (an idle worker waits holding it): `terminate` must not wait for it."""
    import os
    import signal
    import threading
    import time

    from mspretrain.prepare.pool import WorkerDied

    pool = start_pool(2, int, ())
    try:
        _results(pool, 4)
        busy = pool.apply_async(time.sleep, (120,))
        for p in list(pool._pool):
            os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="killed by signal 9"):
            busy.get()
    finally:
        done = threading.Thread(target=pool.terminate, daemon=True)
        done.start()
        done.join(60)
    assert not done.is_alive(), "terminate waited for a dead worker's lock"


def test_terminate_returns_when_cpythons_clean_up_does_not(monkeypatch):
    """CPython's clean-up can wait forever for a lock a stopped worker held (a result in flight):
    `terminate` gives it TERMINATE_WAIT_S, then kills the workers and returns. (Here the clean-up
    is held back until the test ends, then runs.)"""
    import threading
    import time

    from mspretrain.prepare import pool as pool_mod

    release = threading.Event()
    real = mp.pool.Pool.terminate
    monkeypatch.setattr(mp.pool.Pool, "terminate", lambda self: (release.wait(), real(self)))
    monkeypatch.setattr(pool_mod, "TERMINATE_WAIT_S", 0.5)
    pool = start_pool(2, int, ())
    try:
        _results(pool, 4)
        workers = list(pool._pool)
        t0 = time.monotonic()
        pool.terminate()
        assert time.monotonic() - t0 < 15
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.is_alive() for p in workers)  # killed, not left running
    finally:
        release.set()
