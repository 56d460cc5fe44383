"""Replay steps of a run from one of its checkpoints, in a scratch run dir, as they ran or changed.

`replay(RUN, from_step=K, steps=N)` builds the real trainer (`train/build.build_trainer`) on a scratch
run dir that holds only a link to the checkpoint of step K (or of the newest verified step before
it, when K was not kept), runs the steps up to K + N and returns each step's loss and grad norm next
to the ones `metrics.jsonl` logged. On CPU with the same world size an unchanged replay is the run
itself, bit for bit (the loader is a pure function of its position; the step is deterministic).

Interventions, each a change of the scratch run only:
- `drop_docs`: samples that overlap the given documents are swapped for clean ones (`drop_docs.py`);
- `dtype`: precision.dtype of the replay, with that precision's fresh loss scaler (fp32: none);
- `lr_scale`: every step's lr times X (the schedule's shape and total are the original's);
- `loss_scale`: the restored loss scale replaced by X.

Design choices:
- RUN is only read. The scratch dir must be new or empty (a dir with other files is refused, never
  cleaned); the checkpoint's files are hard links (copies across filesystems), which the scratch
  trainer never writes into: it writes new checkpoint dirs and prunes by unlinking.
- The replay stops after its last step without touching `train.max_steps`: the loop's horizon
  (`Trainer.total_steps`) is set to K + N, and every step runs at the lr `batches.jsonl` recorded
  for it, so a replay crosses sessions (a raised budget, a constant-lr continuation) with the lr
  each step actually had (the checkpoint's schedule only where no record exists). The periodic eval is left out (it changes no
  weight and would cost a pass over the valid split).
- Another world size than the original's changes the order of the sums over ranks: losses then
  agree to about 1e-5 (relative), not bit for bit, and the comparison says so.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from mspretrain.checkpoint import store
from mspretrain.config import schema as cfgmod
from mspretrain.errors import UserError
from mspretrain.fsutil import LOG_CAP, jsonl_dicts, read_json_file, read_regular_text
from mspretrain.monitor.batch_log import FILE as BATCHES
from mspretrain.monitor.batch_log import records as batch_records
from mspretrain.paths import RunPaths

TOLERANCE = 1e-5  # relative agreement expected of a replay on another world size

Observer = Callable[[Any, int], None]  # (trainer, step whose weights the model holds now)


@dataclass(frozen=True)
class Interventions:
    drop_docs: tuple[tuple[int, int], ...] = ()  # (source, document id in its train split)
    dtype: str | None = None
    lr_scale: float | None = None
    loss_scale: float | None = None

    def any(self) -> bool:
        return bool(self.drop_docs) or any(v is not None for v in (self.dtype, self.lr_scale, self.loss_scale))

    def describe(self) -> list[str]:
        out = []
        if self.drop_docs:
            out.append("dropped documents " + ", ".join(f"{d}" if s == 0 else f"{s}:{d}" for s, d in self.drop_docs))
        if self.dtype:
            out.append(f"precision.dtype = {self.dtype}")
        if self.lr_scale is not None:
            out.append(f"lr x {self.lr_scale:g}")
        if self.loss_scale is not None:
            out.append(f"loss scale {self.loss_scale:g}")
        return out


@dataclass
class Row:
    step: int
    original: float | None  # metrics.jsonl's loss (None: not logged at this step)
    replayed: float
    grad_norm: float
    lr: float
    spike_original: bool = False
    spike_replayed: bool = False

    @property
    def difference(self) -> float | None:
        return None if self.original is None else self.replayed - self.original


@dataclass
class Replay:
    run: Path
    scratch: Path | None  # None: a temporary dir, removed
    requested: int  # --from-step
    start: int  # the checkpoint's step
    end: int
    world_original: int
    world: int
    changes: Interventions
    rows: list[Row] = field(default_factory=list)
    swaps: list[Any] = field(default_factory=list)  # drop_docs.Swap
    notes: list[str] = field(default_factory=list)  # session boundaries the replay crosses

    @property
    def exact_expected(self) -> bool:
        return self.world == self.world_original

    def first_difference(self) -> Row | None:
        """The first compared step whose loss differs (bit for bit, or beyond TOLERANCE across worlds)."""
        for r in self.rows:
            if r.original is None or r.step <= self.requested:
                continue
            if self.exact_expected and r.replayed != r.original:
                return r
            if not self.exact_expected and not math.isclose(r.replayed, r.original, rel_tol=TOLERANCE):
                return r
        return None


# ----------------------------------------------------------------------------- run files
def read_run_metrics(run: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl by step (the last line of a step wins: after a rewind it is the kept history)."""
    out: dict[int, dict[str, Any]] = {}
    path = RunPaths(run).metrics
    if path.exists():  # a FIFO or device is named by the reader, not taken for "no metrics"
        for _, rec in jsonl_dicts(read_regular_text(path, LOG_CAP, "metrics log", errors="replace")):
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):  # None: a line cut by a crash
                out.setdefault(rec["step"], {}).update(rec)
    return out


