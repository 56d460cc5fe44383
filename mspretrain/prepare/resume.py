"""`prepare`'s progress journal: what a run killed with kill -9 resumes from.

Layout (additions next to the data dir `NAME` that `prepare --out NAME` writes):
    .NAME.progress.json   the journal: JSON, replaced atomically (fsync + rename) at each commit
    .NAME.partial/.resume/ state too big or too Pythonic for the journal (pickles, dedup bitmaps,
                          `replay.log`: the replay's tokenizer sample and held documents, or
                          `sample-N.npy`: the sample's heap by reference, per-chunk path);
                          removed before the data dir is published
    .NAME.partial/dedup.tmp/PART.decided  a dedup partition's result (its commit: see diskdedup)
The journal sits beside the work dir `.NAME.partial/`, not in it, because publishing moves the
whole work dir into place: a kill after that rename must still find the journal (stage
"publish") to know that the data dir is finished.

Design choices:
- The journal's first write, before any work, is the run's fingerprint (`fingerprint`): the
  inputs (names, sizes, mtimes), every config value, the tokenizer's bytes, `--seq-len`, the
  version. A rerun whose fingerprint differs is refused in one line naming the difference, and
  nothing is touched. `--workers`, `--overwrite` and the progress bar are not in it: the output
  is the same for any of them.
- A commit names the last unit whose results are durable: the data files are flushed and
  fsynced first, then the journal is replaced. Whatever was written after the last commit (a
  torn tail after kill -9) is truncated away on resume, using the byte lengths the journal holds.
- Commits come once every worker has finished about one unit (chunk) since the last commit, but
  at most every `MIN_COMMIT_SECONDS`, and at least every `COMMIT_SECONDS`: a kill redoes about
  one unit per worker of the stage that was running, plus the units in flight (`Journal.due`).
- A periodic commit's fsyncs run in a thread (`commit(background=True)`; pass 1's fsync every
  dedup partition file: ~0.1 s for 640 files) while the stage goes on; the journal is replaced
  only after they are done, and the next commit waits for it (a stage's last commit is made in
  the caller's thread). The files grow past the committed
  lengths meanwhile, which a resume cuts off as it does a torn tail.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from mspretrain import __version__
from mspretrain.config.schema import PrepareConfig
from mspretrain.errors import UserError, env_number
from mspretrain.fsutil import atomic_write, cut_back, read_json_file
from mspretrain.prepare.publish import fsync_all

# The journal's format. 2: the chain's first stage may be the score scan ("scan"), and a fresh
# journal names no stage until the runner commits the first (issue 40). A work dir whose journal has
# another version is not resumed but started over (`read` returns None): resuming a version-1 scan
# at pass 1 would take thresholds from a half-written score file.
VERSION = 2
COMMIT_SECONDS = 10.0  # at most this much time between commits (MSPRETRAIN_PREPARE_COMMIT_SECONDS overrides)
MIN_COMMIT_SECONDS = 1.0  # at least this much: bounds the commits' cost (a few fsyncs each) to a few % of the stage
STATE_DIR = ".resume"  # in the work dir; never published
WORK_MARK = "prepare-work"  # in STATE_DIR: the work dir is prepare's own (see Journal._ours)
# The journal's own keys: what makes a file of its name prepare's (`Journal.read`). `check` is the
# SHA-256 of the rest, so a journal edited by hand or damaged (a negative offset, a stage no chain
# has, a list where a count was) is never resumed from: every value a resume reads is one a commit wrote.
FORMAT = "mspretrain-prepare-progress"


_background: threading.Thread | None = None  # the latest background commit (for `point`'s test kill only)


def commit_seconds() -> float:
    """Seconds between commits. The environment variable is for tests (0: after every unit)."""
    return env_number("MSPRETRAIN_PREPARE_COMMIT_SECONDS", COMMIT_SECONDS)  # a bad value: one line, not a ValueError


def point(name: str, written: Callable[[], object] | None = None) -> None:
    """A unit boundary: the unit's data was handed to its files, the commit comes next.
    Test-only hooks (documented in docs/operators.md as such): MSPRETRAIN_PREPARE_TEST_POINTS=1
    prints `prepare-point: NAME` to stderr at each one, and MSPRETRAIN_PREPARE_TEST_KILL=NAME
    makes the process kill itself with SIGKILL there, after `written()` pushed the unit's
    buffered bytes to the files: the uncommitted tail a kill leaves, which a resume must cut off."""
    if os.environ.get("MSPRETRAIN_PREPARE_TEST_POINTS"):
        print(f"prepare-point: {name}", file=sys.stderr, flush=True)
    if os.environ.get("MSPRETRAIN_PREPARE_TEST_KILL") == name:
        import signal

        if written is not None:
            written()
        if _background is not None and _background.is_alive():  # the kill lands after the commit before it, as named
            _background.join()
        os.kill(os.getpid(), signal.SIGKILL)


def fingerprint(inputs: list[str], paths: list[Path], names: list[str], cfg: PrepareConfig,
                tokenizer: tuple[str, str] | None, seq_len: int | None, quality: dict | None = None) -> dict:
    """What makes the output what it is: a rerun must match all of it to resume. `quality`: the
    quality models' paths and SHA-256 (`scoring.QualityStage.identity`), None without them."""
    files = []
    for p, n in zip(paths, names):
        st = p.stat()
        files.append({"name": n, "path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return {"mspretrain": __version__, "inputs": list(inputs), "files": files,
            "config": json.loads(json.dumps(asdict(cfg), default=str)),
            "tokenizer": None if tokenizer is None else {"path": tokenizer[0], "sha256": tokenizer[1]},
            "seq_len": seq_len, **({"quality": quality} if quality is not None else {})}


def _short(v: object) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 60 else s[:57] + "..."


def difference(old: dict, new: dict) -> str | None:
    """The first difference between two fingerprints, in words; None if they are equal."""
    if old == new:
        return None
    ot, nt = old.get("tokenizer"), new.get("tokenizer")
    if ot and nt and ot != nt and ot.get("path") == nt.get("path"):
        return f"the tokenizer {nt.get('path')} changed (its SHA-256)"
    for key, what in (("mspretrain", "the mspretrain version"), ("inputs", "INPUT"), ("seq_len", "--seq-len"), ("tokenizer", "--tokenizer")):
        if old.get(key) != new.get(key):
            return f"{what} was {_short(old.get(key))}, now {_short(new.get(key))}"
    oc, nc = old.get("config") or {}, new.get("config") or {}
    for k in sorted(set(oc) | set(nc)):
        if oc.get(k) != nc.get(k):
            return f"prepare.{k} was {_short(oc.get(k))}, now {_short(nc.get(k))}"
    if old.get("quality") != new.get("quality"):  # the same names, other bytes
        return "a quality model or eval set of prepare.* changed since the interrupted run (its SHA-256)"
    of, nf = old.get("files") or [], new.get("files") or []
    for a, b in zip(of, nf):
        if a != b:
            if a.get("name") != b.get("name") or a.get("path") != b.get("path"):
                return f"input file {a.get('name')} is now {b.get('name')}"
            what = "size" if a.get("size") != b.get("size") else "modification time"
            return f"input file {a.get('name')} changed ({what}: {a.get('size')} -> {b.get('size')} bytes)" \
                if what == "size" else f"input file {a.get('name')} changed (modification time)"
    if len(of) != len(nf):
        return f"the inputs held {len(of)} files, now {len(nf)}"
    return "the run's fingerprint"


class Journal:
    """The progress journal of one `prepare --out NAME` (see the module's layout)."""

    def __init__(self, out: Path) -> None:
        self.work = out.with_name(f".{out.name}.partial")
        self.path = out.with_name(f".{out.name}.progress.json")
        self.state_dir = self.work / STATE_DIR
        self.data: dict = {}
        self.warnings: list[str] = []  # prepare's list of warnings: saved with each stage's state
        self._last = time.monotonic()
        self.units_per_commit = 1  # `due` after this many units: prepare sets its worker count
        self._units = 0  # units since the last commit
        self._pending: threading.Thread | None = None  # a background commit (`commit(background=True)`)
        self._failed: BaseException | None = None

    # ---------------------------------------------------------------- start
    def read(self) -> dict | None:
        """The journal's data; None when there is none. A file of its name that prepare did not
        write as it is now (a user's, one edited by hand or damaged, a FIFO, a link to /dev/zero)
        is refused in one line and left as it is: read with the guards of every state file
        (a regular file, bounded, not nested past the stack)."""
        if not os.path.lexists(self.path):
            return None
        fix = (f"move {self.path} away (prepare never replaces a file it did not write); if it was prepare's, "
               f"delete it and {self.work} to start over")
        d = read_json_file(self.path, "progress journal", fix)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise UserError(f"{self.path} is not a progress journal prepare wrote (no \"format\": \"{FORMAT}\")", fix)
        body = {k: v for k, v in d.items() if k != "check"}
        if d.get("check") != _check(body):
            raise UserError(f"progress journal {self.path} was changed after prepare wrote it (its check sum does not match)", fix)
        if d.get("version") != VERSION or not isinstance(d.get("fingerprint"), dict):
            return None  # another version's: not resumed (the fingerprint names the version)
        return body

    def open(self, fp: dict) -> str:
        """Before any work: "fresh" (a new work dir), "resume" (the journal's stage is in `data`),
        or UserError when a half-done work dir belongs to another command or other inputs."""
        old = self.read()
        if old is not None and self.work.is_dir():
            why = difference(old["fingerprint"], fp)
            if why is not None:
                raise UserError(f"{self.work} holds an interrupted prepare of other inputs or another command: {why}",
                                f"rerun the original command to resume it, or delete {self.work} and {self.path} to start over")
            _regular_only(self.work, self.path)
            self.data = old
            return "resume"
        if self.work.is_symlink() or (self.work.exists() and not self._ours()):
            raise UserError(f"{self.work} exists and is not a work dir `mspretrain prepare` left (no {STATE_DIR}/{WORK_MARK}); "
                            "prepare does not delete it", "move it away (or delete it if it is yours to lose), or choose another --out")
        shutil.rmtree(self.work, ignore_errors=True)  # left over by a crashed run that had not started its journal
        # made under a name of its own with the mark inside, then renamed: a `.NAME.partial` without
        # the mark (an empty one too) is never prepare's, so a user's dir of that name is never removed
        import tempfile

        from mspretrain.fsutil import new_file_mode

        tmp = Path(tempfile.mkdtemp(prefix=f"{self.work.name}.", suffix=".new", dir=self.work.parent))
        os.chmod(tmp, new_file_mode(self.work, directory=True))
        (tmp / STATE_DIR).mkdir()
        (tmp / STATE_DIR / WORK_MARK).write_text("prepare\n", encoding="utf-8")  # what makes a journal-less work dir ours
        os.rename(tmp, self.work)
        self.data = {"version": VERSION, "fingerprint": fp}  # no stage yet: the runner names the chain's first (`pipeline.run`)
        self.commit()
        return "fresh"

    def _ours(self) -> bool:
        """A work dir without a journal may be deleted only if prepare made it: it holds the mark
        (`open` makes the dir under another name and renames it with the mark inside).
        `.NAME.partial` was once removed whatever it held, a user's dir of that name included."""
        try:
            return self.work.is_dir() and not self.work.is_symlink() and (self.state_dir / WORK_MARK).is_file()
        except OSError:
            return False

    @property
    def stage(self) -> str | None:
        """The stage a resumed run starts at (`pipeline.chain`'s names); None: nothing was done yet."""
        return self.data.get("stage")

    # ---------------------------------------------------------------- commits
    def due(self) -> bool:
        """Called once per finished unit: whether to commit now. Every worker has finished about
        one unit since the last commit (and `MIN_COMMIT_SECONDS` passed), or `commit_seconds()`
        passed. With the environment's 0 (tests): after every unit."""
        self._units += 1
        waited, most = time.monotonic() - self._last, commit_seconds()
        return waited >= most or (self._units >= self.units_per_commit and waited >= min(MIN_COMMIT_SECONDS, most))

    def commit(self, *, fsync: list[Path] = (), background: bool = False, **fields) -> None:
        """Make `fsync` (data files whose content the new fields describe) durable, then replace
        the journal with the new fields in one atomic step. `background`: the fsyncs and the
        journal's replacement run in a thread, and this returns at once (the caller has written
        what the fields describe; it may go on writing past it). The previous commit is waited
        for first, so journals land in order."""
        self.wait()
        self.data.update(fields)
        self.data["format"] = FORMAT
        text = json.dumps({**self.data, "check": _check(self.data)}, ensure_ascii=False) + "\n"
        self._last, self._units = time.monotonic(), 0
        if not background:
            _durable(list(fsync), self.path, text)
            return

        def run() -> None:
            try:
                _durable(list(fsync), self.path, text)
            except BaseException as exc:  # raised in the caller's thread by the next `wait`
                self._failed = exc

        global _background
        self._pending = _background = threading.Thread(target=run, name="prepare-commit", daemon=True)
        self._pending.start()

    def wait(self) -> None:
        """Until a background commit is on disk; its error (a full disk) is raised here."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._failed is not None:
            exc, self._failed = self._failed, None
            raise exc

    def state_path(self, name: str) -> Path:
        self.state_dir.mkdir(exist_ok=True)
        return self.state_dir / name

    def drop_state(self) -> None:
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _regular_only(work: Path, journal: Path) -> None:
    """A work dir to resume holds only what prepare writes there: directories and regular files.
    A FIFO, a device or a symbolic link in it (a damaged or tampered work dir) would hang a resume
    or read without end; it is refused in one line before anything is read."""
    for root, dirs, files in os.walk(work):
        for name in dirs + files:
            p = Path(root) / name
            if p.is_symlink() or not (p.is_dir() or p.is_file()):
                from mspretrain.fsutil import file_kind

                raise UserError(f"{p} is {'a symbolic link' if p.is_symlink() else file_kind(p)}, which prepare never writes into "
                                "its work dir: the interrupted prepare's work dir was changed after the kill",
                                f"delete {work} and {journal} to start over")


def _check(data: dict) -> str:
    """The journal's check sum: SHA-256 of its canonical JSON (without `check`)."""
    import hashlib

    return hashlib.sha256(json.dumps(data, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def _durable(fsync: list[Path], path: Path, text: str) -> None:
    for i in range(0, len(fsync), 64):  # concurrent fsyncs share journal commits; not 4,096 threads
        fsync_all(fsync[i: i + 64])
    atomic_write(path, text)


def truncate(path: Path, size: int) -> None:
    """Cut a file back to the length a commit recorded (a torn tail after kill -9)."""
    cut_back(path, size)
