"""`RUN_DIR/batches.jsonl`: one line per optimizer step saying which data it trained on.

Each step's line holds the loader position before the step (per-source consumed counts of the
global sample order), a hash of the global batch's sample ids (`data/order.py`), the world size,
the lr, the loss scale and whether the update was applied. Every start or resume (a session) and
every rewind add a marker line. `mspretrain audit` recomputes all of it from the loader's pure
plan; `mspretrain spike` lists the samples of a step from the logged position.

Design choices:
- Rank 0 writes for the whole world: the position is global (every rank holds the same loader
  state) and the batch's ids follow from it, so no rank has to send anything.
- A separate file, not `metrics.jsonl`: these are not scalars to plot (TensorBoard would draw the
  hash), and they are kept every step, never sampled.
- The cost per step is one slice of a cached permutation, a SHA-256 of a few KB and one line
  written unbuffered, so a crash loses no record (`docs/benchmarks.md` measures it).
- Resume truncates the file to steps <= the checkpoint's step, like `metrics.jsonl`: the steps
  after the checkpoint were not kept, so the history stays the history of the weights.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

from mspretrain.data.order import SamplePlan, batch_hash
from mspretrain.fsutil import LOG_CAP, atomic_write, jsonl_dicts, read_regular_text
from mspretrain.monitor.callback import Callback, DataState, Values

FILE = "batches.jsonl"
MAX_SOURCES = 1024
MAX_COUNT = 2**53  # steps, positions: exact in a float, far beyond any run
SCHEDULE_KINDS = ("cosine", "two_phase", "wsd", "constant")


def _int(v: Any, low: int = 0, high: int = MAX_COUNT) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _num(v: Any, low: float = 0.0, high: float = 1e30) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low <= v <= high


def _counts(v: Any) -> bool:
    return isinstance(v, list) and 1 <= len(v) <= MAX_SOURCES and all(_int(x) for x in v)


def problem(rec: Any) -> str | None:
    """Why a batches.jsonl line cannot be one this module wrote (None: it can). Every field a
    reader indexes or computes with is type- and range-checked here, so readers do not guard:
    a hand-edited, truncated or foreign line (a string step, a NaN lr, a 1e400 position, a
    missing key) is named instead of raising deep inside the audit."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    kinds = [k for k in ("step", "session", "rewind") if k in rec]
    if len(kinds) != 1:
        return "holds none of step / session / rewind" if not kinds else f"holds {' and '.join(kinds)} at once"
    if "session" in rec:
        r = rec["session"]
        if not isinstance(r, dict) or not _int(r.get("step", 0)) or not _int(r.get("world", 1), 1, 1 << 20) \
                or not _int(r.get("total", 0)) or not _int(r.get("warmup", 0)):
            return "session marker with a missing or invalid step / world / total / warmup"
        sch = r.get("schedule")
        if sch is not None and not (isinstance(sch, dict) and sch.get("kind") in SCHEDULE_KINDS
                                    and all(_num(sch.get(k)) for k in ("lr", "min_lr", "decay_fraction", "peak_ratio"))
                                    and _int(sch.get("warmup")) and _int(sch.get("total"))):
            return "session marker with an invalid schedule"
        plan = r.get("plan")
        if plan is not None and not (isinstance(plan, dict) and _counts(plan.get("windows")) and _int(plan.get("seed"), -2**63, 2**63)
                                     and isinstance(plan.get("weights"), list) and len(plan["weights"]) == len(plan["windows"])
                                     and all(_num(w, 1e-30) for w in plan["weights"]) and min(plan["windows"]) >= 1
                                     and _int(r.get("global_batch"), 1, 1 << 24)):
            return "session marker with an invalid sample plan"
        return None
    if "rewind" in rec:
        r = rec["rewind"]
        if not isinstance(r, dict) or not _int(r.get("from"), 1) or not _int(r.get("to")) or r["to"] >= r["from"] \
                or not _int(r.get("skip"), 0, 1 << 20) or not _counts(r.get("pos")):
            return "rewind marker with a missing or invalid from / to / skip / pos"
        return None
    if not _int(rec["step"], 1) or not _counts(rec.get("pos")) or not isinstance(rec.get("hash"), str) \
            or not _int(rec.get("world", 1), 1, 1 << 20) or not _num(rec.get("lr")) or not _num(rec.get("scale", 1.0), 1e-30) \
            or not isinstance(rec.get("finite", True), bool):
        return "step record with a missing or invalid step / pos / hash / world / lr / scale / finite"
    return None


def read_lines(run_dir: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line number, record, problem) for each non-blank line of RUN_DIR/batches.jsonl, read as a
    regular file under the log cap (a symlink to /dev/zero is a one-line error, not a hang)."""
    path = Path(run_dir) / FILE
    text = read_regular_text(path, LOG_CAP, "batch record", "the file was edited or replaced; restore it or train again",
                             errors="replace")
    for n, rec in jsonl_dicts(text):
        why = "not a JSON object (cut by a crash, edited, or not UTF-8)" if rec is None else problem(rec)
        yield n, (None if why else rec), why


def plan_for(loader: Any) -> SamplePlan:
    """The sample plan of a `data.loader.Loader` (its sources, weights and seed)."""
    return SamplePlan(windows=tuple(int(s.n) for s in loader._sources),
                      weights=tuple(float(s.weight) for s in loader._sources), seed=int(loader.seed))


def position(loader: Any) -> list[int]:
    """The loader's global position: samples consumed per source, all ranks together."""
    return [int(s["consumed"]) for s in loader.state()["sources"]]


