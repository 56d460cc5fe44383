"""Durability helpers shared by the writers of shards, data dirs, checkpoints and run files, and the
one way to read a JSON file a person may have edited or truncated."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from mspretrain.errors import UserError


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_range(src_fd: int, src_at: int, dst_fd: int, dst_at: int, count: int) -> None:
    """Copy `count` bytes from `src_at` in file `src_fd` to `dst_at` in file `dst_fd`, in the
    kernel (`copy_file_range`: the bytes never pass through this process); a read and a write
    where the kernel cannot (another filesystem, an old kernel)."""
    while count > 0:
        try:
            n = os.copy_file_range(src_fd, dst_fd, count, src_at, dst_at)
        except (AttributeError, OSError):
            n = 0
        if n <= 0:  # EXDEV, ENOSYS, EINVAL, or nothing copied: the plain way
            data = os.pread(src_fd, count, src_at)
            if len(data) != count:
                raise OSError(f"short read: {len(data)} of {count} bytes at {src_at}")
            while data:
                w = os.pwrite(dst_fd, data, dst_at)
                data, dst_at = data[w:], dst_at + w
            return
        src_at, dst_at, count = src_at + n, dst_at + n, count - n


def _read_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


# read once, at import (the main thread, before any writer thread starts): reading it later would
# set it for an instant under the metrics writer's and the async checkpoint saver's threads
_UMASK = _read_umask()


def _umask() -> int:
    return _UMASK


def new_file_mode(path: str | Path, *, directory: bool = False) -> int:
    """The mode a file (or dir) written at `path` should get: the mode of the one it replaces, else
    what `open()` (`mkdir`) would give under the umask. mkstemp/mkdtemp make 0600/0700, which turned
    every atomically written file (a data dir's tokenizer, an export, a run's config.toml) private
    to its writer, and changed the mode of a file it replaced."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return (0o777 if directory else 0o666) & ~_umask()


def chmod_like_open(path: str | Path) -> None:
    """Give a file this process just wrote the mode `open()` would have (0666 under the umask):
    the safetensors library creates its files 0600, so checkpoints and exports were unreadable
    to the user's group."""
    os.chmod(path, 0o666 & ~_umask())


@contextmanager
def atomic_writer(path: str | Path, *, text: bool = False, fsync: bool = True) -> Iterator[IO]:
    """A file to write `path` through, in pieces: a reader, or a crash at any moment, sees either
    the old file whole or the new one whole, never a torn one. `text=True` writes UTF-8 text.

    The temporary file lives in the same directory (os.replace is atomic only within one
    filesystem) and is removed if the block raises. `fsync=False` skips both fsyncs: still atomic
    for readers, but not durable across a power cut (for caches, or files the caller fsyncs later)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode(path))
        with os.fdopen(fd, "w", encoding="utf-8") if text else os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_path(path.parent)  # makes the rename itself survive a crash


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file, read in 16 MB blocks (weights, tokenizers, output sets)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_cache_dir() -> Path:
    """Where mspretrain keeps what it can rebuild (the demo corpus, prepare's character table, the
    measured CPU peak): `$MSPRETRAIN_CACHE`, else `~/.cache/mspretrain`."""
    env = os.environ.get("MSPRETRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mspretrain"


def atomic_write(path: str | Path, data: bytes | str, *, fsync: bool = True) -> None:
    """Replace `path` with `data` atomically (see `atomic_writer`); `str` is written as UTF-8."""
    with atomic_writer(path, fsync=fsync) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else bytes(data))


def read_json(path: str | Path, fix: str) -> Any:
    """The parsed JSON of `path`, or a one-line UserError naming the file (unreadable, not UTF-8,
    not JSON). Whether the file exists, and what the document must hold, is the caller's to say."""
    path = Path(path)
    data = read_regular_bytes(path, JSON_CAP, "JSON file", fix)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not valid JSON (not UTF-8 at byte {e.start})", fix) from None
    return loads_json(text, str(path), fix)


# Size caps per kind of file a command reads whole. A run's logs grow a line per step (a 1M-step
# run writes ~300 MB of metrics); JSON state files are a few KB. Anything larger is not the file
# the command expects (e.g. a symlink to /dev/zero, a copied dataset), and reading it whole would
# exhaust the host's memory before a single line is judged.
LOG_CAP = 2 << 30  # metrics.jsonl, batches.jsonl, train.log
JSON_CAP = 64 << 20  # run_meta.json, train_state.json, manifests, heartbeats, verdicts
TEXT_CAP = 256 << 20  # an eval file, a document list


