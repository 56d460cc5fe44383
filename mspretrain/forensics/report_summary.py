"""The report's reading half: `metrics.jsonl`, `config.toml`, `run_meta.json`, `train.log` and the
data dir's manifest of a run, as the plain values the report shows (`summarize`). Tolerant by
construction and MindSpore-free (the design notes are `forensics/report.py`'s); `plan --from-run` and
the tests read metrics through it too.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from mspretrain import budget
from mspretrain.config import schema as cfgmod
from mspretrain.errors import UserError
from mspretrain.fsutil import JSON_CAP, LOG_CAP, read_json_file, read_regular_text
from mspretrain.monitor.spikes import scan_metrics
from mspretrain.parallel.plan import ParallelPlan
from mspretrain.paths import DataPaths, RunPaths


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """Records sorted by step (a later line for the same step wins) and the number of unreadable lines."""
    by_step: dict[int, dict] = {}
    bad = 0
    if not path.exists():
        return [], 0
    for line in read_regular_text(path, LOG_CAP, "metrics log", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = rec["step"]
        except (ValueError, KeyError, TypeError, RecursionError):
            bad += 1  # a line the writer has not finished yet, or a torn write
            continue
        # Every consumer (plots, spikes, totals) may then assume: an int step, number values.
        # A hand-edited or foreign line with a string loss or an infinite step is skipped.
        if not (is_number(step) and math.isfinite(step) and step == int(step) and 0 <= step < 2**53):
            bad += 1
            continue
        clean = {k: v for k, v in rec.items() if k != "step" and is_number(v)
                 and (abs(v) <= 1e100 or (k in _MAY_BE_NONFINITE and not math.isfinite(v)))}
        by_step.setdefault(int(step), {}).update(clean, step=int(step))
    return [by_step[s] for s in sorted(by_step)], bad


# A non-finite value is a finding for these keys (counted and marked); for the others (tokens,
# elapsed_s, ...) it is a corrupt line, as is any value beyond 1e100 (no metric we log gets near:
# matplotlib's ticks overflow on a 1e308 range).
_MAY_BE_NONFINITE = frozenset({"loss", "grad_norm", "loss_scale", "eval/ppl", "eval/nll"})


def is_number(v: Any) -> bool:
    """A JSON number that float() can take (an int beyond float range is not: 1e400 as an int)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, float) or abs(v) < 2**1023


def _read_object(path: Path) -> tuple[dict, str | None]:
    """A JSON object file the run wrote ({} when absent), or ({}, why it cannot be used)."""
    if not path.exists():
        return {}, None
    try:
        obj = read_json_file(path, path.name)
    except UserError as e:
        return {}, f"{e.cause}: ignored"
    if not isinstance(obj, dict):
        return {}, f"{path.name} is not a JSON object: ignored"
    return obj, None


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _load_run_config(run_dir: Path) -> tuple[cfgmod.Config | None, str]:
    path = RunPaths(run_dir).config
    if not path.exists():
        return None, ""
    text = read_regular_text(path, JSON_CAP, "run config", errors="replace")
    try:
        return cfgmod.load(path), text
    except UserError:
        return None, text  # written by another version: show the text, use defaults


def _data_dir(run_dir: Path, meta: dict) -> Path | None:
    if meta.get("data_dir"):
        return Path(meta["data_dir"])
    log = RunPaths(run_dir).log
    if log.exists():
        m = re.search(r"\bdata(?:[ _]dir)?\s*[=:]\s*(\S+)", read_regular_text(log, LOG_CAP, "train log", errors="replace")[:20000])
        if m:
            return Path(m.group(1).strip("'\","))
    return None


