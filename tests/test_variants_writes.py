"""Issue 33, round 2: variants of "a refused command touches nothing", "no command overwrites what
it did not write", "multi-file outputs are a set" and "forensics never certify what they cannot see"
that the first round's tests did not cover (found by attacking every writing command).

Each refusal is checked with a checksum of the whole tree around it: names, bytes, modes and
modification times, lock files included (a dir that is not a run must not even get a lock file).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from mspretrain.cli import main
from tests.conftest import TINY
from tests.test_safety import refused


def state(d: Path) -> dict[str, tuple]:
    """Every entry under `d`: mode, size, mtime and (files) sha256; symlinks by their target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(d):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if p.is_symlink():
                what = "->" + os.readlink(p)
            elif p.is_file():
                what = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                what = "dir"
            out[str(p.relative_to(d))] = (st.st_mode, st.st_size if p.is_file() else 0, st.st_mtime_ns, what)
    return out


def _not_runs(root: Path, tiny_data: Path) -> dict[str, Path]:
    """Directories that are not run dirs, each with a file `train` would have replaced."""
    data = root / "data"
    shutil.copytree(tiny_data, data)
    hf = root / "hf"  # an HF folder: its own tokenizer.model, which train replaced with the data's
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (hf / "tokenizer.model").write_bytes(b"someone else's tokenizer")
    ckpt = root / "step_000004"  # a checkpoint dir (of another run) named as --run
    ckpt.mkdir()
    for name in ("manifest.json", "model.safetensors", "config.toml", "train_state.json"):
        (ckpt / name).write_text("x")
    mine = root / "mine"  # a user's folder with their own config.toml and notes
    mine.mkdir()
    (mine / "config.toml").write_text("# my notes on the config\n")
    (mine / "notes.txt").write_text("mine")
    checkpoints = root / "checkpoints"  # a run's checkpoints/ dir named as --run
    (checkpoints / "step_000002").mkdir(parents=True)
    (root / "data-link").symlink_to(data)
    return {"data dir": data, "HF folder": hf, "checkpoint": ckpt, "user folder": mine, "checkpoints/": checkpoints,
            "symlink to a data dir": root / "data-link"}


@pytest.mark.parametrize("kind", ["data dir", "HF folder", "checkpoint", "user folder", "checkpoints/", "symlink to a data dir"])
def test_train_refuses_a_run_dir_that_is_not_one(tiny_data, tmp_path, capsys, kind):
    """`train --run X` on a dir of other files replaced its config.toml and tokenizer.model (an HF
    folder's tokenizer by the data's, a user's config.toml) and added checkpoints: refused now,
    before the lock file, so nothing in it changes."""
    root = tmp_path / "w"
    root.mkdir()
    target = _not_runs(root, tiny_data)[kind]
    before = state(root)
    err = refused(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", target, "--quiet", "train.max_steps=2",
                  "schedule.warmup_steps=1")
    assert "is not a run dir" in err
    assert state(root) == before


@pytest.mark.parametrize("kind", ["data dir", "HF folder", "checkpoint"])
def test_recover_on_a_dir_that_is_not_a_run_leaves_no_lock_file(tiny_data, tmp_path, capsys, kind):
    root = tmp_path / "w"
    root.mkdir()
    target = _not_runs(root, tiny_data)[kind]
    before = state(root)
    refused(capsys, "recover", target)
    assert state(root) == before


def test_a_run_dir_with_files_of_the_users_still_resumes_and_a_dir_with_only_a_config_is_a_new_run(tmp_path):
    """The refusal does not catch real runs: a run dir (run_meta.json) may hold the user's notes;
    a dir holding only names `train` writes (a config placed there first) is a new run."""
    from mspretrain.checkpoint.lock import foreign_entries

    run = tmp_path / "run"
    run.mkdir()
    (run / "run_meta.json").write_text("{}")
    (run / "NOTES.md").write_text("mine")
    assert foreign_entries(run) == []
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(TINY, fresh / "config.toml")
    (fresh / "checkpoints.failed-20260101T000000Z").mkdir()
    (fresh / "msrun_log").mkdir()  # `launch` run from the run dir makes its log dir first
    (fresh / ".DS_Store").write_text("x")
    assert foreign_entries(fresh) == []
    (fresh / "model.safetensors").write_text("x")
    assert foreign_entries(fresh) == ["model.safetensors"]


@pytest.mark.parametrize("where", ["default", "new dirs"])
def test_a_refused_report_creates_no_directory(tiny_data, tmp_path, capsys, where):
    """`report DATA_DIR` (not a run) made DATA_DIR/report/, and `--out new/deep/x.html` made
    new/deep/, before refusing: the report is now rendered in memory before anything is written."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    before = state(tmp_path)
    extra = ["--out", tmp_path / "new" / "deep" / "r.html"] if where == "new dirs" else []
    refused(capsys, "report", data, *extra)
    assert state(tmp_path) == before


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


# ----------------------------------------------------------------------------- forensics
def _resign(run: Path, seed: int) -> None:
    """Make run's batches.jsonl what a run with another seed would have written: every session's
    plan seed changed and every step's batch hash recomputed for it (self-consistent, but not
    this run's record: its checkpoints hold the run's own seed)."""
    from mspretrain.data.order import SamplePlan, batch_hash

    lines, plan, g = [], None, 0
    for line in (run / "batches.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "session" in rec:
            p = rec["session"]["plan"]
            p["seed"] = seed
            plan, g = SamplePlan(tuple(p["windows"]), tuple(p["weights"]), seed), rec["session"]["global_batch"]
        elif "step" in rec:
            rec["hash"] = batch_hash(plan.batch(rec["pos"], g))
        lines.append(json.dumps(rec))
    (run / "batches.jsonl").write_text("".join(x + "\n" for x in lines))


def _audit(run: Path):
    from mspretrain.ops.audit import audit_run

    return audit_run(run)


def test_audit_is_not_exact_on_a_batch_record_of_another_run(reference_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    assert _audit(run).exact
    _resign(run, 7)
    a = _audit(run)
    assert not a.exact
    assert any(f.kind == "record" and "data order seed 1234 (the record gives 7)" in f.message for f in a.findings), a.findings


def test_audit_is_not_exact_on_a_checkpoint_of_another_history(reference_run, tmp_path):
    """A checkpoint whose loader state is not where the record says the run was after that step."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    ds_path = run / "checkpoints" / "step_000004" / "data_state.json"
    ds = json.loads(ds_path.read_text())
    ds["seed"] = 7
    ds_path.write_text(json.dumps(ds))
    a = _audit(run)
    assert not a.exact
    assert [(f.step, f.kind) for f in a.findings] == [(4, "record")], a.findings