def run_data_dir(run: Path) -> Path:
    try:
        return Path(read_json_file(RunPaths(run).meta, "run_meta.json")["data_dir"])
    except (UserError, KeyError, TypeError):
        raise UserError(f"{RunPaths(run).meta} is missing or unreadable, so the run's data dir is unknown",
                        "pass a run dir written by `mspretrain train`") from None


def check_run(run: Path) -> None:
    if not RunPaths(run).config.is_file():
        raise UserError(f"{run} has no config.toml, so it is not a run dir", "pass the --run dir of a training run")


def original_world(run: Path, steps: range) -> int:
    """The world size the run trained these steps on (batches.jsonl, else run_meta.json)."""
    for rec in batch_records(run):
        if rec.get("step") in steps and "world" in rec:
            return int(rec["world"])
    try:
        return int(read_json_file(RunPaths(run).meta, "run_meta.json").get("world_size", 1))
    except (UserError, ValueError, TypeError, AttributeError, OverflowError):
        return 1


def checkpoint_at_or_before(run: Path, step: int) -> Path:
    """The newest checkpoint of `run` at or before `step` that verifies."""
    have = store.list_checkpoints(run)
    for s, d in reversed(have):
        if s <= step and store.verify(d) is None:
            return d
    kept = ", ".join(str(s) for s, _ in have) or "none"
    raise UserError(f"{run} has no verified checkpoint at or before step {step} (checkpoints kept: {kept})",
                    "choose a step at or after a kept checkpoint (see `mspretrain checkpoints RUN --verify`)")


def history_checkpoint(run: Path, step: int, history: int) -> Path:
    """The checkpoint to replay from so that at least `history` steps run before `step`: the newest
    one at or before step - 1 - history; when none is that old, the OLDEST verified one before
    `step` (the most history the kept checkpoints allow; the newest would give one step)."""
    try:
        return checkpoint_at_or_before(run, max(0, step - 1 - history))
    except UserError:
        pass
    for s, d in store.list_checkpoints(run):
        if s <= step - 1 and store.verify(d) is None:
            return d
    return checkpoint_at_or_before(run, step - 1)  # raises the one-line error naming what is kept


def make_scratch(run: Path, out: str | Path | None) -> tuple[Path, bool]:
    """(scratch dir, whether it is a temporary one this replay removes). A full or read-only disk
    is one line (outputs.os_error), before anything is replayed."""
    from mspretrain.outputs import os_error

    if out is None:
        try:
            return Path(tempfile.mkdtemp(prefix="mspretrain-replay-")), True
        except OSError as e:
            raise os_error(e, "replay's temporary scratch dir", "free space in the temp dir (or set TMPDIR), or pass --out DIR") from None
    scratch = Path(out).expanduser().resolve()
    if scratch == run or run in scratch.parents:
        raise UserError(f"the scratch dir {scratch} is inside the run {run}, which replay never writes into",
                        "give --out a dir outside the run dir")
    if scratch.exists() and (not scratch.is_dir() or any(scratch.iterdir())):
        raise UserError(f"the scratch dir {scratch} already holds other files", "give --out a new or empty dir")
    try:
        scratch.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, f"replay's scratch dir {scratch}") from None
    return scratch, False


