"""One self-contained HTML report of a run (plots embedded as base64 PNG), plus the PNGs.

Design choices:
- Reads only files: `metrics.jsonl`, `config.toml`, `run_meta.json`, `train.log` and the data
  dir's `manifest.json`. No MindSpore import, so a report of a live run costs a second and can
  be made on any machine the run dir is copied to.
- Tolerant by construction: a partial last line (the run is still writing), unknown keys and
  missing metrics are skipped, and a panel without data says so instead of failing.
- matplotlib's object API (`Figure` + Agg canvas), never pyplot: no global state, no display.
- Numbers that are estimates are labelled as such (tokens from steps x batch x seq_len when the
  run does not log `tokens`; wall time from throughput when it does not log `elapsed_s`).
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

from mspretrain import budget
from mspretrain import config as cfgmod
from mspretrain.errors import UserError
from mspretrain.fsutil import JSON_CAP, LOG_CAP, read_json_file, read_regular_text
from mspretrain.monitor.spikes import scan_metrics
from mspretrain.paths import DataPaths, RunPaths

_PANELS = (  # (file stem, title)
    ("loss", "Training loss (spikes marked)"), ("eval_ppl", "Eval perplexity"),
    ("eval_acc", "Multiple-choice accuracy (eval.choices_file)"),
    ("harness", "lm-eval task scores against tokens (eval.harness_tasks)"), ("lr", "Learning rate"),
    ("grad_norm", "Gradient norm"), ("loss_scale", "Loss scale and skipped steps"),
    ("throughput", "Throughput (right axis: MFU)"), ("memory", "Peak memory (host RSS; device on Ascend)"),
    ("moe", "Expert load: busiest expert / mean per MoE layer (right axis: balance loss)"))
_OPTIONAL_PANELS = frozenset({"eval_acc", "harness", "moe"})  # left out, not shown empty, when the run has no data for them


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
        if not (_is_number(step) and math.isfinite(step) and step == int(step) and 0 <= step < 2**53):
            bad += 1
            continue
        clean = {k: v for k, v in rec.items() if k != "step" and _is_number(v)
                 and (abs(v) <= 1e100 or (k in _MAY_BE_NONFINITE and not math.isfinite(v)))}
        by_step.setdefault(int(step), {}).update(clean, step=int(step))
    return [by_step[s] for s in sorted(by_step)], bad


# A non-finite value is a finding for these keys (counted and marked); for the others (tokens,
# elapsed_s, ...) it is a corrupt line, as is any value beyond 1e100 (no metric we log gets near:
# matplotlib's ticks overflow on a 1e308 range).
_MAY_BE_NONFINITE = frozenset({"loss", "grad_norm", "loss_scale", "eval/ppl", "eval/nll"})


def _is_number(v: Any) -> bool:
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
    warm-up resolved against the data's tokens); (None, the configured warm-up) if underivable."""
    try:
        b = budget.derive(c, world=world, data_tokens=int(manifest.get("tokens", {}).get("train", 0)) or None)
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


# ---------------------------------------------------------------------------- plots

