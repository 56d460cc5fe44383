"""Learning-rate schedules as pure functions of the optimizer step.

Design choices: the schedule is computed on the host from the number of *applied* optimizer
updates and fed to the compiled step as a scalar tensor, so an overflowed (skipped) fp16 step
does not advance it and resume needs only that one integer. Closed forms, no state. The run's
schedule (its steps and capped auto warm-up) is resolved in `mspretrain/budget.py`.

Kinds:
- `cosine`: linear warm-up to lr, cosine decay to min_lr_ratio * lr at the last step.
- `two_phase` (the field report): linear warm-up to lr, then a cosine rise to peak_ratio * lr
  over another warm-up length, then cosine decay to min_lr.
- `wsd`: warm-up, stable at lr, linear decay to min_lr over the last decay_fraction of steps.
- `constant`: warm-up then flat.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def auto_warmup_steps(tokens: int, step_tokens: int) -> int:
    """The field report's rule: warm up over 2 % of one pass over the data (`tokens`), in steps of
    `step_tokens` (`budget.tokens_per_step`)."""
    return max(1, math.ceil(0.02 * tokens / step_tokens))


def scaled_lr(lr: float, global_batch: int, scaling: str) -> float:
    """`sqrt` scaling relative to a reference global batch of 32 sequences."""
    return lr * math.sqrt(global_batch / 32) if scaling == "sqrt" else lr


@dataclass(frozen=True)
class Schedule:
    kind: str
    lr: float
    warmup: int
    total: int
    min_lr: float
    decay_fraction: float = 0.2
    peak_ratio: float = 1.2

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer update number `step` (0-based)."""
        if self.warmup and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.kind == "constant":
            return self.lr
        if self.kind == "wsd":
            decay = max(1, int(round(self.total * self.decay_fraction)))
            start = self.total - decay
            if step < start:
                return self.lr
            frac = min(1.0, (step - start + 1) / decay)
            return self.lr + (self.min_lr - self.lr) * frac
        if self.kind == "two_phase":
            peak = self.lr * self.peak_ratio
            rise_end = min(self.total, 2 * self.warmup)
            if step < rise_end:
                frac = (step - self.warmup + 1) / max(1, rise_end - self.warmup)
                return self.lr + (peak - self.lr) * 0.5 * (1 - math.cos(math.pi * frac))
            return _cosine(step - rise_end, self.total - rise_end, peak, self.min_lr)
        return _cosine(step - self.warmup, self.total - self.warmup, self.lr, self.min_lr)

    def describe(self) -> str:
        return (f"{self.kind}: warm-up {self.warmup} steps to lr {self.lr:.3g}"
                + (f", peak {self.lr * self.peak_ratio:.3g}" if self.kind == "two_phase" else "")
                + f", {self.total} steps in all, min lr {self.min_lr:.3g}")


def _cosine(i: int, n: int, hi: float, lo: float) -> float:
    if n <= 1:
        return lo if i >= 0 else hi
    frac = min(1.0, max(0.0, i / (n - 1)))
    return lo + (hi - lo) * 0.5 * (1 + math.cos(math.pi * frac))


def continuation_overrides(lr: float, lr_scaling: str = "none") -> str:
    """Overrides that continue a run at learning rate `lr` (a constant tail): no warm-up, no jump.

    `repr` prints the shortest decimal that reads back as the same float, so the tail starts at
    exactly the learning rate the run was at."""
    return (f"schedule.kind=constant schedule.warmup_steps=0 optim.lr={lr!r}"
            + (" optim.lr_scaling=none" if lr_scaling != "none" else ""))


def resume_notes(old: dict | None, new: Schedule, position: int, lr_scaling: str = "none") -> list[str]:
    """What a resume changes in the schedule, for the log: both shapes, and the learning rate of the
    next update under each. Empty when nothing changes.

    `old` is the checkpoint's train_state["schedule"] ({kind, warmup, total, lr}, lr being the
    rate of update `position`); raising train.max_steps re-stretches a cosine, so a finished run's
    lr jumps from its floor back up: the notes say so and print the continuous alternative."""
    if not old or not {"kind", "warmup", "total", "lr"} <= set(old):
        return []
    lr_old, lr_new = float(old["lr"]), new(position)
    same_lr = math.isclose(lr_old, lr_new, rel_tol=1e-9, abs_tol=0.0)
    if (old["kind"], int(old["warmup"]), int(old["total"])) == (new.kind, new.warmup, new.total) and same_lr:
        return []
    notes = [f"schedule changes on resume: was {old['kind']} with warm-up {old['warmup']}, {old['total']} steps in all; "
             f"now {new.describe()}"]
    if same_lr:
        notes.append(f"the learning rate stays continuous: {lr_old:.3g} at update {position + 1}")
    else:
        ratio = lr_new / lr_old if lr_old else float("inf")
        notes.append(f"the learning rate of update {position + 1} jumps from {lr_old:.3g} to {lr_new:.3g} (x{ratio:.2f}): "
                     "this is a new schedule, not a plain continuation")
        notes.append(f"to continue at {lr_old:.3g} instead (a constant tail), add: {continuation_overrides(lr_old, lr_scaling)}")
    return notes