def test_audit_is_not_exact_on_a_config_or_world_the_record_contradicts(reference_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    cfg = (run / "config.toml").read_text()
    (run / "config.toml").write_text(cfg.replace("seed = 1234", "seed = 7"))
    assert "seed = 7" in (run / "config.toml").read_text()
    assert any("train.seed = 7" in f.message for f in _audit(run).findings)
    (run / "config.toml").write_text(cfg)
    lines = (run / "batches.jsonl").read_text().splitlines()
    at = next(i for i, x in enumerate(lines) if json.loads(x).get("step") == 3)
    rec = json.loads(lines[at])
    rec["world"] = 2
    lines[at] = json.dumps(rec)
    (run / "batches.jsonl").write_text("".join(x + "\n" for x in lines))
    a = _audit(run)
    assert [(f.step, f.kind) for f in a.findings] == [(3, "step")], a.findings


@pytest.mark.slow
def test_a_run_started_again_from_step_0_does_not_append_to_the_old_metrics(reference_run, tiny_data, tmp_path):
    """A run killed before its first checkpoint (here: its checkpoints gone) starts again from step
    0: its metrics.jsonl held the old steps 1..8 followed by the new 1..2. Like a resume, which cuts
    metrics.jsonl back to the checkpoint's step, a start from 0 now cuts it to nothing."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    shutil.rmtree(run / "checkpoints")
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
                 "train.max_steps=2", "schedule.warmup_steps=1"]) == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_prepare_never_deletes_a_dir_of_its_work_dirs_name_that_it_did_not_make(corpus_file, tmp_path, capsys):
    """`prepare --out data` removed `.data.partial/` whatever it held when no journal was beside it
    (the issue's `X.tmp` instance, for prepare's fixed work-dir name). It is deleted now only when
    prepare's mark is in it (written right after prepare makes it) or it is empty."""
    users = tmp_path / ".data.partial"
    users.mkdir()
    (users / "keep.txt").write_text("mine")
    before = state(tmp_path)
    err = refused(capsys, "prepare", corpus_file, "--out", tmp_path / "data", "--config", TINY, "--workers", "1")
    assert "is not a work dir" in err
    assert state(tmp_path) == before
    (users / "keep.txt").unlink()  # an empty one (a kill right after the mkdir) is prepare's to reuse
    assert main(["prepare", str(corpus_file), "--out", str(tmp_path / "data"), "--config", str(TINY), "--workers", "1",
                 "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize("given", ["new", "empty"])
def test_a_refused_replay_leaves_its_out_dir_as_it_was(reference_run, tmp_path, capsys, given):
    """A refusal after replay had copied the starting checkpoint into --out (here: the run's data
    dir is gone) left the copy there: --out is now as it was, absent or empty."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    meta = json.loads((run / "run_meta.json").read_text())
    meta["data_dir"] = str(tmp_path / "gone")
    (run / "run_meta.json").write_text(json.dumps(meta))
    out = tmp_path / "deep" / "scratch" if given == "new" else tmp_path / "scratch"
    if given == "empty":
        out.mkdir()
    before = state(tmp_path)
    refused(capsys, "replay", run, "--from-step", "4", "--steps", "1", "--out", out)
    assert state(tmp_path) == before


@pytest.mark.parametrize("cmd", [["frobnicate"], ["train", "--frob", "1"], ["train", "--config", "c.toml"]])
def test_launch_refuses_a_worker_command_that_cannot_parse_before_msrun_starts(tmp_path, monkeypatch, capsys, cmd):
    """`launch -- frobnicate` started msrun, whose workers all failed with a traceback, and left
    msrun_log/ behind (exit 1). The workers' command is parsed first now: exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    refused(capsys, "launch", "--nproc", "2", "--", *cmd)
    assert list(tmp_path.iterdir()) == []


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


def test_a_refused_demo_prepares_nothing_first(corpus_file, tmp_path, capsys):
    """The demo checked its run dir's config only after preparing the data (minutes, and a new
    data dir left behind by the refusal) when data/ was gone: now before."""
    work = tmp_path / "wd"
    (work / "run").mkdir(parents=True)
    shutil.copy(TINY, work / "run" / "config.toml")  # a run with another config than the demo's
    before = state(tmp_path)
    err = refused(capsys, "demo", "--workdir", work, "--corpus", corpus_file, "--quiet", "prepare.vocab_size=512")
    assert "another config than this demo's" in err
    assert state(tmp_path) == before
