"""One writer per run dir: an exclusive `flock` on `RUN_DIR/.mspretrain.lock`.

Two `train` processes on one `--run` would interleave their metrics and replace each other's
checkpoints and config; `recover` rewriting a manifest under a live trainer is as bad. Whoever
writes a run dir takes this lock first, and anyone else is refused in one line naming the
holder's PID and host.

Design choices:
- `fcntl.flock` on a file inside the run dir, held for the life of the process: the kernel drops
  it when the process dies (even by SIGKILL), so a stale lock never blocks the next run and no
  "is that PID still alive?" guessing is needed. The PID and host written into the file are for
  the error message only; the lock itself is the kernel's.
- Per process the lock is re-entrant: flock conflicts between two open files of the same process,
  and a process that trains and then recovers the same run dir (tests, notebooks) is one writer.
- Under msrun only rank 0 takes it (the caller decides): the other ranks of the same job write
  their optimizer shards into the same run dir by design.
- On NFS, flock is emulated with POSIX locks by Linux (nfs(5), "local_lock"); it still excludes
  other hosts on NFSv4. On filesystems without locks (some FUSE mounts) `flock` fails with
  ENOLCK/EOPNOTSUPP: then we proceed with a warning rather than refuse every run.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from mspretrain.errors import UserError
from mspretrain.paths import RunPaths

LOCK_NAME = RunPaths(".").lock.name  # for callers that list a run dir's files

# path of the lock file (resolved) -> open fd, for the life of the process
_held: dict[str, int] = {}


def _holder(path: Path) -> str:
    """'PID 123 on host h (since ...)' from the lock file, or a vaguer phrase if it is unreadable."""
    try:
        from mspretrain.fsutil import read_json_file

        info = read_json_file(path, "lock file", cap=1 << 16)
        return f"PID {int(info['pid'])} on host {info['host']} ({info.get('command', '?')}, since {info.get('since', '?')})"
    except (UserError, ValueError, KeyError, TypeError, AttributeError):
        return "another process"


# What `train` (and the commands that write into a run: report, spike records, launch's
# watchdog, `--restart`) put at the top of a run dir. A dir holding anything else, and no
# run_meta.json, is not a run dir: a data dir, an HF folder, a checkpoint, a user's folder.
RUN_NAMES = frozenset({"config.toml", "metrics.jsonl", "tb", "train.log", "run_meta.json", "tokenizer.model",
                       "tokenizer.json", "checkpoints", ".mspretrain.lock", "batches.jsonl", "heartbeat", "spikes",
                       "profile", "report", "msrun_log"})  # launch's default --log-dir, when run from the run dir


def foreign_entries(run_dir: Path) -> list[str]:
    """The names in an existing dir that make it not a run dir (empty for a run dir, a new or an
    empty dir). A dir with run_meta.json is a run dir whatever else the user keeps in it (notes);
    without one (a run killed before its first write ends, or a config placed there first) every
    name must be one `train` writes."""
    try:
        if (run_dir / RunPaths(".").meta.name).is_file():
            return []
        names = sorted(p.name for p in run_dir.iterdir())
    except OSError:
        return []
    # hidden names (.DS_Store, an editor's swap file) say nothing about what the dir is
    return [n for n in names if n not in RUN_NAMES and not n.startswith(("checkpoints.failed-", "."))]


def ensure_run_dir(run_dir: Path, command: str = "train") -> Path:
    """Create the run dir, or refuse in one line when it cannot be one (a file, read-only, a dir
    of other files: `train --run DATA_DIR` replaced its tokenizer, `--run` on a user's folder its
    config.toml). This is the first write of `train` and `recover`, so the refusal touches nothing."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run {run_dir} is a file, not a directory", "pass a directory (it is created if missing)")
    foreign = foreign_entries(run_dir) if run_dir.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UserError(f"{run_dir} is not a run dir: it holds files `mspretrain train` does not write ({shown}) and no "
                        f"run_meta.json; `{command}` leaves it alone",
                        "pass a new or empty directory, or the run dir of an earlier `mspretrain train`")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"--run {run_dir}: a parent of it is a file", "pass a path under a directory") from None
    except OSError as exc:
        raise UserError(f"cannot create run dir {run_dir}: {exc.strerror}", "pass a --run dir you can write to") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UserError(f"run dir {run_dir} is not writable", "fix its permissions or pass another --run dir")
    return run_dir


def acquire(run_dir: str | Path, command: str, log: Callable[[str], None] = print) -> Path:
    """Take the run dir's lock for the rest of this process's life; refuse if another holds it."""
    made = not os.path.lexists(run_dir)
    run_dir = ensure_run_dir(Path(run_dir), command)
    path = RunPaths(run_dir).lock
    key = str(path.resolve())
    if key in _held:
        try:
            same = os.path.samestat(os.fstat(_held[key]), os.stat(path))
        except OSError:
            same = False
        if same:
            return path
        os.close(_held.pop(key))  # the run dir was deleted and made again: lock the new file
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UserError(f"cannot open the lock file {path}: {exc.strerror}", "pass a --run dir you can write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise UserError(f"run dir {run_dir} is in use by {_holder(path)}",
                            "wait for it to finish (or stop it), or use another --run dir") from None
        log(f"warning: cannot lock {run_dir} ({exc.strerror}); make sure no other process writes to it")
        return path
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except OSError as exc:  # a full disk or a quota: the run could not write a checkpoint either
        os.close(fd)
        if made:  # a run dir this call made is taken away again: a refused new run leaves nothing
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise UserError(f"cannot write in run dir {run_dir}: {exc.strerror}",
                        "free disk space (or pass a --run dir on another disk) and run the same command again") from None
    _held[key] = fd
    return path


def release(run_dir: str | Path) -> None:
    """Drop this process's lock on `run_dir` early (exit drops it anyway)."""
    key = str(RunPaths(run_dir).lock.resolve())
    fd = _held.pop(key, None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor releases the flock
