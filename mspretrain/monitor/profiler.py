"""Profile a range of training steps with the MindSpore profiler and print the top operators.

Design choices:
- `profile.steps = "10-20"` (inclusive) or `"15"`: the profiler is created with
  `start_profile=False` and started at the beginning of the first step and stopped at the end of
  the last, so compilation of the first steps stays out of the trace. `mindspore.profiler.profile`
  (2.10's API; `mindspore.Profiler` is deprecated) with `tensorboard_trace_handler`, which analyses
  when the profiler stops, writes under `RUN_DIR/profile/`: a Chrome trace
  (`trace_view.json`, open in chrome://tracing or Perfetto) and per-operator CSVs.
- The top-operator table is read back from those CSVs: `cpu_op_type_info_*.csv` on CPU,
  `op_statistic*.csv` (CANN's "OP Type" / "Total Time(us)") on Ascend. Reading files keeps us
  independent of profiler-internal Python APIs that change between MindSpore versions.
- `analyse()` takes seconds and runs once, after the last profiled step. Steps outside the range
  cost nothing; an empty `steps` makes every call a no-op.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable

from mspretrain.monitor.callback import Callback, Values


def parse_steps(text: str) -> tuple[int, int] | None:
    """"10-20" -> (10, 20); "15" -> (15, 15); "" -> None (the config's own check, `config/sections/observe.parse_step_range`)."""
    from mspretrain.config.sections.observe import parse_step_range

    return parse_step_range(text)


def top_operators(profile_dir: Path, n: int = 10) -> list[dict[str, Any]]:
    """Operator types by total time (ms), largest first, from the profiler's per-op CSVs."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for path in sorted(Path(profile_dir).rglob("*.csv")):
        name = path.name
        if name.startswith("cpu_op_type_info"):
            op_key, time_key, scale, count_key = "op_type", "total_compute_time", 1.0, "type_occurrences"
        elif name.startswith("op_statistic"):
            op_key, time_key, scale, count_key = "OP Type", "Total Time(us)", 1e-3, "Count"
        else:
            continue
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            for row in csv.DictReader(f):
                try:
                    op, t = row[op_key].strip(), float(row[time_key]) * scale
                except (KeyError, ValueError, AttributeError):
                    continue
                totals[op] = totals.get(op, 0.0) + t
                counts[op] = counts.get(op, 0) + int(float(row.get(count_key) or 0))
    grand = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return [{"op": op, "total_ms": t, "calls": counts[op], "share": t / grand} for op, t in ranked]


def format_top(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'operator':<28}{'total ms':>12}{'calls':>9}{'share':>8}"]
    lines += [f"{r['op'][:27]:<28}{r['total_ms']:>12.3f}{r['calls']:>9}{100 * r['share']:>7.1f}%" for r in rows]
    return "\n".join(lines)


class StepProfiler(Callback):
    def __init__(self, run_dir: Path, steps: str, log: Callable[[str], None] = print) -> None:
        self.range = parse_steps(steps)
        self.out_dir = Path(run_dir) / "profile"
        self.log = log
        self._prof: Any = None
        self.rows: list[dict[str, Any]] = []

    @property
    def active(self) -> bool:
        return self._prof is not None

    # the loop's hooks (monitor/callback.py)
    def pre_load_batch(self, step: int) -> None:
        self.step_begin(step)

    def post_train_batch(self, step: int, values: Values) -> None:
        self.step_end(step)

    def step_begin(self, step: int) -> None:
        if self.range is None or self._prof is not None or step != self.range[0]:
            return

        self.out_dir.mkdir(parents=True, exist_ok=True)
        # mindspore.profiler.profile: 2.10's profiler (mindspore.Profiler "will be deprecated",
        # profiler/profiler.py); without a schedule it records from start() to stop(), and the
        # handler analyses on stop into `out_dir` (tensorboard_trace_handler, profiler.py).
        from mindspore.profiler import profile, tensorboard_trace_handler

        self._prof = profile(start_profile=False, on_trace_ready=tensorboard_trace_handler(dir_name=str(self.out_dir)))
        self._prof.start()
        self.log(f"profiler: recording steps {self.range[0]}-{self.range[1]} into {self.out_dir}")

    def step_end(self, step: int) -> None:
        if self._prof is not None and step >= self.range[1]:
            self._finish()

    def close(self) -> None:
        """Stop and analyse if the run ended inside the range."""
        if self._prof is not None:
            self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()  # analyses too (the on_trace_ready handler)
        # Each profiler session writes its own sub-directory; a resumed run may have older ones.
        sessions = sorted((d for d in self.out_dir.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
        self.rows = top_operators(sessions[-1]) if sessions else []
        if self.rows:
            self.log("profiler: top operators by time\n" + format_top(self.rows))
        else:
            self.log(f"profiler: no per-operator CSV found under {self.out_dir}")
        self.log(f"profiler: Chrome trace and CSVs under {self.out_dir} (open trace_view.json in chrome://tracing)")