def _figure(title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 3.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _plot(stem: str, title: str, s: dict) -> Any | None:
    """One panel as a matplotlib Figure, or None when the run has no data for it."""
    recs = s["records"]
    if stem == "loss":
        xs, ys = series(recs, "loss")
        fin = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        if not xs:
            return None
        fig, ax = _figure(title)
        if fin:
            ax.plot([x for x, _ in fin], [y for _, y in fin], lw=1, color="tab:blue", label="loss")
        spikes = [e for e in s["events"] if e["kind"] == "loss_spike"]
        if spikes:
            ax.scatter([e["step"] for e in spikes], [e["value"] for e in spikes], color="red", marker="x",
                       s=40, zorder=3, label=f"spike (> rolling mean + {s['config'].spike.threshold if s['config'] else 0.3})")
        for i, e in enumerate(e for e in s["events"] if e["kind"] == "nonfinite"):
            ax.axvline(e["step"], color="orange", lw=0.8, alpha=0.6, label="non-finite loss" if i == 0 else None)
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
        return fig
    if stem == "loss_scale":
        xs, ys = series(recs, "loss_scale")
        kx, ky = series(recs, "skipped")
        if not xs and not kx:
            return None
        if set(ys) <= {1.0} and not any(ky):
            # fp32 (or loss_scale = "none"): say so; autoscaled, the flat line sat on a +-0.04 axis
            fig, ax = _figure(title)
            ax.plot(xs, ys, lw=1.2, color="tab:purple")
            ax.set_ylim(0, 2)
            ax.set_yticks([1])
            ax.set_ylabel("loss scale")
            dtype = s["config"].precision.dtype if s["config"] else "fp32"
            ax.text(0.5, 0.72, f"no loss scaling ({dtype}): scale 1 at every step,\nno step skipped",
                    transform=ax.transAxes, ha="center", va="center", fontsize=12)
            return fig
        fig, ax = _figure(title)
        lines = []
        if xs:
            lines += ax.plot(xs, ys, lw=1.2, color="tab:purple", label="loss scale")
            if min(ys) > 0:
                ax.set_yscale("log", base=2)
            ax.set_ylabel("loss scale")
        if kx:
            ax2 = ax.twinx()
            lines += ax2.step(kx, ky, where="post", color="tab:red", lw=1, ls="--", label="skipped steps (total)")
            ax2.set_ylabel("skipped steps")
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8)
        return fig
    if stem == "throughput":
        xs, ys = series(recs, "tokens_per_s")
        mx, my = series(recs, "mfu")
        if not xs and not mx:
            return None
        fig, ax = _figure(title)
        ratios = [100 * m / t for t, m in zip(ys, my) if t] if xs and mx and xs == mx else []
        if ratios and max(ratios) - min(ratios) <= 1e-9 * max(abs(r) for r in ratios):
            # MFU is tokens/s times a constant (FLOPs per token / peak): one curve, read on either axis
            r = ratios[0]
            ax.plot(xs, ys, lw=1.2, color="tab:green", marker="o" if len(xs) < 30 else None, ms=3)
            ax.set_ylabel("tokens/s")
            if r > 0:
                sec = ax.secondary_yaxis("right", functions=(lambda t: t * r, lambda m: m / r))
                sec.set_ylabel("MFU %")
            return fig
        lines = []
        if xs:
            lines += ax.plot(xs, ys, lw=1.2, color="tab:green", label="tokens/s")
            ax.set_ylabel("tokens/s")
        if mx:
            ax2 = ax.twinx()
            lines += ax2.plot(mx, [100 * v for v in my], lw=1, color="tab:orange", ls="--", label="MFU %")
            ax2.set_ylabel("MFU %")
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8)
        return fig
    if stem == "eval_acc":
        named = [(k, label) for k, label in (("eval/acc", "accuracy (summed log-likelihood)"),
                                              ("eval/acc_norm", "accuracy (length-normalised)")) if series(recs, k)[0]]
        if not named:
            return None
        fig, ax = _figure(title)
        for k, label in named:
            xs, ys = series(recs, k)
            ax.plot(xs, [100 * y for y in ys], lw=1, marker="o" if len(xs) < 30 else None, ms=3, label=label)
        ax.set_xlim(0, max(s["last_step"], 1) * 1.04)
        ax.set_ylim(0, 100)
        ax.set_ylabel("accuracy %")
        ax.legend(fontsize=8)
        return fig
    if stem == "harness":
        return _harness_plot(title, recs)
    if stem == "moe":
        return _moe_plot(title, recs)
    if stem == "memory":
        # host RSS and (Ascend) device memory are separate metrics: one line each, never summed
        named = [(k, label) for k, label in (("mem_mb", "host RSS (peak)"), ("device_mem_mb", "device allocated (peak)"),
                                              ("device_mem_reserved_mb", "device reserved (peak)")) if series(recs, k)[0]]
        if not named:
            return None
        fig, ax = _figure(title)
        for k, label in named:
            xs, ys = series(recs, k)
            ax.plot(xs, ys, lw=1, marker="o" if len(xs) < 30 else None, ms=3, label=label)
        ax.set_ylabel("MB")
        ax.legend(fontsize=8)
        return fig
    key, ylabel, logy = {"eval_ppl": ("eval/ppl", "perplexity", True), "lr": ("lr", "lr", False),
                         "grad_norm": ("grad_norm", "grad norm", True), "memory": ("mem_mb", "MB", False)}[stem]
    xs, ys = series(recs, key)
    pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    if not pts:
        return None
    fig, ax = _figure(title)
    ax.plot([x for x, _ in pts], [y for _, y in pts], lw=1, marker="o" if len(pts) < 30 else None, ms=3)
    if stem == "eval_ppl":  # on the run's step axis, with the value written out: often one or two points
        ax.set_xlim(0, max(s["last_step"], pts[-1][0]) * 1.04)
        x, y = pts[-1]
        ax.annotate(f"{y:,.1f}", (x, y), textcoords="offset points", xytext=(-6, 6), ha="right", fontsize=9)
    if logy and min(y for _, y in pts) > 0 and max(y for _, y in pts) / min(y for _, y in pts) > 20:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    if stem == "grad_norm":
        for e in (e for e in s["events"] if e["kind"] == "grad_norm"):
            ax.scatter([e["step"]], [e["value"]], color="red", marker="x", s=40, zorder=3)
    return fig


