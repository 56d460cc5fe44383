"""The training loop: data → step → metrics → eval → checkpoint → signals. No numerics here.

Reads top to bottom: `Trainer.__init__` resolves config, device, world, data and (if the run dir
has one) the newest verified checkpoint; `train()` loops over `train_step()` and the periodic
work; `save()` hands a host copy of the full state to the background saver.

Design choices:
- Resume is exact: the state to continue is the weights, the AdamW moments and counter, the
  loss-scale numbers, the loader's few integers, the spike detector's window and the step/token
  counters. Nothing else influences the next step (there is no dropout), so an interrupted and
  resumed run produces bit-identical weights on CPU.
- A config change that alters numerics (model shape, seq_len, global batch, seed) is refused on
  resume unless `allow_config_change`; the budget (max_steps/max_tokens) may always change.
- SIGINT/SIGTERM finish the current step, write a checkpoint and return normally.
- Only rank 0 writes files; all ranks run the same numerics and agree on skips (the overflow
  flag comes from the all-reduced gradients).
"""
from __future__ import annotations

import dataclasses
import json
import math
import platform
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mspretrain import __version__
from mspretrain import config as cfgmod
from mspretrain.checkpoint import lock as run_lock
from mspretrain.checkpoint import store
from mspretrain.checkpoint.saver import Saver
from mspretrain.config import Config
from mspretrain.device import DeviceInfo, plan_device, setup_mindspore
from mspretrain.errors import UserError
from mspretrain.ops.fits import check_fits
from mspretrain.monitor.memory import memory_metrics
from mspretrain.train import distributed
from mspretrain.train.loss_scale import LossScaler
from mspretrain.train.schedule import Schedule, build_schedule, resume_notes, total_steps

NUMERIC_KEYS = ("model", "data.seq_len", "data.reset_attention_at_eos", "train.global_batch", "train.seed")


def config_changes(old: Config, new: Config) -> list[str]:
    """Human-readable list of numerics-altering differences between two configs."""
    out = []
    for key in NUMERIC_KEYS:
        section, _, name = key.partition(".")
        a, b = getattr(old, section), getattr(new, section)
        if name:
            a, b = getattr(a, name), getattr(b, name)
            if a != b:
                out.append(f"{key}: {a} -> {b}")
        else:
            for f in dataclasses.fields(a):
                va, vb = getattr(a, f.name), getattr(b, f.name)
                if va != vb:
                    out.append(f"{section}.{f.name}: {va} -> {vb}")
    return out


def check_data_dir(data_dir: Path, manifest: dict[str, Any]) -> None:
    from mspretrain.data.loader import check_data_dir as check

    check(data_dir, manifest)


