"""A two-node Ray cluster for `prepare --ray`: `ray_env`, `ray_cluster` (a module fixture: a test
module takes it with `from tests.helpers.ray import ray_cluster`), `run_local`, `run_prepare`,
`same_files`."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

RAY_START_SECONDS = 90  # a node's `ray start` on a busy 2-core box


def ray_env() -> dict:
    # the nodes' worker processes import this tree's mspretrain, as the driver does
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray 2.60 turns token authentication on at the head when ~/.ray/auth_token exists
            # (left by any earlier `ray get-auth-token --generate`), while a node started without
            # RAY_AUTH_MODE=token does not send it and cannot join: one mode for every process here
            "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def ray_cluster():
    """HOST:PORT of a Ray head (0 CPUs) with one worker node (1 CPU), both killed at the end.
    A module fixture: a test module takes it with `from tests.helpers.ray import ray_cluster`."""
    import tempfile
    import time

    import ray  # noqa: F401  a pinned test dependency (pyproject [test]): missing must fail, not skip

    from mspretrain.parallel.distributed import free_local_port

    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    tmp = tempfile.mkdtemp(prefix="msr-", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    port = free_local_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--node-ip-address=127.0.0.1", "--object-store-memory=80000000", "--disable-usage-stats"]
    procs: list[subprocess.Popen] = []

    def start(args: list[str], name: str) -> None:
        log = open(Path(tmp) / f"{name}.log", "wb")
        procs.append(subprocess.Popen([ray_bin, "start", *args, *common], stdout=log, stderr=subprocess.STDOUT,
                                      env=ray_env(), start_new_session=True))  # its own group: killed whole below

    def started(name: str) -> bool:  # `ray start` prints this once its node has joined
        return "Ray runtime started" in (Path(tmp) / f"{name}.log").read_text(errors="replace")

    def nodes_up() -> bool:
        try:  # a `ray status` slow on a loaded box is "not yet": RAY_START_SECONDS bounds the wait
            out = subprocess.run([ray_bin, "status", f"--address={address}"], capture_output=True, text=True, env=ray_env(),
                                 timeout=max(1.0, min(30.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            return False
        return out.stdout.count(" node_") >= 2

    try:
        # both at once: the worker node waits for the head's GCS by itself
        start(["--head", f"--port={port}", "--num-cpus=0", f"--temp-dir={tmp}/t", "--include-dashboard=false"], "head")
        start([f"--address={address}", "--num-cpus=1"], "worker")
        deadline = time.time() + RAY_START_SECONDS
        while not (started("head") and started("worker") and nodes_up()):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                logs = "\n".join((Path(tmp) / f"{n}.log").read_text(errors="replace")[-2000:] for n in ("head", "worker"))
                raise AssertionError(f"the Ray cluster did not come up with 2 nodes in {RAY_START_SECONDS} s:\n{logs}")
            time.sleep(0.5)
        yield address
    finally:
        for p in reversed(procs):  # SIGTERM lets `ray start --block` stop its node; SIGKILL whatever is left
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 3
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def run_local(corpus: Path, out: Path, *extra: str) -> None:
    """`prepare` without --ray, in this process (no Ray in it)."""
    from mspretrain.cli import main

    assert main(["prepare", str(corpus), "--out", str(out), *extra, "--workers", "2", "--quiet",
                 "prepare.min_chars=4", "prepare.valid_fraction=0.1"]) == 0


def run_prepare(corpus: Path, out: Path, *extra: str) -> str:
    """The CLI in a process of its own, as a user runs it (ray.init's state stays out of pytest); its stdout."""
    cmd = [sys.executable, "-m", "mspretrain.cli", "prepare", str(corpus), "--out", str(out), *extra,
           "prepare.min_chars=4", "prepare.valid_fraction=0.1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ray_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""  # Ray's own log lines stay out of prepare's output
    return r.stdout


def same_files(a: Path, b: Path) -> None:
    """Two data dirs hold the same file names, byte for byte."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "train.bin" in names and "manifest.json" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
