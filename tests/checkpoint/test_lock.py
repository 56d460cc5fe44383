"""One writer per run dir and no silent restart over damaged checkpoints.

The lock test uses two real processes: a `mspretrain train` subprocess holds the run dir, a second
trainer and `recover` are refused naming its PID and host, and after the holder is SIGKILLed
(no clean-up code runs) the next trainer starts and finishes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mspretrain.checkpoint import lock
from mspretrain.cli import main
from tests.conftest import NO_EVAL, ONE_LAYER, ROOT, TINY


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "hint:"))]
    assert [ln.split(":")[0] for ln in lines] == ["error", "hint"], err
    assert "Traceback" not in err
    return err


def _wait_for_holder(run: Path, proc: subprocess.Popen, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    path = run / lock.LOCK_NAME
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "holder exited"
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
            if info.get("pid") == proc.pid and (run / "metrics.jsonl").is_file():
                return info
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError("the holder never took the lock")


@pytest.mark.sigkill
def test_second_trainer_and_recover_refused_until_the_holder_is_killed(tmp_path, tiny_data, capsys):
    run = tmp_path / "run"
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=str(ROOT))
    holder = subprocess.Popen(
        [sys.executable, "-m", "mspretrain.cli", "train", "--config", str(TINY), "--data", str(tiny_data),
         "--run", str(run), "--quiet", "train.max_steps=100000", "checkpoint.every=0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        info = _wait_for_holder(run, holder)
        assert info["host"] == socket.gethostname()
        # a second trainer on the same --run: refused, naming the holder; nothing of it written
        before = (run / "config.toml").read_bytes()
        assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
                     "train.max_steps=2", "model.n_layers=1"]) == 2
        err = _one_error(capsys)
        assert f"PID {holder.pid}" in err and socket.gethostname() in err
        assert (run / "config.toml").read_bytes() == before
        # recover rewrites manifests: refused too
        assert main(["recover", str(run)]) == 2
        assert f"PID {holder.pid}" in _one_error(capsys)
    finally:
        holder.send_signal(signal.SIGKILL)  # no handler, no clean-up: only the kernel drops the lock
        holder.wait(timeout=30)
    # the stale lock file is still there, with the dead PID in it, and blocks nothing
    assert json.loads((run / lock.LOCK_NAME).read_text())["pid"] == holder.pid
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
                 "train.max_steps=2", "schedule.warmup_steps=1", "checkpoint.every=0", NO_EVAL]) == 0
    assert json.loads((run / lock.LOCK_NAME).read_text())["pid"] == os.getpid()


def test_lock_is_per_run_dir_and_reentrant_in_one_process(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    lock.acquire(a, "test")
    lock.acquire(a, "test")  # same process: one writer, not refused
    lock.acquire(b, "test")
    # another process cannot take a, can take a third dir
    code = ("import sys; from mspretrain.checkpoint import lock; from mspretrain.errors import UserError\n"
            "try:\n lock.acquire(sys.argv[1], 'x')\nexcept UserError as e:\n print(e.cause); sys.exit(3)\n"
            "lock.acquire(sys.argv[2], 'x')")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code, str(a), str(tmp_path / "c")], env=env, capture_output=True, text=True)
    assert r.returncode == 3 and f"PID {os.getpid()}" in r.stdout
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c"), str(tmp_path / "d")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lock.release(a)
    r = subprocess.run([sys.executable, "-c", code, str(a), str(tmp_path / "e")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lock.release(b)


@pytest.mark.parametrize("make", ["file", "parent_file", "read_only"])
def test_run_dir_that_cannot_be_one_is_refused(tmp_path, tiny_data, capsys, make):
    if make == "file":
        run = tmp_path / "run"
        run.write_text("not a dir")
    elif make == "parent_file":
        (tmp_path / "f").write_text("x")
        run = tmp_path / "f" / "run"
    else:
        if os.geteuid() == 0:
            pytest.skip("root ignores directory permissions")
        run = tmp_path / "ro"
        run.mkdir()
        run.chmod(0o500)
    try:
        assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
                     "train.max_steps=1"]) == 2
        _one_error(capsys)
    finally:
        if make == "read_only":
            run.chmod(0o700)
    if make == "file":
        assert run.read_text() == "not a dir"


@pytest.mark.parametrize("damage", ["flip_model_byte", "delete_manifest", "truncate_train_state"])
def test_every_checkpoint_unverifiable_refuses_then_restart_moves_them_aside(tmp_path, reference_run, tiny_data, capsys, damage):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    ckpts = sorted((run / "checkpoints").iterdir())
    for d in ckpts:
        if damage == "flip_model_byte":
            p = d / "model.safetensors"
            b = bytearray(p.read_bytes())
            b[-5] ^= 0x40
            p.write_bytes(bytes(b))
        elif damage == "delete_manifest":
            (d / "manifest.json").unlink()
        else:
            p = d / "train_state.json"
            p.write_bytes(p.read_bytes()[:-3])
    snapshot = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name not in (lock.LOCK_NAME, "train.log")}
    log_before = (run / "train.log").read_bytes()
    args = ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet", "train.max_steps=2",
            "schedule.warmup_steps=1", "checkpoint.every=0", ONE_LAYER]  # the reference run's model
    assert main(args) == 2
    err = _one_error(capsys)
    assert f"mspretrain recover {run}" in err and "--restart" in err
    # nothing was touched: not the checkpoints, not the metrics (train.log only grows)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name not in (lock.LOCK_NAME, "train.log")} == snapshot
    assert (run / "train.log").read_bytes().startswith(log_before)
    if damage != "flip_model_byte":
        return  # one --restart run is enough (each costs a compile)
    old_metrics = (run / "metrics.jsonl").read_bytes()
    assert main(args + ["--restart"]) == 0
    aside = [p for p in run.iterdir() if p.name.startswith("checkpoints.failed-")]
    assert len(aside) == 1
    assert sorted(p.name for p in aside[0].iterdir()) == sorted([d.name for d in ckpts] + ["metrics.jsonl"])
    assert (aside[0] / "metrics.jsonl").read_bytes() == old_metrics
    moved = [f for f in snapshot if f.parent.parent == run / "checkpoints"]
    assert moved
    for f in moved:  # moved byte for byte, damage included: recover can still work on them
        assert (aside[0] / f.parent.name / f.name).read_bytes() == snapshot[f]
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
