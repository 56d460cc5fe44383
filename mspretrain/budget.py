"""The numbers a run derives from its config before any compute, in one place.

`train`, `plan`, `report`, `recover`, `spike` and the monitors all ask this module for: the
optimizer steps of the run, the warm-up (with the automatic rule's cap), the learning rate after
scaling, the micro-batch per rank and the accumulation steps, the tokens of one step (and of S
steps), and which rank and micro-batch hold each sample of a step. Nothing else multiplies
`global_batch` by `seq_len` or splits the batch (tests/preflight/test_budget.py scans the package for it):
each of them used to rebuild some of these, and `plan`/`report` missed the cap on the automatic
warm-up, so for a short budget they showed a warm-up the run did not use.

Design choices:
- Layer 1 (pure arithmetic): imports `config`, `errors` and `schedule` only, no MindSpore,
  no file reads. The data dir's measured train tokens are passed in by the caller.
- The budget of a run is `train.max_steps` or `train.max_tokens` in steps, whichever comes first.
  `plan` may ask "what if" with an explicit token budget (`tokens=`), and without any budget it
  falls back to one pass over the data dir: `Budget.steps` is None when there is none at all
  (memory can still be planned, steps and time cannot).
- Automatic warm-up: the field report's 2 % of one pass over the data, never more than a tenth of
  the run (a short run would otherwise spend itself warming up). Without a data dir `plan`
  stands in the budget's tokens for the data's and says so in `warmup_note`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mspretrain.config.schema import Config
from mspretrain.errors import UserError
from mspretrain.schedule import Schedule, auto_warmup_steps, scaled_lr


def tokens_per_step(cfg: Config) -> int:
    """Tokens one optimizer step consumes over all ranks and micro-batches."""
    return cfg.train.global_batch * cfg.data.seq_len


def tokens_after(cfg: Config, steps: int) -> int:
    """Tokens a run has consumed after `steps` optimizer steps (every step takes the same number)."""
    return steps * tokens_per_step(cfg)


def micro_batches(cfg: Config, world_size: int) -> tuple[int, int]:
    """(micro-batch per rank, accumulation steps) for a world size; errors name the fix."""
    t = cfg.train
    if t.global_batch % world_size:
        raise UserError(f"train.global_batch = {t.global_batch} is not divisible by {world_size} ranks",
                        "make global_batch a multiple of the number of devices")
    per_rank = t.global_batch // world_size
    mb = t.micro_batch or per_rank
    if per_rank % mb:
        raise UserError(
            f"train.global_batch = {t.global_batch} is not divisible by ranks ({world_size}) x micro_batch ({mb})",
            "make global_batch a multiple of world size x micro_batch")
    return mb, per_rank // mb


# Where each sample of a step's global batch goes. The loader deals the global order out one
# micro-batch at a time: each `next_batch` of every rank covers the next micro x world positions,
# of which rank r takes r, r + world, r + 2 world, ... (`data/loader.py`). So micro-batch m of a
# step holds positions [m x micro x world, (m + 1) x micro x world).

def step_samples(micro: int, accum: int, world: int) -> int:
    """Samples of one optimizer step (train.global_batch) from its split (the inverse of `micro_batches`)."""
    return micro * accum * world


def position_of_row(row: int, *, rank: int, micro: int, world: int) -> int:
    """Position in the step's global batch of row `row` of `rank`'s rows, counted in the order the
    step takes them (micro-batch after micro-batch: its micro-batch is row // micro)."""
    m, i = divmod(row, micro)
    return m * micro * world + rank + world * i


def row_of_position(position: int, *, micro: int, world: int) -> tuple[int, int]:
    """(rank, row) holding `position` of a step's global batch: the inverse of `position_of_row`."""
    m, q = divmod(position, micro * world)
    return q % world, m * micro + q // world


def total_steps(cfg: Config, tokens: int | None = None) -> int | None:
    """Optimizer steps of the run: ceil(tokens / step) for an explicit token budget, else
    train.max_steps or train.max_tokens in steps, whichever is first; None without any budget."""
    per_step = tokens_per_step(cfg)
    if tokens:
        return math.ceil(tokens / per_step)
    t = cfg.train
    candidates = [s for s in (t.max_steps, math.ceil(t.max_tokens / per_step) if t.max_tokens else 0) if s]
    return min(candidates) if candidates else None


def warmup_steps(cfg: Config, total: int, data_tokens: int | None) -> int:
    """The warm-up the schedule uses: the configured steps, or auto (2 % of one pass, capped at a tenth)."""
    s = cfg.schedule
    if s.warmup_steps == "auto":
        if not data_tokens:
            raise UserError('schedule.warmup_steps = "auto" needs the data dir\'s token count',
                            "pass --data, or set schedule.warmup_steps to an integer")
        warmup = auto_warmup_steps(data_tokens, tokens_per_step(cfg))
        return min(warmup, max(1, total // 10))  # auto never eats more than a tenth of a short run
    warmup = int(s.warmup_steps)
    if warmup >= total:
        raise UserError(f"schedule.warmup_steps = {warmup} is not shorter than the run ({total} steps)",
                        "lower schedule.warmup_steps or raise train.max_steps")
    return warmup


def build_schedule(cfg: Config, data_tokens: int | None, total: int | None = None) -> Schedule:
    """The run's learning-rate schedule (auto warm-up needs the data dir's measured tokens)."""
    total = total or total_steps(cfg)
    if not total:
        raise UserError("the run has no budget", "set train.max_steps or train.max_tokens")
    lr = scaled_lr(cfg.optim.lr, cfg.train.global_batch, cfg.optim.lr_scaling)
    s = cfg.schedule
    return Schedule(kind=s.kind, lr=lr, warmup=warmup_steps(cfg, total, data_tokens), total=total,
                    min_lr=lr * s.min_lr_ratio, decay_fraction=s.decay_fraction, peak_ratio=s.peak_ratio)


@dataclass(frozen=True)
class Budget:
    """What one config means for a world size: steps, warm-up, lr, the batch split."""

    steps: int | None  # None: no budget anywhere (plan shows memory only)
    tokens: int  # the token budget the steps come from (0 without one)
    tokens_source: str  # "--tokens", "config", "data dir" or "none"
    warmup: int | None
    warmup_note: str
    lr: float
    lr_note: str
    micro_batch: int
    accumulation: int
    world: int
    tokens_per_step: int
    schedule: Schedule | None


def derive(cfg: Config, *, world: int = 1, data_tokens: int | None = None, tokens: int | None = None) -> Budget:
    """The budget of `cfg` on `world` ranks.

    data_tokens: the data dir's measured train tokens (auto warm-up; the budget of last resort).
    tokens: an explicit token budget ("what if", `plan --tokens`), before the config's own."""
    micro, accum = micro_batches(cfg, world)
    per_step = tokens_per_step(cfg)
    steps = total_steps(cfg, tokens)
    source = "--tokens" if tokens else "config"
    if steps is None and data_tokens:  # no budget set: one pass over the data
        steps, source = total_steps(cfg, data_tokens), "data dir"
    t = cfg.train
    if tokens or source == "data dir":
        budget_tokens = tokens or data_tokens or 0
    else:  # the config's: max_tokens, or max_steps in tokens, whichever is first
        budget_tokens = min([x for x in (t.max_tokens, t.max_steps * per_step) if x] or [0])
    lr = scaled_lr(cfg.optim.lr, cfg.train.global_batch, cfg.optim.lr_scaling)
    lr_note = f"{cfg.optim.lr:g} x sqrt({cfg.train.global_batch}/32)" if cfg.optim.lr_scaling == "sqrt" else "no scaling"
    warmup, note, schedule = None, "no budget", None
    if steps:
        basis = data_tokens or budget_tokens  # without a data dir (plan only) the budget stands in for one pass
        schedule = build_schedule(cfg, basis, total=steps)
        warmup, note = schedule.warmup, "from schedule.warmup_steps"
        if cfg.schedule.warmup_steps == "auto":
            note = f"auto: ceil(0.02 x {basis:,} / ({cfg.train.global_batch} x {cfg.data.seq_len}))"
            if warmup < auto_warmup_steps(basis, per_step):
                note += f", capped at a tenth of the {steps:,} steps"
    return Budget(steps=steps, tokens=budget_tokens if steps else 0, tokens_source=source if steps else "none",
                  warmup=warmup, warmup_note=note, lr=lr, lr_note=lr_note, micro_batch=micro, accumulation=accum,
                  world=world, tokens_per_step=per_step, schedule=schedule)