def summarize(run_dir: Path) -> dict[str, Any]:
    """Everything the header shows, as plain values (also used by `diagnose` and tests)."""
    run_dir = Path(run_dir)
    paths = RunPaths(run_dir)
    records, bad = read_metrics(paths.metrics)
    cfg, cfg_text = _load_run_config(run_dir)
    meta, meta_note = _read_object(paths.meta)
    if not isinstance(meta.get("data_dir"), (str, type(None))):
        meta = {k: v for k, v in meta.items() if k != "data_dir"}
    data_dir = _data_dir(run_dir, meta)
    manifest, _ = _read_object(DataPaths(data_dir).manifest) if data_dir else ({}, None)
    if not isinstance(manifest.get("tokens"), dict):
        manifest = {k: v for k, v in manifest.items() if k != "tokens"}
    c = cfg or cfgmod.Config()
    ws = meta.get("world_size", 1)
    world = ws if isinstance(ws, int) and not isinstance(ws, bool) and ws > 0 else 1
    last = records[-1]["step"] if records else 0
    tokens_logged = series(records, "tokens")[1]
    tokens = int(tokens_logged[-1]) if tokens_logged else budget.tokens_after(c, last)
    tps = series(records, "tokens_per_s")[1]
    elapsed = series(records, "elapsed_s")
    sessions = _session_seconds(elapsed, _session_starts(paths.log))
    if elapsed:
        hours = sum(sessions) / 3600
        hours_note = "logged" if len(sessions) == 1 else f"logged, sum of {len(sessions)} sessions"
    elif tps:
        hours, hours_note = tokens / (sum(tps) / len(tps)) / 3600, "estimated from mean tokens/s"
    else:
        hours, hours_note = None, "unknown"
    budget_steps, warmup = _run_budget(c, manifest, world)
    events = scan_metrics(records, c.spike, warmup=warmup)
    losses = series(records, "loss")[1]
    finite = [x for x in losses if math.isfinite(x)]
    ppl = series(records, "eval/ppl")[1]
    acc = [(x, a) for x, a in zip(*series(records, "eval/acc")) if math.isfinite(a)]
    acc_norm = dict(zip(*series(records, "eval/acc_norm")))
    init_from = meta.get("init_from") if isinstance(meta.get("init_from"), dict) else None
    mfu = series(records, "mfu")[1]
    skipped = series(records, "skipped")[1]
    price = c.cost.price_per_device_hour
    device_hours = hours * world if hours is not None else None
    metrics_file = paths.metrics
    return {
        "run_dir": str(run_dir), "config_text": cfg_text, "config": cfg, "meta": meta,
        "data_dir": str(data_dir) if data_dir else None, "manifest": manifest, "records": records,
        "bad_lines": bad, "meta_note": meta_note, "last_step": last, "tokens": tokens, "tokens_logged": bool(tokens_logged),
        "world_size": world, "hardware": meta.get("hardware"), "hours": hours, "hours_note": hours_note,
        "device_hours": device_hours, "cost": device_hours * price if device_hours and price else None,
        "price": price, "final_loss": finite[-1] if finite else None,
        "best_ppl": min(ppl) if ppl else None,
        # the last multiple-choice evaluation: (step, acc, acc_norm or None)
        "last_acc": (acc[-1][0], acc[-1][1], acc_norm.get(acc[-1][0])) if acc else None,
        "init_from": init_from, "mean_tokens_per_s": sum(tps) / len(tps) if tps else None,
        "mean_mfu": sum(mfu) / len(mfu) if mfu else None, "events": events, "warmup": warmup,
        "sessions": len(sessions), "log_events": log_events(paths.log),
        "nonfinite": sum(1 for x in losses if not math.isfinite(x)),
        "skipped": (max(skipped) if skipped and all(b >= a for a, b in zip(skipped, skipped[1:])) else sum(skipped)) if skipped else 0,
        "updated_s_ago": time.time() - metrics_file.stat().st_mtime if metrics_file.exists() else None,
        "budget_steps": budget_steps,
        # finished: the budget is done, or the last session said goodbye (stopped, or nothing to do)
        "ended": bool(budget_steps and last >= budget_steps) or _last_session_ended(paths.log),
    }


def _session_starts(log: Path) -> set[int]:
    """First step of each training session, from train.log: every session logs its start-up line
    ("...; world N; micro-batch ..."), after "resumed from step_X: step N" when it resumed."""
    if not log.exists():
        return set()
    starts, resumed = set(), 0
    for line in read_regular_text(log, LOG_CAP, "train log", errors="replace").splitlines():
        m = re.search(r"resumed from step_\d+: step (\d+)", line)
        if m:
            resumed = int(m.group(1))
        elif "; world " in line and "micro-batch" in line:
            starts.add(resumed + 1)
            resumed = 0
    return starts


def _session_seconds(elapsed: tuple[list[int], list[float]], starts: set[int]) -> list[float]:
    """Wall seconds per training session. `elapsed_s` restarts at every session, so the run's time
    is the sum of each session's last value; a session starts at a step train.log names, or where
    `elapsed_s` drops (no train.log). A session's clock starts at its first step (compilation
    included, checkpoint loading not)."""
    out: list[float] = []
    prev, prev_step = None, 0
    for step, e in zip(*elapsed):
        if prev is None or e < prev or any(prev_step < st <= step for st in starts):
            out.append(0.0)
        out[-1] = e
        prev, prev_step = e, step
    return out


def _run_budget(c: cfgmod.Config, manifest: dict, world: int) -> tuple[int | None, int]:
    """(total steps, warm-up) of the run as the trainer derived them (mspretrain/budget.py, auto
    warm-up resolved against the data's tokens, the batch split over the data-parallel ranks as
    train/build.py splits it); (None, the configured warm-up) if underivable."""
    try:
        dp = ParallelPlan.for_config(c, world).dp
        b = budget.derive(c, world=dp, data_tokens=int(manifest.get("tokens", {}).get("train", 0)) or None)
        return b.steps, b.warmup or 0
    except (UserError, ValueError, TypeError):
        return None, c.schedule.warmup_steps if isinstance(c.schedule.warmup_steps, int) else 0


def _last_session_ended(log: Path) -> bool:
    """Whether train.log's last session logged its end (the spike detector's closing line, a stop by
    signal, or "nothing to do"); a session that is still going, or was killed, has not."""
    if not log.exists():
        return False
    ended = False
    for line in read_regular_text(log, LOG_CAP, "train log", errors="replace").splitlines():
        if "; world " in line and "micro-batch" in line:
            ended = False
        elif "spike detector: " in line or "stopped by " in line or "nothing to do:" in line:
            ended = True
    return ended


# Lines of train.log worth a reader's attention: interruptions, resumes, changes, warnings, skips.
_LOG_EVENT = re.compile(r"received SIG|stopped by|resumed from|config change accepted|schedule changes on resume|"
                        r"learning rate of update|warning:|gradient overflow|spike at step|rewound|checkpoint save failed|"
                        r"nothing to do|--restart")


def log_events(path: Path, limit: int = 200) -> list[str]:
    """The notable lines of train.log (with their timestamps), oldest first."""
    if not path.exists():
        return []
    lines = [ln for ln in read_regular_text(path, LOG_CAP, "train log", errors="replace").splitlines() if _LOG_EVENT.search(ln)]
    return lines[-limit:]
