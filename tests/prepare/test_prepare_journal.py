"""`prepare`'s commit cadence and background commits (`prepare/resume.py`): a kill redoes about one
chunk per worker, and a commit's fsyncs do not hold up pass 1."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from mspretrain.config.schema import PrepareConfig
from mspretrain.prepare import publish, resume
from mspretrain.prepare.prepare import prepare
from tests.conftest import make_poems


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(resume.time, "monotonic", c)
    monkeypatch.delenv("MSPRETRAIN_PREPARE_COMMIT_SECONDS", raising=False)
    return c


def test_due_after_one_unit_per_worker_but_not_more_often_than_the_floor(tmp_path, clock):
    j = resume.Journal(tmp_path / "data")
    j.units_per_commit = 3
    assert not j.due() and not j.due()  # 2 of 3 units
    assert not j.due()  # 3 units, but 0 s since the last commit: under MIN_COMMIT_SECONDS
    clock.now += resume.MIN_COMMIT_SECONDS
    assert j.due()  # 4 units, 1 s
    tmp_path.joinpath(".data.partial").mkdir()
    j.commit()
    clock.now += 5
    assert not j.due()  # 1 unit of 3 after the commit
    clock.now += resume.COMMIT_SECONDS
    assert j.due()  # the ceiling: however few units


def test_zero_seconds_in_the_environment_commits_after_every_unit(tmp_path, clock, monkeypatch):
    monkeypatch.setenv("MSPRETRAIN_PREPARE_COMMIT_SECONDS", "0")
    j = resume.Journal(tmp_path / "data")
    j.units_per_commit = 8
    assert j.due()


def test_a_background_commit_writes_the_journal_only_after_its_fsyncs(tmp_path, monkeypatch):
    j = resume.Journal(tmp_path / "data")
    f = tmp_path / "part"
    f.write_bytes(b"x")
    release, order = threading.Event(), []

    def slow_fsync(p) -> None:
        release.wait(10)
        order.append(("fsync", Path(p).name, j.path.exists()))

    monkeypatch.setattr(publish, "fsync_path", slow_fsync)
    j.commit(fsync=[f], background=True, pass1={"chunks": 3})
    assert not j.path.exists()  # still fsyncing: the journal is not replaced before the data is durable
    release.set()
    j.wait()
    assert order == [("fsync", "part", False)]
    assert json.loads(j.path.read_text())["pass1"] == {"chunks": 3}


def test_a_background_commits_error_is_raised_by_the_next_commit(tmp_path, monkeypatch):
    j = resume.Journal(tmp_path / "data")

    def full(p) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publish, "fsync_path", full)
    j.commit(fsync=[tmp_path], background=True, pass1={"chunks": 1})
    with pytest.raises(OSError, match="No space"):
        j.commit(stage="dedup")
    assert not j.path.exists()


def test_pass1_commits_once_per_chunk_per_worker(tmp_path, monkeypatch):
    """With no floor, pass 1 commits after every `workers` chunks: what a kill can lose is about
    one chunk per worker (plus those in flight). The time ceiling (tested on its own above, with a
    fake clock) is set out of reach: its default 10 s, counted from the journal's creation, could
    pass while the worker pool starts on a loaded machine, and a commit then came after one chunk."""
    monkeypatch.setenv("MSPRETRAIN_PREPARE_COMMIT_SECONDS", "1e9")
    monkeypatch.setattr(resume, "MIN_COMMIT_SECONDS", 0.0)
    raw = tmp_path / "raw"
    raw.mkdir()
    poems = [p.replace("\n", "，") for p in make_poems(240, seed=3)]
    for k in range(8):  # a chunk each
        (raw / f"p{k}.txt").write_text("\n".join(poems[k * 30: (k + 1) * 30]) + "\n", encoding="utf-8")
    seen: list[int] = []
    real = resume.Journal.commit

    def commit(self, *, fsync=(), background=False, **fields):
        real(self, fsync=fsync, background=background, **fields)
        if background and self.stage == "pass1":  # pass 1's own commits (its last one, with the stage's end, is not)
            seen.append(self.data["pass1"]["chunks"])

    monkeypatch.setattr(resume.Journal, "commit", commit)
    cfg = PrepareConfig(vocab_size=400, doc_per_line=True, valid_fraction=0.1)
    for workers, want in ((2, [2, 4, 6, 8]), (1, [1, 2, 3, 4, 5, 6, 7, 8])):
        seen.clear()
        prepare([str(raw)], tmp_path / f"out{workers}", cfg, workers=workers, log=lambda m: None)
        assert seen == want


def _covered(work: Path, fields: dict, itemsize: int) -> list[str]:
    """What a commit's fields say is written that the files on disk do not hold yet (at the time
    of the commit): a kill after the commit would lose it, and a resume would pad it with zeros."""
    from mspretrain.data.origin import HEADER, RECORD, origin_name

    short = []

    def need(path: Path, n: int) -> None:
        if path.stat().st_size < n:
            short.append(f"{path.name}: {path.stat().st_size} < {n}")

    for key in ("replay", "encode", "pass2"):
        v = fields.get(key) or {}
        for s, st in (v.get("writers") or {}).items():
            if "tokens" in st:
                need(work / f"{s}.bin.tmp", st["tokens"] * itemsize)
                need(work / f"{s}.len.tmp", st["documents"] * 4)
            else:
                need(work / f"{s}.spool", st["bytes"])
        for s, r in (v.get("origins") or {}).items():
            need(work / origin_name(s), len(HEADER) + r * RECORD.itemsize)
        if "log_bytes" in v:
            need(work / resume.STATE_DIR / "replay.log", v["log_bytes"])
    if fields.get("pass1"):
        need(work / "pass1.tmp", fields["pass1"]["spool_bytes"])
    return short


@pytest.mark.parametrize("pieces", [True, False])
@pytest.mark.parametrize("given", [True, False])
def test_every_commit_describes_bytes_already_in_the_files(tmp_path, monkeypatch, pieces, given):
    """At each commit (one after every chunk here) the files hold at least what the journal's new
    fields say they hold, on every path: buffered bytes flushed first. (The replay through the
    sink committed origin records still in this process's buffer.)"""
    from mspretrain.prepare import pipeline

    monkeypatch.setenv("MSPRETRAIN_PREPARE_COMMIT_SECONDS", "0")
    monkeypatch.setattr(pipeline, "LOCAL_PIECES", pieces)
    raw = tmp_path / "raw"
    raw.mkdir()
    poems = [p.replace("\n", "，") for p in make_poems(300, seed=4)]
    for k in range(5):
        (raw / f"p{k}.txt").write_text("\n".join(poems[k * 60: (k + 1) * 60] + poems[:3]) + "\n", encoding="utf-8")
    cfg = PrepareConfig(vocab_size=400, doc_per_line=True, valid_fraction=0.2, tokenizer_sample_chars=2000)
    tok = None
    if given:
        first = prepare([str(raw)], tmp_path / "first", cfg, workers=1, log=lambda m: None)
        tok = str(tmp_path / "first" / first["tokenizer"]["file"])
    problems: list[str] = []
    commits = []
    real = resume.Journal.commit

    def commit(self, *, fsync=(), background=False, **fields):
        commits.append(sorted(fields))
        problems.extend(_covered(self.work, fields, 2))
        real(self, fsync=fsync, background=background, **fields)

    monkeypatch.setattr(resume.Journal, "commit", commit)
    prepare([str(raw)], tmp_path / "out", cfg, tokenizer=tok, workers=2, log=lambda m: None)
    assert len(commits) > 10 and not problems


def test_a_file_shorter_than_its_commit_is_refused_not_padded(tmp_path):
    """Resuming cuts a file back to its committed length; one that lost committed bytes (damaged
    after the kill) is refused: `truncate` would pad it with zeros that pass for tokens."""
    from mspretrain.errors import UserError
    from mspretrain.fsutil import cut_back

    f = tmp_path / "train.bin.tmp"
    f.write_bytes(b"0123456789")
    cut_back(f, 8)  # a torn tail goes
    assert f.read_bytes() == b"01234567"
    with pytest.raises(UserError, match="holds 8 bytes, fewer than the 12"):
        cut_back(f, 12)
    assert f.read_bytes() == b"01234567"


# what creates, renames or removes a file or dir (`Path`, `os`, `shutil`)
_TOUCHES = {"rmtree", "unlink", "mkdir", "makedirs", "rename", "replace", "remove", "rmdir", "removedirs", "move",
            "touch", "symlink_to", "hardlink_to", "link", "symlink", "copy", "copyfile", "copytree"}


def test_only_the_work_dir_owner_creates_renames_or_removes_its_entries(tmp_path):
    """Every stage reaches the work dir through `workdir.WorkDir` (`Run.files`): no stage module
    removes, renames or creates an entry itself, nor joins a path onto the run's work dir
    (`r.work / x`); and the owner hands out only the names it knows."""
    import ast

    from mspretrain.prepare import stage, workdir

    bad = []
    stages = sorted(Path(stage.__file__).parent.glob("stage_*.py"))
    assert len(stages) >= 7
    for path in stages:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _TOUCHES:
                owner = node.func.value
                if not (isinstance(owner, ast.Name) and owner.id in ("j", "journal")):  # the journal (beside the work dir) removes itself
                    bad.append(f"{path.name}:{node.lineno} .{node.func.attr}()")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                if isinstance(node.left, ast.Attribute) and node.left.attr in ("work", "root"):  # `r.work / x`, `r.files.root / x`
                    bad.append(f"{path.name}:{node.lineno} a path joined onto the work dir")
    assert not bad, bad
    files = workdir.WorkDir(tmp_path / "w", resume.Journal(tmp_path / "data"))
    with pytest.raises(AssertionError, match="not an entry"):
        files.path("stray.tmp")
    (tmp_path / "w").mkdir()
    assert files.fresh(workdir.PIECES).is_dir() and files.fresh(workdir.PIECES, make=False) == tmp_path / "w" / workdir.PIECES
    assert not (tmp_path / "w" / workdir.PIECES).exists()