def _open_regular(path: Path, cap: int, what: str, fix: str) -> tuple[int, os.stat_result]:
    """A non-blocking descriptor of `path` and its stat, after checking on the open descriptor that
    it is a regular file of at most `cap` bytes (so a swap between check and read cannot slip
    through); else a one-line UserError. The caller closes the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UserError(f"cannot read {what} {path} ({e.strerror or e})", fix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a directory" if stat.S_ISDIR(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file")
            raise UserError(f"cannot read {what} {path}: it is {kind}, not a regular file", fix)
        if st.st_size > cap:
            raise UserError(f"{what} {path} is {st.st_size:,} bytes, more than the {cap:,} such a file can hold", fix)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular_bytes(path: str | Path, cap: int, what: str, fix: str = "") -> bytes:
    """The bytes of `path`, which must be a regular file (after symlinks) of at most `cap` bytes;
    else a one-line UserError naming `what` it should have been. A FIFO, a device (/dev/zero), a
    socket or a directory is refused without blocking (`_open_regular`)."""
    path = Path(path)
    fix = fix or f"replace {path} with the {what} it should be"
    fd, _ = _open_regular(path, cap, what, fix)
    try:
        chunks, total = [], 0
        while True:  # read to EOF, but never past the cap (a file still growing)
            chunk = os.read(fd, min(1 << 24, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise UserError(f"{what} {path} grew past the {cap:,} bytes such a file can hold", fix)
        return b"".join(chunks)
    except OSError as e:
        raise UserError(f"cannot read {what} {path} ({e.strerror or e})", fix) from None
    finally:
        os.close(fd)


def read_regular_text(path: str | Path, cap: int, what: str, fix: str = "", *, errors: str = "strict") -> str:
    """`read_regular_bytes` decoded as UTF-8; with errors="strict" a byte that is not UTF-8 is a
    one-line error naming its offset ("replace" is for logs a crash may have cut mid-character)."""
    data = read_regular_bytes(path, cap, what, fix)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {e.start})", fix or f"replace {path} with the {what} it should be") from None


def loads_json(text: str, what: str, fix: str = "") -> Any:
    """json.loads with every failure one line: a syntax error, and also nesting so deep the
    parser recurses past Python's stack (`[[[[...` of 100k brackets raises RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"{what} is nested too deeply to be a record this tool wrote", fix or "replace the file") from None
    except ValueError as e:
        raise UserError(f"{what} is not valid JSON ({' '.join(str(e).split())[:200]})", fix or "replace the file") from None


def read_json_file(path: str | Path, what: str, fix: str = "", cap: int = JSON_CAP) -> Any:
    """A JSON state file: a regular file under `cap`, UTF-8, valid JSON, not absurdly nested."""
    return loads_json(read_regular_text(path, cap, what, fix), f"{what} {path}", fix)


def jsonl_dicts(text: str) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, record or None) for each non-blank line of a JSON-lines log: None for a line
    that is not a JSON object (cut by a crash, edited, nested past the stack). The callers decide
    whether a bad line is skipped (plots) or named (the audit)."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            rec = None
        yield n, rec if isinstance(rec, dict) else None


def stream_lines(path: str | Path, cap: int, what: str, fix: str = "", max_line: int = 1 << 20) -> Iterator[str]:
    """The lines of a regular file (newline kept, UTF-8 with errors replaced) in bounded memory:
    the file must be regular and at most `cap` bytes (as `read_regular_bytes`), and a line longer
    than `max_line` is cut there (its rest is skipped), so a log of one endless line is still read
    in bounded memory."""
    path = Path(path)
    fix = fix or f"replace {path} with the {what} it should be"
    read_regular_bytes_check(path, cap, what, fix)
    with open(path, "rb") as f:
        total = 0
        while True:
            raw = f.readline(max_line)
            if not raw:
                return
            total += len(raw)
            if total > cap:
                raise UserError(f"{what} {path} grew past the {cap:,} bytes such a file can hold", fix)
            if not raw.endswith(b"\n") and len(raw) == max_line:
                while (rest := f.readline(max_line)) and not rest.endswith(b"\n"):  # skip the over-long rest
                    total += len(rest)
                    if total > cap:
                        raise UserError(f"{what} {path} grew past the {cap:,} bytes such a file can hold", fix)
            yield raw.decode("utf-8", errors="replace")


def read_regular_bytes_check(path: str | Path, cap: int, what: str, fix: str = "") -> None:
    """The checks of `read_regular_bytes` (a regular file, at most `cap` bytes) without reading it."""
    path = Path(path)
    fd, _ = _open_regular(path, cap, what, fix or f"replace {path} with the {what} it should be")
    os.close(fd)


