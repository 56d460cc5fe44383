"""Checkpoints that cannot lie: corruption is detected, crashes never leave a valid-looking half
checkpoint, a full disk loses nothing, SIGKILL + resume is bit-identical, recover rebuilds state."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mspretrain.checkpoint import store
from mspretrain.cli import main
from tests.conftest import NO_EVAL, ONE_LAYER, REFERENCE_STEPS, TINY

FILES = ("model.safetensors", "optimizer.safetensors", "train_state.json", "data_state.json", "config.toml", "manifest.json")


def _train_cmd(data: Path, run: Path, *over: str) -> list[str]:
    """The reference run's model (one layer) and `over`: these runs resume it or are compared with it."""
    return [sys.executable, "-m", "mspretrain.cli", "train", "--config", str(TINY), "--data", str(data),
            "--run", str(run), "train.log_every=1", NO_EVAL, ONE_LAYER, *over]


def _losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, reference_run) -> Path:
    """A run stopped after step 4 with checkpoints at steps 2 and 4: cut from the session's
    reference run (no training of its own; copies of the same numbers, minus the later steps)."""
    run = tmp_path_factory.mktemp("ck") / "run"
    shutil.copytree(reference_run, run)
    for step, ckpt in store.list_checkpoints(run):
        if step not in (2, 4):
            shutil.rmtree(ckpt)
    (run / "metrics.jsonl").write_text("".join(l + "\n" for l in (run / "metrics.jsonl").read_text().splitlines()
                                               if json.loads(l).get("step", 0) <= 4))
    assert [s for s, _ in store.list_checkpoints(run)] == [2, 4]
    return run


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete"])
def test_corrupt_newest_checkpoint_falls_back(four_steps, tmp_path, damage):
    for name in FILES:
        run = tmp_path / f"{damage}-{name}"
        shutil.copytree(four_steps, run)
        f = run / "checkpoints" / "step_000004" / name
        if damage == "delete":
            f.unlink()
        elif damage == "truncate":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        else:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x01
            f.write_bytes(bytes(data))
        lines: list[str] = []
        chosen = store.latest_verified(run, log=lines.append)
        assert chosen is not None and chosen.name == "step_000002", (damage, name)
        assert len(lines) == 1 and lines[0].startswith("checkpoint step_000004 is corrupt:") and "using step_000002" in lines[0], lines


def test_tmp_dir_is_ignored_and_cleaned(four_steps, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    half = run / "checkpoints" / "step_000006.tmp"
    shutil.copytree(run / "checkpoints" / "step_000004", half)
    assert [s for s, _ in store.list_checkpoints(run)] == [2, 4]
    store.clean_tmp_dirs(run, log=lambda s: None)
    assert not half.exists()


def test_disk_full_keeps_previous_checkpoint(four_steps, tmp_path, tiny_data):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    limit = (run / "checkpoints" / "step_000004" / "model.safetensors").stat().st_size + 1024  # optimizer file is ~2x

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG as an OSError instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(_train_cmd(tiny_data, run, "train.max_steps=6", "checkpoint.every=2", "checkpoint.async_save=false"),
                          capture_output=True, text=True, preexec_fn=small_files, timeout=300,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})  # no .pyc cut at the file-size limit
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert err[0].startswith("error: checkpoint save failed") and "Traceback" not in proc.stderr
    assert [s for s, _ in store.list_checkpoints(run)] == [2, 4]
    assert store.verify(run / "checkpoints" / "step_000004") is None
    assert not list((run / "checkpoints").glob("*.tmp"))


def _run_until_killed(cmd: list[str], run: Path, kill_at: int, during_save: bool, env: dict) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            if proc.poll() is not None:  # a held save never ends on its own: the run failed
                pytest.fail(f"the run exited ({proc.returncode}) before the kill point")
            if during_save:
                if list((run / "checkpoints").glob(f"step_{kill_at:06d}.tmp")) if (run / "checkpoints").is_dir() else []:
                    break
            elif (run / "metrics.jsonl").is_file() and max(_losses(run) or {0: 0}) >= kill_at:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the run never reached the kill point")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.sigkill
