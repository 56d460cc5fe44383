"""`mspretrain diagnose RUN_DIR|LOGFILE`: why did the job die at 2 a.m.?

Design choices:
- Reads what a run leaves behind: our `train.log` and `metrics.jsonl`, and every `*.log` below
  the run dir (msrun's `worker_N.log` / `scheduler.log`, MindSpore's own logs). Nothing is
  imported from MindSpore, so it runs on a laptop with a copied log dir.
- Log problems are regular expressions over single lines, tried in a fixed priority order (the
  kernel OOM killer is "killed", not "device OOM"); each line gets at most one kind. A kind is
  reported once per file with its first evidence line (file:line) and a count.
- Metric problems reuse `monitor.spikes.scan_metrics` (loss spikes, grad-norm spikes, non-finite
  runs) so the report, the live trainer and diagnose agree on what a spike is.
- Router collapse (mixture of experts, issue 52.6): from the per-layer expert load the trainer
  logs (model/moe.py `load_metrics`): a layer whose busiest expert was chosen by at least
  COLLAPSE_SHARE of its tokens and holds at least COLLAPSE_RATIO times the mean assignments, for
  COLLAPSE_RUN logged steps in a row. Both, so that a tiny model's balanced load (4 experts, 2
  per token: every expert's share is 1/2) is not a collapse, nor a 128-expert layer at 2x mean.
- Stragglers: per-rank step times parsed from worker logs (`step_time=`, MindSpore's `per step
  time: X ms`, or our `N tok/s`); a rank whose median is > 1.5x the median of the other ranks is named.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mspretrain.config import schema as cfgmod
from mspretrain.errors import UserError
from mspretrain.fsutil import LOG_CAP, stream_lines
from mspretrain.monitor.ranks import STALE_S, describe, lagging, process_state, rank_states
from mspretrain.monitor.spikes import scan_metrics

ADVICE = {
    "killed": "the process was killed (SIGKILL or the kernel OOM killer): check host memory (`dmesg | grep -i oom`), "
              "use --cpu-quota or fewer workers per host; `mspretrain train` resumes from the newest verified checkpoint",
    "oom": "device/host memory ran out: lower train.micro_batch (global_batch stays, accumulation grows), recompute, or "
           "shard optimizer state; `mspretrain plan` shows memory per device before launch",
    "disk_full": "the disk is full: free space or lower checkpoint.keep_last; checkpoints are written to step_N.tmp and "
                 "renamed, so the last verified one is intact — resume after freeing space",
    "comm_timeout": "a collective timed out: usually another rank failed or stalled first — find its error in the other "
                    "worker logs; check links (`hccn_tool`, `npu-smi info`); raise HCCL_EXEC_TIMEOUT/HCCL_CONNECT_TIMEOUT for slow starts",
    "nonfinite": "non-finite losses in a row: lower optim.lr or lengthen warm-up, check fp16 loss scaling "
                 "(precision.init_scale), keep optim.grad_clip on; resume from a checkpoint before the storm (spike.action=rewind)",
    "overflow": "fp16 overflow: many steps skipped in a row; the loss scale is collapsing — lower lr, check the data "
                "around these steps, or train in bf16 on Ascend",
    "loss_spike": "loss spike: if isolated and it recovers, ignore it; if it repeats, lower lr, inspect the data at that "
                  "step (a bad shard), or set spike.action=rewind",
    "grad_norm": "gradient-norm spike: often precedes a loss spike; check lr and optim.grad_clip, and the data at that step",
    "router_collapse": "router collapse: one expert takes most of an MoE layer's tokens, so the others stop learning: "
                       "raise model.router_aux_loss_coef (Qwen3 uses 0.001) or lower optim.lr, and resume from a checkpoint "
                       "before the collapse; after --upcycle, check that the experts were copies and the routers fresh",
    "straggler": "one rank is far slower than the others, so every step waits for it: check that host (other jobs, "
                 "thermal throttling, `npu-smi info`), its data loading (CPU share, disk) and its network link",
    "exception": "the process stopped on this error; the lines above it in the file show where",
}

# (kind, pattern), in priority order: the first matching kind claims the line.
LOG_RULES: list[tuple[str, re.Pattern]] = [
    ("killed", re.compile(r"Killed process \d+|oom-kill|invoked oom-killer|^\s*Killed\s*$|\b\d+ Killed\b|\bsignal 9\b|SIGKILL|"
                          r"(?:exit|error|return)\s*code[:=]?\s*-9\b|exitcode:?\s*-9\b|exit status -9\b|exit code 137\b", re.I)),
    ("disk_full", re.compile(r"No space left on device|ENOSPC|Disk quota exceeded|\[Errno 28\]")),
    ("oom", re.compile(r"out of memory|\bOOM\b|MemoryError|memory isn't enough|memory is not enough|"
                       r"Allocate memory failed|Malloc device memory failed|alloc(?:ate)?\w* .{0,40}failed|std::bad_alloc|\bEL0004\b", re.I)),
    ("comm_timeout", re.compile(r"(?:hccl|mccl|nccl|collective|all_?reduce|all_?gather|broadcast|heartbeat|rendezvous|"
                                r"socket|notify).{0,160}(?:time ?out|timed out)|(?:time ?out|timed out).{0,160}(?:hccl|mccl|rank|collective)|"
                                r"\bEI000[2-9]\b|\bEI0010\b", re.I)),
    ("nonfinite", re.compile(r"\bloss[ =:]+[-+]?(?:nan|inf)\b|non-finite for \d+ steps", re.I)),
]
# Lower-case words at least one alternative of each rule needs: a line with none of them cannot
# match any rule, and is skipped after one pass of C-speed substring tests (most lines of a long
# log). Measured on a 50 MB worker log (one progress line per step): 45.1 -> 4.8 CPU s, and the
# whole `diagnose` command 154 -> 42 MB peak RSS (step times are kept as floats, not line tuples).
_RULE_WORDS = ("kill", "oom", "signal 9", "exit", "code", "space left", "enospc", "quota", "errno 28", "memory",
               "alloc", "el0004", "time", "ei00", "nan", "inf", "non-finite")
_RULE_RX = re.compile("|".join(map(re.escape, _RULE_WORDS)))
EXCEPTION = re.compile(r"^(?:\[[A-Z]+\].*?)?\b([A-Z]\w*(?:Error|Exception)): (.+)$")
STEP_TIME = [
    (re.compile(r"step[_ ]time\s*[=:]\s*([\d.]+)\s*(ms|s)?", re.I), "time"),
    (re.compile(r"per step time:?\s*([\d.]+)\s*(ms)", re.I), "time"),
    (re.compile(r"([\d][\d,]*(?:\.\d+)?)\s*tok(?:ens)?/s"), "rate"),
]
STRAGGLER_FACTOR = 1.5
NONFINITE_RUN = 3
OVERFLOW_RUN = 5
COLLAPSE_SHARE = 0.5  # the busiest expert chosen by at least half the layer's tokens ...
COLLAPSE_RATIO = 2.0  # ... and at least twice the mean assignments ...
COLLAPSE_RUN = 3  # ... for this many logged steps in a row
_SHARE = re.compile(r"^moe/layer_(\d+)/top_share$")


@dataclass
class Finding:
    kind: str
    file: str
    line: int
    evidence: str
    count: int = 1
    advice: str = ""

    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


class StepTimes:
    """Step-time samples of one log file in bounded memory: the values (8 bytes each, in one
    array) and the text of the first two samples (the evidence), not a tuple per line."""

    def __init__(self) -> None:
        self.fmt: int | None = None  # index into STEP_TIME: one format per file
        self.values = array("d")
        self.examples: list[tuple[int, str]] = []

    def add(self, no: int, value: float, text: str) -> None:
        self.values.append(value)
        if len(self.examples) < 2:
            self.examples.append((no, text))

    def __len__(self) -> int:
        return len(self.values)


def scan_log(path: Path, root: Path) -> tuple[list[Finding], StepTimes]:
    """Findings of one log file, and its step-time samples. Streams the file line by line: memory
    stays bounded whatever the log's size (the findings keep one line per kind)."""
    first: dict[str, Finding] = {}
    times = StepTimes()
    last_exc: Finding | None = None
    # stream_lines: a regular file under the log cap, lines cut at 1 MB (bounded memory)
    for no, raw in enumerate(stream_lines(path, LOG_CAP, "log file"), 1):
        line = raw.rstrip("\n")
        low = line.lower()
        claimed = False
        if _RULE_RX.search(low):
            for kind, rx in LOG_RULES:
                if rx.search(line):
                    claimed = True
                    if kind in first:
                        first[kind].count += 1
                    else:
                        first[kind] = Finding(kind, _rel(path, root), no, line.strip()[:300])
                    break
        if not claimed and ("Error: " in line or "Exception: " in line) and EXCEPTION.search(line.strip()):
            last_exc = Finding("exception", _rel(path, root), no, line.strip()[:300])
        k_time, k_tok = low.find("time"), low.find("tok")
        if k_time < 0 and k_tok < 0:
            continue
        for idx, (rx, what) in enumerate(STEP_TIME):
            if times.fmt is not None and idx != times.fmt:
                continue  # one format per file, so ranks are compared in the same unit
            # search a window around the keyword, not the whole line: a number-rich line made
            # the rate pattern try every digit (37 us a line, most of a long log's time)
            k = k_tok if what == "rate" else k_time
            if k < 0:
                continue
            t = rx.search(line[max(0, k - 48):k + 48])
            if t:
                times.fmt = idx
                v = float(t.group(1).replace(",", ""))
                if what == "rate":
                    v = 1.0 / v if v > 0 else math.inf
                elif (t.group(2) or "s").lower() == "ms":
                    v /= 1000.0
                times.add(no, v, line.strip()[:300])
                break
    out = list(first.values())
    # A non-finite loss line or two is noise the spike detector also reports; a storm is news.
    out = [f for f in out if f.kind != "nonfinite" or f.count >= NONFINITE_RUN or "non-finite for" in f.evidence]
    if last_exc is not None:
        out.append(last_exc)
    return out, times