def records(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The lines of RUN_DIR/batches.jsonl as dicts, in order; a line cut by a crash is skipped
    (`audit` reads the file strictly instead: it must name a damaged history)."""
    if not (Path(run_dir) / FILE).exists():
        return
    for _, rec, _why in read_lines(run_dir):
        if rec is not None:  # a damaged line is skipped here; the audit names it
            yield rec


def truncate(path: Path, step: int) -> None:
    """Keep the history of the weights saved at `step`: every line up to the LAST record of that
    step (after a rewind, steps repeat; the checkpoint belongs to the latest pass)."""
    if not path.exists():
        return
    lines = []
    for line in read_regular_text(path, LOG_CAP, "batch record", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line cut by a crash
        if isinstance(rec, dict):  # kept as written: a damaged record stays for the audit to name
            lines.append((line, rec))
    last = max((i for i, (_, rec) in enumerate(lines) if rec.get("step") == step and not isinstance(rec.get("step"), bool)),
               default=None)
    if last is None:  # no record of that step (a checkpoint from before this file): keep steps <= it
        kept = [line for line, rec in lines if isinstance(rec.get("step"), int) and rec["step"] <= step]
    else:
        kept = [line for line, _ in lines[:last + 1]]
    atomic_write(path, "".join(k + "\n" for k in kept))


class BatchLog(Callback):
    """Writes `batches.jsonl` on rank 0 (a no-op elsewhere); a train loop callback.

    `post_step` is called after every step with the loader state before the step and the step's values. The
    step that ran is always the previous record's + 1 (a rewind sets it back through its marker),
    which is why it is counted here rather than read from the loop's step counter, which a rewind
    has already moved when the callback runs."""

    def __init__(self, run_dir: Path, *, plan: SamplePlan, global_batch: int, enabled: bool, loader: Any = None,
                 resume_step: int | None = None, world: int = 1, skipped: int = 0, rewind_skip: int = 0,
                 total: int = 0, warmup: int = 0, schedule: Any = None, precision: dict[str, Any] | None = None,
                 changes: tuple[str, ...] = ()) -> None:
        self.path = Path(run_dir) / FILE
        self.plan, self.global_batch, self.enabled = plan, global_batch, enabled
        self.loader, self.world, self.rewind_skip = loader, world, rewind_skip
        self._last, self._skipped = resume_step or 0, skipped
        self._file = None
        self._pending: list[str] = []
        if not enabled:
            return
        if resume_step is not None:
            truncate(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # a line per step reaches the disk
        # each start or resume: the step it starts after, the world, and the schedule it runs (a
        # raised budget re-stretches the schedule on resume; the audit checks each part against its own)
        # Additive fields (each session judged by its own settings, not by the run's latest config):
        # the whole schedule, the sample plan and batch size, the loss-scale rules, and what the session was allowed to change (--allow-data-change,
        # --allow-config-change, --restart).
        session: dict[str, Any] = {"step": resume_step or 0, "world": world, "total": total, "warmup": warmup}
        if schedule is not None:
            session["schedule"] = {k: getattr(schedule, k) for k in
                                   ("kind", "lr", "warmup", "total", "min_lr", "decay_fraction", "peak_ratio")}
        session["plan"] = {"windows": list(plan.windows), "weights": list(plan.weights), "seed": plan.seed}
        session["global_batch"] = global_batch
        if precision is not None:
            session["precision"] = precision
        if changes:
            session["changes"] = list(changes)
        self._write({"session": session})

    def post_step(self, step: int, data_state: DataState, values: Values) -> None:
        ran = self._last + 1
        skipped = int(values.get("skipped", self._skipped))
        self.step(ran, [int(s["consumed"]) for s in data_state["sources"]], world=self.world,
                  lr=float(values["lr"]), scale=float(values.get("loss_scale", 1.0)), finite=skipped == self._skipped)
        self._skipped = skipped
        if "rewind" in values:
            self.rewind(ran, int(values["rewind"]), self.rewind_skip, position(self.loader))

    def step(self, step: int, pos: list[int], *, world: int, lr: float, scale: float, finite: bool) -> None:
        """Record optimizer step `step`, which started at loader position `pos`."""
        self._last = step
        if self._file is None:
            return
        ids = self.plan.batch(pos, self.global_batch)
        self._write({"step": step, "pos": pos, "hash": batch_hash(ids), "world": world, "lr": lr,
                     "scale": scale, "finite": bool(finite)})

    def rewind(self, at: int, to: int, skip: int, pos: list[int]) -> None:
        """A spike rewind at step `at` reloaded step `to`; the next step starts at `pos`."""
        self._last = to
        if self._file is not None:
            self._write({"rewind": {"from": at, "to": to, "skip": skip, "pos": pos}})

    def _write(self, rec: dict[str, Any]) -> None:
        """Append one record, whole or not at all: a failed write (a full disk) is cut back to the
        last whole line and kept to `retry()`, and raised as an OSError naming this file."""
        line = json.dumps(rec) + "\n"
        self._pending.append(line)
        self.retry()

    def retry(self) -> None:
        """Write the records a failed write left pending (the trainer calls it once it has room again)."""
        if self._file is None:
            return
        while self._pending:
            good = self._file.tell()
            try:
                self._file.write(self._pending[0])
                self._file.flush()
            except OSError as exc:
                try:
                    self._file.truncate(good)  # no torn line for a reader (or the resume) to meet
                    self._file.seek(good)
                except OSError:
                    pass
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
            self._pending.pop(0)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
