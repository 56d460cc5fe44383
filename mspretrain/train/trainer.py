"""The training loop: data → step → spike policy → observers → checkpoint → signals. No numerics, no building.

The loop is given its parts (`train/build.py: build_trainer` wires the real ones; tests and
`replay` wire their own), each typed by a Protocol of `train/parts.py`: the compiled step, the
loader, the loss scaler, the lr schedule, the checkpoints (`train/checkpointing.CheckpointManager`:
when to save, save/load of the full state) and the spike policy (`train/spike_policy.SpikePolicy`:
warn, rewind or stop on spikes and non-finite losses). It drives those.

Everything that only observes a step is a `monitor/callback.Callback`, given as `callbacks`, and
the loop calls each hook of every callback, in their order, at one place (the hooks and when they
run: monitor/callback.py). `build_trainer` gives, in this order: the heartbeat (monitor/heartbeat:
this rank's step and phase for `diagnose --hang` and launch's watchdog), the step meter
(monitor/meter: tokens/s, MFU, host share, memory), the profiler, the console line, the periodic
eval (train/eval_schedule: valid perplexity at its interval and at the end), the batch log, the
source ledger, the spike record, the caller's own callbacks, and last the metrics logger
(metrics.jsonl and TensorBoard, in `log_metrics`, after every callback has added its keys).
New per-step work is a callback, not an edit of the loop. Initial weights from another source:
`build_trainer(..., init_weights=f)` calls `f(model)` on a run that starts from step 0, after the
model is built and before the compiled step and its optimizer state are.

Exactness: the state that decides the next step is the weights, the AdamW moments and counter, the
loss-scale numbers, the loader's few integers, the spike detector's window and the step/applied
counters; all of it is in a checkpoint, so on CPU an interrupted and resumed run is bit-identical
to an uninterrupted one. SIGINT/SIGTERM finish the current step, write a checkpoint and return
normally; a second one stops at once. Only rank 0 writes files; all ranks agree on skips.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from mspretrain.checkpoint import store
from mspretrain.config.schema import Config
from mspretrain.errors import UserError
from mspretrain.monitor.callback import Callback
from mspretrain.paths import RunPaths
from mspretrain.train.parts import BatchSource, Checkpoints, CompiledStep, LossScale, LrSchedule, SpikeGuard, StepOutcome
from mspretrain.train.replicas import record_weights_hash
from mspretrain.train.spike_policy import MAX_REWINDS, REWIND, STOP
from mspretrain.world import World

if TYPE_CHECKING:
    from mindspore import nn


@dataclass
class Summary:
    run_dir: Path
    start_step: int
    step: int
    tokens_seen: int
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    skipped: int = 0
    stopped_by_signal: bool = False
    final_checkpoint: Path | None = None
    stall_s: list[float] = field(default_factory=list)
    loss_spikes: int = 0


class Trainer:
    def __init__(self, *, cfg: Config, run_dir: Path, data_dir: Path, world: World, model: nn.Cell | None,
                 step_fn: CompiledStep, loader: BatchSource, scaler: LossScale, schedule: LrSchedule,
                 checkpoints: Checkpoints, spikes: SpikeGuard, total_steps: int, accum_steps: int, tokens_per_step: int,
                 log: Callable[[str], None], banner: tuple[str, ...] = (), callbacks: Sequence[Callback] = ()) -> None:
        self.cfg, self.run_dir, self.data_dir, self.world = cfg, Path(run_dir), Path(data_dir), world
        self.model, self.step_fn, self.loader, self.scaler, self.schedule = model, step_fn, loader, scaler, schedule
        self.checkpoints, self.spikes = checkpoints, spikes
        self.total_steps, self.accum_steps, self.tokens_per_step = total_steps, accum_steps, tokens_per_step
        self.log, self.banner = log, tuple(banner)
        self.callbacks: list[Callback] = list(callbacks)
        self.step = self.applied = self.tokens_seen = self.skipped = self.rewinds = 0
        self._stop_signal: int | None = None

    # ----------------------------------------------------------------- state
    def train_state(self) -> dict[str, Any]:
        return {"step": self.step, "applied_steps": self.applied, "tokens_seen": self.tokens_seen,
                "skipped_steps": self.skipped, "loss_scale": self.scaler.state(), "spikes": self.spikes.detector.state(),
                "schedule": {"kind": self.schedule.kind, "position": self.applied, "warmup": self.schedule.warmup,
                             "total": self.schedule.total, "lr": self.schedule(self.applied)},
                "rng": {"seed": self.cfg.train.seed, "note": "no stochastic ops in training; init and data order derive from the seed"},
                "world_size": self.world.size}

    def load(self, ckpt: Path, *, restore_data: bool = True) -> None:
        """Restore the full state of a checkpoint into the live objects and the loop's counters."""
        self.restore(self.checkpoints.load(ckpt, restore_data=restore_data), ckpt.name)

    def restore(self, ts: dict[str, Any], name: str) -> None:
        """The loop's counters from a checkpoint's train_state (its tensors are already loaded:
        `build_trainer` loads them before it writes anything, so a refused resume writes nothing)."""
        self.step = int(ts["step"])
        self.applied = int(ts.get("applied_steps", self.step))
        self.tokens_seen = int(ts.get("tokens_seen", self.step * self.tokens_per_step))
        self.skipped = int(ts.get("skipped_steps", 0))
        self.scaler.load_state(ts.get("loss_scale", {}))
        if "spikes" in ts:
            self.spikes.detector.load_state(ts["spikes"])
        self.log(f"resumed from {name}: step {self.step}, {self.tokens_seen:,} tokens seen, loss scale {self.scaler.scale:g}")

    def save(self) -> Path | None:
        """Checkpoint the state after `self.step` (see CheckpointManager.save)."""
        for c in self.callbacks:
            c.pre_checkpoint(self.step)
        path = self.checkpoints.save(self.step, self.train_state())
        for c in self.callbacks:
            c.post_checkpoint_saved(self.step, path)
        return path

    def close(self) -> None:
        """End a trainer that will not train (or has nothing to do): its files, and the heartbeat's
        thread, which runs from build_trainer on."""
        self.checkpoints.close()
        for c in self.callbacks:
            c.post_train(self.step)
        for c in self.callbacks:
            c.close()

    def fail(self, exc: BaseException) -> None:
        """End a trainer whose building failed after the callbacks started (a refused resume)."""
        for c in self.callbacks:
            c.on_error(self.step, exc)
        for c in self.callbacks:
            c.close()

    # ----------------------------------------------------------------- loop
    def train(self) -> Summary:
        start = self.step
        summary = Summary(run_dir=self.run_dir, start_step=start, step=start, tokens_seen=self.tokens_seen)
        for line in self.banner:
            self.log(line)
        if start >= self.total_steps:
            self.log(f"nothing to do: the run is at step {start} and the budget is {self.total_steps} steps")
            self.close()
            return summary
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        for c in self.callbacks:
            c.pre_train(start)
        t_begin = time.perf_counter()
        error: BaseException | None = None
        try:
            while self.step < self.total_steps and self._stop_signal is None:
                data_state = self.loader.state()
                res, lr, scale = self.train_step()
                values: dict[str, Any] = {"loss": res.loss, "lr": lr, "grad_norm": res.grad_norm, "loss_scale": scale,
                                          "skipped": self.skipped, "tokens": self.tokens_seen,
                                          "elapsed_s": round(time.perf_counter() - t_begin, 3)}
                for c in self.callbacks:  # the heartbeat, the meter's throughput and memory, the profiler
                    c.post_train_batch(self.step, values)
                values.update(res.moe or {})  # MoE: the step's expert-load metrics (model/moe.py load_metrics)
                summary.tokens_per_s = values.get("tokens_per_s", summary.tokens_per_s)
                summary.losses.append(res.loss)
                rewound = self._after_spike_check(self.spikes.observe(self.step, res.loss, res.grad_norm, values), values)
                values["_row_nll"] = res.row_nll
                try:  # the console line, the eval, the batch log, the ledger, the spike record, the caller's
                    for c in self.callbacks:
                        c.post_step(self.step, data_state, values)
                except OSError as exc:  # batches.jsonl, spikes/ on a full disk: stop cleanly, keep the steps
                    self._stop_on_write_error(exc, values)
                for c in self.callbacks:  # the metrics record, after every callback has added its keys
                    c.log_metrics(self.step, values)
                # After a rewind the step is the checkpoint's own: saving it again would replace the
                # directory the other ranks are loading at that moment (seen under msrun as a rank
                # that found it torn, did not rewind, and left the job), and would write nothing new.
                if not rewound and self.checkpoints.due(self.step, self.total_steps):
                    self.save()
            summary.final_checkpoint = self.save()
            self.checkpoints.close()
            record_weights_hash(self.run_dir, rank=self.world.rank, world=self.world.size, step=self.step, model=self.model,
                                step_fn=self.step_fn)
            for c in self.callbacks:
                c.post_train(self.step)
        except store.SaveError as exc:
            error = exc
            self.checkpoints.failed(exc)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if error is not None:
                for c in self.callbacks:
                    c.on_error(self.step, error)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            for c in self.callbacks:
                c.close()
        return self._finish(summary, start)

    def _stop_on_write_error(self, exc: OSError, values: dict[str, Any]) -> None:
        """A run file could not be written (disk full, read-only): checkpoint the steps done if the
        disk still takes it (then write what was pending), else keep the last good checkpoint; stop
        in one line either way. Training on without the record would leave `audit` blind."""
        what = exc.filename or "a run file"
        try:
            self.save()
            self.checkpoints.wait()
            saved = self.checkpoints.latest_name() == RunPaths(self.run_dir).step_dir(self.step).name
        except (OSError, UserError):
            saved = False
        if saved:
            try:
                for c in self.callbacks:
                    c.retry()
                for c in self.callbacks:
                    c.log_metrics(self.step, values)
            except OSError:
                pass
        kept = (f"checkpoint {RunPaths(self.run_dir).step_dir(self.step).name} saved" if saved
                else f"the last good checkpoint is {self.checkpoints.latest_name()}")
        raise UserError(f"cannot write {what}: {exc.strerror or exc}; training stopped after step {self.step}, {kept}",
                        "free disk space (or fix permissions) and run the same command to resume")

    def _finish(self, summary: Summary, start: int) -> Summary:
        summary.step, summary.tokens_seen, summary.skipped = self.step, self.tokens_seen, self.skipped
        summary.stall_s = self.checkpoints.stall_s
        summary.loss_spikes = self.spikes.loss_spikes
        if summary.step > start:
            self.log(f"spike detector: {self.spikes.loss_spikes} loss spike(s) above {self.cfg.spike.threshold} over the rolling "
                     f"mean after warm-up in steps {start + 1}-{summary.step}")
        if self._stop_signal is not None:
            summary.stopped_by_signal = True
            self.log(f"stopped by {signal.Signals(self._stop_signal).name} after step {self.step}; checkpoint written. "
                     f"Resume with: mspretrain train --config {RunPaths(self.run_dir).config} --data {self.data_dir} --run {self.run_dir}")
        return summary

    def train_step(self) -> tuple[StepOutcome, float, float]:
        """Fetch this rank's micro-batches, run the compiled step, update the host counters."""
        lr = self.schedule(self.applied)
        scale = self.scaler.scale
        step = self.step + 1
        for c in self.callbacks:
            c.pre_load_batch(step)
        micro = []
        for _ in range(self.accum_steps):
            b = self.loader.next_batch()
            micro.append((b.tokens, b.positions, b.segments))
        for c in self.callbacks:
            c.pre_step(step)
        res = self.step_fn.run(micro, lr, scale)
        self.scaler.update(res.finite)
        self.step = step
        self.tokens_seen += self.tokens_per_step
        if res.finite:
            self.applied += 1
            self.checkpoints.after_update()  # the EMA of the weights, when train.ema_decay keeps one
        else:
            self.skipped += 1
            self.log(f"step {self.step}: gradient overflow at loss scale {scale:g} — update skipped, scale now {self.scaler.scale:g}")
        return res, lr, scale

    def _after_spike_check(self, action: str, values: dict[str, Any]) -> bool:
        """Act on the spike detector's verdict; True when the state was rewound to a checkpoint."""
        if action == REWIND:
            rewound = self.rewind()
            values["rewind"] = float(self.step)
            return rewound
        elif action == STOP:
            streak = self.spikes.detector.nonfinite_streak
            self.checkpoints.close()
            raise UserError(f"the loss was non-finite for {streak} steps in a row (step {self.step}); stopped to save compute",
                            f"lower optim.lr or use precision.dtype=fp32, then resume from {self.checkpoints.latest_name()}")
        return False

    def rewind(self) -> bool:
        """PaLM's remedy: reload the last good checkpoint and skip past the batches that led here.
        False when there is none to go back to (or the rewinds are used up): training continues."""
        ckpt = None if self.rewinds >= MAX_REWINDS else self.checkpoints.rewind_target()
        if ckpt is None:
            self.log(f"spike: no checkpoint to rewind to (or {MAX_REWINDS} rewinds already); continuing")
            return False
        spike_step = self.step
        skip = self.cfg.spike.rewind_skip
        self.load(ckpt, restore_data=skip > 0)
        for _ in range(skip * self.accum_steps):
            self.loader.next_batch()
        self.rewinds += 1
        self.log(f"spike at step {spike_step}: rewound to {ckpt.name}, skipping "
                 f"{skip if skip else spike_step - self.step} steps of data")
        return True

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self._stop_signal = signum
        # MindSpore's runtime installs its own SIGINT handler each time it runs a graph, and that
        # handler raises SIGTERM (measured): a Ctrl-C during a step arrives here as SIGTERM.
        name = "SIGTERM (or Ctrl-C)" if signum == signal.SIGTERM else signal.Signals(signum).name
        self.log(f"received {name}: finishing step {self.step + 1}, then writing a checkpoint")
