"""Supervising an msrun job for `mspretrain launch` (the argument parsing and the checks before
msrun starts stay in commands/launch.py).

- `supervise`: runs msrun; with a run dir, the watchdog (launcher/watchdog.py) watches the ranks'
  heartbeats and processes and ends the whole job when one dies or stops; a SIGTERM or SIGHUP to
  launch is passed on to msrun and every worker, which save and stop; launch returns only once
  every process of the job has exited.
- `wait_for_master`: node ranks > 0 probe node 0's scheduler before msrun waits on it silently.
- `train_run_dir`: which run dir a `train` command's heartbeats are in.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def wait_for_master(addr: str, port: int, wait_s: float, log=print) -> None:
    """Node ranks > 0: msrun on them waits for node 0's scheduler forever, silently. Probe its
    address first (a TCP connect, closed at once), say what is awaited, and give up after `wait_s`
    with one line naming the address and port."""
    import socket

    from mspretrain.errors import UserError

    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, max(0.1, wait_s))):
                return
        except OSError as e:
            reason = e.strerror or str(e)
        if time.monotonic() >= deadline:
            raise UserError(f"node 0 is not listening at {addr}:{port} after {wait_s:g} s ({reason})",
                            f"start node 0 first (--node-rank 0 --master-addr {addr} --master-port {port}), check the "
                            "address, port and firewall, or wait longer with --master-wait S")
        if not said:
            log(f"waiting up to {wait_s:g} s for node 0 at {addr}:{port} ...", flush=True)
            said = True
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def train_run_dir(cmd: list[str]) -> Path | None:
    """The --run dir of a `train` command (where the heartbeats are), None for other commands."""
    if not cmd or cmd[0] != "train":
        return None
    for i, a in enumerate(cmd):
        if a == "--run" and i + 1 < len(cmd):
            return Path(cmd[i + 1])
        if a.startswith("--run="):
            return Path(a.split("=", 1)[1])
    return None


TERM_GRACE_S = 60.0  # a worker's SIGTERM handler writes a checkpoint before it stops
JOB_END_WAIT_S = 30.0  # for the job's processes to exit once SIGKILLed


class _Terminated(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def supervise(argv: list[str], env: dict[str, str], run_dir: Path | None, stale_s: float, stop_grace_s: float):
    """Run msrun; with a run dir, watch the ranks and end the job when one dies or stops.
    Returns (msrun's exit code, the watchdog's verdict or None)."""
    from mspretrain.launcher.watchdog import POLL_S, JobProcesses, Watchdog, descendants, kill_tree, record_verdict

    since = time.time()
    proc = subprocess.Popen(argv, env=env)
    dog = Watchdog(run_dir, since=since, stale_s=stale_s, stop_grace_s=stop_grace_s) if run_dir is not None else None
    job = JobProcesses(proc.pid)
    grace_until = 0.0  # after a SIGTERM: until when the workers may still save before they are killed

    def on_term(signum: int, _frame: object) -> None:
        raise _Terminated(signum)

    # a SIGTERM (or SIGHUP) to launch used to end launch alone, leaving msrun and its workers running
    old = {s: signal.signal(s, on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            job.note()
            if dog is None:
                try:
                    return proc.wait(timeout=POLL_S), None
                except subprocess.TimeoutExpired:
                    pass
            else:
                dog.watch_exits(POLL_S)  # blocks on the ranks' exits: their order names the culprit
                if proc.poll() is not None:
                    return proc.returncode, None
            verdict = dog.check() if dog is not None else None
            if verdict is not None:
                try:
                    record_verdict(run_dir, verdict)
                except OSError:
                    pass  # a full disk must not keep the job alive; the message below still names the rank
                kill_tree(proc.pid)
                proc.wait(timeout=60)
                return proc.returncode, verdict
    except _Terminated as t:  # pass the signal on to msrun and every worker (each in its own group),
        # which save and stop as on a Ctrl-C; whatever is still alive after the grace period is killed
        name = signal.Signals(t.signum).name
        print(f"launch got {name}: sending it to msrun and its workers", file=sys.stderr, flush=True)
        job.note()  # msrun still alive: its workers are still below it
        grace_until = time.monotonic() + TERM_GRACE_S
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait(timeout=10)
        return 128 + t.signum, None  # the workers msrun left behind: `job.end` below
    except KeyboardInterrupt:  # msrun got the Ctrl-C too and stops its workers; give it a moment
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if dog is not None:
            dog.close()
        # Whatever path ended msrun, launch returns only once every process of the job has exited
        # (launcher/watchdog.py JobProcesses: msrun does not wait for the workers it kills), so the
        # next command on the run dir never meets a rank still holding its lock.
        left = job.end(grace_s=max(0.0, grace_until - time.monotonic()), wait_s=JOB_END_WAIT_S)
        if left:
            print(f"warning: process(es) {', '.join(map(str, left))} of the job still exist {JOB_END_WAIT_S:g} s after "
                  f"SIGKILL (stuck in the kernel?); check them before relaunching", file=sys.stderr, flush=True)
