"""`mspretrain audit RUN`: was this run, across every resume, rewind and world-size change, the
run its config describes?

The loader's order is a pure function of (seed, per-source consumed counts), the lr a pure
function of the applied-update count, the loss scale a pure function of the overflow history.
So the whole history can be recomputed from step 1 and compared with what the trainer logged in
`batches.jsonl` (`monitor/batch_log.py`) and `metrics.jsonl`:

- every step follows the previous one (no step trained twice, none missing);
- every step starts where the previous one ended in the global sample order (no batch skipped
  or replayed) and trained on the batch the plan gives for that position (same hash);
- the lr is the schedule's at the applied-update count; the loss scale follows the scaler's
  rules from the previous step;
- `metrics.jsonl` holds each step once (a loss logged twice would be counted twice by every
  reader), except where a rewind legitimately repeats steps.

Rewinds (`spike.action = "rewind"`) repeat steps on purpose: the audit restores the state of the
step rewound to and checks the documented skip. Everything found is named with its step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mspretrain import budget
from mspretrain.config import schema as cfgmod
from mspretrain.data.order import SamplePlan, batch_hash
from mspretrain.errors import UserError
from mspretrain.fsutil import LOG_CAP, jsonl_dicts, read_json_file, read_regular_text
from mspretrain.monitor.batch_log import FILE as BATCHES
from mspretrain.monitor.batch_log import read_lines
from mspretrain.step.loss_scale import LossScaler


@dataclass
class Finding:
    step: int
    kind: str  # "step", "data", "lr", "loss_scale", "metrics"
    message: str


@dataclass
class Audit:
    steps: int = 0
    resumes: list[dict[str, Any]] = field(default_factory=list)
    rewinds: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)  # why the record cannot vouch for the whole run

    @property
    def exact(self) -> bool:
        return not self.findings and not self.incomplete


@dataclass
class _State:
    """What the plan says after a step."""

    step: int
    pos: list[int]
    applied: int
    scaler: dict[str, Any]
    world: int | None = None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's objects; a damaged line is an error naming it (the audit must not skip what
    it cannot read)."""
    out = []
    text = read_regular_text(path, LOG_CAP, "metrics log", "restore the file, or remove the broken line and run audit again")
    for n, rec in jsonl_dicts(text):
        if rec is None:
            raise UserError(f"{path} line {n} is not a JSON object", "the file was edited or cut by a crash; "
                            "remove the broken line and run audit again")
        out.append(rec)
    return out


