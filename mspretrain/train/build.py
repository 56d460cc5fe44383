"""Wire a real `Trainer` from a config, a data dir and a run dir.

In order: the config against the device, the data dir(s) and the vocabulary, MindSpore and the
world of ranks, the run lock, the budget (steps, warm-up, lr, micro-batches: `mspretrain/budget.py`),
the resume decision (the newest checkpoint that verifies; refused config changes; --restart), then
the parts: model, compiled step, loader, scaler, checkpoints, spike policy, then the run dir's
files (config.toml with the resolved values as comments, run_meta.json, the tokenizer), the
observers as the loop's callbacks (monitor/callback.py; their order is the order of their effects
within each hook) and finally the checkpoint's state loaded into all of them.

Design choices:
- A config change that alters numerics (model shape, seq_len, global batch, seed) is refused on
  resume unless `allow_config_change`; the budget (max_steps/max_tokens) may always change, and
  a re-stretched schedule is explained in the log.
- A run dir whose every checkpoint fails verification is not silently restarted from step 0 (that
  would append to the old metrics and later prune checkpoints `recover` could repair): --restart.
- `init_weights(model)` (the hook for weights from elsewhere) runs only on a run that starts from
  step 0, before the compiled step exists, so its optimizer state and fp32 masters start from them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from mspretrain import __version__, budget
from mspretrain.checkpoint import lock as run_lock
from mspretrain.checkpoint import store
from mspretrain.config import schema as cfgmod
from mspretrain.config.schema import Config
from mspretrain.errors import UserError
from mspretrain.monitor.callback import Callback
from mspretrain.parallel.layout import bucket_mb_for
from mspretrain.parallel.plan import ParallelPlan
from mspretrain.paths import DataPaths, RunPaths
from mspretrain.train.trainer import Trainer
from mspretrain.world import detect, select_launch

# the memory check build_trainer is given: (config, world size, device target, log=...) -> None or UserError
FitCheck = Callable[..., None]

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


def sampling_for_run(m: cfgmod.MetricsConfig, total: int) -> cfgmod.MetricsConfig:
    """The metric intervals, each capped at total/8 steps so a short run draws every panel."""
    cap = max(1, total // 8)
    return replace(m, **{f.name: min(getattr(m, f.name), cap) for f in dataclasses.fields(m) if f.name.endswith("_every")})


def _scans_data() -> bool:
    """Whether this process reads old shards (no `max_token_id` in the manifest) for the largest id:
    rank 0 alone (known from msrun's or the rank table's variables before `init`), never msrun's
    scheduler process (MS_ROLE=MS_SCHED, which runs this script too), so 8 ranks and the scheduler
    do not each read 240 GB."""

    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return False
    world = detect()
    return world.is_main if world is not None else os.environ.get("RANK_ID", "0").strip() in ("", "0")


def check_sources(cfg: Config, data_dir: Path, manifest: dict[str, Any]) -> list[tuple[Path, float]]:
    """The weighted data dirs; all must share the --data dir's tokenizer."""
    from mspretrain.data.loader import resolve_sources
    from mspretrain.data.manifest import check_data_dir, read_manifest

    sources = resolve_sources(data_dir, cfg.data.sources)
    want = manifest.get("tokenizer_sha256")
    for path, _ in sources:
        other = read_manifest(path)
        if path.resolve() != data_dir:  # the --data dir was checked by the caller
            check_data_dir(path, other, scan=_scans_data())
        if want and other.get("tokenizer_sha256") != want:
            raise UserError(f"data dir {path} was tokenized with a different tokenizer than {data_dir}",
                            f"prepare it again with --tokenizer {DataPaths(data_dir).tokenizer_model}")
    return sources


