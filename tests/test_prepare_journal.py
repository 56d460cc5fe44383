"""`prepare`'s commit cadence and background commits (`data/resume.py`): a kill redoes about one
chunk per worker, and a commit's fsyncs do not hold up pass 1."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from mspretrain.config import PrepareConfig
from mspretrain.data import publish, resume
from mspretrain.data.prepare import prepare
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
    """With the default ceiling (10 s) and no floor, pass 1 commits after every `workers` chunks:
    what a kill can lose is about one chunk per worker (plus those in flight)."""
    monkeypatch.delenv("MSPRETRAIN_PREPARE_COMMIT_SECONDS", raising=False)
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
        if background:  # pass 1's own commits (its last one, with the stage's end, is not)
            seen.append(self.data["pass1"]["chunks"])

    monkeypatch.setattr(resume.Journal, "commit", commit)
    cfg = PrepareConfig(vocab_size=400, doc_per_line=True, valid_fraction=0.1)
    for workers, want in ((2, [2, 4, 6, 8]), (1, [1, 2, 3, 4, 5, 6, 7, 8])):
        seen.clear()
        prepare([str(raw)], tmp_path / f"out{workers}", cfg, workers=workers, log=lambda m: None)
        assert seen == want
