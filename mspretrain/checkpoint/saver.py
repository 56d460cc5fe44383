"""Saving checkpoints without stalling training.

Design choices: at the step boundary the trainer copies parameters and moments to host memory
(the only part that must block, since the next step overwrites them); a background thread then
writes, hashes, fsyncs and renames. A second save waits for the first, and `close()` waits for
the last, so at most one extra copy of the state lives in host memory. A failed write (disk
full, permissions) leaves the previous checkpoints intact and removes its temp dir; the error is
kept and handed to the trainer at the next save or at close, which then stops or goes on per
`checkpoint.on_error`.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mspretrain.checkpoint import shards
from mspretrain.checkpoint.model_shards import model_shard_name
from mspretrain.checkpoint.store import _sha256, optimizer_shard_name, prune, step_dir_name, write_checkpoint_dir
from mspretrain.checkpoint.tensor_file import save_tensors
from mspretrain.config.schema import Config
from mspretrain.fsutil import chmod_like_open, fsync_path
from mspretrain.paths import RunPaths


class Saver:
    def __init__(self, run_dir: Path, *, keep_last: int, keep_every: int, async_save: bool = True,
                 log: Callable[[str], None] = print) -> None:
        self.root = RunPaths(run_dir).checkpoints
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_save = async_save
        self.log = log
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved: int | None = None
        self.stall_s: list[float] = []  # time the training thread was blocked per save
        self.write_s: list[float] = []  # time the writer took per save

    def save(self, *, step: int, model: dict[str, np.ndarray], optimizer: dict[str, np.ndarray] | None,
             train_state: dict[str, Any], data_state: dict[str, Any] | None, config: Config,
             tokenizer_path: Path | None, stall_started: float | None = None, world: int = 1,
             model_metadata: dict[str, str] | None = None,
             extra: dict[str, tuple[dict[str, np.ndarray], dict[str, str]]] | None = None) -> None:
        """Hand a host copy of the state to the writer. Raises a previous write's error first.

        world > 1: `optimizer` is rank 0's shard of a sharded run; the other ranks' shards are
        collected (see checkpoint/shards.py) before the manifest is written. `model_metadata`
        (ZeRO-3): `model` is rank 0's weight slices, written as its per-rank weight file. `extra`:
        more files {name: (tensors, metadata)} for the checkpoint dir (the EMA, train/ema.py)."""
        kwargs: dict[str, Any] = dict(step=step, model=model, optimizer=optimizer, train_state=train_state,
                                      data_state=data_state, config=config, tokenizer_path=tokenizer_path)
        if model_metadata is not None:
            kwargs.update(model_file=model_shard_name(0, world), model_metadata=model_metadata)
        if world > 1:
            kwargs["optimizer_file"] = optimizer_shard_name(0, world)
        if world > 1 or extra:
            kwargs["collect"] = lambda tmp: dict(_write_extra(tmp, extra or {}),
                                                 **(shards.collect(self.root, step, world, tmp) if world > 1 else {}))
        self._start(self._write, kwargs, step, stall_started)

    def save_shard(self, *, step: int, rank: int, world: int, optimizer: dict[str, np.ndarray],
                   stall_started: float | None = None, model: dict[str, np.ndarray] | None = None,
                   model_metadata: dict[str, str] | None = None,
                   extra: dict[str, tuple[dict[str, np.ndarray], dict[str, str]]] | None = None) -> None:
        """Rank R > 0 of a sharded run: write this rank's optimizer shard (and, ZeRO-3, its weight
        slices; with train.ema_decay under ZeRO, its EMA file) for rank 0 to publish."""
        self._start(self._write_shard, dict(step=step, rank=rank, world=world, tensors=optimizer, model=model,
                                            model_metadata=model_metadata, extra=extra), step, stall_started)

    def _start(self, target: Callable[..., None], kwargs: dict[str, Any], step: int, stall_started: float | None) -> None:
        t0 = stall_started if stall_started is not None else time.perf_counter()
        self.wait()
        self.root.mkdir(parents=True, exist_ok=True)
        if self.async_save:
            self._thread = threading.Thread(target=target, kwargs=kwargs, name=f"ckpt-{step}", daemon=False)
            self._thread.start()
        else:
            target(**kwargs)
            self.raise_error()
        self.stall_s.append(time.perf_counter() - t0)

    def _write(self, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        step = kwargs["step"]
        try:
            write_checkpoint_dir(self.root / step_dir_name(step), **kwargs)
            self.last_saved = step
            prune(self.root.parent, self.keep_last, self.keep_every, log=self.log)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            self._error = exc
        finally:
            self.write_s.append(time.perf_counter() - t0)

    def _write_shard(self, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            shards.write_shard(self.root, **kwargs)
            self.last_saved = kwargs["step"]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            self._error = exc
        finally:
            self.write_s.append(time.perf_counter() - t0)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        self.wait()


def _write_extra(tmp: Path, extra: dict[str, tuple[dict[str, np.ndarray], dict[str, str]]]) -> dict[str, dict[str, Any]]:
    """Rank 0's extra files written into the checkpoint's tmp dir: their manifest entries."""
    entries = {}
    for name, (tensors, meta) in sorted(extra.items()):
        save_tensors(tensors, tmp / name, meta)
        chmod_like_open(tmp / name)
        fsync_path(tmp / name)
        entries[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
    return entries
