"""The launch watchdog: end an msrun job whose rank died or stopped, and say which rank, where.

What msrun 2.10 does on its own (measured on CPU, 2 workers, mspretrain train):
- a worker SIGKILLed: msrun's join loop (parallel/cluster/process_entity/_api.py, `join_processes`,
  polls every 1 s) sees the exit code -9, SIGKILLs the other local workers, then waits for the
  scheduler, which gives up on the dead node after its heartbeat timeout: the job ended 32 s
  after the kill, with "Worker process PID exit with exception. Error code: -9" and msrun's own
  RuntimeError traceback — a pid, not a rank or a step.
- a worker SIGSTOPped: nothing exits; the scheduler times the silent node out ("The node: 1 is
  timed out", cluster/topology/meta_server_node.cc, MS_NODE_TIMEOUT) and the job ended 38 s after
  the stop, with the timeout in scheduler.log only.
- another node's msrun (multi-node) only learns of it through its own workers' failures.

The watchdog reads the ranks' heartbeat files (monitor/heartbeat.py) and /proc, every 0.5 s:
- a rank whose process is gone (or a zombie) before it wrote "done" died;
- a rank whose process has been stopped (state T) for `stop_grace_s` is stopped;
- a rank on another host whose heartbeat is older than `stale_s` while others still beat is silent
  (its writer thread beats every 2 s even while the step waits in a collective).
It then kills the whole local job (msrun, its scheduler and workers) and reports
"rank R died/stopped at step S (phase P)". Heartbeats of an earlier job in the same run dir
(a relaunch) are ignored: only those started after this launch count.
"""
from __future__ import annotations

import math
import os
import select
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mspretrain.monitor.ranks import STALE_S, process_state, rank_states

STOP_GRACE_S = 5.0
POLL_S = 0.5


@dataclass
class Verdict:
    rank: int
    what: str  # "died", "failed", "stopped", "went silent"
    step: int
    phase: str
    detail: str

    def message(self) -> str:
        return f"rank {self.rank} {self.what} at step {self.step} (phase {self.phase}): {self.detail}"


VERDICT_FILE = "watchdog.json"  # in RUN_DIR/heartbeat/, next to the ranks' files


def record_verdict(run_dir: str | Path, verdict: Verdict) -> None:
    """Leave the verdict in the run dir before the job is killed: afterwards every process is
    gone, and `diagnose --hang` could no longer tell the rank that stopped from those ended with it."""
    import json

    from mspretrain.monitor.heartbeat import HEARTBEAT_DIR, write_atomic

    d = Path(run_dir) / HEARTBEAT_DIR
    d.mkdir(parents=True, exist_ok=True)
    write_atomic(d / VERDICT_FILE, json.dumps({**asdict(verdict), "message": verdict.message(), "time": time.time()}))


def read_verdict(run_dir: str | Path) -> dict | None:

    from mspretrain.errors import UserError
    from mspretrain.fsutil import read_json_file
    from mspretrain.monitor.heartbeat import HEARTBEAT_DIR

    path = Path(run_dir) / HEARTBEAT_DIR / VERDICT_FILE
    if not path.exists():
        return None
    try:
        verdict = read_json_file(path, "watchdog verdict", cap=1 << 16)
    except UserError:
        return None
    return verdict if isinstance(verdict, dict) else None