def _line_texts(path: Path, numbers: set[int]) -> dict[int, str]:
    """The text of a few lines of a file (the evidence), by a second streaming pass."""
    out: dict[int, str] = {}
    if numbers:
        for no, raw in enumerate(stream_lines(path, LOG_CAP, "log file"), 1):
            if no in numbers:
                out[no] = raw.strip()[:300]
    return out


def scan_metrics_file(path: Path, root: Path, spike_cfg: cfgmod.SpikeConfig) -> list[Finding]:
    # Only the keys the checks read, and line numbers instead of line texts: a long run's
    # metrics.jsonl is kept as a few small numbers per step (the evidence is read back at the end).
    records, line_of = [], {}
    # stream_lines: see scan_log
    for no, raw in enumerate(stream_lines(path, LOG_CAP, "metrics log"), 1):
        try:
            rec = json.loads(raw)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            continue
        kept = {k: rec[k] for k in ("loss", "grad_norm", "skipped") if k in rec} | {"step": step}
        collapsed = _collapsed_layers(rec)
        if collapsed is not None:  # an MoE step: the layers whose load looks collapsed
            kept["collapsed"] = collapsed
        records.append(kept)
        line_of[step] = no

    def line_at(step: int) -> tuple[int, str]:  # at most three calls, only when something was found
        no = line_of[step]
        return no, _line_texts(path, {no}).get(no, "")

    rel = _rel(path, root)
    out: list[Finding] = []
    events = scan_metrics(records, spike_cfg)
    for kind in ("loss_spike", "grad_norm"):
        ev = [e for e in events if e["kind"] == kind]
        if ev:
            no, text = line_at(ev[0]["step"])
            steps = ", ".join(str(e["step"]) for e in ev[:8]) + (" …" if len(ev) > 8 else "")
            out.append(Finding(kind, rel, no, f"{ev[0]['message']} (steps {steps})", count=len(ev)))
    # Runs of non-finite losses and of skipped (overflowed) steps.
    run_start, run_len, best = None, 0, (None, 0)
    prev_skipped, skip_start, skip_len, skip_best = None, None, 0, (None, 0)
    for rec in sorted(records, key=lambda r: r["step"]):
        loss = rec.get("loss")
        if isinstance(loss, (int, float)):
            if not math.isfinite(loss):
                run_start = run_start if run_len else rec["step"]
                run_len += 1
                best = max(best, (run_start, run_len), key=lambda x: x[1])
            else:
                run_len = 0
        sk = rec.get("skipped")
        if isinstance(sk, (int, float)):
            if prev_skipped is not None and sk > prev_skipped:
                skip_start = skip_start if skip_len else rec["step"]
                skip_len += 1
                skip_best = max(skip_best, (skip_start, skip_len), key=lambda x: x[1])
            elif prev_skipped is not None:
                skip_len = 0
            prev_skipped = sk
    if best[1] >= NONFINITE_RUN:
        no, text = line_at(best[0])
        out.append(Finding("nonfinite", rel, no, f"{best[1]} non-finite losses in a row from step {best[0]}: {text}", count=best[1]))
    if skip_best[1] >= OVERFLOW_RUN:
        no, text = line_at(skip_best[0])
        out.append(Finding("overflow", rel, no, f"{skip_best[1]} skipped steps in a row from step {skip_best[0]}: {text}", count=skip_best[1]))
    collapse = _longest_collapse([r for r in records if "collapsed" in r])
    if collapse is not None:
        layer, start, length, share = collapse
        no, _ = line_at(start)
        out.append(Finding("router_collapse", rel, no,
                           f"MoE layer {layer}: its busiest expert was chosen by {share:.0%} of the tokens for {length} logged "
                           f"steps in a row from step {start} (moe/layer_{layer}/top_share >= {COLLAPSE_SHARE:g}, "
                           f"max_over_mean >= {COLLAPSE_RATIO:g})", count=length))
    return out


