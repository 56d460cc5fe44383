"""Issue 33, classes 2, 3 and 7: no command deletes or overwrites what it did not write, a
multi-file output is published as a set, and a full disk or a read-only dir is one line.

The helper (mspretrain/outputs.py) is tested on its own first, then through every command that
writes with it: export, convert, tokenizer extend, selftest --out, report --out; and the trainer's
batches.jsonl on a full disk."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mspretrain.cli import main
from mspretrain.errors import UserError
from mspretrain.outputs import MARKER, SCRATCH_MARK, OutputDir, check_set, write_output_file
from tests.conftest import ROOT, TINY, make_poems
from tests.test_safety import refused


def tree(d: Path) -> dict[str, str]:
    if not d.exists():
        return {}
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(d.rglob("*"))}


def _write_set(out: Path, content: str, overwrite: bool = True) -> None:
    with OutputDir(out, "demo-writer", overwrite=overwrite) as tmp:
        (tmp / "a.txt").write_text(content, encoding="utf-8")
        (tmp / "b.txt").write_text(content * 2, encoding="utf-8")


# --------------------------------------------------------------------------- the helper

def test_output_dir_publishes_a_marked_set_and_replaces_only_its_own(tmp_path):
    out = tmp_path / "out"
    _write_set(out, "one")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "a.txt", "b.txt"]
    assert json.loads((out / MARKER).read_text())["command"] == "demo-writer" and check_set(out) is None
    _write_set(out, "two")
    assert (out / "a.txt").read_text() == "two" and check_set(out) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no scratch, no aside left
    with pytest.raises(UserError, match="not empty"):
        _write_set(out, "three", overwrite=False)
    (out / "notes.md").write_text("mine")
    before = tree(out)
    with pytest.raises(UserError, match="did not write"):
        _write_set(out, "four")
    assert tree(out) == before
    # another command's output is not this one's to replace
    other = tmp_path / "other"
    with OutputDir(other, "someone-else", overwrite=True) as tmp:
        (tmp / "a.txt").write_text("x")
    with pytest.raises(UserError, match="did not write"):
        _write_set(other, "five")


def test_scratch_names_never_touch_user_files(tmp_path):
    out = tmp_path / "X"
    (tmp_path / "X.tmp").mkdir()
    (tmp_path / "X.tmp" / "keep").write_text("user")
    (tmp_path / ".X.tmp").write_text("user too")
    (tmp_path / ".X.1.partial").mkdir()  # looks like scratch, but has no scratch mark: not ours
    (tmp_path / ".X.1.partial" / "keep").write_text("user three")
    before = tree(tmp_path)
    _write_set(out, "one")
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("X/") and k != "X"} == before


def test_a_killed_publish_leaves_the_old_set_or_puts_it_back(tmp_path):
    out = tmp_path / "out"
    _write_set(out, "old")
    old = tree(out)
    # killed inside the block (between two files' writes): the old set stays, the scratch is cleaned next time
    code = ("import os, sys; from pathlib import Path; from mspretrain.outputs import OutputDir\n"
            f"with OutputDir(Path({str(out)!r}), 'demo-writer', overwrite=True) as tmp:\n"
            "    (tmp / 'a.txt').write_text('new')\n"
            "    os._exit(9)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 9
    assert tree(out) == old and any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    _write_set(out, "new")
    assert (out / "a.txt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # killed between the two renames (old moved aside, new not yet in place): the next run puts it back
    aside = tmp_path / ".out.999999999.abc.old"
    os.rename(out, aside)
    (aside / SCRATCH_MARK).write_text("demo-writer")
    OutputDir(out, "demo-writer", overwrite=True)  # deciding is enough: the earlier output is back
    assert (out / "a.txt").read_text() == "new" and check_set(out) is None and not aside.exists()


def test_torn_set_is_detected(tmp_path):
    out = tmp_path / "out"
    _write_set(out, "one")
    (out / "b.txt").write_text("from another run")
    assert "b.txt" in (check_set(out) or "")


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_write_error_is_one_line_and_leaves_nothing(tmp_path, err):
    out = tmp_path / "out"
    _write_set(out, "old")
    before = tree(tmp_path)
    with pytest.raises(UserError) as e:
        with OutputDir(out, "demo-writer", overwrite=True) as tmp:
            (tmp / "a.txt").write_text("new")
            raise OSError(err, os.strerror(err), str(tmp / "b.txt"))
    assert "\n" not in str(e.value) and os.strerror(err) in e.value.cause
    assert tree(tmp_path) == before


def test_an_input_inside_out_is_refused(tmp_path):
    out = tmp_path / "out"
    _write_set(out, "old")
    before = tree(tmp_path)
    for inp in (out / "a.txt", out, out / "*.txt"):
        with pytest.raises(UserError, match="would replace an input"):
            OutputDir(out, "demo-writer", overwrite=True, inputs=[inp])
    assert tree(tmp_path) == before


def test_write_output_file(tmp_path):
    mine = lambda head: head.startswith(b"{\"mine\"")  # noqa: E731
    p = tmp_path / "f.json"
    write_output_file(p, '{"mine": 1}', "demo-writer", is_ours=mine)
    write_output_file(p, '{"mine": 2}', "demo-writer", is_ours=mine)
    assert json.loads(p.read_text()) == {"mine": 2}
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(UserError, match="not an earlier"):
        write_output_file(notes, '{"mine": 1}', "demo-writer", is_ours=mine)
    assert notes.read_text() == "my notes"
    with pytest.raises(UserError, match="does not exist"):
        write_output_file(tmp_path / "missing" / "f.json", "{}", "demo-writer", is_ours=mine)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.json", "notes.txt"]


# --------------------------------------------------------------------------- export / convert

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_data):
    """A tiny weights-only checkpoint with the data dir's tokenizer."""
    from dataclasses import replace

    from mspretrain import config as cfgmod
    from mspretrain.checkpoint.store import write_weights_only_checkpoint
    from mspretrain.config import Config
    from mspretrain.data.tokenizer import Tokenizer
    from mspretrain.model.llama import Llama, state_numpy

    root = tmp_path_factory.mktemp("outputs_ckpt")
    vocab = Tokenizer.load(tiny_data).vocab_size
    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, max_seq_len=64))
    return write_weights_only_checkpoint(root / "ck", state_numpy(Llama(m, seed=1)), replace(Config(), model=m),
                                         tokenizer_path=tiny_data / "tokenizer.model")


