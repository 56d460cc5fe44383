"""The launcher: the watchdog names the rank that exited first by exit evidence
(pidfds), not by poll order or heartbeat age; node ranks > 0 wait for node 0 a bounded time with
one line naming the address; a SIGTERM to `launch` reaches msrun and every worker."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mspretrain.errors import UserError
from mspretrain.monitor.ranks import process_state


def _beat(run: Path, rank: int, pid: int, age: float) -> None:
    d = run / "heartbeat"
    d.mkdir(parents=True, exist_ok=True)
    now = time.time()
    rec = {"rank": rank, "world": 2, "step": 5, "phase": "save", "collectives": 30, "collectives_per_step": 6, "pid": pid,
           "host": socket.gethostname(), "time": now - age, "phase_since": now - age, "started": now - 100}
    (d / f"rank_{rank:05d}.json").write_text(json.dumps(rec))


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")
def test_watchdog_names_the_rank_that_exited_first_whatever_the_poll_order(tmp_path):
    """Rank 1 is killed during a save, rank 0 (whose last heartbeat is OLDER) a moment later, both
    before the watchdog's next poll: the heartbeat ages point at rank 0; the exit order names 1."""
    from mspretrain.launcher.watchdog import Watchdog

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        _beat(tmp_path, 0, procs[0].pid, age=1.9)
        _beat(tmp_path, 1, procs[1].pid, age=0.1)
        dog = Watchdog(tmp_path, since=time.time() - 600)
        assert dog.check() is None  # both running: their pidfds are taken
        # Each kill is awaited until the process has exited (a zombie, not reaped): a process
        # not scheduled within watch_exits' 0.3 s on a loaded box exited together with the next
        # one, and their order was then the heartbeat ages' (rank 0 first).
        procs[1].kill()
        _until_exited(procs[1].pid)
        dog.watch_exits(0.3)
        procs[0].kill()
        _until_exited(procs[0].pid)
        dog.watch_exits(0.3)
        v = dog.check()
        assert (v.rank, v.what) == (1, "died"), v
        dog.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def _until_exited(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while process_state(pid) not in ("zombie", "dead"):
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout} s after SIGKILL"
        time.sleep(0.01)


def test_node_rank_1_without_node_0_fails_in_bounded_time(tiny_data, capsys):
    from mspretrain.cli import main
    from mspretrain.launcher.supervise import wait_for_master

    # A port bound here and never listened on: connecting is refused, and no other process (a
    # Ray node, an msrun scheduler of the other test lane) can take it meanwhile, as it could
    # a port found free and then closed.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(UserError, match=f"node 0 is not listening at 127.0.0.1:{port} after 1 s"):
        wait_for_master("127.0.0.1", port, 1.0, log=lambda *a, **k: None)
    assert time.monotonic() - t0 < 10
    code = main(["launch", "--nproc", "1", "--nodes", "2", "--node-rank", "1", "--master-port", str(port),
                 "--master-wait", "0.5", "--", "train", "--data", str(tiny_data), "--run", "r", "train.max_steps=5"])
    err = capsys.readouterr().err
    if "msrun is not installed" not in err:
        assert code == 2 and f"127.0.0.1:{port}" in err and err.count("\n") == 2, err
    with socket.socket() as srv:  # node 0 listening: no wait
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        wait_for_master("127.0.0.1", srv.getsockname()[1], 1.0, log=lambda *a, **k: None)
    closed.close()