def _collapsed_layers(rec: dict) -> tuple[tuple[int, float], ...] | None:
    """(layer, top share) of each MoE layer of one metrics record that looks collapsed; None when
    the record has no expert-load metrics (a dense model's, or a step not logged)."""
    found, moe = [], False
    for key, share in rec.items():
        m = _SHARE.match(key)
        if m is None:
            continue
        moe = True
        ratio = rec.get(f"moe/layer_{m.group(1)}/max_over_mean")
        if (isinstance(share, (int, float)) and isinstance(ratio, (int, float))
                and share >= COLLAPSE_SHARE and ratio >= COLLAPSE_RATIO):
            found.append((int(m.group(1)), float(share)))
    return tuple(found) if moe else None


def _longest_collapse(records: list[dict]) -> tuple[int, int, int, float] | None:
    """(layer, first step, logged steps, last share) of the longest run of collapsed logged steps
    of one layer, when it reaches COLLAPSE_RUN; runs are over the records that carry the metrics."""
    runs: dict[int, tuple[int, int]] = {}  # layer -> (start step, length) of its current run
    best: tuple[int, int, int, float] | None = None
    for rec in sorted(records, key=lambda r: r["step"]):
        now = dict(rec["collapsed"])
        runs = {layer: (runs[layer][0], runs[layer][1] + 1) if layer in runs else (rec["step"], 1) for layer in now}
        for layer, (start, length) in runs.items():
            if length >= COLLAPSE_RUN and (best is None or length > best[2]):
                best = (layer, start, length, now[layer])
    return best