def plan_of_run(run: Path, cfg: cfgmod.Config) -> tuple[SamplePlan, int]:
    """The run's sample plan (from its data dirs) and its train token count."""
    from mspretrain.data.loader import resolve_sources
    from mspretrain.data.manifest import read_manifest

    meta_path = run / "run_meta.json"
    try:
        data_dir = Path(read_json_file(meta_path, "run_meta.json")["data_dir"])
    except (UserError, KeyError, TypeError):
        raise UserError(f"{meta_path} is missing or unreadable, so the run's data dir is unknown",
                        "audit a run dir written by `mspretrain train`") from None
    windows, weights, tokens = [], [], 0
    for i, (path, weight) in enumerate(resolve_sources(data_dir, cfg.data.sources)):
        n_tok = int(read_manifest(path)["tokens"]["train"])
        tokens += n_tok if i == 0 else 0
        windows.append((n_tok - 1) // cfg.data.seq_len)
        weights.append(float(weight))
    return SamplePlan(tuple(windows), tuple(weights), cfg.train.seed), tokens


@dataclass
class _Session:
    """The settings a session trained with: each step is judged by its own session's, so a
    raised budget, a constant-lr continuation, --allow-data-change or --allow-config-change
    judge the steps after the change by the new settings and the steps before by the old."""

    plan: SamplePlan
    schedule: Any
    g: int
    precision: Any


def _session_of(r: dict[str, Any], prev: _Session, cfg: cfgmod.Config) -> _Session:
    from mspretrain.schedule import Schedule

    plan, schedule, g, precision = prev.plan, prev.schedule, prev.g, prev.precision
    if "plan" in r:
        p = r["plan"]
        new = SamplePlan(tuple(int(w) for w in p["windows"]), tuple(float(w) for w in p["weights"]), int(p["seed"]))
        if (new.windows, new.weights, new.seed) != (plan.windows, plan.weights, plan.seed):
            if max(new.windows) > max(max(plan.windows), 1 << 28):  # a permutation of that size would not fit
                raise UserError(f"a session of {BATCHES} names a source of {max(new.windows):,} windows",
                                "the file was edited; restore it")
            plan = new
        g = int(r.get("global_batch", g))
    if "schedule" in r:
        schedule = Schedule(**{k: r["schedule"][k] for k in ("kind", "lr", "warmup", "total", "min_lr", "decay_fraction",
                                                            "peak_ratio")})
    elif r.get("total") and (r["total"], r.get("warmup")) != (schedule.total, schedule.warmup):
        schedule = replace(schedule, total=int(r["total"]), warmup=int(r.get("warmup", 0)))  # older records
    if isinstance(r.get("precision"), dict):
        try:
            precision = cfgmod.PrecisionConfig(**r["precision"])
        except (TypeError, UserError):
            raise UserError(f"a session of {BATCHES} holds loss-scale settings this version cannot read",
                            "audit with the version of mspretrain that trained the run") from None
    return _Session(plan, schedule, g, precision)


def _record_extent(run: Path) -> tuple[int, str] | None:
    """The furthest step the run's other records vouch for: its newest checkpoint, or the last step
    of metrics.jsonl (None when neither exists)."""
    from mspretrain.checkpoint import store

    best: tuple[int, str] | None = None
    have = store.list_checkpoints(run)
    if have:
        best = (have[-1][0], f"checkpoint {have[-1][1].name}")
    path = run / "metrics.jsonl"
    if path.exists():
        steps = [r["step"] for r in _read_jsonl(path) if isinstance(r.get("step"), int) and not isinstance(r["step"], bool)]
        if steps and (best is None or max(steps) > best[0]):
            best = (max(steps), "metrics.jsonl")
    return best


def audit_run(run_dir: str | Path) -> Audit:
    run = Path(run_dir)
    path = run / BATCHES
    if not (run / "config.toml").is_file():
        raise UserError(f"{run} has no config.toml, so it is not a run dir", "pass the --run dir of a training run")
    if not path.exists():
        raise UserError(f"{run} has no {BATCHES}: it was trained by a version of mspretrain that did not record batches",
                        "audit a run trained with this version")
    cfg = cfgmod.load(run / "config.toml")
    plan, tokens = plan_of_run(run, cfg)
    sess = _Session(plan, budget.derive(cfg, data_tokens=tokens).schedule, cfg.train.global_batch, cfg.precision)
    out = Audit()
    scaler = LossScaler.from_config(sess.precision)
    state = _State(step=0, pos=[0] * len(plan.windows), applied=0, scaler=scaler.state())
    history: dict[int, _State] = {0: replace(state, pos=list(state.pos), scaler=dict(state.scaler))}
    sessions = 0
    seen: dict[int, list[tuple[list[int], int, float, int]]] = {}  # step -> every state the record gives after it
    session_world: Any = None

    for n, rec, why in read_lines(run):
        if why is not None:  # named, never skipped: the audit cannot vouch for what it cannot read
            out.findings.append(Finding(state.step + 1, "record", f"{BATCHES} line {n} is damaged ({why}): the "
                                                                  "history cannot be checked there"))
            continue
        if "session" in rec:
            r = rec["session"]
            at = int(r.get("step", 0))
            changes = list(r.get("changes", [])) if isinstance(r.get("changes"), list) else []
            first, sessions = sessions == 0, sessions + 1
            session_world = r.get("world")
            old = sess
            sess = _session_of(r, sess, cfg)
            if first and "plan" in r:  # the first session's own plan, not the run's latest data
                state = replace(state, pos=[0] * len(sess.plan.windows))
                history[0] = replace(state, pos=list(state.pos), scaler=dict(state.scaler))
            if at > 0:
                out.resumes.append(r)
            if "restart" in changes and at == 0 and state.step > 0:  # --restart: a new history from step 0
                out.notes.append(f"restarted from step 0 after step {state.step} (--restart moved the old checkpoints "
                                 "aside): the steps before are another history, not checked against this one")
                scaler = LossScaler.from_config(sess.precision)
                state = _State(step=0, pos=[0] * len(sess.plan.windows), applied=0, scaler=scaler.state())
                history = {0: replace(state, pos=list(state.pos), scaler=dict(state.scaler))}
                seen = {}  # the old checkpoints were moved aside with the old history
                continue
            if at < state.step:  # started again below the history: e.g. its checkpoints were gone
                out.findings.append(Finding(at + 1, "step", f"the run started again after step {at} over a history that "
                                            f"had reached step {state.step}: steps {at + 1}-{state.step} are trained twice"))
            elif at > state.step:
                out.findings.append(Finding(at, "step", f"resumed after step {at} but the history ends at step {state.step}: "
                                            f"steps {state.step + 1}-{at} have no record"))
            if at != state.step and at in history:  # check what follows against the plan from there
                back = history[at]
                state = replace(back, pos=list(back.pos), scaler=dict(back.scaler), world=state.world)
            if not first and (sess.schedule.total, sess.schedule.warmup) != (old.schedule.total, old.schedule.warmup):
                out.notes.append(f"budget changed at the resume after step {at}: schedule over "
                                 f"{old.schedule.total} -> {sess.schedule.total} steps, warm-up {old.schedule.warmup} "
                                 f"-> {sess.schedule.warmup}")
            if not first and (sess.schedule.kind, sess.schedule.lr, sess.schedule.min_lr) != \
                    (old.schedule.kind, old.schedule.lr, old.schedule.min_lr):
                out.notes.append(f"schedule changed at the resume after step {at}: {old.schedule.describe()} -> "
                                 f"{sess.schedule.describe()}")
            if not first and (sess.plan.windows, sess.plan.weights) != (old.plan.windows, old.plan.weights):
                out.notes.append(f"data changed at the resume after step {at}"
                                 + (" (--allow-data-change)" if "data" in changes else "")
                                 + ": the steps after it are checked against the new data's plan")
                if len(state.pos) != len(sess.plan.windows):
                    out.findings.append(Finding(at + 1, "data", f"the data changed from {len(state.pos)} to "
                                                f"{len(sess.plan.windows)} sources at the resume after step {at}"))
            if not first and sess.g != old.g:
                out.notes.append(f"global batch changed at the resume after step {at}: {old.g} -> {sess.g}")
            if sess.precision != old.precision:
                fresh = LossScaler.from_config(sess.precision)  # the new rules, the scale the run had reached
                fresh.load_state(state.scaler)
                scaler, state = fresh, replace(state, scaler=fresh.state())
            continue
        plan, g = sess.plan, sess.g
        if sessions == 0 and out.steps == 0 and not any("session marker" in n for n in out.notes):
            out.notes.append(f"{BATCHES} does not start with a session marker: its first steps are judged by "
                             "config.toml's settings")
        if "rewind" in rec:
            r = rec["rewind"]
            out.rewinds.append(r)
            back = history.get(int(r["to"]))
            if back is None:
                out.findings.append(Finding(int(r["from"]), "step", f"rewind at step {r['from']} to step {r['to']}, "
                                                                    "which this history never reached"))
                continue
            if len(back.pos) != len(plan.windows) or g * int(r["skip"]) > 1 << 27:
                out.findings.append(Finding(int(r["from"]), "data", f"rewind at step {r['from']} names a skip of "
                                            f"{r['skip']} steps this history cannot take"))
                continue
            pos = plan.advance(back.pos, g * int(r["skip"])) if int(r["skip"]) > 0 else state.pos
            state = replace(back, pos=pos, scaler=dict(back.scaler), world=state.world)
            if list(r.get("pos", pos)) != pos:
                out.findings.append(Finding(int(r["from"]), "data", f"rewind at step {r['from']} continued at sample "
                                            f"position {r.get('pos')}, the documented skip of {r['skip']} steps gives {pos}"))
            continue
        _check_step(rec, state, plan, sess.schedule, cfg, g, out)
        if session_world is not None and rec.get("world") != session_world:  # only a resume changes it
            out.findings.append(Finding(int(rec["step"]), "step", f"step {rec['step']} ran on {rec.get('world')} rank(s), "
                                                                  f"its session on {session_world}, with no resume recorded"))
        scaler.load_state(state.scaler)
        if math.isclose(scaler.scale, float(rec.get("scale", scaler.scale)), rel_tol=1e-12):
            scaler.update(bool(rec.get("finite", True)))
        else:  # named above; continue from what was logged so one fault is named once
            scaler.scale, scaler.good_steps = float(rec["scale"]), 0
            scaler.update(bool(rec.get("finite", True)))
        pos = [int(p) for p in rec.get("pos", state.pos)]
        state = _State(step=int(rec["step"]), pos=plan.advance(pos, g) if len(pos) == len(plan.windows) else pos,
                       applied=state.applied + bool(rec.get("finite", True)), scaler=scaler.state(),
                       world=rec.get("world", state.world))
        history[state.step] = replace(state, pos=list(state.pos), scaler=dict(state.scaler))
        seen.setdefault(state.step, []).append((list(state.pos), state.applied, float(state.scaler["scale"]), plan.seed))
        out.steps += 1
    if sessions and sess.plan.seed != cfg.train.seed:  # a resume with another seed is refused: never legitimate
        out.findings.append(Finding(state.step, "record", f"config.toml says train.seed = {cfg.train.seed}, but the run's "
                                                          f"last session trained with seed {sess.plan.seed}: the files are "
                                                          "not of one run"))
    _check_checkpoints(run, seen, out)
    _check_metrics(run, out)
    # the record must reach as far as the run's checkpoints and metrics: an empty or cut-off
    # batches.jsonl checks nothing and must not be called exact
    extent = _record_extent(run)
    if extent is not None and extent[0] > state.step:
        out.incomplete.append(f"{BATCHES} records steps up to {state.step}, but {extent[1]} reaches step {extent[0]}: "
                              f"steps {state.step + 1}-{extent[0]} cannot be checked")
    elif out.steps == 0:
        out.incomplete.append(f"{BATCHES} records no step: there is nothing to check")
    return out


def _check_step(rec: dict[str, Any], state: _State, plan: SamplePlan, schedule: Any, cfg: cfgmod.Config, g: int,
                out: Audit) -> None:
    step = int(rec["step"])
    if step <= state.step:
        out.findings.append(Finding(step, "step", f"step {step} trained again after step {state.step} with no rewind "
                                                  "or resume recorded"))
    elif step > state.step + 1:
        out.findings.append(Finding(step, "step", f"steps {state.step + 1}-{step - 1} are missing from the history"))
    if state.world is not None and rec.get("world") != state.world:
        out.notes.append(f"world size {state.world} -> {rec.get('world')} at step {step}")
    pos = [int(p) for p in rec.get("pos", [])]
    if len(pos) != len(plan.windows):
        out.findings.append(Finding(step, "data", f"step {step} names positions in {len(pos)} sources, the run's data "
                                                  f"has {len(plan.windows)}"))
    elif pos != state.pos:
        have, want = sum(pos), sum(state.pos)
        what = (f"{want - have} samples replayed" if have < want else f"{have - want} samples skipped") if have != want \
            else "the per-source positions differ"
        out.findings.append(Finding(step, "data", f"step {step} started at sample position {pos}, the plan says "
                                                  f"{state.pos}: {what}"))
    if len(pos) == len(plan.windows) and rec.get("hash") != batch_hash(plan.batch(pos, g)):
        out.findings.append(Finding(step, "data", f"step {step} trained on a batch that is not the plan's for its "
                                                  "position (data dir, seed or mixing weights changed?)"))
    want_lr = schedule(state.applied)
    if not math.isclose(float(rec.get("lr", want_lr)), want_lr, rel_tol=1e-9, abs_tol=1e-15):
        out.findings.append(Finding(step, "lr", f"step {step} ran at lr {rec.get('lr'):.6g}, the schedule says {want_lr:.6g}"))
    want_scale = float(state.scaler["scale"])
    if not math.isclose(float(rec.get("scale", want_scale)), want_scale, rel_tol=1e-12):
        out.findings.append(Finding(step, "loss_scale", f"step {step} ran at loss scale {rec.get('scale'):g}, the "
                                                        f"scaler's rules give {want_scale:g}"))


def _check_checkpoints(run: Path, seen: dict[int, list[tuple[list[int], int, float, int]]], out: Audit) -> None:
    """Each kept checkpoint must hold the state the record gives after its step: the data order's
    seed, the sample position, the applied steps and the loss scale. A batches.jsonl (or a
    checkpoint) copied from another run agrees with itself but not with these, and the audit must
    not call such a run exact."""
    from mspretrain.checkpoint import store

    for step, d in store.list_checkpoints(run):
        if step not in seen:  # beyond the record: said by the extent check
            continue
        try:
            ds = read_json_file(d / store.DATA_STATE, "data_state.json")
            ts = read_json_file(d / store.TRAIN_STATE, "train_state.json")
            have = ([int(src["consumed"]) for src in ds["sources"]], int(ts["applied_steps"]),
                    float(ts["loss_scale"]["scale"]), int(ds["seed"]))
        except (UserError, KeyError, TypeError, ValueError):
            out.notes.append(f"checkpoint {d.name}: its state files are unreadable, so it was not compared with the record")
            continue
        if have in seen[step]:
            continue
        want = seen[step][-1]
        what = [f"{name} {h} (the record gives {w})" for name, h, w in
                zip(("sample position", "applied steps", "loss scale", "data order seed"), have, want) if h != w]
        out.findings.append(Finding(step, "record", f"checkpoint {d.name} holds {', '.join(what)}: {BATCHES} and the "
                                                    "checkpoint are not of one history (a file copied from another run?)"))


def _check_metrics(run: Path, out: Audit) -> None:
    """Each step once in metrics.jsonl, except the steps a rewind repeats."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return
    last = 0
    for rec in _read_jsonl(path):
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        if "rewind" in rec:  # the spike step's record, written after the rewind: steps repeat from here
            last = int(rec["rewind"])
            continue
        if step <= last:
            out.findings.append(Finding(step, "metrics", f"metrics.jsonl logs step {step} again after step {last}: "
                                                         "its loss would be counted twice"))
        last = step


def format_audit(a: Audit, run: Path) -> str:
    lines = [f"audit of {run}: {a.steps} steps, {len(a.resumes)} resume(s), {len(a.rewinds)} rewind(s)"]
    for r in a.resumes:
        lines.append(f"  resumed after step {r.get('step')} on {r.get('world')} rank(s)")
    for r in a.rewinds:
        lines.append(f"  rewind at step {r['from']} to step {r['to']}, skipping {r['skip']} step(s) of data (by design)")
    lines += [f"  {n}" for n in a.notes]
    if a.incomplete:
        lines.append("incomplete: " + "; ".join(a.incomplete))
    if a.exact:
        lines.append("exact: every step trained once, on the plan's batch, at the schedule's lr and the scaler's loss scale")
    elif a.findings:
        lines.append(f"NOT exact: {len(a.findings)} finding(s)")
        lines += [f"  step {f.step}: [{f.kind}] {f.message}" for f in a.findings]
    return "\n".join(lines)
