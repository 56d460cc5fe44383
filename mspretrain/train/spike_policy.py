"""What the loop does about a step's loss and grad norm: warn, count, ask for a rewind or a stop.

The detection itself is `monitor/spikes.SpikeDetector` (shared with report and diagnose); this is
the policy on top: every finding is logged as a warning, a loss spike marks the step's metrics
(`spike`) and, with `spike.action = "rewind"`, asks the loop to rewind (PaLM's remedy: reload the
last good checkpoint and skip past the batches that led there); `spike.max_nonfinite` non-finite
losses in a row ask it to stop, since more steps would only burn compute.
"""
from __future__ import annotations

from typing import Callable

from mspretrain.config.schema import SpikeConfig
from mspretrain.monitor.spikes import SpikeDetector

CONTINUE, REWIND, STOP = "continue", "rewind", "stop"
MAX_REWINDS = 3  # a run that keeps spiking after 3 rewinds needs a person, not a 4th reload


class SpikePolicy:
    def __init__(self, cfg: SpikeConfig, *, warmup_steps: int, log: Callable[[str], None]) -> None:
        self.cfg, self.log = cfg, log
        self.detector = SpikeDetector(cfg)
        self.detector.warmup_steps = warmup_steps
        self.loss_spikes = 0  # this session's, for the closing line

    def observe(self, step: int, loss: float, grad_norm: float, values: dict[str, float]) -> str:
        """Check one step; marks `values` and returns CONTINUE, REWIND or STOP."""
        findings = self.detector.check(step, loss, grad_norm)
        for f in findings:
            self.log(f"warning: {f['message']}")
        if any(f["kind"] == "loss_spike" for f in findings):
            self.loss_spikes += 1
            values["spike"] = 1.0
            if self.cfg.action == "rewind":
                return REWIND  # a spike is a finite loss: the non-finite streak is 0
        if self.detector.nonfinite_streak >= self.cfg.max_nonfinite:
            return STOP
        return CONTINUE
