"""Write a command's output directory (or file) without ever touching what the command did not write.

One helper for every command that writes a directory the user names with `--out` (export,
convert, tokenizer extend, report's plots) and for single output files (selftest --out):

    with OutputDir(out, "export", overwrite=args.overwrite, inputs=[ckpt_dir]) as tmp:
        ...write every file into tmp...   # then, on a clean exit of the block:
    # OUT now holds exactly those files plus OUT/.mspretrain-output.json (the marker), as one set

    write_output_file(path, text, "selftest", mark=lambda text: '"selftest"' in text)

What it guarantees:
- **Decided before anything is written.** `OutputDir(...)` refuses (a one-line UserError) before
  any byte is written: --out is a file; --out holds files this command did not write (only the
  names listed in an earlier output's marker are its own, so a user's notes, an HF folder made by
  someone else, or a checkpoint are never deleted); --out holds an earlier output and `overwrite`
  is False (for commands that require --overwrite); an input is --out itself or lies inside it
  (`tokenizer extend --with OUT/tokenizer.model --out OUT` would replace its own input).
- **Scratch names never collide.** The scratch dir is `tempfile.mkdtemp` beside --out, named
  `.OUTNAME.<pid>.<random>.partial` and holding a `.mspretrain-scratch` file. Only dirs of that
  shape whose marker is present and whose pid is dead are cleaned up later; a user's `X.tmp` or
  `.X.tmp` is never looked at.
- **Published as a set.** The files go into the scratch dir, the marker (command, and every
  file's size and sha256) is written last, and one `rename` puts the dir in place. Replacing an
  earlier output is two renames (old aside, new in) and then the old one is deleted: a kill at any
  point leaves either the old set or the new set at OUT (or OUT missing with the old set beside it
  as `.OUTNAME.<pid>.<random>.old`, which the next run puts back), never a mix.
  `check_set(dir)` tells a whole set from a torn one (a file whose bytes differ from the marker's).
  A torn earlier output is refused, not replaced: a listed file whose bytes changed was written by
  someone else (a user's edited tokenizer.json, fine-tuned weights saved into an export), and
  `tokenizer extend` replaces its earlier output without a flag.
- **One line on failure.** A full disk, a read-only directory, a missing parent: `OSError` while
  writing becomes a UserError naming the path and the cause, and the scratch dir is removed.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Callable, Iterable

from mspretrain.errors import UserError
from mspretrain.fsutil import chmod_like_open, new_file_mode, sha256_file

MARKER = ".mspretrain-output.json"
SCRATCH_MARK = ".mspretrain-scratch"


def os_error(exc: OSError, what: str, fix: str = "") -> UserError:
    """A one-line UserError for an OSError while writing `what` (disk full, read-only, missing dir)."""
    cause = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        fix = fix or "free disk space (or write to another disk) and run the same command again"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = fix or "write to a directory you can write to (fix its permissions or choose another --out)"
    elif exc.errno == errno.ENOENT:
        fix = fix or "create the directory first, or name a path in an existing one"
    where = f" ({exc.filename})" if exc.filename else ""
    return UserError(f"cannot write {what}: {cause}{where}", fix or "fix the cause above and run the same command again")


def read_marker(d: Path) -> dict | None:
    """The marker of an output dir (a dict with "command" and "files"), or None if absent or not ours."""
    try:
        doc = json.loads((Path(d) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("command"), str) or not isinstance(doc.get("files"), dict):
        return None
    return doc


def check_set(d: str | Path) -> str | None:
    """None when every file the marker lists is present with its size and sha256; else what is wrong
    (a torn set: one file replaced or missing, e.g. by a kill between separate writes of an older version)."""
    d = Path(d)
    marker = read_marker(d)
    if marker is None:
        return f"{d} has no readable {MARKER}"
    for name, info in marker["files"].items():
        p = d / name
        if not p.is_file():
            return f"{name} is missing"
        if not isinstance(info, dict) or p.stat().st_size != info.get("bytes") or sha256_file(p) != info.get("sha256"):
            return f"{name} is not the file written with the others (size or sha256 differs)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _ours(p: Path, out_name: str) -> tuple[int, str] | None:
    """(pid, kind) of a scratch/aside dir this module made for `out_name`, else None."""
    name = p.name
    prefix = f".{out_name}."
    if not name.startswith(prefix) or not (name.endswith(".partial") or name.endswith(".old")):
        return None
    pid = name[len(prefix):].split(".", 1)[0]
    if not pid.isdigit() or not (p / SCRATCH_MARK).is_file() or p.is_symlink():
        return None
    return int(pid), name.rsplit(".", 1)[1]


def _tidy(out: Path, log: Callable[[str], None]) -> None:
    """Put back an earlier output a killed publish left aside, and remove dead processes' scratch."""
    try:
        siblings = list(out.parent.iterdir())
    except OSError:
        return
    for p in siblings:
        found = _ours(p, out.name)
        if found is None or _pid_alive(found[0]):
            continue
        pid, kind = found
        if kind == "old" and not out.exists():
            (p / SCRATCH_MARK).unlink(missing_ok=True)
            os.rename(p, out)
            log(f"put back the earlier output {out} (an interrupted run had moved it aside)")
        else:
            shutil.rmtree(p, ignore_errors=True)