def find_resume(paths: RunPaths, *, is_main: bool, restart: bool, log: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies, or None to start from step 0."""
    if not paths.root.exists():
        return None
    if is_main:
        store.clean_tmp_dirs(paths.root, log=log)
    found = store.latest_verified(paths.root, log=log)
    if found is None and store.list_checkpoints(paths.root):
        if not restart:
            raise UserError(f"every checkpoint in {paths.checkpoints} fails verification; not starting over them from step 0",
                            f"repair one with `mspretrain recover {paths.root}`, or pass --restart to move them aside and start from step 0")
        if is_main:
            moved = store.move_aside(paths.root)
            log(f"--restart: the unverifiable checkpoints and metrics were moved to {', '.join(p.name for p in moved)}")
    return found


def builds_on_host(cfg: Config, world_size: int) -> bool:
    """Whether the model is drawn in host memory and only this rank's pieces go to the device:
    when it will be cut (ZeRO-3 over more than one rank, tensor parallel, expert parallel: each
    rank keeps E/ep experts, model/decoder.py `Decoder.apply_ep`)."""
    return world_size > 1 and (cfg.optim.shard_parameters or cfg.parallel.tp > 1 or cfg.parallel.ep > 1)


def memory_options(cfg: Config, step_fn: Any, world: Any, accum: int) -> str:
    """The memory options in effect, for the start-up line (rank 0's share of the state)."""
    parts = []
    if step_fn.sharded:
        sizes = step_fn.sizes  # whole parameters' (ZeRO-3 holds slices)
        mine = step_fn.owned_elements()
        what = "weights, optimizer state and gradients" if step_fn.plan.zero3 else \
            f"optimizer state{' and gradients' if step_fn.shard_grads else ''}"
        parts.append(f"{what} sharded over "
                     f"{step_fn.world} ranks (rank {step_fn.rank} holds {mine / sum(sizes):.0%})")
    if world.size > 1:
        c = step_fn.collectives(accum)
        parts.append(f"{c['calls']} collectives and {c['bytes'] / 2**20:,.1f} MB on the wire per step")
    if cfg.precision.param_dtype == "compute" and cfg.precision.dtype != "fp32":
        parts.append(f"{cfg.precision.dtype} matrices with fp32 masters")
    if cfg.train.recompute:
        parts.append("layer recompute")
    if cfg.parallel.tp > 1:
        parts.append(f"tensor parallel over {cfg.parallel.tp} ranks x {world.size // cfg.parallel.tp} data-parallel")
    if cfg.parallel.ep > 1:
        parts.append(f"expert parallel over {cfg.parallel.ep} ranks x {world.size // cfg.parallel.ep} expert-data-parallel")
    return "; " + ", ".join(parts) if parts else ""


def resolved_notes(cfg: Config, b: budget.Budget, sampling: cfgmod.MetricsConfig, threads: int,
                   target: str = "cpu") -> dict[str, str]:
    """The automatic (0) values as they ran, for comments in RUN_DIR/config.toml. The keys stay
    automatic so the same file resumes on another world size or machine."""
    notes = {}
    if not cfg.train.micro_batch:
        notes["train.micro_batch"] = f"0 = automatic; this run: {b.micro_batch} per rank x {b.accumulation} accumulation on {b.world} rank(s)"
    if not cfg.device.threads:
        notes["device.threads"] = f"0 = all cores; this run: {threads}"
    if cfg.schedule.warmup_steps == "auto":
        notes["schedule.warmup_steps"] = f"this run: {b.warmup} steps"
    if cfg.optim.bucket_mb == "auto" and b.world > 1:
        notes["optim.bucket_mb"] = f"this run: {bucket_mb_for('auto', target):g} MB ({target})"
    for f in dataclasses.fields(sampling):
        if getattr(sampling, f.name) != getattr(cfg.metrics, f.name):
            notes[f"metrics.{f.name}"] = f"this run: every {getattr(sampling, f.name)} (intervals capped at {b.steps} steps / 8)"
    return notes


def build_trainer(cfg: Config, data_dir: str | Path, run_dir: str | Path, *, allow_config_change: bool = False,
                  allow_data_change: bool = False, restart: bool = False, log: Callable[[str], None] = print,
                  init_weights: Callable[[Any], None] | None = None, run_meta: dict[str, Any] | None = None,
                  callbacks: Sequence[Callback] = (), fits: FitCheck | None = None) -> Trainer:
    """The real trainer for `mspretrain train`, resumed from the run dir's newest verified checkpoint.
    A refused run (any UserError) leaves the run dir as it was: every check runs before the first write.
    `fits(cfg, world, device, log=...)`: the memory check run before any allocation (`preflight/fits.check_fits`,
    which the commands and replay pass; it is given, not imported, because it reads `preflight/plan`'s
    memory model and preflight/ builds on step/); None: none (tests' tiny models).
    `callbacks`: the caller's own per-step work, called after the run's observers and before the
    metrics record is written (monitor/callback.py)."""
    from mspretrain.monitor.console import RunLog

    for flag, path in (("--data", data_dir), ("--run", run_dir)):
        try:  # a name that is not UTF-8 fails at the first checkpoint save otherwise, hours later
            os.fsencode(path).decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{flag} {os.fsdecode(path)!r} is not a UTF-8 path: the checkpoint and JSON writers cannot name it",
                            "rename the directory (or a parent) to a UTF-8 name") from None
    data_dir, paths = Path(data_dir).resolve(), RunPaths(run_dir)
    say = RunLog(paths.log, log)
    say.hold()  # nothing reaches train.log until the run is decided (see `_write_run_files`)
    created = not paths.root.exists()
    try:
        return _build(cfg, data_dir, paths, say, allow_config_change=allow_config_change,
                      allow_data_change=allow_data_change, restart=restart, init_weights=init_weights,
                      run_meta=run_meta, callbacks=callbacks, fits=fits)
    except UserError:
        if created:
            _remove_if_only_lock(paths)
        raise


def _remove_if_only_lock(paths: RunPaths) -> None:
    """A refused new run leaves no run dir behind: remove the one the lock made, if it holds nothing else."""
    try:
        if paths.root.is_dir() and {p.name for p in paths.root.iterdir()} <= {paths.lock.name}:
            run_lock.release(paths.root)
            paths.lock.unlink(missing_ok=True)
            paths.root.rmdir()
    except OSError:
        pass


def _write_run_files(paths: RunPaths, cfg: Config, notes: dict[str, str], tokenizer: Path | None,
                     meta: dict[str, Any]) -> None:
    """config.toml, the tokenizer and run_meta.json, each replaced atomically. Called only once
    every check that can refuse the run has passed: a refused resume leaves these files as they were."""
    from mspretrain.fsutil import atomic_write
    from mspretrain.outputs import os_error

    try:  # a full or read-only run dir (train, and replay's --out scratch run): one line, the old files whole
        cfgmod.save(cfg, paths.config, notes=notes)
        if tokenizer is not None:
            atomic_write(paths.root / tokenizer.name, tokenizer.read_bytes())
        atomic_write(paths.meta, json.dumps(meta, indent=1))
    except OSError as exc:
        raise os_error(exc, f"the run files in {paths.root}") from None


def _build(cfg: Config, data_dir: Path, paths: RunPaths, say: Any, *, allow_config_change: bool,
           allow_data_change: bool, restart: bool, init_weights: Callable[[Any], None] | None,
           run_meta: dict[str, Any] | None, callbacks: Sequence[Callback], fits: FitCheck | None) -> Trainer:
    import mindspore as ms

    from mspretrain.checkpoint.saver import Saver
    from mspretrain.data.loader import Loader
    from mspretrain.data.manifest import check_data_dir, read_manifest
    from mspretrain.device import plan_device, setup_mindspore
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.model.parallel import check_tp
    from mspretrain.monitor.batch_log import BatchLog, plan_for
    from mspretrain.monitor.console import ConsoleLine
    from mspretrain.monitor.heartbeat import Heartbeat
    from mspretrain.monitor.meter import StepMeter
    from mspretrain.monitor.metrics import MetricsLogger
    from mspretrain.monitor.mfu import device_peak_tflops, flops_per_token
    from mspretrain.monitor.profiler import StepProfiler
    from mspretrain.monitor.source_ledger import SourceLedger
    from mspretrain.monitor.spike_record import SpikeRecord
    from mspretrain.parallel import distributed
    from mspretrain.schedule import resume_notes
    from mspretrain.step.loss_scale import LossScaler
    from mspretrain.step.step import TrainStep
    from mspretrain.step.tp import TPTrainStep, mesh_for
    from mspretrain.train.checkpointing import CheckpointManager
    from mspretrain.train.eval_schedule import PeriodicEval
    from mspretrain.train.spike_policy import SpikePolicy

    device = plan_device(cfg)
    cfgmod.validate(cfg, device=device.target)
    manifest = read_manifest(data_dir)
    check_data_dir(data_dir, manifest, scan=_scans_data())  # the tokenizer and the ids the model will see
    vocab = int(manifest["vocab_size"])
    # more rows than pieces is a padded embedding (Qwen2.5: 152,064 rows for 151,665 tokens); fewer cannot hold the ids
    if cfg.model.vocab_size and cfg.model.vocab_size < vocab:
        raise UserError(f"model.vocab_size = {cfg.model.vocab_size} but the data dir's tokenizer has {vocab} pieces",
                        f"set model.vocab_size={vocab} (or 0 to take it from the data dir)")
    cfg = replace(cfg, model=cfgmod.resolve_model(cfg.model, vocab))
    sources = check_sources(cfg, data_dir, manifest)
    evaluator = PeriodicEval(cfg.eval, data_dir=data_dir, seq_len=cfg.data.seq_len, log=say,  # reads eval.choices_file now
                             jit_level=device.jit_level, seed=cfg.train.seed)
    # a process started from a rank table binds the NPU its entry names (msrun negotiates it otherwise)
    setup_mindspore(device, device_id=select_launch(device.target).device_id if device.target == "ascend" else None)
    check_tp(cfg.model, cfg.parallel.tp)  # before the rendezvous: a model tp cannot cut is refused on every rank alike
    world = distributed.init(device.target)
    say.is_main = world.is_main
    # the run's parallel plan (mspretrain/parallel/plan.py), built once: the step, the checkpoints, the
    # EMA and the replica hash read it. Tensor parallel: the data-parallel rank and size (loader,
    # budget, checkpoint shards) are the plan's, its groups made from the ranks it names (step/tp.py)
    plan = ParallelPlan.for_config(cfg, world=world.size, rank=world.rank)
    mesh = mesh_for(plan, device.target) if plan.tp > 1 else None
    dp_rank, dp_size = plan.dp_rank, plan.dp
    if world.is_main:  # one writer per run dir; the other msrun ranks are the same job
        run_lock.acquire(paths.root, "train", log=say)
    b = budget.derive(cfg, world=dp_size, data_tokens=int(manifest["tokens"]["train"]))
    if fits is not None:
        fits(cfg, world.size, device.target, log=say)  # before any allocation
    resume_from = find_resume(paths, is_main=world.is_main, restart=restart, log=say)
    resume_state: dict[str, Any] = {}
    if resume_from is not None:
        changes = config_changes(cfgmod.load(resume_from / store.CONFIG_FILE), cfg)
        if changes and not allow_config_change:
            raise UserError(f"the config changes numerics of the run in {paths.root}: {'; '.join(changes)}",
                            "use the original values, a new --run dir, or --allow-config-change")
        for c in changes:
            say(f"config change accepted on resume: {c}")
        resume_state = store.read_json(resume_from / store.TRAIN_STATE)  # a raised budget re-stretches the schedule: say how
        for note in resume_notes(resume_state.get("schedule"), b.schedule,
                                 int(resume_state.get("applied_steps", resume_state["step"])), cfg.optim.lr_scaling):
            say(note)
    # a short run still gets a few points of every metric (grad norm every 50 draws nothing in 40 steps)
    sampling = sampling_for_run(cfg.metrics, b.steps)

    ms.set_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed % (2**32))
    # a model cut for ZeRO-3, tensor or expert parallel is drawn on the host and only this rank's pieces
    # go to the device (model/parallel.py `piece_tensor`): built whole in HBM it did not fit above
    # ~15.6 B parameters (issue 51.2; Qwen3-30B-A3B: 113.7 GB whole, 12.5 GB of pieces at ep 16).
    # On an NPU each weight is drawn when the cut first reads it (model/decoder.py `LazyDraw`), so
    # the host holds one whole fp32 weight at a time (`plan`: model initialisation); on the CPU the
    # host is the device and the weights are drawn at once
    model = Decoder(cfg.model, dtype=cfg.precision.dtype, attention="auto", device=device.target, seed=cfg.train.seed,
                    host_weights=builds_on_host(cfg, world.size))
    if cfg.train.recompute:
        for layer in model.layers:
            layer.recompute()
    if init_weights is not None and resume_from is None:
        init_weights(model)
    half = half_eligible(model) if cfg.precision.param_dtype == "compute" and cfg.precision.dtype != "fp32" else []
    if mesh is not None:
        model.apply_tp(mesh.tp)  # whole weights (seeded or --init-from) cut to this rank's piece
    step_type, where = (TrainStep, {}) if mesh is None else (TPTrainStep, {"mesh": mesh})
    if plan.ep > 1:  # expert parallel (step/ep.py): each MoE layer keeps this rank's experts
        from mspretrain.step.ep import EPTrainStep, expert_mesh

        emesh = expert_mesh(plan, device.target)
        model.apply_ep(emesh.ep)
        step_type, where = EPTrainStep, {"mesh": emesh}
    step_fn = step_type(model, cfg.optim, global_tokens=b.tokens_per_step, **where, plan=plan,
                        jit=cfg.train.mode == "jit", allreduce_fp16=cfg.precision.allreduce_dtype == "fp16",
                        bucket_mb=cfg.optim.bucket_mb, split_mb=cfg.optim.split_mb, device=device.target, accumulation=b.accumulation,
                        half_params=half, jit_level=cfg.device.jit_level, trainable=cfg.train.trainable)
    loader = Loader(sources, split="train", seq_len=cfg.data.seq_len, batch_size=b.micro_batch, seed=cfg.train.seed,
                    rank=dp_rank, world=dp_size, reset_attention_at_eos=cfg.data.reset_attention_at_eos,
                    token_dtype=cfg.data.token_dtype, log=say)
    tokenizer = DataPaths(data_dir).tokenizer
    saver = Saver(paths.root, keep_last=cfg.checkpoint.keep_last, keep_every=cfg.checkpoint.keep_every,
                  async_save=cfg.checkpoint.async_save, log=say)
    checkpoints = CheckpointManager(paths, saver, cfg=cfg, model=model, step_fn=step_fn, loader=loader, plan=plan,
                                    tokenizer=tokenizer, allow_data_change=allow_data_change, log=say)
    # the checks that can still refuse a resume (data dir changed, train.trainable changed, a model
    # shape that does not fit the weights) run here, before the first byte is written to the run dir
    loaded = checkpoints.load(resume_from, restore_data=True) if resume_from is not None else None
    if world.is_main:
        paths.root.mkdir(parents=True, exist_ok=True)
        meta = {"data_dir": str(data_dir), "world_size": world.size, "code_version": __version__,
                "sources": [{"path": str(p), "weight": w} for p, w in sources],  # source{j}/* metrics
                "hardware": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": device.target,
                             "python": sys.version.split()[0], "mindspore": ms.__version__}}
        meta.update(run_meta or {})  # e.g. {"init_from": ...} (checkpoint/init_source.init_for_run)
        _write_run_files(paths, cfg, resolved_notes(cfg, b, sampling, device.threads, device.target), tokenizer, meta)
    say.release()
    metrics = MetricsLogger(paths.root, sampling, enabled=world.is_main, log=say,
                            # from step 0 (a run killed before its first checkpoint): its old lines are retrained
                            resume_step=int(resume_state["step"]) if resume_from is not None else 0)
    meter = StepMeter(tokens_per_step=b.tokens_per_step, seq_len=cfg.data.seq_len, devices=world.size,
                      flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len, cfg.train.trainable),
                      peak_tflops=device_peak_tflops(device.target, cfg.precision.dtype, cfg.device.peak_tflops),
                      price_per_device_hour=cfg.cost.price_per_device_hour, throughput_every=cfg.metrics.throughput_every,
                      log_every=cfg.train.log_every, memory_every=sampling.memory_every, target=device.target)
    scaler = LossScaler.from_config(cfg.precision)
    # which data each step trained on (RUN_DIR/batches.jsonl, for `audit` and `spike`)
    batches = BatchLog(paths.root, plan=plan_for(loader), global_batch=cfg.train.global_batch, enabled=world.is_main,
                       loader=loader, world=dp_size, rewind_skip=cfg.spike.rewind_skip,
                       resume_step=int(resume_state["step"]) if resume_from is not None else None,
                       skipped=int(resume_state.get("skipped_steps", 0)), total=b.steps, warmup=b.warmup,
                       schedule=b.schedule, precision=dataclasses.asdict(cfg.precision),
                       changes=tuple(name for name, on in (("data", allow_data_change and resume_from is not None),
                                                           ("config", allow_config_change and resume_from is not None),
                                                           ("restart", restart and resume_from is None)) if on))
    ledger = SourceLedger(plan_for(loader), world=dp_size, rank=dp_rank, micro=b.micro_batch, accum=b.accumulation,
                          seq_len=cfg.data.seq_len, every=cfg.train.log_every)  # loss and tokens per data source
    spike_record = SpikeRecord(paths.root, global_batch=cfg.train.global_batch, enabled=world.is_main,  # RUN/spikes/
                               # from step 0 (a run killed before its first checkpoint): its old lines are retrained
                            resume_step=int(resume_state["step"]) if resume_from is not None else 0)
    banner = (f"{device.describe()}; world {world.size}; micro-batch {b.micro_batch} x {b.accumulation} accumulation"
              + memory_options(cfg, step_fn, world, b.accumulation), f"schedule {b.schedule.describe()}")
    # this rank's step and phase, for `diagnose --hang` and launch's watchdog (its thread runs from here on)
    heartbeat = Heartbeat(paths.root, world.rank, world.size,
                          collectives_per_step=step_fn.collectives(b.accumulation)["calls"] if world.size > 1 else 0)
    evaluator.attach(model, total=b.steps, phase=heartbeat.phase)
    observers = (heartbeat, meter, StepProfiler(paths.root, cfg.profile.steps if world.is_main else "", log=say),
                 ConsoleLine(say, total=b.steps, log_every=cfg.train.log_every, show_scale=scaler.mode != "none",
                             rank=world.rank),
                 evaluator, batches, ledger, spike_record, *callbacks,
                 metrics)  # last: the metrics record holds every key the others added
    trainer = Trainer(
        cfg=cfg, run_dir=paths.root, data_dir=data_dir, world=world, model=model, step_fn=step_fn, loader=loader,
        scaler=scaler, schedule=b.schedule, checkpoints=checkpoints,
        spikes=SpikePolicy(cfg.spike, warmup_steps=b.warmup, log=say), total_steps=b.steps,
        accum_steps=b.accumulation, tokens_per_step=b.tokens_per_step, log=say, banner=banner, callbacks=observers)
    if resume_from is not None and loaded is not None:
        try:
            trainer.restore(loaded, resume_from.name)
        except BaseException as exc:  # the heartbeat's thread runs from here on: a refused resume must not leave it behind
            trainer.fail(exc)
            raise
        checkpoints.last_save_step = trainer.step
    return trainer
