"""Checkpoint policy of a run: when to save, what a checkpoint holds, how it comes back.

A small `CheckpointManager` in the manner of torchtitan's: the trainer hands it the step and the
loop's own counters (`train_state`), and it snapshots the weights, the optimizer state and the
loader's position, hands them to the background `Saver` (which writes, verifies and prunes), and
restores all of it on resume or rewind.

Design choices:
- The snapshot is a host *copy*: on CPU asnumpy() returns a view of the live parameter memory, and
  the next step would change the weights while the writer thread is still writing them.
- Only rank 0 writes, except with a sharded optimizer or expert parallel, where every rank writes its
  optimizer file and rank 0 publishes the checkpoint once all are there (checkpoint/shards.py).
  Under ZeRO-3 each rank also writes its weight slices to a file of its own
  (`model-R-of-N.safetensors`, checkpoint/model_shards.py), under expert parallel its experts'
  slices of the stacks: no gather, no whole model on any host. Every layout reads either
  form of the weights back: whole tensors, or (ZeRO-3, any world size) just this rank's ranges.
- A rewind must reload the same checkpoint on every rank: "newest on disk" could differ between
  ranks while rank 0's writer is at work, so under msrun every rank takes the step of this run's
  newest save and waits until rank 0 has published it.
- A failed write stops the run or is logged and skipped, per `checkpoint.on_error`; the
  previous checkpoints stay intact either way.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from mspretrain.checkpoint import store
from mspretrain.checkpoint.model_shards import read_pieces
from mspretrain.checkpoint.saver import Saver
from mspretrain.config.schema import Config
from mspretrain.errors import UserError
from mspretrain.parallel.plan import ParallelPlan
from mspretrain.paths import RunPaths


class CheckpointManager:
    def __init__(self, paths: RunPaths, saver: Saver, *, cfg: Config, model: Any, step_fn: Any, loader: Any,
                 plan: ParallelPlan, tokenizer: Path | None, allow_data_change: bool,
                 log: Callable[[str], None]) -> None:
        """`plan`: the run's parallel plan (mspretrain/parallel/plan.py): who gathers for a save, who
        writes which file; `rank` and `world` here are the data-parallel ones (a checkpoint is a
        data-parallel run's, whatever the tp)."""
        self.paths, self.saver, self.cfg, self.log = paths, saver, cfg, log
        self.model, self.step_fn, self.loader = model, step_fn, loader
        self.plan = plan
        self.rank, self.world, self.tokenizer = plan.dp_rank, plan.dp, tokenizer
        self.allow_data_change = allow_data_change
        self.last_save_step: int | None = None  # every rank knows which step the newest save is for
        # train.ema_decay: the EMA of this rank's weights, saved with and restored from each checkpoint
        # (train/ema.py: None when off, and on ranks whose weights rank 0's EMA already covers)
        from mspretrain.train.ema import for_run

        self.ema = for_run(cfg, model, step_fn, rank=self.rank, world=self.world)

    def after_update(self) -> None:
        """An optimizer step was applied: the EMA of the weights (if kept) takes them."""
        if self.ema is not None:
            self.ema.update()

    def due(self, step: int, total: int) -> bool:
        """A periodic save after `step` (the last step's save is the loop's final one)."""
        every = self.cfg.checkpoint.every
        return bool(every) and step % every == 0 and step < total

    def save(self, step: int, train_state: dict[str, Any]) -> Path | None:
        """Checkpoint the state after `step`; the copy to host blocks briefly, the write does not."""
        sharded = self.plan.per_rank_files  # every dp rank writes its own files (ZeRO, expert parallel)
        self.last_save_step = step
        # tensor parallel: the whole weights are gathered over the tp group on every rank (a collective:
        # all ranks call it), so the model file is the one any layout writes and any layout resumes
        # from; the optimizer state too (step/tp.py), written by tp rank 0 alone. ZeRO-3 and expert
        # parallel gather nothing: each rank writes its own slices (checkpoint/model_shards.py)
        gathers = self.plan.gathers_for_save
        if self.rank != 0 and not sharded and not gathers:
            return None
        t0 = time.perf_counter()
        part, meta = None, None  # ZeRO-3, expert parallel: this rank's weight slices and their file's metadata
        if self.plan.writes_model_slices:
            from mspretrain.checkpoint.model_shards import shard_metadata

            if self.plan.zero3:
                from mspretrain.step.zero3 import slice_state

                part, shapes = slice_state(self.model, self.world, self.rank)
            else:  # expert parallel (step/ep.py): its experts' slices, the rest whole on rank 0
                part, shapes = self.step_fn.model_slices()
            meta = shard_metadata(step, shapes)
        whole = self.step_fn.full_weights() if gathers else None
        optim = {k: v.copy() for k, v in self.step_fn.optimizer_state().items()}
        if not self.plan.writes_files or (self.rank != 0 and not sharded):
            return None
        extra = self.ema.files(step) if self.ema is not None else None
        try:
            if self.rank != 0:
                self.saver.save_shard(step=step, rank=self.rank, world=self.world, optimizer=optim, stall_started=t0,
                                      model=part, model_metadata=meta, extra=extra)
                return None
            model = part if part is not None else whole if whole is not None else {
                k: v.copy() for k, v in self.step_fn.full_weights().items()}
            self.saver.save(step=step, model=model, optimizer=optim, train_state=train_state,
                            data_state=self.loader.state(), config=self.cfg, tokenizer_path=self.tokenizer,
                            stall_started=t0, world=self.world if sharded else 1, model_metadata=meta, extra=extra)
        except store.SaveError as exc:
            self.failed(exc)
        return self.paths.step_dir(step)

    def failed(self, exc: store.SaveError) -> None:
        msg = f"checkpoint save failed: {exc.strerror or exc}; previous checkpoints are intact"
        if self.cfg.checkpoint.on_error == "stop":
            raise UserError(msg, "free disk space (or fix permissions) and run the same command to resume")
        self.log(f"warning: {msg}; training continues (checkpoint.on_error=continue)")

    def load(self, ckpt: Path, *, restore_data: bool) -> dict[str, Any]:
        """Load a checkpoint's weights, this rank's optimizer state and (optionally) the loader
        position into the live objects; returns its train_state for the loop's own counters."""
        ts = store.read_json(ckpt / store.TRAIN_STATE)
        # either form of the weights (model_shards.py); ZeRO-3 reads just this rank's ranges of them
        wanted = {}
        if self.plan.zero3:
            from mspretrain.step.zero3 import wanted_ranges

            wanted = wanted_ranges(self.model, self.world, self.rank)
        elif self.plan.ep > 1:  # this rank's experts' rows of each stack, not the whole stacks
            wanted = self.step_fn.expert_ranges()
        self.step_fn.load_weights(read_pieces(ckpt, wanted))
        available = store.optimizer_keys(ckpt)
        if not available:
            raise UserError(f"checkpoint {ckpt.name} has no optimizer state",
                            "resume from a training checkpoint, or start a new --run dir from these weights")
        # only the part this rank holds is read (all of it unless the optimizer is sharded), from
        # whichever file has it: a sharded checkpoint resumes with any world size, sharded or not
        # (a split parameter's slices are re-cut to this world's slices: TrainStep.keys_to_read)
        opt = store.read_optimizer_tensors(ckpt, keys=self.step_fn.keys_to_read(available))
        self.step_fn.load_optimizer_state(opt, available=available)
        if self.ema is not None:
            self.ema.load(ckpt, self.log)
        if restore_data:
            self.loader.load_state(store.read_json(ckpt / store.DATA_STATE), allow_data_change=self.allow_data_change)
        return ts

    def rewind_target(self) -> Path | None:
        """The checkpoint to rewind to, the same on every rank (see the module docstring)."""
        self.saver.wait()
        if self.world == 1 or self.last_save_step is None:
            return store.latest_verified(self.paths.root, log=self.log)
        from mspretrain.checkpoint.shards import WAIT_S

        target = self.paths.step_dir(self.last_save_step)
        deadline = time.monotonic() + WAIT_S

        def check(deep: bool) -> str | None:
            # A file vanishing while it is hashed means rank 0 is still replacing the directory
            # (the loop used to save the rewound-to step again; trainer.py no longer does): not
            # usable yet, wait on rather than leave the job on a rank of its own.
            try:
                return store.verify(target, deep=deep)
            except OSError as exc:
                return f"it is being written ({exc.strerror or exc})"

        while check(deep=False) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        reason = check(deep=True)
        while reason is not None and reason.startswith("it is being written") and time.monotonic() < deadline:
            time.sleep(0.1)
            reason = check(deep=True)
        if reason is not None:
            self.log(f"spike: checkpoint {target.name} is not usable ({reason})")
            return None
        return target

    def latest_name(self) -> str:
        """The newest verified checkpoint's name, for messages ('scratch' if none)."""
        last = store.latest_verified(self.paths.root, log=lambda s: None)
        return last.name if last else "scratch"

    @property
    def stall_s(self) -> list[float]:
        return list(self.saver.stall_s)

    def wait(self) -> None:
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()