def file_kind(path: str | Path) -> str:
    """What `path` is, for an error line: "a file" (regular), "a directory", "a FIFO", "a device",
    "a socket", "a symbolic link to nothing", or "missing" (symlinks followed, never opened)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else "missing"
    except OSError as e:  # a symlink loop, a name too long, a parent that is a file
        return f"unreachable ({e.strerror or e})"
    mode = st.st_mode
    return ("a file" if stat.S_ISREG(mode) else "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")


def why_not(path: str | Path, want: str = "a regular file") -> str:
    """The end of "X ..." when `path` is not `want` ("a regular file" or "a directory"):
    "does not exist", or "is a FIFO, not a regular file" (a FIFO was reported as missing)."""
    kind = file_kind(path)
    return "does not exist" if kind == "missing" else f"is {kind}, not {want}"


def cut_back(f: IO[bytes] | str | Path, size: int) -> None:
    """Cut a file (a path, or a file opened for writing) back to the `size` bytes a commit of
    `prepare`'s journal recorded: the torn tail a kill left goes. A file shorter than that lost
    bytes the commit said were written (a damaged or edited work dir): `truncate` would pad it
    with zeros, which would pass for data, so it is refused instead."""
    if isinstance(f, (str, Path)):
        with open(f, "r+b") as g:
            cut_back(g, size)
        return
    have = os.fstat(f.fileno()).st_size
    if have < size:
        raise UserError(f"{f.name} holds {have:,} bytes, fewer than the {size:,} that prepare's progress journal "
                        "recorded for it: the interrupted prepare's work dir was damaged after the kill, and cannot be resumed",
                        "run the same command again: prepare removed the damaged work dir, and starts over")
    f.truncate(size)


# ----------------------------------------------------------------------------- a lock beside an output

LOCK_KEYS = ("pid", "host", "command", "since")  # what `checkpoint/lock.py` writes into a run dir's lock too


def _lock_holder(text: str) -> str | None:
    """'PID 1 on host h (cmd, since t)' of a lock file's text; "" for an empty one (a kill between
    its creation and its first write); None when the text is not a lock file mspretrain wrote."""
    if not text.strip():
        return ""
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(info, dict) or set(info) != set(LOCK_KEYS) or not isinstance(info.get("pid"), int):
        return None
    return f"PID {info['pid']} on host {info['host']} ({info['command']}, since {info['since']})"


@contextmanager
def locked_beside(path: str | Path, command: str, what: str, log: Any = print) -> Iterator[None]:
    """Hold an exclusive `flock` on the lock file `path` (beside an output that has no dir of its
    own yet: `prepare --out NAME` locks `.NAME.lock`) for the block, then remove it. As
    `checkpoint/lock.py` locks a run dir: the kernel drops the lock when the process dies (even by
    SIGKILL), so a stale file never blocks; the PID and host inside are for the message. A file of
    that name that is not such a lock (a user's) is refused, never replaced; a second holder is
    refused in one line naming the first."""
    import errno
    import fcntl
    import socket
    import time

    path = Path(path)
    fix = f"move {path} away (it is not a lock file mspretrain wrote), or choose another {what}"
    while True:
        if os.path.lexists(path):
            if os.path.islink(path) or not path.is_file():
                raise UserError(f"{path} is {file_kind(path) if not os.path.islink(path) else 'a symbolic link'}, not the lock "
                                f"file mspretrain keeps beside {what}", fix)
            if _lock_holder(read_regular_text(path, 1 << 16, "lock file", fix, errors="replace")) is None:
                raise UserError(f"{path} is not a lock file mspretrain wrote; it is left as it is", fix)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise UserError(f"cannot create the lock file {path}: {exc.strerror}", f"choose a {what} in a directory you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                try:
                    who = _lock_holder(read_regular_text(path, 1 << 16, "lock file", fix, errors="replace")) or "another process"
                except UserError:
                    who = "another process"
                raise UserError(f"{what} is in use by {who}", "wait for it to finish (or stop it), or choose another output") from None
            log(f"warning: cannot lock {path} ({exc.strerror}); make sure no other process writes {what}")
            yield
            return
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file as we opened it: lock the new one
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except OSError as exc:
        Path(path).unlink(missing_ok=True)
        os.close(fd)
        raise UserError(f"cannot write the lock file {path}: {exc.strerror}", "free disk space, or choose another output") from None
    try:
        yield
    finally:
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.unlink(path)  # while still held: whoever opens it next finds another inode and tries again
        except OSError:
            pass
        os.close(fd)


def command_output(argv: list[str], *, cap: int = 1 << 20, timeout_s: float = 20.0) -> str | None:
    """The standard output of `argv` as text (bytes that are not UTF-8 replaced), or None when it
    cannot start, exits non-zero, prints more than `cap` bytes or runs past `timeout_s`: then it is
    killed. For tools whose output is parsed (npu-smi): `subprocess.run(capture_output=True)`
    held all of an endless output in memory, and `text=True` raised on a non-UTF-8 byte."""
    import selectors
    import subprocess
    import time

    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    except (OSError, ValueError):
        return None
    deadline = time.monotonic() + timeout_s
    chunks, total, ok = [], 0, True
    assert proc.stdout is not None
    with proc, selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                ok = False  # ran past the timeout
                break
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                ok = False
                break
        if not ok:
            proc.kill()
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # closed its output but has not exited
            proc.kill()
            proc.wait()
            return None
    return b"".join(chunks).decode("utf-8", errors="replace") if ok and code == 0 else None
