"""A job killed or stopped mid-run: `DEATH_BOUND_S`, `LONG`, `start_launch`, `wait_for_rank`,
`wait_for_beat_after`, `ended_within`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import NO_EVAL, ONE_LAYER, TINY
from tests.helpers.runs import kill_tree

DEATH_BOUND_S = 60  # the job must end this long after a worker is killed or stopped, at most
# a constant lr: a relaunch that lowers max_steps would re-stretch a cosine schedule
LONG = ["train.max_steps=400", "checkpoint.every=2", "checkpoint.keep_last=3", "train.log_every=1", "schedule.kind=constant", NO_EVAL,
        ONE_LAYER]


def start_launch(tmp_path: Path, data: Path, run: Path, *extra: str, launch: tuple[str, ...] = ()) -> subprocess.Popen:
    """A 2-worker `mspretrain launch` of the tiny config, left running (the caller ends it)."""
    from mspretrain.parallel.distributed import free_local_port

    logs = tmp_path / f"logs-{run.name}"
    cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", "2", "--master-port", str(free_local_port()), "--log-dir", str(logs),
           *launch, "--", "train", "--config", str(TINY), "--data", str(data), "--run", str(run), "--quiet", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "GLOG_v": "3"})


def wait_for_rank(run: Path, rank: int, step: int, proc: subprocess.Popen, timeout: float = 600, not_pid: int = 0) -> dict:
    """Rank `rank`'s heartbeat once it has finished `step` steps (and a checkpoint exists); after a
    relaunch, `not_pid` (the old rank's) skips the heartbeat the killed job left behind."""
    import time

    path = run / "heartbeat" / f"rank_{rank:05d}.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            beat = {}
        if beat.get("step", 0) >= step and beat.get("pid") != not_pid and list((run / "checkpoints").glob("step_*[0-9]")):
            return beat
        time.sleep(0.5)
    raise AssertionError(f"rank {rank} did not reach step {step} in {timeout} s")


def wait_for_beat_after(run: Path, rank: int, t0: float, proc: subprocess.Popen, timeout: float = 15) -> None:
    """Until rank `rank` has written a heartbeat after time `t0`."""
    import time

    path = run / "heartbeat" / f"rank_{rank:05d}.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if json.loads(path.read_text()).get("time", 0) > t0:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} wrote no heartbeat in the {timeout} s after the stop")


def ended_within(proc: subprocess.Popen, t0: float) -> tuple[str, float]:
    """The job's stderr once it has ended, and the seconds since `t0` (at most DEATH_BOUND_S + 30)."""
    import time

    try:
        _, err = proc.communicate(timeout=DEATH_BOUND_S + 30)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"the job still ran {DEATH_BOUND_S + 30} s after the signal") from None
    return err, time.time() - t0


def signal_rank(proc: subprocess.Popen, pid: int, sig: int) -> tuple[str, float]:
    """Send `sig` to rank process `pid` of the job `proc` and wait for the job to end: (its stderr,
    the seconds it took, `ended_within`). The job is killed whole if it is still running after that."""
    import time

    try:
        t0 = time.time()
        os.kill(pid, sig)
        return ended_within(proc, t0)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
