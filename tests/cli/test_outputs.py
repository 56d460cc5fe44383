"""Outputs: no command deletes or overwrites what it did not write, a multi-file output is
published as a set, and a full disk or a read-only dir is one line.

The helper (mspretrain/outputs.py) is tested on its own first, then through every command that
writes with it: export, convert, tokenizer extend, selftest --out, report --out; and the trainer's
batches.jsonl on a full disk. Last the edges: an output dir named `.`, the modes of written
files, a restart killed between its moves, a run started again from step 0, prepare's work dir,
and an earlier output changed since it was written."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mspretrain.cli import main
from mspretrain.errors import UserError
from mspretrain.outputs import MARKER, SCRATCH_MARK, OutputDir, check_set, write_output_file
from tests.conftest import NO_EVAL, ONE_LAYER, ROOT, TINY, make_poems
from tests.helpers.cli import refused, state


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

    from mspretrain.checkpoint.store import write_weights_only_checkpoint
    from mspretrain.config import schema as cfgmod
    from mspretrain.config.schema import Config
    from mspretrain.data.tokenizer import Tokenizer
    from mspretrain.model.decoder import Decoder, state_numpy

    root = tmp_path_factory.mktemp("outputs_ckpt")
    vocab = Tokenizer.load(tiny_data).vocab_size
    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, max_seq_len=64))
    return write_weights_only_checkpoint(root / "ck", state_numpy(Decoder(m, seed=1)), replace(Config(), model=m),
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
    import mspretrain.checkpoint.tensor_file as tensor_file
    import mspretrain.model.hf as hf

    monkeypatch.setattr(tensor_file, "save_file", full)  # checkpoints (store.py, shards.py)
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
    shutil.copy(base, out / "tokenizer.model")  # what a kill between separate writes would leave
    refused(capsys, "tokenizer", "extend", str(out), "--train", str(corpus), "--add", "5", "--out", str(tmp_path / "o2"))
    refused(capsys, "prepare", str(corpus), "--tokenizer", str(out / "tokenizer.model"), "--out", str(tmp_path / "d"), "--quiet")
    # an output from before the marker existed (or torn) without a marker: not taken for a whole set
    (out / MARKER).unlink()
    err = refused(capsys, *_extend(base, corpus, out))
    assert "cannot be told whole" in err


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_extend_write_errors_are_one_line(tok_inputs, tmp_path, capsys, monkeypatch, err):
    import mspretrain.prepare.tokenizer_extend as te

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

@pytest.mark.slow  # a run, stopped, and its resume (~12 s of CPU): end to end
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
            "train.max_steps=5", "checkpoint.every=10", NO_EVAL, ONE_LAYER]
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
    # The run's writers bind atomic_write when first imported: first imported under the patch (this
    # test first in its process, as under xdist), they would keep the fake for every later test.
    import mspretrain.fsutil as fsutil
    from mspretrain.monitor import batch_log, heartbeat, metrics, mfu, spike_record  # noqa: F401

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil, "atomic_write", full)
    err = refused(capsys, "train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / "run"),
                  "--quiet", "train.max_steps=4")
    assert "No space left" in err and not (tmp_path / "run" / "config.toml").exists()


# --------------------------------------------------------------------------- scratch names, modes, restarts, earlier outputs

def test_output_dir_named_dot_publishes_and_leaves_no_scratch(tmp_path, monkeypatch):
    """`export --out .` in an empty dir wrote the scratch marker into it and then failed to rename
    the current dir: a refused command left a file. --out is made absolute first."""
    from mspretrain.outputs import MARKER, OutputDir

    cwd = tmp_path / "empty"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with OutputDir(".", "export", overwrite=False) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in cwd.iterdir()) == sorted([MARKER, "config.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no scratch or aside dir beside it


def test_written_files_get_the_mode_open_would_give(tmp_path, monkeypatch):
    """mkstemp (atomic writes), mkdtemp (output dirs) and the safetensors library create 0600/0700:
    a data dir's tokenizer, an export and every checkpoint were unreadable to the user's group, and
    an atomic rewrite changed a file's mode. Now: what `open()` gives under the umask, or the
    mode of the file replaced."""
    import numpy as np
    from safetensors.numpy import save_file

    from mspretrain.fsutil import atomic_write
    from mspretrain.outputs import OutputDir

    monkeypatch.setattr("mspretrain.fsutil._UMASK", 0o022)  # read once at import: the process's umask
    umask = os.umask(0o022)
    try:
        new = tmp_path / "new.txt"
        atomic_write(new, "x")
        assert stat.S_IMODE(new.stat().st_mode) == 0o644
        kept = tmp_path / "kept.txt"
        kept.write_text("old")
        os.chmod(kept, 0o640)
        atomic_write(kept, "new")
        assert stat.S_IMODE(kept.stat().st_mode) == 0o640
        out = tmp_path / "export"
        with OutputDir(out, "export", overwrite=False) as tmp:
            save_file({"w": np.zeros(2, np.float32)}, str(tmp / "model.safetensors"))
        assert stat.S_IMODE(out.stat().st_mode) == 0o755
        assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    finally:
        os.umask(umask)


def test_restart_killed_between_its_moves_does_not_mix_old_metrics_into_the_new_run(tmp_path, monkeypatch):
    """`train --restart` moves checkpoints/ aside and metrics.jsonl into it. Killed between the two
    renames, the checkpoints were aside and the old metrics.jsonl still in the run: the next run
    started at step 0 and appended to it. Now metrics.jsonl goes into checkpoints/ first and one
    rename moves both; the rerun finishes the move."""
    from mspretrain.checkpoint import store

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    real = os.replace
    calls = []

    def killed_after_one(a, b):
        if calls:
            raise KeyboardInterrupt("killed")
        calls.append((a, b))
        real(a, b)

    monkeypatch.setattr(store.os, "replace", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        store.move_aside(run)
    monkeypatch.setattr(store.os, "replace", real)
    assert not (run / "metrics.jsonl").exists()  # the old code left it here for the new run to append to
    assert store.list_checkpoints(run)  # still repairable in place (or moved by the rerun's --restart)
    moved = store.move_aside(run)
    assert sorted(p.name for p in moved[0].iterdir()) == ["metrics.jsonl", "step_000002"]
    assert sorted(p.name for p in run.iterdir()) == [moved[0].name]


@pytest.mark.slow
def test_a_run_started_again_from_step_0_does_not_append_to_the_old_metrics(reference_run, tiny_data, tmp_path):
    """A run killed before its first checkpoint (here: its checkpoints gone) starts again from step
    0: its metrics.jsonl held the old steps 1..8 followed by the new 1..2. Like a resume, which cuts
    metrics.jsonl back to the checkpoint's step, a start from 0 now cuts it to nothing."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    shutil.rmtree(run / "checkpoints")
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
                 "train.max_steps=2", "schedule.warmup_steps=1", NO_EVAL, ONE_LAYER]) == 0  # the reference run's model
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_prepare_never_deletes_a_dir_of_its_work_dirs_name_that_it_did_not_make(corpus_file, tmp_path, capsys):
    """`prepare --out data` removed `.data.partial/` whatever it held when no journal was beside it
    (the issue's `X.tmp` instance, for prepare's fixed work-dir name). It is deleted now only when
    prepare's mark is in it: prepare makes the dir under a temporary name with the mark inside and
    renames it, so even an empty dir of that name is a user's, refused and kept."""
    users = tmp_path / ".data.partial"
    users.mkdir()
    (users / "keep.txt").write_text("mine")
    for _ in range(2):  # holding a file, then empty
        before = state(tmp_path)
        err = refused(capsys, "prepare", corpus_file, "--out", tmp_path / "data", "--config", TINY, "--workers", "1")
        assert "is not a work dir" in err
        assert state(tmp_path) == before
        (users / "keep.txt").unlink(missing_ok=True)
    users.rmdir()  # moved away: the same command goes through and leaves only its output
    assert main(["prepare", str(corpus_file), "--out", str(tmp_path / "data"), "--config", str(TINY), "--workers", "1",
                 "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize("overwrite", [True, False])
def test_an_earlier_output_with_a_file_changed_since_is_not_replaced(tmp_path, overwrite):
    """An earlier output whose listed file was changed after it was written (a user edited the
    extend output's tokenizer.json, saved fine-tuned weights into an export) was "torn" and replaced
    whole, the user's bytes deleted: `tokenizer extend` replaces its earlier output without a flag."""
    from mspretrain.errors import UserError
    from mspretrain.outputs import OutputDir

    out = tmp_path / "out"
    with OutputDir(out, "tokenizer extend", overwrite=True) as tmp:
        (tmp / "tokenizer.json").write_text("{}")
    (out / "tokenizer.json").write_text('{"edited": "by the user"}')
    before = state(tmp_path)
    with pytest.raises(UserError, match="changed it after it was written"):
        OutputDir(out, "tokenizer extend", overwrite=overwrite)
    assert state(tmp_path) == before


