"""Per-rank heartbeat files: what each rank is doing now, for hang and death triage.

Every rank writes `RUN_DIR/heartbeat/rank_RRRRR.json`:
`{"rank", "world", "step", "phase", "collectives", "collectives_per_step", "pid", "host", "time",
"phase_since", "started"}`. `step` counts the steps this rank has finished; `phase` says what it is
doing since `phase_since` (wall time); `collectives` is the sequence number of the last collective
it has issued, counted as finished steps x collectives per step (`TrainStep.collectives`): ranks
of one data-parallel job issue the same collectives in the same order, so two ranks whose numbers
differ are waiting for each other.

Phases: "start" (built, before the first step), "compile" (the first step: graph compilation
happens inside it), "data" (fetching this step's micro-batches on the host), "step" (inside the
compiled step), "eval", "save", "done", and "failed" (the loop ended on an exception). The
compiled step is one graph — forward, backward, the gradient reduction and the optimizer — so a
rank stuck in a collective shows as "step": on CPU the graph cannot be split into
forward-backward / reduce / optimizer without giving up the fused step.

Design choices:
- Off the hot path: `phase()` only stores a few Python values; a daemon thread writes the file at
  most once every `interval` seconds, plus at once when a phase that matters starts (compile,
  save, eval, done) — those are seconds long anyway. A busy step loop thus costs one attribute
  assignment per phase change, and the disk sees one small write every few seconds.
- The thread keeps writing while the main thread waits inside a collective (MindSpore releases
  the GIL while a graph runs), so a rank that waits for a peer stays *fresh* with its step frozen,
  while a rank that is stopped (SIGSTOP, a hung host) or dead goes *stale*: that difference is
  what `diagnose --hang` and `launch`'s watchdog read.
- Atomic (temporary file + os.replace), not fsynced: a reader never sees a torn file, and a
  heartbeat is worthless after a power cut anyway.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write, read_regular_text
from mspretrain.monitor.callback import Callback, Values

HEARTBEAT_DIR = "heartbeat"
PHASES = ("start", "compile", "data", "step", "eval", "save", "done", "failed")
URGENT = frozenset({"compile", "eval", "save", "done", "failed"})  # written at once: long phases, or the last word
DEFAULT_INTERVAL_S = 2.0


def heartbeat_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"rank_{rank:05d}.json"


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a torn one; no fsync (see the module doc)."""
    atomic_write(path, text, fsync=False)