class OutputDir:
    """See the module docstring. `command` names the writer in the marker; `overwrite` is whether
    an earlier output of the same command may be replaced (export/convert: only with --overwrite;
    tokenizer extend: always); `inputs` are paths the command reads, refused if inside --out;
    `flag` is the option's name in messages; `known_names` are the file names the command writes
    (a dir of only those names but no marker gets a message of its own: it cannot be told whole)."""

    def __init__(self, out: str | Path, command: str, *, overwrite: bool, inputs: Iterable[str | Path] = (),
                 flag: str = "--out", known_names: Iterable[str] = (), log: Callable[[str], None] = lambda s: None) -> None:
        # absolute: `--out .` or `--out ..` has no name to make a scratch dir beside
        self.out, self.command, self.flag, self.log = Path(os.path.abspath(out)), command, flag, log
        self.scratch: Path | None = None
        out_abs = Path(os.path.abspath(self.out))
        for inp in inputs:
            real = Path(os.path.realpath(inp))
            if real == Path(os.path.realpath(out_abs)) or Path(os.path.realpath(out_abs)) in real.parents:
                raise UserError(f"{flag} {self.out} would replace an input of this command ({inp})",
                                f"choose a {flag} directory that holds none of the inputs")
        if self.out.is_symlink():  # the rename would replace the link, not what it points to
            raise UserError(f"{flag} {self.out} is a symbolic link", "name the real directory, or a new path")
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"{flag} {self.out} exists and is not a directory", "choose a new directory path")
        _tidy(self.out, log)
        self.replacing = False
        if self.out.is_dir():
            try:
                names = {p.name for p in self.out.iterdir()}
            except OSError as exc:
                raise os_error(exc, str(self.out)) from None
            if names:
                marker = read_marker(self.out)
                own = set(marker["files"]) | {MARKER, SCRATCH_MARK} if marker and marker["command"] == command else set()
                foreign = sorted(names - own)
                if foreign and marker is None and names <= set(known_names):
                    raise UserError(f"{flag} {self.out} holds `{command}` files without {MARKER} (an older version's output, "
                                    "or one a kill tore between its writes): it cannot be told whole, so it is not replaced",
                                    f"delete {self.out} yourself and run the same command again, or choose a new {flag}")
                if foreign:
                    shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
                    raise UserError(f"{flag} {self.out} already holds files `{command}` did not write ({shown}); nothing there is replaced",
                                    f"choose a new or empty {flag} directory (or move those files away)")
                torn = check_set(self.out)
                if torn is not None:  # a file changed after the set was written: its bytes are not ours to delete
                    raise UserError(f"{flag} {self.out} holds an earlier `{command}` output, but {torn}: someone changed it "
                                    "after it was written, so it is not replaced",
                                    f"move the changed file(s) away (or delete {self.out} yourself) and run the same command again")
                if not overwrite:
                    raise UserError(f"output directory {self.out} is not empty: it holds an earlier `{command}` output",
                                    f"choose another {flag}, or pass --overwrite to replace it")
                self.replacing = True

    def __enter__(self) -> Path:
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.scratch = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.{os.getpid()}.", suffix=".partial", dir=parent))
            os.chmod(self.scratch, new_file_mode(self.out, directory=True))  # mkdtemp's 0700 hid an export from the group
            (self.scratch / SCRATCH_MARK).write_text(self.command, encoding="utf-8")
        except OSError as exc:
            self._discard()
            raise os_error(exc, str(self.out)) from None
        return self.scratch

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if kind is not None:
            self._discard()
            if isinstance(exc, OSError):
                raise os_error(exc, str(self.out)) from None
            if type(exc).__name__ == "SafetensorError":  # safetensors reports a full disk as its own error type
                msg = str(exc).replace("Error while serializing: ", "")
                full = "code: 28" in msg or "StorageFull" in msg
                raise UserError(f"cannot write {self.out}: " + ("No space left on device" if full else msg.splitlines()[0][:200]),
                                "free disk space (or write to another disk) and run the same command again") from None
            return False
        try:
            self._publish()
        except OSError as e:
            self._discard()
            raise os_error(e, str(self.out)) from None
        return False

    def _publish(self) -> None:
        assert self.scratch is not None
        scratch = self.scratch
        (scratch / SCRATCH_MARK).unlink()
        for p in scratch.iterdir():
            if p.is_file():
                chmod_like_open(p)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(scratch.iterdir()) if p.is_file()}
        marker = {"command": self.command, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
        with open(scratch / MARKER, "w", encoding="utf-8") as f:  # last: its presence means the set is whole
            f.write(json.dumps(marker, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for p in scratch.iterdir():
            _fsync(p)
        _fsync(scratch)
        aside = None
        if self.out.is_dir() and any(self.out.iterdir()):
            aside = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.{os.getpid()}.", suffix=".old", dir=self.out.parent))
            os.rmdir(aside)
            (self.out / SCRATCH_MARK).write_text(self.command, encoding="utf-8")  # so a killed run's aside is put back
            os.rename(self.out, aside)
        elif self.out.is_dir():
            os.rmdir(self.out)  # an empty dir the user made: the new one takes its place
        os.rename(scratch, self.out)
        self.scratch = None
        _fsync(self.out.parent)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def _discard(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_output_file(path: str | Path, command: str, *, is_ours: Callable[[bytes], bool], flag: str = "--out") -> Path:
    """Refuse (one line) an output file path that cannot be written or must not be replaced: a
    directory, a missing parent dir, an existing file `is_ours(its first 4 KiB)` does not claim
    for this command (a symlink is never ours). Call it before the command's work, so a long run
    is not wasted on a refusal at the end."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory", f"name the file to write, e.g. {flag} {command}.json")
    if path.exists() or path.is_symlink():
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError:
            head = b""
        if path.is_symlink() or not is_ours(head):
            raise UserError(f"{flag} {path} exists and is not an earlier `{command}` output; refusing to replace it",
                            f"name a new file (or an earlier {command} output) with {flag}")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: the directory {path.parent} does not exist",
                        "create it first, or name a file in an existing directory")
    return path


def write_output_file(path: str | Path, data: str | bytes, command: str, *, is_ours: Callable[[bytes], bool],
                      flag: str = "--out") -> Path:
    """`check_output_file`, then write atomically (a unique temporary beside it, then a rename):
    a full disk or a read-only dir is a one-line UserError and leaves the old file whole."""
    from mspretrain.fsutil import atomic_write

    path = check_output_file(path, command, is_ours=is_ours, flag=flag)
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise os_error(exc, str(path)) from None
    return path


def refuse_torn(path: str | Path, what: str) -> None:
    """Refuse to read `path` when it belongs to an output set (its dir has a marker listing it) that
    is torn: a file of it was replaced or lost after the set was written."""
    path = Path(path)
    marker = read_marker(path.parent)
    if marker is None or path.name not in marker["files"]:
        return
    torn = check_set(path.parent)
    if torn is not None:
        raise UserError(f"{what} {path} belongs to a torn `{marker['command']}` output in {path.parent} ({torn})",
                        f"run `{marker['command']}` again to write the set whole")