HARNESS_METRICS = ("acc", "acc_norm", "exact_match")  # scores on a 0-1 scale: one axis in %


def expert_load_curves(recs: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """{MoE layer: (steps, busiest expert's assignments / mean)} from `moe/layer_L/max_over_mean`
    (model/moe.py `load_metrics`)."""
    curves: dict[int, tuple[list[int], list[float]]] = {}
    for r in recs:
        for k, v in r.items():
            if k.startswith("moe/layer_") and k.endswith("/max_over_mean") and _is_number(v) and math.isfinite(v):
                layer = k[len("moe/layer_"):-len("/max_over_mean")]
                if layer.isdigit():
                    xs, ys = curves.setdefault(int(layer), ([], []))
                    xs.append(r["step"])
                    ys.append(float(v))
    return curves


def _moe_plot(title: str, recs: list[dict]) -> Any | None:
    curves = expert_load_curves(recs)
    if not curves:
        return None
    fig, ax = _figure(title)
    if len(curves) <= 8:
        for layer, (xs, ys) in sorted(curves.items()):
            ax.plot(xs, ys, lw=1, label=f"layer {layer}")
    else:  # many layers: the worst and the median layer at each step
        by_step: dict[int, list[float]] = {}
        for xs, ys in curves.values():
            for x, y in zip(xs, ys):
                by_step.setdefault(x, []).append(y)
        steps = sorted(by_step)
        ax.plot(steps, [max(by_step[x]) for x in steps], lw=1, label=f"worst of {len(curves)} layers")
        ax.plot(steps, [statistics.median(by_step[x]) for x in steps], lw=1, label="median layer")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="balanced")
    ax.set_ylabel("max / mean")
    bx, by = series(recs, "moe/balance_loss")
    if bx:
        ax2 = ax.twinx()
        ax2.plot(bx, by, lw=1, color="tab:red", alpha=0.6)
        ax2.set_ylabel("balance loss", color="tab:red")
    ax.legend(fontsize=8)
    return fig