def test_sigterm_to_launch_ends_msrun_and_its_workers(tmp_path):
    """A stand-in for msrun that starts a worker in its own session (as msrun does) and sleeps."""
    from mspretrain.launcher.supervise import supervise

    pidfile = tmp_path / "worker.pid"
    fake = (f"import subprocess, time; p = subprocess.Popen(['sleep', '120'], start_new_session=True); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    before = signal.getsignal(signal.SIGTERM)
    done = threading.Event()

    def term_once_started() -> None:
        # once the worker exists and supervise's handler is in place: a fixed 1.5 s timer could
        # fire before a slow-starting stand-in had started its worker (no pidfile to read below)
        while not done.wait(0.02):
            if pidfile.is_file() and pidfile.read_text() and signal.getsignal(signal.SIGTERM) is not before:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    timer = threading.Thread(target=term_once_started, daemon=True)
    timer.start()
    t0 = time.monotonic()
    try:
        code, verdict = supervise([sys.executable, "-c", fake], dict(os.environ), None, 20.0, 5.0)
    finally:
        done.set()
        timer.join(timeout=10)
    assert code == 128 + signal.SIGTERM and verdict is None
    assert time.monotonic() - t0 < 30
    worker = int(pidfile.read_text())
    for _ in range(50):
        if process_state(worker) in ("dead", "zombie"):
            break
        time.sleep(0.1)
    assert process_state(worker) in ("dead", "zombie")
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler was restored


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")
def test_launch_returns_only_once_every_worker_has_exited_and_released_the_run_dir(tmp_path):
    """msrun ends a failed job by SIGKILLing the other workers without waiting for them; a worker
    still exiting when launch returned held the run dir's lock, and the relaunch was refused (seen
    in a TP 2 kill test). A stand-in msrun starts a worker that takes the run dir's lock, in its
    own session as msrun's are, and exits 1 leaving it running: when supervise returns the worker
    has exited and the lock is free."""
    from mspretrain.checkpoint import lock
    from mspretrain.launcher.supervise import supervise

    run, pidfile = tmp_path / "run", tmp_path / "worker.pid"
    worker = (f"import os, time; from mspretrain.checkpoint.lock import acquire; acquire({str(run)!r}, 'train'); "
              f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    fake = (f"import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True)\n"
            f"while not os.path.getsize({str(pidfile)!r}) if os.path.exists({str(pidfile)!r}) else True: time.sleep(0.05)\n"
            f"time.sleep(1.5); sys.exit(1)")  # polled by supervise meanwhile (every 0.5 s)
    code, verdict = supervise([sys.executable, "-c", fake], dict(os.environ), None, 20.0, 5.0)
    assert code == 1 and verdict is None
    assert process_state(int(pidfile.read_text())) in ("dead", "zombie")
    lock.acquire(run, "train", log=pytest.fail)
    lock.release(run)


def test_launch_refuses_a_pool_larger_than_the_npus_before_msrun_starts(tiny_data, tmp_path, monkeypatch, capsys):
    """On a 32 GB 910B4 every rank would set the 58 GB pool and fail at its first large
    allocation; launch reads the HBM (npu-smi, monkeypatched here) first and refuses in one line."""
    from mspretrain import device
    from mspretrain.cli import main
    from mspretrain.commands import launch
    from tests.conftest import TINY

    monkeypatch.setattr(device, "npu_hbm_bytes", lambda npu=0, **kw: 32 * 2**30)
    monkeypatch.setattr(shutil, "which", lambda name, **kw: f"/opt/venv/bin/{name}")  # msrun is never run here
    monkeypatch.setattr(launch, "supervise", lambda *a, **kw: pytest.fail("msrun started"))
    logs = tmp_path / "logs"
    argv = ["launch", "--nproc", "8", "--log-dir", str(logs), "--", "train", "--config", str(TINY), "--data", str(tiny_data),
            "--run", str(tmp_path / "run")]
    assert main([*argv, "device.target=ascend"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device.max_device_memory 58 GB does not fit this NPU's 32.0 GB") and err.count("\n") == 2
    assert "hint: set device.max_device_memory=26 (GB)" in err and "Traceback" not in err
    assert not logs.exists()
    # the pool the hint names passes the check (and msrun would start)
    started = []
    monkeypatch.setattr(launch, "supervise", lambda *a, **kw: started.append(a) or (0, None))
    assert main([*argv, "device.target=ascend", "device.max_device_memory=26"]) == 0 and started


@pytest.mark.parametrize("user", [None, "300"])
def test_launch_exports_the_plans_hccl_buffsize_on_ascend(tiny_data, tmp_path, monkeypatch, capsys, user):
    """A collective larger than HCCL_BUFFSIZE (200 MB by default) may run slower (CANN);
    launch exports the plan's size for a train on Ascend, and keeps a value the user exported."""
    from mspretrain import device
    from mspretrain.cli import main
    from mspretrain.commands import launch
    from mspretrain.config import schema as cfgmod
    from mspretrain.preflight.plan import make_plan
    from tests.conftest import TINY

    monkeypatch.setattr(device, "npu_hbm_bytes", lambda npu=0, **kw: 64 * 2**30)
    monkeypatch.setattr(shutil, "which", lambda name, **kw: f"/opt/venv/bin/{name}")
    envs = []
    monkeypatch.setattr(launch, "supervise", lambda argv, env, *a: envs.append(env) or (0, None))
    if user:
        monkeypatch.setenv("HCCL_BUFFSIZE", user)
    else:
        monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    # a model whose embedding alone is 500 MB: split over the ranks, it crosses in one collective
    big = ["device.target=ascend", "model.vocab_size=32000", "model.dim=4096", "model.n_heads=32", "model.n_layers=1",
           "optim.shard_optimizer=true", "optim.shard_gradients=true"]
    argv = ["launch", "--nproc", "2", "--nodes", "2", "--node-rank", "0", "--log-dir", str(tmp_path / "logs"), "--", "train",
            "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / "run"), *big]
    assert main(argv) == 0
    out = capsys.readouterr().out
    plan = make_plan(cfgmod.load(TINY, big + ["train.max_steps=0"]), devices=4, tokens=None, data_dir=None,
                     tokens_per_s_per_device=None, target="ascend", nodes_ranks=2)
    want = plan["hccl"]["buffsize_mb"]
    assert plan["hccl"]["nodes"] == 2 and 200 < want <= 1024  # across servers: the whole collective
    assert envs[0]["HCCL_BUFFSIZE"] == (user or str(want))
    assert f"HCCL_BUFFSIZE={user or want} ({'yours; ' if user else ''}the plan's: {want} MB" in out
    # a CPU run: nothing exported
    envs.clear()
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    assert main([*argv[:-len(big)], *[b for b in big if not b.startswith("device.")], "device.target=cpu"]) == 0
    assert "HCCL_BUFFSIZE" not in envs[0] and "HCCL_BUFFSIZE" not in capsys.readouterr().out