def read_data_manifest(data_dir: Path) -> dict[str, Any]:
    from mspretrain.data.loader import read_manifest

    return read_manifest(data_dir)


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
    def __init__(self, cfg: Config, data_dir: str | Path, run_dir: str | Path, *,
                 allow_config_change: bool = False, allow_data_change: bool = False,
                 log: Callable[[str], None] = print, progress: bool = False, restart: bool = False) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.run_dir = Path(run_dir)
        self._print = log
        self.device: DeviceInfo = plan_device(cfg)
        cfgmod.validate(cfg, device=self.device.target)
        self.manifest = read_data_manifest(self.data_dir)
        check_data_dir(self.data_dir, self.manifest)  # the tokenizer and the ids the model will see
        vocab = int(self.manifest["vocab_size"])
        if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
            raise UserError(f"model.vocab_size = {cfg.model.vocab_size} but the data dir's tokenizer has {vocab} pieces",
                            f"set model.vocab_size={vocab} (or 0 to take it from the data dir)")
        cfg = replace(cfg, model=cfgmod.resolve_model(cfg.model, vocab))
        self.sources = self._check_sources(cfg)
        setup_mindspore(self.device)
        self.world = distributed.init(self.device.target)
        if self.world.is_main:  # one writer per run dir; the other msrun ranks are the same job
            run_lock.acquire(self.run_dir, "train", log=self._print)
        self.micro, self.accum_steps = cfgmod.micro_batches(cfg, self.world.size)
        check_fits(cfg, self.world.size, self.device.target, log=self.log)  # before any allocation

        # ---- resume: the newest checkpoint that verifies (rank 0 decides what it logs)
        self.resume_from: Path | None = None
        if self.run_dir.exists():
            store.clean_tmp_dirs(self.run_dir, log=self.log) if self.world.is_main else None
            self.resume_from = store.latest_verified(self.run_dir, log=self.log)
            if self.resume_from is None and store.list_checkpoints(self.run_dir):
                # starting from step 0 here would append to the old metrics and later prune the
                # damaged checkpoints that `recover` could have repaired
                if not restart:
                    raise UserError(f"every checkpoint in {self.run_dir / 'checkpoints'} fails verification; not starting over them from step 0",
                                    f"repair one with `mspretrain recover {self.run_dir}`, or pass --restart to move them aside and start from step 0")
                if self.world.is_main:
                    moved = store.move_aside(self.run_dir)
                    self.log(f"--restart: the unverifiable checkpoints and metrics were moved to {', '.join(p.name for p in moved)}")
        if self.resume_from is not None:
            old = cfgmod.load(self.resume_from / "config.toml")
            changes = config_changes(old, cfg)
            if changes and not allow_config_change:
                raise UserError(f"the config changes numerics of the run in {self.run_dir}: {'; '.join(changes)}",
                                "use the original values, a new --run dir, or --allow-config-change")
            for c in changes:
                self.log(f"config change accepted on resume: {c}")
        self.cfg = cfg
        self.schedule: Schedule = build_schedule(cfg, int(self.manifest["tokens"]["train"]))
        self.total_steps = total_steps(cfg)
        if self.resume_from is not None:  # a raised budget re-stretches the schedule: say how
            ts = store.read_json(self.resume_from / "train_state.json")
            for note in resume_notes(ts.get("schedule"), self.schedule, int(ts.get("applied_steps", ts["step"])),
                                     cfg.optim.lr_scaling):
                self.log(note)
        # a short run still gets a few points of every metric (grad norm every 50 draws nothing in 40 steps)
        self.sampling = sampling_for_run(cfg.metrics, self.total_steps)
        self.global_tokens = cfg.train.global_batch * cfg.data.seq_len
        self.allow_data_change = allow_data_change
        self.progress = progress
        self._stop_signal: int | None = None

    def _check_sources(self, cfg: Config) -> list[tuple[Path, float]]:
        """The weighted data dirs; all must share the --data dir's tokenizer."""
        from mspretrain.data.loader import resolve_sources

        sources = resolve_sources(self.data_dir, cfg.data.sources)
        want = self.manifest.get("tokenizer_sha256")
        for path, _ in sources:
            other = read_data_manifest(path)
            if path.resolve() != self.data_dir:  # the --data dir was checked above
                check_data_dir(path, other)
            if want and other.get("tokenizer_sha256") != want:
                raise UserError(f"data dir {path} was tokenized with a different tokenizer than {self.data_dir}",
                                f"prepare it again with --tokenizer {self.data_dir / 'tokenizer.model'}")
        return sources

    # ----------------------------------------------------------------- logging
    def log(self, text: str) -> None:
        if getattr(self, "world", None) is None or self.world.is_main:
            self._print(text)
            if self.run_dir.is_dir():
                with open(self.run_dir / "train.log", "a", encoding="utf-8") as f:
                    f.write(time.strftime("%Y-%m-%d %H:%M:%S ") + text + "\n")

    # ----------------------------------------------------------------- setup
    def _build(self) -> None:
        import mindspore as ms

        from mspretrain.data.loader import Loader
        from mspretrain.model.llama import Llama, half_eligible
        from mspretrain.monitor.metrics import MetricsLogger
        from mspretrain.monitor.spikes import SpikeDetector
        from mspretrain.train.step import TrainStep

        cfg = self.cfg
        ms.set_seed(cfg.train.seed)
        np.random.seed(cfg.train.seed % (2**32))
        self.model = Llama(cfg.model, dtype=cfg.precision.dtype, attention="auto", device=self.device.target,
                           seed=cfg.train.seed)
        if cfg.train.recompute:
            for layer in self.model.layers:
                layer.recompute()
        half = half_eligible(self.model) if cfg.precision.param_dtype == "compute" and cfg.precision.dtype != "fp32" else []
        self.step_fn = TrainStep(self.model, cfg.optim, global_tokens=self.global_tokens, world=self.world.size,
                                 rank=self.world.rank, jit=cfg.train.mode == "jit",
                                 allreduce_fp16=cfg.precision.allreduce_dtype == "fp16", shard=cfg.optim.shard_optimizer,
                                 shard_grads=cfg.optim.shard_gradients, bucket_mb=cfg.optim.bucket_mb,
                                 device=self.device.target, accumulation=self.accum_steps, half_params=half,
                                 jit_level=cfg.device.jit_level)
        self.loader = Loader(self.sources, split="train", seq_len=cfg.data.seq_len, batch_size=self.micro,
                             seed=cfg.train.seed, rank=self.world.rank, world=self.world.size,
                             reset_attention_at_eos=cfg.data.reset_attention_at_eos,
                             token_dtype=cfg.data.token_dtype, log=self.log)
        self.scaler = LossScaler.from_config(cfg.precision)
        self.spikes = SpikeDetector(cfg.spike)
        self.spikes.warmup_steps = self.schedule.warmup
        self.step = 0
        self.applied = 0
        self.tokens_seen = 0
        self.skipped = 0
        self.rewinds = 0
        self.loss_spikes = 0
        self._last_save_step: int | None = None
        if self.resume_from is not None:
            self._load(self.resume_from, restore_data=True)
            self._last_save_step = self.step
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfgmod.save(self.cfg, self.run_dir / "config.toml", notes=self._resolved_notes())
            tok = self._tokenizer_file()
            if tok is not None:
                (self.run_dir / tok.name).write_bytes(tok.read_bytes())
            meta = {"data_dir": str(self.data_dir), "world_size": self.world.size, "code_version": __version__,
                    "hardware": {"platform": platform.platform(), "cpus": __import__("os").cpu_count(),
                                 "device": self.device.target, "python": sys.version.split()[0],
                                 "mindspore": ms.__version__}}
            (self.run_dir / "run_meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        self.metrics = MetricsLogger(self.run_dir, self.sampling, enabled=self.world.is_main,
                                     resume_step=self.step if self.resume_from is not None else None, log=self.log)
        self.saver = Saver(self.run_dir, keep_last=cfg.checkpoint.keep_last, keep_every=cfg.checkpoint.keep_every,
                           async_save=cfg.checkpoint.async_save, log=self.log)

    def _resolved_notes(self) -> dict[str, str]:
        """The automatic (0) values as they ran, for comments in RUN_DIR/config.toml. The keys stay
        automatic so the same file resumes on another world size or machine."""
        notes = {}
        if not self.cfg.train.micro_batch:
            notes["train.micro_batch"] = f"0 = automatic; this run: {self.micro} per rank x {self.accum_steps} accumulation on {self.world.size} rank(s)"
        if not self.cfg.device.threads:
            notes["device.threads"] = f"0 = all cores; this run: {self.device.threads}"
        if self.cfg.schedule.warmup_steps == "auto":
            notes["schedule.warmup_steps"] = f"this run: {self.schedule.warmup} steps"
        for f in dataclasses.fields(self.sampling):
            if getattr(self.sampling, f.name) != getattr(self.cfg.metrics, f.name):
                notes[f"metrics.{f.name}"] = f"this run: every {getattr(self.sampling, f.name)} (intervals capped at {self.total_steps} steps / 8)"
        return notes

    def _tokenizer_file(self) -> Path | None:
        for name in ("tokenizer.model", "tokenizer.json"):
            if (self.data_dir / name).is_file():
                return self.data_dir / name
        return None

    def _load(self, ckpt: Path, *, restore_data: bool) -> None:
        """Restore the full state of a checkpoint into the live objects."""
        from mspretrain.model.llama import load_numpy

        ts = store.read_json(ckpt / "train_state.json")
        load_numpy(self.model, store.load_file(str(ckpt / store.MODEL_FILE)))
        available = store.optimizer_keys(ckpt)
        if not available:
            raise UserError(f"checkpoint {ckpt.name} has no optimizer state", "resume from a training checkpoint, or start a new --run dir from these weights")
        # only the part this rank holds is read (all of it unless the optimizer is sharded), from
        # whichever file has it: a sharded checkpoint resumes with any world size, sharded or not
        opt = store.read_optimizer_tensors(ckpt, keys=self.step_fn.state_keys(owned_only=True))
        self.step_fn.load_optimizer_state(opt, available=available)
        self.step = int(ts["step"])
        self.applied = int(ts.get("applied_steps", self.step))
        self.tokens_seen = int(ts.get("tokens_seen", self.step * self.global_tokens))
        self.skipped = int(ts.get("skipped_steps", 0))
        self.scaler.load_state(ts.get("loss_scale", {}))
        if "spikes" in ts:
            self.spikes.load_state(ts["spikes"])
        if restore_data:
            ds = store.read_json(ckpt / "data_state.json")
            self.loader.load_state(ds, allow_data_change=self.allow_data_change)
        self.log(f"resumed from {ckpt.name}: step {self.step}, {self.tokens_seen:,} tokens seen, loss scale {self.scaler.scale:g}")

    # ----------------------------------------------------------------- state
    def train_state(self) -> dict[str, Any]:
        return {"step": self.step, "applied_steps": self.applied, "tokens_seen": self.tokens_seen,
                "skipped_steps": self.skipped, "loss_scale": self.scaler.state(), "spikes": self.spikes.state(),
                "schedule": {"kind": self.schedule.kind, "position": self.applied, "warmup": self.schedule.warmup,
                             "total": self.schedule.total, "lr": self.schedule(self.applied)},
                "rng": {"seed": self.cfg.train.seed, "note": "no stochastic ops in training; init and data order derive from the seed"},
                "world_size": self.world.size}

    def save(self) -> Path | None:
        """Checkpoint the state after `self.step` (rank 0 writes; the copy to host blocks briefly).

        With a sharded optimizer every rank writes its own optimizer shard and rank 0 publishes."""
        sharded = self.step_fn.sharded
        self._last_save_step = self.step  # every rank knows which step the newest save is for
        if not self.world.is_main and not sharded:
            return None
        from mspretrain.model.llama import state_numpy

        t0 = time.perf_counter()
        # asnumpy() on CPU returns a view of the live parameter memory: the writer thread needs a
        # snapshot, or the next step would change the weights while they are being written.
        optim = {k: v.copy() for k, v in self.step_fn.optimizer_state().items()}
        try:
            if not self.world.is_main:
                self.saver.save_shard(step=self.step, rank=self.world.rank, world=self.world.size,
                                      optimizer=optim, stall_started=t0)
                return None
            model = {k: v.copy() for k, v in state_numpy(self.model, keep_fp16=True).items()}
            self.saver.save(step=self.step, model=model, optimizer=optim,
                            train_state=self.train_state(), data_state=self.loader.state(), config=self.cfg,
                            tokenizer_path=self._tokenizer_file(), stall_started=t0,
                            world=self.world.size if sharded else 1)
        except store.SaveError as exc:
            self._save_failed(exc)
        return self.run_dir / "checkpoints" / store.step_dir_name(self.step)

    def _save_failed(self, exc: store.SaveError) -> None:
        msg = f"checkpoint save failed: {exc.strerror or exc}; previous checkpoints are intact"
        if self.cfg.checkpoint.on_error == "stop":
            raise UserError(msg, "free disk space (or fix permissions) and run the same command to resume")
        self.log(f"warning: {msg}; training continues (checkpoint.on_error=continue)")

    # ----------------------------------------------------------------- loop
    def train(self) -> Summary:
        self._build()
        from mspretrain.monitor.mfu import device_peak_tflops, flops_per_token

        start = self.step
        summary = Summary(run_dir=self.run_dir, start_step=start, step=start, tokens_seen=self.tokens_seen)
        self.log(f"{self.device.describe()}; world {self.world.size}; micro-batch {self.micro} x {self.accum_steps} accumulation"
                 + self._memory_options())
        self.log(f"schedule {self.schedule.describe()}")
        if start >= self.total_steps:
            self.log(f"nothing to do: the run is at step {start} and the budget is {self.total_steps} steps")
            self.saver.close()
            self.metrics.close()
            return summary
        flops_tok = flops_per_token(self.cfg.model, self.cfg.data.seq_len)
        peak = device_peak_tflops(self.device.target, self.cfg.precision.dtype, self.cfg.device.peak_tflops) * 1e12
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        profiler = self._profiler()
        t_window, tok_window = time.perf_counter(), 0
        t_begin = time.perf_counter()
        try:
            while self.step < self.total_steps and self._stop_signal is None:
                t_step = time.perf_counter()
                profiler.step_begin(self.step + 1)
                res, lr, scale = self.train_step()
                profiler.step_end(self.step)
                tok_window += self.global_tokens
                values: dict[str, float] = {"loss": res.loss, "lr": lr, "grad_norm": res.grad_norm, "loss_scale": scale,
                                            "skipped": self.skipped, "tokens": self.tokens_seen,
                                            "elapsed_s": round(time.perf_counter() - t_begin, 3)}
                if self.step == start + 1:  # the first step includes graph compilation
                    t_window, tok_window = time.perf_counter(), 0
                    self._run_s = 0.0
                elif self.step % self.cfg.metrics.throughput_every == 0 or self.step % self.cfg.train.log_every == 0:
                    dt = max(time.perf_counter() - t_window, 1e-9)
                    tps = tok_window / dt
                    per_dev = tps / self.world.size
                    # host_share: the part of the wall time outside the compiled step (data, metrics,
                    # logging): what the once-per-step read of loss/norm/finite can cost the device
                    values.update(tokens_per_s=tps, samples_per_s=tps / self.cfg.data.seq_len,
                                  mfu=flops_tok * per_dev / peak if peak else 0.0, real_token_share=1.0,
                                  tokens_per_device_hour=per_dev * 3600, host_share=max(0.0, 1.0 - self._run_s / dt))
                    self._run_s = 0.0
                    if self.cfg.cost.price_per_device_hour:
                        values["cost_per_btok"] = self.cfg.cost.price_per_device_hour / (per_dev * 3600) * 1e9
                    summary.tokens_per_s = tps
                    t_window, tok_window = time.perf_counter(), 0
                if self.step % self.sampling.memory_every == 0:
                    # host RSS as mem_mb; on Ascend also the NPU's peak allocated/reserved (monitor/memory.py)
                    values.update(memory_metrics(self.device.target))
                summary.losses.append(res.loss)
                self._spikes(res, values)
                if self.step % self.cfg.train.log_every == 0 or self.step == start + 1 or self.step == self.total_steps:
                    self._console(values, t_begin, start)
                    if not self.world.is_main:  # per-rank timing in the msrun worker logs, for straggler diagnosis
                        print(f"rank={self.world.rank} step={self.step} step_time={(time.perf_counter() - t_step):.3f}s", flush=True)
                # every run ends with an eval (eval.every = 0 means only then), in the step's own record
                if (self.cfg.eval.every and self.step % self.cfg.eval.every == 0) or self.step == self.total_steps:
                    self.evaluate(values)
                self.metrics.log(self.step, values)
                if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0 and self.step < self.total_steps:
                    self.save()
            summary.final_checkpoint = self.save()
            self.saver.close()
            self._replica_check()
        except store.SaveError as exc:
            self._save_failed(exc)
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            profiler.close()
            self.metrics.close()
        summary.step, summary.tokens_seen, summary.skipped = self.step, self.tokens_seen, self.skipped
        summary.stall_s = list(self.saver.stall_s)
        summary.loss_spikes = self.loss_spikes
        if summary.step > start:
            self.log(f"spike detector: {self.loss_spikes} loss spike(s) above {self.cfg.spike.threshold} over the rolling "
                     f"mean after warm-up in steps {start + 1}-{summary.step}")
        if self._stop_signal is not None:
            summary.stopped_by_signal = True
            self.log(f"stopped by {signal.Signals(self._stop_signal).name} after step {self.step}; checkpoint written. "
                     f"Resume with: mspretrain train --config {self.run_dir / 'config.toml'} --data {self.data_dir} --run {self.run_dir}")
        return summary

    def train_step(self) -> tuple[Any, float, float]:
        """Fetch this rank's micro-batches, run the compiled step, update the host counters."""
        lr = self.schedule(self.applied)
        scale = self.scaler.scale
        micro = []
        for _ in range(self.accum_steps):
            b = self.loader.next_batch()
            micro.append((b.tokens, b.positions, b.segments))
        t_run = time.perf_counter()
        res = self.step_fn.run(micro, lr, scale)
        self._run_s = getattr(self, "_run_s", 0.0) + time.perf_counter() - t_run
        self.scaler.update(res.finite)
        self.step += 1
        self.tokens_seen += self.global_tokens
        if res.finite:
            self.applied += 1
        else:
            self.skipped += 1
            self.log(f"step {self.step}: gradient overflow at loss scale {scale:g} — update skipped, scale now {self.scaler.scale:g}")
        return res, lr, scale

    def _spikes(self, res: Any, values: dict[str, float]) -> None:
        findings = self.spikes.check(self.step, res.loss, res.grad_norm)
        for f in findings:
            self.log(f"warning: {f['message']}")
        if any(f["kind"] == "loss_spike" for f in findings):
            self.loss_spikes += 1
            values["spike"] = 1.0
            if self.cfg.spike.action == "rewind":
                self.rewind()
                values["rewind"] = float(self.step)
        if self.spikes.nonfinite_streak >= self.cfg.spike.max_nonfinite:
            self.saver.close()
            last = store.latest_verified(self.run_dir, log=lambda s: None)
            raise UserError(f"the loss was non-finite for {self.spikes.nonfinite_streak} steps in a row (step {self.step}); stopped to save compute",
                            f"lower optim.lr or use precision.dtype=fp32, then resume from {last.name if last else 'scratch'}")

    def rewind(self) -> None:
        """PaLM's remedy: reload the last good checkpoint and skip past the batches that led here."""
        ckpt = self._rewind_target()
        if ckpt is None or self.rewinds >= 3:
            self.log("spike: no checkpoint to rewind to (or 3 rewinds already); continuing")
            return
        spike_step = self.step
        skip = self.cfg.spike.rewind_skip
        self._load(ckpt, restore_data=skip > 0)
        for _ in range(skip * self.accum_steps):
            self.loader.next_batch()
        self.rewinds += 1
        self.log(f"spike at step {spike_step}: rewound to {ckpt.name}, skipping "
                 f"{skip if skip else spike_step - self.step} steps of data")

    def _memory_options(self) -> str:
        """The memory options in effect, for the start-up line (rank 0's share of the state)."""
        parts = []
        if self.step_fn.sharded:
            sizes = [int(np.prod(p.shape)) for p in self.step_fn.params]
            mine = sum(sizes[i] for i in self.step_fn.own)
            parts.append(f"optimizer state{' and gradients' if self.step_fn.shard_grads else ''} sharded over "
                         f"{self.world.size} ranks (rank {self.world.rank} holds {mine / sum(sizes):.0%})")
        if self.world.size > 1:
            c = self.step_fn.collectives(self.accum_steps)
            parts.append(f"{c['calls']} collectives and {c['bytes'] / 2**20:,.1f} MB on the wire per step")
        if self.cfg.precision.param_dtype == "compute" and self.cfg.precision.dtype != "fp32":
            parts.append(f"{self.cfg.precision.dtype} matrices with fp32 masters")
        if self.cfg.train.recompute:
            parts.append("layer recompute")
        return "; " + ", ".join(parts) if parts else ""

    def _rewind_target(self) -> Path | None:
        """The checkpoint to rewind to, the same on every rank.

        One process: the newest that verifies. Under msrun every rank takes the step of the newest
        save of this run (all ranks save at the same steps), waiting until rank 0 has published it:
        "newest on disk" could differ between ranks while rank 0's writer is still at work."""
        self.saver.wait()
        if self.world.size == 1 or self._last_save_step is None:
            return store.latest_verified(self.run_dir, log=self.log)
        from mspretrain.checkpoint.shards import WAIT_S

        target = self.run_dir / "checkpoints" / store.step_dir_name(self._last_save_step)
        deadline = time.monotonic() + WAIT_S
        while store.verify(target, deep=False) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        reason = store.verify(target)
        if reason is not None:
            self.log(f"spike: checkpoint {target.name} is not usable ({reason})")
            return None
        return target

    def _replica_check(self) -> None:
        """Every rank records a hash of its weights; data parallel replicas must be identical."""
        if self.world.size == 1:
            return
        import hashlib

        from mspretrain.model.llama import state_numpy

        h = hashlib.sha256()
        for name, arr in sorted(state_numpy(self.model).items()):
            h.update(name.encode())
            h.update(arr.tobytes())
        ranks = self.run_dir / "ranks"
        ranks.mkdir(parents=True, exist_ok=True)
        (ranks / f"rank_{self.world.rank}.json").write_text(
            json.dumps({"rank": self.world.rank, "step": self.step, "weights_sha256": h.hexdigest()}), encoding="utf-8")

    def evaluate(self, values: dict[str, float] | None = None) -> float:
        """Valid perplexity; logged into `values` (the step's metrics record) when given."""
        from mspretrain.eval.perplexity import evaluate_split

        res = evaluate_split(self.model, self.data_dir, split="valid", seq_len=self.cfg.data.seq_len,
                             batch_size=self.cfg.eval.batch_size, max_tokens=self.cfg.eval.max_tokens)
        if values is None:
            self.metrics.log(self.step, {"eval/ppl": res["ppl"], "eval/nll": res["nll"]})
        else:
            values.update({"eval/ppl": res["ppl"], "eval/nll": res["nll"]})
        self.log(f"step {self.step}: valid ppl {res['ppl']:.2f} over {res['tokens']:,} tokens")
        return res["ppl"]

    def _console(self, v: dict[str, float], t_begin: float, start: int) -> None:
        done = self.step - start
        elapsed = time.perf_counter() - t_begin
        eta = elapsed / max(done, 1) * (self.total_steps - self.step)
        parts = [f"step {self.step}/{self.total_steps}", f"loss {v['loss']:.4f}", f"lr {v['lr']:.2e}",
                 f"gnorm {v['grad_norm']:.3f}"]
        if self.scaler.mode != "none":
            parts.append(f"scale {v['loss_scale']:g}")
        if "tokens_per_s" in v:
            parts += [f"{v['tokens_per_s']:,.0f} tok/s", f"mfu {100 * v['mfu']:.1f}%"]
        if done > 1:  # the first step includes graph compilation: no ETA from it
            parts.append(f"eta {_fmt_time(eta)}")
        self.log(" | ".join(parts))

    def _profiler(self) -> Any:
        from mspretrain.ops.profiler import StepProfiler

        return StepProfiler(self.run_dir, self.cfg.profile.steps if self.world.is_main else "", log=self.log)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self._stop_signal = signum
        # MindSpore's runtime installs its own SIGINT handler each time it runs a graph, and that
        # handler raises SIGTERM (measured): a Ctrl-C during a step arrives here as SIGTERM.
        name = "SIGTERM (or Ctrl-C)" if signum == signal.SIGTERM else signal.Signals(signum).name
        self.log(f"received {name}: finishing step {self.step + 1}, then writing a checkpoint")


def sampling_for_run(m: cfgmod.MetricsConfig, total: int) -> cfgmod.MetricsConfig:
    """The metric intervals, each capped at total/8 steps so a short run draws every panel."""
    cap = max(1, total // 8)
    return replace(m, **{f.name: min(getattr(m, f.name), cap) for f in dataclasses.fields(m) if f.name.endswith("_every")})


def _fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