@pytest.fixture(scope="module")
def hf_folder(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("outputs_hf") / "hf"
    assert main(["export", str(ckpt), "--format", "hf", "--out", str(out), "--quiet"]) == 0
    return out


def test_export_and_convert_leave_user_scratch_lookalikes_alone(ckpt, hf_folder, tmp_path, capsys):
    for name in ("X.tmp", ".X.tmp", "Y.tmp", ".Y.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text(name)
    before = tree(tmp_path)
    assert main(["export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "X"), "--quiet"]) == 0
    assert main(["convert", "--from-hf", str(hf_folder), "--out", str(tmp_path / "Y"), "--quiet"]) == 0
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if k.split("/")[0] not in ("X", "Y")} == before
    from mspretrain.checkpoint.store import verify

    assert verify(tmp_path / "Y") is None


@pytest.mark.parametrize("command", ["export", "convert"])
def test_overwrite_never_deletes_user_files(command, ckpt, hf_folder, tmp_path, capsys):
    out = tmp_path / "out"
    argv = (["export", str(ckpt), "--format", "hf"] if command == "export" else ["convert", "--from-hf", str(hf_folder)])
    argv += ["--out", str(out), "--quiet"]
    assert main(argv) == 0
    (out / "my-notes.md").write_text("mine")
    before = tree(tmp_path)
    err = refused(capsys, *argv, "--overwrite")
    assert "did not write" in err and tree(tmp_path) == before
    (out / "my-notes.md").unlink()
    assert main([*argv, "--overwrite"]) == 0  # its own earlier output: replaced


@pytest.mark.parametrize("command", ["export", "convert"])
def test_a_full_disk_is_one_line_and_leaves_no_output(command, ckpt, hf_folder, tmp_path, capsys, monkeypatch):
    import safetensors.numpy

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    import mspretrain.checkpoint.store as store
    import mspretrain.model.hf as hf

    monkeypatch.setattr(store, "save_file", full, raising=False)
    monkeypatch.setattr(hf, "save_file", full, raising=False)
    argv = (["export", str(ckpt), "--format", "hf"] if command == "export" else ["convert", "--from-hf", str(hf_folder)])
    err = refused(capsys, *argv, "--out", str(tmp_path / "out"))
    assert "No space left" in err
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- tokenizer extend

@pytest.fixture(scope="module")
def tok_inputs(tmp_path_factory, tiny_data):
    d = tmp_path_factory.mktemp("outputs_tok")
    (d / "zh.txt").write_text("\n".join(make_poems(300, seed=9)) + "\n", encoding="utf-8")
    return tiny_data / "tokenizer.model", d / "zh.txt"


def _extend(base, corpus, out, *extra):
    return ["tokenizer", "extend", str(base), "--train", str(corpus), "--add", "20", "--out", str(out), "--quiet", *extra]


def test_extend_refuses_to_replace_its_own_input(tok_inputs, tmp_path, capsys):
    base, corpus = tok_inputs
    out = tmp_path / "out"
    assert main(_extend(base, corpus, out)) == 0
    before = tree(tmp_path)
    err = refused(capsys, "tokenizer", "extend", str(base), "--with", str(out / "tokenizer.model"), "--out", str(out))
    assert "input" in err and tree(tmp_path) == before
    err = refused(capsys, "tokenizer", "extend", str(out / "tokenizer.model"), "--train", str(corpus), "--add", "5", "--out", str(out))
    assert tree(tmp_path) == before


def test_a_kill_between_extend_writes_leaves_the_old_set(tok_inputs, tmp_path):
    base, corpus = tok_inputs
    out = tmp_path / "out"
    assert main(_extend(base, corpus, out)) == 0
    old = tree(out)
    env = dict(os.environ, PYTHONPATH=str(ROOT), MSPRETRAIN_TEST_KILL_BETWEEN_WRITES="1")
    argv = ["tokenizer", "extend", str(base), "--train", str(corpus), "--add", "30", "--out", str(out), "--quiet"]
    rc = subprocess.run([sys.executable, "-m", "mspretrain.cli", *argv], env=env, timeout=300, capture_output=True).returncode
    assert rc == 137
    assert tree(out) == old and check_set(out) is None  # the old set, whole
    assert main(_extend(base, corpus, out)) == 0  # the rerun cleans the dead run's scratch
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_torn_extend_output_is_refused_by_readers(tok_inputs, tmp_path, capsys):
    base, corpus = tok_inputs
    out = tmp_path / "out"
    assert main(_extend(base, corpus, out)) == 0
    shutil.copy(base, out / "tokenizer.model")  # what a kill between separate writes used to leave
    refused(capsys, "tokenizer", "extend", str(out), "--train", str(corpus), "--add", "5", "--out", str(tmp_path / "o2"))
    refused(capsys, "prepare", str(corpus), "--tokenizer", str(out / "tokenizer.model"), "--out", str(tmp_path / "d"), "--quiet")
    # an output from before the marker existed (or torn) without a marker: not taken for a whole set
    (out / MARKER).unlink()
    err = refused(capsys, *_extend(base, corpus, out))
    assert "cannot be told whole" in err


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_extend_write_errors_are_one_line(tok_inputs, tmp_path, capsys, monkeypatch, err):
    import mspretrain.data.tokenizer_extend as te

    base, corpus = tok_inputs
    out = tmp_path / "out"

    def fail():
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(te, "_between_writes", fail)
    msg = refused(capsys, *_extend(base, corpus, out))
    assert os.strerror(err) in msg and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("add", ["1e20", str(10**20)])
def test_extend_refuses_absurd_add(tok_inputs, tmp_path, capsys, add):
    base, corpus = tok_inputs
    try:  # argparse's own refusal of a non-integer exits through the CLI's one-line parser error
        rc = main(["tokenizer", "extend", str(base), "--train", str(corpus), "--add", add, "--out", str(tmp_path / "o")])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 2 and lines[0].startswith("error: ") and "--add" in lines[0] and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- selftest --out, report --out

@pytest.mark.parametrize("case", ["notes", "config", "missing_dir", "is_dir"])
def test_selftest_out_refuses_before_running(tmp_path, capsys, case):
    target = {"notes": tmp_path / "notes.txt", "config": tmp_path / "config.toml",
              "missing_dir": tmp_path / "nope" / "s.json", "is_dir": tmp_path}[case]
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "config.toml").write_text("[train]\nmax_steps = 3\n")
    before = tree(tmp_path)
    refused(capsys, "selftest", "--quick", "--run", str(tmp_path / "r"), "--out", str(target))
    assert tree(tmp_path) == before


def test_selftest_read_only_run_dir_is_one_line(tmp_path, capsys, monkeypatch):
    import tempfile

    def ro(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path))

    monkeypatch.setattr(tempfile, "mkdtemp", ro)
    err = refused(capsys, "selftest", "--quick", "--run", str(tmp_path))
    assert "Read-only" in err


def test_selftest_output_is_recognised():
    from mspretrain.commands.selftest import is_selftest_output

    assert is_selftest_output(b'{\n "selftest_version": 1,\n "target": "cpu"')
    assert not is_selftest_output(b"[train]\nmax_steps = 3\n") and not is_selftest_output(b"my notes")


def test_report_out_writes_nothing_into_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[train]\nmax_steps = 3\n", encoding="utf-8")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2, 3)))
    before = tree(run)
    out = tmp_path / "elsewhere" / "r.html"
    out.parent.mkdir()
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert tree(run) == before
    assert out.is_file() and any((tmp_path / "elsewhere" / "r-plots").glob("*.png"))
    assert main(["report", str(run), "--out", str(out)]) == 0  # again: its own plots dir is replaced


# --------------------------------------------------------------------------- train

def test_a_full_disk_in_batches_jsonl_stops_after_checkpointing(tiny_data, tmp_path, capsys, monkeypatch):
    """Step 3's record cannot be written: training stops in one line with a checkpoint of step 3
    (every step kept), batches.jsonl is whole through step 3, and the same command resumes."""
    from mspretrain.monitor import batch_log

    run = tmp_path / "run"
    real = batch_log.BatchLog.retry
    state = {"failed": False}

    def flaky(self):
        if not state["failed"] and any('"step": 3,' in line for line in self._pending):
            state["failed"] = True
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        real(self)

    monkeypatch.setattr(batch_log.BatchLog, "retry", flaky)
    argv = ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
            "train.max_steps=5", "checkpoint.every=10"]
    err = refused(capsys, *argv)
    assert "No space left" in err and "step 3" in err and "step_000003 saved" in err
    steps = [json.loads(line).get("step") for line in (run / "batches.jsonl").read_text().splitlines()]
    assert [s for s in steps if s is not None] == [1, 2, 3]
    assert (run / "checkpoints" / "step_000003").is_dir()
    assert main(argv) == 0
    steps = [json.loads(line).get("step") for line in (run / "batches.jsonl").read_text().splitlines()]
    assert [s for s in steps if s is not None] == [1, 2, 3, 4, 5]


