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

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mspretrain import budget
from mspretrain import config as cfgmod
from mspretrain.data.order import SamplePlan, batch_hash
from mspretrain.errors import UserError
from mspretrain.fsutil import read_json_file
from mspretrain.monitor.batch_log import FILE as BATCHES
from mspretrain.train.loss_scale import LossScaler


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

    @property
    def exact(self) -> bool:
        return not self.findings


@dataclass
class _State:
    """What the plan says after a step."""

    step: int
    pos: list[int]
    applied: int
    scaler: dict[str, Any]
    world: int | None = None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise UserError(f"{path} line {n} is not JSON", "the file was edited or cut by a crash; "
                            "remove the broken line and run audit again") from None
        if isinstance(rec, dict):
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


def audit_run(run_dir: str | Path) -> Audit:
    run = Path(run_dir)
    path = run / BATCHES
    if not (run / "config.toml").is_file():
        raise UserError(f"{run} has no config.toml, so it is not a run dir", "pass the --run dir of a training run")
    if not path.is_file():
        raise UserError(f"{run} has no {BATCHES}: it was trained by a version of mspretrain that did not record batches",
                        "audit a run trained with this version")
    cfg = cfgmod.load(run / "config.toml")
    plan, tokens = plan_of_run(run, cfg)
    schedule = budget.derive(cfg, data_tokens=tokens).schedule
    g = cfg.train.global_batch
    out = Audit()
    scaler = LossScaler.from_config(cfg.precision)
    state = _State(step=0, pos=[0] * len(plan.windows), applied=0, scaler=scaler.state())
    history: dict[int, _State] = {0: replace(state, pos=list(state.pos), scaler=dict(state.scaler))}

    for rec in _read_jsonl(path):
        if "session" in rec:
            r = rec["session"]
            if int(r.get("step", 0)) > 0:
                out.resumes.append(r)
            at = int(r.get("step", 0))
            if at < state.step:  # started again below the history: e.g. its checkpoints were gone
                out.findings.append(Finding(at + 1, "step", f"the run started again after step {at} over a history that "
                                            f"had reached step {state.step}: steps {at + 1}-{state.step} are trained twice"))
            elif at > state.step:
                out.findings.append(Finding(at, "step", f"resumed after step {at} but the history ends at step {state.step}: "
                                            f"steps {state.step + 1}-{at} have no record"))
            if at != state.step and at in history:  # check what follows against the plan from there
                back = history[at]
                state = replace(back, pos=list(back.pos), scaler=dict(back.scaler), world=state.world)
            if r.get("total") and (r["total"], r.get("warmup")) != (schedule.total, schedule.warmup):
                if out.steps:
                    out.notes.append(f"budget changed at the resume after step {r.get('step')}: schedule over "
                                     f"{schedule.total} -> {r['total']} steps, warm-up {schedule.warmup} -> {r.get('warmup')}")
                schedule = replace(schedule, total=int(r["total"]), warmup=int(r.get("warmup", 0)))
            continue
        if "rewind" in rec:
            r = rec["rewind"]
            out.rewinds.append(r)
            back = history.get(int(r["to"]))
            if back is None:
                out.findings.append(Finding(int(r["from"]), "step", f"rewind at step {r['from']} to step {r['to']}, "
                                                                    "which this history never reached"))
                continue
            pos = plan.advance(back.pos, g * int(r["skip"])) if int(r["skip"]) > 0 else state.pos
            state = replace(back, pos=pos, scaler=dict(back.scaler), world=state.world)
            if list(r.get("pos", pos)) != pos:
                out.findings.append(Finding(int(r["from"]), "data", f"rewind at step {r['from']} continued at sample "
                                            f"position {r.get('pos')}, the documented skip of {r['skip']} steps gives {pos}"))
            continue
        _check_step(rec, state, plan, schedule, cfg, g, out)
        scaler.load_state(state.scaler)
        if math.isclose(scaler.scale, float(rec.get("scale", scaler.scale)), rel_tol=1e-12):
            scaler.update(bool(rec.get("finite", True)))
        else:  # named above; continue from what was logged so one fault is named once
            scaler.scale, scaler.good_steps = float(rec["scale"]), 0
            scaler.update(bool(rec.get("finite", True)))
        pos = [int(p) for p in rec.get("pos", state.pos)]
        state = _State(step=int(rec["step"]), pos=plan.advance(pos, g), applied=state.applied + bool(rec.get("finite", True)),
                       scaler=scaler.state(), world=rec.get("world", state.world))
        history[state.step] = replace(state, pos=list(state.pos), scaler=dict(state.scaler))
        out.steps += 1
    _check_metrics(run, out)
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
    if pos != state.pos:
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
    if a.exact:
        lines.append("exact: every step trained once, on the plan's batch, at the schedule's lr and the scaler's loss scale")
    else:
        lines.append(f"NOT exact: {len(a.findings)} finding(s)")
        lines += [f"  step {f.step}: [{f.kind}] {f.message}" for f in a.findings]
    return "\n".join(lines)
