"""Metrics sinks: `metrics.jsonl` (always) and TensorBoard events, written off the training thread.

Design choices:
- Each metric is kept only at its own interval (field report §3.7: loss and lr every step, grad
  norm every 50, memory every 200, throughput every 10). Any key without an interval (`skipped`,
  `eval/ppl`, `spike`, ...) is kept whenever it is logged, so rare events are never sampled away.
- The training thread only puts a dict on a queue; one writer thread appends the JSON line and
  the TensorBoard scalars. A slow disk (the field report's NFS stall) then delays the metrics,
  not the step. The trade-off: a hard crash can lose the last few queued records; `close()`
  drains the queue, and every JSON line is flushed as soon as it is written.
- Resume truncates `metrics.jsonl` to steps <= the checkpoint's step (an atomic rewrite) and
  opens TensorBoard with `purge_step`, so neither series holds the replayed steps twice.
- Non-finite values are written as JSON `NaN`/`Infinity` (Python's json reads them back): a NaN
  loss is exactly what a reader of this file must be able to see.
- Rank 0 only: `enabled=False` writes nothing and starts no thread.
"""
from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable

from mspretrain.config.schema import MetricsConfig
from mspretrain.fsutil import LOG_CAP, atomic_write, read_regular_text
from mspretrain.monitor.callback import Callback, Values
from mspretrain.paths import RunPaths

THROUGHPUT_KEYS = ("tokens_per_s", "samples_per_s", "mfu", "peak_tflops", "real_token_share",
                   "tokens_per_device_hour", "cost_per_btok")
# metric key -> name of its interval field in MetricsConfig; keys not listed are always kept.
INTERVAL_FIELD: dict[str, str] = {
    "loss": "loss_every", "lr": "lr_every", "loss_scale": "loss_scale_every",
    "grad_norm": "grad_norm_every", "mem_mb": "memory_every",
    "device_mem_mb": "memory_every", "device_mem_reserved_mb": "memory_every",
    **{k: "throughput_every" for k in THROUGHPUT_KEYS},
}

# Filesystems where a blocking writer can stall the process: network, cluster and FUSE mounts.
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "ceph", "glusterfs", "lustre",
              "gpfs", "beegfs", "9p", "afs", "davfs", "sshfs", "ncpfs", "orangefs", "cvmfs")

MOUNTINFO = Path("/proc/self/mountinfo")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def mount_of(path: str | Path, mountinfo: str | Path = MOUNTINFO) -> tuple[str, str, str] | None:
    """(mount point, filesystem type, source) of the mount holding `path`, from a mountinfo file."""
    try:
        text = Path(mountinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    for line in text.splitlines():
        parts = line.split()
        if " - " not in line or len(parts) < 5:
            continue
        mount_point = _unescape(parts[4])
        after = line.split(" - ", 1)[1].split()
        fstype, source = (after + ["", ""])[:2]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        # The longest matching mount point wins; a later line for the same point overmounts it.
        if inside and (best is None or len(mount_point) >= len(best[0])):
            best = (mount_point, fstype, source)
    return best


def is_network_fs(fstype: str) -> bool:
    base = fstype.split(".")[0].lower()
    return base == "fuse" or base == "fuseblk" or base in NETWORK_FS or fstype.lower() in NETWORK_FS


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def truncate_metrics(path: Path, keep_through_step: int) -> int:
    """Drop lines with step > keep_through_step (and unreadable lines); atomic rewrite. Returns lines dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in read_regular_text(path, LOG_CAP, "metrics log", errors="replace").splitlines():
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and int(rec["step"]) <= keep_through_step
        except (ValueError, KeyError, TypeError, RecursionError):
            ok = False  # a partial line from a killed writer
        if ok:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write(path, "".join(line + "\n" for line in kept))
    return dropped


def _scalar(v: Any) -> float | int | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    try:
        return float(v)  # numpy / MindSpore scalars
    except (TypeError, ValueError):
        return None


def _summary_writer():
    """tensorboardX's SummaryWriter without the `import torch` tensorboardX makes when torch is
    installed (only to type-hint torch tensors; we log floats): ~2 s of CPU at every start of a
    rank 0 where torch is installed (the test extra), for nothing. Torch stays importable after."""
    import sys

    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  `import torch` raises ImportError: tensorboardX's fallback
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsLogger(Callback):
    """Samples metrics at their intervals and writes them off the training thread."""

    def __init__(self, run_dir: Path, cfg: MetricsConfig, *, enabled: bool = True,
                 resume_step: int | None = None, log: Callable[[str], None] = print,
                 mountinfo: str | Path = MOUNTINFO) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.enabled = enabled
        self._log = log
        self._error_reported = False
        self._closed = False
        self.path = RunPaths(self.run_dir).metrics
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        mount = mount_of(_nearest_existing(self.run_dir), mountinfo)
        if mount and is_network_fs(mount[1]):
            log(f"warning: run dir {self.run_dir} is on a network filesystem ({mount[1]} at {mount[0]}); "
                "a blocking metrics/checkpoint write there can stall training — prefer a local disk and sync afterwards")
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if cfg.tensorboard:
            SummaryWriter = _summary_writer()  # imported here: rank != 0 never pays for it

            # purge_step makes TensorBoard hide events >= it from earlier files of this run.
            self._tb = SummaryWriter(logdir=str(RunPaths(self.run_dir).tb), flush_secs=30,
                                     purge_step=None if resume_step is None else resume_step + 1)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._writer, name="metrics-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread

    def keep(self, step: int, key: str) -> bool:
        """Whether `key` is sampled at `step` (its interval divides the step)."""
        field = INTERVAL_FIELD.get(key)
        return field is None or step % getattr(self.cfg, field) == 0

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log() after close()")
        record: dict[str, Any] = {"step": int(step)}
        for key, value in values.items():
            if key.startswith("_"):  # for the loop's components (e.g. `_row_nll`), not a metric
                continue
            v = _scalar(value)
            if v is not None and self.keep(step, key):
                record[key] = v
        if len(record) > 1:
            self._queue.put(record)

    def log_metrics(self, step: int, values: Values) -> None:
        """The train loop's hook (monitor/callback.py): the step's record, once every callback added its keys."""
        self.log(step, values)

    def flush(self) -> None:
        """Block until every queued record is on disk (tests, report of a live run)."""
        if self.enabled and not self._closed:
            self._queue.join()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writer thread

    def _writer(self) -> None:
        while True:
            record = self._queue.get()
            try:
                if record is None:
                    return
                self._write(record)
            except Exception as exc:  # a metrics write must never kill training; say it once
                if not self._error_reported:
                    self._error_reported = True
                    self._log(f"warning: metrics write failed ({exc}); training continues, later metrics may be missing")
            finally:
                self._queue.task_done()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step":
                    self._tb.add_scalar(key, value, step)
