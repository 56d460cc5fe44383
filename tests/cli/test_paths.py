"""atomic_write keeps the old file whole until the rename; RunPaths/DataPaths name the documented files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write, atomic_writer, read_json
from mspretrain.paths import DataPaths, RunPaths

ROOT = Path(__file__).resolve().parents[2]


def test_atomic_write_bytes_and_str(tmp_path):
    p = tmp_path / "f.json"
    atomic_write(p, b"\x00\x01old")
    assert p.read_bytes() == b"\x00\x01old"
    atomic_write(p, "新的 text", fsync=False)
    assert p.read_bytes() == "新的 text".encode("utf-8")
    assert os.listdir(tmp_path) == ["f.json"]  # no temporary left behind


def test_atomic_write_failing_rename_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "state.json"
    p.write_text("old", encoding="utf-8")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write(p, "new")
    assert p.read_text(encoding="utf-8") == "old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_atomic_write_killed_before_rename_leaves_the_old_file(tmp_path):
    """A real crash: the process dies (no exception handler runs) after writing the temp file."""
    p = tmp_path / "state.json"
    p.write_text("old", encoding="utf-8")
    code = ("import os, sys; from mspretrain.fsutil import atomic_write\n"
            "os.replace = lambda *a: os._exit(9)\n"
            f"atomic_write({str(p)!r}, 'new' * 1000)\n")
    rc = subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode
    assert rc == 9
    assert p.read_text(encoding="utf-8") == "old"
    temps = [n for n in os.listdir(tmp_path) if n != "state.json"]
    assert len(temps) == 1 and temps[0].startswith(".state.json.") and temps[0].endswith(".tmp")  # hidden, never a reader's name
    assert (tmp_path / temps[0]).read_text(encoding="utf-8") == "new" * 1000  # it was written, just not published


def test_atomic_writer_streams_and_an_error_midway_keeps_the_old_file(tmp_path):
    p = tmp_path / "corpus.jsonl"
    with atomic_writer(p, text=True) as f:
        for i in range(3):
            f.write(f"行{i}\n")
    assert p.read_text(encoding="utf-8") == "行0\n行1\n行2\n"
    with pytest.raises(KeyboardInterrupt):
        with atomic_writer(p, text=True) as f:
            f.write("half")
            raise KeyboardInterrupt  # Ctrl-C in the middle of a long write
    assert p.read_text(encoding="utf-8") == "行0\n行1\n行2\n" and os.listdir(tmp_path) == ["corpus.jsonl"]


def test_read_json_errors_are_one_line(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": [1, 2]}')
    assert read_json(p, "fix") == {"a": [1, 2]}
    for body, said in ((b'{"a":\n  [1,\n', "is not valid JSON (Expecting value: line 3"), (b"\xff{}", "is not valid JSON (not UTF-8 at byte 0)")):
        p.write_bytes(body)
        with pytest.raises(UserError) as ei:
            read_json(p, "re-create it")
        assert said in ei.value.cause and "\n" not in ei.value.cause and ei.value.fix == "re-create it"
    with pytest.raises(UserError, match="cannot read"):
        read_json(tmp_path, "fix")  # a directory: IsADirectoryError, an OSError


def test_atomic_write_into_missing_dir_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "nope" / "f", "x")


def test_run_paths_are_the_documented_names(tmp_path):
    from mspretrain.checkpoint.lock import LOCK_NAME
    from mspretrain.checkpoint.store import step_dir_name

    r = RunPaths(tmp_path)
    got = {"config": r.config, "metrics": r.metrics, "tb": r.tb, "log": r.log, "meta": r.meta,
           "checkpoints": r.checkpoints, "lock": r.lock, "tokenizer_model": r.tokenizer_model,
           "tokenizer_json": r.tokenizer_json}
    want = {"config": "config.toml", "metrics": "metrics.jsonl", "tb": "tb", "log": "train.log", "meta": "run_meta.json",
            "checkpoints": "checkpoints", "lock": ".mspretrain.lock", "tokenizer_model": "tokenizer.model",
            "tokenizer_json": "tokenizer.json"}
    assert {k: v.relative_to(tmp_path).as_posix() for k, v in got.items()} == want
    assert r.step_dir(100).relative_to(tmp_path).as_posix() == "checkpoints/step_000100"
    assert r.step_dir(1234567).name == step_dir_name(1234567) == "step_1234567"
    assert r.lock.name == LOCK_NAME
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for name in ("config.toml", "metrics.jsonl", "tb/", "train.log", "run_meta.json", "checkpoints/step_NNNNNN/"):
        assert f"`{name}`" in design, name  # the design doc names the same files
    assert RunPaths(str(tmp_path)) == r and hash(RunPaths(tmp_path)) == hash(r)
    with pytest.raises(AttributeError):
        r.root = Path("/elsewhere")  # frozen


def test_data_paths_are_the_documented_names(tmp_path):
    from mspretrain.data.tokenizer import TOKENIZER_FILES

    d = DataPaths(tmp_path)
    assert d.manifest == tmp_path / "manifest.json"
    assert (d.tokenizer_model.name, d.tokenizer_json.name) == TOKENIZER_FILES == ("tokenizer.model", "tokenizer.json")
    assert [d.bin(s).name for s in ("train", "valid")] == ["train.bin", "valid.bin"]
    assert [d.idx(s).name for s in ("train", "valid")] == ["train.idx", "valid.idx"]
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for name in ("manifest.json", "tokenizer.model", "tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert f"`{name}`" in design or f"{name}`" in design, name
    assert d.tokenizer is None
    d.tokenizer_json.write_text("{}")
    assert d.tokenizer == d.tokenizer_json
    d.tokenizer_model.write_bytes(b"x")
    assert d.tokenizer == d.tokenizer_model  # SentencePiece first, as the loaders look
