"""Loss-spike, grad-norm and non-finite detection, live (trainer) and offline (report, diagnose).

Design choices:
- A loss spike is an *absolute* rise above the rolling mean of the last `window` finite losses
  (the field report's bar: no jump above 0.3 in a smooth curve). Absolute, not relative, because
  the report's bar is in nats and a relative bar would tighten as the loss falls.
- A grad-norm spike is a value above `grad_norm_factor` x the rolling median: the median ignores
  the few large norms of early training that would inflate a mean.
- Every finite value enters the window, spikes included, so a genuine level shift is flagged
  once and then becomes the new normal instead of firing on every step.
- Nothing is flagged until `min(window, 10)` values are in the window, and no spike is flagged
  at or before `warmup_steps`, where the loss falls fast and the lr is still rising.
- Non-finite losses are always reported and counted in a row (`nonfinite_streak`) so the trainer
  can stop after `spike.max_nonfinite`.
- State is a few JSON lists and ints, carried in the checkpoint so a resumed run flags the same
  steps an uninterrupted one would.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from mspretrain.config.schema import SpikeConfig


class SpikeDetector:
    def __init__(self, cfg: SpikeConfig) -> None:
        self.cfg = cfg
        self.warmup_steps = 0
        self.nonfinite_streak = 0
        self._losses: deque[float] = deque(maxlen=cfg.window)
        self._grad_norms: deque[float] = deque(maxlen=cfg.window)

    @property
    def min_history(self) -> int:
        return min(self.cfg.window, 10)

    def check(self, step: int, loss: float | None, grad_norm: float | None = None) -> list[dict[str, Any]]:
        """Structured findings for one step; updates the rolling windows."""
        found: list[dict[str, Any]] = []
        if loss is not None:
            loss = float(loss)
            if not math.isfinite(loss):
                self.nonfinite_streak += 1
                found.append({"step": step, "kind": "nonfinite", "value": loss, "reference": None,
                              "message": f"step {step}: non-finite loss ({loss}), {self.nonfinite_streak} in a row"})
            else:
                self.nonfinite_streak = 0
                if len(self._losses) >= self.min_history and step > self.warmup_steps:
                    mean = sum(self._losses) / len(self._losses)
                    if loss - mean > self.cfg.threshold:
                        found.append({"step": step, "kind": "loss_spike", "value": loss, "reference": mean,
                                      "message": f"step {step}: loss spike {loss:.4f} is {loss - mean:.3f} above the "
                                                 f"rolling mean {mean:.4f} (threshold {self.cfg.threshold})"})
                self._losses.append(loss)
        if grad_norm is not None:
            g = float(grad_norm)
            if math.isfinite(g):
                if len(self._grad_norms) >= self.min_history and step > self.warmup_steps:
                    median = statistics.median(self._grad_norms)
                    if median > 0 and g > self.cfg.grad_norm_factor * median:
                        found.append({"step": step, "kind": "grad_norm", "value": g, "reference": median,
                                      "message": f"step {step}: grad norm {g:.4g} is {g / median:.1f}x the rolling "
                                                 f"median {median:.4g} (factor {self.cfg.grad_norm_factor})"})
                self._grad_norms.append(g)
        return found

    def update(self, step: int, loss: float, grad_norm: float | None = None) -> list[str]:
        """Event messages for this step (empty when nothing is wrong)."""
        return [f["message"] for f in self.check(step, loss, grad_norm)]

    def state(self) -> dict[str, Any]:
        return {"losses": list(self._losses), "grad_norms": list(self._grad_norms),
                "nonfinite_streak": self.nonfinite_streak, "warmup_steps": self.warmup_steps}

    def load_state(self, state: dict[str, Any]) -> None:
        self._losses = deque((float(x) for x in state.get("losses", [])), maxlen=self.cfg.window)
        self._grad_norms = deque((float(x) for x in state.get("grad_norms", [])), maxlen=self.cfg.window)
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))


def scan_metrics(records: list[dict], cfg: SpikeConfig, warmup: int = 0) -> list[dict]:
    """Replay a metrics series through a fresh detector: every loss spike, grad-norm spike and
    non-finite loss, as dicts {step, kind, value, reference, message}, in step order."""
    det = SpikeDetector(cfg)
    det.warmup_steps = warmup
    found: list[dict] = []
    for rec in sorted((r for r in records if "step" in r), key=lambda r: r["step"]):
        loss, gn = rec.get("loss"), rec.get("grad_norm")
        if loss is None and gn is None:
            continue
        found.extend(det.check(int(rec["step"]), loss, gn))
    return found