class Heartbeat(Callback):
    """One rank's heartbeat writer, a train loop callback: "data", "step" and the steps finished
    from the step's hooks, "save" before a checkpoint, "done" after the loop, "failed" on an error;
    "eval" from the periodic eval (`phase(name, step)`). `close()` writes "done" (or the phase
    given) and stops the thread.

    `clock` is injectable so tests can show the rate limit without sleeping."""

    def __init__(self, run_dir: str | Path, rank: int = 0, world: int = 1, *, collectives_per_step: int = 0,
                 interval: float = DEFAULT_INTERVAL_S, clock=time.monotonic, thread: bool = True) -> None:
        self.path = heartbeat_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.world, self.per_step = rank, world, collectives_per_step
        self.interval = interval
        self._clock = clock
        self._host, self._pid, self._started = socket.gethostname(), os.getpid(), time.time()
        self._step, self._phase, self._since = 0, "start", time.time()
        self._stepped = False
        self._last_write = -float("inf")
        self._written_phase: str | None = None
        self.writes = 0
        self._lock = threading.Lock()  # the thread and an urgent write from the loop never interleave
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._flush(force=True)
        if thread:
            self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)
            self._thread.start()

    def phase(self, name: str, step: int | None = None) -> None:
        """The rank now does `name` (one of PHASES) with `step` steps finished. Cheap: the write
        happens on the thread, at once only for the URGENT phases."""
        if step is not None:
            self._step = step
        if name != self._phase:
            self._phase, self._since = name, time.time()
            if name in URGENT:
                self._wake.set()

    # The train loop's three calls per step. Before the first step has finished, its data and its
    # step are "compile": the first call of the compiled step builds the graph.
    def data(self, step: int) -> None:
        self.phase("data" if self._stepped else "compile", step)

    def running(self) -> None:
        self.phase("step" if self._stepped else "compile")

    def finished(self, step: int) -> None:
        self._stepped = True
        self._step = step

    # the loop's hooks (monitor/callback.py); `step` there is the step being run
    def pre_load_batch(self, step: int) -> None:
        self.data(step - 1)

    def pre_step(self, step: int) -> None:
        self.running()

    def post_train_batch(self, step: int, values: Values) -> None:
        self.finished(step)

    def pre_checkpoint(self, step: int) -> None:
        self.phase("save", step)

    def post_train(self, step: int) -> None:
        self.close("done", step)

    def on_error(self, step: int, exc: BaseException) -> None:
        self.close("failed", step)

    def record(self) -> dict:
        return {"rank": self.rank, "world": self.world, "step": self._step, "phase": self._phase,
                "collectives": self._step * self.per_step, "collectives_per_step": self.per_step,
                "pid": self._pid, "host": self._host, "time": time.time(), "phase_since": self._since,
                "started": self._started}

    def _flush(self, force: bool = False) -> bool:
        """Write if the interval has passed, or an urgent phase is new, or `force`."""
        with self._lock:
            now = self._clock()
            urgent = self._phase in URGENT and self._phase != self._written_phase
            if not (force or urgent or now - self._last_write >= self.interval):
                return False
            try:
                write_atomic(self.path, json.dumps(self.record()))
            except OSError:  # a full disk must not stop training; the stale heartbeat says enough
                self._last_write = now  # and the thread retries only after the interval
                return False
            self._last_write, self._written_phase = now, self._phase
            self.writes += 1
            return True

    def _run(self) -> None:
        while not self._stop:
            remaining = self._last_write + self.interval - self._clock()
            if remaining > 0:
                self._wake.wait(remaining)  # woken early by an urgent phase
                self._wake.clear()
            if not self._stop:
                self._flush()

    def close(self, phase: str = "done", step: int | None = None) -> None:
        """The last word ("done", or "failed" from an exception path); later calls do nothing."""
        if self._stop:
            return
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.phase(phase, step)
        self._flush(force=True)


def _int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v < 2**53


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e15


def read_heartbeats(run_dir: str | Path) -> list[dict]:
    """The heartbeats of the run's current job, sorted by rank.

    A relaunch at a smaller world size leaves the old job's higher ranks behind: only the ranks
    below the world size of the newest heartbeat are kept. Unreadable files (a foreign file, a
    half-copied dir) are skipped, since the writer never leaves a torn one."""
    d = Path(run_dir) / HEARTBEAT_DIR
    beats = []
    for p in sorted(d.glob("rank_*.json")) if d.is_dir() else []:
        try:  # a regular file of at most 64 KB: a heartbeat is ~300 bytes, /dev/zero is endless
            rec = json.loads(read_regular_text(p, 1 << 16, "heartbeat", errors="replace"))
            if not (_int(rec["rank"]) and _int(rec["step"]) and _int(rec.get("world", 1), 1) and _int(rec.get("pid", 0))
                    and _int(rec.get("collectives", 0)) and isinstance(rec["phase"], str) and isinstance(rec.get("host", ""), str)
                    and all(_finite(rec.get(k, 0.0)) for k in ("time", "phase_since", "started")) and "time" in rec):
                continue
        except (UserError, ValueError, KeyError, TypeError, RecursionError):
            continue
        beats.append(rec)
    if not beats:
        return []
    world = int(max(beats, key=lambda r: r["time"]).get("world", len(beats)))
    return sorted((b for b in beats if int(b["rank"]) < world), key=lambda r: int(r["rank"]))