class Watchdog:
    """Decides from heartbeats whether the job must end. `check()` is pure apart from the clock
    and `probe`, so tests drive it with written heartbeat files and a fake probe."""

    def __init__(self, run_dir: str | Path, *, since: float, stale_s: float = STALE_S,
                 stop_grace_s: float = STOP_GRACE_S, probe=process_state) -> None:
        self.run_dir, self.since, self.stale_s, self.stop_grace_s = Path(run_dir), since, stale_s, stop_grace_s
        self.probe = probe
        self._stopped_since: dict[int, float] = {}
        self._gone_since: dict[int, float] = {}
        # Exit evidence: a pidfd per local rank process (Linux >= 5.3). `watch_exits` blocks on
        # them, so the order in which ranks exit is seen as it happens, not at the next poll: when
        # rank 1 is killed during a save and msrun kills rank 0 a moment later, both can be gone
        # by the next poll, and the ages of their last heartbeats (written every 2 s) cannot tell
        # which went first.
        self._pidfds: dict[int, tuple[int, int]] = {}  # rank -> (pid, fd)
        self._exit_seq: dict[int, int] = {}  # rank -> order of its exit (equal: seen in one wake-up)
        self._seq = 0

    def _track(self, rank: int, pid: int) -> None:
        if rank in self._pidfds and self._pidfds[rank][0] == pid or pid <= 0 or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        old = self._pidfds.pop(rank, None)
        if old is not None:
            os.close(old[1])
        self._pidfds[rank] = (pid, fd)

    def watch_exits(self, timeout: float) -> None:
        """Wait up to `timeout` seconds, noting the order in which the tracked rank processes exit."""
        deadline = time.monotonic() + timeout
        while True:
            live = {fd: rank for rank, (_, fd) in self._pidfds.items() if rank not in self._exit_seq}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if not live:
                time.sleep(remaining)
                return
            ready, _, _ = select.select(list(live), [], [], remaining)
            for fd in ready:
                self._exit_seq[live[fd]] = self._seq
            if ready:
                self._seq += 1

    def close(self) -> None:
        for _, fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

    def check(self, now: float | None = None) -> Verdict | None:
        now = time.time() if now is None else now
        states = rank_states(self.run_dir, now=now, stale_s=self.stale_s, probe=self.probe, since=self.since)
        # The first to die is the cause; msrun then kills the other local workers within a second,
        # and those must not be named instead: ranks are ordered by when this watchdog first saw
        # them gone (it polls twice as often as msrun), then by the age of their last heartbeat.
        for r in states:
            if r.status in ("dead", "failed"):
                self._gone_since.setdefault(r.rank, now)
            elif r.process in ("running", "stopped"):
                self._track(r.rank, r.pid)
        # earliest exit first by the pidfd evidence, then by when a poll first saw it gone, then
        # by the age of the last heartbeat
        gone = sorted((r for r in states if r.status in ("dead", "failed")),
                      key=lambda r: (self._exit_seq.get(r.rank, math.inf), self._gone_since[r.rank], -r.age_s))
        if gone:
            r = gone[0]
            if r.status == "failed":
                return Verdict(r.rank, "failed", r.step, r.phase, "it stopped on an error (its worker log has it)")
            return Verdict(r.rank, "died", r.step, r.phase, f"its process {r.pid} on {r.host} is gone (killed, or the OOM killer); "
                           f"step and phase as of its last heartbeat")
        for r in states:
            if r.status != "stopped":
                self._stopped_since.pop(r.rank, None)
                continue
            first = self._stopped_since.setdefault(r.rank, now)
            if now - first >= self.stop_grace_s:
                return Verdict(r.rank, "stopped", r.step, r.phase,
                               f"its process {r.pid} on {r.host} has been stopped (SIGSTOP or a debugger) for {now - first:.0f} s")
        silent = [r for r in states if r.status == "stale"]
        if silent:
            r = silent[0]
            return Verdict(r.rank, "went silent", r.step, r.phase,
                           f"no heartbeat from {r.host} (process {r.pid}) for {r.age_s:.0f} s while the other ranks still beat")
        return None


def descendants(pid: int) -> list[int]:
    """The process ids below `pid` (children first), from /proc: msrun puts each worker in its own
    process group, so killing msrun's group alone would leave them running."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it (a stopped process dies of SIGKILL too)."""
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class JobProcesses:
    """Every process below msrun, each held by a pidfd from the poll that first saw it, so that
    the job's end can wait until all of them have exited.

    Why: msrun ends a job whose worker died by SIGKILLing the other workers' groups without
    waiting for them (`kill_worker_processes` in parallel/cluster/process_entity/_api.py), and
    the watchdog's `kill_tree` does not wait either: a process exits some time after SIGKILL
    (when it leaves the kernel), and one no longer below msrun (msrun gone first) was not
    killed at all. Until it has exited it holds the run dir's lock: seen in make test, where the
    one-process resume right after a TP 2 job whose rank 1 was SIGKILLed was refused with "run
    dir ... is in use by PID" (rank 0's). A pidfd names one process, not a PID number, so a PID
    reused meanwhile is never signalled."""

    def __init__(self, root: int) -> None:
        self.root = root
        self._fds: dict[int, int] = {}  # pid -> pidfd

    def note(self) -> None:
        """Take a pidfd of each process below `root` not seen before (cheap: one walk of /proc)."""
        if not hasattr(os, "pidfd_open"):
            return
        for pid in descendants(self.root):
            if pid not in self._fds:
                try:
                    self._fds[pid] = os.pidfd_open(pid)
                except OSError:  # exited between the walk and here
                    pass

    def end(self, grace_s: float, wait_s: float) -> list[int]:
        """Let them exit on their own for up to `grace_s` (after a SIGTERM a worker saves first),
        SIGKILL those still alive, wait up to `wait_s` until every one has exited (its files, the
        run dir's lock among them, closed) and close the pidfds; returns the PIDs still alive."""
        live = {fd: pid for pid, fd in self._fds.items()}
        _wait_exits(live, grace_s)
        for fd in live:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
        _wait_exits(live, wait_s)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        return sorted(live.values())


def _wait_exits(live: dict[int, int], wait_s: float) -> None:
    """Drop from `live` (pidfd -> pid) each process that exits within `wait_s` (0: those gone now)."""
    deadline = time.monotonic() + wait_s
    while live:
        ready, _, _ = select.select(list(live), [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            live.pop(fd)
        if time.monotonic() >= deadline:
            return
