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
from pathlib import Path
from typing import Any, Iterator

from mspretrain.data.order import SamplePlan, batch_hash
from mspretrain.fsutil import atomic_write

FILE = "batches.jsonl"


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
    path = Path(run_dir) / FILE
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec


def truncate(path: Path, step: int) -> None:
    """Keep the history of the weights saved at `step`: every line up to the LAST record of that
    step (after a rewind, steps repeat; the checkpoint belongs to the latest pass)."""
    if not path.is_file():
        return
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            lines.append((line, json.loads(line)))
        except ValueError:
            continue  # a line cut by a crash
    last = max((i for i, (_, rec) in enumerate(lines) if rec.get("step") == step), default=None)
    if last is None:  # no record of that step (a checkpoint from before this file): keep steps <= it
        kept = [line for line, rec in lines if isinstance(rec.get("step"), int) and rec["step"] <= step]
    else:
        kept = [line for line, _ in lines[:last + 1]]
    atomic_write(path, "".join(k + "\n" for k in kept))


class BatchLog:
    """Writes `batches.jsonl` on rank 0 (a no-op elsewhere); a trainer step callback.

    Called after every step with the loader state before the step and the step's values. The
    step that ran is always the previous record's + 1 (a rewind sets it back through its marker),
    which is why it is counted here rather than read from the loop's step counter, which a rewind
    has already moved when the callback runs."""

    def __init__(self, run_dir: Path, *, plan: SamplePlan, global_batch: int, enabled: bool, loader: Any = None,
                 resume_step: int | None = None, world: int = 1, skipped: int = 0, rewind_skip: int = 0,
                 total: int = 0, warmup: int = 0) -> None:
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
        self._write({"session": {"step": resume_step or 0, "world": world, "total": total, "warmup": warmup}})

    def __call__(self, step: int, data_state: dict[str, Any], values: dict[str, float]) -> None:
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