def find_stragglers(times_by_file: dict[str, StepTimes]) -> list[Finding]:
    """Ranks (worker_N logs) whose median step time is > STRAGGLER_FACTOR x the median over ranks."""
    groups: dict[int, dict[str, tuple[float, StepTimes]]] = {}
    for name, samples in times_by_file.items():
        if re.search(r"worker_\d+", name) and len(samples) >= 2:
            # Skip the first sample: it includes graph compilation.
            # numpy's median over the array's buffer: no Python float per sample
            groups.setdefault(samples.fmt, {})[name] = (float(np.median(np.frombuffer(samples.values, dtype=np.float64)[1:])), samples)
    out = []
    for ranks in groups.values():
        out += _stragglers_in(ranks)
    return out


def _stragglers_in(ranks: dict[str, tuple[float, StepTimes]]) -> list[Finding]:
    if len(ranks) < 2:
        return []
    out = []
    for name, (med, samples) in sorted(ranks.items()):
        # Against the median of the *other* ranks, so two ranks are enough to name a straggler.
        overall = statistics.median(m for n, (m, _) in ranks.items() if n != name)
        if overall > 0 and med > STRAGGLER_FACTOR * overall:
            no, text = samples.examples[1]
            rank = re.search(r"worker_(\d+)", name).group(1)
            unit = "s/step" if samples.fmt < 2 else "s per token (1 / tok/s)"
            out.append(Finding("straggler", name, no, f"rank {rank} is {med / overall:.1f}x slower than the other ranks "
                                                    f"({med:.3g} vs {overall:.3g} {unit}); e.g. {text}", count=len(samples)))
    return out


def diagnose(target: Path) -> list[Finding]:
    target = Path(target)
    if not target.exists():
        raise UserError(f"{target} does not exist", "pass a run dir (with train.log / metrics.jsonl / worker logs) or one log file")
    root = target if target.is_dir() else target.parent
    spike_cfg = cfgmod.SpikeConfig()
    if target.is_dir() and (target / "config.toml").is_file():
        try:
            spike_cfg = cfgmod.load(target / "config.toml").spike
        except UserError:
            pass
    if target.is_dir():
        logs = sorted(p for p in target.rglob("*.log") if "profile" not in p.relative_to(target).parts)
        metrics = [p for p in [target / "metrics.jsonl"] if p.is_file()]
        if not logs and not metrics:
            raise UserError(f"{target} has no *.log files and no metrics.jsonl", "pass the --run dir of a training run or msrun's --log_dir")
    else:
        logs, metrics = ([], [target]) if target.suffix == ".jsonl" else ([target], [])
    findings: list[Finding] = []
    times: dict[str, StepTimes] = {}
    for p in logs:
        found, t = scan_log(p, root)
        findings += found
        times[_rel(p, root)] = t
    for p in metrics:
        findings += scan_metrics_file(p, root, spike_cfg)
    findings += find_stragglers(times)
    order = list(ADVICE)
    findings.sort(key=lambda f: (order.index(f.kind), f.file, f.line))
    for f in findings:
        f.advice = ADVICE[f.kind]
        if f.kind == "oom" and metrics:
            f.advice += _device_memory_note(metrics[0])
    return findings