def link_checkpoint(ckpt: Path, scratch: Path) -> None:
    from mspretrain.outputs import os_error

    dest = RunPaths(scratch).checkpoints / ckpt.name
    try:
        dest.mkdir(parents=True)
        for f in ckpt.iterdir():
            try:
                os.link(f, dest / f.name)
            except OSError:  # another filesystem, or no hard links there
                shutil.copy2(f, dest / f.name)
    except OSError as e:  # the copy on a full disk
        raise os_error(e, f"the starting checkpoint into replay's scratch dir {scratch}") from None


# ----------------------------------------------------------------------------- the trainer's parts
class _ScaledSchedule:
    """The run's lr schedule times a factor; its kind, warm-up and total are the original's."""

    def __init__(self, base: Any, factor: float) -> None:
        self.base, self.factor = base, factor

    def __call__(self, applied: int) -> float:
        return self.base(applied) * self.factor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


class _RecordedSchedule:
    """The lr each step actually ran at (batches.jsonl), across session boundaries: a raised budget
    re-stretches the schedule and the quickstart's constant-lr continuation replaces it, so the
    schedule of the checkpoint's config is right only inside its own session. Steps without a
    record (a run older than the record) fall back to that schedule."""

    def __init__(self, base: Any, lrs: dict[int, float], trainer: Any) -> None:
        self.base, self.lrs, self.trainer = base, lrs, trainer

    def __call__(self, applied: int) -> float:
        return self.lrs.get(self.trainer.step + 1, self.base(applied) if callable(self.base) else 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def recorded_lrs(run: Path, steps: range) -> dict[int, float]:
    """step -> the lr batches.jsonl says it ran at (the last record of a step: after a rewind it
    is the kept history)."""
    out: dict[int, float] = {}
    for rec in batch_records(run):
        if rec.get("step") in steps and "lr" in rec:
            out[int(rec["step"])] = float(rec["lr"])
    return out


def scratch_config(ckpt: Path, changes: Interventions) -> cfgmod.Config:
    cfg = cfgmod.load(ckpt / store.CONFIG_FILE)
    if changes.dtype and changes.dtype != cfg.precision.dtype:
        if cfg.precision.param_dtype != "fp32":
            raise UserError(f"--dtype {changes.dtype}: the run keeps its parameters in its compute dtype "
                            "(precision.param_dtype = compute)", "replay without --dtype, or from a run with fp32 parameters")
        cfg = replace(cfg, precision=replace(cfg.precision, dtype=changes.dtype))
    return cfg


# ----------------------------------------------------------------------------- replay
def replay(run: str | Path, from_step: int, steps: int, *, changes: Interventions = Interventions(),
           out: str | Path | None = None, log: Callable[[str], None] = lambda s: None,
           observer: Observer | None = None) -> Replay:
    """Replay steps from_step + 1 .. from_step + steps (from the newest verified checkpoint at or before
    from_step); `observer(trainer, step)` is called with the weights of every step from the
    checkpoint's to the last, the loader at the next step's position (spike forensics look there)."""
    from mspretrain.checkpoint import lock
    from mspretrain.data.loader import resolve_sources
    from mspretrain.forensics.drop_docs import DropDocsLoader
    from mspretrain.monitor.batch_log import plan_for, position
    from mspretrain.monitor.callback import Callback
    from mspretrain.preflight.fits import check_fits
    from mspretrain.step.loss_scale import LossScaler
    from mspretrain.train.build import build_trainer
    from mspretrain.train.eval_schedule import PeriodicEval

    run = Path(run).expanduser().resolve()
    check_run(run)
    if steps < 0 or from_step < 0:
        raise UserError(f"--from-step {from_step} --steps {steps}: both must be >= 0 (steps >= 1)",
                        "e.g. --from-step 100 --steps 20")
    end = from_step + steps
    metrics = read_run_metrics(run)
    last = max((s for s, r in metrics.items() if "loss" in r), default=0)
    if end > last:
        raise UserError(f"step {end} is out of range: {run} logged losses up to step {last}",
                        f"replay at most to step {last} (--from-step + --steps <= {last})")
    ckpt = checkpoint_at_or_before(run, from_step)
    start = int(ckpt.name.split("_")[1])
    cfg = scratch_config(ckpt, changes)
    data_dir = run_data_dir(run)
    created = _first_missing(Path(out).expanduser().resolve()) if out is not None else None
    given = os.stat(out) if out is not None and created is None else None  # an empty --out: its times are put back
    scratch, temporary = make_scratch(run, out)
    result = Replay(run=run, scratch=None if temporary else scratch, requested=from_step, start=start, end=end,
                    world_original=original_world(run, range(start + 1, end + 1)), world=1, changes=changes)
    try:
        link_checkpoint(ckpt, scratch)
        record: dict[int, dict[str, float]] = {}
        holder: list[Any] = []

        class OnStep(Callback):
            def post_step(self, step: int, data_state: dict[str, Any], values: dict[str, Any]) -> None:
                record[step] = dict(values)
                if observer is not None:
                    observer(holder[0], step)

        trainer = build_trainer(cfg, data_dir, scratch, allow_config_change=changes.dtype is not None, log=log,
                                callbacks=(OnStep(),), fits=check_fits)
        holder.append(trainer)
        result.world = trainer.world.size
        if trainer.step != start:
            raise UserError(f"the scratch trainer resumed at step {trainer.step}, not at the checkpoint's {start}",
                            f"check that {ckpt} verifies (mspretrain checkpoints {run} --verify)")
        lrs = recorded_lrs(run, range(start + 1, end + 1))
        beyond = [st for st in range(trainer.total_steps + 1, end + 1) if st not in lrs]
        if beyond:  # a later session raised the budget, but no record says at which lr those steps ran
            raise UserError(f"step {beyond[0]} is beyond the budget of {trainer.total_steps} steps of checkpoint "
                            f"{ckpt.name}'s config and {BATCHES} has no record of its lr",
                            f"replay at most to step {trainer.total_steps}, or from a checkpoint of the later session")
        for rec in batch_records(run):  # a later session inside the range: its lr is the recorded one, but a
            r = rec.get("session")       # config change it was allowed (--allow-config-change) is not replayed
            if isinstance(r, dict) and start <= int(r.get("step", 0)) < end:
                what = [c for c in r.get("changes", []) if c in ("config", "data")] if isinstance(r.get("changes"), list) else []
                result.notes.append(f"the run resumed after step {r.get('step')}: steps after it are replayed at the lr they "
                                    "ran at" + (f", but with the settings of {ckpt.name} (that session changed its "
                                                f"{' and '.join(what)} with --allow-{what[0]}-change)" if what else ""))
        trainer.total_steps = end  # the loop's horizon only
        trainer.schedule = _RecordedSchedule(trainer.schedule, lrs, trainer)  # each step at the lr it ran with
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, PeriodicEval)]  # no eval in a replay
        if changes.lr_scale is not None:
            trainer.schedule = _ScaledSchedule(trainer.schedule, changes.lr_scale)
        if changes.dtype is not None:  # the scaler of the new precision (fp32: none), not the restored one
            trainer.scaler.load_state(LossScaler.from_config(cfg.precision).state())
        if changes.loss_scale is not None:
            trainer.scaler.scale = float(changes.loss_scale)
        if changes.drop_docs:
            sources = [p for p, _ in resolve_sources(data_dir, cfg.data.sources)]
            plan = plan_for(trainer.loader)
            g = cfg.train.global_batch
            trainer.loader = DropDocsLoader(trainer.loader, plan=plan, sources=sources, docs=list(changes.drop_docs),
                                            end=plan.advance(position(trainer.loader), g * (end - start)),
                                            first_step=start + 1, accum=trainer.accum_steps)
        if observer is not None:
            observer(trainer, start)
        trainer.train()
        result.swaps = list(getattr(trainer.loader, "swaps", []))
        for s in range(start + 1, end + 1):
            v = record.get(s)
            if v is None:  # the loop stopped early (a signal, a non-finite stop): report what ran
                break
            orig = metrics.get(s, {})
            result.rows.append(Row(step=s, original=orig.get("loss"), replayed=float(v["loss"]),
                                   grad_norm=float(v["grad_norm"]), lr=float(v["lr"]),
                                   spike_original="spike" in orig, spike_replayed="spike" in v))
        return result
    except UserError:
        if not temporary:  # refused: --out is left as it was (absent, or the empty dir it had to be)
            lock.release(scratch)
            _undo_scratch(scratch, created)
            if given is not None:
                os.utime(scratch, ns=(given.st_atime_ns, given.st_mtime_ns))
        raise
    finally:
        lock.release(scratch)
        if temporary:
            shutil.rmtree(scratch, ignore_errors=True)


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (what `mkdir(parents=True)` makes)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing = p
    return missing


