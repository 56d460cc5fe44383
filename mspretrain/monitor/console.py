"""What a run says while it trains: the run log (stdout of rank 0 and RUN_DIR/train.log) and the
per-step console line.

Design choices:
- One log function for the whole run: every component is given it, so a message goes to the
  screen and to train.log (with a time stamp) the same way. Before the run dir exists (the first
  checks of `train`) the text is only printed; ranks other than 0 print nothing.
- The console line is a pure function of the step's values, the start time and the budget, so
  tests can compare it with the documented sessions.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

from mspretrain.monitor.callback import Callback, DataState, Values


class RunLog:
    """Call with a line of text: rank 0 prints it and appends it to train.log once the run dir exists."""

    def __init__(self, path: Path, echo: Callable[[str], None] = print, *, is_main: bool = True) -> None:
        self.path = Path(path)
        self.echo = echo
        self.is_main = is_main  # set once the world is known: before that every process speaks
        self._held: list[str] | None = None

    def hold(self) -> None:
        """Keep lines off train.log (still echoed) until `release()`: a command that may still be
        refused must leave the run dir as it was, its log included."""
        self._held = []

    def release(self) -> None:
        """Append the held lines to train.log; later lines go straight there again."""
        held, self._held = self._held or [], None
        if held and self.path.parent.is_dir():
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(held)

    def __call__(self, text: str) -> None:
        if not self.is_main:
            return
        self.echo(text)
        line = time.strftime("%Y-%m-%d %H:%M:%S ") + text + "\n"
        if self._held is not None:
            self._held.append(line)
        elif self.path.parent.is_dir():
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)


class ConsoleLine(Callback):
    """`step N/T | loss | lr | gnorm [| scale] [| tok/s | mfu] [| eta]` every log_every steps,
    at the first step of a session and at the last step of the run; a train loop callback. The
    ranks other than 0 (`rank`), whose log is silent, print their own step time at those steps
    instead, to their msrun worker log, for straggler diagnosis."""

    def __init__(self, log: Callable[[str], None], *, total: int, log_every: int, show_scale: bool, rank: int = 0) -> None:
        self.log, self.total, self.log_every, self.show_scale, self.rank = log, total, log_every, show_scale, rank
        self.start, self._t0 = 0, time.perf_counter()
        self._t_step = self._t0

    # the loop's hooks (monitor/callback.py)
    def pre_train(self, start: int) -> None:
        self.begin(start)

    def pre_load_batch(self, step: int) -> None:
        self._t_step = time.perf_counter()

    def post_step(self, step: int, data_state: DataState, values: Values) -> None:
        if self.due(step):
            self(step, values)
            if self.rank != 0:
                print(f"rank={self.rank} step={step} step_time={(time.perf_counter() - self._t_step):.3f}s", flush=True)

    def begin(self, start: int) -> None:
        """The session starts after step `start` (0, or the step resumed from)."""
        self.start, self._t0 = start, time.perf_counter()

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.start + 1 or step == self.total

    def __call__(self, step: int, v: dict[str, float]) -> None:
        done = step - self.start
        eta = (time.perf_counter() - self._t0) / max(done, 1) * (self.total - step)
        parts = [f"step {step}/{self.total}", f"loss {v['loss']:.4f}", f"lr {v['lr']:.2e}", f"gnorm {v['grad_norm']:.3f}"]
        if self.show_scale:
            parts.append(f"scale {v['loss_scale']:g}")
        if "tokens_per_s" in v:
            parts += [f"{v['tokens_per_s']:,.0f} tok/s", f"mfu {100 * v['mfu']:.1f}%"]
        if done > 1:  # the first step includes graph compilation: no ETA from it
            parts.append(f"eta {fmt_time(eta)}")
        self.log(" | ".join(parts))


def fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