def test_train_refuses_a_non_utf8_run_dir_before_training(tiny_data, tmp_path, capsys):
    run = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run-\xff")
    refused(capsys, "train", "--config", str(TINY), "--data", str(tiny_data), "--run", run, "--quiet", "train.max_steps=2")
    assert list(tmp_path.iterdir()) == []


def test_write_output_file_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    import mspretrain.fsutil as fsutil

    p = tmp_path / "s.json"
    p.write_text('{"mine": 1}')

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil, "atomic_write", full)
    with pytest.raises(UserError, match="No space left") as e:
        write_output_file(p, '{"mine": 2}', "demo-writer", is_ours=lambda head: b'"mine"' in head)
    assert "free disk space" in e.value.fix and p.read_text() == '{"mine": 1}'


def test_a_full_disk_writing_the_run_files_is_one_line(tiny_data, tmp_path, capsys, monkeypatch):
    """config.toml / run_meta.json cannot be written (train, and replay's --out scratch run go
    through the same writer): one line, and no run files half written."""
    import mspretrain.fsutil as fsutil

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil, "atomic_write", full)
    err = refused(capsys, "train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / "run"),
                  "--quiet", "train.max_steps=4")
    assert "No space left" in err and not (tmp_path / "run" / "config.toml").exists()