@pytest.mark.slow
@pytest.mark.parametrize("trial", ["random_step", "during_save"])
def test_sigkill_and_resume_is_bit_identical(tmp_path, tiny_data, reference_run, trial):
    # the session's reference run has the same numerics (it only keeps more checkpoints)
    over = (f"train.max_steps={REFERENCE_STEPS}", "checkpoint.every=1", "checkpoint.keep_last=2")
    env = {**os.environ, "GLOG_v": "3"}
    ref = reference_run
    run = tmp_path / "crash"
    rng = np.random.default_rng(zlib.crc32(trial.encode()))
    kill_at = int(rng.integers(3, 7))
    # A save held open mid-write until the kill (store._fault_delay): during_save holds step
    # kill_at's, so the poller cannot miss its .tmp; random_step holds the last step's, so that
    # however late the poller's kill comes on a loaded machine, the run cannot have finished (and
    # published step 8) first. Where the kill lands between step kill_at and the end stays open.
    held = kill_at if trial == "during_save" else REFERENCE_STEPS
    env["MSPRETRAIN_FAULT_SAVE_DELAY"] = f"600@{held}"
    _run_until_killed(_train_cmd(tiny_data, run, *over), run, kill_at, trial == "during_save", env)
    if trial == "during_save":
        assert (run / "checkpoints" / f"step_{kill_at:06d}.tmp").exists()  # the kill hit a half-written save
    had_checkpoint = store.latest_verified(run, log=lambda s: None) is not None
    # A kill before the first save would make a from-scratch rerun pass everything below as
    # "resumed": the kill point is after several steps, so a checkpoint must have been published.
    published = store.latest_verified(run, log=lambda s: None)
    assert published is not None, f"no checkpoint was published before the kill at step {kill_at}"
    published_step = int(json.loads((published / "train_state.json").read_text())["step"])
    # The poller sees step kill_at in metrics.jsonl and then sends the kill; the run keeps going
    # meanwhile and may publish a later step first, but never the last (its save is held open).
    assert 1 <= published_step < REFERENCE_STEPS and published.name == f"step_{published_step:06d}", (kill_at, published_step)
    resumed = subprocess.run(_train_cmd(tiny_data, run, *over), capture_output=True, text=True, timeout=300,
                             env={**os.environ, "GLOG_v": "3"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert ("resumed from step_" in resumed.stdout) == had_checkpoint
    assert f"resumed from {published.name}: step {published_step}," in resumed.stdout, resumed.stdout[-2000:]
    a = load_file(str(ref / "checkpoints" / "step_000008" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_000008" / "model.safetensors"))
    assert _losses(ref) == _losses(run), (kill_at, _losses(ref), _losses(run))  # the whole series, incl. after the resume
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, (kill_at, differ)
    assert not list((run / "checkpoints").glob("*.tmp"))


@pytest.mark.slow  # two training runs of its own (66 s at load ~3)
def test_recover_rebuilds_deleted_train_state(tmp_path, tiny_data, capsys):
    run = tmp_path / "run"
    base = ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
            "precision.dtype=fp16", "precision.init_scale=1024", "precision.growth_interval=2", "checkpoint.every=2", NO_EVAL]
    assert main(base + ["train.max_steps=4"]) == 0
    ckpt = run / "checkpoints" / "step_000004"
    saved = json.loads((ckpt / "train_state.json").read_text())
    saved_data = json.loads((ckpt / "data_state.json").read_text())
    (ckpt / "train_state.json").unlink()
    (ckpt / "data_state.json").unlink()
    assert store.verify(ckpt) is not None
    assert main(["recover", str(run)]) == 0
    out = capsys.readouterr().out
    assert "rebuilt train_state.json: step 4" in out and "rebuilt data_state.json" in out
    assert store.verify(ckpt) is None
    rebuilt = json.loads((ckpt / "train_state.json").read_text())
    assert rebuilt["step"] == saved["step"] and rebuilt["tokens_seen"] == saved["tokens_seen"]
    assert rebuilt["loss_scale"]["scale"] == saved["loss_scale"]["scale"]
    assert json.loads((ckpt / "data_state.json").read_text()) == saved_data  # position, micro-batch and world
    assert main(base + ["train.max_steps=6"]) == 0
    log = (run / "train.log").read_text()
    assert f"resumed from step_000004: step 4, {saved['tokens_seen']:,} tokens seen, loss scale {saved['loss_scale']['scale']:g}" in log
    assert sorted(_losses(run)) == [1, 2, 3, 4, 5, 6]