def _device_memory_note(metrics_path: Path) -> str:
    """The run's last device-memory figures (monitor/memory.py, Ascend only), for the OOM advice."""
    last: dict = {}
    # stream_lines: see scan_log
    for raw in stream_lines(metrics_path, LOG_CAP, "metrics log"):
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and "device_mem_mb" in rec:
            last = rec
    if not last:
        return ""
    reserved = last.get("device_mem_reserved_mb")
    return (f"; last logged device memory (step {last.get('step')}): peak allocated {last['device_mem_mb'] / 1024:.1f} GB"
            + (f", peak reserved {reserved / 1024:.1f} GB" if isinstance(reserved, (int, float)) else "")
            + " — compare with `mspretrain plan`'s estimate and the device's capacity")


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "no problems found (checked: OOM, killed, disk full, comm timeouts, non-finite storms, spikes, router collapse, stragglers)"
    lines = []
    for f in findings:
        lines.append(f"[{f.kind}] {f.where()}" + (f"  ({f.count} lines)" if f.count > 1 else ""))
        lines.append(f"    evidence: {f.evidence}")
        lines.append(f"    advice:   {f.advice}")
    return "\n".join(lines)


def as_json(findings: list[Finding]) -> str:
    return json.dumps([asdict(f) for f in findings], ensure_ascii=False, indent=1)


# ---------------------------------------------------------------- diagnose RUN --hang

def hang_report(run_dir: Path, *, stale_s: float = STALE_S, now: float | None = None, probe=process_state) -> tuple[str, bool]:
    """`diagnose RUN --hang`: the text, and whether a rank lags."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory", "pass the --run dir of a training run")
    from mspretrain.monitor.heartbeat import read_heartbeats

    states = rank_states(run_dir, now=now, stale_s=stale_s, probe=probe)
    if not states:
        raise UserError(f"{run_dir} has no heartbeats (heartbeat/rank_*.json)",
                        "pass the --run dir of a run trained by this mspretrain version; every rank writes its heartbeat there")
    top = max(r.step for r in states)
    lines = [f"{len(states)} rank(s) in {run_dir}: newest step {top}"]
    from mspretrain.launcher.watchdog import read_verdict

    verdict = read_verdict(run_dir)
    raw = read_heartbeats(run_dir)
    if verdict is not None and float(verdict.get("time", 0)) >= max(float(b.get("started", 0)) for b in raw):
        # `launch` ended this job: after the kill every process is gone, so its verdict (taken
        # while they ran) is what tells the rank that stopped from the ranks ended with it
        lines.append(f"LAGGING: {verdict.get('message')}")
        lines.append("         the launch watchdog ended the job then; the other ranks were ended with it:")
        for r in states:
            if r.rank != verdict.get("rank"):
                lines.append(f"         rank {r.rank}: step {r.step}, phase {r.phase}; last heartbeat {r.age_s:.0f} s ago")
        return "\n".join(lines), True
    bad = lagging(states)
    if not bad:
        if all(r.status == "done" for r in states):
            lines.append(f"all ranks finished at step {top}")
        else:
            phases = sorted({r.phase for r in states})
            lines.append(f"all ranks agree: step {top}, phase {'/'.join(phases)}, heartbeats at most "
                         f"{max(r.age_s for r in states):.0f} s old")
            if all(r.age_s > stale_s for r in states):
                lines.append(f"note: every heartbeat is older than {stale_s:.0f} s: the job is not running now "
                             "(ended without writing 'done', or the whole job is frozen)")
        return "\n".join(lines), False
    for r in sorted(bad, key=lambda r: ("dead", "failed", "stopped", "stale", "stuck", "behind").index(r.status)):
        lines.append("LAGGING: " + describe(r))
    for r in states:
        if r not in bad:
            wait = " (waiting for the lagging rank in a collective)" if r.phase == "step" and r.step >= top else ""
            lines.append(f"         rank {r.rank}: step {r.step}, phase {r.phase} for {r.phase_s:.0f} s{wait}; heartbeat {r.age_s:.0f} s old")
    return "\n".join(lines), True
