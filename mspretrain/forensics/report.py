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
- Three modules: `report_summary` reads the files into plain values, `report_plots` draws the
  panels, this one writes the page (its tables and text) and the files.
"""
from __future__ import annotations

import base64
import html
import io
import math
import time
from pathlib import Path
from typing import Any

from mspretrain.errors import UserError
from mspretrain.forensics.report_plots import OPTIONAL_PANELS, PANELS, plot_panel
from mspretrain.forensics.report_summary import summarize


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
    for stem, title in PANELS:
        fig = plot_panel(stem, title, s)
        if fig is None and stem in OPTIONAL_PANELS:
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