def harness_curves(recs: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """{"TASK/METRIC": (tokens seen, score)} of the lm-eval scores in the metrics (`harness/TASK/METRIC`
    keys at the evaluation steps), the x axis the `tokens` logged in the same record."""
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for r in recs:
        for k, v in r.items():
            if k.startswith("harness/") and k.rsplit("/", 1)[-1] in HARNESS_METRICS and _is_number(v) \
                    and math.isfinite(v) and _is_number(r.get("tokens")):
                xs, ys = curves.setdefault(k.removeprefix("harness/"), ([], []))
                xs.append(float(r["tokens"]))
                ys.append(float(v))
    return curves


def _harness_plot(title: str, recs: list[dict]) -> Any | None:
    curves = harness_curves(recs)
    if not curves:
        return None
    fig, ax = _figure(title)
    for name, (xs, ys) in sorted(curves.items()):
        ax.plot(xs, [100 * y for y in ys], lw=1, marker="o" if len(xs) < 30 else None, ms=3, label=name)
    ax.set_xlabel("tokens seen")
    ax.set_ylim(0, 100)
    ax.set_ylabel("score %")
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------------------- html

def _fmt(v: Any, spec: str = ",.4g") -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def _documents(docs: Any) -> str:
    """{"train": 11851, "valid": 143} as "train 11,851, valid 143"."""
    if isinstance(docs, dict):
        return ", ".join(f"{k} {_fmt(v, ',d')}" for k, v in docs.items())
    return _fmt(docs, ",d") if isinstance(docs, int) else _fmt(docs)


def _duration(hours: float) -> str:
    sec = hours * 3600
    return f"{sec:.0f} s" if sec < 120 else (f"{sec / 60:.1f} min" if sec < 7200 else f"{hours:,.2f} h")


def _accuracy(last: tuple[int, float, float | None]) -> str:
    step, acc, norm = last
    return f"{100 * acc:.1f} %" + (f" (length-normalised {100 * norm:.1f} %)" if norm is not None else "") + f" at step {step:,}"


def _init_rows(rec: dict | None) -> list[tuple[str, Any]]:
    """Where a `train --init-from` run's weights came from (run_meta.json "init_from"); [] for a
    run started from random weights."""
    if not rec:
        return []
    rows: list[tuple[str, Any]] = [("init from", f"{rec.get('path', '—')} ({rec.get('kind', 'unknown kind')})")]
    if rec.get("dir") and rec.get("dir") != rec.get("path"):  # a run dir: the checkpoint it resolved to
        rows.append(("weights read from", rec["dir"]))
    files = rec.get("files")
    if isinstance(files, dict):
        rows += [(f"SHA-256 {name}", sha) for name, sha in sorted(files.items())]
    r = rec.get("resized")
    if isinstance(r, dict):
        rows.append(("vocabulary resized", f"{_fmt(r.get('base_vocab'), ',d')} -> {_fmt(r.get('vocab'), ',d')}: "
                                            f"{_fmt(r.get('split_mean'), ',d')} new rows from the mean of their base-tokenizer "
                                            f"split, {_fmt(r.get('overall_mean'), ',d')} from the overall mean"))
    else:
        rows.append(("vocabulary resized", "no (same vocabulary as the init weights)"))
    return rows


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


_CSS = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:6px 0}th{text-align:left;padding:2px 14px 2px 0;color:#555;font-weight:normal}
td{padding:2px 8px}.grid{display:grid;grid-template-columns:1fr 1fr;gap:12px 28px}
img{max-width:100%;border:1px solid #eee}pre{background:#f6f6f6;padding:8px;font-size:12px;overflow:auto}
.warn{color:#a33}.muted{color:#888;font-size:13px}"""


def render_report(run_dir: Path) -> tuple[str, dict[str, bytes]]:
    """(the HTML, {panel stem: PNG bytes}) of a run, in memory: every check that can refuse the
    report runs here, before anything is written (a refused report leaves no report/ dir behind)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run dir {run_dir} does not exist", "pass the --run directory of a training run")
    s = summarize(run_dir)
    if not s["records"] and not s["config_text"]:
        raise UserError(f"{run_dir} has no metrics.jsonl and no config.toml", "is this a run dir? `mspretrain train --run DIR` writes them")
    panels, pngs = [], {}
    for stem, title in _PANELS:
        fig = _plot(stem, title, s)
        if fig is None and stem in _OPTIONAL_PANELS:
            continue
        if fig is None:
            panels.append(f"<div><h3>{html.escape(title)}</h3><p class=muted>no data in metrics.jsonl</p></div>")
            continue

        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        pngs[stem] = buf.getvalue()
        b64 = base64.b64encode(buf.getvalue()).decode("ascii")
        panels.append(f'<div><img alt="{html.escape(title)}" src="data:image/png;base64,{b64}"></div>')
    return render_html(s, panels), pngs


def write_pngs(pngs: dict[str, bytes], png_dir: Path) -> None:
    png_dir.mkdir(parents=True, exist_ok=True)
    for stem, data in pngs.items():
        (png_dir / f"{stem}.png").write_bytes(data)


def build_report(run_dir: Path, out: Path | None = None, png_dir: Path | None = None) -> Path:
    """Write the plots as PNGs into `png_dir` (default RUN_DIR/report/) and the HTML (default
    RUN_DIR/report/report.html; the plots are embedded in it too); return the HTML path."""
    run_dir = Path(run_dir)
    page, pngs = render_report(run_dir)
    png_dir = Path(png_dir) if png_dir is not None else run_dir / "report"
    write_pngs(pngs, png_dir)
    out = Path(out) if out else png_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def render_html(s: dict, panels: list[str]) -> str:
    c, man = s["config"], s["manifest"]
    run_rows = [("run dir", s["run_dir"]), ("last step", _fmt(s["last_step"], ",d")),
                ("tokens seen", _fmt(s["tokens"], ",d") + ("" if s["tokens_logged"] else " (steps × global batch × seq len)")),
                ("wall time", (_duration(s["hours"]) + " (" + s["hours_note"] + ")") if s["hours"] is not None else "—"),
                ("device-hours", _fmt(s["device_hours"], ",.4g")),
                ("cost", (_fmt(s["cost"], ",.4g") + f" at {s['price']:g} per device-hour") if s["cost"] else "— (set cost.price_per_device_hour)"),
                ("final loss", _fmt(s["final_loss"])), ("best eval perplexity", _fmt(s["best_ppl"])),
                *([("eval accuracy", _accuracy(s["last_acc"]))] if s["last_acc"] else []),
                ("mean tokens/s", _fmt(s["mean_tokens_per_s"], ",.0f")),
                ("mean MFU", _fmt(100 * s["mean_mfu"], ".2f") + " %" if s["mean_mfu"] is not None else "—"),
                ("loss spikes", len([e for e in s["events"] if e["kind"] == "loss_spike"])),
                ("grad-norm spikes", len([e for e in s["events"] if e["kind"] == "grad_norm"])),
                ("non-finite losses", s["nonfinite"]), ("skipped steps", _fmt(s["skipped"], ",.0f"))]
    hw = s["hardware"]
    hw_rows = [("hardware", ", ".join(f"{k}: {v}" for k, v in hw.items()) if isinstance(hw, dict) else (hw or "—")),
               ("world size", s["world_size"])]
    if c is not None:
        m = c.model
        hw_rows += [("model", f"dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads (kv {m.n_kv_heads or m.n_heads}), "
                              f"vocab {m.vocab_size or 'from data'}"),
                    ("batch", f"global {c.train.global_batch} × seq {c.data.seq_len}"),
                    ("optimizer", f"lr {c.optim.lr:g}" + (" (x sqrt(batch/32))" if c.optim.lr_scaling == "sqrt" else "")
                                  + f", {c.schedule.kind}, warm-up {s['warmup']} steps"
                                  + (" (auto)" if c.schedule.warmup_steps == "auto" else "")),
                    ("precision", c.precision.dtype)]
    weight_rows = _init_rows(s["init_from"])
    data_rows = [("data dir", s["data_dir"] or "— (not recorded; the lead's run_meta.json has data_dir)")]
    if man:
        tok = man.get("tokens", {})
        data_rows += [("train / valid tokens", f"{_fmt(tok.get('train'), ',d')} / {_fmt(tok.get('valid'), ',d')}"),
                      ("documents", _documents(man.get("documents"))), ("characters", _fmt(man.get("characters"), ",d")),
                      ("chars per token", _fmt(man.get("chars_per_token"), ".3f")), ("vocab size", _fmt(man.get("vocab_size"), ",d")),
                      ("fingerprint", str(man.get("fingerprint", "—"))[:16])]
    notes = [s["meta_note"]] if s.get("meta_note") else []
    if s["bad_lines"]:
        notes.append(f"{s['bad_lines']} unreadable line(s) in metrics.jsonl skipped (a run still writing leaves a partial last line).")
    if s["updated_s_ago"] is not None and s["updated_s_ago"] < 600 and not s["ended"]:
        notes.append(f"metrics.jsonl was updated {s['updated_s_ago']:.0f} s ago: the run may still be going; rerun the report to refresh.")
    events = "".join(f"<li>{html.escape(e['message'])}</li>" for e in s["events"][:50])
    more = f"<li>… {len(s['events']) - 50} more</li>" if len(s["events"]) > 50 else ""
    events += "".join(f"<li><code>{html.escape(line)}</code></li>" for line in s["log_events"])
    # the batch the spike detector recorded for each flagged step (monitor/spike_record.py)
    events += "".join(f'<li>batch of the spike at step {int(p.stem[5:])}: <a href="{html.escape(p.resolve().as_uri())}">'
                      f'spikes/{html.escape(p.name)}</a>; <code>mspretrain spike {html.escape(s["run_dir"])} --step '
                      f'{int(p.stem[5:])}</code> lists its samples and documents</li>'
                      for p in sorted((Path(s["run_dir"]) / "spikes").glob("step_*.json")))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mspretrain report — {html.escape(Path(s['run_dir']).name)}</title>
<style>{_CSS}</style></head><body>
<h1>mspretrain run report: {html.escape(Path(s['run_dir']).name)}</h1>
<p class=muted>generated {time.strftime('%Y-%m-%d %H:%M:%S')}</p>
{''.join(f'<p class=warn>{html.escape(n)}</p>' for n in notes)}
<div class=grid><div><h2>Totals</h2>{_table(run_rows)}</div>
<div><h2>Hardware and model</h2>{_table(hw_rows)}\
{f'<h2>Initial weights</h2>{_table(weight_rows)}' if weight_rows else ''}<h2>Data</h2>{_table(data_rows)}</div></div>
<h2>Curves</h2><div class=grid>{''.join(panels)}</div>
<h2>Events</h2><p class=muted>loss and grad-norm spikes from metrics.jsonl; interruptions, resumes, schedule and config changes, \
warnings from train.log</p><ul>{events or '<li>none</li>'}{more}</ul>
<h2>Config</h2><details><summary>config.toml</summary><pre>{html.escape(s['config_text'] or '(no config.toml)')}</pre></details>
</body></html>
"""
