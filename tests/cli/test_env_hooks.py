"""Every `MSPRETRAIN_*` environment hook that parses a number refuses a bad value in one line
(not a ValueError traceback), through the one parser
(errors.py `env_number`); and every hook in the source is one this file knows, so a new numeric
hook that parses on its own fails here first."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from mspretrain.errors import UserError, env_number

NUMERIC = {"MSPRETRAIN_INIT_THREADS", "MSPRETRAIN_FAULT_SAVE_DELAY", "MSPRETRAIN_PREPARE_COMMIT_SECONDS",
           "MSPRETRAIN_LOCAL_RANKS", "MSPRETRAIN_PREPARE_TEST_WORKER_KILL"}
# hooks that name a choice or a path, not a number (each checked where it is read, or an on/off flag)
OTHER = {"MSPRETRAIN_CACHE", "MSPRETRAIN_BPE", "MSPRETRAIN_SAMPLE", "MSPRETRAIN_MINHASH", "MSPRETRAIN_NO_SCHEDULER",
         "MSPRETRAIN_PREPARE_TEST_POINTS", "MSPRETRAIN_PREPARE_TEST_KILL", "MSPRETRAIN_TEST_KILL_BETWEEN_WRITES",
         "MSPRETRAIN_HCCL_GROUP_MB"}  # launch's "tp=MB,dp=MB": parsed, and refused in one line, in parallel/hccl.py (tests/train/test_hccl.py)
BAD = ["abc", "1e999", "nan", "-1", "²", "1_000", "9" * 40, "inf", "0x10"]


def test_every_hook_in_the_source_is_known_here():
    src = Path(__file__).resolve().parents[2] / "mspretrain"
    found = {m for p in src.rglob("*.py") for m in re.findall(r"MSPRETRAIN_[A-Z_]+[A-Z]", p.read_text(encoding="utf-8"))}
    assert found == NUMERIC | OTHER, sorted(found ^ (NUMERIC | OTHER))


def _call(name: str) -> object:
    if name == "MSPRETRAIN_INIT_THREADS":
        from mspretrain.model.decoder import init_threads
        return init_threads()
    if name == "MSPRETRAIN_FAULT_SAVE_DELAY":
        from mspretrain.checkpoint.store import _fault_delay
        return _fault_delay(3)
    if name == "MSPRETRAIN_PREPARE_COMMIT_SECONDS":
        from mspretrain.prepare.resume import commit_seconds
        return commit_seconds()
    if name == "MSPRETRAIN_LOCAL_RANKS":
        from mspretrain.preflight.fits import local_ranks
        return local_ranks(8)
    if name == "MSPRETRAIN_PREPARE_TEST_WORKER_KILL":
        from mspretrain.prepare.workers import spill_item
        return spill_item(None, (None, "/x/00001"))
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(NUMERIC))
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_numeric_hook_is_one_line_naming_it(monkeypatch, name, bad):
    value = f"{bad}@3" if name == "MSPRETRAIN_FAULT_SAVE_DELAY" and bad != "²" else bad
    monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as e:
        _call(name)
    assert name in e.value.cause and "\n" not in str(e.value)


def test_the_save_delay_step_part_is_checked_too(monkeypatch):
    monkeypatch.setenv("MSPRETRAIN_FAULT_SAVE_DELAY", "0@x")
    with pytest.raises(UserError, match="MSPRETRAIN_FAULT_SAVE_DELAY"):
        _call("MSPRETRAIN_FAULT_SAVE_DELAY")
    monkeypatch.setenv("MSPRETRAIN_FAULT_SAVE_DELAY", "0.01@3")
    _call("MSPRETRAIN_FAULT_SAVE_DELAY")  # a good value still works


def test_good_values_still_parse(monkeypatch):
    assert env_number("MSPRETRAIN_UNSET_FOR_TEST", 2.5) == 2.5
    monkeypatch.setenv("MSPRETRAIN_INIT_THREADS", "3")
    assert _call("MSPRETRAIN_INIT_THREADS") == 3
    monkeypatch.setenv("MSPRETRAIN_PREPARE_COMMIT_SECONDS", "0")
    assert _call("MSPRETRAIN_PREPARE_COMMIT_SECONDS") == 0.0
    monkeypatch.setenv("MSPRETRAIN_PREPARE_COMMIT_SECONDS", ".5")
    assert _call("MSPRETRAIN_PREPARE_COMMIT_SECONDS") == 0.5
    monkeypatch.setenv("MSPRETRAIN_PREPARE_COMMIT_SECONDS", "1e9")
    assert _call("MSPRETRAIN_PREPARE_COMMIT_SECONDS") == 1e9
    with pytest.raises(UserError):
        env_number("MSPRETRAIN_INIT_THREADS", 1, kind=int, value="1e3")
    monkeypatch.setenv("MSPRETRAIN_LOCAL_RANKS", "2")
    assert _call("MSPRETRAIN_LOCAL_RANKS") == 2
    monkeypatch.delenv("MSPRETRAIN_LOCAL_RANKS")
    assert _call("MSPRETRAIN_LOCAL_RANKS") == 8