def _undo_scratch(scratch: Path, created: Path | None) -> None:
    """Remove what a refused replay wrote into --out: the dirs it made, or the contents of the
    empty dir it was given (a refusal after the checkpoint copy, e.g. the data dir is gone, left
    the copy behind)."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    for p in scratch.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- output
def format_replay(r: Replay, *, drop_rule: str = "") -> str:
    where = f"in {r.scratch}" if r.scratch else "in a temporary dir (removed)"
    lines = [f"replay of {r.run}: steps {r.start + 1}..{r.end} from checkpoint step_{r.start:06d} {where}"]
    lines += [f"note: {n}" for n in r.notes]
    if r.start < r.requested:
        lines.append(f"note: step {r.requested} has no kept checkpoint; replayed from step {r.start}, the newest "
                     f"verified one before it")
    if not r.exact_expected:
        lines.append(f"note: the run trained on {r.world_original} rank(s), this replay on {r.world}: the sums over "
                     f"ranks run in another order, so losses are compared to {TOLERANCE:g} (relative), not bit for bit")
    shown = [row for row in r.rows if row.step > r.requested]
    compared = [row for row in shown if row.original is not None]
    first = r.requested + 1
    if not r.changes.any():
        if len(compared) < len(shown):
            lines.append(f"note: metrics.jsonl logged the loss at {len(compared)} of these {len(shown)} steps "
                         f"(metrics.loss_every); those are compared")
        bad = r.first_difference()
        if bad is None and compared:
            how = "bit for bit" if r.exact_expected else f"to {TOLERANCE:g}"
            lines.append(f"reproduced steps {first}..{r.end} {how}: every logged loss is equal"
                         + ("" if r.exact_expected else " within the tolerance"))
        elif bad is None:
            lines.append(f"nothing to compare: metrics.jsonl logged no loss in steps {first}..{r.end}")
        else:
            n = sum(1 for row in compared if row.replayed != row.original)
            lines.append(f"NOT reproduced: step {bad.step} differs first: logged {bad.original!r}, replayed "
                         f"{bad.replayed!r} (difference {bad.difference:+.3g}); {n} of {len(compared)} compared "
                         f"steps differ")
        return "\n".join(lines)
    lines.append("interventions: " + "; ".join(r.changes.describe()))
    if r.changes.drop_docs:
        lines.append(f"rule: {drop_rule}")
        for sw in r.swaps:
            lines.append(f"  step {sw.step}, sample {sw.position}: window {sw.dropped[1]} of source {sw.dropped[0]} "
                         f"-> window {sw.substitute[1]} of source {sw.substitute[0]}")
        if not r.swaps:
            lines.append("  no sample of the replayed steps overlaps a dropped document")
    lines.append(f"{'step':>6}  {'original':>10}  {'replayed':>10}  {'difference':>10}  note")
    for row in shown:
        note = ", ".join(n for n, on in (("spike in the run", row.spike_original), ("spike in the replay", row.spike_replayed)) if on)
        orig = f"{row.original:10.4f}" if row.original is not None else f"{'-':>10}"
        diff = f"{row.difference:+10.4f}" if row.difference is not None else f"{'-':>10}"
        lines.append(f"{row.step:>6}  {orig}  {row.replayed:10.4f}  {diff}  {note}".rstrip())
    return "\n".join(lines)
