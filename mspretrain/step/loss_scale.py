"""Loss scaling for fp16: dynamic (with the field report's optional linear warm-up), static, or none.

Design choices: *whether* a step overflowed is decided inside the compiled graph (the
optimizer update is skipped there, no Python `if` on a device tensor); this class only keeps
the host-side bookkeeping of the scale for the *next* step, from the one boolean the step
returns anyway. Its whole state is a few numbers, saved in `train_state.json`.

Rules: the scale is fixed across the micro-batches of one accumulation window; on overflow
it backs off ×0.5 (not below min_scale); after `growth_interval` finite steps in a row it
grows ×2 (not above max_scale). With a warm-up (`scale_warmup_to` over `scale_warmup_steps`)
the scale follows the straight line from init_scale while no overflow has happened; the first
overflow hands control to the dynamic rules.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mspretrain.config.schema import PrecisionConfig


@dataclass
class LossScaler:
    mode: str  # "dynamic" | "static" | "none"
    scale: float
    init_scale: float
    growth_interval: int
    min_scale: float
    max_scale: float
    warmup_to: float = 0.0
    warmup_steps: int = 0
    steps: int = 0  # steps seen (finite or not)
    good_steps: int = 0  # finite steps since the last change of scale
    overflows: int = 0
    warming: bool = False

    @classmethod
    def from_config(cls, p: PrecisionConfig) -> "LossScaler":
        mode = p.loss_scale
        if mode == "auto":
            mode = "dynamic" if p.dtype == "fp16" else "none"
        scale = p.init_scale if mode != "none" else 1.0
        warming = mode == "dynamic" and p.scale_warmup_to > 0 and p.scale_warmup_steps > 0
        return cls(mode=mode, scale=scale, init_scale=scale, growth_interval=p.growth_interval,
                   min_scale=p.min_scale, max_scale=p.max_scale, warmup_to=p.scale_warmup_to,
                   warmup_steps=p.scale_warmup_steps, warming=warming)

    def update(self, finite: bool) -> None:
        """Account for one step that used `self.scale`; sets the scale for the next one."""
        self.steps += 1
        if self.mode != "dynamic":
            return
        if not finite:
            self.overflows += 1
            self.warming = False
            self.scale = max(self.min_scale, self.scale * 0.5)
            self.good_steps = 0
            return
        if self.warming:
            frac = min(1.0, self.steps / self.warmup_steps)
            self.scale = min(self.max_scale, self.init_scale + (self.warmup_to - self.init_scale) * frac)
            if self.steps >= self.warmup_steps:
                self.warming = False
                self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.max_scale, self.scale * 2.0)
            self.good_steps = 0

    def state(self) -> dict[str, Any]:
        return asdict(self)

    def load_state(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)
